"""Temperature scaling, expected calibration error and the held-out split, against hand-computed values."""

import math

import pytest
import torch

from ecru.lifelong.calibration import SCALE_RANGE, expected_calibration_error, fit_scale, holdout_split


def test_ece_matches_a_hand_computed_value():
    # 15 bins of width 1/15: 0.95 and 0.97 share bin 15 (acc 1/2, conf 0.96), 0.5 is alone in bin 8 (acc 1),
    # 0.1 alone in bin 2 (acc 0): ECE = (2 |0.5 - 0.96| + |1 - 0.5| + |0 - 0.1|) / 4 = (0.92 + 0.5 + 0.1) / 4
    conf = torch.tensor([0.95, 0.97, 0.5, 0.1], dtype=torch.float64)
    correct = torch.tensor([True, False, True, False])
    assert expected_calibration_error(conf, correct) == pytest.approx(0.38, abs=1e-12)


def test_ece_of_perfect_and_empty_inputs():
    conf = torch.tensor([1.0, 1.0, 0.0])  # a confidence of 0 falls in the first bin, not out of range
    assert expected_calibration_error(conf, torch.tensor([True, True, False])) == pytest.approx(0.0)
    assert expected_calibration_error(torch.tensor([]), torch.tensor([], dtype=torch.bool)) == 0.0


def test_fit_scale_recovers_the_scale_that_generated_the_labels():
    g = torch.Generator().manual_seed(0)
    cosines = torch.rand(4000, 5, generator=g) * 2 - 1
    labels = torch.multinomial(torch.softmax(7.0 * cosines, -1), 1, generator=g)[:, 0]
    assert fit_scale(cosines, labels) == pytest.approx(7.0, rel=0.08)


def test_fit_scale_goes_up_the_range_when_every_answer_is_right():
    cosines = torch.tensor([[0.9, 0.1], [0.2, 0.8]], dtype=torch.float64)
    scale = fit_scale(cosines, torch.tensor([0, 1]))
    # the smallest scale whose loss is 0 in float64: every right answer at probability 1
    assert 40 < scale <= SCALE_RANGE[1]
    assert torch.softmax(scale * cosines, -1).diagonal().min().item() == pytest.approx(1.0, abs=1e-12)


def _map_objective(
    cosines: list[list[float]], labels: list[int], s: float, prior: float, strength: float
) -> float:
    """Plain-Python reference: summed NLL of softmax(s x cosines) plus strength x (ln s - ln prior)^2."""
    nll = 0.0
    for row, y in zip(cosines, labels, strict=True):
        top = max(s * c for c in row)
        nll += top + math.log(sum(math.exp(s * c - top) for c in row)) - s * row[y]
    return nll + strength * (math.log(s) - math.log(prior)) ** 2


def _golden_min(f, lo: float, hi: float) -> float:
    """The minimiser of a unimodal f on [lo, hi] in log space, by golden-section search to 1e-9."""
    a, b, r = math.log(lo), math.log(hi), (math.sqrt(5) - 1) / 2
    while b - a > 1e-9:
        c, d = b - r * (b - a), a + r * (b - a)
        a, b = (a, d) if f(math.exp(c)) < f(math.exp(d)) else (c, b)
    return math.exp((a + b) / 2)


GRID_STEP = (SCALE_RANGE[1] / SCALE_RANGE[0]) ** (1 / 399)  # fit_scale's log-spaced grid of 400 scales


@pytest.mark.parametrize("strength", [0.5, 3.0, 10.0])
def test_fit_scale_with_a_prior_is_the_map_scale_of_a_plain_reference(strength):
    g = torch.Generator().manual_seed(1)
    cosines = torch.rand(30, 4, generator=g, dtype=torch.float64) * 2 - 1
    labels = torch.multinomial(torch.softmax(5.0 * cosines, -1), 1, generator=g)[:, 0]
    rows, ys = cosines.tolist(), labels.tolist()
    want = _golden_min(lambda s: _map_objective(rows, ys, s, 12.0, strength), *SCALE_RANGE)
    got = fit_scale(cosines, labels, prior=12.0, strength=strength)
    assert want / GRID_STEP <= got <= want * GRID_STEP  # within one step of the grid
    assert abs(math.log(got / 12.0)) < abs(math.log(fit_scale(cosines, labels) / 12.0))  # pulled to the prior


def test_fit_scale_prior_keeps_an_all_right_held_out_set_finite_and_washes_out_with_data():
    cosines = torch.tensor([[0.9, 0.1], [0.2, 0.8]], dtype=torch.float64)
    labels = torch.tensor([0, 1])
    want = _golden_min(lambda s: _map_objective(cosines.tolist(), [0, 1], s, 12.0, 10.0), *SCALE_RANGE)
    got = fit_scale(cosines, labels, prior=12.0, strength=10.0)
    assert 12.0 < got < 40 and want / GRID_STEP <= got <= want * GRID_STEP  # not the range's end (no prior)
    g = torch.Generator().manual_seed(0)
    many = torch.rand(4000, 5, generator=g) * 2 - 1
    drawn = torch.multinomial(torch.softmax(7.0 * many, -1), 1, generator=g)[:, 0]
    assert fit_scale(many, drawn, prior=20.0, strength=10.0) == pytest.approx(7.0, rel=0.08)


