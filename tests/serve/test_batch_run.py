"""`ecru serve run`: checked input lines, answers in input order, resumable after a crash (SIGKILL)."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ecru.cli import main
from ecru.serve.engine.packed import packing_available

from .test_packed import Counting

SRC = str(Path(__file__).resolve().parents[2] / "src")


def write_lines(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def answers(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def run(model_dir, src, out, *extra):
    return main(["serve", "run", "--model", str(model_dir), "--in", str(src), "--out", str(out), *extra])


def test_prompts_and_messages_answered_in_input_order(chat_model_dir, tmp_path, capsys):
    src = write_lines(tmp_path / "in.jsonl", [
        {"prompt": "Once upon a time"},
        {"messages": [{"role": "user", "content": "hello"}], "id": "chat", "max_tokens": 3},
        {"prompt": "The weather today", "id": 42},
    ])  # fmt: skip
    out = tmp_path / "deep" / "missing" / "out.jsonl"
    assert run(chat_model_dir, src, out, "--max-new-tokens", "12", "--max-batch-size", "2") == 0
    rows = answers(out)
    assert [r["id"] for r in rows] == [1, "chat", 42]
    assert [r["output_tokens"] for r in rows] == [12, 3, 12]
    assert all(set(r) == {"id", "text", "output_tokens", "finish_reason"} and r["text"] for r in rows)
    assert rows[1]["finish_reason"] == "length"
    assert run(chat_model_dir, src, out, "--max-new-tokens", "12") == 0  # all done: nothing appended
    assert answers(out) == rows and "0 answered" in capsys.readouterr().out


BAD_LINES = [
    ('{"prompt": null}', "non-empty string"),
    ('{"prompt": ""}', "non-empty string"),
    ('{"prompt": 5}', "non-empty string"),
    ("not json", "not valid JSON"),
    ("[1, 2]", "JSON object"),
    ('{"text": "x"}', "exactly one of"),
    ('{"prompt": "x", "messages": []}', "exactly one of"),
    ('{"messages": []}', "non-empty list"),
    ('{"messages": [{"role": "user"}]}', '"content"'),
    ('{"prompt": "x", "max_tokens": 0}', "max_tokens"),
    ('{"prompt": "x", "max_tokens": "5"}', "max_tokens"),
    ('{"prompt": "x", "max_tokens": true}', "max_tokens"),
    ('{"prompt": "x", "max_tokens": 2.0}', "max_tokens"),
    ('{"prompt": "x", "id": [1]}', '"id"'),
    ('{"prompt": "x", "id": 1}', "appears twice"),
    ('{"prompt": "' + "word " * 600 + '"}', "context"),
]


@pytest.mark.parametrize(("line", "why"), BAD_LINES, ids=[f"bad{i}" for i in range(len(BAD_LINES))])
def test_a_bad_line_stops_the_run_before_any_work_with_file_and_line(
    chat_model_dir, tmp_path, capsys, line, why
):
    src = write_lines(tmp_path / "in.jsonl", ['{"prompt": "fine"}', line])
    out = tmp_path / "out.jsonl"
    assert run(chat_model_dir, src, out, "--max-new-tokens", "4") == 2
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]  # (above it, at most transformers' weight-loading bar)
    assert last.startswith(f"ecru: error: {src}:2:") and why in last and "Traceback" not in err
    assert not out.exists() or out.read_text() == ""


def test_skip_invalid_counts_and_serves_the_rest(chat_model_dir, tmp_path, capsys):
    src = write_lines(
        tmp_path / "in.jsonl", ['{"prompt": null}', '{"prompt": "ok"}', "junk", '{"prompt": "ok2"}']
    )
    out = tmp_path / "out.jsonl"
    assert run(chat_model_dir, src, out, "--max-new-tokens", "4", "--skip-invalid") == 0
    captured = capsys.readouterr()
    assert [r["id"] for r in answers(out)] == [2, 4]
    assert "2 invalid line(s) skipped" in captured.out and f"{src}:3:" in captured.err


def test_undecodable_bytes_are_an_invalid_line(chat_model_dir, tmp_path, capsys):
    src = tmp_path / "in.jsonl"
    src.write_bytes(b'{"prompt": "fine"}\n{"prompt": "bad \xff"}\n{"prompt": "also fine"}\n')
    out = tmp_path / "out.jsonl"
    assert run(chat_model_dir, src, out, "--max-new-tokens", "4") == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith(f"ecru: error: {src}:2: not valid UTF-8 (byte 0xff at column 17)")
    assert run(chat_model_dir, src, out, "--max-new-tokens", "4", "--skip-invalid") == 0
    assert [r["id"] for r in answers(out)] == [1, 3]


def test_a_whole_last_answer_without_its_newline_is_kept_and_appending_goes_on(tmp_path):
    from ecru.serve.entrypoints.batch_run import read_answers

    out = tmp_path / "out.jsonl"
    out.write_text('{"id": 1, "text": "a"}\n{"id": 2, "text": "b"}')  # killed before the newline
    assert [r["id"] for r in read_answers(out)] == [1, 2]
    assert out.read_text().endswith('"b"}\n')
    out.write_text(out.read_text() + '{"id": 3, "te')  # torn mid-line
    assert [r["id"] for r in read_answers(out)] == [1, 2] and out.read_text().endswith('"b"}\n')


@pytest.mark.parametrize("row", ['{"id": [1], "text": "a"}', '{"id": true}', '{"id": null}', '{"id": {}}'])
def test_an_answers_file_with_an_id_no_input_line_can_have_is_one_line(tmp_path, row):
    from ecru.errors import EcruError
    from ecru.serve.entrypoints.batch_run import read_answers

    out = tmp_path / "out.jsonl"
    out.write_text(row + "\n")  # a crafted --out: its id must not reach a set (unhashable) or match an input
    with pytest.raises(EcruError, match="out.jsonl:1: not an answer line"):
        read_answers(out)


def test_killed_mid_run_then_rerun_answers_each_id_once(chat_model_dir, tmp_path):
    n = 24
    src = write_lines(
        tmp_path / "in.jsonl", [{"prompt": f"story number {i}", "id": f"q{i}"} for i in range(n)]
    )
    out = tmp_path / "out.jsonl"
    flags = ["--max-new-tokens", "96", "--max-batch-size", "2"]
    cmd = [sys.executable, "-m", "ecru", "serve", "run", "--model", str(chat_model_dir), "--in", str(src),
           "--out", str(out), *flags]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": SRC}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if out.is_file() and len(out.read_text().splitlines()) >= 3:
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    partial = answers(out) if out.read_text().strip() else []
    assert 3 <= len(partial) < n, "the run should have been killed mid-way"

    assert run(chat_model_dir, src, out, *flags) == 0
    rows = answers(out)
    assert [r["id"] for r in rows] == [f"q{i}" for i in range(n)]  # each once, in input order
    fresh = tmp_path / "fresh.jsonl"
    assert run(chat_model_dir, src, fresh, *flags) == 0
    assert rows == answers(fresh)  # greedy: the resumed run answers exactly as an uninterrupted one


def test_fcfs_slack_needs_cb_sjf_and_answers_alike(chat_model_dir, tmp_path, capsys):
    src = write_lines(
        tmp_path / "in.jsonl", [{"prompt": p} for p in ("Once upon a time", "hi", "The weather")]
    )
    assert run(chat_model_dir, src, tmp_path / "bad.jsonl", "--fcfs-slack", "0.2") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--fcfs-slack applies to --policy cb-sjf" in err[0]
    assert not (tmp_path / "bad.jsonl").exists()  # refused before any work
    extra = ("--max-new-tokens", "8", "--max-batch-size", "2")
    assert run(chat_model_dir, src, tmp_path / "cb.jsonl", *extra) == 0
    assert (
        run(chat_model_dir, src, tmp_path / "sjf.jsonl", *extra, "--policy", "cb-sjf", "--fcfs-slack", "0.2")
        == 0
    )
    assert answers(tmp_path / "cb.jsonl") == answers(
        tmp_path / "sjf.jsonl"
    )  # greedy: order changes no answer


def test_engine_config_takes_fcfs_slack_only_with_cb_sjf():
    from ecru.errors import EcruError
    from ecru.serve.engine.request_engine import EngineConfig
    from ecru.serve.entrypoints.setup import EngineSetup

    setup = EngineSetup(policy="cb-sjf", max_batch_size=4, max_new_tokens=16, prefix_cache=0, fcfs_slack=0.3)
    config = setup.engine_config
    assert config.deadline == 0.3 and config.aging_per_step == 0.0  # the deadline bounds the wait, not aging
    with pytest.raises(EcruError, match="--fcfs-slack applies to --policy cb-sjf or cb-srpt only"):
        EngineSetup(policy="cb", fcfs_slack=0.3)
    with pytest.raises(ValueError, match="fcfs_slack"):
        EngineConfig(policy="cb", fcfs_slack=0.3)
    with pytest.raises(ValueError, match="fcfs_slack"):
        EngineConfig(policy="cb-sjf", fcfs_slack=-1.0)


@pytest.mark.skipif(not packing_available(), reason="this torch build has no oneDNN linear ops")
def test_answers_alike_with_and_without_packed_weights(chat_model_dir, tmp_path, monkeypatch):
    products = Counting(monkeypatch)
    src = write_lines(
        tmp_path / "in.jsonl", [{"prompt": f"Tell me about {w}"} for w in ("cats", "rain", "maps")]
    )
    outs = [tmp_path / "packed.jsonl", tmp_path / "plain.jsonl"]
    assert run(chat_model_dir, src, outs[0], "--max-new-tokens", "8") == 0
    assert products.calls > 0
    packed_calls = products.calls
    assert run(chat_model_dir, src, outs[1], "--max-new-tokens", "8", "--no-packed-weights") == 0
    assert products.calls == packed_calls  # plain layers only
    assert answers(outs[0]) == answers(outs[1])
