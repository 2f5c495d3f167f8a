"""Self-prediction: the LLM, LoRA-tuned on its own response lengths, prints how long its answer will be.

As in the paper: a query prompt asks for the length instead of the answer; the target is the label (the
max of k sampled lengths) rounded up to a multiple of `bucket`; LoRA r=8, alpha=16, dropout 0.05 on the
q/v projections. The adapter is enabled for prediction and disabled for generation, so one model is in
memory (`adapter_disabled()` wraps generation).
"""

from __future__ import annotations

import math
import re
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch.nn.utils.rnn import pad_sequence

from ecru.serve.engine.static import GenerationConfig, generate_static

QUERY = (
    "{prompt}\n\nDon't output the response for the above instruction. Instead, you need to predict the number "
    "of tokens in your response. Output one number only."
)


READOUTS = ("greedy", "expected")


@dataclass(frozen=True)
class SelfLoRAConfig:
    """Instruction tuning of the length-predicting adapter."""

    rank: int = 8
    """LoRA rank."""
    alpha: int = 16
    """LoRA scaling numerator."""
    dropout: float = 0.05
    """LoRA dropout."""
    target_modules: tuple[str, ...] = ("q_proj", "v_proj")
    """Linear layers that get an adapter (the paper: the attention query and value projections)."""
    lr: float = 5e-4
    """AdamW learning rate (the paper's 2e-5 is for thousands of examples; we have hundreds)."""
    epochs: int = 3
    """Passes over the labelled prompts."""
    batch_size: int = 8
    """Examples per optimiser step."""
    bucket: int = 50
    """Labels are rounded up to a multiple of this."""
    cap: int = 256
    """Global max_new_tokens: labels and predictions never exceed it."""
    seed: int = 0
    """Seed of the adapter init and the example order."""
    readout: str = "greedy"
    """How a prediction is read: "greedy", the number the model generates (the paper); "expected", the mean of
    the bucket numbers weighed by the model's probability of each (`bucket_log_probs`: a prefill of the query,
    then one forward of every bucket's few tokens on its cache), continuous, so prompts the model puts in the
    same bucket are still ranked."""

    def __post_init__(self):
        if self.readout not in READOUTS:
            raise ValueError(f"readout must be one of {', '.join(READOUTS)}; got {self.readout!r}")
        if (
            min(self.rank, self.alpha, self.epochs, self.batch_size, self.bucket, self.cap) < 1
            or self.lr <= 0
        ):
            raise ValueError("rank, alpha, epochs, batch_size, bucket, cap must be >= 1 and lr > 0")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")


def bucket_label(length: float, *, bucket: int, cap: int) -> int:
    """Round up to a multiple of `bucket`, then clip to `cap`."""
    return min(cap, max(bucket, bucket * math.ceil(length / bucket)))


def buckets(*, bucket: int, cap: int) -> list[int]:
    """Every value `bucket_label` can give: the multiples of `bucket` below `cap`, then `cap`."""
    return sorted({bucket_label(v, bucket=bucket, cap=cap) for v in range(1, cap + 1)})


def query_ids(tokenizer, prompts: Sequence[str]) -> list[list[int]]:
    """Each prompt wrapped in `QUERY`, as one chat-templated user turn."""
    from ecru.serve.prompts import encode_chat

    return encode_chat(tokenizer, [QUERY.format(prompt=p) for p in prompts])


def parse_length(text: str, *, cap: int) -> float | None:
    """The first integer in the model's answer, clipped to [1, cap]; None when the answer holds no number."""
    match = re.search(r"\d+", text)
    return float(min(cap, max(1, int(match.group())))) if match else None


@torch.no_grad()
def stated_lengths(
    model,
    tokenizer,
    prompts: Sequence[str],
    *,
    cap: int,
    batch_size: int = 32,
    max_tokens: int = 6,
) -> list[float | None]:
    """The length the model states when asked `QUERY` (greedy, `max_tokens` tokens, first integer; None where
    its answer holds no number)."""
    gen = GenerationConfig.for_model(model, tokenizer)
    ids = query_ids(tokenizer, prompts)
    out = []
    for i in range(0, len(ids), batch_size):
        result = generate_static(model, ids[i : i + batch_size], max_new_tokens=max_tokens, config=gen)
        texts = tokenizer.batch_decode(result.tokens, skip_special_tokens=True)
        out += [parse_length(t, cap=cap) for t in texts]
    return out


