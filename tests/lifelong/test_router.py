import pytest
import torch
import torch.nn.functional as F

from ecru.datasets import humanize_intent, load_clinc, load_wiki_sentences
from ecru.errors import EcruError
from ecru.lifelong import RoutedConfig, StreamConfig, TrainConfig, build_clinc_stream, make_method
from ecru.lifelong.methods.base import snapshot_steps
from ecru.lifelong.router import FROZEN, Router, knn_scores, route
from ecru.models import load_minilm

TRAIN = TrainConfig(epochs=1, batch_size=8, progress=False)


def _unit(*rows):
    return F.normalize(torch.tensor(rows, dtype=torch.float64), dim=-1)


def test_knn_scores_by_hand():
    keys = _unit([1, 0], [0, 1], [1, 1])
    q = _unit([1, 0])
    s2 = 2**-0.5
    torch.testing.assert_close(knn_scores(q, keys, k=1), torch.tensor([1.0], dtype=torch.float64))
    torch.testing.assert_close(knn_scores(q, keys, k=2), torch.tensor([(1 + s2) / 2], dtype=torch.float64))
    # leave-one-out: each key's neighbours are the other keys only
    loo = knn_scores(keys, keys, k=1, exclude_self=True)
    torch.testing.assert_close(loo, torch.tensor([s2, s2, s2], dtype=torch.float64))


def test_a_task_with_one_training_utterance_is_refused():
    one = F.normalize(torch.randn(1, 4), dim=-1)
    with pytest.raises(ValueError, match="two or more training utterances"):
        Router(k=5, percentile=10).add_task(one)


def test_route_takes_the_best_task_or_the_frozen_model():
    scores = torch.tensor([[0.9, 0.5], [0.2, 0.7], [0.6, 0.65]])
    thresholds = torch.tensor([0.8, 0.7])
    assert route(scores, thresholds).tolist() == [0, 1, FROZEN]  # row 3: best task 1 is below its threshold


def test_router_threshold_is_a_percentile_of_leave_one_out_scores():
    torch.manual_seed(0)
    center = F.normalize(torch.randn(8, dtype=torch.float64), dim=-1)
    emb = F.normalize(center + 0.3 * torch.randn(50, 8, dtype=torch.float64), dim=-1)  # one task's cluster
    router = Router(k=3, percentile=10)
    assert router(emb).eq(FROZEN).all()  # nothing learned yet
    router.add_task(emb)
    loo = knn_scores(emb, emb, k=3, exclude_self=True)
    assert router.thresholds[0] == pytest.approx(torch.quantile(loo, 0.1).item(), abs=1e-12)
    assert router(emb).eq(0).float().mean() >= 0.9  # a training text scores at least its leave-one-out score
    assert router(-emb).eq(FROZEN).all()


def test_snapshot_schedule():
    assert snapshot_steps(16, 5) == {3, 6, 9, 12, 15}
    assert snapshot_steps(4, 10) == {1, 2, 3, 4}
    assert snapshot_steps(100, 10) == set(range(10, 101, 10))
    assert snapshot_steps(10, 0) == frozenset()


@pytest.fixture(scope="module")
def routed():
    """The real MiniLM with `ecru` trained on two tiny CLINC domains (banking, credit_cards)."""
    stream = build_clinc_stream(StreamConfig(tasks=2, train_per_intent=6, test_per_intent=1, heldout_per_class=1,
                                             reference_size=1))  # fmt: skip
    method = make_method("ecru", load_minilm(), train=TRAIN)
    for i, task in enumerate(stream.tasks):
        method.learn(task, index=i)
    return method, stream


def test_a_task_s_own_training_text_goes_to_its_adapter(routed):
    method, stream = routed
    enc, frozen = method.encoder(), load_minilm()
    for j, task in enumerate(stream.tasks):
        texts = [e.text for e in task.train]
        # >= 90%: the threshold is the 10th percentile of leave-one-out scores, and a text's own score is higher
        assert enc.routes(texts).eq(j).float().mean() >= 0.9
        assert (enc.encode(texts) - frozen.encode(texts)).abs().max() > 1e-3  # the adapter changed them


def test_a_held_out_distribution_text_goes_to_the_frozen_model(routed):
    method, _ = routed
    enc, frozen = method.encoder(), load_minilm()
    texts = load_wiki_sentences()[:20] + [e.text for e in load_clinc()["test"] if e.domain == "travel"][:20]
    assert enc.routes(texts).eq(FROZEN).all()
    torch.testing.assert_close(enc.encode(texts), frozen.encode(texts), rtol=1e-5, atol=1e-6)


