"""The step plan (ecru.l2l.plan) on its own: exact orders for small configurations, invariants over a
grid of them, and the engine making exactly the plan's store calls."""

from __future__ import annotations

import functools
import itertools

import pytest
import torch

from ecru.l2l.plan import (
    RESIDENT,
    Backward,
    Begin,
    Collect,
    Evict,
    Fetch,
    Forward,
    Head,
    PlanConfig,
    Prefetch,
    StemBackward,
    StemForward,
    StepAll,
    Synchronize,
    Update,
    step_plan,
)


def test_the_plan_of_three_blocks_two_micro_batches_one_kept_block():
    plan = step_plan(
        PlanConfig(
            blocks=(0, 1, 2),
            micro_batches=2,
            prefetch=1,
            keep_graph_blocks=1,
            trainable=frozenset({0, 1, 2, 3}),
            stem_trains=True,
        )
    )
    assert [p.name for p in plan.phases] == [
        "l2l.forward",
        "l2l.head",
        *["l2l.backward.block"] * 3,
        "l2l.backward.stem",
        "l2l.finish_update",
    ]
    assert plan.ops == (
        Fetch(0), StemForward(0), StemForward(1), Begin("forward", (1, 2, 3)),
        Fetch(1), Prefetch(2), Forward(0, 0), Forward(0, 1), Evict(1),
        Fetch(2), Prefetch(3), Forward(1, 0), Forward(1, 1), Evict(2),
        Fetch(3), Forward(2, 0, keep_graph=True, input_grad=True),
        Forward(2, 1, keep_graph=True, input_grad=True), Evict(3),
        Fetch(0), Head(0), Head(1), Begin("backward", (3, 2, 1)),
        Prefetch(2), Backward(2, 0, True, kept=True), Backward(2, 1, True, kept=True), Evict(3), Update(3),
        Fetch(2), Prefetch(1), Backward(1, 0, True), Backward(1, 1, True), Evict(2), Update(2),
        Fetch(1), Backward(0, 0, True), Backward(0, 1, True), Evict(1), Update(1),
        Fetch(0), StemBackward(0), StemBackward(1), Evict(0), Update(0),
        Synchronize(),
    )  # fmt: skip


def test_after_step_updates_collect_and_step_all_at_the_end_and_a_frozen_stem_runs_no_backward():
    plan = step_plan(
        PlanConfig(
            blocks=(1, 0), micro_batches=1, prefetch=0, update="after_step", trainable=frozenset({1, 2})
        )
    )
    assert plan.ops == (
        Fetch(0), StemForward(0), Begin("forward", (2, 1)),
        Fetch(2), Forward(1, 0), Evict(2),
        Fetch(1), Forward(0, 0), Evict(1),
        Fetch(0), Head(0), Begin("backward", (1, 2)),
        Fetch(1), Backward(0, 0, True), Evict(1), Collect(1),
        Fetch(2), Backward(1, 0, False), Evict(2), Collect(2),
        Evict(0), StepAll(), Synchronize(),
    )  # fmt: skip


def test_bad_settings_are_refused():
    for bad in (
        dict(blocks=(0, 0), micro_batches=1),
        dict(blocks=(0,), micro_batches=0),
        dict(blocks=(0,), micro_batches=1, prefetch=-1),
        dict(blocks=(0,), micro_batches=1, update="sometimes"),
    ):
        with pytest.raises(ValueError):
            PlanConfig(**bad)


GRID = [
    PlanConfig(
        blocks=blocks,
        micro_batches=micro,
        prefetch=prefetch,
        keep_graph_blocks=keep,
        update=update,
        trainable=trainable,
        stem_trains=stem,
    )
    for blocks, micro, prefetch, keep, update, trainable, stem in itertools.product(
        [(), (0,), (0, 1, 2, 3, 4), (3, 0, 2)],
        [1, 3],
        [0, 1, 2, 9],
        [0, 2, 9],
        ["overlapped", "after_step"],
        [frozenset(range(6)), frozenset({2, 4}), frozenset()],
        [True, False],
    )
]


def _uses(op) -> int | None:
    """The group whose fetched weights `op` computes with (None: none, or a kept graph's own)."""
    if isinstance(op, StemForward | Head | StemBackward):
        return RESIDENT
    if isinstance(op, Forward) or (isinstance(op, Backward) and not op.kept):
        return op.block + 1
    return None


def test_invariants_over_a_grid_of_configurations():
    for config in GRID:
        _assert_invariants(config)