@torch.no_grad()
def bucket_log_probs(
    model, tokenizer, prompts: Sequence[str], values: Sequence[int], *, batch_size: int = 32
) -> torch.Tensor:
    """[N, len(values)] log-probability that the model, asked `QUERY`, answers each value (its digits then
    EOS). One prefill of the query per prompt; its KV cache is repeated for the values' few tokens (so a batch
    holds len(values) copies of it), and their log-probabilities are taken in float32."""
    from transformers import DynamicCache

    from ecru.serve.engine.static import left_pad, positions

    eos = tokenizer.eos_token_id
    answers = [tokenizer.encode(str(v), add_special_tokens=False) + [eos] for v in values]
    width = max(len(a) for a in answers)
    device = next(model.parameters()).device
    padded = [a + [eos] * (width - len(a)) for a in answers]  # the EOS after a shorter answer is never read
    tail = torch.tensor(padded, device=device)
    ids = query_ids(tokenizer, prompts)
    out = []
    for i in range(0, len(ids), batch_size):
        x, mask = (t.to(device) for t in left_pad(ids[i : i + batch_size], tokenizer.pad_token_id or 0))
        cache = DynamicCache(config=model.config)
        first = model(input_ids=x, attention_mask=mask, position_ids=positions(mask), past_key_values=cache,
                      use_cache=True, logits_to_keep=1).logits[:, -1].float().log_softmax(-1)  # fmt: skip
        cache.batch_repeat_interleave(len(answers))  # row b * C + c: prompt b, value c
        mask = torch.cat([mask.repeat_interleave(len(answers), 0), torch.ones(len(x) * len(answers), width, device=device,
                          dtype=mask.dtype)], dim=1)  # fmt: skip
        rest = model(input_ids=tail.repeat(len(x), 1), attention_mask=mask, position_ids=positions(mask)[:, -width:],
                     past_key_values=cache, use_cache=True).logits.float().log_softmax(-1)  # fmt: skip
        out.append(
            torch.stack(
                [_answer_log_prob(first, rest[c :: len(answers)], a) for c, a in enumerate(answers)], 1
            )
        )
    return torch.cat(out).cpu()


def _answer_log_prob(first: torch.Tensor, rest: torch.Tensor, answer: list[int]) -> torch.Tensor:
    """[B] log p(answer): its first token from `first` [B, V], token j > 0 from `rest` [B, width, V] at j - 1."""
    tokens = torch.tensor(answer, device=rest.device)
    later = rest[:, : len(answer) - 1].gather(-1, tokens[1:].expand(len(rest), -1)[..., None]).squeeze(-1)
    return first[:, answer[0]] + later.sum(-1)


class PiAPredictor:
    """Perception in advance, untuned: the base LLM is asked how many tokens its answer will have."""

    name = "pia"

    def __init__(self, model, tokenizer, *, cap: int = 256, default: float = 128.0, max_tokens: int = 16):
        self.model, self.tokenizer = model, tokenizer
        self.cap, self.default, self.max_tokens = cap, default, max_tokens
        self.parsed = 0
        """How many answers of the last `predict` held a number (the rest got `default`)."""

    def predict(self, prompts: Sequence[str]) -> list[float]:
        out = stated_lengths(self.model, self.tokenizer, prompts, cap=self.cap, max_tokens=self.max_tokens)
        self.parsed = sum(x is not None for x in out)
        return [self.default if x is None else x for x in out]


