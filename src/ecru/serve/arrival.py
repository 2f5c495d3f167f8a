"""Prefill on arrival: a request's prompt is prefilled when it arrives, and its KV kept until admission.

The engine prefills every prompt anyway; doing it at arrival gives three things from that one forward:
the first token (time to first token is at arrival), the KV cache of the prompt (admission then needs no
forward) and the prompt's mean-pooled last hidden state, the features of the self-probe
(`predictors.ProbePredictor`, a `StatePredictor`): its length prediction costs a dot product instead of
another prompt forward.

When (`arrival_prefill_due`): the arrived requests are prefilled together once `refill_min` of them have
arrived, or at once when the batch could take them now (running rows + prefilled waiting requests <
`max_batch_size`, an idle server included). Under a backlog arrivals are so prefilled in groups of
`refill_min`, as cheap per prompt as the admission prefills they replace. Each forward takes prompts of
similar lengths (`prefill_groups`), at most `max_batch_size` of them (`arrival_groups`): no forward is
larger than an admission's, whatever burst arrives.

`KeptKV` holds each waiting request's cache rows without padding (exactly its cached positions: the prompt,
and for a row cb-srpt preempted its tokens but the newest) for the requests the scheduler keeps
(`Scheduler.kept`: at most `arrival_kv_requests`; beyond, the request predicted longest is prefilled again at
admission, prompt plus tokens). At admission the kept rows are left-padded and stacked into one cache, with
no forward.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ecru.serve.kv_cache import row_kv, stack_rows


@dataclass
class KeptRow:
    """One waiting request's cached KV (per layer, [heads, positions, head_dim] keys and values) and its
    pending token."""

    kv: list[tuple[torch.Tensor, torch.Tensor]]
    pending: int
    """Its newest token (the first, sampled at arrival; a preempted row's last), not yet in the cache."""

    @property
    def length(self) -> int:
        return self.kv[0][0].shape[-2]


class KeptKV:
    """The KV rows of prefilled or preempted waiting requests, by request key (which ones: the scheduler's
    `kept`)."""

    def __init__(self):
        self.rows: dict[int, KeptRow] = {}

    def __len__(self) -> int:
        return len(self.rows)

    def __contains__(self, key: int) -> bool:
        return key in self.rows

    @property
    def tokens(self) -> int:
        """KV positions held (the kept rows have no padding)."""
        return sum(r.length for r in self.rows.values())

    def keep(self, key: int, cache, row: int, length: int, *, pending: int) -> None:
        """Copy row `row` of a left-padded `cache` (its last `length` positions are the request's cached ones)."""
        self.rows[key] = KeptRow(row_kv(cache, row, length), pending)

    def drop(self, key: int) -> None:
        self.rows.pop(key, None)

    def take(self, model, keys: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor, object]:
        """Remove the rows of `keys` and stack them as a running batch's pieces: pending tokens [B], a
        left-padded attention mask [B, T] and a KV cache for `model`."""
        rows = [self.rows.pop(k) for k in keys]
        mask, cache = stack_rows(model.config, [r.kv for r in rows])
        return torch.tensor([r.pending for r in rows]), mask, cache
