"""The request engine and the online simulator decide alike: the same trace, counted in decode steps (a
cost model of one second per decode step and free prefills), gives each request the same finish step under
every continuous policy the real-engine benchmark compares."""

import random

import pytest
import torch

from ecru.serve.cost import CostModel
from ecru.serve.online import OnlineConfig, OnlineRequest, simulate_online
from ecru.serve.request_engine import EngineConfig, RequestEngine
from ecru.serve.sampling import SamplingParams

from .conftest import RunsLong

STEP = CostModel(1.0, 0.0, 0.0, 0.0, 0.0, source="one second per decode step")
K, ROWS, CAP = 4, 4, 40
NO_EOS = (10**6,)  # a token the model never emits: an answer ends at its trace length (`run_engine`)


def workload(n: int = 24, seed: int = 0):
    """Prompts, answer lengths, prompt-only predictions, re-predictions every K tokens, arrival steps: a
    stream above the batch's capacity, with predictions that are sometimes wrong (the re-predictions fix
    them)."""
    rng, g = random.Random(seed), torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 60, (rng.randint(3, 9),), generator=g).tolist() for _ in range(n)]
    assert len({tuple(p) for p in prompts}) == n  # predictions are looked up by prompt
    lengths = [rng.choice((3, 6, 10, 18, 30, CAP)) for _ in range(n)]
    predicted = [
        float(n_ if rng.random() < 0.6 else rng.choice((4, 12, 36, 60))) for n_ in lengths
    ]  # 60: past the cap
    remaining = [tuple(float(max(1, n_ - K * j + rng.randint(-2, 2))) for j in range(CAP // K + 1))
                 for n_ in lengths]  # fmt: skip
    arrivals = sorted(rng.randint(0, 3 * n) for _ in range(n))
    return prompts, lengths, predicted, remaining, arrivals


def run_engine(model, policy: str, overrides: dict, work) -> tuple[list[int], int]:
    """Each request's finish step on the engine, driven in decode steps: arrivals added before the step
    they arrive at, the not-yet-arrived count given as `upcoming` (as the simulator knows it)."""
    prompts, lengths, predicted, remaining, arrivals = work
    config = EngineConfig(policy=policy, max_batch_size=ROWS, max_new_tokens=CAP, repredict_every=K,
                          prefix_cache=0, **overrides)  # fmt: skip
    index = {tuple(p): i for i, p in enumerate(prompts)}
    engine = RequestEngine(model, eos_token_ids=NO_EOS, pad_token_id=0, config=config,
                           predict=lambda prompt, params: predicted[index[tuple(prompt)]],
                           remaining=RunsLong() if policy == "cb-srpt" else None)  # fmt: skip

    def repredict(rows, states):  # the trace's re-predictions, at the engine's own re-prediction points
        for r in rows:
            r.predicted = min(float(CAP), len(r.output) + remaining[r.seq][len(r.output) // K])

    engine._repredict = repredict  # the answer's end and the re-predictions come from the trace
    engine._reason = lambda req, eos: "length" if len(req.output) >= lengths[req.seq] else None
    finish, added, step = {}, 0, 0
    while added < len(prompts) or engine.has_unfinished():
        while added < len(prompts) and arrivals[added] <= step:
            engine.add_request(prompts[added], SamplingParams(max_tokens=CAP), key=added)
            added += 1
        engine.upcoming = len(prompts) - added
        if not engine.has_unfinished():
            step = arrivals[added]
            continue
        step += 1
        for req in engine.step():
            finish[req.seq] = step
    return [finish[i] for i in range(len(prompts))], engine.stats.preemptions


def run_simulator(policy: str, overrides: dict, work) -> tuple[list[int], int]:
    prompts, lengths, predicted, remaining, arrivals = work
    trace = [OnlineRequest(float(a), len(p), n, q, r)
             for p, n, q, r, a in zip(prompts, lengths, predicted, remaining, arrivals, strict=True)]  # fmt: skip
    config = OnlineConfig(
        max_batch_size=ROWS, max_new_tokens=CAP, repredict_every=K, token_s=1.0, **overrides
    )
    result = simulate_online(trace, policy=policy, config=config, cost=STEP)
    return [round(a + lat) for a, lat in zip(arrivals, result.latencies, strict=True)], result.preemptions


DEADLINE = {"aging": 0.0, "fcfs_slack": 0.15}
POLICIES = {
    "cb": ("cb", {}, {}),
    "cb-sjf": ("cb-sjf", {"aging": 0.1}, {}),
    "cb-sjf[fcfs-slack]": ("cb-sjf", DEADLINE, {}),
    "cb-srpt[fcfs-slack]": ("cb-srpt", DEADLINE | {"preempt_mode": "keep", "preempt_margin": 2.0},
                            {"preempt": True}),
}  # fmt: skip


@pytest.mark.parametrize("name", list(POLICIES))
@pytest.mark.parametrize("seed", [0, 1, 3, 4, 9])  # traces where cb-srpt swaps rows
def test_engine_and_simulator_finish_each_request_at_the_same_step(model, name, seed):
    policy, overrides, sim_only = POLICIES[name]
    work = workload(seed=seed)
    engine, preempted = run_engine(model, policy, overrides, work)
    simulated, sim_preempted = run_simulator(policy, overrides | sim_only, work)
    assert engine == simulated and preempted == sim_preempted
    assert (preempted > 0) == (policy == "cb-srpt")  # the traces do make cb-srpt swap rows
