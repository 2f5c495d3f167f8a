"""The foundation section: the bundled model and data exercised for real.

SmolLM2-135M-Instruct answers a few CLINC150 test queries (greedy, token counts reported) and
all-MiniLM-L6-v2 classifies one CLINC domain zero-shot by cosine similarity to the intent names.
"""

from __future__ import annotations

import time

import torch

from ecru.datasets import humanize_intent, load_clinc
from ecru.demo.plots import new_figure, save
from ecru.demo.report import DemoContext, Section

DOMAIN = "banking"
N_QUERIES, MAX_NEW_TOKENS = 4, 48


def zero_shot_domain(domain: str, ctx: DemoContext) -> tuple[float, dict[str, float]]:
    """Overall and per-intent accuracy of MiniLM zero-shot on the domain's test utterances."""
    from ecru.models import load_minilm

    data = load_clinc()
    intents = data.domains[domain]
    examples = [e for e in data["test"] if e.domain == domain]
    model = load_minilm()
    ctx.log(f"MiniLM: encoding {len(examples)} '{domain}' test utterances and {len(intents)} intent names")
    names = model.encode([humanize_intent(i) for i in intents])
    pred = (model.encode([e.text for e in examples]) @ names.T).argmax(-1)
    gold = torch.tensor([intents.index(e.label) for e in examples])
    per_intent = {i: (pred[gold == k] == k).float().mean().item() for k, i in enumerate(intents)}
    return (pred == gold).float().mean().item(), per_intent


def answer_queries(ctx: DemoContext) -> list[dict]:
    """SmolLM2's greedy answers to the first few CLINC test queries, with generated token counts."""
    from ecru.models import load_smollm2

    ctx.log("SmolLM2: loading (the first run converts the GGUF file, ~30 s)")
    model, tok = load_smollm2()
    queries = [e.text for e in load_clinc()["test"][:: 4500 // N_QUERIES][:N_QUERIES]]
    rows = []
    for q in queries:
        ids = tok.apply_chat_template(
            [{"role": "user", "content": q}],
            add_generation_prompt=True,
            return_tensors="pt",
            return_dict=True,
        )
        start = time.perf_counter()
        with torch.no_grad():
            out = model.generate(**ids, max_new_tokens=MAX_NEW_TOKENS, do_sample=False)
        new = out[0, ids["input_ids"].shape[1] :]
        answer = tok.decode(new, skip_special_tokens=True).strip()
        rows.append(
            {"query": q, "answer": answer[:160], "tokens": int(new.numel()), "s": time.perf_counter() - start}
        )
        ctx.log(f"SmolLM2: {q!r} -> {int(new.numel())} tokens")
    return rows


def section(ctx: DemoContext) -> Section:
    acc, per_intent = zero_shot_domain(DOMAIN, ctx)
    rows = answer_queries(ctx)
    fig, (ax1, ax2) = new_figure(width=10, height=3.8, ncols=2)
    ax1.barh(list(per_intent), list(per_intent.values()), color="tab:blue")
    ax1.set(xlabel="zero-shot accuracy", title=f"MiniLM on CLINC '{DOMAIN}' (15-way)", xlim=(0, 1))
    ax1.tick_params(axis="y", labelsize=7)
    ax2.bar(range(len(rows)), [r["tokens"] for r in rows], color="tab:orange")
    ax2.set(xlabel="query", ylabel="generated tokens", title=f"SmolLM2 answers (cap {MAX_NEW_TOKENS})")
    ax2.set_xticks(range(len(rows)), [f"q{i + 1}" for i in range(len(rows))])
    plot = save(fig, ctx.out / "foundation.png")
    tokens = sum(r["tokens"] for r in rows)
    return Section(
        "foundation",
        {
            f"minilm_zeroshot_acc_{DOMAIN}": acc,
            "smollm2_tokens": tokens,
            "smollm2_tokens_per_s": tokens / sum(r["s"] for r in rows),
        },
        text=(
            f"all-MiniLM-L6-v2 classifies the {DOMAIN} domain's CLINC150 test utterances by cosine similarity "
            f"to the intent names (chance 1/15). SmolLM2-135M-Instruct answers {len(rows)} CLINC150 test "
            f"queries greedily, at most {MAX_NEW_TOKENS} new tokens each."
        ),
        plots=[plot],
        rows=rows,
        takeaway=(
            f"The bundled models run offline: MiniLM classifies {DOMAIN} queries zero-shot at {acc:.0%} "
            f"(chance {1 / len(per_intent):.0%}); SmolLM2 generates {tokens / sum(r['s'] for r in rows):.0f} tokens/s."
        ),
    )
