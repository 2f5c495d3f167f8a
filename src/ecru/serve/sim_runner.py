"""The simulated runner: the scheduler's plans executed on a cost-model clock with a trace's known lengths.

It is a `scheduler.Runner` like the real engine: the continuous-batching simulators (`online.simulate_online`,
`simulator.simulate_continuous`) are the engine's own `Scheduler` driven by it, so they admit, preempt and
keep KV exactly as the engine does. Costs (`CostModel`): a prefill forward over its widest row (prompt plus
the tokens a preempted row kept), a decode step over the padded cache (rows x widest row, the engine's
left-padded layout, also `peak`); joining with kept KV costs nothing (the engine merges kept rows as it merges
any admission). A row ends at its trace length; predictions come from the trace (`predicted` at arrival,
`remaining[j]` after j x `repredict_every` tokens), each re-prediction charged `repredict_s`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from ecru.serve.scheduler import Outcome

if TYPE_CHECKING:  # torch-free at run time: any object with CostModel's three timings will do
    from ecru.serve.cost import CostModel


class SimulatedRunner:
    """A trace's requests on a cost-model clock: `finish[i]` is when request i's last token came out."""

    def __init__(
        self,
        prompt_lens: Sequence[int],
        targets: Sequence[int],
        *,
        cost: CostModel,
        predicted: Sequence[float] = (),
        remaining: Sequence[Sequence[float]] = (),
        repredict_every: int = 16,
        repredict_s: float = 0.0,
        start_s: float = 0.0,
    ):
        self.prompt_lens, self.targets, self.cost = prompt_lens, targets, cost
        self.predicted, self.remaining = predicted, remaining
        self.every, self.repredict_s = repredict_every, repredict_s
        self.done = [0] * len(targets)
        self.finish = [0.0] * len(targets)
        self.clock, self.peak, self.slots, self.prefills = start_s, 0, 0, 0
        self.running: list[int] = []
        self.kept: dict[int, int] = {}  # waiting requests' KV positions

    def _width(self, rows: Sequence[int]) -> int:
        return max((self.prompt_lens[i] + self.done[i] for i in rows), default=0)

    def _grow(self, rows: Sequence[int]) -> set[int]:
        """One more token for each row; the rows that reached their length (their finish time recorded)."""
        ended = set()
        for i in rows:
            self.done[i] += 1
            if self.done[i] >= self.targets[i]:
                self.finish[i] = self.clock
                ended.add(i)
        self.slots += len(rows)
        return ended

    def prefill_arrivals(self, groups: list[list[int]]) -> Outcome:
        ended = set()
        for rows in groups:
            self.clock += self.cost.prefill_time(len(rows), self._width(rows))
            held = len(self.running) * self._width(self.running) + sum(self.kept.values())
            self.peak = max(self.peak, held + len(rows) * self._width(rows))
            ended |= self._grow(rows)
        arrived = [i for rows in groups for i in rows]
        self.kept |= {i: self.prompt_lens[i] for i in arrived if i not in ended}
        return Outcome(ended, {i: float(self.predicted[i]) for i in arrived})

    def admit(self, kept: list[int], fresh: list[int]) -> Outcome:
        for i in kept:
            del self.kept[i]
        self.running += kept
        if not fresh:
            return Outcome()
        self.clock += self.cost.prefill_time(len(fresh), self._width(fresh))
        self.prefills += 1
        ended = self._grow(fresh)
        self.running += [i for i in fresh if i not in ended]
        return Outcome(ended)

    def decode(self, rows: list[int], repredict: list[int]) -> Outcome:
        width = self._width(rows)
        self.peak = max(self.peak, len(rows) * width + sum(self.kept.values()))
        self.clock += self.cost.step_time(len(rows), width)
        predicted = {}
        for i in repredict:  # the state after done[i] tokens: the trace's prediction there, if it has one
            j = self.done[i] // self.every
            if j < len(self.remaining[i]):
                predicted[i] = float(self.remaining[i][j])
        ended = self._grow(rows)
        self.clock += sum(i not in ended for i in predicted) * self.repredict_s  # a row that ended needs none
        self.running = [i for i in rows if i not in ended]
        return Outcome(ended, predicted)

    def preempt(self, keys: list[int], *, keep_kv: bool, discard: bool) -> None:
        for i in keys:
            self.running.remove(i)
            if keep_kv:  # its newest token is pending, not cached (as in the engine)
                self.kept[i] = self.prompt_lens[i] + self.done[i] - 1
            if discard:
                self.done[i] = 0

    def release(self, keys: list[int]) -> None:
        for i in keys:
            del self.kept[i]
