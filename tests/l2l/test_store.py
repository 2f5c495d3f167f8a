"""The parameter server: host updates overlap the backward of the blocks below, and stay synchronised."""

from __future__ import annotations

import copy
import functools
import threading
import time

import pytest
import torch
from torch import nn

from ecru.l2l import L2L, L2LConfig, ParameterStore

from .helpers import assert_params_close


class SlowSGD(torch.optim.SGD):
    """SGD that logs which thread steps which block, and takes long enough to expose any missing wait."""

    def __init__(self, params, log: list, **kw):
        super().__init__(params, **kw)
        self.log, self.tag = log, len(log)

    @torch.no_grad()
    def step(self, closure=None):
        self.log.append(("step-start", id(self), threading.current_thread().name))
        time.sleep(0.05)
        out = super().step(closure)
        self.log.append(("step-end", id(self), threading.current_thread().name))
        return out


def _deep_mlp(seed: int = 0, depth: int = 4) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(depth)], nn.Linear(8, 2))


def test_host_update_of_a_block_overlaps_the_backward_below_and_results_match_plain():
    log: list = []
    ref, seq = _deep_mlp(), _deep_mlp()
    for i, block in enumerate(seq):
        block.register_forward_hook(lambda *_, i=i: log.append(("block", i, threading.current_thread().name)))
    factory = functools.partial(SlowSGD, log=log, lr=0.1, momentum=0.9)
    engine = L2L.from_sequential(
        seq, loss_fn=nn.MSELoss(), optimizer=factory, config=L2LConfig(micro_batch_size=2)
    )
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    x, y = torch.randn(6, 8), torch.randn(6, 2)
    for _ in range(3):
        log.clear()
        opt.zero_grad()
        nn.functional.mse_loss(ref(x), y).backward()
        opt.step()
        engine.step((x, y))
        last_block_opt = id(engine.store.groups[len(seq)].optimizer)
        below_recomputed = max(k for k, e in enumerate(log) if e[:2] == ("block", len(seq) - 2))
        top_updated = log.index(("step-end", last_block_opt, "ecru-l2l-optimizer_0"))
        assert below_recomputed < top_updated  # the block below ran while the top one was being updated
        assert {e[2] for e in log if e[0].startswith("step")} == {"ecru-l2l-optimizer_0"}
    assert_params_close(ref, engine.state_dict())


def test_wire_copy_follows_the_masters_after_each_update():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    engine = L2L.from_sequential(
        model,
        loss_fn=nn.MSELoss(),
        optimizer=functools.partial(torch.optim.SGD, lr=0.1),
        config=L2LConfig(compute_dtype="bfloat16"),
    )
    before = copy.deepcopy(model.state_dict())
    engine.step((torch.randn(3, 4), torch.randn(3, 1)))
    for g in engine.store.groups[1:]:
        for view, p in zip(g.views(g.wire), g.params, strict=True):
            torch.testing.assert_close(view, p.detach().to(torch.bfloat16), atol=0, rtol=0)
    assert not torch.equal(model[0].weight, before["0.weight"])


def test_float32_on_cpu_binds_the_masters_without_copies():
    params = [nn.Parameter(torch.randn(3, 3)), nn.Parameter(torch.randn(3))]
    store = ParameterStore(
        [[], params],
        optimizer=functools.partial(torch.optim.SGD, lr=1.0),
        device=torch.device("cpu"),
        dtype=torch.float32,
    )
    weights = store.weights(1)
    assert all(w.data_ptr() == p.data_ptr() for w, p in zip(weights, params, strict=True))
    store.add_grads(1, [torch.ones(3, 3), torch.ones(3)])
    store.add_grads(1, [torch.ones(3, 3), torch.ones(3)])
    expected = [p.detach() - 2 for p in params]
    store.update(1)
    store.synchronize()
    for p, e in zip(params, expected, strict=True):
        torch.testing.assert_close(p.detach(), e, atol=0, rtol=0)
    store.close()


def test_float32_on_cpu_gradients_accumulate_in_the_masters_grad_without_a_copy():
    """The first micro-batch's gradient is taken over (same memory) and the others are added in place, as
    in plain training; after the step no gradient is left on the masters."""
    model = _deep_mlp(depth=2)
    first_grad: dict[int, int] = {}

    def record(p):
        def hook(grad):
            first_grad.setdefault(id(p), grad.data_ptr())

        return hook

    for p in model.parameters():
        p.register_hook(record(p))
    seen: dict[int, int] = {}

    class Recorder(torch.optim.SGD):
        def step(self, closure=None):
            seen.update({id(p): p.grad.data_ptr() for grp in self.param_groups for p in grp["params"]})
            return super().step(closure)

    engine = L2L.from_sequential(
        model,
        loss_fn=nn.MSELoss(),
        optimizer=functools.partial(Recorder, lr=0.1),
        config=L2LConfig(micro_batch_size=2),
    )
    engine.step((torch.randn(6, 8), torch.randn(6, 2)))
    assert seen and seen == {k: first_grad[k] for k in seen}
    assert all(p.grad is None for p in model.parameters())
    engine.close()


