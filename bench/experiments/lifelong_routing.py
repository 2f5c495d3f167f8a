"""Where `ecru-text` (text routing) loses own-task accuracy: the router's shares, routed vs forced adapters.

    OMP_NUM_THREADS=1 python bench/experiments/lifelong_routing.py --json bench/results/lifelong_routing.json

On CLINC's validation split (never test), full data (100 training utterances per intent):
1. The router alone (frozen embeddings, the first 4 domains learned): for each threshold percentile, the
   share of a learned task's own test utterances sent to its adapter and to another task's adapter, and
   the share of the 6 unseen domains' and of Banking77's utterances sent to any adapter.
2. One task learned with the preset adapter (anchor values from --anchors): accuracy on its test
   utterances when routed, when every one is forced through the adapter, and with the frozen model.
Prints both tables and writes JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

import torch

from ecru.datasets import humanize_intent
from ecru.io import atomic_write_json
from ecru.lifelong import StreamConfig, TrainConfig, build_clinc_stream, make_method
from ecru.lifelong.evaluate import encode_sorted
from ecru.lifelong.methods import ROUTED
from ecru.lifelong.router import FROZEN, Router
from ecru.models import load_minilm


def route_shares(keys: list[torch.Tensor], own: list[torch.Tensor], foreign: dict[str, torch.Tensor], *,
                 k: int, percentile: float) -> dict[str, float]:  # fmt: skip
    """Percent of own texts (task j's, for each learned j) routed to adapter j / to another adapter, and of
    each foreign set routed to any adapter."""
    router = Router(k=k, percentile=percentile)
    for emb in keys:
        router.add_task(emb)
    routes = [router(emb) for emb in own]
    out = {
        "own_to_own": 100 * torch.cat([r == j for j, r in enumerate(routes)]).double().mean().item(),
        "own_to_other": 100 * torch.cat([(r != j) & (r != FROZEN) for j, r in enumerate(routes)]).double().mean().item(),
    }  # fmt: skip
    for name, emb in foreign.items():
        out[f"{name}_to_adapter"] = 100 * (router(emb) != FROZEN).double().mean().item()
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--learned", type=int, default=4, help="domains learned by the router")
    ap.add_argument("--percentiles", default="10,5,2,0")
    ap.add_argument("--anchors", default="3.0,0.5", help="anchor weights of the one-task adapter check")
    ap.add_argument("--json", default="bench/results/lifelong_routing.json")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    start = time.perf_counter()
    stream = build_clinc_stream(StreamConfig(tasks=10, train_per_intent=100, test_per_intent=20,
                                             heldout_per_class=40, reference_size=10, split="val"))  # fmt: skip
    enc, n = load_minilm(), args.learned
    keys = [encode_sorted(enc, [e.text for e in t.train]) for t in stream.tasks[:n]]
    tests = [encode_sorted(enc, [e.text for e in t.test]) for t in stream.tasks]
    foreign = {
        "unseen": torch.cat(tests[n:]),
        "banking77": encode_sorted(enc, [e.text for e in stream.heldout]),
    }
    knn = ROUTED["ecru-text"].knn
    shares = {
        p: route_shares(keys, tests[:n], foreign, k=knn, percentile=float(p))
        for p in args.percentiles.split(",")
    }
    print(f"router, {n} domains learned (percent):")
    for p, s in shares.items():
        print(f"  percentile {p:>3}: " + ", ".join(f"{k} {v:.1f}" for k, v in s.items()))

    task = stream.tasks[0]
    texts = [e.text for e in task.test]
    gold = torch.tensor([task.intents.index(e.label) for e in task.test])
    adapters = {}
    for anchor in (float(a) for a in args.anchors.split(",")):
        m = make_method("ecru-text", load_minilm(), train=TrainConfig(progress=False),
                        config=dataclasses.replace(ROUTED["ecru-text"], anchor=anchor))  # fmt: skip
        m.learn(task, index=0)
        routed_enc = m.encoder()
        names = routed_enc.frozen([humanize_intent(i) for i in task.intents])
        frozen, routed = routed_enc.frozen(texts), routed_enc.encode(texts)
        m.peft.base_model.set_adapter(m.adapters[0])
        forced = m.student.encode(texts)
        to_frozen = m.router(frozen) == FROZEN

        def acc(emb, g=gold, names=names):
            return 100 * ((emb @ names.T).argmax(-1) == g).double().mean().item()

        adapters[str(anchor)] = {
            "routed": acc(routed),
            "adapter_for_all": acc(forced),
            "frozen": acc(frozen),
            "share_to_frozen": 100 * to_frozen.double().mean().item(),
            "frozen_acc_on_those": acc(frozen[to_frozen], gold[to_frozen]),
            "adapter_acc_on_those": acc(forced[to_frozen], gold[to_frozen]),
        }
        print(
            f"task {task.name}, anchor {anchor}: "
            + ", ".join(f"{k} {v:.1f}" for k, v in adapters[str(anchor)].items())
        )
    out = {"config": {"learned": n, "split": "val", "knn": knn, "percentile_preset": ROUTED["ecru-text"].percentile,
                      "wall_s": time.perf_counter() - start},
           "router_shares_percent": shares, "one_task_accuracy": adapters}  # fmt: skip
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(args.json, out)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
