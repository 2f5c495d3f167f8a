from collections import Counter

import torch

from ecru.datasets import humanize_intent
from ecru.lifelong.evaluate import CandidateAwareEncoder, LabelAwareEncoder


class Spy:
    """A candidate-aware encoder that records which names each group of texts is classified among."""

    def __init__(self, dim: int = 8):
        self.dim, self.calls = dim, []

    def _emb(self, texts):
        g = torch.Generator().manual_seed(len(texts))
        return torch.nn.functional.normalize(torch.randn(len(texts), self.dim, generator=g), dim=-1)

    def encode(self, texts, *, batch_size=64):
        raise AssertionError("a candidate-aware encoder is asked with encode_among only")

    def encode_labels(self, texts, *, batch_size=64):
        return self._emb(texts)

    def encode_among(self, texts, labels, *, batch_size=64):
        self.calls.append((frozenset(texts), tuple(labels)))
        return self._emb(texts)


def test_evaluator_asks_each_group_among_its_own_candidate_names(tiny_evaluator):
    stream, spy = tiny_evaluator.stream, Spy()
    assert isinstance(spy, CandidateAwareEncoder) and isinstance(spy, LabelAwareEncoder)
    tiny_evaluator.evaluate(spy, seen=1)
    names = [[humanize_intent(i) for i in t.intents] for t in stream.tasks]
    texts = [frozenset(e.text for e in t.test) for t in stream.tasks]
    held = (
        frozenset(e.text for e in stream.heldout),
        tuple(humanize_intent(x) for x in stream.heldout_labels),
    )
    want = [
        (texts[0], tuple(names[0])),  # task-incremental, task 1
        (texts[0], tuple(names[0])),  # class-incremental after task 1: task 1's names only
        (texts[1], tuple(names[1])),  # task-incremental, task 2
        (texts[1], tuple(names[0] + names[1])),  # class-incremental: seen tasks' names plus task 2's
        held,
    ]
    assert Counter(spy.calls) == Counter(want)  # as multisets: equal sets may print in different orders


class Oracle(Spy):
    """Embeds each text as its gold intent name, among whatever names it is asked with: 100% if the Evaluator
    pairs every group of texts with the right candidate names, in the right order, and the right gold indices."""

    def __init__(self, stream):
        super().__init__(dim=len(stream.tasks) * 15 + len(stream.heldout_labels))
        gold = [(e.text, e.label) for t in stream.tasks for e in t.test] + [
            (e.text, e.label) for e in stream.heldout
        ]
        self.gold = {text: humanize_intent(label) for text, label in gold}
        names = [humanize_intent(i) for t in stream.tasks for i in t.intents]
        self.index = {n: k for k, n in enumerate(names + [humanize_intent(x) for x in stream.heldout_labels])}

    def encode_labels(self, texts, *, batch_size=64):
        return torch.nn.functional.one_hot(torch.tensor([self.index[t] for t in texts]), self.dim).float()

    def encode_among(self, texts, labels, *, batch_size=64):
        assert all(self.gold[t] in labels for t in texts), "a text asked among names that exclude its own"
        return self.encode_labels([self.gold[t] for t in texts])


def test_evaluator_scores_an_oracle_at_100_everywhere(tiny_evaluator):
    for seen in (0, 1, 2):
        row = tiny_evaluator.evaluate(Oracle(tiny_evaluator.stream), seen=seen)
        assert row.ti == [100.0, 100.0] and row.ci == [100.0, 100.0] and row.heldout == 100.0


class PredictingOracle(Oracle):
    def predict_among(self, texts, labels, *, batch_size=64):
        assert all(self.gold[t] in labels for t in texts), "a text asked among names that exclude its own"
        return torch.tensor([labels.index(self.gold[t]) for t in texts])


def test_evaluator_takes_a_predicting_encoder_s_decisions(tiny_evaluator):
    for seen in (0, 2):
        row = tiny_evaluator.evaluate(PredictingOracle(tiny_evaluator.stream), seen=seen)
        assert row.ti == [100.0, 100.0] and row.ci == [100.0, 100.0] and row.heldout == 100.0
