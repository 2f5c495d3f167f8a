"""The request engine and the online simulator decide alike: the same trace, counted in decode steps (a
cost model of one second per decode step and free prefills), gives each request the same finish step under
every continuous policy the real-engine benchmark compares. Both are the same `Scheduler`, one on the model,
one on a `SimulatedRunner`; this checks the two runners report the same things, through public API only:
answers end at their `max_tokens` (the trace's length), predictions come from the `predict` hook and a
`RemainingPredictor`."""

import math
import random

import pytest
import torch

from ecru.serve.engine.request_engine import EngineConfig, RequestEngine
from ecru.serve.engine.sampling import SamplingParams
from ecru.serve.sched.scheduler import run_in_steps
from ecru.serve.sim.cost import CostModel
from ecru.serve.sim.simulator import OnlineRequest, simulate_policy

STEP = CostModel(1.0, 0.0, 0.0, 0.0, 0.0, source="one second per decode step")
K, ROWS, CAP = 4, 4, 40
NO_EOS = (10**6,)  # a token the model never emits: an answer ends at its max_tokens, the trace's length
REMAINING = [float(random.Random(j).randint(1, 50)) for j in range(CAP // K + 1)]
"""The re-predicted remainder after j x K tokens (the same for every row; each row's cap makes it differ)."""


class TraceRemaining:
    """A `RemainingPredictor` reading `REMAINING` at each row's token count."""

    def predict(self, states: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return torch.tensor([REMAINING[n // K] for n in t.tolist()])


def workload(n: int = 24, seed: int = 0):
    """Prompts, answer lengths, prompt-only predictions, arrival steps: a stream above the batch's capacity,
    with predictions that are sometimes wrong (the re-predictions fix them)."""
    rng, g = random.Random(seed), torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 60, (rng.randint(3, 9),), generator=g).tolist() for _ in range(n)]
    assert len({tuple(p) for p in prompts}) == n  # predictions are looked up by prompt
    lengths = [rng.choice((3, 6, 10, 18, 30, CAP)) for _ in range(n)]
    predicted = [
        float(n_ if rng.random() < 0.4 else rng.choice((2, 4, 12, 36, 60))) for n_ in lengths
    ]  # 60: past the cap
    arrivals = sorted(rng.randint(0, n) for _ in range(n))
    return prompts, lengths, predicted, arrivals


def run_engine(model, policy: str, overrides: dict, work) -> tuple[list[int], int]:
    """Each request's finish step on the engine, driven in decode steps (`run_in_steps`)."""
    prompts, lengths, predicted, arrivals = work
    config = EngineConfig(policy=policy, max_batch_size=ROWS, max_new_tokens=CAP, repredict_every=K,
                          prefix_cache=0, **overrides)  # fmt: skip
    index = {tuple(p): i for i, p in enumerate(prompts)}
    engine = RequestEngine(model, eos_token_ids=NO_EOS, pad_token_id=0, config=config,
                           predict=lambda prompt, params: predicted[index[tuple(prompt)]],
                           remaining=TraceRemaining() if policy == "cb-srpt" else None)  # fmt: skip
    finish = {}

    def add(i: int) -> None:
        engine.add_request(prompts[i], SamplingParams(max_tokens=lengths[i]), key=i)

    def step() -> None:
        for req in engine.step():
            assert req.finish_reason == "length"
            finish[req.seq] = engine.scheduler.steps

    run_in_steps(engine.scheduler, arrivals, add, step)
    return [finish[i] for i in range(len(prompts))], engine.stats.preemptions


def run_simulator(policy: str, overrides: dict, work) -> tuple[list[int], int]:
    prompts, lengths, predicted, arrivals = work
    trace = [OnlineRequest(float(a), len(p), n, q, tuple(REMAINING), max_tokens=n)
             for p, n, q, a in zip(prompts, lengths, predicted, arrivals, strict=True)]  # fmt: skip
    config = EngineConfig(max_batch_size=ROWS, max_new_tokens=CAP, repredict_every=K)
    result = simulate_policy(trace, policy, config, STEP, overrides)
    return [round(a + lat) for a, lat in zip(arrivals, result.latencies, strict=True)], result.preemptions


DEADLINE = {"aging": 0.0, "fcfs_slack": 0.15}
POLICIES = {
    "cb": ("cb", {}),
    "cb-sjf": ("cb-sjf", {}),
    "cb-sjf[fcfs-slack]": ("cb-sjf", DEADLINE),
    "cb-srpt": ("cb-srpt", {"preempt_margin": 2.0}),  # the shipped FCFS deadline and kept KV
    "cb-srpt[no-deadline][recompute]": ("cb-srpt", {"fcfs_slack": math.inf, "preempt_mode": "recompute",
                                                    "preempt_margin": 2.0}),
}  # fmt: skip


@pytest.mark.parametrize("name", list(POLICIES))
@pytest.mark.parametrize("seed", [9, 10, 14, 15])  # traces where cb-srpt swaps rows
def test_engine_and_simulator_finish_each_request_at_the_same_step(model, name, seed):
    policy, overrides = POLICIES[name]
    work = workload(seed=seed)
    engine, preempted = run_engine(model, policy, overrides, work)
    simulated, sim_preempted = run_simulator(policy, overrides, work)
    assert engine == simulated and preempted == sim_preempted
    assert (preempted > 0) == (policy == "cb-srpt")  # the traces do make cb-srpt swap rows