class _WithUnused(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.unused = nn.Linear(8, 8), nn.Parameter(torch.ones(3))

    def forward(self, x):
        return torch.tanh(self.lin(x))


def test_a_parameter_the_step_does_not_use_is_left_alone_as_in_plain_training():
    """Plain training gives an unused parameter no gradient, so AdamW skips it (no weight decay either)."""
    torch.manual_seed(0)
    ref = nn.Sequential(_WithUnused(), _WithUnused(), nn.Linear(8, 2))
    seq = copy.deepcopy(ref)
    adamw = functools.partial(torch.optim.AdamW, lr=0.01, weight_decay=0.5)
    engine = L2L.from_sequential(
        seq, loss_fn=nn.MSELoss(), optimizer=adamw, config=L2LConfig(micro_batch_size=2)
    )
    opt = adamw(ref.parameters())
    x, y = torch.randn(5, 8), torch.randn(5, 2)
    for _ in range(3):
        opt.zero_grad()
        nn.functional.mse_loss(ref(x), y).backward()
        opt.step()
        engine.step((x, y))
    assert_params_close(ref, engine.state_dict())
    assert torch.equal(seq[0].unused, torch.ones(3))
    engine.close()


class _FailsInRecompute(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.fail, self.recomputed = nn.Linear(8, 8), False, 0

    def forward(self, x):
        if torch.is_grad_enabled():
            self.recomputed += 1
            if self.fail and self.recomputed == 2:  # after the first micro-batch's gradient has arrived
                raise RuntimeError("boom")
        return torch.tanh(self.lin(x))


def test_a_step_that_fails_mid_backward_leaves_no_gradient_behind():
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(8, 8), _FailsInRecompute(), nn.Linear(8, 2))
    seq = copy.deepcopy(ref)
    sgd = functools.partial(torch.optim.SGD, lr=0.1)  # stateless: the failed step updated the last block
    engine = L2L.from_sequential(
        seq, loss_fn=nn.MSELoss(), optimizer=sgd, config=L2LConfig(micro_batch_size=2)
    )
    x, y = torch.randn(5, 8), torch.randn(5, 2)
    seq[1].fail = True
    try:
        engine.step((x, y))
    except RuntimeError:
        pass
    else:
        raise AssertionError("the step should have failed")
    engine.store.synchronize()  # the last block's update was already submitted when block 1 failed
    assert seq[1].recomputed == 2
    assert all(p.grad is None for p in seq.parameters())
    seq[1].fail = False
    ref.load_state_dict(engine.state_dict())
    opt = sgd(ref.parameters())
    for _ in range(2):
        opt.zero_grad()
        nn.functional.mse_loss(ref(x), y).backward()
        opt.step()
        engine.step((x, y))
    assert_params_close(ref, engine.state_dict())
    engine.close()


def test_with_rollback_a_step_that_fails_mid_backward_changes_nothing(recwarn):
    """The last block was updated before block 1's recompute failed: rollback=True puts it back."""
    torch.manual_seed(0)
    seq = nn.Sequential(nn.Linear(8, 8), _FailsInRecompute(), nn.Linear(8, 2))
    adamw = functools.partial(torch.optim.AdamW, lr=0.1)
    engine = L2L.from_sequential(
        seq, loss_fn=nn.MSELoss(), optimizer=adamw, config=L2LConfig(micro_batch_size=2, rollback=True)
    )
    x, y = torch.randn(5, 8), torch.randn(5, 2)
    engine.step((x, y))
    before = copy.deepcopy(engine.state_dict())
    states = [copy.deepcopy(g.optimizer.state_dict()) for g in engine.store.groups if g.optimizer]
    seq[1].fail, seq[1].recomputed = True, 0
    with pytest.raises(RuntimeError, match="boom"):
        engine.step((x, y))
    for name, value in engine.state_dict().items():
        assert torch.equal(value, before[name]), name
    for g, state in zip([g for g in engine.store.groups if g.optimizer], states, strict=True):
        torch.testing.assert_close(g.optimizer.state_dict()["state"], state["state"], atol=0, rtol=0)
    assert not [w for w in recwarn if "already updated" in str(w.message)]
    seq[1].fail = False
    engine.step((x, y))
    engine.close()


def test_a_step_shows_its_phases_as_profiler_spans():
    """The engine marks its phases with torch.profiler spans, so profiling needs no patching."""
    from torch.profiler import ProfilerActivity, profile

    from ecru.l2l import L2L
    from ecru.models import tiny_llama
    from tests.l2l.helpers import lm_batch

    engine = L2L.from_hf(tiny_llama(num_layers=2), optimizer=functools.partial(torch.optim.SGD, lr=0.1))
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        engine.step(lm_batch())
    engine.close()
    counts = {e.key: e.count for e in prof.key_averages() if e.key.startswith("l2l.")}
    assert counts["l2l.forward"] == counts["l2l.head"] == counts["l2l.backward.stem"] == 1
    assert counts["l2l.backward.block"] == 2 and counts["l2l.finish_update"] == 1
    assert counts["l2l.block.forward"] == counts["l2l.recompute"] > 0
