"""Decision rules of `routed-lora` scored offline on `bench/experiments/lifelong_diagnose.py` caches, in seconds.

    python bench/experiments/lifelong_rules.py runs/diag/quick_val.pt [more caches] --json bench/results/lifelong_rules.json

For each cache (one trained run: frozen and per-adapter embeddings of every evaluation text), every rule's
task-agnostic metrics (as `bench/lifelong.py` computes them: last, avg, transfer_retention, heldout_change,
last_with_heldout_labels), the split of its errors on the learned tasks after the last task into routing
errors (a label of the wrong task) and within-task errors (right task, wrong label), where the Banking77
probe's losses come from, and how well candidate signals separate the learned tasks' texts from texts of no
learned task (AUROC). `own_rule_matches` checks that the offline rule of the cache's own method reproduces
the method's own scores (`scores` in the cache): the rules here are the code's, not a paraphrase.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from sklearn.metrics import roc_auc_score

from ecru.io import atomic_write_json
from ecru.lifelong.methods.base import TrainConfig
from ecru.lifelong.methods.registry import ROUTED
from ecru.lifelong.methods.routed import OFFSET
from ecru.lifelong.router import (
    FROZEN,
    LDARouter,
    class_prototypes,
    class_statistics,
    loo_prototype_scores,
    pooled_lda_head,
    routing_threshold,
)

SCALE = TrainConfig().scale  # the adapters' inverse temperature, as trained


class Cache:
    """A diagnose cache with the index bookkeeping every rule needs."""

    def __init__(self, path: Path):
        c = torch.load(path, weights_only=False)
        self.raw, self.path = c, path
        self.names, self.task_names = c["names"], c["task_names"]
        col = {n: k for k, n in enumerate(self.names)}
        self.T, self.spans, self.N = len(self.task_names), c["spans"], c["eval_frozen"].shape[0]
        self.F, self.A, self.NE = c["eval_frozen"], c["eval_adapted"], c["name_emb"]
        self.P, self.TH = c["router"]["prototypes"], torch.tensor(c["router"]["thresholds"])
        self.gold = torch.tensor([col[g] for g in c["gold"]])
        self.cols = [torch.tensor([col[n] for n in t]) for t in self.task_names]
        self.held = torch.tensor([col[n] for n in c["heldout_names"]])
        self.text_task = torch.full((self.N,), -1)
        for j in range(self.T):
            self.text_task[self.spans[j] : self.spans[j + 1]] = j
        self.label_task = torch.full((len(self.names),), -1)
        for t, cols in enumerate(self.cols):
            self.label_task[cols] = t
        train_col = torch.tensor([col[g] for g in c["train_gold"]])
        self.train = (c["train_frozen"].double(), torch.tensor(c["train_task"]), train_col)
        self._lda: dict[int, torch.Tensor] = {}
        self.AP = adapter_prototypes(c, self) if "train_adapted" in c else None
        self._class_thresholds: dict[float, torch.Tensor] = {}
        # caches made with `rmd_percentile`: every LDA rule at the cache's own percentile rejects as its router did
        self.rmd = self._rmd_rejects if c["router"].get("rmd_thresholds") else None
        self._rejects: dict[int, torch.Tensor] = {}

    def _rmd_rejects(self, k: int) -> torch.Tensor:
        """[N] whether the cache's own router rejects each text after k tasks: its prototype test and its
        relative Mahalanobis test, by the router's code (the thresholds are the saved ones)."""
        if k not in self._rejects:
            router = LDARouter(percentile=0.0, rmd_percentile=0.0)  # percentiles unused: saved thresholds
            router.load_state_dict({key: v[:k] for key, v in self.raw["router"].items()})
            self._rejects[k] = router(self.F) == FROZEN
        return self._rejects[k]

    def learned(self, k: int) -> torch.Tensor:
        return torch.cat(self.cols[:k]) if k else torch.zeros(0, dtype=torch.long)

    def lda(self, k: int) -> torch.Tensor:
        """[N, C_learned] LDA logits after k tasks, as `LDARouter.logits` computes them."""
        if k not in self._lda:
            w, b = lda_head_after(self.train, self.cols, k)
            self._lda[k] = self.F @ w.T.to(self.F.dtype) + b.to(self.F.dtype)
        return self._lda[k]


