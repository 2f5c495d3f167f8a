"""The L2L demo section: SmolLM2-135M fine-tuned on CLINC150 utterances with L2L and with plain PyTorch.

Same initial weights, same batches, same AdamW: in fp32 the two loss curves coincide (the only
difference is the order of floating-point sums over micro-batches), and so do the final weights.
"""

from __future__ import annotations

import copy
import functools
import itertools
import time

import torch

from ecru.demo.plots import new_figure, save
from ecru.demo.report import DemoContext, Section

STEPS, BATCH, MICRO, MAX_LENGTH, LR = 8, 8, 4, 32, 1e-4


def plain_losses(model, batches: list[dict], optimizer) -> tuple[list[float], float]:
    """Ordinary training: full-batch forward, backward, optimizer step. Returns losses and mean step time."""
    opt = optimizer(model.parameters())
    losses, start = [], time.perf_counter()
    for batch in batches:
        opt.zero_grad(set_to_none=True)
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, (time.perf_counter() - start) / len(batches)


def l2l_losses(model, batches: list[dict], optimizer) -> tuple[list[float], float]:
    from ecru.l2l import L2L, L2LConfig

    engine = L2L.from_hf(model, optimizer=optimizer, config=L2LConfig(micro_batch_size=MICRO))
    start = time.perf_counter()
    losses = [engine.step(batch) for batch in batches]
    elapsed = (time.perf_counter() - start) / len(batches)
    engine.close()
    return losses, elapsed


def section(ctx: DemoContext) -> Section:
    from ecru.l2l.data import clinc_batches
    from ecru.models import load_smollm2

    ctx.log("L2L: loading SmolLM2-135M-Instruct (the first run converts the GGUF file, ~30 s)")
    model, tokenizer = load_smollm2()
    model.train()
    # one fixed batch of utterances, fitted for a few steps: a clean, comparable descent
    batches = (
        list(itertools.islice(clinc_batches(tokenizer, batch_size=BATCH, max_length=MAX_LENGTH), 1)) * STEPS
    )
    adamw = functools.partial(torch.optim.AdamW, lr=LR, fused=True)
    ctx.log(f"L2L: {STEPS} steps of plain PyTorch training (batch {BATCH})")
    reference = copy.deepcopy(model)
    plain, plain_s = plain_losses(reference, batches, adamw)
    ctx.log(f"L2L: {STEPS} steps of L2L training ({BATCH // MICRO} micro-batches of {MICRO})")
    l2l, l2l_s = l2l_losses(model, batches, adamw)
    weight_gap = max(
        (a - b).abs().max().item()
        for a, b in zip(model.state_dict().values(), reference.state_dict().values(), strict=True)
    )
    loss_gap = max(abs(a - b) for a, b in zip(plain, l2l, strict=True))
    plot = _plot(plain, l2l, ctx)
    return Section(
        "l2l",
        {
            "plain_final_loss": plain[-1],
            "l2l_final_loss": l2l[-1],
            "max_loss_gap": loss_gap,
            "max_weight_gap": weight_gap,
            "step_time_ratio": l2l_s / plain_s,
        },
        text=(
            f"SmolLM2-135M-Instruct fine-tuned for {STEPS} AdamW steps (lr {LR}) on a batch of {BATCH} CLINC150 "
            f"training utterances (at most {MAX_LENGTH} tokens each): once with plain PyTorch, once with "
            f"L2L ({BATCH // MICRO} micro-batches, blocks executed one at a time from the host parameter "
            "server, each block updated on a worker thread while the blocks below run their backward). In "
            "fp32 the curves coincide; the gaps are floating-point reordering. On a CPU there is no device "
            "memory to save, so the step time ratio shows L2L's recomputation cost (about 4/3 on the blocks)."
        ),
        plots=[plot],
        takeaway=(
            f"L2L trains SmolLM2 exactly as plain PyTorch does: {STEPS} steps, largest loss gap {loss_gap:.1e}, "
            f"largest weight gap {weight_gap:.1e}, with one block at a time on the device."
        ),
        shortfall=(
            f"L2L costs time: a step took {l2l_s / plain_s:.2f}x a plain one here (the recomputed forward); "
            "its memory saving needs a device smaller than the model, which this CPU run does not show."
        ),
        rows=[
            {"step": i + 1, "plain_loss": p, "l2l_loss": q, "gap": abs(p - q)}
            for i, (p, q) in enumerate(zip(plain, l2l, strict=True))
        ],
    )


def _plot(plain: list[float], l2l: list[float], ctx: DemoContext) -> str:
    fig, (ax1, ax2) = new_figure(width=9, height=3.4, ncols=2)
    steps = range(1, len(plain) + 1)
    ax1.plot(steps, plain, "o-", label="plain PyTorch", color="tab:blue")
    ax1.plot(steps, l2l, "x--", label="L2L", color="tab:orange")
    ax1.set(xlabel="step", ylabel="training loss", title="SmolLM2-135M on CLINC150 utterances")
    ax1.legend()
    ax2.semilogy(
        steps, [max(abs(p - q), 1e-9) for p, q in zip(plain, l2l, strict=True)], "s-", color="tab:green"
    )
    ax2.set(xlabel="step", ylabel="|loss(plain) - loss(L2L)|", title="gap (floating-point reordering)")
    return save(fig, ctx.out / "l2l.png")
