"""The knowledge store and its CLI on the real MiniLM, with two tiny CLINC tasks (4 intents, 4 examples each)."""

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch

from ecru.cli import main
from ecru.datasets import load_clinc
from ecru.errors import EcruError
from ecru.lifelong.calibration import holdout_split
from ecru.lifelong.store import KnowledgeStore
from ecru.lifelong.userdata import label_name, read_records

EPOCHS = 2


def _examples(domain: str, split: str, per_intent: int) -> list[dict]:
    clinc = load_clinc()
    intents = clinc.domains[domain][:4]
    rows = []
    for intent in intents:
        rows += [{"text": e.text, "label": e.label} for e in clinc[split] if e.label == intent][:per_intent]
    return rows


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _digest(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("data")
    return {
        "banking": _jsonl(d / "banking.jsonl", _examples("banking", "train", 4)),
        "travel": _jsonl(d / "travel.jsonl", _examples("travel", "train", 4)),
        "banking_test": _jsonl(d / "banking_test.jsonl", _examples("banking", "test", 3)),
        "travel_test": _jsonl(d / "travel_test.jsonl", _examples("travel", "test", 3)),
    }


@pytest.fixture(scope="module")
def store(tmp_path_factory, data):
    path = tmp_path_factory.mktemp("store") / "s"
    s = KnowledgeStore(path)
    for task in ("banking", "travel"):
        s.learn(task, read_records(data[task], labels=True), epochs=EPOCHS)
    return s


def test_label_names_follow_the_documented_rule():
    assert (
        label_name("freeze_account")
        == label_name("freeze-account")
        == label_name(" freeze  account ")
        == "freeze account"
    )
    assert label_name("Card Payment") == "Card Payment"


def test_task_agnostic_prediction_among_every_learned_label(store, data):
    assert [t["task"] for t in store.tasks()] == ["banking", "travel"]
    records = read_records(data["banking_test"], labels=True) + read_records(data["travel_test"], labels=True)
    preds = store.predict([r.text for r in records])
    assert [p.text for p in preds] == [r.text for r in records]  # in order
    assert {p.label for p in preds} <= set(store.learned_labels()) and len(store.learned_labels()) == 8
    right = sum(p.label == r.label for p, r in zip(preds, records, strict=True))
    assert right / len(records) >= 0.8  # 24 texts of 8 intents; the frozen model alone gets ~0.8 here
    assert all(0 < p.score <= 1 for p in preds) and sum(p.score for p in preds) / len(preds) > 0.6  # not flat


def test_given_labels_learned_or_not(store, data):
    # a training text of freeze_account (its router accepts it) and a text of no learned task
    freeze = next(r.text for r in read_records(data["banking"], labels=True) if r.label == "freeze_account")
    texts = ["what is the weather like in paris", freeze]
    preds = store.predict(texts, labels=["weather", "freeze-account", "book hotel"])
    assert [p.label for p in preds] == ["weather", "freeze-account"]  # spelled as given, matched by name
    with pytest.raises(EcruError, match="list of texts"):
        store.predict("one string")


def test_scores_are_candidate_independent(store):
    enc = store.method().encoder()
    texts = ["can you freeze my account", "what plug do i need in london", "tell me a joke"]
    labels = [label_name(x) for x in store.learned_labels()] + ["tell joke", "weather"]
    full = enc.scores(texts, labels)
    pick = [1, 5, 8, 9]
    torch.testing.assert_close(
        store.method().encoder().scores(texts, [labels[i] for i in pick]), full[:, pick]
    )


def test_relearning_replaces_the_task_and_forget_removes_it(tmp_path, store, data):
    path = tmp_path / "copy"
    shutil.copytree(store.path, path)
    s = KnowledgeStore(path)
    s.learn("travel", read_records(data["travel"], labels=True)[:12], epochs=1)
    assert [t["task"] for t in s.tasks()] == ["banking", "travel"] and s.tasks()[1]["examples"] == 12
    assert len(list((path / "tasks").iterdir())) == 2  # the old folder is gone, no second adapter
    s.forget("banking")
    assert [t["task"] for t in KnowledgeStore(path).tasks()] == ["travel"]
    assert len(list((path / "tasks").iterdir())) == 1


def test_cli_round_trip(tmp_path, store, data, capsys):
    out = tmp_path / "pred.jsonl"
    assert (
        main(
            [
                "lifelong",
                "predict",
                "--store",
                str(store.path),
                "--data",
                str(data["banking_test"]),
                "--out",
                str(out),
            ]
        )
        == 0
    )
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(lines) == 12 and set(lines[0]) == {"text", "label", "score"}
    assert "accuracy" in capsys.readouterr().out
    listing = tmp_path / "tasks.json"
    assert main(["lifelong", "tasks", "--store", str(store.path), "--json", str(listing)]) == 0
    tasks = json.loads(listing.read_text())
    assert [t["task"] for t in tasks] == ["banking", "travel"]
    assert {"labels", "examples", "trainable_params", "stored_bytes"} <= set(tasks[0]) and tasks[0][
        "examples"
    ] == 16


def test_export_loads_with_peft_alone(tmp_path, store):
    from peft import PeftModel
    from transformers import AutoModel, AutoTokenizer

    assert main(["lifelong", "export", "--store", str(store.path), "--out", str(tmp_path / "exp")]) == 0
    folder = tmp_path / "exp" / "banking"
    assert {"adapter_config.json", "adapter_model.safetensors", "router.safetensors", "labels.json"} <= {
        p.name for p in folder.iterdir()
    }
    from ecru.models.minilm import minilm_dir

    # the base is named by its public id (portable), and loads here from the bundled copy of it
    named = json.loads((folder / "adapter_config.json").read_text())["base_model_name_or_path"]
    assert named == "sentence-transformers/all-MiniLM-L6-v2"
    base = minilm_dir()
    model = PeftModel.from_pretrained(AutoModel.from_pretrained(base), folder).eval()
    tok = AutoTokenizer.from_pretrained(base)
    texts = ["please freeze my account", "what is my routing number"]
    batch = tok(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state
    m = batch["attention_mask"].unsqueeze(-1).float()
    emb = torch.nn.functional.normalize((hidden * m).sum(1) / m.sum(1), dim=-1)
    want = store.method().encoder().for_task(0).encode(texts)
    torch.testing.assert_close(emb, want, rtol=1e-4, atol=1e-5)
    assert (emb - store.method().encoder().frozen(texts)).abs().max() > 1e-3  # the adapter is not a no-op


def _tiny_model_folder(path: Path) -> Path:
    from transformers import AutoTokenizer, BertConfig, BertModel

    from ecru.models.minilm import minilm_dir

    tok = AutoTokenizer.from_pretrained(minilm_dir())
    cfg = BertConfig(vocab_size=tok.vocab_size, hidden_size=32, num_hidden_layers=6, num_attention_heads=2,
                     intermediate_size=64, max_position_embeddings=128)  # fmt: skip
    torch.manual_seed(0)
    BertModel(cfg, add_pooling_layer=False).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def test_bad_input_exits_2_with_one_line_and_leaves_the_store_unchanged(tmp_path, store, data, capsys):
    path = tmp_path / "s"
    shutil.copytree(store.path, path)
    before = _digest(path)
    no_label = _jsonl(tmp_path / "no_label.jsonl", [{"text": "hi"}, {"text": "there"}])
    one_label = _jsonl(tmp_path / "one.jsonl", [{"text": "a", "label": "x"}, {"text": "b", "label": "x"}])
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    csv_no_text = tmp_path / "bad.csv"
    csv_no_text.write_text("sentence,label\nhello,a\n")
    other = _tiny_model_folder(tmp_path / "other_model")
    cases = {
        "no 'label'": ["learn", "--task", "t", "--data", str(no_label)],
        "at least two different labels": ["learn", "--task", "t", "--data", str(one_label)],
        "no examples": ["learn", "--task", "t", "--data", str(empty)],
        "'text' column": ["learn", "--task", "t", "--data", str(csv_no_text)],
        "was made with the encoder": [
            "learn",
            "--task",
            "t",
            "--data",
            str(data["banking"]),
            "--model",
            str(other),
        ],
        "no task 'nope'": ["forget", "--task", "nope"],
    }
    for message, argv in cases.items():
        capsys.readouterr()
        assert main(["lifelong", argv[0], "--store", str(path), *argv[1:]]) == 2, message
        err = capsys.readouterr().err.strip()
        assert message in err and "\n" not in err and "Traceback" not in err, err
        assert _digest(path) == before, message
    assert main(["lifelong", "tasks", "--store", str(tmp_path / "missing")]) == 2
    assert not (tmp_path / "missing").exists()


def test_a_new_store_with_another_encoder_folder(tmp_path, data):
    other = _tiny_model_folder(tmp_path / "m")
    s = KnowledgeStore(tmp_path / "s", model=other)
    s.learn("banking", read_records(data["banking"], labels=True), epochs=1)
    assert json.loads((tmp_path / "s" / "store.json").read_text())["model"]["path"] == str(other.resolve())
    assert len(KnowledgeStore(tmp_path / "s").predict(["freeze my account"])) == 1


def test_csv_and_jsonl_read_alike_and_bad_lines_are_named(tmp_path):
    csv_file = tmp_path / "a.csv"
    csv_file.write_text('text,label,extra\n"hello, world",greet,x\nbye,farewell,y\n')
    assert read_records(csv_file, labels=True) == read_records(
        _jsonl(
            tmp_path / "a.jsonl",
            [{"text": "hello, world", "label": "greet"}, {"text": "bye", "label": "farewell"}],
        ),
        labels=True,
    )
    assert [r.label for r in read_records(_jsonl(tmp_path / "u.jsonl", [{"text": "hi"}]), labels=False)] == [
        None
    ]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "a", "label": "x"}\nnot json\n')
    with pytest.raises(EcruError, match="bad.jsonl:2: not JSON"):
        read_records(bad, labels=True)
    mixed = _jsonl(tmp_path / "m.jsonl", [{"text": "a", "label": "x"}, {"text": "b"}])
    with pytest.raises(EcruError, match="all or none"):
        read_records(mixed, labels=False)


def test_a_store_keeps_its_router_and_one_made_with_prototypes_only_still_predicts(store, tmp_path, data):
    from safetensors.torch import load_file, save_file

    folder = store.path / "tasks" / store.manifest["tasks"][0]["folder"]
    saved = load_file(folder / "router.safetensors")
    assert {
        "prototypes",
        "threshold",
        "means",
        "scatter",
        "count",
        "fourth",
        "class_counts",
        "rmd_threshold",
    } <= set(saved)  # the LDA router's, with its relative Mahalanobis test
    labels = json.loads((folder / "labels.json").read_text())["labels"]
    assert saved["adapter_prototypes"].shape == (len(labels), saved["prototypes"].shape[1])
    # the adapter prototypes count the texts trained on: the task's examples less those held out to calibrate
    records = read_records(data["banking"], labels=True)
    _, held = holdout_split([r.label for r in records], store.manifest["config"]["calibration"], seed=0)
    assert held and saved["adapter_counts"].sum() == store.manifest["tasks"][0]["examples"] - len(held)
    assert saved["scale"].item() == store.method().scales[0] > 0
    protos, counts = store.method().adapter_prototypes[0]  # read back as written
    assert torch.equal(protos, saved["adapter_prototypes"]) and torch.equal(counts, saved["adapter_counts"])
    texts = [r.text for r in read_records(data["banking_test"], labels=True)]
    want = [p.label for p in store.predict(texts)]
    # a store written before the LDA router: prototype router config, router files with prototypes only
    old = tmp_path / "old"
    shutil.copytree(store.path, old)
    manifest = json.loads((old / "store.json").read_text())
    manifest["config"] = {
        k: v
        for k, v in manifest["config"].items()
        if k not in ("lda_weight", "label_smoothing", "rmd_percentile", "few_margin", "scale_prior")
    }
    manifest["config"].update(router="prototypes", prototype_weight=0.5)
    (old / "store.json").write_text(json.dumps(manifest))
    for t in manifest["tasks"]:
        f = old / "tasks" / t["folder"] / "router.safetensors"
        keep = load_file(f)
        save_file({k: keep[k] for k in ("prototypes", "threshold")}, f)
        (f.parent / "manifest.json").unlink()  # written before task folders had manifests
    from ecru.lifelong.router import LDARouter, PrototypeRouter

    assert isinstance(store.method().router, LDARouter)
    old_store = KnowledgeStore(old)
    got = old_store.predict(texts)
    assert type(old_store.method().router) is PrototypeRouter
    assert old_store.method().scales == [None, None]  # no fitted scale stored: scores at the trained scale
    # a task it learns next is calibrated by plain temperature scaling, as before
    assert old_store.method().cfg.scale_prior == 0.0
    assert (
        len(got) == len(texts)
        and sum(p.label == w for p, w in zip(got, want, strict=True)) >= len(texts) // 2
    )
    # a store written with the LDA router before the adapter prototypes and the relative Mahalanobis test: no
    # adapter_* or rmd tensors, no such config
    lda = tmp_path / "lda"
    shutil.copytree(store.path, lda)
    manifest = json.loads((lda / "store.json").read_text())
    manifest["config"] = {
        k: v
        for k, v in manifest["config"].items()
        if not k.startswith("adapter_prototype") and k != "rmd_percentile"
    }
    (lda / "store.json").write_text(json.dumps(manifest))
    for t in manifest["tasks"]:
        f = lda / "tasks" / t["folder"] / "router.safetensors"
        keep = load_file(f)
        save_file(
            {
                k: v
                for k, v in keep.items()
                if not k.startswith("adapter_") and k not in ("class_counts", "rmd_threshold")
            },
            f,
        )
        (f.parent / "manifest.json").unlink()  # written before task folders had manifests
    lda_store = KnowledgeStore(lda)
    before = lda_store.predict(texts)
    assert lda_store.method().adapter_prototypes == [None] * len(manifest["tasks"])
    assert lda_store.method().cfg.adapter_prototype_weight == 0.0
    assert lda_store.method().router.rmd_percentile is None
    assert sum(p.label == w for p, w in zip(before, want, strict=True)) >= len(texts) // 2


def test_a_damaged_task_file_is_refused_in_one_line(store, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(store.path, copy)
    router = next((copy / "tasks").glob("*/router.safetensors"))
    data = bytearray(router.read_bytes())
    data[-3] ^= 0x10
    router.write_bytes(bytes(data))
    with pytest.raises(EcruError, match="checksum mismatch in .*router.safetensors"):
        KnowledgeStore(copy).predict(["hello"])
    router.write_bytes(b"garbage")
    (router.parent / "manifest.json").unlink()
    with pytest.raises(EcruError, match="router.safetensors is damaged or not a safetensors file"):
        KnowledgeStore(copy).predict(["hello"])


def test_forget_never_deletes_outside_the_store(store, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(store.path, copy)
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep.txt").write_text("mine")
    manifest = json.loads((copy / "store.json").read_text())
    manifest["tasks"][0]["folder"] = "../../victim"
    (copy / "store.json").write_text(json.dumps(manifest))
    with pytest.raises(EcruError, match="points outside the folder"):
        KnowledgeStore(copy).forget(manifest["tasks"][0]["task"])
    assert (victim / "keep.txt").read_text() == "mine"


def test_leftovers_of_a_killed_learn_are_cleaned_by_the_next_writer(store, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(store.path, copy)
    orphan = copy / "tasks" / "travel-deadbeef"  # renamed into place, killed before store.json
    half = copy / "tasks" / ".x.ecru-tmp-0001"  # killed while writing
    commit = copy / ".store.json.ecru-tmp-0003"  # killed between writing store.json and renaming it
    orphan.mkdir()
    half.mkdir()
    commit.write_text("{}")
    ks = KnowledgeStore(copy)
    ks.forget(ks.tasks()[-1]["task"])
    assert not orphan.exists() and not half.exists() and not commit.exists()
    # a store killed before its first commit is no store yet, not "a folder that is not a store"
    fresh = tmp_path / "fresh"
    (fresh / "tasks" / ".t.ecru-tmp-0002").mkdir(parents=True)
    (fresh / ".ecru.lock").write_text("123\n")
    assert KnowledgeStore(fresh).tasks() == []


def test_two_concurrent_learns_on_one_new_store_keep_both_tasks(tmp_path, data):
    """Two processes learn at once into a store that does not exist yet: both exit 0 and both tasks are
    there (each commits under the store's lock against the store.json it then reads)."""
    import os
    import subprocess
    import sys

    src = str(Path(__file__).resolve().parents[2] / "src")
    env = {**os.environ, "PYTHONPATH": src, "OMP_NUM_THREADS": "1"}
    store = tmp_path / "shared"
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "ecru",
                "lifelong",
                "learn",
                "--store",
                str(store),
                "--task",
                task,
                "--data",
                str(data[task]),
                "--epochs",
                "1",
            ],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for task in ("banking", "travel")
    ]
    errors = [p.communicate(timeout=300)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], errors
    tasks = KnowledgeStore(store).tasks()
    assert sorted(t["task"] for t in tasks) == ["banking", "travel"]
    folders = sorted(p.name for p in (store / "tasks").iterdir())
    assert len(folders) == 2  # no orphan, no leftover


def test_a_linked_tasks_folder_is_refused_and_nothing_outside_is_deleted(store, tmp_path):
    copy, victim = tmp_path / "copy", tmp_path / "victim"
    shutil.copytree(store.path, copy)
    (victim / "project").mkdir(parents=True)
    (victim / "project" / "file.txt").write_text("mine")
    for task in (copy / "tasks").iterdir():
        shutil.move(task, victim / task.name)
    (copy / "tasks").rmdir()
    (copy / "tasks").symlink_to(victim)
    with pytest.raises(EcruError, match="symbolic link"):
        KnowledgeStore(copy).forget(store.tasks()[-1]["task"])
    assert (victim / "project" / "file.txt").read_text() == "mine"


def test_outputs_inside_the_store_are_refused(store, tmp_path, data, capsys):
    copy = tmp_path / "copy"
    shutil.copytree(store.path, copy)
    before = _digest(copy)
    runs = [
        [
            "predict",
            "--store",
            str(copy),
            "--data",
            str(data["banking_test"]),
            "--out",
            str(copy / "store.json"),
        ],
        ["tasks", "--store", str(copy), "--json", str(copy / "store.json")],
        ["export", "--store", str(copy), "--out", str(copy)],
        ["export", "--store", str(copy), "--out", str(copy / "tasks" / "x")],
    ]
    for run in runs:
        assert main(["lifelong", *run]) == 2
        assert "would overwrite the input" in capsys.readouterr().err
    assert _digest(copy) == before


def test_export_never_overwrites_and_names_each_task_apart(store, tmp_path, data):
    copy = tmp_path / "copy"
    shutil.copytree(store.path, copy)
    KnowledgeStore(copy).learn(
        "banking!", read_records(data["travel"], labels=True), epochs=1
    )  # slug: banking
    mine = tmp_path / "mine"
    (mine / "banking").mkdir(parents=True)
    (mine / "banking" / "notes.txt").write_text("mine")
    with pytest.raises(EcruError, match="not empty"):
        KnowledgeStore(copy).export(mine)
    assert (mine / "banking" / "notes.txt").read_text() == "mine"
    written = KnowledgeStore(copy).export(tmp_path / "exp")
    assert [p.name for p in written] == ["banking", "travel", "banking-2"]
    entries = json.loads((tmp_path / "exp" / "export.json").read_text())["tasks"]
    assert [(e["task"], e["folder"]) for e in entries] == [("banking", "banking"), ("travel", "travel"),
                                                          ("banking!", "banking-2")]  # fmt: skip
    with pytest.raises(EcruError, match="not a knowledge store"):  # an export is not mistaken for a store
        KnowledgeStore(tmp_path / "exp")


@pytest.mark.parametrize(
    "edit",
    [
        lambda m: [m],
        lambda m: m.update(tasks="oops"),
        lambda m: m["tasks"][0].update(labels=5),
        lambda m: m["tasks"][0].pop("folder"),
        lambda m: m.pop("model"),
        lambda m: m["tasks"][0].update(names=m["tasks"][0]["names"][:1]),
        lambda m: m["config"].update(r="eight"),
    ],
)
def test_a_hand_edited_store_json_is_one_line(store, tmp_path, data, capsys, edit):
    copy = tmp_path / "copy"
    shutil.copytree(store.path, copy)
    manifest = json.loads((copy / "store.json").read_text())
    manifest = edit(manifest) or manifest
    (copy / "store.json").write_text(json.dumps(manifest))
    out = tmp_path / "p.jsonl"
    runs = [["predict", "--store", str(copy), "--data", str(data["banking_test"]), "--out", str(out)]]
    if "config" in json.dumps(manifest) and "eight" not in json.dumps(manifest):  # listing reads no config
        runs.append(["tasks", "--store", str(copy)])
    for run in runs:
        assert main(["lifelong", *run]) == 2
        err = capsys.readouterr().err
        assert err.startswith("ecru: error:") and err.count("\n") == 1, err


def test_a_router_of_the_wrong_shape_is_one_line(store, tmp_path):
    from safetensors.torch import load_file, save_file

    copy = tmp_path / "copy"
    shutil.copytree(store.path, copy)
    router = next((copy / "tasks").glob("*/router.safetensors"))
    (router.parent / "manifest.json").unlink()  # a store from before manifests: nothing checks the bytes
    tensors = load_file(router)
    tensors["prototypes"] = tensors["prototypes"][:, :10].contiguous()
    save_file(tensors, router)
    with pytest.raises(EcruError, match="no prototypes for its"):
        KnowledgeStore(copy).predict(["hello"])


def test_a_reader_meeting_a_commit_reads_the_new_tasks(store, tmp_path, data):
    copy = tmp_path / "copy"
    shutil.copytree(store.path, copy)
    reader = KnowledgeStore(copy)  # has read store.json
    KnowledgeStore(copy).learn(
        "banking", read_records(data["banking"], labels=True), epochs=1
    )  # old folder gone
    assert reader.predict(["I lost my card"])[0].label is not None


def test_a_store_below_a_file_is_refused_before_training(tmp_path, data):
    (tmp_path / "afile").write_text("hi")
    with pytest.raises(EcruError, match="is a file, not a folder"):
        KnowledgeStore(tmp_path / "afile" / "sub")


def test_no_loading_bar_in_a_log(store, tmp_path, data, capsys):
    run = ["predict", "--store", str(store.path), "--data", str(data["banking_test"])]
    assert main(["lifelong", *run, "--out", str(tmp_path / "p.jsonl")]) == 0
    assert capsys.readouterr().err == ""  # stderr is no terminal here: an error would be its one line


def test_duplicate_spellings_of_a_candidate_label_are_one(store, tmp_path, data, capsys):
    out = tmp_path / "p.jsonl"
    labels = "freeze_account,freeze account,routing"
    run = ["predict", "--store", str(store.path), "--data", str(data["banking_test"]), "--out", str(out)]
    assert main(["lifelong", *run, "--labels", labels]) == 0
    assert main(["lifelong", *run[:-1], str(tmp_path / "q.jsonl"), "--labels", "freeze_account,routing"]) == 0
    assert out.read_text() == (tmp_path / "q.jsonl").read_text()


def test_a_task_manifest_that_omits_its_router_is_refused(store, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(store.path, copy)
    manifest_file = next((copy / "tasks").glob("*/manifest.json"))
    manifest = json.loads(manifest_file.read_text())
    manifest_file.write_text(json.dumps({**manifest, "files": {}}))
    with pytest.raises(EcruError, match="is not in .*manifest.json"):
        KnowledgeStore(copy).predict(["hello"])