def test_fit_scale_refuses_a_strength_without_a_prior():
    cosines, labels = torch.zeros(2, 2), torch.tensor([0, 1])
    for kw in ({"strength": 1.0}, {"strength": 1.0, "prior": 0.0}, {"strength": -1.0, "prior": 12.0}):
        with pytest.raises(ValueError, match="strength"):
            fit_scale(cosines, labels, **kw)


def test_holdout_split_is_per_label_deterministic_and_keeps_two_of_each():
    labels = ["a"] * 10 + ["b"] * 3 + ["c"] * 2
    kept, held = holdout_split(labels, 0.3, seed=1)
    assert sorted(kept + held) == list(range(15)) and not set(kept) & set(held)
    assert [labels[i] for i in held].count("a") == 3 and [labels[i] for i in held].count("b") == 1
    assert all(labels[i] != "c" for i in held)  # two texts only: both stay for training
    assert holdout_split(labels, 0.3, seed=1) == (kept, held)
    assert holdout_split(labels, 0.0, seed=1) == (list(range(15)), [])


def _two_task_data() -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
    """Two tasks' (embeddings [20, 16], labels [20]) and 200 queries."""
    g = torch.Generator().manual_seed(0)
    centres = torch.nn.functional.normalize(torch.randn(4, 16, generator=g), dim=-1)
    tasks = []
    for t in (0, 1):
        labels = torch.arange(2).repeat_interleave(10)
        emb = centres[2 * t + labels] + 0.3 * torch.randn(20, 16, generator=g)
        tasks.append((torch.nn.functional.normalize(emb, dim=-1), labels))
    return tasks, torch.nn.functional.normalize(torch.randn(200, 16, generator=g), dim=-1)


def _two_tasks(router):
    tasks, queries = _two_task_data()
    for emb, labels in tasks:
        router.add_task(emb, labels=labels)
    return queries


@pytest.mark.parametrize("kind", ["prototypes", "lda"])
def test_claim_margin_is_the_best_tasks_standardised_prototype_score(kind):
    from ecru.lifelong.router import LDARouter, PrototypeRouter, loo_prototype_scores

    router = LDARouter(percentile=10.0) if kind == "lda" else PrototypeRouter(percentile=10.0)
    queries = _two_tasks(router)
    margin = router.claim_margin(queries)
    # reference: each task's own leave-one-out scores give its mean and sd; the best standardised score wins
    z, centred = [], []
    for t, (emb, labels) in enumerate(_two_task_data()[0]):
        own = loo_prototype_scores(emb, labels, 2).double()
        cosine = (queries.double() @ router.prototypes[t].double().T).max(-1).values
        z.append((cosine - own.mean()) / own.std())
        centred.append(cosine - own.mean())
    torch.testing.assert_close(margin, torch.stack(z, -1).max(-1).values, rtol=0, atol=1e-6)
    assert 0 < (margin >= -2).sum() < len(queries)  # the check is not vacuous
    # unstandardised: the best task's score minus its own texts' mean (not the same task as the z's, in general)
    plain = router.claim_margin(queries, standardise=False)
    torch.testing.assert_close(plain, torch.stack(centred, -1).max(-1).values, rtol=0, atol=1e-6)


def test_admit_pools_the_held_out_scores_into_the_claim_statistics():
    from ecru.lifelong.router import PrototypeRouter, loo_prototype_scores, pooled_stats

    router = PrototypeRouter(percentile=10.0)
    _two_tasks(router)
    held = torch.nn.functional.normalize(
        torch.randn(7, 16, generator=torch.Generator().manual_seed(3)), dim=-1
    )
    before = router.claim_means[1]
    router.admit(1, held, quantile=0.0)
    emb, labels = _two_task_data()[0][1]
    own = torch.cat([loo_prototype_scores(emb, labels, 2), router.scores(held, [1])[:, 0]]).double()
    assert router.claim_counts[1] == 27 and router.claim_means[1] != before
    assert router.claim_means[1] == pytest.approx(own.mean().item(), abs=1e-9)
    assert router.claim_sds[1] == pytest.approx(own.std().item(), abs=1e-9)
    assert pooled_stats(3, 1.0, 0.5, torch.tensor([float("inf")])) == (
        3,
        1.0,
        0.5,
    )  # nothing finite: unchanged


def test_a_router_saved_without_claim_statistics_keeps_its_old_claim():
    from ecru.lifelong.router import PrototypeRouter

    router = PrototypeRouter(percentile=10.0)
    queries = _two_tasks(router)
    old = {k: v for k, v in router.state_dict().items() if not k.startswith("claim_")}
    legacy = PrototypeRouter(percentile=10.0)
    legacy.load_state_dict(old)
    # some task's prototype score reaches its threshold - 0.04 (the former rule asked it of the routed task)
    margins = legacy.scores(queries, [0, 1]) - torch.tensor(legacy.thresholds)
    was_claimed = (margins >= -0.04).any(-1)
    assert torch.equal(legacy.claim_margin(queries) >= -2, was_claimed)
    assert 0 < was_claimed.sum() < len(queries)
