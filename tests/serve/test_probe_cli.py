"""`ecru serve probe` fits cb-srpt's remaining-length probe and cb-sjf's prompt-length predictor on a user's
prompts; `serve run/api --policy cb-sjf/cb-srpt --length-predictor DIR --remaining-probe DIR` serve with them
(greedy answers unchanged)."""

import json

import pytest
import torch

from ecru.cli import main
from ecru.errors import EcruError
from ecru.serve.predict.predictors import LENGTH_FILE, EmbeddingPredictor, read_length_file
from ecru.serve.predict.remaining import PROBE_FILE, RemainingProbe, model_key

from .test_batch_run import answers, run, write_lines

PROMPTS = ["Once upon a time", "hi", "The weather today", "List three fruits", "Why is the sky blue",
           "Tell me a story", "a b c", "Count to ten", "What is a cache", "Name a colour", "Say yes",
           "Explain rain"]  # fmt: skip


@pytest.fixture(scope="module")
def probe_dir(chat_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("probe")
    src = write_lines(tmp / "p.jsonl", [{"prompt": p} for p in PROMPTS])
    out = tmp / "probe"
    args = ["--model", str(chat_model_dir), "--in", str(src), "--out", str(out), "--max-new-tokens", "40"]
    assert main(["serve", "probe", *args]) == 0
    return out


def test_a_fitted_probe_is_saved_with_its_model_and_held_out_report(probe_dir, chat_model_dir):
    probe = RemainingProbe.load(probe_dir)
    assert probe.model == model_key(str(chat_model_dir)) and probe.cap == 40 and probe.hidden_size == 32
    report = json.loads((probe_dir / "probe.json").read_text())
    held = report["held_out"]
    assert report["cap"] == 40 and held["answers"] == len(PROMPTS) and held["held_out_answers"] == 3
    assert held["answer_tokens"] > 0 and set(held) >= {"mae", "acc50", "spearman", "held_out_points"}
    t = torch.tensor([0, 4])
    assert probe.predict(torch.randn(2, 32), t).shape == (2,)


def test_the_prompt_length_predictor_is_saved_beside_with_its_report(probe_dir, chat_model_dir):
    from ecru.serve.engine.models import ServedModel

    served = ServedModel.load(str(chat_model_dir))
    length = EmbeddingPredictor.load(probe_dir, served.model, served.tokenizer)
    assert length.key == model_key(str(chat_model_dir)) and length.cap == 40 and length.lam in length.LAMS
    held = json.loads((probe_dir / "probe.json").read_text())["length_predictor_held_out"]
    assert held["prompts"] == len(PROMPTS) and held["held_out_prompts"] == 3
    assert set(held) >= {"mae", "acc50", "spearman", "held_out_lam"} and held["lam"] == length.lam
    ids = served.encode_chat([{"role": "user", "content": "hello there"}])
    assert 1 <= length.engine_predict(ids) <= 40


def test_length_predictor_save_and_load_give_the_same_predictions(model, tmp_path):
    ids = [[5, 6, 7], [9, 9, 30, 41], [12], [50, 3, 3], [8, 8]]
    p = EmbeddingPredictor(model, None, lam=0.3, cap=24, key="m").fit_ids(ids, [3.0, 20.0, 7.0, 15.0, 9.0])
    p.save(tmp_path)
    back = EmbeddingPredictor.load(tmp_path, model, None)
    assert torch.equal(back.w, p.w) and torch.equal(back.b, p.b)
    # the same weights; a loaded tensor's product may round differently in the last bit
    torch.testing.assert_close(back.predict_ids(ids), p.predict_ids(ids), rtol=1e-6, atol=1e-5)
    assert (back.lam, back.cap, back.key) == (0.3, 24, "m")
    with pytest.raises(ValueError, match="no length_predictor.safetensors"):
        EmbeddingPredictor.load(tmp_path / "missing", model, None)
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(3), "b": torch.zeros(1)}, str(tmp_path / LENGTH_FILE),
              metadata={"predictor": json.dumps({"cap": 24, "lam": 1.0, "model": "m"})})  # fmt: skip
    with pytest.raises(ValueError, match="embeddings of width 3, the model's are"):
        EmbeddingPredictor.load(tmp_path, model, None)
    (tmp_path / LENGTH_FILE).write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="not a length predictor"):
        EmbeddingPredictor.load(tmp_path, model, None)
    with pytest.raises(RuntimeError, match="not fitted"):
        EmbeddingPredictor(model, None).save(tmp_path)


