"""Re-prediction while generating: a probe on a running row's own hidden state predicts its REMAINING length.

After t generated tokens a row's last hidden state (the one that emits token t + 1) has read the prompt
and its answer so far, so it knows more than the prompt alone: a list that has reached its last item, a
story winding down, a repetition loop that will run to the cap. `RemainingProbe` is ridge regression of
log(1 + remaining) on that state plus t; it is trained teacher-forced: one forward of prompt + answer
(`answer_states`) gives the state at every t, equal to what the decode steps compute. At serving time the
engine already has this state at every step, so a re-prediction costs one dot product per row.

`fit_probe` fits one for a user's prompts (their greedy answers on the engine; `ecru serve probe`), and a
fitted probe is saved to and loaded from a folder (`save`, `load`: one safetensors file with its model's
name), which `ecru serve api/run --policy cb-srpt --remaining-probe DIR` serve with.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import torch
from torch.nn.utils.rnn import pad_sequence

from ecru.serve.predict.predictors import (
    length_metrics,
    model_key,
    read_ridge,
    ridge_fit,
    save_ridge,
    spearman,
)

PROBE_FILE = "remaining_probe.safetensors"


@torch.no_grad()
def answer_states(
    model, prompts: Sequence[Sequence[int]], answers: Sequence[Sequence[int]], *, batch_size: int = 8
) -> list[torch.Tensor]:
    """Per example, the last-layer hidden states [len(answer), H] after t = 0 .. len(answer) - 1 answer
    tokens (row t is the state at the prompt's last token + t: the one that emits answer token t + 1)."""
    out = []
    for start in range(0, len(prompts), batch_size):
        end = start + batch_size
        pairs = list(zip(prompts[start:end], answers[start:end], strict=True))
        seqs = [torch.tensor([*p, *a], dtype=torch.long) for p, a in pairs]
        # right padding: positions 0.. per row without position ids
        ids = pad_sequence(seqs, batch_first=True)
        mask = pad_sequence([torch.ones_like(s) for s in seqs], batch_first=True)
        # the decoder stack alone: its output is the model's last hidden state, without the vocabulary-sized
        # LM head at every position (most of a teacher-forced forward's memory traffic)
        hidden = model.get_decoder()(input_ids=ids, attention_mask=mask).last_hidden_state
        for row, (p, a) in enumerate(pairs):
            out.append(hidden[row, len(p) - 1 : len(p) - 1 + len(a)].float().clone())
    return out


def position_features(states: torch.Tensor, t: torch.Tensor, *, cap: int) -> torch.Tensor:
    """[state, t / cap, log(1 + t) / log(1 + cap)]: the hidden state plus how far the row has come."""
    t = t.float()[:, None]
    return torch.cat([states, t / cap, torch.log1p(t) / math.log1p(cap)], dim=1)


class RemainingProbe:
    """Ridge regression of log(1 + remaining tokens) on `position_features`; predictions in [1, cap - t]."""

    name = "remaining-probe"

    def __init__(self, *, cap: int = 256, lam: float = 10.0, stride: int = 4, model: str | None = None):
        self.cap, self.lam, self.stride = cap, lam, stride
        self.model = model
        """The name of the model whose hidden states it reads (recorded by `save`, checked by front ends)."""
        self.w: torch.Tensor | None = None
        self.b: torch.Tensor | None = None

    @property
    def hidden_size(self) -> int | None:
        return None if self.w is None else self.w.shape[0] - 2

    def save(self, folder: str | Path) -> Path:
        """Write the fitted probe to `folder`/remaining_probe.safetensors (atomically)."""
        if self.w is None:
            raise RuntimeError("RemainingProbe is not fitted: nothing to save")
        meta = {"cap": self.cap, "lam": self.lam, "stride": self.stride, "model": self.model}
        return save_ridge(Path(folder) / PROBE_FILE, self.w, self.b, meta_key="probe", meta=meta)

    @classmethod
    def load(cls, folder: str | Path) -> RemainingProbe:
        """A probe written by `save`; ValueError when `folder` holds none."""
        numbers = {"cap": int, "lam": float, "stride": int}
        path = Path(folder) / PROBE_FILE
        meta, w, b = read_ridge(path, meta_key="probe", what="a remaining-length probe", numbers=numbers)
        probe = cls(**meta)
        probe.w, probe.b = w, b
        return probe

    def fit(self, states: Sequence[torch.Tensor], lengths: Sequence[int]) -> RemainingProbe:
        """`states[i]` from `answer_states`; `lengths[i]` the answer's length (capped at `cap`). Every
        `stride`-th position of each answer is one training row."""
        xs, ys = [], []
        for s, n in zip(states, lengths, strict=True):
            n = min(n, self.cap, len(s))
            t = torch.arange(0, n, self.stride)
            xs.append(position_features(s[t], t, cap=self.cap))
            ys.append(torch.log1p((n - t).float()))
        self.w, self.b = ridge_fit(torch.cat(xs), torch.cat(ys), lam=self.lam)
        return self

    def predict(self, states: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """Predicted remaining tokens of rows with hidden states `states` [N, H] after `t` [N] tokens."""
        if self.w is None:
            raise RuntimeError("RemainingProbe is not fitted: call fit(states, lengths) first")
        log_rem = position_features(states, t, cap=self.cap) @ self.w + self.b
        upper = (self.cap - t).clamp_min(1).float()
        return torch.minimum(torch.expm1(log_rem).clamp_min(1.0), upper)

    def trajectory(self, states: torch.Tensor, *, every: int) -> list[float]:
        """Predicted remaining length after 0, every, 2 x every, ... tokens of one answer."""
        t = torch.arange(0, len(states), every)
        return self.predict(states[t], t).tolist()


def greedy_answers(
    served, prompts: Sequence[Sequence[int]], *, cap: int, config, progress: bool
) -> list[list[int]]:
    """Each prompt's greedy answer (at most `cap` tokens) on the request engine, with a progress bar."""
    from tqdm.auto import tqdm

    from ecru.serve.engine.sampling import SamplingParams

    engine = served.engine(config)
    reqs = [engine.add_request(p, SamplingParams(max_tokens=cap)) for p in prompts]
    with tqdm(total=len(reqs), desc="answering", unit="prompt", disable=not progress) as bar:
        while engine.has_unfinished():
            bar.update(len(engine.step()))
    return [r.output for r in reqs]


def fit_probe(served, prompts: Sequence[Sequence[int]], answers: Sequence[Sequence[int]], *, cap: int,
              every: int = 16, holdout: int = 5) -> tuple[RemainingProbe, dict]:  # fmt: skip
    """A `RemainingProbe` for `served` from `prompts` (token ids) and their greedy `answers` (at most `cap`
    tokens each; `greedy_answers`): one teacher-forced forward each for the states. Every `holdout`-th
    prompt is first held out to report how well re-predictions every `every` tokens rank and match the true
    remaining lengths of unseen answers; the probe returned is then fitted on all."""
    states, lengths = answer_states(served.model, prompts, answers), [len(a) for a in answers]
    if not any(lengths):
        raise ValueError("every greedy answer is empty (the model ended each at once): nothing to fit on")
    train = [i for i in range(len(prompts)) if i % holdout]
    held = RemainingProbe(cap=cap).fit([states[i] for i in train], [lengths[i] for i in train])
    test = range(0, len(prompts), holdout)
    pred, true = [], []
    for i in test:
        t = torch.arange(every, max(every, lengths[i]), every)  # after every k tokens, while the answer runs
        pred += held.predict(states[i][t], t).tolist()
        true += (lengths[i] - t).tolist()
    report = {"answers": len(answers), "answer_tokens": sum(lengths), "held_out_answers": len(test),
              "held_out_points": len(pred), "every": every, **(length_metrics(pred, true) if pred else {}),
              "spearman": spearman(pred, true)}  # fmt: skip
    probe = RemainingProbe(cap=cap, model=model_key(served.name)).fit(states, lengths)
    return probe, report
