"""The parameter server: host updates overlap the backward of the blocks below, and stay synchronised."""

from __future__ import annotations

import copy
import functools
import threading
import time

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
    engine = L2L.from_sequential(seq, loss_fn=nn.MSELoss(), optimizer=factory, config=L2LConfig(micro_batch_size=2))
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
    engine = L2L.from_sequential(model, loss_fn=nn.MSELoss(), optimizer=functools.partial(torch.optim.SGD, lr=0.1),
                                 config=L2LConfig(compute_dtype="bfloat16"))
    before = copy.deepcopy(model.state_dict())
    engine.step((torch.randn(3, 4), torch.randn(3, 1)))
    for g in engine.store.groups[1:]:
        for view, p in zip(g.views(g.wire), g.params, strict=True):
            torch.testing.assert_close(view, p.detach().to(torch.bfloat16), atol=0, rtol=0)
    assert not torch.equal(model[0].weight, before["0.weight"])


def test_float32_on_cpu_binds_the_masters_without_copies():
    params = [nn.Parameter(torch.randn(3, 3)), nn.Parameter(torch.randn(3))]
    store = ParameterStore([[], params], optimizer=functools.partial(torch.optim.SGD, lr=1.0),
                           device=torch.device("cpu"), dtype=torch.float32)
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
