"""Length labels on the continuous-batching engine: greedy labels are the lengths of Hugging Face
`generate`'s answers, sampled ones are reproducible from their seeds. The answer cache: greedy answers
equal one-at-a-time generation; a rerun generates nothing new."""

import json

import pytest

from ecru.cli import main
from ecru.errors import EcruError
from ecru.serve import GenerationConfig, generate_static
from ecru.serve.predict.labels import generate_responses, read_responses, sample_lengths
from ecru.serve.prompts import encode_chat


def test_greedy_labels_are_the_reference_answers_lengths(model, prompts, gen, reference, max_new):
    lengths = sample_lengths(model, prompts, gen=gen, samples=1, max_new_tokens=max_new, batch_size=5)
    assert lengths == [[len(r)] for r in reference]


def test_sampled_labels_follow_their_seeds(model, prompts, gen, reference, max_new):
    first = sample_lengths(model, prompts[:8], gen=gen, samples=3, max_new_tokens=max_new, batch_size=4)
    again = sample_lengths(model, prompts[:8], gen=gen, samples=3, max_new_tokens=max_new, batch_size=8)
    assert first == again  # per-request seeds: the batch's composition does not matter
    assert [row[0] for row in first] == [len(r) for r in reference[:8]]  # sample 0 is greedy
    assert any(row[1:] != [row[0]] * 2 for row in first)  # the others are sampled (T = 0.3, 0.5)
    assert all(1 <= n <= max_new for row in first for n in row)


def test_a_prompt_beyond_the_context_is_one_line_before_any_work(tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "hello"}) + "\n")
    out = tmp_path / "labels.jsonl"
    args = ["serve", "label", "--model", "tiny", "--prompts", str(prompts), "--n", "1", "--samples", "1"]
    assert main([*args, "--max-new-tokens", "600", "--out", str(out)]) == 2  # the tiny model's context: 512
    last = capsys.readouterr().err.strip().splitlines()[-1]  # after the model's loading bar
    assert "512-token context" in last and "--max-new-tokens" in last
    assert not out.exists()


@pytest.fixture(scope="module")
def tiny():
    from transformers import AutoTokenizer

    from ecru.models import cache_dir, load_smollm2, tiny_llama

    path = cache_dir() / "smollm2-135m-instruct"  # the tokenizer alone when cached: no 135M-weight load
    tok = (
        AutoTokenizer.from_pretrained(path)
        if (path / "tokenizer_config.json").is_file()
        else load_smollm2()[1]
    )
    return tiny_llama(vocab_size=len(tok), hidden_size=32, num_layers=2, seed=0).eval(), tok


@pytest.mark.slow  # ~50 s on the shared CPU: loading the tokenizer dominates
def test_answers_cached_and_equal_to_unbatched_greedy(tiny, tmp_path):
    model, tok = tiny
    prompts = ["say hi", "count to three please", "a", "what is a cache"]
    out = tmp_path / "answers.jsonl"
    got = generate_responses(model, tok, prompts, out=out, model_key="tiny", max_new_tokens=8, batch_size=3,
                             progress=False)  # fmt: skip
    gen = GenerationConfig.for_model(model, tok)
    for p, ids in zip(prompts, encode_chat(tok, prompts), strict=True):
        assert got[p] == generate_static(model, [ids], max_new_tokens=8, config=gen).tokens[0]
    lines = out.read_text()
    again = generate_responses(
        model, tok, prompts[:2], out=out, model_key="tiny", max_new_tokens=8, progress=False
    )
    assert out.read_text() == lines and again == {p: got[p] for p in prompts[:2]}
    assert read_responses(out, max_new_tokens=16, model_key="tiny") == {}  # another cap: nothing for it
    assert read_responses(out, max_new_tokens=8, model_key="smollm2") == {}  # another model: nothing either


def test_malformed_cache_line_names_the_file(tmp_path):
    bad = tmp_path / "a.jsonl"
    bad.write_text('{"prompt": "x"}\n')
    with pytest.raises(EcruError, match="a.jsonl:1"):
        read_responses(bad, max_new_tokens=8, model_key="tiny")


def test_labels_end_at_every_eos_the_served_model_ends_at(chat_model_dir, tmp_path):
    """A model whose generation config lists a second EOS (Llama 3, Qwen 2 chat models): labels and greedy
    answers stop where `serve api` stops (they read the tokenizer's EOS alone and ran on to the cap)."""
    from ecru.serve import EngineConfig, SamplingParams, ServedModel
    from ecru.serve.predict.labels import label_prompts

    served = ServedModel.load(str(chat_model_dir), packed=False)
    tok, cap = served.tokenizer, 16
    ids = encode_chat(tok, ["say hi"])[0]

    def answer() -> list[int]:
        engine = served.engine(EngineConfig(max_batch_size=1, max_new_tokens=cap))
        return engine.generate([ids], [SamplingParams(cap)])[0].output

    plain = answer()
    assert len(plain) > 4 and tok.eos_token_id not in plain[:4]
    served.model.generation_config.eos_token_id = [tok.eos_token_id, plain[3]]
    expected = plain[: plain.index(plain[3]) + 1]
    assert answer() == expected
    labels = label_prompts(served.model, tok, ["say hi"], out=tmp_path / "l.jsonl", model_key="x", samples=1,
                           max_new_tokens=cap, progress=False)  # fmt: skip
    assert labels[0].lengths == [len(expected)]
    answers = generate_responses(served.model, tok, ["say hi"], out=tmp_path / "a.jsonl", model_key="x",
                                 max_new_tokens=cap, progress=False)  # fmt: skip
    assert answers["say hi"] == expected
