"""`ecru serve label`, `simulate`, `cost`, `api` and `run` (and the labels feeding bench/serve.py) end to end on
the tiny model (SmolLM2's tokenizer)."""

import json

import pytest

from ecru.cli import main
from tests.cli_helpers import status_and_err as _code


def test_label_then_bench_on_a_prompt_file(tmp_path, capsys, bench_serve):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"tell me about topic {i}"}) + "\n" for i in range(6)))
    labels = tmp_path / "labels.jsonl"
    args = ["serve", "label", "--model", "tiny", "--prompts", str(prompts), "--n", "6", "--samples", "2"]
    assert main([*args, "--max-new-tokens", "6", "--out", str(labels)]) == 0
    rows = [json.loads(line) for line in labels.read_text().splitlines()]
    assert len(rows) == 6 and all(len(r["lengths"]) == 2 and r["max_new_tokens"] == 6 for r in rows)
    assert main([*args, "--max-new-tokens", "6", "--out", str(labels)]) == 0  # cached: nothing appended
    assert len(labels.read_text().splitlines()) == 6

    out = tmp_path / "bench.json"
    code = bench_serve.main(
        [
            "--model",
            "tiny",
            "--prompts",
            str(prompts),
            "--n",
            "5",
            "--max-new-tokens",
            "6",
            "--batch-size",
            "2",
            "--predictor",
            "constant",
            "--labels",
            str(labels),
            "--train-n",
            "6",
            "--repeats",
            "2",
            "--json",
            str(out),
        ]
    )
    result = json.loads(out.read_text())
    assert code == 0 and set(result["policies"]) == {
        "fcfs",
        "sorted",
        "fcr",
        "fcr+vbs",
        "fcr+vbs+bins",
        "oracle",
        "cb",
        "cb-sjf",
        "cb-kv",
        "cb-srpt",
    }
    keys = {
        "samples_per_s",
        "tokens_per_s",
        "effective_token_ratio",
        "failure_ratio",
        "mean_latency_s",
        "p99_latency_s",
        "wall_s",
    }
    for m in result["policies"].values():
        assert keys <= set(m) and m["outputs_match_fcfs"]
        assert len(m["samples_per_s_runs"]) == len(m["speedup_vs_fcfs_runs"]) == 2
    assert result["policies"]["fcfs"]["speedup_vs_fcfs_runs"] == [1.0, 1.0]
    orders = result["setup"]["orders"]
    assert orders[0][0] == "fcfs" and orders[1] == orders[0][1:] + orders[0][:1]
    assert {"name", "mae", "acc50", "acc100", "predict_s"} <= set(result["predictor"])


def test_bad_predicted_len_and_labels_are_one_line_errors_before_any_work(tmp_path, capsys, bench_serve):
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"prompt_len": 3, "output_len": 4, "predicted_len": "soon"}\n')
    assert main(["serve", "simulate", "--trace", str(trace), "--policy", "sorted"]) == 2
    err = capsys.readouterr().err
    assert f"{trace}:1:" in err and "Traceback" not in err
    labels = tmp_path / "labels.jsonl"
    labels.write_text('{"prompt": "x", "lengths": [3], "max_new_tokens": 8}\n{"prompt": "y"}\n')
    args = [
        "--model",
        "tiny",
        "--n",
        "2",
        "--labels",
        str(labels),
        "--predictor",
        "constant",
    ]
    assert bench_serve.main(args) == 2  # before the model is even loaded
    err = capsys.readouterr().err
    assert err.strip().startswith(f"ecru: error: {labels}:2:") and len(err.strip().splitlines()) == 1


