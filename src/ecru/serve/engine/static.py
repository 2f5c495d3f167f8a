"""Static-batch generation over a Hugging Face causal LM: left padding, a KV cache, per-row EOS.

Every decode step computes one token slot per row of the batch, finished or not: `slots` counts them
all, `useful` only the tokens a request actually produced (its EOS included). Their ratio is the
effective token ratio the scheduling policies try to raise.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ecru.serve.engine.sampling import SamplingParams, next_token_ids

GREEDY = SamplingParams()


@dataclass(frozen=True)
class GenerationConfig:
    """The model's special token ids; how to sample is a `SamplingParams` (greedy by default)."""

    eos_token_ids: tuple[int, ...]
    """Tokens that end a response (the EOS is kept in the output and counted as a useful token)."""
    pad_token_id: int
    """Token fed to padded prompt positions and to rows that have finished."""

    def __post_init__(self):
        if not self.eos_token_ids:
            raise ValueError(
                "eos_token_ids is empty: give the tokenizer's EOS id(s), e.g. (tok.eos_token_id,)"
            )

    @classmethod
    def for_model(cls, model, tokenizer) -> GenerationConfig:
        """EOS ids: the tokenizer's and every one of the model's generation config (a list in e.g. Llama 3 and
        Qwen 2 chat models, whose answers end at any of them); padding: the tokenizer's, else the first EOS.
        The one rule every path that generates uses (`ServedModel`, labels, the static runs)."""
        ids = {tokenizer.eos_token_id}
        eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        ids.update(eos if isinstance(eos, list) else [eos])
        eos_ids = tuple(sorted(int(i) for i in ids if i is not None))
        if not eos_ids:
            raise ValueError(
                "neither the tokenizer nor the model's generation config names an EOS token, so no answer "
                "could end: set eos_token in tokenizer_config.json or eos_token_id in generation_config.json"
            )
        pad = tokenizer.pad_token_id
        return cls(eos_token_ids=eos_ids, pad_token_id=int(pad if pad is not None else eos_ids[0]))


def context_length(model) -> int:
    """The longest prompt + answer `model` takes: its (text) config's `max_position_embeddings`, else 2048."""
    return int(getattr(model.config.get_text_config(), "max_position_embeddings", None) or 2048)


@dataclass
class BatchResult:
    """Outputs of one static batch, in the order its prompts were given."""

    tokens: list[list[int]]
    """Generated token ids per row (EOS included when produced)."""
    ended: list[bool]
    """Whether each row produced an EOS (False: it was cut at its budget, by default the batch's max_new_tokens)."""
    steps: int
    """Decode steps the batch ran (the longest row's length)."""
    slots: int
    """Token slots computed: rows x steps."""
    prompt_slots: int
    """Prompt positions computed at prefill, padding included: rows x longest prompt (0 for `resume_static`)."""
    kept: list[list[tuple[torch.Tensor, torch.Tensor]] | None] | None = None
    """With `keep_cut`: per row, the KV cache of a row cut at the last step without an EOS (`resume_static`
    continues it), else None."""

    @property
    def useful(self) -> int:
        """Slots that produced a real token (EOS included)."""
        return sum(len(t) for t in self.tokens)


def left_pad(prompts: Sequence[Sequence[int]], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`(input_ids, attention_mask)` [B, T], prompts right-aligned so every row's next token is at T."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token (and the batch at least one prompt)")
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, width - len(p) :] = torch.as_tensor(list(p), dtype=torch.long)
        mask[row, width - len(p) :] = 1
    return ids, mask


def positions(mask: torch.Tensor) -> torch.Tensor:
    """Position ids of a left-padded batch: 0 at each row's first real token (padding clamped to 0)."""
    return (mask.cumsum(-1) - 1).clamp_min(0)


def forward(model, ids: torch.Tensor, mask: torch.Tensor, cache) -> torch.Tensor:
    """Run `ids` [B, q] after the cached positions; `mask` [B, cached + q]. Returns last logits [B, V].

    Only the last position goes through the LM head (`logits_to_keep=1`, as `generate` does): a prefill
    would otherwise spend a vocabulary-sized matmul on every prompt token."""
    return _run(model, ids, mask, cache).logits[:, -1]


def forward_states(model, ids: torch.Tensor, mask: torch.Tensor, cache) -> tuple[torch.Tensor, torch.Tensor]:
    """`forward`'s last logits [B, V] and, from the same forward, the decoder's output, the last hidden state
    after the final norm, at every position of `ids`: [B, q, H]."""
    seen = []  # the decoder's output, caught by a hook: only the last layer's states are kept
    hook = model.get_decoder().register_forward_hook(lambda mod, args, out: seen.append(out[0]))
    try:
        logits = _run(model, ids, mask, cache).logits[:, -1]
    finally:
        hook.remove()
    return logits, seen[0]


def _run(model, ids: torch.Tensor, mask: torch.Tensor, cache):
    pos = positions(mask)[:, -ids.shape[1] :]
    return model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache, use_cache=True,
                 logits_to_keep=1)  # fmt: skip


