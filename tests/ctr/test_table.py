"""A practitioner's own table: `ecru ctr schema`, `train --data table:FILE --schema`, `predict` (ids, one line
per input line), Parquet, and the one-line errors of bad schemas.

The table has a KNOWN ground truth: a logistic model over its columns (dense, categorical and the mean of a
multi-hot cell's tag weights), so the oracle AUC of the held-out rows bounds what any model can reach."""

import json

import pytest
import torch

from ecru.ctr import auc
from ecru.ctr.reader import ReaderConfig, load_ctr_file
from ecru.ctr.schema import TableSchema, load_schema, propose_schema
from ecru.ctr.synthetic import _calibrate, zipf_ids

from .test_cli import run

SCHEMA = {
    "label": "clicked",
    "dense": ["price", "age"],
    "categorical": ["user", "item", "city"],
    "multi_hot": {"tags": "|"},
}
CARDS = {"user": 300, "item": 120, "city": 15, "tags": 40}


def make_table(n: int, seed: int) -> tuple[list[dict], torch.Tensor]:
    """Rows (dicts of cell text) and their true click probabilities; the teacher is seeded apart from the
    rows, so every call draws rows of one and the same ground truth."""
    teacher = torch.Generator().manual_seed(1234)
    weights = {c: torch.randn(k, generator=teacher) * 0.9 for c, k in CARDS.items()}
    beta = torch.tensor([0.8, -0.6])
    gen = torch.Generator().manual_seed(seed)
    ids = {c: zipf_ids(n, k, 1.05, gen) for c, k in CARDS.items() if c != "tags"}
    n_tags = torch.randint(1, 5, (n,), generator=gen)
    tags = [zipf_ids(int(k), CARDS["tags"], 1.05, gen).unique() for k in n_tags]
    price = torch.exp(torch.randn(n, generator=gen) * 0.8 + 3)
    age = torch.randint(18, 80, (n,), generator=gen).float()
    x = torch.stack([(torch.log(price) - 3) / 0.8, (age - 49) / 18], 1)
    z = sum(weights[c][ids[c]] for c in ids) + x @ beta
    z = z + torch.stack([weights["tags"][t].mean() for t in tags])
    prob = torch.sigmoid(z + _calibrate(z, 0.3))
    clicked = torch.bernoulli(prob, generator=gen).int()
    rows = [
        {
            "row_id": f"r{seed}-{i}",
            "clicked": str(int(clicked[i])),
            "price": f"{float(price[i]):.2f}",
            "age": str(int(age[i])),
            **{c: f"{c[0]}{int(ids[c][i])}" for c in ids},
            "tags": "|".join(f"t{int(t)}" for t in tags[i]),
        }
        for i in range(n)
    ]
    return rows, prob


def write_csv(path, rows: list[dict], *, drop=()) -> None:
    names = [k for k in rows[0] if k not in drop]
    path.write_text(",".join(names) + "\n" + "".join(",".join(r[k] for k in names) + "\n" for r in rows))


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    root = tmp_path_factory.mktemp("table")
    train_rows, _ = make_table(40_000, seed=0)
    held_rows, held_prob = make_table(5_000, seed=1)
    write_csv(root / "train.csv", train_rows)
    write_csv(root / "held.csv", held_rows, drop=("clicked",))
    (root / "schema.json").write_text(json.dumps(SCHEMA))
    labels = torch.tensor([float(r["clicked"]) for r in held_rows])
    return root, held_rows, labels, held_prob


def test_own_table_trains_from_the_cli_and_scores_held_out_rows(table, capsys):
    root, held_rows, labels, held_prob = table
    train = ["ctr", "train", "--data", f"table:{root / 'train.csv'}", "--schema", str(root / "schema.json")]
    rc, out, err = run([*train, "--epochs", "3", "--out", str(root / "model"), "--seed", "0"], capsys)
    assert rc == 0, err
    assert json.loads((root / "model" / "schema.json").read_text())["multi_hot"] == {"tags": "|"}
    scores = root / "scores.txt"
    predict = ["ctr", "predict", "--model", str(root / "model"), "--data", f"table:{root / 'held.csv'}"]
    rc, _, err = run([*predict, "--out", str(scores)], capsys)
    probs = torch.tensor([float(v) for v in scores.read_text().splitlines()])
    model_auc, oracle_auc = auc(labels, probs), auc(labels, held_prob)
    print(f"own table: CLI held-out AUC {model_auc:.4f}, oracle AUC {oracle_auc:.4f}")
    assert rc == 0 and len(probs) == 5_000 and not probs.isnan().any()
    assert model_auc >= 0.78 and model_auc <= oracle_auc + 0.005  # no model beats the ground truth
    # the id column beside each probability; the same numbers as the bare scores
    rc, _, _ = run([*predict, "--id-column", "row_id", "--out", str(root / "scores.csv")], capsys)
    table_out = (root / "scores.csv").read_text().splitlines()
    assert rc == 0 and table_out[0] == "id,probability" and table_out[1].startswith("r1-0,")
    with_ids = torch.tensor([float(r.split(",")[1]) for r in table_out[1:]])
    torch.testing.assert_close(with_ids, probs, rtol=0, atol=0)
    # the same rows as Parquet score the same
    import pyarrow as pa
    import pyarrow.parquet as pq

    names = [k for k in held_rows[0] if k != "clicked"]
    pq.write_table(pa.table({k: [r[k] for r in held_rows] for k in names}), root / "held.parquet")
    rc, _, err = run([*predict[:-1], f"table:{root / 'held.parquet'}", "--out", str(root / "pq.txt")], capsys)
    parquet = torch.tensor([float(v) for v in (root / "pq.txt").read_text().splitlines()])
    assert rc == 0, err
    torch.testing.assert_close(parquet, probs, rtol=1e-6, atol=1e-7)


