"""Length labels on the continuous-batching engine: greedy labels are the lengths of Hugging Face
`generate`'s answers, sampled ones are reproducible from their seeds."""

import json

from ecru.cli import main
from ecru.serve.labels import sample_lengths


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
