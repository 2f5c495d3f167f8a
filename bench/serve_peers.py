"""`ecru serve api` against llama.cpp's own server (`llama-server`, continuous batching, `--parallel` slots)
on the same model, prompts and clients, in the same run.

    OMP_NUM_THREADS=1 python bench/serve_peers.py --llama-server PATH/llama-server \\
        --json bench/results/serve_peers.json

The peer is built from the llama.cpp source vendored in llama-cpp-python's sdist, never installed into the
project's environment:

    pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d /tmp/llama
    tar xzf /tmp/llama/llama_cpp_python-0.3.36.tar.gz -C /tmp/llama
    cd /tmp/llama/llama_cpp_python-0.3.36/vendor/llama.cpp
    cmake -B build -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DBUILD_SHARED_LIBS=OFF -DCMAKE_BUILD_TYPE=Release
    cmake --build build --target llama-server -j2        # -> build/bin/llama-server

Model: SmolLM2-135M-Instruct from the bundled package's Q4_1 GGUF. llama.cpp serves the GGUF itself; ecru
serves its fp32 weights dequantized from that same file (`ecru.models.load_smollm2`). Both run on one
thread (`--threads 1` / `OMP_NUM_THREADS=1`) with 16 rows (`--parallel 16` / `--max-batch-size 16`). Both
are driven by the same `--clients` concurrent streaming clients (the official `openai` client, greedy chat
completions of held-out CLINC150/Banking77 queries, cap `--max-new-tokens`), each client sending its next
prompt when its answer has ended; the servers alternate A B B A (`--rounds` pairs) so that a drifting load
weighs on both alike. Tokens/s = completion tokens (as each server reports them) / the group's wall time.
The answers are compared too: llama.cpp computes with quantized dot products, ecru in fp32, so greedy
answers may differ after a near tie; the fraction of identical answers is reported, not required.
"""

from __future__ import annotations

import os
import platform
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "bench")]  # this checkout's ecru; serve_api beside it
from ecru.cliargs import ArgumentParser, positive_int, prepare_out_file, run_main  # noqa: E402
from ecru.errors import EcruError  # noqa: E402
from serve_api import Server, drive  # noqa: E402 - the same clients and ecru server as bench/serve_api.py

GOAL = 1.0  # ecru's tokens/s over llama-server's at 16 clients (issue 43)


class LlamaServer:
    """`llama-server` on a free loopback port, stopped by `close`."""

    def __init__(self, binary: str, gguf: Path, *, rows: int, context: int):
        from ecru.serve.entrypoints.server import free_port

        self.port = free_port()
        cmd = [binary, "--model", str(gguf), "--host", "127.0.0.1", "--port", str(self.port),
               "--threads", "1", "--threads-batch", "1", "--parallel", str(rows), "--cont-batching",
               "--ctx-size", str(context), "--no-webui"]  # fmt: skip
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.url = f"http://127.0.0.1:{self.port}"
        for _ in range(600):
            try:
                if urllib.request.urlopen(self.url + "/health", timeout=2).status == 200:
                    return
            except OSError:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"llama-server exited at start: {' '.join(cmd)}") from None
            time.sleep(0.5)
        raise RuntimeError("llama-server did not answer /health in 300 s")

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


def measure(url: str, texts: list[str], cap: int, clients: int, name: str) -> tuple[dict, list[str]]:
    drive(url, texts[:2], cap, 2)  # warm-up: no measured group pays the first forwards' costs
    result, answers = drive(url, texts, cap, clients)
    print(f"{name}: {result['tokens_per_s']:.1f} tok/s, TTFT {result['mean_ttft_s']:.2f} s, "
          f"latency {result['mean_latency_s']:.2f} s", flush=True)  # fmt: skip
    return result, answers


def main(argv: list[str] | None = None) -> int:
    ap = ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--llama-server", required=True, help="path of the llama-server binary (see the docstring)"
    )
    ap.add_argument("--n", type=positive_int, default=64, help="prompts per group")
    ap.add_argument("--max-new-tokens", type=positive_int, default=64, help="cap on answer tokens")
    ap.add_argument("--clients", type=positive_int, default=16, help="concurrent streaming clients")
    ap.add_argument("--rows", type=positive_int, default=16, help="server rows (llama-server --parallel)")
    ap.add_argument("--rounds", type=positive_int, default=1, help="A B B A pairs")
    ap.add_argument("--json", required=True, help="result JSON")
    args = ap.parse_args(argv)
    from ecru.io import atomic_write_json
    from ecru.models.smollm2 import smollm2_gguf_path
    from ecru.serve.prompts import load_prompts

    prepare_out_file(args.json, flag="--json")
    if not os.access(args.llama_server, os.X_OK):
        raise EcruError(
            f"--llama-server {args.llama_server}: not an executable; build it as the docstring says"
        )
    texts = load_prompts("mixed", n=args.n, split="test")
    runs: dict[str, list[dict]] = {"ecru": [], "llama_server": []}
    answers: dict[str, list[str]] = {}
    for name in ["ecru", "llama_server", "llama_server", "ecru"] * args.rounds:
        server = (
            Server(args.max_new_tokens, args.rows, "cb")
            if name == "ecru"
            else LlamaServer(
                args.llama_server,
                smollm2_gguf_path(),
                rows=args.rows,
                context=args.rows * (256 + args.max_new_tokens),
            )  # fmt: skip
        )
        try:
            result, answers[name] = measure(server.url, texts, args.max_new_tokens, args.clients, name)
        finally:
            server.close()
        runs[name].append(result)
    report = summarize(args, runs, answers)
    atomic_write_json(args.json, report)
    print(f"ecru / llama-server tokens/s at {args.clients} clients: {report['x_llama_server']:.2f} "
          f"(median of {len(runs['ecru'])} runs each; goal >= {GOAL}); identical answers "
          f"{report['identical_answers']:.0%}; wrote {args.json}")  # fmt: skip
    return 0


def summarize(args, runs: dict[str, list[dict]], answers: dict[str, list[str]]) -> dict:
    med = {k: statistics.median(r["tokens_per_s"] for r in v) for k, v in runs.items()}
    same = sum(a == b for a, b in zip(answers["ecru"], answers["llama_server"], strict=True))
    return {
        "command": "python bench/serve_peers.py " + " ".join(sys.argv[1:]),
        "prompts": args.n,
        "max_new_tokens": args.max_new_tokens,
        "clients": args.clients,
        "rows": args.rows,
        "threads": 1,
        "order": "A B B A (ecru, llama-server, llama-server, ecru)",
        "tokens_per_s_median": med,
        "x_llama_server": med["ecru"] / med["llama_server"],
        "goal_x_llama_server": GOAL,
        "identical_answers": same / len(answers["ecru"]),
        "runs": runs,
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "cores": os.cpu_count(),
            "load_after": os.getloadavg(),
        },  # fmt: skip
    }


if __name__ == "__main__":
    sys.exit(run_main(main))