def test_intent_names_are_encoded_by_the_frozen_model(routed):
    method, stream = routed
    names = ["freeze account", "credit limit", "book a flight"]
    got = method.encoder().encode_labels(names)
    torch.testing.assert_close(got, load_minilm().encode(names), rtol=1e-5, atol=1e-6)


def test_config_override_must_match_the_preset_type(tiny_model):
    from ecru.lifelong import FinetuneConfig

    with pytest.raises(EcruError, match="RoutedConfig"):
        make_method("ecru", tiny_model(), train=TRAIN, config=FinetuneConfig())
    with pytest.raises(EcruError, match="percentile"):
        RoutedConfig(percentile=101)


def test_validation_split_never_uses_test_utterances():
    cfg = StreamConfig(
        tasks=2, train_per_intent=2, test_per_intent=3, heldout_per_class=1, reference_size=1, split="val"
    )
    stream = build_clinc_stream(cfg)
    clinc = load_clinc()
    val, test = {e.text for e in clinc["val"]}, {e.text for e in clinc["test"]}
    assert all(e.text in val and e.text not in test for t in stream.tasks for e in t.test)
    from ecru.datasets import load_banking77

    assert {e.text for e in stream.heldout} <= {e.text for e in load_banking77()["train"]}
    with pytest.raises(EcruError, match="split"):
        StreamConfig(split="dev")


def test_negatives_lower_the_threshold_to_their_quantile_but_never_raise_it():
    torch.manual_seed(0)
    center = F.normalize(torch.randn(8, dtype=torch.float64), dim=-1)
    emb = F.normalize(center + 0.3 * torch.randn(50, 8, dtype=torch.float64), dim=-1)
    far = F.normalize(-center + 0.3 * torch.randn(40, 8, dtype=torch.float64), dim=-1)  # texts of no task
    loo = knn_scores(emb, emb, k=3, exclude_self=True)
    router = Router(k=3, percentile=10, negative_quantile=0.99)
    router.add_task(emb, far)
    want = torch.quantile(knn_scores(far, emb, k=3), 0.99).item()
    assert want < torch.quantile(loo, 0.1).item()
    assert router.thresholds[0] == pytest.approx(want, abs=1e-12)
    assert router(emb).eq(0).all() and router(far).eq(FROZEN).float().mean() >= 0.95
    # negatives as close as the task's own texts: the percentile bound stays
    near = Router(k=3, percentile=10, negative_quantile=0.99)
    near.add_task(emb, emb.flip(0))
    assert near.thresholds[0] == pytest.approx(torch.quantile(loo, 0.1).item(), abs=1e-12)
    with pytest.raises(ValueError, match="negatives"):
        Router(k=3, percentile=10, negative_quantile=0.5).add_task(emb)


def test_negative_quantile_needs_the_teacher(tiny_model):
    with pytest.raises(EcruError, match="teacher"):
        make_method("ecru", tiny_model(), train=TRAIN, config=RoutedConfig(negative_quantile=0.99))
    with pytest.raises(EcruError, match="negative_quantile"):
        RoutedConfig(negative_quantile=1.5)


def test_router_among_some_tasks_with_and_without_threshold():
    torch.manual_seed(0)
    centers = F.normalize(torch.randn(3, 8, dtype=torch.float64), dim=-1)
    clusters = [F.normalize(c + 0.2 * torch.randn(30, 8, dtype=torch.float64), dim=-1) for c in centers]
    router = Router(k=3, percentile=10)
    for emb in clusters[:2]:  # tasks 0 and 1 learned; cluster 2 is an unseen domain
        router.add_task(emb)
    unseen = clusters[2]
    assert router(unseen).eq(FROZEN).all()
    assert router(unseen, tasks=[1], open_set=False).eq(1).all()  # closed set: the only candidate task
    assert router(clusters[0], tasks=[1]).eq(FROZEN).all()  # open set among task 1 only: below its threshold
    assert router(clusters[0], tasks=[0, 1], open_set=False).eq(0).all()
    assert router(clusters[1], tasks=[]).eq(FROZEN).all()
    with pytest.raises(ValueError, match="learned"):
        router(unseen, tasks=[2])


