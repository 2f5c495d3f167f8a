"""`ecru ctr train --out` / `predict` / `synth` end to end, and the one-line errors of bad inputs."""

import json
import shutil

import pytest
import torch

from ecru.cli import main
from ecru.ctr import auc, load_model
from ecru.errors import EcruError

FAST = ["--mlp", "8", "--batch-size", "256", "--base-batch", "256", "--min-count", "1"]


def run(argv, capsys):
    """(exit status, stdout, stderr) of `ecru ARGV`; argparse errors exit through SystemExit."""
    try:
        rc = main(argv)
    except SystemExit as exc:
        rc = exc.code
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("ctr")
    assert (
        main(["ctr", "synth", "--rows", "3000", "--scale", "1e-3", "--out", str(root / "new" / "all.tsv")])
        == 0
    )
    lines = (root / "new" / "all.tsv").read_text().splitlines(keepends=True)
    bad = ["7" + lines[5][1:], "1\t2\t3\n", lines[9].replace("\t", "\tx", 1)]
    (root / "train.tsv").write_text("".join(lines[:2500] + bad))
    (root / "held.tsv").write_text("".join(lines[2500:]))
    (root / "held_nolabel.tsv").write_text("".join(line.split("\t", 1)[1] for line in lines[2500:]))
    return root


@pytest.fixture(scope="module")
def trained(files):
    out = files / "model"
    argv = [
        "ctr",
        "train",
        "--data",
        f"criteo:{files / 'train.tsv'}",
        "--skip-malformed",
        "--out",
        str(out),
        *FAST,
    ]
    assert main(argv) == 0
    return out


def test_train_writes_a_self_contained_folder(trained):
    names = {p.name for p in trained.iterdir()}
    assert {
        "model.safetensors",
        "vocab.safetensors",
        "config.json",
        "metrics.json",
        "checkpoint.safetensors",
    } <= names
    metrics = json.loads((trained / "metrics.json").read_text())
    assert metrics["skipped_lines"] == 3 and 0.5 < metrics["auc"] <= 1
    assert not [n for n in names if n.endswith(".tmp")]


def test_predict_one_probability_per_row_in_order(files, trained, capsys):
    out = files / "scores" / "held.txt"
    rc, stdout, _ = run(
        [
            "ctr",
            "predict",
            "--model",
            str(trained),
            "--data",
            f"criteo:{files / 'held.tsv'}",
            "--out",
            str(out),
        ],
        capsys,
    )
    assert rc == 0 and "AUC" in stdout
    probs = torch.tensor([float(x) for x in out.read_text().split()])
    assert len(probs) == 500 and ((probs > 0) & (probs < 1)).all()
    # the Python API and an unlabelled copy of the file give the same numbers
    predictor = load_model(trained)
    api = predictor.predict(files / "held.tsv")
    torch.testing.assert_close(probs, api, rtol=1e-6, atol=1e-7)
    nolabel = predictor.predict(files / "held_nolabel.tsv")
    torch.testing.assert_close(nolabel, api, rtol=0, atol=0)
    # ids never seen in training take the out-of-vocabulary row: a row of unseen tokens still scores
    row = (files / "held.tsv").read_text().splitlines()[0].split("\t")
    unseen = files / "unseen.tsv"
    unseen.write_text("\t".join(row[:14] + ["abcdef01"] * 26) + "\n")
    data = predictor.read(unseen)
    assert (data.cats == 0).all() and 0 < float(predictor.predict(unseen)[0]) < 1


def test_predict_skip_malformed_keeps_rows_aligned(files, trained, capsys):
    out = files / "train_scores.txt"
    data = f"criteo:{files / 'train.tsv'}"
    rc, _, err = run(["ctr", "predict", "--model", str(trained), "--data", data, "--out", str(out)], capsys)
    assert rc == 2 and "train.tsv:2501:" in err and len(err.strip().splitlines()) == 1 and not out.exists()
    rc, _, _ = run(
        ["ctr", "predict", "--model", str(trained), "--data", data, "--out", str(out), "--skip-malformed"],
        capsys,
    )
    values = out.read_text().split()
    assert rc == 0 and len(values) == 2503 and values[2500:] == ["nan"] * 3 and "nan" not in values[:2500]


