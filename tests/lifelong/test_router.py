import pytest
import torch
import torch.nn.functional as F

from ecru.datasets import humanize_intent, load_clinc, load_wiki_sentences
from ecru.errors import EcruError
from ecru.lifelong import RoutedConfig, StreamConfig, TrainConfig, build_clinc_stream, make_method
from ecru.lifelong.methods.base import snapshot_steps
from ecru.lifelong.router import FROZEN, LDARouter, Router, knn_scores, prototype_scores, route
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
    """The real MiniLM with `routed-lora` trained on two tiny CLINC domains (banking, credit_cards)."""
    stream = build_clinc_stream(StreamConfig(tasks=2, train_per_intent=6, test_per_intent=1, heldout_per_class=1,
                                             reference_size=1))  # fmt: skip
    method = make_method("routed-lora", load_minilm(), train=TRAIN)
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
        make_method("routed-lora", tiny_model(), train=TRAIN, config=FinetuneConfig())
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
        make_method("routed-lora", tiny_model(), train=TRAIN, config=RoutedConfig(negative_quantile=0.99))
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


def test_task_then_class_a_routed_text_is_classified_among_its_task_s_labels(routed):
    method, stream = routed
    enc = _variant(method)  # the plain rule: no margin, no blend, no reject penalty
    banking, cards = ([humanize_intent(i) for i in t.intents] for t in stream.tasks)
    texts = [e.text for t in stream.tasks for e in t.train]
    routes, pred = enc.routes(texts), enc.scores(texts, banking + cards).argmax(-1)
    assert routes.ne(FROZEN).any()
    assert (pred[routes == 0] < len(banking)).all() and (pred[routes == 1] >= len(banking)).all()
    # among one task's labels only: the routed task's own labels if it is that task, else the frozen choice
    frozen = load_minilm()
    want = (frozen.encode(texts) @ frozen.encode(cards).T).argmax(-1)
    got = enc.scores(texts, cards).argmax(-1)
    assert torch.equal(got[routes != 1], want[routes != 1])
    # a text routed to the frozen model is scored by the frozen model against every label
    wiki = load_wiki_sentences()[:10]
    assert enc.routes(wiki).eq(FROZEN).all()
    torch.testing.assert_close(
        enc.scores(wiki, banking), frozen.encode(wiki) @ frozen.encode(banking).T, rtol=1e-5, atol=1e-5
    )


def test_the_gate_sends_every_text_to_the_given_task(routed):
    method, _ = routed
    enc = method.encoder()
    wiki = load_wiki_sentences()[:5]
    method.peft.base_model.set_adapter(method.adapters[1])
    torch.testing.assert_close(
        enc.for_task(1).encode(wiki), method.student.encode(wiki), rtol=1e-5, atol=1e-6
    )
    with pytest.raises(EcruError, match="not learned"):
        enc.for_task(2)


def test_prototype_router_by_hand():
    from ecru.lifelong.router import PrototypeRouter, class_prototypes, loo_prototype_scores

    emb = _unit([1, 0], [1, 0.2], [0, 1], [0.2, 1], [1, 1])
    labels = torch.tensor([0, 0, 1, 1, 1])
    protos = class_prototypes(emb, labels, 2)
    torch.testing.assert_close(protos[0], F.normalize(emb[0] + emb[1], dim=0))
    loo = loo_prototype_scores(emb, labels, 2)
    # text 0 without itself: its class mean is text 1; the other class's mean is left as is
    want0 = max((emb[0] @ emb[1]).item(), (emb[0] @ protos[1]).item())
    assert loo[0].item() == pytest.approx(want0, abs=1e-12)
    router = PrototypeRouter(percentile=0.0)
    router.add_task(emb, labels=labels)
    assert router.thresholds[0] == pytest.approx(loo.min().item(), abs=1e-12)
    assert router(emb).eq(0).all() and router(-emb).eq(FROZEN).all()
    assert router.state_dict()["prototypes"][0].shape == (2, 2)  # C x D stored, not N x D
    # one text per class: each text's score leaves its own class out entirely (the other classes remain)
    single = loo_prototype_scores(emb[[0, 2]], torch.tensor([0, 1]), 2)
    torch.testing.assert_close(single, (emb[0] @ emb[2]).repeat(2))
    with pytest.raises(ValueError, match="two or more"):
        PrototypeRouter(percentile=5).add_task(emb[[0]], labels=torch.tensor([0]))


