"""CUDA paths (streams, pinned wire copies, device slots, host stash): run only where a GPU exists."""

from __future__ import annotations

import copy
import functools

import pytest
import torch

from ecru.l2l import L2L, L2LConfig
from ecru.models import tiny_gpt2, tiny_llama

from .helpers import GradRecorder, lm_batch, named_grads, reference_step
from .test_dropout import MICRO, same_masks_reference_grads

pytestmark = pytest.mark.gpu
SGD = functools.partial(torch.optim.SGD, lr=0.5, momentum=0.9)


@pytest.mark.parametrize("prefetch", [0, 1, 3])
@pytest.mark.parametrize("stash", ["device", "host"])
def test_cuda_fp32_matches_plain_cpu_training(stash, prefetch):
    torch.backends.cuda.matmul.allow_tf32 = False
    ref = tiny_llama(num_layers=4)
    engine = L2L.from_hf(
        copy.deepcopy(ref),
        optimizer=SGD,
        config=L2LConfig(device="cuda", micro_batch_size=2, stash=stash, prefetch=prefetch),
    )
    opt = SGD(ref.parameters())
    for s in range(3):
        batch = lm_batch(seed=s)
        assert engine.step(batch) == pytest.approx(reference_step(ref, opt, batch), rel=1e-5)
    for name, value in ref.state_dict().items():
        torch.testing.assert_close(engine.state_dict()[name].cpu(), value, atol=1e-5, rtol=1e-4)


def test_cuda_dropout_replays_device_masks():
    """As the CPU test (test_dropout): the recomputing backward must replay the CUDA generator's masks,
    so the gradients equal plain autograd on the device through the same masks, drawn in the same order."""
    torch.backends.cuda.matmul.allow_tf32 = False
    ref = tiny_gpt2(num_layers=3, dropout=0.2).train()
    model = copy.deepcopy(ref)
    batch = lm_batch(seed=3)
    expected = same_masks_reference_grads(ref.cuda(), {k: v.cuda() for k, v in batch.items()}, seed=11)
    log: dict[int, torch.Tensor] = {}
    engine = L2L.from_hf(
        model,
        optimizer=functools.partial(GradRecorder, log=log, lr=0.1),
        config=L2LConfig(device="cuda", micro_batch_size=MICRO),
    )
    torch.manual_seed(11)
    engine.step(batch)
    got = named_grads(model, log)
    for name, grad in expected.items():
        torch.testing.assert_close(got[name].cpu(), grad.cpu(), atol=1e-5, rtol=1e-4, msg=name)
    # the masks matter: without dropout the gradients are far from these
    plain = tiny_gpt2(num_layers=3, dropout=0.2).eval().cuda()
    plain(**{k: v.cuda() for k, v in batch.items()}).loss.backward()
    assert (plain.lm_head.weight.grad.cpu() - got["transformer.wte.weight"]).abs().max() > 1e-3


def test_nccl_collectives_get_cuda_tensors(tmp_path):
    """Data parallel over NCCL (one rank: every collective still runs) refuses CPU tensors: the initial
    broadcast, the target count and loss all-reduces, gradient reductions, ZeRO-1 broadcasts and the
    whole-optimizer-state gather must all hand it CUDA tensors. Training equals the engine without
    data parallel."""
    import torch.distributed as dist

    torch.backends.cuda.matmul.allow_tf32 = False
    base = tiny_llama(num_layers=3)
    plain = L2L.from_hf(
        copy.deepcopy(base), optimizer=SGD, config=L2LConfig(device="cuda", micro_batch_size=2)
    )
    expected = [plain.step(lm_batch(seed=s)) for s in range(2)]
    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        for shard in (False, True):
            engine = L2L.from_hf(
                copy.deepcopy(base),
                optimizer=SGD,
                config=L2LConfig(device="cuda", micro_batch_size=2, shard_optimizer=shard),
            )
            assert engine.comm is not None and engine.comm.device.type == "cuda"
            losses = [engine.step(lm_batch(seed=s)) for s in range(2)]
            assert losses == pytest.approx(expected, rel=1e-5)
            engine.save(tmp_path / f"ckpt{shard}")
            for name, value in plain.state_dict().items():
                torch.testing.assert_close(engine.state_dict()[name], value, atol=1e-5, rtol=1e-4)
            engine.close()
    finally:
        dist.destroy_process_group()


def test_cuda_bf16_close_to_fp32():
    base = tiny_llama(num_layers=3)
    losses = {}
    for dtype in ("float32", "bfloat16"):
        engine = L2L.from_hf(
            copy.deepcopy(base),
            optimizer=functools.partial(torch.optim.AdamW, lr=1e-2),
            config=L2LConfig(device="cuda", micro_batch_size=2, compute_dtype=dtype, stash="host"),
        )
        losses[dtype] = [engine.step(lm_batch(seed=1)) for _ in range(3)]
    assert losses["bfloat16"] == pytest.approx(losses["float32"], rel=1e-2)


@pytest.mark.parametrize("keep", [2, 99])
@pytest.mark.parametrize("prefetch", [0, 1])  # 4 blocks > prefetch + 2 slots: kept blocks' slots get reused
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_kept_graphs_equal_recomputation(keep, prefetch, dtype):
    """Kept graphs hold their own copy of the device weights: the reused slots must not change them."""
    torch.backends.cuda.matmul.allow_tf32 = False
    base = tiny_llama(num_layers=4)
    runs = {}
    for k in (0, keep):
        config = L2LConfig(
            device="cuda",
            micro_batch_size=2,
            compute_dtype=dtype,
            prefetch=prefetch,
            keep_graph_blocks=k,
            stash="host",
        )
        engine = L2L.from_hf(copy.deepcopy(base), optimizer=SGD, config=config)
        runs[k] = ([engine.step(lm_batch(seed=s)) for s in range(3)], engine.state_dict())
    assert runs[keep][0] == pytest.approx(runs[0][0], rel=1e-5)
    for name, value in runs[0][1].items():
        torch.testing.assert_close(runs[keep][1][name], value, atol=1e-5, rtol=1e-4)