def new_cache(model):
    """An empty KV cache for `model`: Hugging Face's `DynamicCache` appending into spare capacity."""
    from ecru.serve.engine.kv_cache import HeadroomCache

    return HeadroomCache(model.config)


@torch.no_grad()
def generate_static(
    model,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    config: GenerationConfig,
    params: SamplingParams = GREEDY,
    budgets: Sequence[int] | None = None,
    keep_cut: bool = False,
) -> BatchResult:
    """Generate for one static batch until every row has an EOS or its budget of tokens: `budgets` per row
    (each within 1..max_new_tokens), or `max_new_tokens` for every row, sampled as `params` says (temperature,
    top-k, top-p, seed). `keep_cut`: copy out the KV of the rows cut at the last step, for `resume_static`."""
    budgets = _budgets(budgets, len(prompts), max_new_tokens)
    device = next(model.parameters()).device
    ids, mask = (t.to(device) for t in left_pad(prompts, config.pad_token_id))
    cache = new_cache(model)
    logits = forward(model, ids, mask, cache)
    return _decode(
        model, logits, mask, cache, budgets, max_new_tokens, config, params, int(ids.numel()), keep_cut
    )


@torch.no_grad()
def resume_static(
    model,
    kept: Sequence[list[tuple[torch.Tensor, torch.Tensor]]],
    pending: Sequence[int],
    *,
    max_new_tokens: int,
    config: GenerationConfig,
    params: SamplingParams = GREEDY,
    budgets: Sequence[int] | None = None,
) -> BatchResult:
    """`generate_static` for rows cut earlier whose KV was kept (`BatchResult.kept`): each row's cache and its
    `pending` token (its last generated, not yet fed) continue without a prefill. Greedy, the tokens are the
    ones an uninterrupted generation would have produced after `pending`."""
    from ecru.serve.engine.kv_cache import stack_rows

    if len(kept) != len(pending):
        raise ValueError(f"one pending token per kept row: {len(kept)} rows, {len(pending)} tokens")
    budgets = _budgets(budgets, len(kept), max_new_tokens)
    device = next(model.parameters()).device
    mask, cache = stack_rows(model.config, kept)
    mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1).to(device)
    logits = forward(model, torch.tensor(list(pending), device=device)[:, None], mask, cache)
    return _decode(model, logits, mask, cache, budgets, max_new_tokens, config, params, 0, False)


def _budgets(budgets: Sequence[int] | None, rows: int, max_new_tokens: int) -> list[int]:
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    budgets = [max_new_tokens] * rows if budgets is None else list(budgets)
    if len(budgets) != rows or not all(1 <= b <= max_new_tokens for b in budgets):
        raise ValueError(f"budgets must be one per prompt, each in 1..{max_new_tokens}, got {budgets}")
    return budgets


def _decode(
    model, logits, mask, cache, budgets, max_new_tokens, config, params, prompt_slots, keep_cut
) -> BatchResult:
    """The decode loop of a static batch from its first logits; every row stops at an EOS or its budget."""
    device = logits.device
    eos = torch.tensor(config.eos_token_ids, device=device)
    seeded = params.seed is not None and not params.greedy
    gen = torch.Generator(device=device).manual_seed(params.seed) if seeded else None
    rows = len(budgets)
    params, no_output = [params] * rows, [()] * rows
    done = torch.zeros(len(budgets), dtype=torch.bool, device=device)
    ended, limit = done.clone(), torch.tensor(budgets, device=device)
    columns = []
    for step in range(max_new_tokens):
        tok = next_token_ids(logits, params, no_output, [gen] * rows)  # the engine's sampling, row by row
        tok = torch.where(done, config.pad_token_id, tok)
        columns.append(torch.where(done, -1, tok))  # -1 marks slots after a row has finished
        hit = torch.isin(tok, eos) & ~done
        ended |= hit
        done |= hit | (limit <= step + 1)
        if bool(done.all()) or step + 1 == max_new_tokens:
            break
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        logits = forward(model, tok[:, None], mask, cache)
    table = torch.stack(columns, dim=1).tolist()
    tokens = [[t for t in row if t >= 0] for row in table]
    steps = len(columns)
    return BatchResult(
        tokens=tokens,
        ended=ended.tolist(),
        steps=steps,
        slots=len(budgets) * steps,
        prompt_slots=prompt_slots,
        kept=_kept(cache, mask, tokens, ended.tolist(), steps) if keep_cut else None,
    )


def _kept(cache, mask, tokens, ended, steps) -> list:
    """The KV of each row cut at the last step (no EOS, `steps` tokens): every cached position it holds, its
    last token excepted (not fed); None for the other rows."""
    from ecru.serve.engine.kv_cache import row_kv

    held = mask.sum(-1).tolist()  # a row live to the last step has no padding after its prompt
    return [
        row_kv(cache, r, held[r]) if not e and len(t) == steps else None
        for r, (t, e) in enumerate(zip(tokens, ended, strict=True))
    ]
