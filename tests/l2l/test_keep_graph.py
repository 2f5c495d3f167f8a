"""`keep_graph_blocks`: the last k blocks keep their forward graph instead of being recomputed; the
training still equals plain PyTorch, and exactly those blocks skip the recomputation."""

from __future__ import annotations

import copy
import functools
from collections import Counter

import pytest
import torch

from ecru.l2l import L2L, L2LConfig, L2LInputError
from ecru.models import tiny_gpt2, tiny_llama

from .helpers import GRAD_TOL, GradRecorder, assert_params_close, lm_batch, named_grads, reference_step
from .test_dropout import same_masks_reference_grads
from .test_parity import MODELS, SGD, sequential_parity

ALL = 99  # more than any fixture's blocks: keeps them all


def count_block_calls(engine: L2L) -> Counter:
    """Forward calls per block index over the engine's life (forward and recompute alike)."""
    calls: Counter = Counter()
    for i, block in enumerate(engine.parts.blocks):
        block.register_forward_hook(lambda *_, i=i: calls.update([i]))
    return calls


def assert_kept_blocks_not_recomputed(
    calls: Counter, *, blocks: int, keep: int, micro: int, steps: int
) -> None:
    """Every block runs once per micro-batch in the forward; only the blocks not kept run again."""
    kept = min(keep, blocks)
    expected = {i: steps * micro * (1 if i >= blocks - kept else 2) for i in range(blocks)}
    assert dict(calls) == expected


@pytest.mark.parametrize("keep", [1, ALL])
@pytest.mark.parametrize("stash", ["device", "host"])
@pytest.mark.parametrize("micro", [1, 2, 3])  # 5 samples: 3 leaves a last micro-batch of 2
@pytest.mark.parametrize("name", list(MODELS))
def test_hf_training_matches_plain(name, micro, stash, keep):
    ref = MODELS[name]()
    model = copy.deepcopy(ref)
    opt = SGD(ref.parameters())
    engine = L2L.from_hf(
        model, optimizer=SGD, config=L2LConfig(micro_batch_size=micro, stash=stash, keep_graph_blocks=keep)
    )
    calls = count_block_calls(engine)
    for step in range(3):
        batch = lm_batch(seed=step)
        expected = reference_step(ref, opt, batch)
        assert engine.step(batch) == pytest.approx(expected, rel=1e-6, abs=0)
    assert_params_close(ref, engine.state_dict())
    assert (ref.lm_head.weight - MODELS[name]().lm_head.weight).abs().max() > 1e-3
    assert_kept_blocks_not_recomputed(
        calls, blocks=len(engine.parts.blocks), keep=keep, micro=-(-5 // micro), steps=3
    )
    assert engine._run is None  # no graph outlives its step


@pytest.mark.parametrize("keep", [1, ALL])
@pytest.mark.parametrize("micro", [1, 2, 3])
def test_gradients_equal_plain_including_tied_embedding(micro, keep):
    ref = tiny_llama(num_layers=3)
    model = copy.deepcopy(ref)
    log: dict[int, torch.Tensor] = {}
    engine = L2L.from_hf(
        model,
        optimizer=functools.partial(GradRecorder, log=log, lr=0.1),
        config=L2LConfig(micro_batch_size=micro, keep_graph_blocks=keep),
    )
    batch = lm_batch(seed=7)
    ref(**batch).loss.backward()
    engine.step(batch)
    got = named_grads(model, log)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    for name, p in ref.named_parameters():
        torch.testing.assert_close(got[name], p.grad, msg=lambda m, n=name: f"{n}: {m}", **GRAD_TOL)


@pytest.mark.parametrize("keep", [1, ALL])
@pytest.mark.parametrize("stash", ["device", "host"])
@pytest.mark.parametrize("micro", [1, 2, 3])
def test_sequential_matches_plain(micro, stash, keep):
    counters: list[Counter] = []
    sequential_parity(
        L2LConfig(micro_batch_size=micro, stash=stash, keep_graph_blocks=keep),
        on_engine=lambda engine: counters.append(count_block_calls(engine)),
    )
    assert_kept_blocks_not_recomputed(counters[0], blocks=5, keep=keep, micro=-(-7 // micro), steps=3)


@pytest.mark.parametrize("keep", [1, 2, ALL])
def test_dropout_kept_graphs_hold_their_masks_and_later_blocks_draw_plain_masks(keep):
    """Kept blocks draw their masks once (in the forward) and the recomputed ones replay theirs: both equal
    autograd through the masks drawn in the engine's order."""
    ref = tiny_gpt2(num_layers=3, dropout=0.2).train()
    model = copy.deepcopy(ref)
    batch = lm_batch(seed=3)
    expected = same_masks_reference_grads(ref, batch, seed=11)
    log: dict[int, torch.Tensor] = {}
    engine = L2L.from_hf(
        model,
        optimizer=functools.partial(GradRecorder, log=log, lr=0.1),
        config=L2LConfig(micro_batch_size=2, keep_graph_blocks=keep),
    )
    torch.manual_seed(11)
    engine.step(batch)
    after = torch.rand(3)
    got = named_grads(model, log)
    for name, grad in expected.items():
        torch.testing.assert_close(got[name], grad, msg=lambda m, n=name: f"{n}: {m}", **GRAD_TOL)
    # the step consumed exactly the forward's random numbers, as without kept graphs
    torch.manual_seed(11)
    with torch.no_grad():
        engine._forward(list(engine.parts.split(batch, 2)))
    torch.testing.assert_close(torch.rand(3), after, atol=0, rtol=0)


def test_low_precision_kept_graphs_equal_recomputation():
    """bfloat16 on the CPU binds copies of the wire weights (not the masters): the kept graph works on
    its own copy and gives bit for bit what the recomputation gives."""
    runs = []
    for keep in (0, 2):
        model = tiny_llama(num_layers=3)
        engine = L2L.from_hf(
            model,
            optimizer=SGD,
            config=L2LConfig(micro_batch_size=2, compute_dtype="bfloat16", keep_graph_blocks=keep),
        )
        losses = [engine.step(lm_batch(seed=s)) for s in range(3)]
        runs.append((losses, engine.state_dict()))
    assert runs[0][0] == runs[1][0]
    for name, value in runs[0][1].items():
        torch.testing.assert_close(runs[1][1][name], value, atol=0, rtol=0, msg=name)


def test_kept_blocks_are_the_last_of_a_dynamic_order():
    model = tiny_llama(num_layers=3)
    engine = L2L.from_hf(model, optimizer=SGD, config=L2LConfig(micro_batch_size=5, keep_graph_blocks=1))
    calls = count_block_calls(engine)
    ref = copy.deepcopy(model)
    engine.step(lm_batch(), blocks=[2, 0])
    assert dict(calls) == {2: 2, 0: 1}  # block 0 runs last, so it is the kept one
    assert torch.equal(
        engine.state_dict()["model.layers.1.mlp.up_proj.weight"], ref.model.layers[1].mlp.up_proj.weight
    )


@pytest.mark.parametrize("bad", [-1, True, 1.5])
def test_bad_keep_graph_blocks(bad):
    with pytest.raises(L2LInputError, match="keep_graph_blocks"):
        L2LConfig(keep_graph_blocks=bad)


def test_keep_graph_blocks_needs_the_ram_store(tmp_path):
    with pytest.raises(L2LInputError, match='store="ram"'):
        L2LConfig(keep_graph_blocks=1, store="disk", store_dir=str(tmp_path))