def _variant(method, **fields):
    """The trained `method`'s state under another decision rule (same adapters and router)."""
    config = RoutedConfig(**{"router": method.cfg.router, **fields})
    other = make_method("routed-lora", load_minilm(), train=TRAIN, config=config)
    other.load_state_dict(method.state_dict())
    return other.encoder()


def test_margin_lets_the_frozen_model_veto_a_route(routed):
    method, stream = routed
    banking = [humanize_intent(i) for i in stream.tasks[0].intents]
    foreign = ["book a flight", "what is the weather", "set an alarm", "play music"]  # learned by no task
    labels = banking + foreign
    texts = [e.text for e in stream.tasks[0].train] + ["i lost my card yesterday", "flight to paris please"]
    frozen = load_minilm()
    F = frozen.encode(texts) @ frozen.encode(labels).T
    own = torch.tensor([n in banking for n in labels])
    for margin in (0.0, 0.1, -0.05):
        enc = _variant(method, margin=margin)
        routes = enc.routes(texts)
        lead = F[:, own].max(-1).values + margin - F[:, ~own].max(-1).values
        accept, clear = lead >= 0, lead.abs() > 1e-5  # float noise between the two frozen paths
        adapter = (enc.for_task(0).encode(texts) @ frozen.encode(banking).T).argmax(-1)
        pred = enc.scores(texts, labels).argmax(-1)
        to0 = (routes == 0) & clear
        assert to0.sum() >= len(texts) // 2
        torch.testing.assert_close(pred[to0 & accept], adapter[to0 & accept])
        torch.testing.assert_close(pred[to0 & ~accept], F.argmax(-1)[to0 & ~accept])


def test_prototype_weight_one_is_nearest_class_mean_within_the_task(routed):
    method, stream = routed
    cards = [humanize_intent(i) for i in stream.tasks[1].intents]
    enc = _variant(method, prototype_weight=1.0)
    texts = [e.text for e in stream.tasks[1].test] + [e.text for e in stream.tasks[1].train][:10]
    routes = enc.routes(texts)
    want = (load_minilm().encode(texts) @ method.router.prototypes[1].T).argmax(-1)
    got = enc.scores(texts, cards).argmax(-1)
    assert routes.eq(1).any()
    torch.testing.assert_close(got[routes == 1], want[routes == 1])
    # the gate (task given) uses the same blend
    torch.testing.assert_close(enc.for_task(1).scores(texts, cards).argmax(-1), want)
    with pytest.raises(EcruError, match="prototype_weight"):
        RoutedConfig(router="knn", prototype_weight=0.5)


def test_rejected_texts_prefer_unlearned_labels_and_routes_never_pick_another_task_s(routed):
    method, stream = routed
    banking, cards = ([humanize_intent(i) for i in t.intents] for t in stream.tasks)
    unlearned = ["book a flight", "what is the weather", "set an alarm"]
    wiki = load_wiki_sentences()[:10]
    enc = _variant(method, reject_penalty=2.0, margin=0.0)
    assert enc.routes(wiki).eq(FROZEN).all()  # below every threshold: rejected
    assert (enc.scores(wiki, banking + unlearned).argmax(-1) >= len(banking)).all()  # an unlearned label
    # only learned candidates: the best task's choice stands (its labels, never the other task's)
    best = method.router(enc.frozen(wiki), open_set=False)
    pred = enc.scores(wiki, banking + cards).argmax(-1)
    assert torch.equal(pred >= len(banking), best == 1)
    texts = [e.text for t in stream.tasks for e in t.train]
    gated = _variant(method, margin=0.0)
    routes, pred = gated.routes(texts), gated.scores(texts, banking + cards + unlearned).argmax(-1)
    in_cards = (pred >= len(banking)) & (pred < len(banking) + len(cards))
    assert not in_cards[routes == 0].any() and not (pred[routes == 1] < len(banking)).any()
    with pytest.raises(EcruError, match="margin"):
        RoutedConfig(reject_penalty=1.0)
    with pytest.raises(EcruError, match="margin"):
        RoutedConfig(margin=-1.5)


