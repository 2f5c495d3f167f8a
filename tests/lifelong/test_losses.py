import pytest
import torch
import torch.nn.functional as F

from ecru.lifelong.losses import distill_loss, soft_cross_entropy, task_loss


def _emb(*shape):
    return F.normalize(torch.randn(*shape, dtype=torch.float64), dim=-1)


def test_task_loss_matches_cross_entropy():
    torch.manual_seed(0)
    emb, names, labels = _emb(6, 8), _emb(5, 8), torch.tensor([0, 1, 2, 3, 4, 0])
    ref = F.cross_entropy(30 * emb @ names.T, labels, label_smoothing=0.2)
    torch.testing.assert_close(
        task_loss(emb, names, labels, scale=30, label_smoothing=0.2), ref, rtol=1e-12, atol=1e-12
    )
    all_true = torch.ones(6, 5, dtype=torch.bool)
    got = task_loss(emb, names, labels, scale=30, label_smoothing=0.2, candidates=all_true)
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)


def test_candidates_equal_cross_entropy_over_each_rows_subset():
    torch.manual_seed(1)
    emb, names = _emb(2, 8), _emb(5, 8)
    labels = torch.tensor([1, 3])  # row 0 among classes 0..1, row 1 among classes 2..4
    cand = torch.tensor([[1, 1, 0, 0, 0], [0, 0, 1, 1, 1]], dtype=torch.bool)
    logits = 30 * emb @ names.T
    ref = (F.cross_entropy(logits[:1, :2], labels[:1], label_smoothing=0.1)
           + F.cross_entropy(logits[1:, 2:], labels[1:] - 2, label_smoothing=0.1)) / 2  # fmt: skip
    got = task_loss(emb, names, labels, scale=30, label_smoothing=0.1, candidates=cand)
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)


def test_distillation_is_kl_plus_teacher_entropy_in_both_directions():
    torch.manual_seed(2)
    s, t = _emb(4, 8), _emb(4, 8)
    T = 2.0

    def ref(a, b):  # T^2 * (KL(p_t || p_s) + H(p_t)), mean over rows
        p, logq = (a / T).softmax(-1), (b / T).log_softmax(-1)
        kl = F.kl_div(logq, p, reduction="batchmean")
        return T**2 * (kl - (p * p.log()).sum(-1).mean())

    st, tt = 30 * s @ t.T, 30 * t @ t.T
    torch.testing.assert_close(soft_cross_entropy(tt, st, temperature=T), ref(tt, st), rtol=1e-10, atol=1e-10)
    got = distill_loss(s, t, t, scale=30, temperature=T)
    torch.testing.assert_close(got, ref(tt, st) + ref(tt.T, st.T), rtol=1e-10, atol=1e-10)


def test_distillation_is_minimal_when_student_equals_teacher():
    torch.manual_seed(3)
    t = _emb(5, 8)
    s = (t + 0.3 * torch.randn_like(t)).requires_grad_()
    at_teacher = distill_loss(t, t, t, scale=30, temperature=2.0)
    assert distill_loss(s, t, t, scale=30, temperature=2.0) > at_teacher
    assert at_teacher.item() == pytest.approx(distill_loss(t.clone(), t, t, scale=30, temperature=2.0).item())
