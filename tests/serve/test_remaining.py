"""Re-prediction of the remaining length: teacher-forced states equal decode-time states; the probe fits."""

import pytest
import torch

from ecru.serve.predict.remaining import RemainingProbe, answer_states


@torch.no_grad()
def test_answer_states_equal_each_prefix_forward(model, prompts, reference):
    # the state after t answer tokens is what a decode step computes: the last position of prompt + a[:t]
    pairs = [(p, a) for p, a in zip(prompts[:6], reference[:6], strict=True) if len(a) >= 2]
    states = answer_states(model, [p for p, _ in pairs], [a for _, a in pairs], batch_size=4)
    for (p, a), s in zip(pairs, states, strict=True):
        assert s.shape[0] == len(a)
        for t in (0, len(a) // 2, len(a) - 1):
            ids = torch.tensor([p + a[:t]])
            expected = model(input_ids=ids, output_hidden_states=True).hidden_states[-1][0, -1]
            torch.testing.assert_close(s[t], expected, atol=1e-4, rtol=1e-4)


def test_probe_learns_remaining_length_from_states():
    # synthetic answers whose state carries the remaining length in one coordinate, plus noise
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(5, 120, (60,), generator=g).tolist()

    def states_of(n):
        s = torch.randn(n, 8, generator=g) * 0.1
        s[:, 0] = torch.log1p(n - torch.arange(n).float())
        return s

    train = [states_of(n) for n in lengths]
    probe = RemainingProbe(cap=128, lam=1e-3, stride=1).fit(train, lengths)
    test = states_of(100)
    pred = probe.predict(test, torch.arange(100))
    true = (100 - torch.arange(100)).float()
    assert (pred - true).abs().median() < 3
    traj = probe.trajectory(test, every=16)
    assert len(traj) == 7 and traj[0] == pytest.approx(pred[0].item())


def test_probe_predictions_stay_within_what_is_left_of_the_cap():
    probe = RemainingProbe(cap=50)
    probe.w, probe.b = torch.zeros(10), torch.tensor(10.0)  # exp(10): far beyond the cap
    t = torch.tensor([0, 10, 49, 60])
    assert probe.predict(torch.zeros(4, 8), t).tolist() == [50.0, 40.0, 1.0, 1.0]


def test_unfitted_probe_refuses():
    with pytest.raises(RuntimeError, match="fit"):
        RemainingProbe().predict(torch.zeros(1, 4), torch.zeros(1))
