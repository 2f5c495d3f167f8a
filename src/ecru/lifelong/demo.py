"""The lifelong section of `ecru demo`: a tiny CLINC stream, zero-shot vs sequential fine-tuning vs ecru."""

from __future__ import annotations

import numpy as np

from ecru.demo.plots import new_figure, save
from ecru.demo.report import DemoContext, Section

METHODS = ("zeroshot", "seqft", "ecru")
KEYS = ("last", "avg", "transfer_retention", "bwt", "heldout_drop")


def _plot(results: dict, ctx: DemoContext) -> list[str]:
    fig, axes = new_figure(width=11, height=3.2, ncols=len(results) + 1)
    for ax, (name, res) in zip(axes, results.items(), strict=False):
        R = np.array(res.R)
        ax.imshow(R, vmin=40, vmax=100, cmap="viridis")
        for (i, j), v in np.ndenumerate(R):
            ax.text(j, i, f"{v:.0f}", ha="center", va="center", fontsize=8, color="w")
        ticks, labels = range(len(R)), [str(t + 1) for t in range(len(R))]
        ax.set(title=name, xlabel="task", ylabel="after task", xticks=ticks, yticks=ticks,
               xticklabels=labels, yticklabels=labels)  # fmt: skip
    bar = axes[-1]
    width = 0.8 / len(results)
    for k, (name, res) in enumerate(results.items()):
        bar.bar(np.arange(len(KEYS)) + k * width, [res.metrics[m] for m in KEYS], width, label=name)
    bar.set_xticks(np.arange(len(KEYS)) + width, [k.replace("_", "\n") for k in KEYS], fontsize=7)
    bar.axhline(0, color="grey", lw=0.5)
    bar.legend(fontsize=7)
    bar.set(title="metrics (points)")
    return [save(fig, ctx.out / "lifelong.png")]


def section(ctx: DemoContext) -> Section:
    from ecru.lifelong.experiment import Experiment
    from ecru.lifelong.methods import TrainConfig
    from ecru.lifelong.stream import StreamConfig

    stream = StreamConfig(
        tasks=3, train_per_intent=4, test_per_intent=3, heldout_per_class=2, reference_size=200
    )
    exp = Experiment(stream, log=ctx.log)
    train = TrainConfig(epochs=2, batch_size=16, progress=False)
    results = {name: exp.run(name, train) for name in METHODS}
    rows = [{"method": n, **{k: round(r.metrics[k], 2) for k in KEYS},
             "trainable_params": int(r.cost["trainable_params"]), "train_s_per_task": round(r.cost["wall_s"], 1)}
            for n, r in results.items()]  # fmt: skip
    ecru, seqft = results["ecru"], results["seqft"]
    return Section(
        "lifelong",
        {
            "ecru_last": ecru.metrics["last"],
            "ecru_transfer_retention": ecru.metrics["transfer_retention"],
            "seqft_transfer_retention": seqft.metrics["transfer_retention"],
            "ecru_trainable_frac": ecru.cost["trainable_params"] / max(1, seqft.cost["trainable_params"]),
        },
        text=(
            "all-MiniLM-L6-v2 as a zero-shot intent classifier (cosine similarity to intent names) learns three "
            "CLINC150 domains one after another (4 training utterances per intent, 3 test utterances per intent, "
            "Banking77 with 2 per class as the never-trained probe). R[i][j] is the accuracy on domain j after "
            "training domain i; transfer retention is the change in zero-shot accuracy on domains not yet learned "
            "(ZSCL's definitions). ecru trains one small adapter per domain and picks it by the candidate "
            "intent names a text is classified among: names of no learned domain get exactly the pretrained "
            "model, so its transfer retention and Banking77 drop are zero by construction. A tiny stream: "
            "differences of a few points are within noise here; bench/lifelong.py runs every method."
        ),
        plots=_plot(results, ctx),
        rows=rows,
    )
