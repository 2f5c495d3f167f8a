"""ecru.io: atomic writes, folder locks, manifests, state without pickle; and no unsafe load in src/."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from ecru.errors import EcruError
from ecru.io import (
    TMP_MARK,
    ChecksumError,
    FolderLock,
    atomic_folder,
    atomic_path,
    atomic_write_text,
    clean_leftovers,
    from_json_tree,
    inside,
    load_state,
    load_tensors,
    merge_json,
    save_state,
    to_json_tree,
    verify_manifest,
    write_manifest,
)

SRC = Path(__file__).resolve().parents[1] / "src"


def test_atomic_write_replaces_whole_and_a_failed_write_leaves_the_old_file(tmp_path):
    path = tmp_path / "a.txt"
    atomic_write_text(path, "old")
    with pytest.raises(RuntimeError), atomic_path(path) as tmp:
        tmp.write_text("half")
        raise RuntimeError("killed")
    assert path.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["a.txt"]
    atomic_write_text(path, "new")
    assert path.read_text() == "new" and oct(path.stat().st_mode & 0o777) != oct(0o600)


def test_atomic_folder_appears_whole_or_not_at_all(tmp_path):
    with pytest.raises(RuntimeError), atomic_folder(tmp_path / "f") as tmp:
        (tmp / "x").write_text("1")
        raise RuntimeError
    assert not (tmp_path / "f").exists() and list(tmp_path.iterdir()) == []
    with atomic_folder(tmp_path / "f") as tmp:
        (tmp / "x").write_text("1")
    assert (tmp_path / "f" / "x").read_text() == "1"
    (tmp_path / f".g{TMP_MARK}0001").mkdir()  # what a kill -9 leaves
    (tmp_path / f".h{TMP_MARK}0002").write_text("torn")
    assert len(clean_leftovers(tmp_path)) == 2 and sorted(p.name for p in tmp_path.iterdir()) == ["f"]


def test_atomic_folder_replaces_an_existing_folder_whole(tmp_path):
    with atomic_folder(tmp_path / "f") as tmp:
        (tmp / "old").write_text("1")
    with pytest.raises(FileExistsError):
        atomic_folder(tmp_path / "f").__enter__()
    with pytest.raises(RuntimeError), atomic_folder(tmp_path / "f", replace=True) as tmp:
        (tmp / "new").write_text("2")
        raise RuntimeError
    assert sorted(p.name for p in (tmp_path / "f").iterdir()) == ["old"]  # untouched by the failed rewrite
    with atomic_folder(tmp_path / "f", replace=True) as tmp:
        (tmp / "new").write_text("2")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f"]  # the old one renamed aside, then deleted
    assert sorted(p.name for p in (tmp_path / "f").iterdir()) == ["new"]


def test_state_round_trips_without_pickle(tmp_path):
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.randn(3, 2))], lr=1e-3, betas=(0.8, 0.9))
    opt.param_groups[0]["params"][0].grad = torch.ones(3, 2)
    opt.step()
    state = {"opt": opt.state_dict(), "rng": torch.get_rng_state(), "t": (1, 2.5, None, "s"), 3: [True]}
    save_state(tmp_path / "s.safetensors", state)
    back = load_state(tmp_path / "s.safetensors")
    assert back["t"] == (1, 2.5, None, "s") and back[3] == [True]
    assert back["opt"]["param_groups"] == opt.state_dict()["param_groups"]  # int keys, tuples kept
    for k, v in opt.state_dict()["state"][0].items():
        torch.testing.assert_close(back["opt"]["state"][0][k], v, rtol=0, atol=0)
    assert torch.equal(back["rng"], state["rng"])
    assert torch.equal(from_json_tree(to_json_tree({"r": state["rng"]}))["r"], state["rng"])
    tied = torch.randn(4, 4)
    save_state(tmp_path / "tied.safetensors", {"a": tied, "b": tied, "view": tied[1:, :2]})
    got = load_state(tmp_path / "tied.safetensors")
    assert torch.equal(got["b"], tied) and torch.equal(got["view"], tied[1:, :2])


@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_damaged_tensor_files_are_one_line(tmp_path, damage):
    path = tmp_path / "w.safetensors"
    save_state(path, {"w": torch.randn(100)})
    path.write_bytes(path.read_bytes()[:50] if damage == "truncate" else b"\x00garbage" * 10)
    with pytest.raises(
        EcruError, match=r"w.safetensors is damaged or not a safetensors file .*; fix it"
    ) as e:
        load_tensors(path, hint="fix it")
    assert "\n" not in str(e.value)


def test_manifest_catches_bit_flips_missing_files_and_escapes(tmp_path):
    (tmp_path / "a.bin").write_bytes(b"\x00" * 1000)
    (tmp_path / "b.json").write_text("{}")
    write_manifest(tmp_path, ["a.bin", "b.json"], meta={"step": 3})
    assert verify_manifest(tmp_path)["meta"] == {"step": 3}
    data = bytearray((tmp_path / "a.bin").read_bytes())
    data[500] ^= 0x01
    (tmp_path / "a.bin").write_bytes(bytes(data))
    with pytest.raises(
        ChecksumError, match="checksum mismatch in .*a.bin; the folder was changed after ecru"
    ):
        verify_manifest(tmp_path)
    verify_manifest(tmp_path, ["b.json"])  # only what is asked
    (tmp_path / "b.json").unlink()
    with pytest.raises(ChecksumError, match="b.json is missing"):
        verify_manifest(tmp_path, ["b.json"])
    (tmp_path / "manifest.json").write_text("not json")
    with pytest.raises(ChecksumError, match="damaged or not an ecru manifest"):
        verify_manifest(tmp_path)
    with pytest.raises(EcruError, match="points outside the folder"):
        inside(tmp_path, "../elsewhere")
    with pytest.raises(EcruError, match="points outside the folder"):
        inside(tmp_path, "/etc")


def _holder(folder: Path) -> subprocess.Popen:
    code = textwrap.dedent(f"""
        import sys, time
        from ecru.io import FolderLock
        lock = FolderLock({str(folder)!r}).acquire()
        print("held", flush=True)
        time.sleep(60)
    """)
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_live_holder_is_refused_or_waited_for_and_a_dead_ones_lock_is_recovered(tmp_path):
    proc = _holder(tmp_path)
    try:
        with pytest.raises(EcruError, match=rf"in use by another ecru process \(pid {proc.pid}\)"):
            FolderLock(tmp_path, what="--store").acquire()
        start = time.monotonic()
        with pytest.raises(EcruError):
            FolderLock(tmp_path, wait=0.3).acquire()
        assert time.monotonic() - start >= 0.3
    finally:
        proc.send_signal(signal.SIGKILL)  # kill -9: the kernel drops the lock
        proc.wait()
    with FolderLock(tmp_path, wait=2):
        pass


def test_merge_json_keeps_other_keys_lands_concurrent_writers_and_refuses_a_non_object(tmp_path):
    path = tmp_path / "results" / "r.json"
    script = (
        "import sys; from ecru.io import merge_json; merge_json(sys.argv[1], sys.argv[2], {'k': sys.argv[2]})"
    )
    procs = [subprocess.Popen([sys.executable, "-c", script, str(path), f"run{i}"]) for i in range(4)]
    assert [p.wait() for p in procs] == [0] * 4
    merge_json(path, "run0", [1])  # replaces its own key only
    assert json.loads(path.read_text()) == {"run0": [1], **{f"run{i}": {"k": f"run{i}"} for i in (1, 2, 3)}}
    path.write_text("[1, 2]")
    with pytest.raises(EcruError, match="not a JSON object"):
        merge_json(path, "x", 1)
    path.write_bytes(b"\xff")
    with pytest.raises(EcruError, match="not a JSON file"):
        merge_json(path, "x", 1)


def test_no_unsafe_load_or_second_atomic_writer_in_src():
    """No pickle load, no `weights_only=False`, every `torch.load` with `weights_only=True`, and no file
    renamed into place outside ecru/io.py."""
    unsafe = re.compile(r"weights_only\s*=\s*False|pickle\.loads?\(|cloudpickle|dill\.load")
    renames = re.compile(r"os\.replace\(|mkstemp\(|mkdtemp\(|\.rename\(")
    for path in sorted(SRC.rglob("*.py")):
        text = path.read_text()
        assert not unsafe.search(text), f"{path}: an unsafe load"
        for call in re.findall(r"torch\.load\([^)]*\)", text):
            assert "weights_only=True" in call, f"{path}: {call}"
        if path.name != "io.py":
            assert not renames.search(text), f"{path}: writes files into place itself; use ecru.io"


def test_read_jsonl_parses_objects_and_names_the_bad_line(tmp_path):
    from ecru.io import BadLine, read_jsonl

    def parse(row: dict) -> int:
        if row["n"] < 0:
            raise BadLine("n must be >= 0: fix it")
        return int(row["n"])

    path = tmp_path / "f.jsonl"
    path.write_bytes(b'{"n": 1}\n\n  \n{"n": 2}\n')
    assert read_jsonl(path, parse, expected='{"n": int}') == [1, 2]  # blank lines skipped
    cases = {
        b"\xff\xfe": "f.jsonl:2: not valid UTF-8 (byte 0xff at column 1); save the file as UTF-8",
        b"[1, 2]": 'f.jsonl:2: expected {"n": int} (a JSON list, not an object)',
        b"{oops": 'f.jsonl:2: expected {"n": int} (Expecting property name',
        b'{"m": 1}': "f.jsonl:2: expected {\"n\": int} ('n')",
        b'{"n": "x"}': 'f.jsonl:2: expected {"n": int} (',
        b'{"n": -1}': "f.jsonl:2: n must be >= 0: fix it",
    }
    for line, message in cases.items():
        path.write_bytes(b'{"n": 1}\n' + line + b"\n")
        with pytest.raises(EcruError) as info:
            read_jsonl(path, parse, expected='{"n": int}')
        assert str(info.value).startswith(str(tmp_path / message)) and "\n" not in str(info.value)


def test_read_jsonl_reads_a_byte_order_mark_as_if_absent(tmp_path):
    from ecru.io import decode_line, read_jsonl

    path = tmp_path / "f.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"n": 1}\n{"n": 2}\n')
    assert read_jsonl(path, lambda row: row["n"], expected='{"n": int}') == [1, 2]
    with pytest.raises(ValueError, match=r"byte 0xff at column 5\)"):
        decode_line(b"\xef\xbb\xbfa\xff")  # columns count the bytes as stored, BOM included


def test_a_flipped_bit_in_a_saved_state_is_refused(tmp_path):
    from ecru.io import save_state

    state = {"step": 3, "w": torch.arange(64, dtype=torch.float32), "opt": [{"m": torch.ones(2, 2)}]}
    path = save_state(tmp_path / "s.safetensors", state)
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x40  # in the last tensor's bytes: still a valid safetensors file
    path.write_bytes(bytes(data))
    with pytest.raises(ChecksumError, match="checksum mismatch"):
        load_state(path)
    # a state written before checksums (no ecru_sha256 in its metadata) still loads
    plain = tmp_path / "old.safetensors"
    save_state(plain, state, checksum=False)
    loaded = load_state(plain)
    assert loaded["step"] == 3 and torch.equal(loaded["w"], state["w"])
