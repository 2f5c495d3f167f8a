"""`ServedModel`: chat messages need the tokenizer's chat template."""

from types import SimpleNamespace

import pytest

from ecru.serve.engine.models import ServedModel


@pytest.mark.parametrize("template", [None, ""])
def test_chat_messages_to_a_model_without_a_chat_template_are_refused(template):
    served = ServedModel("raw-lm", object(), SimpleNamespace(chat_template=template))
    with pytest.raises(
        ValueError, match="model raw-lm has no chat template: send a raw prompt to /v1/completions"
    ):
        served.encode_chat([{"role": "user", "content": "hi"}])


def test_an_encoder_folder_is_refused_before_serving(tmp_path, capsys):
    """A sentence encoder (BERT) loads as a BertLMHeadModel whose LM head is random: refused in one line naming
    what is missing (it loaded, then failed with an EOS error blamed on --remaining-probe)."""
    from ecru.cli import main
    from ecru.models.minilm import minilm_dir

    prompts, out = tmp_path / "p.jsonl", tmp_path / "out.jsonl"
    prompts.write_text('{"prompt": "hello"}\n')
    assert main(["serve", "run", "--model", str(minilm_dir()), "--in", str(prompts), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert (
        "not a whole causal-LM checkpoint" in err
        and "cls.predictions" in err
        and "remaining-probe" not in err
    )
    assert not out.exists()


def test_a_model_with_no_eos_token_anywhere_is_refused():
    from ecru.serve.engine.static import GenerationConfig

    model = SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=None))
    with pytest.raises(ValueError, match="names an EOS token"):
        GenerationConfig.for_model(model, SimpleNamespace(eos_token_id=None, pad_token_id=None))
    with_list = SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=[7, 3]))
    config = GenerationConfig.for_model(with_list, SimpleNamespace(eos_token_id=3, pad_token_id=None))
    assert config.eos_token_ids == (3, 7) and config.pad_token_id == 3