def test_ledoit_wolf_matches_sklearn_on_centred_samples():
    from sklearn.covariance import LedoitWolf

    from ecru.lifelong.router import ledoit_wolf

    torch.manual_seed(0)
    x = torch.randn(40, 6, dtype=torch.float64) @ torch.randn(6, 6, dtype=torch.float64)
    got = ledoit_wolf(x.T @ x, 40, float((x.norm(dim=-1) ** 4).sum()))
    want = torch.tensor(LedoitWolf(assume_centered=True).fit(x.numpy()).covariance_)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_lda_router_pools_the_covariance_and_separates_what_cosine_cannot():
    from ecru.lifelong.router import LDARouter, PrototypeRouter, lda_head

    # two tasks of one class each, 1 degree apart in direction, both spread widely along a shared axis:
    # the cosine to the class means mixes them up, LDA with the pooled covariance does not
    torch.manual_seed(0)
    base, spread, sep = torch.tensor([1.0, 0, 0]), torch.tensor([0, 1.0, 0]), torch.tensor([0, 0, 0.02])

    def task(sign, n=200):
        return base + sign * sep + spread * 0.5 * torch.randn(n, 1) + 0.002 * torch.randn(n, 3)

    a, b = task(1), task(-1)
    lda, proto = LDARouter(percentile=0.0), PrototypeRouter(percentile=0.0)
    for r in (lda, proto):
        r.add_task(a, labels=torch.zeros(200, dtype=torch.long))
        r.add_task(b, labels=torch.zeros(200, dtype=torch.long))
    test_a, test_b = task(1), task(-1)
    assert lda(test_a, open_set=False).eq(0).float().mean() > 0.95
    assert lda(test_b, open_set=False).eq(1).float().mean() > 0.95
    assert proto(test_a, open_set=False).eq(0).float().mean() < 0.9  # the prototypes alone cannot
    # the head is LDA with the pooled (shrunk) covariance, by hand
    means = torch.stack([a.mean(0), b.mean(0)]).double()
    cov = torch.tensor([[1.0, 0.2, 0], [0.2, 2.0, 0], [0, 0, 0.5]], dtype=torch.float64)
    w, bias = lda_head(means, cov)
    x = torch.randn(3, dtype=torch.float64)
    inv = torch.linalg.inv(cov)
    torch.testing.assert_close(x @ w.T + bias, x @ inv @ means.T - 0.5 * ((means @ inv) * means).sum(-1))
    # learned in two steps or loaded from two one-task states (the store's path): the same head
    merged = LDARouter(percentile=0.0)
    one, two = ({k: v[i : i + 1] for k, v in lda.state_dict().items()} for i in (0, 1))
    merged.load_state_dict({k: one[k] + two[k] for k in one})
    torch.testing.assert_close(merged.logits(test_a, 1), lda.logits(test_a, 1))


def test_lda_weight_needs_the_lda_router():
    with pytest.raises(EcruError, match="lda_weight"):
        RoutedConfig(router="prototypes", lda_weight=0.1)
    with pytest.raises(EcruError, match="lda_weight"):
        RoutedConfig(router="lda", lda_weight=-1.0)


def test_lda_router_survives_a_task_whose_texts_repeat_verbatim():
    from ecru.lifelong.router import LDARouter

    emb = _unit([1, 0, 0], [1, 0, 0], [0, 1, 0], [0, 1, 0])  # two classes, each one text twice: no spread
    router = LDARouter(percentile=0.0)
    router.add_task(emb, labels=torch.tensor([0, 0, 1, 1]))
    assert router.logits(emb, 0).isfinite().all()
    assert router(emb, open_set=False).eq(0).all() and router(-emb).eq(FROZEN).all()


