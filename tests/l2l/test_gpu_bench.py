"""bench/l2l_gpu.py, the prepared GPU command: without CUDA it refuses in one line, and `--device cpu` runs
every section (parity, timing, LoRA with the base read in place, a real model folder) at toy sizes."""

import json

import pytest
import torch

from tests.bench_scripts import load_bench_script


@pytest.fixture(scope="module")
def bench():
    return load_bench_script("l2l_gpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_without_a_gpu_it_says_so_and_fails(bench, capsys):
    assert bench.main([]) == 1
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_the_cpu_smoke_run_passes_every_section(bench, tmp_path):
    out = tmp_path / "gpu.json"
    assert bench.main(["--device", "cpu", "--json", str(out), "--work", str(tmp_path)]) == 0
    result = json.loads(out.read_text())
    assert result["parity"]["ok"] and result["real_model"]["ok"] and result["lora_in_place"]["ok"]
    lora = result["lora_in_place"]
    assert lora["max_abs_adapter_diff"] <= 1e-4
    assert lora["store_mb"] <= lora["trainable_state_mb"] + 0.5  # no copy of the frozen base
    assert len(lora["l2l_in_place"]["losses"]) == len(lora["plain_peft"]["losses"]) == 2
    assert lora["l2l_in_place"]["losses"] == pytest.approx(lora["plain_peft"]["losses"], rel=1e-5)
    assert result["model"] == "tiny" and result["timing"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpu.json"]  # model folder and store removed
