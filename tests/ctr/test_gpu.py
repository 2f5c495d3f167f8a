"""The training loop on a CUDA device follows the CPU run (skipped without a GPU)."""

import pytest
import torch

from ecru.ctr import SyntheticConfig, TrainConfig, generate, train


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["full", "sparse"])
def test_cuda_run_matches_cpu(mode):
    tr, te = generate(SyntheticConfig(n_rows=4000, scale=1e-3)).split_random(0.25)
    cfg = dict(batch_size=256, recipe="cowclip", mode=mode, mlp=(16,), progress=False, base_batch=256)
    cpu = train(TrainConfig(**cfg), tr, te)
    gpu = train(TrainConfig(device="cuda", **cfg), tr, te)
    torch.testing.assert_close(torch.tensor(gpu.losses), torch.tensor(cpu.losses), rtol=1e-4, atol=1e-5)
    assert abs(gpu.auc - cpu.auc) < 1e-3