def test_save_and_load_give_the_same_predictions(tmp_path):
    gen = torch.Generator().manual_seed(0)
    states = [torch.randn(n, 8, generator=gen) for n in (5, 9, 12, 3)]
    probe = RemainingProbe(cap=16, stride=1, model="m").fit(states, [5, 9, 12, 3])
    probe.save(tmp_path)
    back = RemainingProbe.load(tmp_path)
    x, t = torch.randn(4, 8, generator=gen), torch.tensor([0, 1, 2, 3])
    assert torch.equal(back.predict(x, t), probe.predict(x, t))
    assert (back.cap, back.lam, back.stride, back.model) == (16, probe.lam, 1, "m")
    with pytest.raises(ValueError, match="no remaining_probe.safetensors"):
        RemainingProbe.load(tmp_path / "missing")
    (tmp_path / PROBE_FILE).write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="not a remaining-length probe"):
        RemainingProbe.load(tmp_path)
    with pytest.raises(RuntimeError, match="not fitted"):
        RemainingProbe().save(tmp_path)
    from safetensors.torch import save_file

    for tensors, meta in (({"w": torch.zeros(3), "b": torch.zeros(1)}, {"probe": "{}"}),
                          ({"w": torch.zeros(3, 2), "b": torch.zeros(1)}, {"probe": json.dumps({"cap": 1, "lam": 1,
                           "stride": 1, "model": "m"})}), ({"b": torch.zeros(1)}, {"probe": "[]"})):  # fmt: skip
        save_file(tensors, str(tmp_path / PROBE_FILE), metadata=meta)
        with pytest.raises(ValueError, match="not a remaining-length probe"):
            RemainingProbe.load(tmp_path)


@pytest.mark.parametrize(
    "change",
    [
        {"cap": float("inf")},
        {"cap": 0},
        {"cap": 2.5},
        {"cap": True},
        {"stride": -1},
        {"lam": float("nan")},
        {"lam": "1"},
        {"w": float("nan")},
    ],  # fmt: skip
)
def test_a_crafted_probe_or_predictor_is_refused_in_one_line(tmp_path, change):
    """Settings a fitted file can not hold (an infinite cap was an OverflowError traceback at load; a NaN weight
    gave NaN priorities in the queue): the file is refused as not a probe or predictor."""
    from safetensors.torch import save_file

    w = torch.full((10,), change.pop("w", 0.5))
    settings = {"cap": 16, "lam": 10.0, "stride": 4, "model": "m"} | change
    save_file({"w": w, "b": torch.zeros(1)}, str(tmp_path / PROBE_FILE),
              metadata={"probe": json.dumps(settings)})  # fmt: skip
    with pytest.raises(ValueError, match="not a remaining-length probe"):
        RemainingProbe.load(tmp_path)
    if "stride" in change:
        return  # a length predictor has none
    settings.pop("stride")
    save_file({"w": w, "b": torch.zeros(1)}, str(tmp_path / LENGTH_FILE),
              metadata={"predictor": json.dumps(settings)})  # fmt: skip
    with pytest.raises(ValueError, match="not a length predictor"):
        read_length_file(tmp_path)


