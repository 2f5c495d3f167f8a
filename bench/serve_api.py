"""`ecru serve api` under load, against one-request-at-a-time generation and transformers' own continuous
batching (`generate_batch`), on the same prompts in the same run.

    OMP_NUM_THREADS=1 nice -n 5 python bench/serve_api.py --quick --json bench/results/serve_api_quick.json

Prompts: held-out CLINC150/Banking77 queries (mixed test split) in SmolLM2-135M-Instruct's chat template,
greedy, cap `--max-new-tokens`. `--quick`: 32 prompts on 16 rows, so finished rows are refilled (with 16
prompts on 16 rows no row ever is, and continuous batching cannot show). Measured:
- one request at a time: Hugging Face `model.generate` on each of the first `--single-n` prompts alone;
- `model.generate_batch` (transformers' paged continuous batching, the same `--max-batch-size`) on all
  prompts at once (A), the same engine in this process without HTTP (B, what the transport costs), the
  same with plain `nn.Linear` layers (B0: what the pre-packed weights of `ecru.serve.engine.packed` gain; A and
  one-at-a-time always run on the plain layers, as transformers ships them) and the server
  (`python -m ecru serve api`, its own process, warmed by one request) driven through HTTP by 16
  concurrent streaming clients (C, the official `openai` client), in the order A B B0 C C B0 B A so that
  a load drifting linearly weighs on all alike (the machine is shared); then the server at 4 clients (all
  prompts) and at 1 client (the first `--single-n`). Each client sends its next prompt as soon as its
  previous answer has ended.
Tokens/s is generated tokens (EOS included) / wall seconds of the whole group. CPU seconds are recorded
too (this process's for A and B and one-at-a-time, the server process's for C; the clients' apart), as
tokens per CPU second weigh less on what else runs on the machine. Identity: every greedy answer of every
method equals generate_batch's (as text for the server), and all equal `generate` one at a time on the
first `--single-n` prompts. Prints a table, writes JSON.
"""

from __future__ import annotations

import json
import os
import platform
import queue
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))  # this checkout's ecru, installed or not
from ecru.cliargs import ArgumentParser, int_list, positive_int, prepare_out_file, run_main  # noqa: E402
from ecru.serve.sched.names import ENGINE_POLICIES  # noqa: E402

TARGETS = {"x_one_at_a_time": 4.0, "x_generate_batch": 1.5}  # at 16 concurrent clients (issue 21)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def summary(tokens: int, wall: float, done: list[float], *, latencies=None, ttfts=None, cpu=None) -> dict:
    """`done`: each request's end, seconds from the start of the group (all prompts ready at t=0);
    `latencies`: from the moment its client sent it (server only, where clients send one at a time)."""
    out = {
        "tokens": tokens,
        "wall_s": wall,
        "tokens_per_s": tokens / wall,
        "mean_completion_s": statistics.fmean(done),
        "p99_completion_s": percentile(done, 0.99),
    }
    if cpu is not None:
        out |= {"cpu_s": cpu, "tokens_per_cpu_s": tokens / cpu}
    if latencies:
        out |= {"mean_latency_s": statistics.fmean(latencies), "p99_latency_s": percentile(latencies, 0.99)}
    if ttfts:
        out |= {"mean_ttft_s": statistics.fmean(ttfts), "p99_ttft_s": percentile(ttfts, 0.99)}
    return out


def set_packed(model, packed: bool) -> int:
    """The model's linear layers pre-packed (the engine's default) or plain (transformers' own); returns
    how many are packed."""
    from ecru.serve.engine.packed import pack_linears_, unpack_linears_

    if packed:
        return pack_linears_(model)
    unpack_linears_(model)
    return 0


def one_at_a_time(served, prompts: list[list[int]], cap: int) -> tuple[dict, list[list[int]]]:
    """Hugging Face `generate`, one prompt alone after the other (every request waits from t=0)."""
    import torch

    set_packed(served.model, False)
    outs, finish, start, cpu = [], [], time.perf_counter(), time.process_time()
    for p in prompts:
        ids = torch.tensor([p])
        full = served.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=cap,
                                     do_sample=False, eos_token_id=list(served.eos_token_ids),
                                     pad_token_id=served.pad_token_id)  # fmt: skip
        outs.append(full[0, len(p) :].tolist())
        finish.append(time.perf_counter() - start)
    return summary(sum(map(len, outs)), finish[-1], finish, cpu=time.process_time() - cpu), outs