def test_adapter_prototypes_are_class_means_through_the_task_s_own_adapter(routed):
    from ecru.lifelong.router import class_prototypes

    method, stream = routed
    assert method.cfg.adapter_prototype_weight > 0  # the preset keeps them from training
    enc = method.encoder()  # after both tasks: task 0's adapter must not have moved since its prototypes
    for t, task in enumerate(stream.tasks):
        texts = [e.text for e in task.train]
        labels = torch.tensor([task.intents.index(e.label) for e in task.train])
        want = class_prototypes(enc.for_task(t).encode(texts), labels, len(task.intents))
        protos, counts = method.adapter_prototypes[t]
        torch.testing.assert_close(protos, want, atol=1e-5, rtol=0)
        assert counts.tolist() == torch.bincount(labels, minlength=len(task.intents)).float().tolist()


def test_adapter_prototype_weight_adds_the_adapter_cosine_to_them_within_the_task(routed):
    method, stream = routed
    task = stream.tasks[1]
    cards = [humanize_intent(i) for i in task.intents]
    texts = [e.text for e in task.test] + [e.text for e in stream.tasks[0].train][:10]
    frozen, names = load_minilm().encode(texts), load_minilm().encode(cards)
    labels = torch.tensor([task.intents.index(e.label) for e in task.train])
    protos, counts = method._adapter_prototypes([e.text for e in task.train], labels, 1, len(task.intents))
    counts[0] = 1.0  # a label with fewer texts: its prototype weighs less
    for weight, support in ((1.0, 8.0), (50.0, 8.0), (50.0, 0.5)):
        enc = _variant(
            method, adapter_prototype_weight=weight, adapter_prototype_support=support, lda_weight=0.05
        )
        enc.m.adapter_prototypes[1] = (protos, counts)
        emb = enc.for_task(1).encode(texts)
        w = weight * counts / (counts + support)
        blend = emb @ names.T + 0.05 / TRAIN.scale * method.router.logits(frozen, 1) + emb @ protos.T * w
        torch.testing.assert_close(
            enc.for_task(1).scores(texts, cards), blend
        )  # the task given: the blend itself
    # a task kept without them (a store written before) is scored without the term
    enc = _variant(method, adapter_prototype_weight=1.0, lda_weight=0.05)
    enc.m.adapter_prototypes = [None] * len(stream.tasks)
    plain = _variant(method, lda_weight=0.05)
    torch.testing.assert_close(enc.for_task(1).scores(texts, cards), plain.for_task(1).scores(texts, cards))
    with pytest.raises(EcruError, match="adapter_prototype_weight"):
        RoutedConfig(adapter_prototype_weight=-1.0)
    with pytest.raises(EcruError, match="adapter_prototype_support"):
        RoutedConfig(adapter_prototype_support=0.0)


