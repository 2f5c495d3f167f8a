import pytest
import torch

from ecru.datasets import humanize_intent
from ecru.lifelong.evaluate import Scorer, TaskGatedEncoder


class Oracle:
    """Scores each text 1 for its gold name and 0 elsewhere; `decoy` (a name) scores 2 for every text."""

    def __init__(self, stream, decoy: str | None = None):
        gold = [(e.text, e.label) for t in stream.tasks for e in t.test] + [
            (e.text, e.label) for e in stream.heldout
        ]
        self.gold = {text: humanize_intent(label) for text, label in gold}
        self.decoy, self.asked = decoy, []

    def encode(self, texts, *, batch_size=64):
        raise AssertionError("a scorer is asked through scores only")

    def scores(self, texts, labels, *, batch_size=64):
        self.asked.append(list(labels))
        return torch.tensor(
            [[2.0 if n == self.decoy else float(n == self.gold[t]) for n in labels] for t in texts]
        )


def test_an_oracle_scores_100_in_both_protocols(tiny_evaluator):
    oracle = Oracle(tiny_evaluator.stream)
    assert isinstance(oracle, Scorer) and not isinstance(oracle, TaskGatedEncoder)
    for seen in (0, 1, 2):
        row = tiny_evaluator.evaluate(oracle, seen=seen)
        assert row.ti == row.agnostic == [100.0, 100.0] and row.heldout == row.heldout_agnostic == 100.0
    assert len(oracle.asked) == 3  # one score matrix per evaluation, every candidate set read from it


def test_task_agnostic_candidates_are_the_learned_labels_plus_the_text_s_own(tiny_evaluator):
    stream = tiny_evaluator.stream
    decoy = humanize_intent(stream.tasks[1].intents[0])  # a label of task 2 that beats every gold label
    oracle = Oracle(stream, decoy)
    gold2 = [humanize_intent(e.label) for e in stream.tasks[1].test]
    own2 = 100.0 * sum(g == decoy for g in gold2) / len(gold2)
    row = tiny_evaluator.evaluate(oracle, seen=1)
    # task 1 among task 1's labels (decoy absent); task 2 (unseen) among task 1's plus its own (decoy in)
    assert row.agnostic == [100.0, own2] and row.heldout_agnostic == 100.0 and row.ti == [100.0, own2]
    row = tiny_evaluator.evaluate(oracle, seen=2)
    assert row.agnostic == [0.0, own2] and row.heldout_agnostic == 0.0  # the decoy is a candidate everywhere
    assert row.ti == [100.0, own2] and row.heldout == 100.0  # gated: own labels only


class Gated(Oracle):
    """A per-task method: told the task, it embeds each text as its gold name (one-hot); untold, the decoy wins."""

    def __init__(self, stream, decoy, names):
        super().__init__(stream, decoy)
        self.index, self.told = {n: k for k, n in enumerate(names)}, []

    def for_task(self, task):
        self.told.append(task)
        return Told(self.gold, self.index)


class Told:
    def __init__(self, gold, index):
        self.gold, self.index = gold, index

    def encode(self, texts, *, batch_size=64):
        return self.encode_labels([self.gold[t] for t in texts])

    def encode_labels(self, texts, *, batch_size=64):
        one_hot = torch.nn.functional.one_hot(torch.tensor([self.index[t] for t in texts]), len(self.index))
        return one_hot.float()


def test_the_gate_is_given_for_learned_tasks_only(tiny_evaluator):
    stream = tiny_evaluator.stream
    decoy = humanize_intent(stream.tasks[0].intents[0])
    gated = Gated(stream, decoy, tiny_evaluator.names)
    assert isinstance(gated, TaskGatedEncoder)
    row = tiny_evaluator.evaluate(gated, seen=1)
    assert gated.told == [0] and row.ti[0] == 100.0  # told task 1: right although the decoy wins untold
    gold1 = [humanize_intent(e.label) for e in stream.tasks[0].test]
    assert row.agnostic[0] == 100.0 * sum(g == decoy for g in gold1) / len(gold1)


def test_distractor_accuracy_adds_the_held_out_labels_to_the_learned_tasks_candidates(tiny_evaluator):
    stream = tiny_evaluator.stream
    decoy = humanize_intent(
        stream.heldout_labels[0]
    )  # a Banking77 label (no task taught it) beats every gold
    assert tiny_evaluator.evaluate(Oracle(stream), seen=0).distractor is None  # nothing learned yet
    row = tiny_evaluator.evaluate(Oracle(stream, decoy), seen=1)
    assert row.agnostic[0] == 100.0  # the decoy is no candidate of a learned task's own question
    assert row.distractor == 0.0  # with Banking77's labels added it wins every learned text
    assert tiny_evaluator.evaluate(Oracle(stream), seen=2).distractor == 100.0