def test_multi_hot_cells_become_padded_id_columns(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text("y,a,tags\n1,x,p|q|r\n0,y,\n1,x,q\n")
    schema = TableSchema("y", (), ("a",), {"tags": "|"}, hash_buckets=0, max_tags=2)
    data, skipped = load_ctr_file(path, schema, cfg=ReaderConfig(hash_buckets=0))
    assert skipped == 0 and data.sequence_fields == 1 and data.sequence_length == 2
    # vocabularies: tokens in sorted order get ids 1..; the empty cell is the empty token (id 0), padding -1
    assert data.cats.tolist() == [[1, 1, 2], [2, 0, -1], [1, 2, -1]]
    assert data.labels.tolist() == [1.0, 0.0, 1.0] and data.cardinalities == (3, 3)


def test_schema_proposes_kinds_from_the_file(table):
    root = table[0]
    schema, facts = propose_schema(root / "train.csv", rows=2000)
    assert schema["label"] == "clicked" and schema["multi_hot"] == {"tags": "|"}
    assert schema["dense"] == ["price"] and {"user", "item", "city"} <= set(schema["categorical"])
    assert facts["row_id"]["kind"] == "id" and "row_id" not in schema["categorical"]
    assert facts["city"]["distinct"] <= CARDS["city"] and facts["tags"]["separator_share"] > 0.5


@pytest.mark.parametrize(
    ("schema", "message"),
    [
        ({}, "empty"),
        ({"label": "clicked", "categorical": ["nope"]}, "nope"),
        ({"label": "clicked", "dense": ["price"]}, "no categorical or multi_hot"),
        ({"label": "clicked", "categorical": ["user"], "colour": 1}, "unknown key"),
        ({"label": "price", "categorical": ["user"]}, "must be 0 or 1"),
        ({"label": "clicked", "categorical": ["user"], "multi_hot": {"tags": ""}}, "separator"),
    ],
)
def test_bad_schemas_are_one_line(table, schema, message, capsys, tmp_path):
    root = table[0]
    (root / "bad.json").write_text(json.dumps(schema))
    argv = ["ctr", "train", "--data", f"table:{root / 'train.csv'}", "--schema", str(root / "bad.json")]
    rc, _, err = run([*argv, "--out", str(tmp_path / "never")], capsys)
    assert rc == 2 and message in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "never").exists()  # a label found not 0/1 as the rows are read left it, empty


def test_table_without_schema_is_one_line(table, capsys):
    rc, _, err = run(["ctr", "train", "--data", f"table:{table[0] / 'train.csv'}"], capsys)
    assert rc == 2 and "--schema" in err and len(err.strip().splitlines()) == 1


def test_schema_command_prints_json(table, capsys):
    rc, out, err = run(["ctr", "schema", "--data", str(table[0] / "train.csv"), "--rows", "500"], capsys)
    assert rc == 0 and json.loads(out)["label"] == "clicked" and "tags: multi_hot:|" in err


def test_table_predict_keeps_one_line_per_input_line(table, capsys):
    """A blank line and a malformed row (--skip-malformed) are nan lines in place; a quoted cell with the
    delimiter in it is one cell."""
    root, held_rows = table[0], table[1][:50]
    if not (root / "model").exists():
        pytest.skip("needs the model of test_own_table_trains_from_the_cli_and_scores_held_out_rows")
    write_csv(root / "small.csv", held_rows, drop=("clicked",))
    lines = (root / "small.csv").read_text().splitlines(keepends=True)
    bad = lines[11].split(",")
    bad[1] = "not-a-number"  # price
    quoted = lines[21].split(",")
    quoted[4] = f'"{quoted[4]},x"'  # item: a token with a comma in it
    mixed = root / "mixed.csv"
    mixed.write_text(
        "".join(
            lines[:6]
            + ["\n"]
            + lines[6:11]
            + [",".join(bad)]
            + lines[12:21]
            + [",".join(quoted)]
            + lines[22:]
        )
    )
    predict = ["ctr", "predict", "--model", str(root / "model"), "--data", f"table:{mixed}"]
    rc, _, err = run([*predict, "--out", str(root / "m.txt")], capsys)
    assert rc == 2 and "mixed.csv:13:" in err and "price" in err and len(err.strip().splitlines()) == 1
    rc, _, err = run([*predict, "--skip-malformed", "--out", str(root / "m.txt")], capsys)
    values = (root / "m.txt").read_text().splitlines()
    assert rc == 0, err
    assert len(values) == 51 and values[5] == "nan" and values[11] == "nan"
    assert sum(v == "nan" for v in values) == 2


