import math
from dataclasses import replace

import pytest
import torch

from ecru.errors import EcruError
from ecru.io import load_state, save_state
from ecru.lifelong import METHODS, TeacherCache, TrainConfig, make_method, run_stream
from ecru.lifelong.methods import DISTILLING

TRAIN = TrainConfig(epochs=1, batch_size=8, lr=1e-3, progress=False)
COST_KEYS = {
    "trainable_params",
    "optimizer_bytes",
    "wall_s",
    "cpu_s",
    "peak_rss_mb",
    "stored_bytes",
    "stored_bytes_per_task",
}


def _teacher(stream, model, **kw):
    return TeacherCache(stream.reference, model, model_id="tiny", **kw)


@pytest.mark.parametrize("name", METHODS)
def test_each_method_runs_a_tiny_stream(name, tiny_model, tiny_evaluator):
    stream = tiny_evaluator.stream
    method = make_method(name, tiny_model(), train=TRAIN, teacher=_teacher(stream, tiny_model()))
    res = run_stream(method, tiny_evaluator, log=lambda s: None)
    T = len(stream.tasks)
    assert len(res.R) == len(res.R_agnostic) == T and all(len(r) == T for r in res.R)
    assert len(res.heldout) == T + 1 and len(res.R0) == T
    assert all(0 <= a <= 100 for row in res.R + res.R_agnostic for a in row)
    assert COST_KEYS <= set(res.cost) and all(math.isfinite(v) for v in res.cost.values())
    assert not math.isnan(res.metrics["transfer_retention"])
    texts = [e.text for e in stream.tasks[0].train[:8]]
    moved = (method.encoder().encode(texts) - tiny_model().encode(texts)).abs().max()
    if name == "zeroshot":
        assert res.cost["trainable_params"] == 0 and res.R == [res.R0] * T and moved == 0
    elif name == "ncm":  # training-free: class means of frozen embeddings
        assert res.cost["trainable_params"] == 0 and moved == 0 and res.cost["stored_bytes"] > 0
    else:
        assert (
            res.cost["trainable_params"] > 0
            and res.cost["optimizer_bytes"] >= 8 * res.cost["trainable_params"]
        )
        assert moved > 1e-4  # training changed what the model computes


def test_routed_thresholds_from_reference_negatives_run_a_tiny_stream(tiny_model, tiny_evaluator):
    from ecru.lifelong import RoutedConfig
    from ecru.lifelong.methods import needs_teacher

    stream, cfg = tiny_evaluator.stream, RoutedConfig(negative_quantile=0.99)
    assert needs_teacher("routed-lora", cfg) and not needs_teacher("ecru") and needs_teacher("zscl")
    teacher = _teacher(stream, tiny_model())
    plain = make_method("routed-lora", tiny_model(), train=TRAIN, config=RoutedConfig())
    method = make_method("routed-lora", tiny_model(), train=TRAIN, teacher=teacher, config=cfg)
    res = run_stream(method, tiny_evaluator, log=lambda s: None)
    assert len(res.R) == len(stream.tasks) and teacher.computed == 1
    plain.learn(stream.tasks[0], index=0)
    # the negatives can only lower a task's threshold
    assert method.router.thresholds[0] <= plain.router.thresholds[0]


def test_routed_reference_distillation_pulls_reference_texts_back_to_the_frozen_embeddings(
    tiny_model, tiny_evaluator
):
    from ecru.lifelong import RoutedConfig
    from ecru.lifelong.methods import needs_teacher

    stream = tiny_evaluator.stream
    teacher = _teacher(stream, tiny_model())
    cfg = RoutedConfig(reference=5.0, lr=1e-2)
    assert needs_teacher("routed-lora", cfg)
    with pytest.raises(EcruError, match="teacher"):
        make_method("routed-lora", tiny_model(), train=TRAIN, config=cfg)
    drift = {}
    for weight in (0.0, 5.0):
        m = make_method(
            "routed-lora",
            tiny_model(),
            train=TRAIN,
            teacher=teacher,
            config=RoutedConfig(reference=weight, lr=1e-2),
        )
        m.learn(stream.tasks[0], index=0)
        m.peft.base_model.set_adapter(m.adapters[0])
        ref = list(teacher.texts[:16])
        drift[weight] = (m.student.encode(ref) - teacher.embeddings()[:16]).norm(dim=-1).mean().item()
    assert drift[5.0] < drift[0.0]  # the adapter moves reference texts less when distilled on them