def test_simulate_prints_its_json_or_writes_it_to_a_file(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"prompt_len": 3, "output_len": 4, "predicted_len": 4}\n')
    assert main(["serve", "simulate", "--trace", str(trace)]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["policy"] == "fcfs" and printed["useful_tokens"] == 4 and printed["batch_size"] == 16
    assert main(["serve", "simulate", "--trace", str(trace), "--json", str(tmp_path / "o" / "r.json")]) == 0
    assert capsys.readouterr().out.strip() == f"wrote {tmp_path / 'o' / 'r.json'}"
    assert json.loads((tmp_path / "o" / "r.json").read_text()) == printed
    assert main(["serve", "simulate", "--trace", str(trace), "--json", str(tmp_path)]) == 2
    assert "--json" in capsys.readouterr().err


def test_output_folders_are_created_or_refused_before_work(tmp_path, capsys):
    out = tmp_path / "missing" / "dir" / "cost.json"
    assert main(["serve", "cost", "--model", "tiny", "--reps", "1", "--out", str(out)]) == 0
    assert json.loads(out.read_text())["source"].startswith("tiny")
    assert main(["serve", "cost", "--model", "tiny", "--out", str(tmp_path)]) == 2  # a folder, not a file
    assert "is a folder" in capsys.readouterr().err


def test_api_and_run_refuse_bad_arguments_in_one_line(tmp_path, capsys, monkeypatch):
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = str(busy.getsockname()[1])
        assert main(["serve", "api", "--model", "tiny", "--port", port]) == 2  # before the model loads
        assert "cannot listen on 127.0.0.1:" in capsys.readouterr().err
    assert main(["serve", "api", "--model", str(tmp_path / "no-model"), "--port", port]) == 2
    assert "unknown model" in capsys.readouterr().err
    for bad in (["--port", "0"], ["--port", "99999"], ["--port", "65536"], ["--port", "http"],
                ["--max-body-bytes", "0"], ["--max-batch-size", "-1"], ["--policy", "lifo"]):  # fmt: skip
        with pytest.raises(SystemExit) as info:
            main(["serve", "api", *bad])
        assert info.value.code == 2
        assert "Traceback" not in capsys.readouterr().err
    assert main(["serve", "api", "--model", "tiny", "--api-key", " padded "]) == 2  # before the model loads
    assert capsys.readouterr().err.count("\n") == 1
    monkeypatch.setenv("ECRU_API_KEY", "")  # set but empty: not silently open
    assert main(["serve", "api", "--model", "tiny"]) == 2
    assert "ECRU_API_KEY is set but empty" in capsys.readouterr().err
    monkeypatch.delenv("ECRU_API_KEY")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "x"}\n')
    with pytest.raises(SystemExit):
        main(["serve", "run", "--in", str(tmp_path / "missing.jsonl"), "--out", str(tmp_path / "a.jsonl")])
    assert "not found" in capsys.readouterr().err
    assert main(["serve", "run", "--in", str(prompts), "--out", str(tmp_path), "--model", "tiny"]) == 2
    assert "is a folder" in capsys.readouterr().err


def test_prompt_files_refuse_null_and_empty_prompts(tmp_path):
    from ecru.errors import EcruError
    from ecru.serve.prompts import read_jsonl_prompts

    for bad in ('{"prompt": null}', '{"prompt": ""}', '{"prompt": 3}'):
        (tmp_path / "p.jsonl").write_text('{"prompt": "fine"}\n' + bad + "\n")
        with pytest.raises(EcruError, match=r"p.jsonl:2: .*non-empty string"):
            read_jsonl_prompts(tmp_path / "p.jsonl")


def test_undecodable_prompt_and_label_files_are_one_line_errors(tmp_path, capsys, bench_serve):
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b'{"prompt": "hi"}\n{"prompt": "ab\xff"}\n')
    labels = tmp_path / "labels.jsonl"
    labels.write_bytes(b'{"prompt": "x\xfe", "lengths": [3], "max_new_tokens": 8}\n')
    runs = [
        [
            main,
            "serve",
            "label",
            "--model",
            "tiny",
            "--prompts",
            str(bad),
            "--n",
            "2",
            "--out",
            str(tmp_path / "l.jsonl"),
        ],
        [bench_serve.main, "--model", "tiny", "--n", "2", "--labels", str(labels), "--predictor", "constant"],
    ]
    for (run, *args), where in zip(
        runs, (f"{bad}:2: not valid UTF-8 (byte 0xff", f"{labels}:1: "), strict=True
    ):
        assert run(args) == 2
        err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("ecru")]
        assert len(err) == 1 and err[0].startswith(f"ecru: error: {where}"), err


def test_a_broken_model_folder_is_one_line(tmp_path, capsys):
    from ecru.serve.entrypoints.server import free_port

    (tmp_path / "config.json").write_text("{}")  # no weights, no tokenizer
    assert main(["serve", "api", "--model", str(tmp_path), "--port", str(free_port())]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"ecru: error: cannot load the model folder {tmp_path}: ") and "\n" not in err


def test_outputs_never_overwrite_inputs_or_special_files(tmp_path, capsys):
    import os

    prompts = tmp_path / "in.jsonl"
    prompts.write_text('{"id": "b", "prompt": "Say hi"}\r\n{"id": "a", "prompt": "Hello"}\r\n')
    before = prompts.read_bytes()
    run = ["serve", "run", "--model", "tiny", "--in", str(prompts), "--max-new-tokens", "2", "--out"]
    rc, err = _code([*run, str(tmp_path / "sub" / ".." / "in.jsonl")], capsys)
    assert rc == 2 and "would overwrite the input" in err and prompts.read_bytes() == before
    os.mkfifo(tmp_path / "pipe")
    rc, err = _code([*run, str(tmp_path / "pipe")], capsys)
    assert rc == 2 and "not a regular file" in err
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"prompt_len": 3, "output_len": 4, "predicted_len": 4}\n')
    rc, err = _code(["serve", "simulate", "--trace", str(trace), "--json", str(trace)], capsys)
    assert rc == 2 and "would overwrite the input" in err and "output_len" in trace.read_text()
    probe_in = tmp_path / "p" / "probe.json"
    probe_in.parent.mkdir()
    probe_in.write_text(prompts.read_text())
    rc, err = _code(
        ["serve", "probe", "--model", "tiny", "--in", str(probe_in), "--out", str(probe_in.parent)], capsys
    )
    assert rc == 2 and "would overwrite the input" in err