def test_relative_mahalanobis_against_a_plain_reference():
    from ecru.lifelong.router import (
        class_statistics,
        ledoit_wolf,
        relative_mahalanobis,
        relative_mahalanobis_head,
    )

    torch.manual_seed(0)
    labels = torch.arange(3).repeat(20)
    emb = torch.randn(3, 8)[labels] + 0.3 * torch.randn(60, 8)
    stats = class_statistics(emb, labels, 3)
    counts = torch.bincount(labels).float()
    got = relative_mahalanobis(emb[:5], relative_mahalanobis_head(*stats, counts))
    # by hand: per pair (x - m)^T S^-1 (x - m), the background's covariance the total one
    means = stats[0].double()
    within = ledoit_wolf(stats[1].double(), stats[2], stats[3]) + 1e-6 * torch.eye(8, dtype=torch.float64)
    centre = means.mean(0)  # equal counts
    between = sum(torch.outer(m - centre, m - centre) for m in means) / 3

    def d2(x, m, cov):
        return (x - m) @ torch.linalg.solve(cov, x - m)

    want = torch.stack(
        [d2(x, centre, within + between) - min(d2(x, m, within) for m in means) for x in emb[:5].double()]
    )
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_the_cross_fitted_relative_mahalanobis_threshold_rejects_its_percentile_of_new_texts():
    from ecru.lifelong.router import (
        LDARouter,
        class_statistics,
        cross_fitted_relative_mahalanobis,
        relative_mahalanobis,
        relative_mahalanobis_head,
    )

    torch.manual_seed(0)
    dim, classes = 64, 5
    centres, spread = 2 * torch.randn(classes, dim), torch.logspace(0.5, -1.5, dim)  # a decaying spectrum

    def texts(n):
        labels = torch.arange(classes).repeat(n // classes)
        return centres[labels] + torch.randn(len(labels), dim) * spread, labels

    (train, labels), (fresh, _) = texts(200), texts(2000)
    head = relative_mahalanobis_head(
        *class_statistics(train, labels, classes), torch.bincount(labels).float()
    )
    fresh_scores = relative_mahalanobis(fresh, head)
    crossed = torch.quantile(cross_fitted_relative_mahalanobis(train, labels), 0.10)
    in_sample = torch.quantile(relative_mahalanobis(train, head), 0.10)
    # the cross-fitted 10th percentile rejects about 10% of new texts of the task; in-sample scores are optimistic
    # (200 texts in 64 dimensions) and their 10th percentile rejects far more
    assert 0.03 <= (fresh_scores < crossed).float().mean() <= 0.15
    assert (fresh_scores < in_sample).float().mean() > 0.2
    # the router applies the test on top of the prototype test: a text near a class mean in cosine but off the
    # task's spread in Mahalanobis distance (along its least varying direction) is rejected with rmd_percentile,
    # routed without it
    odd = centres[:1] + 3 * torch.nn.functional.one_hot(torch.tensor([dim - 1]), dim)
    with_rmd, without = LDARouter(percentile=0.0, rmd_percentile=10.0), LDARouter(percentile=0.0)
    for r in (with_rmd, without):
        r.add_task(train, labels=labels)
    assert without(odd).item() == 0 and with_rmd(odd).item() == FROZEN
    assert with_rmd(fresh).eq(0).float().mean() > 0.8
    # a one-task state (the store's files) loads back into the same test
    loaded = LDARouter(percentile=0.0, rmd_percentile=10.0)
    loaded.load_state_dict({k: v[:1] for k, v in with_rmd.state_dict().items()})
    assert torch.equal(loaded(fresh), with_rmd(fresh))
    with pytest.raises(EcruError, match="relative Mahalanobis"):
        loaded.load_state_dict(without.state_dict())
    # the halves depend on the texts, not on their order, so the threshold does too
    shuffled = torch.randperm(len(train))
    again = LDARouter(percentile=0.0, rmd_percentile=10.0)
    again.add_task(train[shuffled], labels=labels[shuffled])
    assert again.rmd_thresholds == with_rmd.rmd_thresholds
    # one text per class: nothing to cross-fit, the test never rejects
    tiny = LDARouter(percentile=0.0, rmd_percentile=10.0)
    tiny.add_task(train[:classes], labels=labels[:classes])
    assert tiny.rmd_thresholds == [float("-inf")] and tiny(train[:classes]).eq(0).all()


def test_rmd_percentile_needs_the_lda_router():
    with pytest.raises(EcruError, match="rmd_percentile"):
        RoutedConfig(router="prototypes", rmd_percentile=10.0)
    with pytest.raises(EcruError, match="rmd_percentile"):
        RoutedConfig(router="lda", rmd_percentile=120.0)


def test_admit_lowers_thresholds_to_the_held_out_quantile_and_never_raises_them():
    g = torch.Generator().manual_seed(3)
    emb = torch.nn.functional.normalize(torch.randn(40, 16, generator=g), dim=-1)
    labels = torch.arange(40) % 4
    router = LDARouter(percentile=10.0, rmd_percentile=5.0)
    router.add_task(emb[:30], labels=labels[:30])
    before = (router.thresholds[0], router.rmd_thresholds[0])
    held = emb[30:]
    router.admit(0, held, quantile=0.0)
    own = prototype_scores(held, router.prototypes[0])
    assert router.thresholds[0] == pytest.approx(min(before[0], own.min().item()), abs=1e-6)
    assert router.rmd_thresholds[0] == pytest.approx(min(before[1], router.rmd_scores(held, 0).min().item()))
    assert (router(held) == 0).all()  # every held-out text is claimed now
    router.admit(0, router.prototypes[0], quantile=0.0)  # texts at the prototypes score higher: no change
    assert router.thresholds[0] <= before[0] and router.rmd_thresholds[0] <= before[1]