def test_a_byte_order_mark_is_read_as_if_absent(table, tmp_path):
    root = table[0]
    bom = b"\xef\xbb\xbf"  # Excel's "CSV UTF-8" starts the file with it
    (tmp_path / "t.csv").write_bytes(
        bom + (root / "train.csv").read_bytes()[:200_000].rsplit(b"\n", 1)[0] + b"\n"
    )
    (tmp_path / "schema.json").write_bytes(bom + (root / "schema.json").read_bytes())
    schema, facts = propose_schema(tmp_path / "t.csv", rows=500)
    assert "row_id" in facts and schema["label"] == "clicked"
    assert load_schema(tmp_path / "schema.json").label == "clicked"


def test_a_table_whose_only_ids_are_multi_hot_trains_and_scores(table, capsys, tmp_path):
    """Only a multi-hot field (no single-valued categorical one): training was a reshape traceback."""
    root = table[0]
    (tmp_path / "tags.json").write_text(json.dumps({"label": "clicked", "multi_hot": {"tags": "|"}}))
    train = ["ctr", "train", "--data", f"table:{root / 'train.csv'}", "--schema", str(tmp_path / "tags.json")]
    for mode in ("full", "sparse"):
        rc, _, err = run(
            [*train, "--mode", mode, "--epochs", "1", "--mlp", "16", "--out", str(tmp_path / mode)], capsys
        )
        assert rc == 0, err
    predict = ["ctr", "predict", "--model", str(tmp_path / "full"), "--data", f"table:{root / 'held.csv'}"]
    rc, _, err = run([*predict, "--out", str(tmp_path / "s.txt")], capsys)
    probs = torch.tensor([float(v) for v in (tmp_path / "s.txt").read_text().splitlines()])
    assert rc == 0 and len(probs) == 5_000 and auc(table[2], probs) > 0.55  # the tags alone carry signal


def test_the_schema_leaves_out_a_numbered_row_id_but_keeps_a_distinct_quantity(tmp_path):
    """Integers rising row after row (1000, 1001, ...) are a row id; distinct integers in no order a quantity."""
    path = tmp_path / "t.csv"
    gen = torch.Generator().manual_seed(0)
    amounts = torch.randperm(10_000, generator=gen)[:300].tolist()
    path.write_text(
        "row,clicked,amount,city\n"
        + "".join(f"{1000 + i},{i % 2},{a},c{i % 7}\n" for i, a in enumerate(amounts))
    )
    schema, facts = propose_schema(path)
    assert facts["row"]["kind"] == "id" and "row" not in schema["dense"] + schema["categorical"]
    assert schema["dense"] == ["amount"] and schema["categorical"] == ["city"]


def test_group_auc_by_a_field_name_and_a_wrong_one_before_any_work(table, capsys, tmp_path):
    root = table[0]
    train = ["ctr", "train", "--data", f"table:{root / 'train.csv'}", "--schema", str(root / "schema.json")]
    rc, out, err = run(
        [*train, "--epochs", "1", "--mlp", "16", "--group-field", "city", "--json", str(tmp_path / "m.json")],
        capsys,
    )
    metrics = json.loads((tmp_path / "m.json").read_text())
    assert (
        rc == 0
        and (metrics["group_field"], metrics["group_field_name"]) == (2, "city")
        and "field city" in out
    )
    for wrong in ("price", "tags", "nope", "3"):  # dense, multi-hot, absent, past the 3 categorical fields
        rc, _, err = run([*train, "--group-field", wrong, "--out", str(tmp_path / "never")], capsys)
        assert (
            rc == 2 and f"--group-field {wrong}: not a categorical field" in err and "user, item, city" in err
        )
        assert not (tmp_path / "never").exists()


def test_tables_too_large_for_memory_are_refused_before_allocating(table, capsys, tmp_path):
    root = table[0]
    (tmp_path / "huge.json").write_text(json.dumps({**SCHEMA, "hash_buckets": 10**12}))
    train = ["ctr", "train", "--data", f"table:{root / 'train.csv'}", "--schema", str(tmp_path / "huge.json")]
    rc, _, err = run([*train, "--out", str(tmp_path / "never")], capsys)
    assert rc == 2 and "the embedding tables need" in err and "GiB free: lower hash_buckets" in err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "never").exists()
