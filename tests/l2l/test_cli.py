"""`ecru l2l train` end to end on the random tiny Llama (byte tokens), SmolLM2 and a local model folder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ecru.cli import main
from tests.cli_helpers import status_and_err as _code

BASE = ["l2l", "train", "--batch-size", "5", "--micro-batch-size", "2", "--lr", "3e-3"]


def _run(tmp_path, name, *extra):
    out = tmp_path / name
    assert main([*BASE, "--out", str(out), *extra]) == 0
    return out, json.loads((out / "metrics.json").read_text())


def test_train_writes_metrics_checkpoint_and_hf_export(tmp_path, capsys):
    out, result = _run(tmp_path, "run", "--steps", "6", "--stash", "host")
    assert result["steps"] == 6 and len(result["losses"]) == 6
    assert result["final_loss"] < result["first_loss"] - 0.3  # it learns the byte statistics
    assert (out / "checkpoint" / "manifest.json").is_file() and (out / "hf" / "config.json").is_file()
    assert not list(out.rglob("*.pt"))  # nothing pickled
    assert "tokens/s" in capsys.readouterr().out


@pytest.mark.parametrize("store", ["ram", "disk"])
def test_resume_continues_exactly_including_the_data_position(tmp_path, store):
    """4 steps in one run == 2 steps, then --resume to 4 (weights bit for bit, the same losses)."""
    from transformers import AutoModelForCausalLM

    extra = ["--store", store, "--save-every", "2"]
    _, straight = _run(tmp_path, "straight", "--steps", "4", *extra)
    out, first = _run(tmp_path, "split", "--steps", "2", *extra)
    assert main([*BASE, "--out", str(out), "--steps", "4", "--resume", *extra]) == 0
    resumed = json.loads((out / "metrics.json").read_text())
    assert first["losses"] == straight["losses"][:2]
    assert resumed["losses"] == straight["losses"]
    a = AutoModelForCausalLM.from_pretrained(tmp_path / "straight" / "hf").state_dict()
    b = AutoModelForCausalLM.from_pretrained(out / "hf").state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_save_every_writes_checkpoints_during_the_run(tmp_path, monkeypatch):
    from ecru.l2l import cli

    saved = []
    real = cli._checkpoint
    monkeypatch.setattr(cli, "_checkpoint", lambda a, e, *rest: (saved.append(e.steps), real(a, e, *rest)))
    _run(tmp_path, "run", "--steps", "5", "--save-every", "2")
    assert saved == [2, 4, 5]


def test_user_text_files_txt_and_jsonl(tmp_path):
    txt = tmp_path / "t.txt"
    txt.write_text("\n".join(f"line number {i} of my text" for i in range(12)))
    jsonl = tmp_path / "t.jsonl"
    jsonl.write_text("\n".join(json.dumps({"text": f"line number {i} of my text"}) for i in range(12)))
    _, a = _run(tmp_path, "txt", "--steps", "2", "--data", str(txt))
    _, b = _run(tmp_path, "jsonl", "--steps", "2", "--data", str(jsonl))
    assert a["losses"] == b["losses"]  # the same texts: the same run


def test_a_local_hugging_face_model_folder(tmp_path):
    """--model PATH: a decoder-only causal LM folder with its tokenizer (a tiny random Llama saved with
    SmolLM2's tokenizer); the export holds the trained model and the tokenizer."""
    from ecru.models import load_smollm2, tiny_llama

    _, tokenizer = load_smollm2()
    tiny_llama(num_layers=2, vocab_size=len(tokenizer)).save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    data = tmp_path / "d.txt"
    data.write_text("\n".join(f"my own training sentence number {i}" for i in range(20)))
    out, result = _run(
        tmp_path, "run", "--steps", "3", "--model", str(tmp_path / "model"), "--data", str(data)
    )
    assert result["steps"] == 3 and (out / "hf" / "tokenizer.json").is_file()
    assert result["final_loss"] < result["first_loss"]


def test_a_runs_hf_folder_loads_with_auto_classes_and_trains_again(tmp_path):
    """--model tiny: DIR/hf holds the model and its byte tokenizer, loads with AutoModelForCausalLM /
    AutoTokenizer (the same ids as in training), and is a valid --model for a second run."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ecru.l2l.data import byte_tokenizer

    out, _ = _run(tmp_path, "first", "--steps", "2")
    model = AutoModelForCausalLM.from_pretrained(out / "hf")
    tokenizer = AutoTokenizer.from_pretrained(out / "hf")
    text = "héllo ✓"
    assert tokenizer(text)["input_ids"] == [1, *(b + 3 for b in text.encode()), 2]
    assert tokenizer(text)["input_ids"] == byte_tokenizer()(text)["input_ids"]
    assert model.config.vocab_size == len(tokenizer)
    again, result = _run(tmp_path, "second", "--steps", "2", "--model", str(out / "hf"))
    assert result["steps"] == 2 and (again / "hf" / "tokenizer.json").is_file()
    AutoModelForCausalLM.from_pretrained(again / "hf")


def test_lr_schedule_warms_up_then_decays():
    """--lr-schedule linear --warmup-steps 2 over 6 steps: 0, 1/2, 1, then down to 0 at step 6."""
    import argparse

    from ecru.l2l.cli import lr_schedule

    args = argparse.Namespace(lr_schedule="linear", warmup_steps=2, steps=6)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    scheduler = lr_schedule(args)(opt)
    lrs = []
    for _ in range(6):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        scheduler.step()
    assert lrs == pytest.approx([0.0, 0.05, 0.1, 0.075, 0.05, 0.025], abs=1e-12)


def _killed_at_2_then_resumed(tmp_path, monkeypatch, name, *extra) -> Path:
    """A 4-step run interrupted right after its step-2 checkpoint, then the same command with --resume."""
    from ecru.l2l import cli

    real = cli._checkpoint

    def checkpoint_then_die(args, engine, *rest):
        real(args, engine, *rest)
        if engine.steps == 2:
            raise KeyboardInterrupt

    out = tmp_path / name
    command = [*BASE, "--out", str(out), "--steps", "4", "--save-every", "2", *extra]
    with monkeypatch.context() as patch:
        patch.setattr(cli, "_checkpoint", checkpoint_then_die)
        assert main(command) != 0
    assert main([*command, "--resume"]) == 0
    return out


def test_a_scheduled_run_resumes_exactly(tmp_path, monkeypatch):
    """--lr-schedule linear --warmup-steps 1 over 4 steps, killed after step 2 and resumed: the same losses
    as the run straight through (the scheduler is fast-forwarded to the checkpoint's step); the schedule
    changes the run."""
    extra = ["--lr-schedule", "linear", "--warmup-steps", "1"]
    _, straight = _run(tmp_path, "straight", "--steps", "4", *extra)
    out = _killed_at_2_then_resumed(tmp_path, monkeypatch, "split", *extra)
    assert json.loads((out / "metrics.json").read_text())["losses"] == straight["losses"]
    _, constant = _run(tmp_path, "constant", "--steps", "4")
    assert constant["losses"][0] == straight["losses"][0] and constant["losses"][1] != straight["losses"][1]


def test_lora_writes_a_peft_adapter_without_the_base_and_merges_on_request(tmp_path):
    """--lora-r 4 --lora-targets q_proj,v_proj: DIR/adapter is a peft folder holding only LoRA weights
    (trained: lora_B moved from 0) that loads on the base; no hf/ unless --merge, whose hf/ gives the same
    logits as base + adapter."""
    peft = pytest.importorskip("peft")
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from ecru.l2l.cli import load_model

    lora = ["--steps", "2", "--lora-r", "4", "--lora-targets", "q_proj,v_proj", "--lr", "1e-2"]
    out, _ = _run(tmp_path, "adapter", *lora)
    assert not (out / "hf").exists()
    weights = load_file(out / "adapter" / "adapter_model.safetensors")
    assert weights and all("lora_" in k for k in weights)
    assert max(float(v.abs().max()) for k, v in weights.items() if "lora_B" in k) > 0
    merged_out, _ = _run(tmp_path, "merged", *lora, "--merge")
    base, _ = load_model("tiny", seed=0)
    adapted = peft.PeftModel.from_pretrained(base, merged_out / "adapter").eval()
    merged = AutoModelForCausalLM.from_pretrained(merged_out / "hf").eval()
    ids = torch.randint(3, 200, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, adapted(ids).logits, atol=1e-5, rtol=1e-5)


def test_a_lora_run_resumes_exactly(tmp_path, monkeypatch):
    """--lora-r 4 with a linear schedule, killed after step 2 and resumed: the losses and the adapter
    weights of the run straight through, bit for bit."""
    from safetensors.torch import load_file

    lora = ["--lora-r", "4", "--lr", "1e-2", "--lr-schedule", "linear"]
    straight, result = _run(tmp_path, "straight", "--steps", "4", *lora)
    out = _killed_at_2_then_resumed(tmp_path, monkeypatch, "split", *lora)
    assert json.loads((out / "metrics.json").read_text())["losses"] == result["losses"]
    a = load_file(straight / "adapter" / "adapter_model.safetensors")
    b = load_file(out / "adapter" / "adapter_model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # the checkpoint keeps the adapter (and buffers), not a copy of the frozen base
    from ecru.l2l.checkpoint import load

    kept = load(out / "checkpoint")["model"]
    assert kept and all("lora_" in k for k in kept if k.endswith("weight"))


@pytest.mark.slow
def test_smollm2_trains_and_exports_a_loadable_folder(tmp_path):
    """The README's run on the bundled SmolLM2: its cache keeps no gguf quantization_config, so the export
    (and a second run from it) works."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(json.dumps({"text": f"my own training sentence number {i}"}) for i in range(8)))
    extra = ["--steps", "1", "--batch-size", "2", "--data", str(data)]
    out, result = _run(tmp_path, "run", "--model", "smollm2", *extra)
    assert result["steps"] == 1
    AutoModelForCausalLM.from_pretrained(out / "hf")
    assert AutoTokenizer.from_pretrained(out / "hf")("hi")["input_ids"]
    _run(tmp_path, "again", "--model", str(out / "hf"), *extra)


@pytest.mark.parametrize(
    "bad,message",
    [
        (["--lr", "-1"], "argument --lr: must be > 0"),
        (["--micro-batch-size", "0"], "must be > 0"),
        (["--steps", "0"], "must be > 0"),
        (["--keep-graph-blocks", "-1"], "must be >= 0"),
        (["--micro-batch-size", "9", "--batch-size", "4"], "larger than --batch-size"),
        (["--data", "missing.txt"], "not 'clinc' and not an existing file"),
        (["--model", "no/such/folder"], "not a Hugging Face model folder"),
        (["--merge"], "need --lora-r"),
        (["--lora-targets", ","], "module names separated by commas"),
        (["--warmup-steps", "20", "--steps", "2"], "more than --steps"),
        (["--eval-every", "2"], "needs --eval-data"),
        (["--eval-data", "missing.txt"], "not an existing .txt or .jsonl file"),
        (["--eval-every", "0", "--eval-data", "x.txt"], "must be > 0"),
    ],
)
def test_bad_arguments_fail_with_one_line(bad, message, tmp_path, capsys):
    try:  # argparse errors exit from parse_args, EcruErrors return from main: both status 2
        code = main(["l2l", "train", "--out", str(tmp_path / "o"), *bad])
    except SystemExit as exc:
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_an_existing_run_is_not_overwritten_without_resume(tmp_path, capsys):
    out, _ = _run(tmp_path, "run", "--steps", "1")
    assert main([*BASE, "--out", str(out), "--steps", "1"]) == 2
    assert "already holds a run; pass --resume" in capsys.readouterr().err
    assert main([*BASE, "--out", str(out), "--steps", "2", "--resume", "--lr", "0.5"]) == 2
    err = capsys.readouterr().err
    assert "used --lr 0.003, not 0.5" in err and len(err.strip().splitlines()) == 1
    assert main([*BASE, "--out", str(out), "--steps", "2", "--overwrite", "--seed", "3"]) == 0
    assert json.loads((out / "metrics.json").read_text())["steps"] == 2


def test_resume_checks_the_data_by_its_content_not_its_path(tmp_path, capsys):
    """The same texts moved elsewhere resume exactly; the same path with other texts is refused (it resumed)."""
    texts = tmp_path / "a.txt"
    texts.write_text("\n".join(f"line number {i} of my text" for i in range(12)))
    _, straight = _run(tmp_path, "straight", "--steps", "4", "--data", str(texts))
    out, _ = _run(tmp_path, "split", "--steps", "2", "--data", str(texts), "--save-every", "1")
    moved = texts.rename(tmp_path / "moved.txt")
    assert main([*BASE, "--out", str(out), "--steps", "4", "--resume", "--data", str(moved)]) == 0
    assert json.loads((out / "metrics.json").read_text())["losses"] == straight["losses"]
    moved.write_text(moved.read_text().replace("line", "word"))
    capsys.readouterr()
    assert main([*BASE, "--out", str(out), "--steps", "6", "--resume", "--data", str(moved)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"--data {moved} is not the data the run in {out} trained on" in err[0]


def test_an_export_cut_short_leaves_no_folder_that_looks_whole_and_resume_writes_it(tmp_path, monkeypatch):
    """Interrupted after the export's first file: hf/ is absent (it was there, half written: config.json without
    weights), the old export is kept over an interrupted rewrite, and --resume writes it whole."""
    from safetensors.torch import load_file

    from ecru.l2l.engine import L2L

    straight, _ = _run(tmp_path, "straight", "--steps", "2")
    out = tmp_path / "cut"
    real = L2L.save_pretrained

    def cut_short(engine, path, **kw):
        (Path(path) / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(L2L, "save_pretrained", cut_short)
    assert main([*BASE, "--out", str(out), "--steps", "2"]) == 130
    assert not (out / "hf").exists() and not [p for p in out.iterdir() if p.name.startswith(".hf")]
    monkeypatch.setattr(L2L, "save_pretrained", real)
    assert main([*BASE, "--out", str(out), "--steps", "2", "--resume"]) == 0
    a, b = (load_file(d / "hf" / "model.safetensors") for d in (straight, out))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    monkeypatch.setattr(L2L, "save_pretrained", cut_short)
    assert main([*BASE, "--out", str(out), "--steps", "2", "--resume"]) == 130  # a rewrite cut short
    assert (out / "hf" / "model.safetensors").is_file()  # the whole old export stays


def test_a_run_killed_before_its_first_checkpoint_is_finished_by_resume(tmp_path, capsys):
    """Killed after state.json or before anything: `--resume` starts (or finishes) the run."""
    _, straight = _run(tmp_path, "straight", "--steps", "2")
    out = tmp_path / "killed"
    out.mkdir()
    (out / "state.json").write_text(json.dumps({"args": {}, "steps": 0, "losses": []}))
    assert main([*BASE, "--out", str(out), "--steps", "2", "--resume"]) == 0
    assert json.loads((out / "metrics.json").read_text())["losses"] == straight["losses"]
    fresh = tmp_path / "never-started"
    assert main([*BASE, "--out", str(fresh), "--steps", "2", "--resume"]) == 0
    assert "holds no run yet; starting one" in capsys.readouterr().err


def test_undecodable_text_is_one_line_and_creates_nothing(tmp_path, capsys):
    data = tmp_path / "bad.txt"
    data.write_bytes(b"good line one\ngood line two\nbad \xff\xfe bytes\n" * 4)
    out = tmp_path / "o"
    assert main([*BASE, "--out", str(out), "--data", str(data)]) == 2
    err = capsys.readouterr().err
    assert f"{data}, line 3: not valid UTF-8 (byte 0xff at column 5)" in err and len(err.splitlines()) == 1
    assert not out.exists()


def test_eval_data_reports_the_held_out_loss_of_the_model_at_that_step(tmp_path):
    """--eval-data FILE --eval-every 2 over 4 steps: held-out losses after steps 2 and 4 in metrics.json
    and state.json; the last equals the exported model's own mean loss per token over those texts
    (plain transformers, 1e-5), and evaluating leaves the training losses bit for bit unchanged."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ecru.l2l.data import encode_batch

    texts = [f"held-out line {i}: the quick brown fox" * (1 + i % 3) for i in range(7)]
    held = tmp_path / "held.txt"
    held.write_text("\n".join(texts))
    _, plain = _run(tmp_path, "plain", "--steps", "4")
    out, result = _run(tmp_path, "eval", "--steps", "4", "--eval-data", str(held), "--eval-every", "2")
    assert result["losses"] == plain["losses"]
    assert [e["step"] for e in result["eval"]] == [2, 4]
    assert json.loads((out / "state.json").read_text())["eval"] == result["eval"]
    model = AutoModelForCausalLM.from_pretrained(out / "hf").eval()
    tok = AutoTokenizer.from_pretrained(out / "hf")
    total = count = 0
    with torch.no_grad():
        for i in range(0, len(texts), 5):  # --batch-size 5
            batch = encode_batch(tok, texts[i : i + 5], max_length=64)
            n = int((batch["labels"][:, 1:] != -100).sum())
            total, count = total + float(model(**batch).loss) * n, count + n
    assert result["final_eval_loss"] == pytest.approx(total / count, abs=1e-5)


def test_a_run_never_rewrites_its_inputs_nor_follows_links_out_of_out(tmp_path, capsys):
    out, _ = _run(tmp_path, "run", "--steps", "1")
    config = (out / "hf" / "config.json").read_bytes()
    code, err = _code(
        [*BASE, "--out", str(out), "--steps", "1", "--overwrite", "--model", str(out / "hf")], capsys
    )
    assert (
        code == 2 and "which this run rewrites" in err and (out / "hf" / "config.json").read_bytes() == config
    )
    code, err = _code(
        [*BASE, "--out", str(out / "hf" / "x"), "--steps", "1", "--model", str(out / "hf")], capsys
    )
    assert code == 2 and "would overwrite the input" in err
    outside = tmp_path / "outside"
    (out / "checkpoint").rename(outside)
    (out / "checkpoint").symlink_to(outside)
    code, err = _code([*BASE, "--out", str(out), "--steps", "2", "--resume"], capsys)
    assert code == 2 and "symbolic link" in err and err.count("\n") == 1


def test_a_second_run_into_one_out_is_refused(tmp_path, capsys):
    from ecru.io import FolderLock

    out = tmp_path / "run"
    with FolderLock(out):  # another run (the RAM tier had no lock)
        code, err = _code([*BASE, "--out", str(out), "--steps", "1"], capsys)
    assert code == 2 and "in use by another ecru process" in err


@pytest.mark.parametrize(
    "state",
    ["{oops", "[]", '{"args": null}', '{"args": {}, "losses": "abc"}', '{"args": {}, "eval": [{"x": 1}]}'],
)
def test_a_damaged_state_json_is_one_line(tmp_path, capsys, state):
    out = tmp_path / "run"
    out.mkdir()
    (out / "state.json").write_text(state)
    code, err = _code([*BASE, "--out", str(out), "--steps", "1", "--resume"], capsys)
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err


def test_pickled_or_incomplete_weights_and_a_huge_seed_are_refused(tmp_path, capsys):
    import shutil

    from safetensors.torch import load_file, save_file

    out, _ = _run(tmp_path, "run", "--steps", "1")
    pickled, partial = tmp_path / "pickled", tmp_path / "partial"
    (out / "hf").rename(pickled)
    shutil.copytree(pickled, partial)
    weights = load_file(pickled / "model.safetensors")
    torch.save(weights, pickled / "pytorch_model.bin")  # the pickled weights a folder may hold instead
    (pickled / "model.safetensors").unlink()
    save_file({k: v for k, v in weights.items() if ".layers.1." not in k}, partial / "model.safetensors")
    capsys.readouterr()  # the first run's output
    for folder, message in ((pickled, "cannot load the model folder"), (partial, "its weights lack")):
        code, err = _code(
            [*BASE, "--out", str(tmp_path / "o"), "--steps", "1", "--model", str(folder)], capsys
        )
        lines = [
            x for x in err.splitlines() if x.startswith("ecru: error:")
        ]  # after transformers' own report
        assert code == 2 and len(lines) == 1 and message in lines[0], err
    code, err = _code([*BASE, "--out", str(tmp_path / "o2"), "--steps", "1", "--seed", str(2**64)], capsys)
    assert code == 2 and "--seed" in err


def test_a_bad_eval_file_and_lora_targets_naming_nothing_are_refused_before_any_step(tmp_path, capsys):
    bad = tmp_path / "eval.txt"
    bad.write_bytes(b"fine\ncaf\xe9\n")
    out = tmp_path / "run"
    code, err = _code([*BASE, "--out", str(out), "--steps", "2", "--eval-data", str(bad)], capsys)
    assert code == 2 and err.startswith("ecru: error: --eval-data") and not (out / "state.json").exists()
    code, err = _code(
        [*BASE, "--out", str(out), "--steps", "1", "--lora-r", "2", "--lora-targets", "nope_proj"], capsys
    )
    assert code == 2 and "--lora-targets" in err and err.count("\n") == 1, err
