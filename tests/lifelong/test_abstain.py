"""A store that knows what it was not taught: two small CLINC tasks learned, a third domain never taught.

The issue's targets, on CLINC's test texts: the learned tasks' texts answered right >= 0.90 (abstentions
counted wrong), a never-taught domain's texts abstained >= 0.80, and on the answered texts the mean score
within 0.10 of their accuracy. About 20 s on one core."""

import json

import pytest
import torch

from ecru.cli import main
from ecru.datasets import load_clinc
from ecru.lifelong.calibration import expected_calibration_error
from ecru.lifelong.store import UNCLAIMED, KnowledgeStore

TAUGHT, UNTAUGHT = ("travel", "kitchen_and_dining"), ("auto_and_commute", "home")
INTENTS, TRAIN, TEST = 6, 16, 30
# every CLINC test text of the six intents (30 each): with 10 per intent the answered share's standard error
# (about 2.7 points on 120 texts) exceeded the margin the 0.90 target leaves; the never-taught domains use the same


def _rows(domain: str, split: str, per_intent: int) -> list[tuple[str, str]]:
    clinc = load_clinc()
    out = []
    for intent in clinc.domains[domain][:INTENTS]:
        out += [(e.text, e.label) for e in clinc[split] if e.label == intent][:per_intent]
    return out


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    s = KnowledgeStore(tmp_path_factory.mktemp("abstain") / "s")
    for domain in TAUGHT:
        s.learn(domain, _rows(domain, "train", TRAIN), epochs=3)
    return s


def test_learned_texts_answered_and_untaught_domains_abstained(store):
    test = [r for d in TAUGHT for r in _rows(d, "test", TEST)]
    preds = store.predict([t for t, _ in test], abstain=True)
    right = torch.tensor([p.label == label for p, (_, label) in zip(preds, test, strict=True)])
    answered = torch.tensor([p.label is not None for p in preds])
    first10 = torch.tensor([r in set(_rows(d, "test", 10)) for d in TAUGHT for r in _rows(d, "test", TEST)])
    scores = torch.tensor([p.score for p in preds], dtype=torch.float64)
    accuracy = right[answered].double().mean().item()
    ece = expected_calibration_error(scores[answered], right[answered])
    # what docs/lifelong.md reports (`pytest -s` shows it)
    print(f"answered right {right.double().mean():.3f} (first 10 per intent {right[first10].double().mean():.3f}), "
          f"mean score {scores[answered].mean():.3f}, accuracy {accuracy:.3f}, ECE {ece:.3f}")  # fmt: skip
    assert right.double().mean().item() >= 0.90
    assert abs(scores[answered].mean().item() - accuracy) <= 0.10
    assert ece <= 0.10
    for domain in UNTAUGHT:
        other = store.predict([t for t, _ in _rows(domain, "test", TEST)], abstain=True)
        print(f"{domain} abstained {sum(p.label is None for p in other) / len(other):.3f}")
        assert sum(p.label is None for p in other) / len(other) >= 0.80, domain
        assert {p.reason for p in other if p.label is None} == {UNCLAIMED}


def test_each_task_stores_the_map_scale_of_its_held_out_texts(store):
    from ecru.lifelong.calibration import SCALE_RANGE, fit_scale, holdout_split
    from ecru.lifelong.userdata import label_name

    method = store.method()
    assert len(method.scales) == 2 and store.manifest["config"]["calibration"] > 0
    assert method.cfg.scale_prior > 0 and method.cfg.score_scale is not None
    for i, domain in enumerate(TAUGHT):
        rows = _rows(domain, "train", TRAIN)
        labels = [label_name(label) for _, label in rows]
        _, held = holdout_split(labels, method.cfg.calibration, seed=0)  # the store's seed 0, task index 0
        cosines = method.encoder().for_task(i).scores([rows[k][0] for k in held], method.names[i])
        gold = torch.tensor([method.names[i].index(labels[k]) for k in held])
        want = fit_scale(cosines, gold, prior=method.cfg.score_scale, strength=method.cfg.scale_prior)
        # one step of fit_scale's grid: the stored adapter's float32 scores may tip a near tie
        assert method.scales[i] == pytest.approx(want, rel=(SCALE_RANGE[1] / SCALE_RANGE[0]) ** (1 / 399) - 1)
        assert method.scales[i] < SCALE_RANGE[1]


def test_abstain_keeps_unlearned_candidates_zero_shot_and_min_score(store):
    texts = [t for t, _ in _rows("auto_and_commute", "test", 2)]
    free = store.predict(texts, ["oil change", "tire pressure", "book flight"], abstain=True)
    assert all(p.label is not None for p in free)  # the unlearned names answer what no task claims
    assert all(p.label is not None and p.reason is None for p in store.predict(texts))  # no abstention asked
    strict = store.predict(texts, min_score=1.0)
    assert all(p.label is None and "below the minimum" in p.reason for p in strict if p.score < 1.0)


def test_cli_abstain_writes_null_labels_with_the_reason(store, tmp_path, capsys):
    data = tmp_path / "in.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t, _ in _rows("home", "test", 2)))
    out = tmp_path / "out.jsonl"
    code = main(["lifelong", "predict", "--store", str(store.path), "--data", str(data), "--out", str(out),
                 "--abstain"])  # fmt: skip
    assert code == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert any(r["label"] is None and r["reason"] == UNCLAIMED for r in rows)
    assert "abstained on" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exc:
        main(["lifelong", "predict", "--store", str(store.path), "--data", str(data), "--out", str(out),
              "--min-score", "1.5"])  # fmt: skip
    assert exc.value.code == 2


def test_abstention_is_the_claim_score_below_the_slack_and_probabilities_are_each_tasks_softmax(store):
    from ecru.lifelong.router import FROZEN
    from ecru.lifelong.store import CLAIM_Z

    texts = [t for d in (*TAUGHT, *UNTAUGHT) for t, _ in _rows(d, "test", 3)]
    method, preds = store.method(), store.predict(texts, abstain=True)
    enc = method.encoder()
    grade = enc.claim_scores(texts)
    assert [p.label is None for p in preds] == (grade < -CLAIM_Z).tolist()
    assert 0 < sum(p.label is None for p in preds) < len(texts)
    names = method.names[0] + method.names[1]
    scores, routes = enc.scores(texts, names).double(), method.router(enc.frozen(texts), open_set=False)
    scale = torch.tensor(
        [method.scales[r] if r != FROZEN else method.cfg.score_scale for r in routes.tolist()]
    )
    reference = torch.softmax(scale.double()[:, None] * scores, dim=-1)
    torch.testing.assert_close(enc.probabilities(texts, names), reference, rtol=0, atol=1e-12)
    # the benchmark's open-set grade: the claim in cosine plus OPEN_SET_WITHIN_WEIGHT x the best score of the
    # text's best task when that task is given (`for_task`: no gate, its own names only)
    from ecru.lifelong.methods.routed import OPEN_SET_WITHIN_WEIGHT

    within = torch.tensor(
        [
            enc.for_task(r).scores([t], method.names[r]).max().item()
            for t, r in zip(texts, routes.tolist(), strict=True)
        ],
        dtype=torch.float64,
    )
    torch.testing.assert_close(enc.best_within_task(texts), within, rtol=0, atol=1e-6)
    expected = enc.claim_scores(texts, standardise=False) + OPEN_SET_WITHIN_WEIGHT * enc.best_within_task(
        texts
    )
    torch.testing.assert_close(enc.open_set_grades(texts), expected, rtol=0, atol=1e-12)