def test_resume_refuses_another_file_and_a_corrupted_checkpoint(files, trained, capsys):
    other = files / "other"
    shutil.copytree(trained, other)
    argv = [
        "ctr",
        "train",
        "--data",
        f"criteo:{files / 'held.tsv'}",
        "--out",
        str(other),
        "--resume",
        "--epochs",
        "2",
        *FAST,
    ]
    rc, _, err = run(argv, capsys)
    assert rc == 2 and "other data" in err and len(err.strip().splitlines()) == 1
    (other / "checkpoint.safetensors").write_bytes(b"not a checkpoint")
    argv[3] = f"criteo:{files / 'train.tsv'}"
    rc, _, err = run([*argv, "--skip-malformed"], capsys)
    assert rc == 2 and "unreadable" in err and "Traceback" not in err


def test_a_torn_model_folder_is_refused(files, trained):
    torn = files / "torn"
    shutil.copytree(trained, torn)
    config = json.loads((torn / "config.json").read_text())
    (torn / "config.json").write_text(json.dumps({**config, "generation": "0" * 32}))
    with pytest.raises(EcruError, match="checksum mismatch in .*config.json"):
        load_model(torn)
    # a folder of version 1 (before manifests) is still checked by its generation strings
    (torn / "manifest.json").unlink()
    (torn / "config.json").write_text(json.dumps({**config, "version": 1, "generation": "0" * 32}))
    with pytest.raises(EcruError, match="does not belong"):
        load_model(torn)


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_damaged_weights_are_refused_in_one_line(files, trained, damage, capsys):
    bad = files / f"damaged-{damage}"
    shutil.copytree(trained, bad)
    weights = bad / "model.safetensors"
    data = bytearray(weights.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0x04
    else:
        del data[len(data) // 2 :]
    weights.write_bytes(bytes(data))
    rc, _, err = run(["ctr", "predict", "--model", str(bad), "--data", f"criteo:{files / 'train.tsv'}",
                      "--out", str(files / f"p-{damage}.txt")], capsys)  # fmt: skip
    assert rc == 2 and "checksum mismatch in" in err and "model.safetensors" in err
    assert len(err.strip().splitlines()) == 1 and not (files / f"p-{damage}.txt").exists()


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--rows", "-10"], "--rows: must be > 0"),
        (["--test-fraction", "1.5"], "strictly between 0 and 1"),
        (["--test-fraction", "0"], "strictly between 0 and 1"),
        (["--hash-buckets", "1"], "must be 0 (vocabularies) or >= 2"),
        (["--mlp", "8,x"], "comma-separated"),
    ],
)
def test_bad_flags_are_one_line(flags, message, capsys):
    rc, _, err = run(["ctr", "train", *flags], capsys)
    assert rc == 2 and message in err and len(err.strip().splitlines()) == 1


def test_outputs_checked_before_work(files, capsys, tmp_path):
    rc, _, err = run(["ctr", "train", "--json", str(tmp_path), "--rows", "10"], capsys)
    assert rc == 2 and "is a folder" in err
    rc, _, err = run(["ctr", "synth", "--rows", "5", "--out", str(tmp_path)], capsys)
    assert rc == 2 and "is a folder" in err
    out = tmp_path / "missing" / "x.json"
    argv = [
        "ctr",
        "train",
        "--rows",
        "2000",
        "--scale",
        "1e-3",
        "--json",
        str(out),
        "--group-field",
        "2",
        *FAST,
    ]
    rc, stdout, _ = run(argv, capsys)
    metrics = json.loads(out.read_text())
    assert rc == 0 and metrics["steps"] > 0 and 0 < metrics["group_auc"] < 1 and "group AUC" in stdout


def test_one_class_test_split_is_one_line(tmp_path, capsys):
    row = "0\t" + "\t".join(["1"] * 13 + ["0aaf7e0c"] * 26) + "\n"
    path = tmp_path / "zeros.tsv"
    path.write_text(row * 300)
    rc, _, err = run(["ctr", "train", "--data", f"criteo:{path}", *FAST], capsys)
    assert rc == 2 and "one class" in err and len(err.strip().splitlines()) == 1


