"""`UniqueIds` (one sort of a batch's ids) against plain references: `torch.unique`, a per-sample count loop,
`Tensor.coalesce`."""

import pytest
import torch
from torch import nn

from ecru.cowclip import UniqueIds
from ecru.cowclip.ids import coalesce, per_table


def sample_counts(ids: torch.Tensor) -> dict[int, int]:
    """Samples (rows) containing each id >= 0, by a loop over the samples."""
    counts: dict[int, int] = {}
    for row in ids.reshape(ids.shape[0], -1).tolist():
        for k in {i for i in row if i >= 0}:
            counts[k] = counts.get(k, 0) + 1
    return counts


@pytest.mark.parametrize("shape", [(40,), (40, 1), (40, 6)])
@pytest.mark.parametrize("padding", [False, True])
def test_values_inverse_and_sample_counts(shape, padding):
    gen = torch.Generator().manual_seed(len(shape) + padding)
    ids = torch.randint(0 if not padding else -1, 15, shape, generator=gen)  # repeats inside samples too
    unique = UniqueIds.of(ids)
    flat = ids.reshape(-1)
    assert torch.equal(unique.ids, flat[flat >= 0])
    assert torch.equal(unique.values, torch.unique(flat[flat >= 0]))
    assert torch.equal(unique.values[unique.inverse], unique.ids)
    assert dict(zip(unique.values.tolist(), unique.counts.tolist(), strict=True)) == sample_counts(ids)
    assert torch.equal(UniqueIds.of(ids.int()).counts, unique.counts)


def test_positions_of_rows_in_any_order():
    ids = torch.tensor([[4, 9, -1], [9, 2, 4]])
    unique = UniqueIds.of(ids)
    assert unique.positions(unique.ids) is unique.inverse  # the batch's own order: no search
    rows = torch.tensor([9, 9, 2, 4])
    assert torch.equal(unique.values[unique.positions(rows)], rows)
    with pytest.raises(ValueError, match="not among"):
        unique.positions(torch.tensor([3]))


@pytest.mark.parametrize("multi_hot", [False, True])
def test_coalesce_equals_torch_coalesce(multi_hot):
    """Single-hot (the gradient's rows are the ids in order) and multi-hot through embedding_bag (another
    order, padding left out): the rows and sums of `Tensor.coalesce`."""
    torch.manual_seed(0)
    emb = nn.Embedding(30, 5, sparse=True).double()
    if multi_hot:
        ids = torch.where(torch.rand(64, 4) < 0.3, -1, torch.randint(0, 29, (64, 4)))
        pad = torch.where(ids >= 0, ids, 29)
        out = nn.functional.embedding_bag(pad, emb.weight, mode="mean", padding_idx=29, sparse=True)
    else:
        ids = torch.randint(0, 30, (64, 3))
        out = emb(ids)
    out.pow(2).sum().backward()
    grad = emb.weight.grad
    mine, ref = coalesce(grad, UniqueIds.of(ids)), grad.coalesce()
    assert mine.is_coalesced() and torch.equal(mine.indices(), ref.indices())
    torch.testing.assert_close(mine.values(), ref.values(), rtol=1e-12, atol=0)


def test_per_table_sorts_a_shared_tensor_once():
    a, b = torch.tensor([1, 2, 2]), torch.tensor([0, 5])
    shared = per_table(a, 2)
    assert shared[0] is shared[1] and torch.equal(shared[0].values, torch.tensor([1, 2]))
    given = UniqueIds.of(b)
    assert per_table([a, given], 2)[1] is given
    with pytest.raises(ValueError, match="3 id tensors for 2 tables"):
        per_table([a, a, a], 2)


def test_bad_ids_are_refused():
    with pytest.raises(TypeError, match="integer"):
        UniqueIds.of(torch.tensor([1.0]))
    with pytest.raises(ValueError, match="shape"):
        UniqueIds.of(torch.zeros(2, 2, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="-1 for padding"):
        UniqueIds.of(torch.tensor([3, -2]))
    with pytest.raises(ValueError, match="must lie in"):
        UniqueIds.of(torch.tensor([3, 7])).check(7)
    assert UniqueIds.of(torch.zeros(0, 3, dtype=torch.long)).values.numel() == 0