def test_open_set_metrics_match_hand_counts():
    from ecru.lifelong.evaluate import open_set_metrics

    m = open_set_metrics(
        torch.tensor([True, True, False, True]),
        torch.tensor([False, True, False, False]),
        torch.tensor([True, True, False]),
    )
    assert m["oos_recall"] == pytest.approx(200 / 3) and m["oos_precision"] == pytest.approx(200 / 3)
    assert m["in_scope_accuracy"] == 50.0 and m["in_scope_accuracy_no_abstention"] == 75.0
    assert m["in_scope_abstained"] == 25.0


class ClaimingOracle(Oracle):
    """The oracle, and a router that claims exactly the in-scope texts (claim score 1; out-of-scope texts -1)."""

    def scores(self, texts, labels, *, batch_size=64):
        return torch.tensor([[float(n == self.gold.get(t)) for n in labels] for t in texts])

    def open_set_grades(self, texts):
        return torch.tensor([1.0 if t in self.gold else -1.0 for t in texts])


def test_open_set_evaluator_threshold_on_oos_val_and_metrics_after_each_task(tiny_stream):
    from ecru.lifelong.evaluate import Claimer, OpenSetEvaluator

    oos_val, oos_test = ["is it raining on mars", "sing me a song"], ["who won the cup", "what is love", "hi"]
    ev = OpenSetEvaluator(tiny_stream, scale=30.0, oos_val=oos_val, oos_test=oos_test)
    oracle = ClaimingOracle(tiny_stream)
    assert isinstance(oracle, Claimer) and not isinstance(Oracle(tiny_stream), Claimer)
    for seen in (0, 1, 2):
        ev.evaluate(oracle, seen=seen)
    rows = ev.take_open_set()
    assert [r["seen"] for r in rows] == [1, 2] and ev.take_open_set() == []
    for r in rows:  # unclaimed texts grade -1: the threshold is -1 and catches exactly them
        assert r["threshold"] == -1.0 and r["oos_recall"] == 100.0 and r["oos_precision"] == 100.0
        assert r["in_scope_accuracy"] == 100.0 and r["ece"] == pytest.approx(0.0, abs=1e-9)
    # a method without a router: every out-of-scope text is as confident as the oracle's in-scope answers
    # (a uniform softmax over the learned labels < their one-hot): the quantile rule still catches them
    plain = Oracle(tiny_stream)
    plain.gold.update({t: "none" for t in oos_val + oos_test})
    ev.evaluate(plain, seen=1)
    (r,) = ev.take_open_set()
    assert r["oos_recall"] == 100.0 and r["in_scope_accuracy"] == 100.0


class GradingOracle(ClaimingOracle):
    """Graded claims (in-scope 1.0, out-of-scope texts as listed) and its own probabilities: 0.9 on the gold
    label (`Calibrated`), whatever the evaluator's scale."""

    grades = {"a": -0.5, "b": -0.4, "c": -0.3, "d": -0.2, "e": 2.0, "x": -1.0, "y": 0.5, "z": 3.0}

    def open_set_grades(self, texts):
        return torch.tensor([1.0 if t in self.gold else self.grades[t] for t in texts])

    def probabilities(self, texts, names):
        hit = self.scores(texts, names)
        return torch.where(hit.sum(-1, keepdim=True) > 0, 0.1 / (len(names) - 1) + (0.9 - 0.1 / (len(names) - 1)) * hit,
                           torch.full_like(hit, 1 / len(names)))  # fmt: skip


def test_open_set_threshold_on_graded_claims_and_ece_of_own_probabilities(
    tiny_stream,
):
    from ecru.lifelong.evaluate import OOS_RECALL, Calibrated, OpenSetEvaluator

    ev = OpenSetEvaluator(tiny_stream, scale=30.0, oos_val=list("abcde"), oos_test=list("xyz"))
    oracle = GradingOracle(tiny_stream)
    assert isinstance(oracle, Calibrated) and not isinstance(ClaimingOracle(tiny_stream), Calibrated)
    ev.evaluate(oracle, seen=2)
    (r,) = ev.take_open_set()
    expected = torch.quantile(
        torch.tensor([-0.5, -0.4, -0.3, -0.2, 2.0]), OOS_RECALL
    ).item()  # float32 grades
    assert r["threshold"] == pytest.approx(expected, abs=1e-6) and -0.2 < expected < 1.0
    assert r["oos_recall"] == pytest.approx(100 / 3) and r["oos_val_recall"] == 80.0
    assert r["in_scope_accuracy"] == 100.0 and r["ece"] == pytest.approx(
        0.1, abs=1e-6
    )  # conf 0.9 (float32), all right