def test_hashing_folder_and_avazu_round_trip(tmp_path, capsys):
    head = "id,click,hour," + ",".join(f"C{i}" for i in range(21)) + "\n"
    gen = torch.Generator().manual_seed(0)
    rows = []
    for i in range(1200):
        toks = [f"{int(t):x}" for t in torch.randint(0, 6, (21,), generator=gen)]
        click = int(toks[0] in ("0", "1")) if i % 7 else 1 - int(toks[0] in ("0", "1"))
        rows.append(f"{i},{click},141021{i % 24:02d}," + ",".join(toks) + "\n")
    rows[3] = rows[3].replace(",141021", ",1410", 1)  # a bad hour
    (tmp_path / "train.csv").write_text(head + "".join(rows))
    (tmp_path / "score.csv").write_text(
        "id,hour,"
        + ",".join(f"C{i}" for i in range(21))
        + "\n"
        + "".join(r.split(",", 2)[0] + "," + r.split(",", 2)[2] for r in rows[1000:])
    )
    out = tmp_path / "m"
    argv = [
        "ctr",
        "train",
        "--data",
        f"avazu:{tmp_path / 'train.csv'}",
        "--hash-buckets",
        "64",
        "--skip-malformed",
    ]
    rc, _, err = run([*argv, "--out", str(out), *FAST, "--epochs", "3"], capsys)
    assert rc == 0 and "skipped 1 malformed" in err and not (out / "vocab.safetensors").exists()
    model = load_model(out)
    assert model.data_format == "avazu" and model.encoder.buckets == 64
    probs = model.predict(tmp_path / "score.csv")
    labels = torch.tensor([float(r.split(",")[1]) for r in rows[1000:]])
    assert len(probs) == 200 and auc(labels, probs) > 0.7  # the click follows C0: learnable
    rc, _, err = run(
        [
            "ctr",
            "predict",
            "--model",
            str(out),
            "--data",
            f"criteo:{tmp_path / 'score.csv'}",
            "--out",
            str(tmp_path / "s.txt"),
        ],
        capsys,
    )
    assert rc == 2 and "reads avazu files" in err
    # --id-column: the id beside each probability, one row per input line (a blank line -> nan, id "")
    blanked = tmp_path / "blank.csv"
    lines = (tmp_path / "score.csv").read_text().splitlines(keepends=True)
    blanked.write_text("".join(lines[:51] + ["\n"] + lines[51:]))
    predict = ["ctr", "predict", "--model", str(out), "--data", f"avazu:{blanked}", "--id-column", "id"]
    rc, _, _ = run([*predict, "--out", str(tmp_path / "s.csv")], capsys)
    table = (tmp_path / "s.csv").read_text().splitlines()
    assert rc == 0 and table[0] == "id,probability" and len(table) == 1 + 201
    assert table[51] == ",nan" and [r.split(",")[0] for r in table[1:51]] == [
        str(i) for i in range(1000, 1050)
    ]
    got = torch.tensor([float(r.split(",")[1]) for r in table[1:51] + table[52:]])
    torch.testing.assert_close(got, probs, rtol=1e-6, atol=1e-7)
    rc, _, _ = run([*predict, "--out", str(tmp_path / "s.jsonl")], capsys)
    rows_out = [json.loads(r) for r in (tmp_path / "s.jsonl").read_text().splitlines()]
    assert rc == 0 and len(rows_out) == 201 and rows_out[50] == {"id": "", "probability": None}
    assert rows_out[0]["id"] == "1000" and abs(rows_out[0]["probability"] - float(probs[0])) < 1e-6
    rc, _, err = run([*predict, "--out", str(tmp_path / "s.txt")], capsys)
    assert rc == 2 and "FILE.csv or FILE.jsonl" in err and not (tmp_path / "s.txt").exists()
    rc, _, err = run([*predict[:-1], "nope", "--out", str(tmp_path / "t.csv")], capsys)
    assert rc == 2 and "no such column" in err and len(err.strip().splitlines()) == 1