def test_files_written_as_today_keep_loading_and_are_written_the_same(model, tmp_path):
    """The layout `ecru serve probe` writes: one safetensors file, "w" [width] and "b" [1] in float32, the
    settings as JSON under "predictor" (length predictor) or "probe" (remaining probe)."""
    from safetensors.torch import save_file

    table = model.get_input_embeddings().weight.detach()
    w, b = torch.arange(table.shape[1], dtype=torch.float32) / table.shape[1], torch.tensor([3.0])
    old = tmp_path / "old"
    old.mkdir()
    save_file({"w": w, "b": b}, str(old / LENGTH_FILE),
              metadata={"predictor": json.dumps({"cap": 24, "lam": 0.3, "model": "m"})})  # fmt: skip
    length = EmbeddingPredictor.load(old, model, None)
    assert torch.equal(length.w, w) and torch.equal(length.b, b[0])
    assert (length.lam, length.cap, length.key) == (0.3, 24, "m")
    assert length.predict_ids([[5, 6]]) == pytest.approx([float(table[[5, 6]].float().mean(0) @ w + 3)])
    save_file({"w": w[:10], "b": b}, str(old / PROBE_FILE),
              metadata={"probe": json.dumps({"cap": 16, "lam": 10.0, "stride": 4, "model": "m"})})  # fmt: skip
    probe = RemainingProbe.load(old)
    assert torch.equal(probe.w, w[:10]) and torch.equal(probe.b, b[0]) and probe.hidden_size == 8
    assert (probe.cap, probe.lam, probe.stride, probe.model) == (16, 10.0, 4, "m")
    new = tmp_path / "new"
    length.save(new)
    probe.save(new)
    for name in (LENGTH_FILE, PROBE_FILE):
        assert (new / name).read_bytes() == (old / name).read_bytes()


class Repredictions:
    """Counts the probe's re-predictions (it must run, not only load)."""

    def __init__(self, monkeypatch):
        self.rows, predict = 0, RemainingProbe.predict

        def counted(probe, states, t):
            self.rows += len(t)
            return predict(probe, states, t)

        monkeypatch.setattr(RemainingProbe, "predict", counted)


def test_serve_run_with_cb_srpt_answers_as_cb(probe_dir, chat_model_dir, tmp_path, monkeypatch):
    src = write_lines(tmp_path / "in.jsonl", [{"prompt": p} for p in PROMPTS])
    extra = ("--max-new-tokens", "40", "--max-batch-size", "2")
    assert run(chat_model_dir, src, tmp_path / "cb.jsonl", *extra) == 0
    seen = Repredictions(monkeypatch)
    srpt = ("--policy", "cb-srpt", "--remaining-probe", str(probe_dir), "--fcfs-slack", "0.2")
    assert run(chat_model_dir, src, tmp_path / "srpt.jsonl", *extra, *srpt) == 0
    assert seen.rows > 0  # re-predicted every 16 tokens
    assert answers(tmp_path / "cb.jsonl") == answers(
        tmp_path / "srpt.jsonl"
    )  # greedy: order changes no answer


def test_serve_run_queues_by_the_length_predictor(probe_dir, chat_model_dir, tmp_path, monkeypatch):
    src = write_lines(tmp_path / "in.jsonl", [{"prompt": p} for p in PROMPTS])
    extra = ("--max-new-tokens", "40", "--max-batch-size", "2")
    assert run(chat_model_dir, src, tmp_path / "cb.jsonl", *extra) == 0
    calls, predict = [], EmbeddingPredictor.engine_predict

    def counted(self, prompt, params=None):
        calls.append(prompt)
        return predict(self, prompt, params)

    monkeypatch.setattr(EmbeddingPredictor, "engine_predict", counted)
    for policy in ("cb-sjf", "cb-srpt"):
        calls.clear()
        flags = ("--policy", policy, "--length-predictor", str(probe_dir))
        flags += ("--remaining-probe", str(probe_dir)) if policy == "cb-srpt" else ()
        assert run(chat_model_dir, src, tmp_path / f"{policy}.jsonl", *extra, *flags) == 0
        assert len(calls) == len(PROMPTS)  # one prediction per request, from its token ids
        assert answers(tmp_path / "cb.jsonl") == answers(tmp_path / f"{policy}.jsonl")


