import json

import pytest

from ecru.cli import main


def test_run_writes_the_result_json(tmp_path, capsys):
    out = tmp_path / "run.json"
    argv = ["lifelong", "run", "--tasks", "2", "--method", "seqlora", "--train-per-intent", "1", "--test-per-intent", "1",
            "--heldout-per-class", "1", "--reference-size", "8", "--batch-size", "16", "--epochs", "1",
            "--checkpoint-dir", str(tmp_path / "ckpt"), "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    got = json.loads(out.read_text())
    assert {"R", "R0", "metrics", "heldout", "cost", "agnostic", "gated"} <= set(got)
    assert {"last", "avg", "transfer_retention", "heldout_change"} <= set(got["agnostic"]) & set(got["gated"])
    assert len(got["R"]) == 2 and len(got["heldout"]) == 3
    assert got["tasks"] == ["banking", "credit_cards"] and got["config"]["stream"]["tasks"] == 2
    assert "seqlora: task-agnostic last" in capsys.readouterr().out
    assert (tmp_path / "ckpt" / "last.safetensors").is_file()


def test_bad_arguments_fail_cleanly(capsys):
    assert main(["lifelong", "run", "--tasks", "11", "--method", "zeroshot"]) == 2
    assert "tasks must be in 1..10" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["lifelong", "run", "--method", "nope"])
    assert exc.value.code == 2


def test_cli_method_choices_match_the_registry():
    from ecru.lifelong import METHODS
    from ecru.lifelong.cli import METHOD_NAMES, OLD_NAMES
    from ecru.lifelong.methods import ALIASES

    assert sorted(METHOD_NAMES) == sorted(METHODS) and sorted(OLD_NAMES) == sorted(ALIASES)