def test_predict_writes_one_line_per_input_line(files, trained, capsys):
    """Issue 40: a blank line is a nan line, not a dropped one (200 lines in, 200 scores out)."""
    lines = (files / "held.tsv").read_text().splitlines(keepends=True)[:199]
    blank = files / "blank.tsv"
    blank.write_text("".join(lines[:100] + ["\n"] + lines[100:]))
    out = files / "blank_scores.txt"
    rc, _, _ = run(
        ["ctr", "predict", "--model", str(trained), "--data", f"criteo:{blank}", "--out", str(out)], capsys
    )
    values = out.read_text().splitlines()
    plain = load_model(trained).predict(files / "held.tsv")[:199]
    assert rc == 0 and len(values) == 200 and values[100] == "nan"
    got = torch.tensor([float(v) for v in values[:100] + values[101:]])
    torch.testing.assert_close(got, plain, rtol=1e-6, atol=1e-7)
    api = load_model(trained).predict(blank)  # the Python API aligns the same way
    assert len(api) == 200 and api[100].isnan() and not api[:100].isnan().any()


def test_undecodable_bytes_are_one_line_or_skipped(files, trained, capsys):
    """Issue 40: invalid UTF-8 in a count or a categorical is file:line, exit 2 (not ArrowInvalid), or skipped."""
    lines = (files / "held.tsv").read_bytes().splitlines(keepends=True)[:100]
    for column, broken in ((3, b"1\xff2"), (20, b"ab\xffc")):
        parts = lines[40].split(b"\t")
        parts[column] = broken
        bad = files / f"utf8_{column}.tsv"
        bad.write_bytes(b"".join(lines[:40] + [b"\t".join(parts)] + lines[41:]))
        out = files / f"utf8_{column}.txt"
        argv = ["ctr", "predict", "--model", str(trained), "--data", f"criteo:{bad}", "--out", str(out)]
        rc, _, err = run(argv, capsys)
        assert rc == 2 and f"utf8_{column}.tsv:41:" in err and "invalid UTF-8" in err
        assert len(err.strip().splitlines()) == 1 and not out.exists()
        rc, _, _ = run([*argv, "--skip-malformed"], capsys)
        values = out.read_text().splitlines()
        assert (
            rc == 0 and len(values) == 100 and values[40] == "nan" and "nan" not in values[:40] + values[41:]
        )
        train = ["ctr", "train", "--data", f"criteo:{bad}", "--epochs", "1", *FAST]
        rc, _, err = run(train, capsys)
        assert rc == 2 and f"utf8_{column}.tsv:41:" in err and len(err.strip().splitlines()) == 1


def test_clip_note_says_why_it_is_near_zero():
    from ecru.ctr.cli import clip_note

    assert "0.00%" in clip_note(True, 0.0) and "mean loss" in clip_note(True, 0.0)
    assert "docs/ctr.md" in clip_note(True, 0.0) and "off" in clip_note(False, 0.0)


def test_missing_inputs_are_one_line(tmp_path, capsys):
    rc, _, err = run(["ctr", "train", "--data", f"criteo:{tmp_path / 'nope.tsv'}"], capsys)
    assert rc == 2 and "not found" in err and len(err.strip().splitlines()) == 1
    rc, _, err = run(["ctr", "train", "--data", "parquet:x"], capsys)
    assert rc == 2 and "criteo:FILE" in err
    out = tmp_path / "s.txt"
    rc, _, err = run(
        ["ctr", "predict", "--model", str(tmp_path), "--data", "criteo:x", "--out", str(out)], capsys
    )
    assert rc == 2 and "config.json" in err and len(err.strip().splitlines()) == 1
    rc, _, err = run(["ctr", "train", "--resume", "--rows", "100"], capsys)
    assert rc == 2 and "--resume" in err