def test_adapter_methods_train_only_adapters(tiny_model, tiny_evaluator):
    stream = tiny_evaluator.stream
    full = sum(p.numel() for p in tiny_model().parameters())
    for name in ("seqlora", "lora-per-task", "shared-lora-zscl", "routed-lora"):
        model = tiny_model()
        before = {k: v.clone() for k, v in model.encoder.state_dict().items()}
        method = make_method(name, model, train=TRAIN, teacher=_teacher(stream, tiny_model()))
        cost = method.learn(stream.tasks[0], index=0)
        assert 0 < cost.trainable_params < full
        base = {k.replace("base_model.model.", "").replace(".base_layer", ""): v
                for k, v in model.encoder.state_dict().items() if "lora_" not in k}  # fmt: skip
        for k, v in before.items():
            torch.testing.assert_close(base[k], v, rtol=0, atol=0)


def test_teacher_outputs_are_computed_once(tiny_model, tiny_evaluator, tmp_path):
    stream, teacher_model = tiny_evaluator.stream, tiny_model()
    cache = _teacher(stream, teacher_model, folder=tmp_path)
    for name in sorted(DISTILLING):
        run_stream(
            make_method(name, tiny_model(), train=TRAIN, teacher=cache), tiny_evaluator, log=lambda s: None
        )
    assert cache.computed == 1
    again = _teacher(stream, teacher_model, folder=tmp_path)  # a new process: read from disk, not re-encoded
    torch.testing.assert_close(again.embeddings(), cache.embeddings(), rtol=0, atol=0)
    assert again.computed == 0


@pytest.mark.parametrize(
    "name", ["seqft", "replay", "lora-per-task", "zscl", "shared-lora-zscl", "routed-lora"]
)
def test_resume_from_task_checkpoint_equals_uninterrupted_run(name, tiny_model, tiny_evaluator, tmp_path):
    stream = tiny_evaluator.stream

    def method():
        model = tiny_model()
        return make_method(name, model, train=TRAIN, teacher=_teacher(stream, tiny_model())), model

    whole, whole_model = method()
    ref = run_stream(whole, tiny_evaluator, checkpoint_dir=tmp_path / "a", log=lambda s: None)
    stopped = run_stream(
        method()[0], tiny_evaluator, checkpoint_dir=tmp_path / "b", stop_after=1, log=lambda s: None
    )
    assert stopped is None
    resumed, resumed_model = method()
    got = run_stream(resumed, tiny_evaluator, checkpoint_dir=tmp_path / "b", log=lambda s: None)
    assert (got.R, got.R_agnostic, got.heldout) == (ref.R, ref.R_agnostic, ref.heldout)
    # the first task's cost comes from the checkpoint, memory and CPU time included
    assert got.cost["peak_rss_mb"] > 0 and got.cost["cpu_s"] > 0
    want = whole_model.encoder.state_dict()
    for k, v in resumed_model.encoder.state_dict().items():
        torch.testing.assert_close(v, want[k], rtol=0, atol=0, msg=lambda m, k=k: f"{k}: {m}")


def test_resume_refuses_a_checkpoint_of_another_run(tiny_model, tiny_evaluator, tmp_path):
    from dataclasses import replace

    from ecru.errors import EcruError

    run_stream(make_method("seqft", tiny_model(), train=TRAIN), tiny_evaluator, checkpoint_dir=tmp_path,
               stop_after=1, log=lambda s: None)  # fmt: skip
    for other in (
        make_method("seqft", tiny_model(), train=replace(TRAIN, lr=2 * TRAIN.lr)),
        make_method("lwf", tiny_model(), train=TRAIN),
    ):
        with pytest.raises(EcruError, match="different run"):
            run_stream(other, tiny_evaluator, checkpoint_dir=tmp_path, log=lambda s: None)