def test_two_runs_into_one_out_file_are_refused(tmp_path, capsys):
    from ecru.io import FolderLock

    prompts = tmp_path / "in.jsonl"
    prompts.write_text('{"prompt": "Hello"}\n')
    out = tmp_path / "answers.jsonl"
    with FolderLock(tmp_path, name=".answers.jsonl.ecru.lock"):  # another run writing it
        rc, err = _code(["serve", "run", "--model", "tiny", "--in", str(prompts), "--out", str(out)], capsys)
    assert rc == 2 and "in use by another ecru process" in err and not out.exists()


def test_a_pickled_model_folder_and_an_out_of_range_seed_are_refused(tmp_path, capsys):
    from ecru.models import tiny_llama
    from ecru.serve.engine.models import load_model

    _, tokenizer = load_model("tiny")
    folder = tmp_path / "pickled"
    import torch

    model = tiny_llama(num_layers=1)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    torch.save(
        model.state_dict(), folder / "pytorch_model.bin"
    )  # the pickled weights a folder may hold instead
    (folder / "model.safetensors").unlink()
    assert (folder / "pytorch_model.bin").exists() and not (folder / "model.safetensors").exists()
    capsys.readouterr()  # what loading the tokenizer printed
    prompts = tmp_path / "in.jsonl"
    prompts.write_text('{"prompt": "Hello"}\n')
    run = ["serve", "run", "--in", str(prompts), "--out", str(tmp_path / "a.jsonl")]
    rc, err = _code([*run, "--model", str(folder)], capsys)
    assert rc == 2 and "cannot load the model folder" in err and err.count("\n") == 1
    rc, err = _code([*run, "--model", "tiny", "--seed", str(2**64), "--temperature", "1"], capsys)
    assert rc == 2 and "--seed" in err
    rc, err = _code(["demo", "--only", "", "--out", str(tmp_path / "d")], capsys)
    assert rc == 2 and "no section given" in err


def test_a_cost_model_file_is_checked_in_one_line(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"prompt_len": 3, "output_len": 4, "predicted_len": 4}\n')
    good = {"step_base": 0.1, "step_per_row": 0.01, "step_per_row_ctx": 1e-5, "prefill_base": 0.1,
            "prefill_per_token": 0.004, "source": "test"}  # fmt: skip
    cost = tmp_path / "cost.json"
    for bad in ({"step_base": -1.0}, {"step_base": float("nan")}, {"source": 5}):
        cost.write_text(json.dumps({**good, **bad}))
        rc, err = _code(["serve", "simulate", "--trace", str(trace), "--cost-model", str(cost)], capsys)
        assert rc == 2 and "cannot read a cost model" in err and err.count("\n") == 1, err
    cost.write_bytes(b"\xef\xbb\xbf" + json.dumps(good).encode())  # a BOM is read past
    assert _code(["serve", "simulate", "--trace", str(trace), "--cost-model", str(cost)], capsys)[0] == 0


def test_label_reuses_only_its_own_models_lines(tmp_path):
    """A cache holding another model's labels (or lines that name no model) labels this model's anew."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"Say hi number {i}"}) + "\n" for i in range(2)))
    out = tmp_path / "labels.jsonl"
    theirs = [{"prompt": "Say hi number 0", "lengths": [999], "max_new_tokens": 4, "model": "smollm2"},
              {"prompt": "Say hi number 1", "lengths": [999], "max_new_tokens": 4}]  # fmt: skip
    out.write_text("".join(json.dumps(r) + "\n" for r in theirs))
    label = ["serve", "label", "--model", "tiny", "--samples", "1", "--max-new-tokens", "4", "--prompts",
             str(prompts), "--n", "2", "--out", str(out)]  # fmt: skip
    assert main(label) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows[:2] == theirs and len(rows) == 4  # kept, not reused
    assert all(r["model"] == "tiny" and r["lengths"][0] <= 4 for r in rows[2:])
    assert main(label) == 0 and len(out.read_text().splitlines()) == 4  # its own lines are reused


def test_label_finishes_a_run_killed_mid_append(tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"Say hi number {i}"}) + "\n" for i in range(3)))
    out = tmp_path / "labels.jsonl"
    label = ["serve", "label", "--model", "tiny", "--samples", "1", "--max-new-tokens", "4", "--prompts",
             str(prompts), "--n", "3", "--out", str(out)]  # fmt: skip
    assert main(label) == 0
    whole = out.read_text()
    out.write_text(
        whole.rsplit("\n", 2)[0] + "\n" + '{"prompt": "Say hi number 2", "leng'
    )  # killed mid-append
    assert main(label) == 0  # the same command finishes it
    assert out.read_text() == whole