class SelfLoRAPredictor:
    """The LLM with a length adapter: `fit` tunes it, `predict` generates the number, greedily."""

    name = "self-lora"

    def __init__(self, model, tokenizer, *, config: SelfLoRAConfig = SelfLoRAConfig(), adapter_path=None):
        from peft import LoraConfig, PeftModel, get_peft_model

        self.tokenizer, self.config = tokenizer, config
        self.default = float(config.cap // 2)
        if adapter_path is not None:
            self.model = PeftModel.from_pretrained(model, str(adapter_path))
        else:
            torch.manual_seed(config.seed)
            lora = LoraConfig(
                r=config.rank,
                lora_alpha=config.alpha,
                lora_dropout=config.dropout,
                target_modules=list(config.target_modules),
            )
            self.model = get_peft_model(model, lora)
        self.model.eval()

    def _examples(self, prompts: Sequence[str], labels: Sequence[float]) -> list[tuple[list[int], int]]:
        eos = self.tokenizer.eos_token_id
        out = []
        for ids, y in zip(query_ids(self.tokenizer, prompts), labels, strict=True):
            answer = self.tokenizer.encode(
                str(bucket_label(y, bucket=self.config.bucket, cap=self.config.cap)), add_special_tokens=False
            )
            out.append((ids + answer + [eos], len(ids)))
        return out

    def fit(
        self,
        prompts: Sequence[str],
        labels: Sequence[float],
        *,
        progress: bool = True,
        after_epoch: Callable[[int], None] | None = None,
    ) -> SelfLoRAPredictor:
        """Teacher-forced cross-entropy on the answer tokens only, AdamW on the LoRA weights. `after_epoch(e)`
        is called after epoch e (1-based) in eval mode: to score the adapter as it trains."""
        from tqdm.auto import tqdm

        examples = self._examples(prompts, labels)
        self.default = float(statistics.median_low([float(y) for y in labels]))
        params = [p for p in self.model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=self.config.lr, weight_decay=0.0)
        gen = torch.Generator().manual_seed(self.config.seed)
        steps = self.config.epochs * math.ceil(len(examples) / self.config.batch_size)
        bar = tqdm(total=steps, desc="self-lora tuning", unit="step", disable=not progress)
        self.model.train()
        for epoch in range(1, self.config.epochs + 1):
            order = torch.randperm(len(examples), generator=gen).tolist()
            for i in range(0, len(order), self.config.batch_size):
                loss = self._loss([examples[j] for j in order[i : i + self.config.batch_size]])
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                bar.update(1)
                bar.set_postfix(loss=f"{loss.item():.3f}")
            if after_epoch is not None:
                self.model.eval()
                after_epoch(epoch)
                self.model.train()
        bar.close()
        self.model.eval()
        return self

    def _loss(self, batch: list[tuple[list[int], int]]) -> torch.Tensor:
        pad = self.tokenizer.pad_token_id or 0
        rows = [torch.tensor(ids) for ids, _ in batch]  # right padding
        x = pad_sequence(rows, batch_first=True, padding_value=pad)
        mask = pad_sequence([torch.ones_like(r) for r in rows], batch_first=True)
        # only the answer (number + EOS) is learned
        answers = [torch.tensor([-100] * start + ids[start:]) for ids, start in batch]
        target = pad_sequence(answers, batch_first=True, padding_value=-100)
        return self.model(input_ids=x, attention_mask=mask, labels=target).loss

    def predict(self, prompts: Sequence[str], *, batch_size: int = 32) -> list[float]:
        """Each prompt's predicted length, read as `config.readout` says."""
        if self.config.readout == "expected":
            values = buckets(bucket=self.config.bucket, cap=self.config.cap)
            probs = bucket_log_probs(self.model, self.tokenizer, prompts, values, batch_size=batch_size)
            probs = probs.softmax(-1)  # renormalised over the bucket numbers
            return (probs @ torch.tensor(values, dtype=probs.dtype)).tolist()
        out = stated_lengths(self.model, self.tokenizer, prompts, cap=self.config.cap, batch_size=batch_size)
        return [self.default if x is None else x for x in out]

    def adapter_disabled(self):
        """Context in which the model generates as the base LLM (the adapter is bypassed)."""
        return self.model.disable_adapter()

    def save(self, path) -> None:
        self.model.save_pretrained(str(path))
