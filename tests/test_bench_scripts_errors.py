"""The benchmark scripts of bench/ follow the CLI's convention (`ecru.cliargs.run_main`): a bad input is one
line on stderr (``ecru: error: ...``), exit status 2 and no traceback, before any model loads or work starts."""

import subprocess
import sys

import pytest

from tests.bench_scripts import BENCH, load_bench_script


@pytest.fixture
def bad(tmp_path):
    """Paths a user gets wrong: a folder where a file goes, a file where a folder goes, undecodable bytes."""
    undecodable = tmp_path / "bad.bin"
    undecodable.write_bytes(b"\xff\xfe\x00bad\n")
    return {"folder": str(tmp_path), "file": str(undecodable), "in_file": str(undecodable / "x.json")}


def _one_error_line(err: str) -> None:
    assert err.startswith("ecru: error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err


# As the user runs them: the scripts that import no torch at the top start in well under a second.
SUBPROCESS = {
    "serve_api": ["--json", "{folder}"],
    "serve_peers": ["--llama-server", "{file}", "--json", "{folder}/x.json"],
    "ctr_peers": ["--peer-python", "{file}", "--json", "{folder}/x.json"],
}


@pytest.mark.parametrize("script", sorted(SUBPROCESS))
def test_a_bad_input_is_one_line_and_status_2(script, bad):
    argv = [a.format(**bad) for a in SUBPROCESS[script]]
    done = subprocess.run(
        [sys.executable, str(BENCH / f"{script}.py"), *argv], capture_output=True, text=True
    )
    assert done.returncode == 2, done.stderr
    _one_error_line(done.stderr)


# In this process (torch already imported): `main(argv)` through `run_main`, as `__main__` calls it.
IN_PROCESS = {
    "serve_online": ["--json", "{folder}/x.json", "--answers-dir", "{file}"],
    "serve_online_real": ["--json", "{folder}"],
    "ctr_predict_check": ["--json", "{in_file}"],
    "ctr_reader": ["--json", "{folder}"],
    "ctr_scaling": ["--summarize", "{file}"],
    "l2l_beyond_ram": ["--store-dir", "{folder}/store", "--mode", "lora-in-place", "--json", "{file}"],
    "l2l_gpu": ["--device", "cpu", "--work", "{file}"],
    "l2l_memory": ["--json", "{folder}"],
    "l2l_offload_peer": ["--work", "{file}"],
}


@pytest.mark.parametrize("script", sorted(IN_PROCESS))
def test_a_bad_input_is_refused_before_any_work(script, bad, capsys):
    from ecru.cliargs import run_main

    main = load_bench_script(script).main
    argv = [a.format(**bad) for a in IN_PROCESS[script]]
    assert run_main(lambda: main(argv)) == 2
    _one_error_line(capsys.readouterr().err)


def test_every_product_script_runs_through_run_main():
    """The scripts not run above (serve.py, l2l.py) included: errors and Ctrl-C are handled the one way."""
    scripts = sorted(p.stem for p in BENCH.glob("*.py"))
    assert set(SUBPROCESS) | set(IN_PROCESS) <= set(scripts)
    assert [s for s in scripts if "run_main" not in (BENCH / f"{s}.py").read_text()] == []