def test_a_finished_run_is_refused_without_resume_or_overwrite(files, trained, capsys):
    out = files / "again"
    shutil.copytree(trained, out)
    argv = ["ctr", "train", "--data", f"criteo:{files / 'train.tsv'}", "--skip-malformed", "--out", str(out)]
    rc, _, err = run([*argv, *FAST], capsys)
    assert rc == 2 and "already holds a run" in err and "--overwrite" in err
    assert len(err.strip().splitlines()) == 1
    rc, _, err = run([*argv, *FAST, "--resume", "--overwrite"], capsys)
    assert rc == 2 and "not allowed with argument" in err
    rc, _, _ = run([*argv, *FAST, "--overwrite"], capsys)
    assert rc == 0 and json.loads((out / "metrics.json").read_text())["epochs"] >= 1


def test_outputs_never_overwrite_inputs(files, trained, capsys, tmp_path):
    model = tmp_path / "m"
    shutil.copytree(trained, model)
    data = tmp_path / "held.tsv"
    shutil.copy(files / "held.tsv", data)
    before = {p.name: p.read_bytes() for p in [*model.iterdir(), data]}
    for out in (model / "model.safetensors", model / "manifest.json", data):
        rc, _, err = run(
            ["ctr", "predict", "--model", str(model), "--data", str(data), "--out", str(out)], capsys
        )
        assert rc == 2 and "would overwrite the input" in err
    rc, _, err = run(["ctr", "train", "--data", f"criteo:{data}", "--json", str(data), *FAST], capsys)
    assert rc == 2 and "would overwrite the input" in err
    assert {p.name: p.read_bytes() for p in [*model.iterdir(), data]} == before


def test_a_second_run_into_one_out_is_refused(files, capsys, tmp_path):
    from ecru.io import FolderLock

    out = tmp_path / "run"
    with FolderLock(out):  # another process training into it
        rc, _, err = run(["ctr", "train", "--rows", "500", "--out", str(out), *FAST], capsys)
    assert rc == 2 and "in use by another ecru process" in err
    assert not (out / "model.safetensors").exists()


def test_a_manifest_that_omits_the_weights_is_refused(files, trained):
    bad = files / "omits"
    shutil.copytree(trained, bad)
    manifest = json.loads((bad / "manifest.json").read_text())
    (bad / "manifest.json").write_text(json.dumps({**manifest, "files": {}}))
    with pytest.raises(EcruError, match="is not in .*manifest.json"):
        load_model(bad)


def test_a_device_that_is_not_here_and_too_few_synthetic_rows_are_one_line(capsys, tmp_path):
    for device, message in (("foo", "not a device"), ("cuda", "no CUDA device here")):
        if device == "cuda" and torch.cuda.is_available():
            continue
        rc, _, err = run(
            ["ctr", "train", "--rows", "500", "--device", device, "--out", str(tmp_path / "o")], capsys
        )
        assert rc == 2 and message in err and err.count("\n") == 1
        assert not (tmp_path / "o").exists()  # refused before the folder is made
    rc, _, err = run(["ctr", "synth", "--rows", "1", "--out", str(tmp_path / "one.tsv")], capsys)
    assert rc == 2 and "ask for more rows" in err and not (tmp_path / "one.tsv").exists()


@pytest.mark.parametrize(
    "edit", [{"embed_dim": "x"}, None, {"mlp": [3]}], ids=["wrong-type", "null", "another-mlp"]
)
def test_a_config_that_does_not_fit_the_weights_is_one_line(files, trained, edit, capsys):
    from ecru.io import write_manifest

    bad = files / f"refit-{edit and next(iter(edit))}"
    shutil.copytree(trained, bad)
    config = json.loads((bad / "config.json").read_text())
    config["ctr_config"] = None if edit is None else {**config["ctr_config"], **edit}
    (bad / "config.json").write_text(json.dumps(config))
    manifest = json.loads((bad / "manifest.json").read_text())
    write_manifest(bad, sorted(manifest["files"]))  # re-hashed: a crafted folder, not a damaged one
    out = files / "refit.txt"
    rc, _, err = run(
        ["ctr", "predict", "--model", str(bad), "--data", str(files / "held.tsv"), "--out", str(out)], capsys
    )
    assert rc == 2 and "does not fit its config" in err and err.count("\n") == 1, err
