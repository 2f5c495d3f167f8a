"""The answer cache: greedy answers equal one-at-a-time generation; a rerun generates nothing new."""

import pytest

from ecru.errors import EcruError
from ecru.serve import GenerationConfig, generate_static
from ecru.serve.prompts import encode_chat
from ecru.serve.responses import generate_responses, read_responses


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
    got = generate_responses(model, tok, prompts, out=out, max_new_tokens=8, order_hint=[3, 1, 2, 0],
                             batch_size=3, progress=False)  # fmt: skip
    gen = GenerationConfig.for_tokenizer(tok)
    for p, ids in zip(prompts, encode_chat(tok, prompts), strict=True):
        assert got[p] == generate_static(model, [ids], max_new_tokens=8, config=gen).tokens[0]
    lines = out.read_text()
    again = generate_responses(model, tok, prompts[:2], out=out, max_new_tokens=8, progress=False)
    assert out.read_text() == lines and again == {p: got[p] for p in prompts[:2]}
    assert read_responses(out, max_new_tokens=16) == {}  # another cap: nothing cached for it


def test_malformed_cache_line_names_the_file(tmp_path):
    bad = tmp_path / "a.jsonl"
    bad.write_text('{"prompt": "x"}\n')
    with pytest.raises(EcruError, match="a.jsonl:1"):
        read_responses(bad, max_new_tokens=8)