def test_labels_decide_the_route_before_the_text(routed):
    method, stream = routed  # `ecru` routes by labels
    enc = method.encoder()
    banking, cards = ([humanize_intent(i) for i in t.intents] for t in stream.tasks)
    wiki = load_wiki_sentences()[:10]
    # among one learned task's names: that task's adapter, whatever the text looks like
    assert enc.routes_among(wiki, banking).eq(0).all() and enc.routes_among(wiki, cards).eq(1).all()
    # among names of no learned task: the frozen model, whatever the text looks like
    own = [e.text for e in stream.tasks[0].train]
    assert enc.routes_among(own, ["book a flight", "weather"]).eq(FROZEN).all()
    # among learned and unlearned names: the text router with thresholds, over the named tasks only
    mixed = enc.routes_among(own + wiki, banking + ["book a flight"])
    assert mixed[: len(own)].eq(0).float().mean() >= 0.9 and mixed[len(own) :].eq(FROZEN).all()
    # a sub-question of one task (some of its intents): its adapter; a partial overlap with foreign labels
    # (Banking77's 77 names share one with CLINC's travel domain): the frozen model
    assert enc.routes_among(wiki, banking[:3]).eq(0).all()
    assert enc.routes_among(own, banking[:3] + ["book a flight", "weather"]).eq(FROZEN).all()
    # closed set over both tasks: no text goes to the frozen model
    assert enc.routes_among(own + wiki, banking + cards).ne(FROZEN).all()
    torch.testing.assert_close(
        enc.encode_among(own, ["weather"]), load_minilm().encode(own), rtol=1e-5, atol=1e-6
    )
    text_routed = make_method("ecru-text", load_minilm(), train=TRAIN)
    text_routed.load_state_dict(method.state_dict())
    assert text_routed.encoder().routes_among(wiki, banking).eq(FROZEN).all()  # "text": labels ignored


def test_label_routing_keeps_unseen_tasks_and_held_out_exactly_zero_shot(tiny_model, tiny_evaluator):
    from ecru.lifelong import run_stream

    train = TrainConfig(epochs=3, batch_size=8, progress=False)
    # a loose threshold and a large adapter lr: routed by text, unseen and held-out texts reach moved adapters
    loose = RoutedConfig(percentile=0.0, lr=3e-2, routing="labels")
    res = run_stream(
        make_method("ecru", tiny_model(), train=train, config=loose), tiny_evaluator, log=lambda s: None
    )
    assert res.R[0][1] == res.R0[1]  # task 2 not yet learned: scored by exactly the pretrained model
    assert res.heldout == [res.heldout[0]] * len(res.heldout)  # Banking77's labels were never learned
    assert res.metrics["transfer_retention"] == 0.0
    assert res.R[1] != res.R0  # learned tasks did change


def test_label_routing_needs_the_intent_names_in_a_checkpoint(routed, tiny_model):
    method, _ = routed
    state = {k: v for k, v in method.state_dict().items() if k != "names"}
    with pytest.raises(EcruError, match="intent names"):
        make_method("ecru", load_minilm(), train=TRAIN).load_state_dict(state)
    make_method("ecru-text", load_minilm(), train=TRAIN).load_state_dict(state)  # text routing needs none
    with pytest.raises(EcruError, match="routing"):
        RoutedConfig(routing="task")
    with pytest.raises(EcruError, match="frozen_labels"):
        RoutedConfig(routing="labels", frozen_labels=False)
    with pytest.raises(EcruError, match="candidate labels"):
        method.encoder().encode_among(["hello"], [])


def test_label_routing_decides_task_then_class(routed):
    method, stream = routed
    enc = method.encoder()
    banking, cards = ([humanize_intent(i) for i in t.intents] for t in stream.tasks)
    texts = [e.text for t in stream.tasks for e in t.train]
    labels = banking + cards  # class-incremental over both learned tasks
    routes, pred = enc.routes_among(texts, labels), enc.predict_among(texts, labels)
    assert routes.ne(FROZEN).all()
    # a text routed to a task is classified among that task's labels only
    assert (pred[routes == 0] < len(banking)).all() and (pred[routes == 1] >= len(banking)).all()
    # one task's labels: the same decision as scoring the routed embedding against all of them
    own = [e.text for e in stream.tasks[0].test]
    want = (enc.encode_among(own, banking) @ enc.encode_labels(banking).T).argmax(-1)
    assert torch.equal(enc.predict_among(own, banking), want)
    # text routing keeps one embedding against all labels: a text's class may come from another task
    text_routed = make_method("ecru-text", load_minilm(), train=TRAIN)
    text_routed.load_state_dict(method.state_dict())
    tenc = text_routed.encoder()
    want = (tenc.encode(texts) @ tenc.encode_labels(labels).T).argmax(-1)
    assert torch.equal(tenc.predict_among(texts, labels), want)