def test_bad_probe_use_is_refused_in_one_line_before_any_work(probe_dir, chat_model_dir, tmp_path, capsys):
    src = write_lines(tmp_path / "in.jsonl", [{"prompt": "hi"}])
    other, wide = tmp_path / "other", tmp_path / "wide"
    probe = RemainingProbe.load(probe_dir)
    probe.model = "smollm2"
    probe.save(other)
    from ecru.serve.engine.models import ServedModel

    served = ServedModel.load(str(chat_model_dir))
    length = EmbeddingPredictor.load(probe_dir, served.model, served.tokenizer)
    length.key = "smollm2"
    length.save(other)
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / LENGTH_FILE).write_bytes(b"not a safetensors file")
    probe.model, probe.w = model_key(str(chat_model_dir)), torch.zeros(18)  # a 16-wide model's probe
    probe.save(wide)
    cases = {
        ("--policy", "cb-srpt"): "--policy cb-srpt needs --remaining-probe DIR",
        ("--remaining-probe", str(probe_dir)): "--policy cb-srpt needs --remaining-probe DIR",
        ("--policy", "cb-srpt", "--remaining-probe", str(tmp_path)): "no remaining_probe.safetensors",
        ("--policy", "cb-srpt", "--remaining-probe", str(other)): "fitted for model 'smollm2'",
        (
            "--policy",
            "cb-srpt",
            "--remaining-probe",
            str(wide),
        ): "hidden states of width 16, the model's are 32",
        (
            "--policy",
            "cb-srpt",
            "--remaining-probe",
            str(probe_dir),
            "--max-new-tokens",
            "80",
        ): "up to 40 tokens",
        ("--length-predictor", str(probe_dir)): "--length-predictor orders cb-sjf's and cb-srpt's queue",
        ("--policy", "cb-sjf", "--length-predictor", str(tmp_path)): "no length_predictor.safetensors",
        ("--policy", "cb-sjf", "--length-predictor", str(other)): "fitted for model 'smollm2'",
        (
            "--policy",
            "cb-sjf",
            "--length-predictor",
            str(probe_dir),
            "--max-new-tokens",
            "80",
        ): "up to 40 tokens",
        ("--policy", "cb-sjf", "--length-predictor", str(corrupt)): "not a length predictor",
    }
    for extra, message in cases.items():
        out = tmp_path / "out.jsonl"
        assert run(chat_model_dir, src, out, *extra) == 2, extra
        err = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
        assert len(err) == 1 and message in err[0], (extra, err)  # one line (after the model's loading bar)
        assert not out.exists() or not out.read_text()


@pytest.mark.parametrize("flags", [("--policy", "cb-srpt", "--remaining-probe"), ("--policy", "cb-sjf",
                                   "--length-predictor")])  # fmt: skip
def test_a_line_asking_more_than_the_predictors_cover_is_named_before_the_model_loads(
    probe_dir, chat_model_dir, tmp_path, capsys, monkeypatch, flags
):
    """The line's max_tokens, not --max-new-tokens (which the user never raised), is what is too long."""
    from ecru.serve.engine.models import ServedModel

    src = write_lines(tmp_path / "in.jsonl", [{"prompt": "hi"}, {"prompt": "ho", "max_tokens": 80}])
    monkeypatch.setattr(ServedModel, "load", lambda *a, **k: pytest.fail("the model loaded"))
    assert (
        run(chat_model_dir, src, tmp_path / "out.jsonl", *flags, str(probe_dir), "--max-new-tokens", "16")
        == 2
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"ecru: error: {src}:2: max_tokens 80 is above 40, the longest answer the predictors were fitted "
                   "for; lower it or fit them with `ecru serve probe --max-new-tokens 80`"]  # fmt: skip