def test_resume_checks_the_stream_texts_not_only_their_sizes(tiny_model, tiny_evaluator, tmp_path):
    from ecru.lifelong import Evaluator, StreamConfig, build_clinc_stream
    from ecru.lifelong.runner import stream_digest

    run_stream(make_method("seqft", tiny_model(), train=TRAIN), tiny_evaluator, checkpoint_dir=tmp_path,
               stop_after=1, log=lambda s: None)  # fmt: skip
    # another sampling seed: the same domains and sizes, other utterances
    other = Evaluator(build_clinc_stream(replace(StreamConfig(tasks=2, train_per_intent=2, test_per_intent=1,
                      heldout_per_class=1, reference_size=24), seed=1)))  # fmt: skip
    assert stream_digest(other.stream) != stream_digest(tiny_evaluator.stream)
    with pytest.raises(EcruError, match="texts differ"):
        run_stream(
            make_method("seqft", tiny_model(), train=TRAIN),
            other,
            checkpoint_dir=tmp_path,
            log=lambda s: None,
        )
    # a checkpoint written before the texts were signed resumes, and says so
    ckpt = load_state(tmp_path / "last.safetensors")
    del ckpt["signature"]["texts"]
    save_state(tmp_path / "last.safetensors", ckpt)
    said = []
    run_stream(
        make_method("seqft", tiny_model(), train=TRAIN),
        tiny_evaluator,
        checkpoint_dir=tmp_path,
        log=said.append,
    )
    assert any("predates the texts check" in line for line in said)


def test_wise_ft_interpolates_the_fine_tuned_weights_with_the_initial_ones(tiny_model, tiny_evaluator):
    task = tiny_evaluator.stream.tasks[0]
    init = {k: v.clone() for k, v in tiny_model().encoder.state_dict().items()}
    ft, wise = (
        make_method("seqft", tiny_model(), train=TRAIN),
        make_method("wise-ft", tiny_model(), train=TRAIN),
    )
    ft.learn(task, index=0)
    wise.learn(task, index=0)
    tuned, got = ft.encoder().encoder.state_dict(), wise.encoder().encoder.state_dict()
    for k, v in got.items():
        if v.is_floating_point():
            torch.testing.assert_close(v, init[k] + 0.5 * (tuned[k] - init[k]), rtol=1e-6, atol=1e-7)


def test_distilling_method_without_teacher_is_a_clear_error(tiny_model):
    with pytest.raises(EcruError, match="TeacherCache"):
        make_method("zscl", tiny_model(), train=TRAIN)
    with pytest.raises(EcruError, match="unknown method"):
        make_method("sgd", tiny_model(), train=TRAIN)


def _adapter_weights(tiny_model, stream, train, cfg):
    method = make_method("routed-lora", tiny_model(), train=train, config=cfg)
    method.learn(stream.tasks[0], index=0)
    return method.state_dict()["weights"]


def test_routed_label_smoothing_overrides_the_run_s_only_when_set(tiny_model, tiny_evaluator):
    from ecru.lifelong import RoutedConfig

    stream, cfg = tiny_evaluator.stream, RoutedConfig()
    smooth, plain = replace(TRAIN, label_smoothing=0.2), replace(TRAIN, label_smoothing=0.0)
    own = _adapter_weights(tiny_model, stream, smooth, replace(cfg, label_smoothing=0.0))
    run = _adapter_weights(tiny_model, stream, plain, replace(cfg, label_smoothing=None))
    other = _adapter_weights(tiny_model, stream, smooth, replace(cfg, label_smoothing=None))
    assert own.keys() == run.keys()
    assert all(torch.equal(own[k], run[k]) for k in own)  # 0.0 in the config = 0.0 in the run's TrainConfig
    assert any(not torch.equal(own[k], other[k]) for k in own)  # and differs from the run's 0.2
    with pytest.raises(EcruError, match="label_smoothing"):
        RoutedConfig(label_smoothing=1.0)


def test_few_margin_is_the_margin_of_a_task_with_few_texts_per_label(tiny_model, tiny_evaluator):
    from ecru.lifelong.methods import ROUTED, RoutedConfig

    task, preset = tiny_evaluator.stream.tasks[0], ROUTED["routed-lora"]  # 2 training texts per label
    texts = [e.text for e in task.test] + ["will it snow tomorrow"]
    labels = [*(n.replace("_", " ") for n in task.intents), "weather", "book a flight"]

    def scores(cfg):
        m = make_method("routed-lora", tiny_model(), train=TRAIN, config=cfg)
        m.learn(task, index=0)
        return m, m.encoder().scores(texts, labels)

    few, got = scores(replace(preset, few_margin=-0.3, few_texts=3.0))
    _, reference = scores(replace(preset, margin=-0.3, few_margin=None))  # the same training, one margin
    assert few.margin(0) == -0.3
    torch.testing.assert_close(got, reference, rtol=0, atol=1e-6)
    many, _ = scores(replace(preset, few_margin=-0.3, few_texts=2.0))  # 2 texts per label is not fewer than 2
    assert many.margin(0) == preset.margin
    with pytest.raises(EcruError, match="few_margin needs router='lda'"):
        RoutedConfig(router="prototypes", margin=0.0, few_margin=-0.1)