def adapter_prototypes(raw: dict, c: Cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each task's adapter prototypes and their counts (`RoutedAdapters._adapter_prototypes`) from the cache's
    training texts through their own task's adapter (`train_adapted`, caches built since them)."""
    _, task, col = c.train
    out = []
    for t in range(c.T):
        rows = task == t
        index = {int(g): k for k, g in enumerate(c.cols[t])}
        local = torch.tensor([index[int(g)] for g in col[rows]])
        out.append((class_prototypes(raw["train_adapted"][rows], local, len(c.cols[t])),
                    torch.bincount(local, minlength=len(c.cols[t])).float()))  # fmt: skip
    return out


def lda_head_after(
    train: tuple[torch.Tensor, torch.Tensor, torch.Tensor], cols: list[torch.Tensor], k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`LDARouter`'s head (weights [C, D], biases [C], float32) after k tasks, from the training texts' frozen
    embeddings, task and label column (`train`) and each task's label columns `cols`: the router's own
    `class_statistics` of each task, then its `pooled_lda_head`."""
    emb, task, label = train
    stats = []
    for t in range(k):
        rows = task == t
        local = (label[rows, None] == cols[t][None, :]).int().argmax(-1)  # the label's index in its task
        stats.append(class_statistics(emb[rows], local, len(cols[t])))
    weight, bias = pooled_lda_head(*zip(*stats, strict=True))
    return weight.float(), bias.float()


def ncm(c: Cache, k: int) -> torch.Tensor:
    s = c.F @ c.NE.T
    for t in range(k):
        s[:, c.cols[t]] = c.F @ c.P[t].T
    return s


def thresholds_at(c: Cache, percentile: float) -> torch.Tensor:
    """Each task's routing threshold at `percentile` of its training texts' leave-one-out prototype scores,
    as the router sets it (`router.routing_threshold`), from the cache's frozen training embeddings."""
    emb, task, col = c.train
    out = []
    for t in range(c.T):
        rows = task == t
        index = {int(g): k for k, g in enumerate(c.cols[t])}  # a label's row in the task's prototypes
        local = torch.tensor([index[int(g)] for g in col[rows]])
        own = loo_prototype_scores(emb[rows].float(), local, len(c.cols[t]))
        out.append(routing_threshold(own, None, percentile=percentile, negative_quantile=None))
    return torch.tensor(out)


def class_thresholds_at(c: Cache, percentile: float) -> torch.Tensor:
    """Per label column: the `percentile` of its own training texts' leave-one-out cosines to its class mean
    (a class of one text: -inf, it never rejects)."""
    emb, _, col = c.train
    out = torch.full((len(c.names),), float("-inf"))
    for g in col.unique().tolist():
        e = emb[col == g].float()
        if len(e) > 1:
            own = (e * torch.nn.functional.normalize(e.sum(0, keepdim=True) - e, dim=-1)).sum(-1)
            out[g] = torch.quantile(own, percentile / 100)
    return out


def rejected_per_class(c: Cache, k: int, percentile: float) -> torch.Tensor:
    """[N] whether each text's best LDA class rejects it: its cosine to that class's mean is below the class's
    own threshold (`class_thresholds_at`), instead of the task's best prototype against the task's threshold."""
    learned = c.learned(k)
    best = learned[c.lda(k).argmax(-1)]
    proto = torch.cat([c.P[t] for t in range(k)])  # rows in the order of c.learned(k)
    row = torch.full((len(c.names),), -1)
    row[learned] = torch.arange(len(learned))
    if percentile not in c._class_thresholds:  # the same for every k and every metric: computed once
        c._class_thresholds[percentile] = class_thresholds_at(c, percentile)
    return (c.F * proto[row[best]]).sum(-1) < c._class_thresholds[percentile][best]


def routed(c: Cache, k: int, *, route: str = "proto", w: float = 0.5, lda_weight: float = 0.0,
           margin: float | list[float] = 0.0, penalty: float = 2.0, percentile: float | None = None,
           class_percentile: float | None = None, adapter_prototype_weight: float = 0.0,
           adapter_prototype_support: float = 8.0) -> torch.Tensor:  # fmt: skip
    """`RoutedEncoder.scores` after k tasks: route by prototypes or LDA, the prototype threshold, task then
    class with the blend (1 - w) adapter cosine + w prototype cosine + lda_weight / scale x LDA logit
    + w_c x the adapter cosine to label c's adapter prototype, w_c = adapter_prototype_weight x n_c / (n_c +
    adapter_prototype_support) for n_c training texts (needs `train_adapted`).
    `class_percentile` (LDA route): reject by the best class's own threshold instead of the task's. `margin`:
    one for every task, or one per task (`RoutedConfig.few_margin`)."""
    s = c.F @ c.NE.T
    proto = torch.stack([(c.F @ c.P[t].T).max(-1).values for t in range(k)], -1)
    if route == "lda":
        owner = c.label_task[c.learned(k)]
        task = owner[c.lda(k).argmax(-1)]
    else:
        task = proto.argmax(-1)
    th = c.TH if percentile is None else thresholds_at(c, percentile)
    rejected = proto.gather(1, task[:, None])[:, 0] < th[task]
    if percentile is None and route == "lda" and c.rmd is not None:  # the cache's own router, its test too
        rejected = c.rmd(k)
    if class_percentile is not None:
        rejected = rejected_per_class(c, k, class_percentile)
    learned = torch.zeros(len(c.names), dtype=torch.bool)
    learned[c.learned(k)] = True
    out = s.clone()
    for t in range(k):
        rows = (task == t).nonzero().flatten()
        own = c.cols[t]
        blend = (1 - w) * c.A[t, rows] @ c.NE[own].T + w * c.F[rows] @ c.P[t].T
        if lda_weight:
            blend = blend + lda_weight / SCALE * c.lda(k)[rows][:, c.label_task[c.learned(k)] == t]
        if adapter_prototype_weight:
            protos, n = c.AP[t]
            blend = blend + c.A[t, rows] @ protos.T * adapter_prototype_weight * n / (
                n + adapter_prototype_support
            )
        block = s[rows].clone()
        other = learned.clone()
        other[own] = False
        m = margin[t] if isinstance(margin, list) else margin
        block[:, other] -= OFFSET - min(m, 0.0)  # as RoutedEncoder._task_then_class
        best = (c.F[rows] @ c.NE[own].T).max(-1, keepdim=True).values
        block[:, own] = best + m + blend - blend.max(-1, keepdim=True).values
        block[:, learned] -= penalty * rejected[rows].float()[:, None]
        out[rows] = block
    return out


def lda_alone(c: Cache, k: int) -> torch.Tensor:
    """Training-free streaming LDA over the frozen embeddings: the learned labels' LDA logits, and far below
    them the frozen cosines of the unlearned ones (so only its `last` means anything: no open-set rule)."""
    s = c.F @ c.NE.T - 1e4
    s[:, c.learned(k)] = c.lda(k)
    return s


RULES = {
    "zeroshot": lambda c, k: c.F @ c.NE.T,
    "ncm": ncm,
    "LDA alone (training-free; only last is meaningful)": lda_alone,
    "routed-lora-proto (prototype route, blend 0.5)": routed,
    "prototype route, adapter only": lambda c, k: routed(c, k, w=0.0),
    "prototype route, blend 0.7": lambda c, k: routed(c, k, w=0.7),
    "LDA route, blend 0.5": lambda c, k: routed(c, k, route="lda"),
    "prototype route, adapter + LDA 0.05": lambda c, k: routed(c, k, w=0.0, lda_weight=0.05),
    "LDA route, adapter + LDA 0.05 (routed-lora before adapter prototypes)": lambda c, k: routed(c, k, route="lda", w=0.0, lda_weight=0.05),
    **{
        f"routed-lora, rejection threshold at percentile {q}": (
            lambda c, k, q=q: routed(c, k, route="lda", w=0.0, lda_weight=0.05, percentile=q)
        )
        for q in (5, 10, 20, 30, 50)
    },
    **{
        f"routed-lora, margin {m}": (
            lambda c, k, m=m: routed(c, k, route="lda", w=0.0, lda_weight=0.05, margin=m)
        )
        for m in (-0.1, -0.05, -0.02, 0.02)
    },
    **{
        f"routed-lora, per-class rejection threshold at percentile {q}": (
            lambda c, k, q=q: routed(c, k, route="lda", w=0.0, lda_weight=0.05, class_percentile=q)
        )
        for q in (2, 5, 10)
    },
    "LDA route, adapter + LDA 0.1": lambda c, k: routed(c, k, route="lda", w=0.0, lda_weight=0.1),
    "LDA route, adapter + LDA 0.05, reject penalty 0.05": lambda c, k: routed(
        c, k, route="lda", w=0.0, lda_weight=0.05, penalty=0.05
    ),
}  # fmt: skip


_P = ROUTED["routed-lora"]
PRESET = (f"routed-lora (LDA route, adapter + LDA {_P.lda_weight:g} + adapter prototypes "
          f"{_P.adapter_prototype_weight:g}, half at {_P.adapter_prototype_support:g})")  # fmt: skip
ADAPTER_PROTOTYPE_RULES = {
    f"LDA route, adapter + LDA 0.05 + adapter prototypes {w}, half at {n:g}": (
        lambda c, k, w=w, n=n: routed(c, k, route="lda", w=0.0, lda_weight=0.05, adapter_prototype_weight=w,
                                      adapter_prototype_support=n)
    )
    for w in (1.0, 1.5, 2.0) for n in (4.0, 8.0, 16.0)
}  # fmt: skip
"""Rules that need the training texts through their adapters (caches with `train_adapted`)."""
ADAPTER_PROTOTYPE_RULES.pop(
    PRESET.removeprefix("routed-lora (").removesuffix(")"), None
)  # listed once, as the preset
ADAPTER_PROTOTYPE_RULES[PRESET] = lambda c, k: routed(
    c,
    k,
    route="lda",
    w=0.0,
    lda_weight=_P.lda_weight,
    adapter_prototype_weight=_P.adapter_prototype_weight,
    adapter_prototype_support=_P.adapter_prototype_support,
)


def _acc(c: Cache, s: torch.Tensor, lo: int, hi: int, cand: torch.Tensor) -> float:
    cand = torch.tensor(sorted(set(cand.tolist())))
    pred = cand[s[lo:hi][:, cand].argmax(-1)]
    return 100.0 * (pred == c.gold[lo:hi]).float().mean().item()


def metrics(c: Cache, rule) -> dict[str, float]:
    """The task-agnostic metrics of `bench/lifelong.py` for `rule`."""
    T, sp = c.T, c.spans
    s0 = c.F @ c.NE.T
    r0 = [_acc(c, s0, sp[j], sp[j + 1], c.cols[j]) for j in range(T)]
    h0 = _acc(c, s0, sp[T], c.N, c.held)
    R, held = [], []
    for k in range(1, T + 1):
        s, L = rule(c, k), c.learned(k)
        R.append([_acc(c, s, sp[j], sp[j + 1], torch.cat([L, c.cols[j]])) for j in range(T)])
        held.append(_acc(c, s, sp[T], c.N, torch.cat([L, c.held])))
    transfer = sum(sum(R[i][j] for i in range(j)) / j for j in range(1, T)) / (T - 1)
    dis = _acc(c, rule(c, T), 0, sp[T], torch.cat([c.learned(T), c.held]))
    return {"last": sum(R[-1]) / T, "avg": sum(map(sum, R)) / T / T,
            "transfer_retention": transfer - sum(r0[1:]) / (T - 1), "heldout_change": held[-1] - h0,
            "last_with_heldout_labels": dis}  # fmt: skip


def error_split(c: Cache, rule) -> dict[str, float]:
    """Points lost on the learned tasks after the last task: a wrong task's label vs the right task's wrong one."""
    L, hi = c.learned(c.T), c.spans[c.T]
    pred = L[rule(c, c.T)[:hi][:, L].argmax(-1)]
    right_task = c.label_task[pred] == c.text_task[:hi]
    wrong = pred != c.gold[:hi]
    return {"task_wrong": 100.0 * (~right_task).float().mean().item(),
            "task_right_label_wrong": 100.0 * (right_task & wrong).float().mean().item()}  # fmt: skip


def heldout_breakdown(c: Cache, rule) -> dict[str, int]:
    """Banking77 after the last task against before the first: texts lost and gained, and whether the router
    had rejected them (rejected texts get the frozen model's answer among Banking77's labels)."""
    lo, T = c.spans[c.T], c.T
    cand = torch.tensor(sorted(set(torch.cat([c.learned(T), c.held]).tolist())))
    before = c.held[(c.F[lo:] @ c.NE[c.held].T).argmax(-1)] == c.gold[lo:]
    pred = cand[rule(c, T)[lo:][:, cand].argmax(-1)]
    after = pred == c.gold[lo:]
    proto = torch.stack([(c.F[lo:] @ c.P[t].T).max(-1).values for t in range(T)], -1)
    best, task = proto.max(-1)
    rejected = best < c.TH[task]
    lost = (before & ~after).nonzero().flatten().tolist()
    return {"texts": c.N - lo, "rejected": int(rejected.sum()), "lost": len(lost),
            "lost_not_rejected": int((before & ~after & ~rejected).sum()), "gained": int((~before & after).sum()),
            "answered_with_a_learned_label": int((c.label_task[pred] >= 0).sum()),
            "lost_texts": [{"gold": c.names[c.gold[lo + i]], "answered": c.names[pred[i]],
                            "answered_task": int(c.label_task[pred[i]])} for i in lost]}  # fmt: skip


def open_set_auroc(c: Cache) -> dict[str, dict[str, float]]:
    """AUROC of signals that a text belongs to a learned task: learned tasks' texts vs Banking77 (after the
    last task), and task 1's texts vs the other tasks' (after task 1)."""

    def signals(k: int, rows: torch.Tensor) -> dict[str, torch.Tensor]:
        proto = torch.stack([(c.F[rows] @ c.P[t].T).max(-1).values for t in range(k)], -1)
        best, task = proto.max(-1)
        adapter = torch.stack(
            [(c.A[t, r] @ c.NE[c.cols[t]].T).max() for t, r in zip(task, rows, strict=True)]
        )
        frozen = torch.stack([(c.F[r] @ c.NE[c.cols[t]].T).max() for t, r in zip(task, rows, strict=True)])
        energy = torch.stack([torch.logsumexp(SCALE * c.A[t, r] @ c.NE[c.cols[t]].T, -1)
                              for t, r in zip(task, rows, strict=True)])  # fmt: skip
        return {"prototype cosine - task threshold": best - c.TH[task], "prototype cosine": best,
                "LDA max logit": c.lda(k)[rows].max(-1).values, "adapter max cosine to names": adapter,
                "adapter energy (logsumexp)": energy, "adapter - frozen max cosine": frozen - adapter}  # fmt: skip

    def auroc(k: int, pos: torch.Tensor, neg: torch.Tensor) -> dict[str, float]:
        sp, sn = signals(k, pos), signals(k, neg)
        y = [1] * len(pos) + [0] * len(neg)
        return {key: roc_auc_score(y, torch.cat([sp[key], sn[key]]).numpy()) for key in sp}

    T, sp = c.T, c.spans
    return {"learned_vs_banking77": auroc(T, torch.arange(sp[T]), torch.arange(sp[T], c.N)),
            "task1_vs_unseen_tasks": auroc(1, torch.arange(sp[1]), torch.arange(sp[1], sp[T]))}  # fmt: skip


def own_margins(c: Cache, cfg: dict) -> list[float]:
    """Each task's margin as `RoutedAdapters.margin` sets it (`few_margin` for a task of fewer than `few_texts`
    texts per label: the adapter prototypes' counts are its training texts per label)."""
    margin, few = cfg.get("margin") or 0.0, cfg.get("few_margin")
    if few is None or c.AP is None:
        return [margin] * c.T
    return [
        few if c.AP[t][1].sum() < cfg.get("few_texts", 8.0) * len(c.AP[t][1]) else margin for t in range(c.T)
    ]


def own_rule_matches(c: Cache) -> bool | None:
    """Whether the offline rule of the cache's method reproduces the method's own scores (None: not cached)."""
    if "scores" not in c.raw:
        return None
    cfg = c.raw.get("method_config", {})
    lda = cfg.get("router", "prototypes") == "lda"
    want = routed(c, c.T, route="lda" if lda else "proto", w=cfg.get("prototype_weight", 0.0 if lda else 0.5),
                  lda_weight=cfg.get("lda_weight", 0.0), margin=own_margins(c, cfg),
                  penalty=cfg.get("reject_penalty", 2.0),
                  adapter_prototype_weight=cfg.get("adapter_prototype_weight", 0.0),
                  adapter_prototype_support=cfg.get("adapter_prototype_support", 8.0))  # fmt: skip
    return bool(torch.allclose(want, c.raw["scores"], atol=1e-4))


def analyse(path: Path) -> dict:
    c = Cache(path)
    rules = RULES | (ADAPTER_PROTOTYPE_RULES if c.AP is not None else {})
    proto, lda = (
        "routed-lora-proto (prototype route, blend 0.5)",
        "LDA route, adapter + LDA 0.05 (routed-lora before adapter prototypes)",
    )
    ours = PRESET if c.AP is not None else lda
    # the thresholds recomputed from the cache at the preset's percentile are the router's own
    same = bool(torch.allclose(thresholds_at(c, ROUTED["routed-lora"].percentile), c.TH, atol=1e-5))
    return {"cache": str(path), "config": c.raw["config"], "own_rule_matches": own_rule_matches(c),
            "thresholds_match_router": same,
            "rules": {name: metrics(c, rule) for name, rule in rules.items()},
            "error_split": {name: error_split(c, rules[name]) for name in dict.fromkeys(("ncm", proto, lda, ours))},
            "heldout_breakdown": {name: heldout_breakdown(c, rules[name]) for name in dict.fromkeys((proto, ours))},
            "open_set_auroc": open_set_auroc(c)}  # fmt: skip


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "caches", type=Path, nargs="+", help="caches written by bench/experiments/lifelong_diagnose.py"
    )
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    args = p.parse_args(argv)
    out = []
    for path in args.caches:
        res = analyse(path)
        out.append(res)
        print(f"\n{path} (own rule reproduces the method's scores: {res['own_rule_matches']})")
        for name, m in res["rules"].items():
            print(f"  {name:<52}" + " ".join(f"{k[:12]} {v:6.2f}" for k, v in m.items()))
        for name, e in res["error_split"].items():
            print(
                f"  errors {name:<45} task wrong {e['task_wrong']:.2f}, label wrong {e['task_right_label_wrong']:.2f}"
            )
        for name, h in res["heldout_breakdown"].items():
            lost = "; ".join(f"{x['gold']} -> {x['answered']}" for x in h["lost_texts"])
            counts = {k: v for k, v in h.items() if k != "lost_texts"}
            print(f"  Banking77 {name:<42} {counts}")
            print(f"    lost (gold -> answered): {lost}")
        for probe, a in res["open_set_auroc"].items():
            print(f"  AUROC {probe}: " + ", ".join(f"{k} {v:.3f}" for k, v in a.items()))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(args.json, out)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