def test_probe_refuses_a_bad_line_without_a_flag_it_lacks(chat_model_dir, tmp_path, capsys):
    src = write_lines(tmp_path / "p.jsonl", [*({"prompt": p} for p in PROMPTS), {"prompt": ""}])
    assert (
        main(
            ["serve", "probe", "--model", str(chat_model_dir), "--in", str(src), "--out", str(tmp_path / "o")]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert f"p.jsonl:{len(PROMPTS) + 1}:" in err and "--skip-invalid" not in err


def test_probe_refuses_too_few_prompts(chat_model_dir, tmp_path, capsys):
    src = write_lines(tmp_path / "p.jsonl", [{"prompt": p} for p in PROMPTS[:3]])
    out = tmp_path / "probe"
    assert main(["serve", "probe", "--model", str(chat_model_dir), "--in", str(src), "--out", str(out)]) == 2
    assert "a probe needs at least 10" in capsys.readouterr().err
    assert not out.exists()  # refused before the folder is made


def test_the_cli_offers_every_engine_policy():
    from ecru import cli
    from ecru.serve.sched import scheduler

    serve = cli.build_parser()._subparsers._group_actions[0].choices["serve"]
    commands = serve._subparsers._group_actions[0].choices
    for name in ("api", "run"):
        policy = next(a for a in commands[name]._actions if a.dest == "policy")
        assert tuple(policy.choices) == scheduler.ENGINE_POLICIES


def test_the_server_serves_cb_srpt_with_a_probe(probe_dir, chat_model_dir, monkeypatch):
    from concurrent.futures import ThreadPoolExecutor

    import openai

    from ecru.serve.engine.models import ServedModel
    from ecru.serve.engine.request_engine import EngineConfig
    from tests.serve.helpers import BackgroundServer

    served = ServedModel.load(str(chat_model_dir))
    seen, texts = Repredictions(monkeypatch), {}
    for policy, probe in (("cb", None), ("cb-srpt", RemainingProbe.load(probe_dir))):
        config = EngineConfig(policy=policy, max_new_tokens=40, max_batch_size=2, repredict_every=4)
        with BackgroundServer(served, config, remaining=probe) as url:
            client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)

            def ask(prompt, client=client):
                reply = client.completions.create(
                    model=served.name, prompt=prompt, max_tokens=40, temperature=0
                )
                return reply.choices[0].text

            with ThreadPoolExecutor(6) as pool:  # concurrent: rows fill, requests wait, rows may be swapped
                texts[policy] = list(pool.map(ask, PROMPTS[:6]))
    assert seen.rows > 0 and texts["cb"] == texts["cb-srpt"]


def test_a_probe_folder_with_a_damaged_file_is_refused(model, tmp_path):
    from ecru.io import write_manifest

    ids = [[5, 6, 7], [9, 9, 30, 41], [12], [50, 3, 3], [8, 8]]
    p = EmbeddingPredictor(model, None, lam=0.3, cap=24, key="m").fit_ids(ids, [3.0, 20.0, 7.0, 15.0, 9.0])
    write_manifest(tmp_path, [p.save(tmp_path).name])  # as `ecru serve probe` leaves its folder
    EmbeddingPredictor.load(tmp_path, model, None)
    path = tmp_path / LENGTH_FILE
    data = bytearray(path.read_bytes())
    data[-2] ^= 0x20
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="checksum mismatch in .*length_predictor.safetensors"):
        EmbeddingPredictor.load(tmp_path, model, None)


def test_plain_cb_srpt_reads_the_probe_folders_length_predictor(tmp_path):
    from dataclasses import replace

    from ecru.serve.entrypoints.setup import EngineSetup

    probe_only = EngineSetup(policy="cb-srpt", remaining_probe=str(tmp_path))
    assert probe_only.length_predictor is None  # a folder with the probe only: max_tokens orders the queue
    (tmp_path / LENGTH_FILE).write_bytes(b"")
    with pytest.raises(
        EcruError, match=f"--length-predictor {tmp_path}"
    ):  # read: as `ecru serve probe` leaves it
        EngineSetup(policy="cb-srpt", remaining_probe=str(tmp_path))
    with pytest.raises(EcruError, match="--length-predictor other"):
        replace(probe_only, length_predictor="other")
    with pytest.raises(EcruError, match="--policy cb-srpt needs --remaining-probe"):
        replace(probe_only, policy="cb-sjf")  # cb-sjf takes no probe, and reads no length predictor from it
