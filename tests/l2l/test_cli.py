"""`ecru l2l train` end to end on the random tiny Llama (byte tokens, CLINC150 utterances)."""

from __future__ import annotations

import json

import pytest
import torch

from ecru.cli import main


def test_train_writes_numbers_checkpoint_and_hf_export(tmp_path, capsys):
    out = tmp_path / "run.json"
    argv = [
        "l2l",
        "train",
        "--model",
        "tiny-llama",
        "--data",
        "clinc",
        "--steps",
        "6",
        "--batch-size",
        "5",
        "--micro-batch-size",
        "2",
        "--stash",
        "host",
        "--lr",
        "3e-3",
        "--save",
        str(tmp_path / "ckpt"),
        "--json",
        str(out),
    ]
    assert main(argv) == 0
    result = json.loads(out.read_text())
    assert result["steps"] == 6 and len(result["losses"]) == 6
    assert result["final_loss"] < result["first_loss"] - 0.3  # it learns the byte statistics
    assert result["tokens_per_s"] > 0 and result["peak_rss_mb"] > 0
    assert (tmp_path / "ckpt" / "l2l_checkpoint.pt").is_file() and (
        tmp_path / "ckpt" / "hf" / "config.json"
    ).is_file()
    assert "tokens/s" in capsys.readouterr().out

    resumed = tmp_path / "resumed.json"
    again = [
        "l2l",
        "train",
        "--model",
        "tiny-llama",
        "--steps",
        "2",
        "--batch-size",
        "5",
        "--micro-batch-size",
        "2",
        "--resume",
        str(tmp_path / "ckpt"),
        "--json",
        str(resumed),
    ]
    assert main(again) == 0
    assert json.loads(resumed.read_text())["steps"] == 2


@pytest.mark.parametrize("bad", [["--micro-batch-size", "0"], ["--steps", "0"]])
def test_bad_arguments_fail_with_one_line(bad, capsys):
    assert main(["l2l", "train", "--model", "tiny-llama", *bad]) == 2
    assert "must be >= 1" in capsys.readouterr().err


def test_train_on_the_disk_tier_resumes_from_its_store_and_exports(tmp_path):
    from transformers import AutoModelForCausalLM

    store, out = tmp_path / "store", tmp_path / "run.json"
    argv = [
        "l2l",
        "train",
        "--model",
        "tiny-llama",
        "--steps",
        "3",
        "--batch-size",
        "4",
        "--micro-batch-size",
        "2",
        "--stash",
        "disk",
        "--store-dir",
        str(store),
        "--save",
        str(tmp_path / "ckpt"),
        "--json",
        str(out),
    ]
    assert main(argv) == 0
    first = json.loads(out.read_text())
    assert first["parameters"] > 0 and (store / "ecru-l2l" / "store" / "manifest.pt").is_file()
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt" / "hf")
    assert all(p.numel() > 0 for p in exported.parameters())  # every block read back for the export
    assert main(argv[:5] + ["1", *argv[6:]]) == 0  # one more step over the same store
    assert torch.load(store / "ecru-l2l" / "store" / "manifest.pt", weights_only=False)["step"] == 4


def test_keep_graph_blocks_flag_trains_the_same_losses(tmp_path):
    runs = {}
    for keep in ("0", "2"):
        out = tmp_path / f"keep{keep}.json"
        argv = [
            "l2l",
            "train",
            "--model",
            "tiny-llama",
            "--steps",
            "3",
            "--batch-size",
            "5",
            "--micro-batch-size",
            "2",
            "--keep-graph-blocks",
            keep,
            "--lr",
            "3e-3",
            "--json",
            str(out),
        ]
        assert main(argv) == 0
        runs[keep] = json.loads(out.read_text())
    assert runs["2"]["keep_graph_blocks"] == 2
    assert runs["2"]["losses"] == pytest.approx(runs["0"]["losses"], rel=1e-6, abs=0)
    assert runs["2"]["losses"][-1] != runs["2"]["losses"][0]


def test_negative_keep_graph_blocks_fails_with_one_line(capsys):
    assert main(["l2l", "train", "--model", "tiny-llama", "--keep-graph-blocks", "-1"]) == 2
    assert "keep_graph_blocks must be an integer >= 0" in capsys.readouterr().err
