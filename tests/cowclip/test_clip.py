"""`cowclip` against a per-id reference loop written straight from the paper's pseudo-code."""

import math

import pytest
import torch

from ecru.cowclip import UniqueIds, cowclip, zeta_from_paper


def reference(grad, weight, ids, *, r=1.0, zeta=1e-5, threshold="code"):
    """Loop over ids: cnt = samples containing k; scale row k by min(1, clip / ||g_k||)."""
    out = grad.clone()
    rows = ids.reshape(ids.shape[0], -1).tolist()
    for k in sorted({i for row in rows for i in row if i >= 0}):
        cnt = sum(k in row for row in rows)
        w, g = weight[k].norm().item(), grad[k].norm().item()
        if threshold == "paper":
            clip = cnt * max(r * w, zeta)
        else:
            clip = cnt * r * max(w, r * math.sqrt(weight.shape[1]) * zeta)
        if g > clip:
            out[k] = grad[k] * (clip / g)
    return out


def make(v=50, d=4, seed=0):
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(v, d, generator=gen, dtype=torch.float64) * 0.1
    weight[3] = 0.0  # a zero weight row: threshold falls to zeta
    grad = torch.randn(v, d, generator=gen, dtype=torch.float64) * 0.3
    grad[5] = 0.0  # a zero gradient row stays zero
    return grad, weight


@pytest.mark.parametrize("threshold", ["paper", "code"])
@pytest.mark.parametrize("r,zeta", [(1.0, 1e-5), (0.3, 0.05), (2.0, 1.0)])
def test_single_hot_with_duplicates(threshold, r, zeta):
    grad, weight = make()
    ids = torch.tensor([1, 1, 1, 3, 5, 7, 7, 9, 20, 1, 3])
    lib_zeta = zeta if threshold == "code" else zeta_from_paper(zeta, r=r, dim=weight.shape[1])
    out = cowclip(grad, weight, ids, r=r, zeta=lib_zeta)
    torch.testing.assert_close(
        out, reference(grad, weight, ids, r=r, zeta=zeta, threshold=threshold), rtol=1e-12, atol=0
    )
    assert out.data_ptr() != grad.data_ptr()


def test_multi_hot_padded_counts_samples_not_occurrences():
    grad, weight = make()
    ids = torch.tensor([[1, 1, 2, -1], [2, 4, -1, -1], [1, 2, 4, 6], [-1, -1, -1, -1]])
    unique = UniqueIds.of(ids)
    assert dict(zip(unique.values.tolist(), unique.counts.tolist(), strict=True)) == {1: 2, 2: 3, 4: 2, 6: 1}
    for zeta in (1e-5, 0.2):
        out = cowclip(grad, weight, ids, zeta=zeta)
        torch.testing.assert_close(out, reference(grad, weight, ids, zeta=zeta), rtol=1e-12, atol=0)


def test_absent_rows_unchanged_and_zero_rows_stay_zero():
    grad, weight = make()
    ids = torch.tensor([5, 8, 8, 3])
    out = cowclip(grad, weight, ids, r=0.01, zeta=1e-6)
    absent = torch.ones(50, dtype=torch.bool)
    absent[[3, 5, 8]] = False
    assert torch.equal(out[absent], grad[absent])
    assert torch.equal(out[5], torch.zeros(4, dtype=torch.float64))
    assert out[8].norm() < grad[8].norm()  # small r: the present row is clipped


def test_clipped_row_has_threshold_norm():
    grad, weight = make()
    out = cowclip(grad, weight, torch.tensor([2, 2, 2]), r=0.1)
    expected = 3 * max(0.1 * weight[2].norm().item(), 1e-5)
    assert out[2].norm().item() == pytest.approx(expected, rel=1e-12)


def test_sparse_uncoalesced_input_gives_coalesced_output():
    torch.manual_seed(0)
    emb = torch.nn.Embedding(30, 5, sparse=True).double()
    ids = torch.tensor([[1, 4, 4], [1, 7, -1]]).clamp_min(0)
    ids[1, 2] = 0
    emb(ids).pow(2).sum().backward()
    grad = emb.weight.grad
    assert grad.is_sparse and not grad.is_coalesced()
    out = cowclip(grad, emb.weight.detach(), ids, r=0.2)
    assert out.is_sparse and out.is_coalesced()
    dense_ref = reference(grad.to_dense(), emb.weight.detach(), ids, r=0.2)
    torch.testing.assert_close(out.to_dense(), dense_ref, rtol=1e-12, atol=0)
    torch.testing.assert_close(
        cowclip(grad.to_dense(), emb.weight.detach(), ids, r=0.2), dense_ref, rtol=1e-12, atol=0
    )


def test_random_cases_against_reference():
    gen = torch.Generator().manual_seed(1)
    for trial in range(20):
        v, d = 40, int(torch.randint(1, 9, (), generator=gen))
        weight = torch.randn(v, d, generator=gen, dtype=torch.float64) * 0.05
        grad = torch.randn(v, d, generator=gen, dtype=torch.float64)
        ids = (
            torch.randint(-1, v, (16, 3), generator=gen)
            if trial % 2
            else torch.randint(0, v, (16,), generator=gen)
        )
        out = cowclip(grad, weight, ids, r=0.5, zeta=0.01)
        ref = reference(grad, weight, ids, r=0.5, zeta=0.01)
        torch.testing.assert_close(out, ref, rtol=1e-12, atol=0)


def test_float32_close_to_float64_reference():
    grad, weight = make()
    ids = torch.randint(0, 50, (64,), generator=torch.Generator().manual_seed(2))
    out = cowclip(grad.float(), weight.float(), ids, r=0.5)
    torch.testing.assert_close(out, reference(grad, weight, ids, r=0.5).float(), rtol=1e-5, atol=1e-7)


def test_bad_input_errors():
    grad, weight = make()
    with pytest.raises(ValueError, match="must lie in"):
        cowclip(grad, weight, torch.tensor([50]))
    with pytest.raises(ValueError, match="must both be"):
        cowclip(grad[:, :2], weight, torch.tensor([1]))
    with pytest.raises(TypeError, match="integer"):
        cowclip(grad, weight, torch.tensor([1.0]))
    with pytest.raises(ValueError, match="zeta_from_paper"):  # one form of zeta, named at call sites
        cowclip(grad, weight, torch.tensor([1]), threshold="paper")