def generate_batch(served, prompts: list[list[int]], cap: int, rows: int) -> tuple[dict, list[list[int]]]:
    """transformers' continuous batching (paged KV cache, sdpa), the spec's CPU configuration."""
    from transformers import ContinuousBatchingConfig, GenerationConfig

    gen = GenerationConfig(max_new_tokens=cap, do_sample=False, eos_token_id=list(served.eos_token_ids),
                           pad_token_id=served.pad_token_id)  # fmt: skip
    set_packed(served.model, False)
    cb = ContinuousBatchingConfig(page_size=64, num_blocks=max(128, rows * (cap + 256) // 64 + 8),
                                  max_batch_tokens=rows * 256, max_requests_per_batch=rows,
                                  use_cuda_graph=False)  # fmt: skip
    start, cpu = time.perf_counter(), time.process_time()
    results = served.model.generate_batch(inputs=prompts, generation_config=gen, continuous_batching_config=cb,
                                          record_timestamps=False, progress_bar=False, warmup=False)  # fmt: skip
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    ordered = list(results.values())  # in input order (generate_batch re-orders them)
    outs = [list(r.generated_tokens) for r in ordered]
    ends = [r.lifespan[1] - start if r.lifespan[1] > 0 else wall for r in ordered]
    return summary(sum(map(len, outs)), wall, ends, cpu=cpu), outs


class Server:
    """`python -m ecru serve api` in its own process on a free loopback port."""

    def __init__(self, cap: int, rows: int, policy: str):
        from ecru.serve.entrypoints.server import free_port

        self.port = free_port()
        cmd = [sys.executable, "-m", "ecru", "serve", "api", "--model", "smollm2", "--port", str(self.port),
               "--max-new-tokens", str(cap), "--max-batch-size", str(rows), "--policy", policy]  # fmt: skip
        env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                urllib.request.urlopen(self.url + "/health", timeout=2)
                break
            except OSError:
                if self.proc.poll() is not None:
                    raise RuntimeError("the server exited at start") from None
                time.sleep(0.5)
        else:
            raise RuntimeError("the server did not answer /health in 300 s")
        self.warm_up()

    def warm_up(self) -> None:
        """One short request, so that no measured group pays the first forward's one-time costs."""
        body = json.dumps({"model": "smollm2", "prompt": "Hello", "max_tokens": 4}).encode()
        req = urllib.request.Request(self.url + "/v1/completions", body, {"Content-Type": "application/json"})
        urllib.request.urlopen(req, timeout=300).read()

    def cpu_s(self) -> float:
        import psutil

        t = psutil.Process(self.proc.pid).cpu_times()
        return t.user + t.system

    def thread_cpu_s(self) -> dict[int, float]:
        """CPU seconds of each of the server process's threads, by thread id."""
        import psutil

        return {t.id: t.user_time + t.system_time for t in psutil.Process(self.proc.pid).threads()}

    def rss_mb(self) -> float:
        import psutil

        return psutil.Process(self.proc.pid).memory_info().rss / 2**20

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


def drive(url: str, texts: list[str], cap: int, clients: int) -> tuple[dict, list[str]]:
    """`clients` concurrent streaming clients share the prompts (each takes the next when it is done)."""
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
    todo: queue.Queue = queue.Queue()
    for i in range(len(texts)):
        todo.put(i)
    n = len(texts)
    texts_out, tokens, lat, done, ttft = [""] * n, [0] * n, [0.0] * n, [0.0] * n, [0.0] * n
    start, cpu = time.perf_counter(), time.process_time()

    def worker():
        while True:
            try:
                i = todo.get_nowait()
            except queue.Empty:
                return
            sent = time.perf_counter()
            stream = client.chat.completions.create(
                model="smollm2", messages=[{"role": "user", "content": texts[i]}], max_tokens=cap,
                temperature=0, stream=True, stream_options={"include_usage": True})  # fmt: skip
            parts = []
            for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    ttft[i] = ttft[i] or time.perf_counter() - sent
                    parts.append(chunk.choices[0].delta.content)
                if chunk.usage:
                    tokens[i] = chunk.usage.completion_tokens
            end = time.perf_counter()
            texts_out[i], lat[i], done[i] = "".join(parts), end - sent, end - start

    threads = [threading.Thread(target=worker) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    out = summary(sum(tokens), wall, done, latencies=lat, ttfts=[t for t in ttft if t])
    return out | {"client_cpu_s": time.process_time() - cpu}, texts_out


def run_level(server: Server, texts: list[str], reference: list[str], cap: int, clients: int) -> dict:
    cpu, threads = server.cpu_s(), server.thread_cpu_s()
    result, answers = drive(server.url, texts, cap, clients)
    result["cpu_s"] = server.cpu_s() - cpu  # the server process (model, engine, HTTP); clients apart
    spent = sorted((t - threads.get(i, 0.0) for i, t in server.thread_cpu_s().items()), reverse=True)
    result["server_thread_cpu_s"] = {"engine_thread": spent[0], "other_threads": sum(spent[1:])}  # busiest
    result["tokens_per_cpu_s"] = result["tokens"] / result["cpu_s"]
    result["outputs_identical"] = answers == reference
    result["mismatches"] = sum(a != r for a, r in zip(answers, reference, strict=True))
    print(f"server, {clients} clients, {len(texts)} prompts: {result['tokens_per_s']:.1f} tok/s, "
          f"TTFT {result['mean_ttft_s']:.2f} s, latency {result['mean_latency_s']:.2f} s "
          f"(p99 {result['p99_latency_s']:.2f}), same outputs {result['outputs_identical']}", flush=True)  # fmt: skip
    return result


def run_batch(served, prompts, cap: int, rows: int) -> tuple[dict, list[list[int]]]:
    batch, tokens = generate_batch(served, prompts, cap, rows)
    print(f"generate_batch: {batch['tokens_per_s']:.1f} tok/s ({batch['wall_s']:.1f} s)", flush=True)
    return batch, tokens


def engine_alone(served, prompts, args, *, packed: bool = True) -> tuple[dict, list[list[int]]]:
    """The same engine in this process, no HTTP: what the server's transport costs (`packed=False`: on
    plain linear layers, what pre-packing the weights gains)."""
    from ecru.serve import EngineConfig, SamplingParams

    packed_layers = set_packed(served.model, packed)
    engine = served.engine(EngineConfig(policy=args.policy, max_batch_size=args.max_batch_size,
                                        max_new_tokens=args.max_new_tokens))  # fmt: skip
    start, cpu = time.perf_counter(), time.process_time()
    reqs = engine.generate(prompts, SamplingParams(max_tokens=args.max_new_tokens))
    out = summary(sum(len(r.output) for r in reqs), time.perf_counter() - start,
                  [r.finish_s - start for r in reqs], cpu=time.process_time() - cpu)  # fmt: skip
    out |= {"prefills": engine.stats.prefills, "prefill_forwards": engine.stats.prefill_forwards,
            "decode_steps": engine.stats.decode_steps, "peak_kv_tokens": engine.stats.peak_kv_tokens,
            "packed_layers": packed_layers, "prefix_hit_tokens": engine.stats.prefix_hit_tokens}  # fmt: skip
    print(
        f"engine alone (packed {packed}): {out['tokens_per_s']:.1f} tok/s ({out['wall_s']:.1f} s)", flush=True
    )
    return out, [r.output for r in reqs]


def compare_top(served, server, texts, prompts, decode, args, top: int):
    """generate_batch (A), the engine alone (B), the engine on plain linear layers (B0) and the server at
    `top` clients (C) in the order A B B0 C C B0 B A, so that a load drifting linearly during the run weighs
    on all alike. The reference answers are the first generate_batch run's."""
    cap, rows = args.max_new_tokens, args.max_batch_size
    first, ref_tokens = run_batch(served, prompts, cap, rows)
    reference = [decode(t) for t in ref_tokens]
    alone = [engine_alone(served, prompts, args)]
    plain = [engine_alone(served, prompts, args, packed=False)]
    tops = [run_level(server, texts, reference, cap, top) for _ in range(2)]
    plain.append(engine_alone(served, prompts, args, packed=False))
    alone.append(engine_alone(served, prompts, args))
    last, last_tokens = run_batch(served, prompts, cap, rows)
    first["outputs_identical"], last["outputs_identical"] = (
        True,
        last_tokens == ref_tokens,
    )  # first: by definition
    for run, tokens in alone + plain:
        run["outputs_identical"] = tokens == ref_tokens
    engines = [run for run, _ in alone], [run for run, _ in plain]
    return [first, last], engines, tops, ref_tokens, reference


def ABCCBA(top: int) -> list[str]:  # noqa: N802 - the name is the order (with B0 around the C's)
    return [
        "generate_batch",
        "engine alone",
        "engine alone, plain linear layers",
        f"server {top}",
        f"server {top}",
        "engine alone, plain linear layers",
        "engine alone",
        "generate_batch",
    ]


def mean_of(runs: list[dict], key: str) -> float:
    return statistics.fmean(r[key] for r in runs)


def main(argv: list[str] | None = None) -> int:
    ap = ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--quick", action="store_true", help="32 prompts, cap 64, one at a time on 8 (~8 min on 2 cores)"
    )
    ap.add_argument("--n", type=positive_int, default=None, help="prompts (default 64; --quick 32)")
    ap.add_argument("--single-n", type=positive_int, default=None,
                    help="prompts generated one at a time and sent by 1 client (default all; --quick 8)")  # fmt: skip
    ap.add_argument("--max-new-tokens", type=positive_int, default=64, help="cap on answer tokens")
    ap.add_argument(
        "--concurrency", type=int_list, default="1,4,16", help="concurrent clients, comma-separated"
    )
    ap.add_argument(
        "--max-batch-size", type=positive_int, default=16, help="server's rows (and generate_batch's)"
    )
    ap.add_argument("--policy", choices=ENGINE_POLICIES, default="cb", help="server admission policy")
    ap.add_argument("--json", required=True, help="result JSON")
    args = ap.parse_args(argv)
    import psutil
    import torch
    import transformers

    from ecru.io import atomic_write_json
    from ecru.serve.engine.detok import Decoder
    from ecru.serve.engine.models import ServedModel
    from ecru.serve.prompts import load_prompts

    prepare_out_file(args.json, flag="--json")
    n, cap = args.n or (32 if args.quick else 64), args.max_new_tokens
    single_n = min(n, args.single_n or (8 if args.quick else n))
    levels = sorted(args.concurrency)
    served = ServedModel.load("smollm2", packed=False)  # packed for the engine arms only
    texts = load_prompts("mixed", n=n, split="test")
    prompts = [served.encode_chat([{"role": "user", "content": t}]) for t in texts]
    decode = Decoder(served.tokenizer)
    load_before = os.getloadavg()
    print(f"{n} prompts, cap {cap}, {args.max_batch_size} rows, torch threads {torch.get_num_threads()}, "
          f"load {load_before}", flush=True)  # fmt: skip

    single, single_tokens = one_at_a_time(served, prompts[:single_n], cap)
    print(f"one at a time ({single_n} prompts): {single['tokens_per_s']:.1f} tok/s, {single['wall_s']:.1f} s",
          flush=True)  # fmt: skip
    server, levels_out = Server(cap, args.max_batch_size, args.policy), {}
    try:
        batches, alone, tops, ref_tokens, reference = compare_top(
            served, server, texts, prompts, decode, args, levels[-1]
        )
        for c in reversed(levels[:-1]):
            k = single_n if c == 1 else n
            levels_out[str(c)] = run_level(server, texts[:k], reference[:k], cap, c)
        server_rss = server.rss_mb()
    finally:
        server.close()
    single["outputs_identical"] = single_tokens == ref_tokens[:single_n]
    result = assemble(args, n, single_n, levels, single, batches, alone, tops, levels_out)
    command = ["python", "bench/serve_api.py", *(argv if argv is not None else sys.argv[1:])]
    result["setup"] |= {"command": " ".join(command),
                        "load_average_before": load_before, "load_average_after": os.getloadavg(),
                        "torch_threads": torch.get_num_threads(), "cpus": os.cpu_count(),
                        "torch": torch.__version__, "transformers": transformers.__version__,
                        "python": platform.python_version()}  # fmt: skip
    result["peak_rss_mb"] = {"bench_process": psutil.Process().memory_info().rss / 2**20,
                             "server_process": server_rss}  # fmt: skip
    atomic_write_json(args.json, result)
    print(json.dumps({"ratios": result[f"ratios_at_{levels[-1]}_clients"], "met": result["met"]}, indent=2))
    print(f"wrote {args.json}")
    return 0


def assemble(args, n, single_n, levels, single, batches, alone, tops, levels_out) -> dict:
    """The result JSON: every group, the ratios at the top concurrency, the targets and whether they hold."""
    from ecru.serve.engine.packed import MIN_SIZE

    keys = (
        "tokens_per_s",
        "tokens_per_cpu_s",
        "mean_ttft_s",
        "p99_ttft_s",
        "mean_latency_s",
        "p99_latency_s",
    )
    top = {**tops[0], **{k: mean_of(tops, k) for k in keys}, "runs": tops}
    top["outputs_identical"] = all(r["outputs_identical"] for r in tops)
    levels_out = {str(levels[-1]): top, **levels_out}
    levels_out = dict(sorted(levels_out.items(), key=lambda kv: int(kv[0])))
    batch = {"tokens_per_s": mean_of(batches, "tokens_per_s"), "runs": batches,
             "tokens_per_cpu_s": mean_of(batches, "tokens_per_cpu_s"),
             "outputs_identical": all(b["outputs_identical"] for b in batches)}  # fmt: skip
    alone, plain = alone
    engine, unpacked = (
        {
            "tokens_per_s": mean_of(runs, "tokens_per_s"),
            "runs": runs,
            "tokens_per_cpu_s": mean_of(runs, "tokens_per_cpu_s"),
            "outputs_identical": all(r["outputs_identical"] for r in runs),
        }
        for runs in (alone, plain)
    )
    ratios = {
        "x_one_at_a_time": top["tokens_per_s"] / single["tokens_per_s"],
        "x_generate_batch": top["tokens_per_s"] / batch["tokens_per_s"],
        "engine_alone_x_generate_batch": engine["tokens_per_s"] / batch["tokens_per_s"],
        "server_x_engine_alone": top["tokens_per_s"] / engine["tokens_per_s"],
        "packed_x_plain_linear": engine["tokens_per_s"] / unpacked["tokens_per_s"],
        "per_cpu_s_x_generate_batch": top["tokens_per_cpu_s"] / batch["tokens_per_cpu_s"],
        "engine_alone_per_cpu_s_x_generate_batch": engine["tokens_per_cpu_s"] / batch["tokens_per_cpu_s"],
    }
    identical = (single["outputs_identical"] and batch["outputs_identical"] and engine["outputs_identical"]
                 and unpacked["outputs_identical"]
                 and all(r["outputs_identical"] for r in levels_out.values()))  # fmt: skip
    met: dict[str, bool] = {k: ratios[k] >= v for k, v in TARGETS.items()}
    met["identical_greedy_outputs"] = identical
    setup = {
        "model": "SmolLM2-135M-Instruct",
        "prompts": "mixed test split",
        "n": n,
        "single_n": single_n,
        "max_new_tokens": args.max_new_tokens,
        "max_batch_size": args.max_batch_size,
        "policy": args.policy,
        "packed_min_size": MIN_SIZE,
        "greedy": True,
        "order": ["one_at_a_time", *ABCCBA(levels[-1]), *[f"server {c}" for c in reversed(levels[:-1])]],
        "reference": "generate_batch's first run (all prompts); one_at_a_time is compared on the first single_n",
        "cpu_s": "this process's for one_at_a_time, generate_batch, engine_alone(_plain_linear); the server "
        "process's for server",
    }
    return {
        "setup": setup,
        "one_at_a_time": single,
        "generate_batch": batch,
        "engine_alone": engine,
        "engine_alone_plain_linear": unpacked,
        "server": levels_out,
        f"ratios_at_{levels[-1]}_clients": ratios,
        "targets": TARGETS,
        "met": met,
        "outputs_identical": identical,
    }


if __name__ == "__main__":
    sys.exit(run_main(main))