def _assert_invariants(config: PlanConfig) -> None:
    ops = step_plan(config).ops
    fetched: set[int] = set()
    live: set[int] = set()  # streamed groups fetched or prefetched and not yet evicted
    last_backward: dict[int, int] = {}
    for pos, op in enumerate(ops):
        if isinstance(op, Fetch | Prefetch):
            live.add(op.group) if op.group != RESIDENT else None
            fetched.add(op.group) if isinstance(op, Fetch) else None
        elif isinstance(op, Evict):
            fetched.discard(op.group)
            live.discard(op.group)
        # each block fetched before use, and not evicted in between
        assert _uses(op) is None or _uses(op) in fetched, f"{config}: {op} at {pos} before its Fetch"
        # prefetch depth respected: the executing block and at most `prefetch` more on the device
        assert len(live) <= config.prefetch + 1, f"{config}: {len(live)} streamed groups live at {pos}"
        if isinstance(op, Backward | StemBackward | Head):
            last_backward[RESIDENT if not isinstance(op, Backward) else op.block + 1] = pos
    _assert_every_micro_batch_runs_once_forward_before_backward(config, ops)
    _assert_updated_once_after_last_backward(config, ops, last_backward)
    _assert_prefetches_are_fetched(ops)
    assert ops[-1] == Synchronize()


def _assert_every_micro_batch_runs_once_forward_before_backward(config: PlanConfig, ops) -> None:
    forward = [(op.block, op.micro) for op in ops if isinstance(op, Forward)]
    backward = [(op.block, op.micro) for op in ops if isinstance(op, Backward)]
    micro = range(config.micro_batches)
    assert forward == [(i, j) for i in config.blocks for j in micro]
    assert backward == [(i, j) for i in reversed(config.blocks) for j in micro]
    kept = {op.block for op in ops if isinstance(op, Forward) and op.keep_graph}
    assert kept == {op.block for op in ops if isinstance(op, Backward) and op.kept}
    assert len(kept) == min(config.keep_graph_blocks, len(config.blocks))
    assert kept == set(config.blocks[len(config.blocks) - len(kept) :])  # the first the backward needs
    stem = [op.micro for op in ops if isinstance(op, StemBackward)]
    assert stem == (list(micro) if config.stem_trains else [])


def _assert_updated_once_after_last_backward(config: PlanConfig, ops, last_backward: dict[int, int]) -> None:
    kind = Update if config.update == "overlapped" else Collect
    other = Collect if kind is Update else Update
    assert not any(isinstance(op, other) for op in ops)
    handed = [(pos, op.group) for pos, op in enumerate(ops) if isinstance(op, kind)]
    groups = [g for _, g in handed]
    step_groups = {RESIDENT} | {i + 1 for i in config.blocks}
    assert sorted(groups) == sorted(config.trainable & step_groups)  # each trainable group exactly once
    for pos, g in handed:
        assert pos > last_backward[g], f"group {g} handed over before its last backward"
        assert Evict(g) in ops[:pos]
    step_all = [pos for pos, op in enumerate(ops) if isinstance(op, StepAll)]
    if config.update == "after_step":
        assert len(step_all) == 1 and all(pos < step_all[0] for pos, _ in handed)
    else:
        assert not step_all


def _assert_prefetches_are_fetched(ops) -> None:
    """Every prefetched group is fetched later in the same phase's direction: no wasted transfer."""
    for pos, op in enumerate(ops):
        if isinstance(op, Prefetch):
            assert Fetch(op.group) in ops[pos + 1 :], f"{op} at {pos} is never fetched"


@pytest.mark.parametrize("keep", [0, 1])
@pytest.mark.parametrize("clip", [None, 1.0])
def test_the_engine_makes_exactly_the_plans_store_calls(monkeypatch, keep, clip):
    from ecru.l2l import L2L, L2LConfig
    from ecru.models import tiny_llama
    from tests.l2l.helpers import lm_batch

    engine = L2L.from_hf(
        tiny_llama(num_layers=3),
        optimizer=functools.partial(torch.optim.SGD, lr=0.1),
        config=L2LConfig(micro_batch_size=2, keep_graph_blocks=keep, max_grad_norm=clip),
    )
    calls: list[tuple] = []
    names = {
        "weights": Fetch, "prefetch": Prefetch, "done_with": Evict, "begin": Begin, "update": Update,
        "collect": Collect, "step_all": StepAll, "synchronize": Synchronize,
    }  # fmt: skip
    for name, op in names.items():
        method = getattr(engine.store, name)

        def record(*args, _op=op, _method=method, **kwargs):
            calls.append(_op(*(tuple(a) if isinstance(a, list) else a for a in args)))
            return _method(*args, **kwargs)

        monkeypatch.setattr(engine.store, name, record)
    engine.step(lm_batch())  # 5 samples: 3 micro-batches
    monkeypatch.undo()
    engine.close()
    plan = engine._plan([0, 1, 2], 3)
    expected = [op for op in plan.ops if type(op) in names.values()]
    assert calls[: len(expected)] == expected
    assert set(calls[len(expected) :]) <= {Synchronize()}  # the store's own waits in end_step
