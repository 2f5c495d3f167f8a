"""Length labels on the continuous-batching engine: greedy labels are the lengths of Hugging Face
`generate`'s answers, sampled ones are reproducible from their seeds."""

from ecru.serve.labels import sample_lengths


def test_greedy_labels_are_the_reference_answers_lengths(model, prompts, gen, reference, max_new):
    lengths = sample_lengths(model, prompts, gen=gen, samples=1, max_new_tokens=max_new, batch_size=5)
    assert lengths == [[len(r)] for r in reference]


def test_sampled_labels_follow_their_seeds(model, prompts, gen, reference, max_new):
    first = sample_lengths(model, prompts[:8], gen=gen, samples=3, max_new_tokens=max_new, batch_size=4)
    again = sample_lengths(model, prompts[:8], gen=gen, samples=3, max_new_tokens=max_new, batch_size=4)
    assert first == again
    assert [row[0] for row in first] == [len(r) for r in reference[:8]]  # sample 0 is greedy
    assert any(row[1:] != [row[0]] * 2 for row in first)  # the others are sampled (T = 0.3, 0.5)
    assert all(1 <= n <= max_new for row in first for n in row)
