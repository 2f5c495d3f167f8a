"""Criteo / Avazu readers on hand-written files, splits, and the TSV writer round trip."""

import math

import pytest
import torch

from ecru.ctr import (
    MalformedLineError,
    ReaderConfig,
    SyntheticConfig,
    generate,
    load_ctr_file,
    write_criteo_tsv,
)
from ecru.ctr.data import concat
from ecru.ctr.reader import read_ctr_file
from ecru.errors import MissingAssetError


def criteo_line(label, ints, cats):
    return "\t".join([str(label), *ints, *cats]) + "\n"


GOOD = [
    criteo_line(1, ["3", "", "0", "-1"] + ["7"] * 9, ["68fd1e64"] * 25 + [""]),
    criteo_line(0, [""] * 13, ["68fd1e64", "0aaf7e0c"] + ["deadbeef"] * 24),
    criteo_line(0, ["1"] * 13, ["0aaf7e0c"] * 26),
]
BAD = [
    criteo_line(2, ["1"] * 13, ["0aaf7e0c"] * 26),  # label
    "1\t2\t3\n",  # too few fields
    criteo_line(0, ["x"] + ["1"] * 12, ["0aaf7e0c"] * 26),  # integer
    criteo_line(0, ["1"] * 13, ["zzzz"] + ["0aaf7e0c"] * 25),  # not hex
]


@pytest.fixture
def criteo_file(tmp_path):
    path = tmp_path / "day_0.tsv"
    path.write_text(GOOD[0] + BAD[0] + GOOD[1] + BAD[1] + "\n" + BAD[2] + GOOD[2] + BAD[3])
    return path


def test_malformed_line_error_names_file_and_line(criteo_file):
    with pytest.raises(MalformedLineError, match=r"day_0\.tsv:2: .*label must be 0 or 1"):
        load_ctr_file(criteo_file, "criteo")


def test_skip_and_count_malformed_lines(criteo_file):
    data, skipped = load_ctr_file(criteo_file, "criteo", cfg=ReaderConfig(skip_malformed=True))
    assert skipped == 4 and len(data) == 3
    assert data.labels.tolist() == [1.0, 0.0, 0.0]
    torch.testing.assert_close(data.dense[0, :4], torch.tensor([math.log(4), 0.0, 0.0, 0.0]))
    assert data.dense[1].abs().sum() == 0  # empty counts -> 0
    # vocabulary mode: ids 1.. in sorted token order per field, empty -> 0
    assert data.cats[:, 0].tolist() == [2, 2, 1]  # 0aaf7e0c=1, 68fd1e64=2
    assert data.cats[:, 25].tolist() == [0, 2, 1]
    assert data.cardinalities[:3] == (3, 3, 4)


def test_vocabulary_threshold_and_hashing(criteo_file):
    cfg = ReaderConfig(skip_malformed=True, min_count=2)
    data, _ = load_ctr_file(criteo_file, "criteo", cfg=cfg)
    assert data.cats[:, 1].tolist() == [0, 1, 1]  # field 1: 68fd1e64 seen once (-> 0), 0aaf7e0c twice
    hashed, _ = load_ctr_file(criteo_file, "criteo", cfg=ReaderConfig(skip_malformed=True, hash_buckets=1000))
    assert hashed.cardinalities == (1000,) * 26
    assert hashed.cats[0, 0] == hashed.cats[1, 0] != hashed.cats[2, 0]
    assert hashed.cats[0, 25] == 0 and 0 < hashed.cats.max() < 1000


def test_streaming_blocks_with_a_fitted_encoder(tmp_path):
    path = write_criteo_tsv(generate(SyntheticConfig(n_rows=400, scale=1e-4, seed=1)), tmp_path / "s.tsv")
    whole, _ = load_ctr_file(path, "criteo")
    cfg = ReaderConfig(block_bytes=4096)
    blocks = list(read_ctr_file(path, "criteo", encoder=whole.info["encoder"], cfg=cfg))
    assert len(blocks) > 5 and sum(len(b) for b in blocks) == 400
    again = concat(blocks)
    assert torch.equal(again.cats, whole.cats) and torch.equal(again.labels, whole.labels)
    torch.testing.assert_close(again.dense, whole.dense, rtol=0, atol=0)
    # the single-pass vocabulary does not depend on the block size
    small, _ = load_ctr_file(path, "criteo", cfg=cfg)
    assert torch.equal(small.cats, whole.cats) and small.cardinalities == whole.cardinalities


def test_unlabelled_criteo_file(tmp_path, criteo_file):
    data, _ = load_ctr_file(criteo_file, "criteo", cfg=ReaderConfig(skip_malformed=True))
    path = tmp_path / "nolabel.tsv"
    path.write_text("".join(line.split("\t", 1)[1] for line in GOOD))
    scored, skipped = load_ctr_file(path, "criteo", encoder=data.info["encoder"])
    assert skipped == 0 and torch.isnan(scored.labels).all()
    assert torch.equal(scored.cats, data.cats) and torch.equal(scored.dense, data.dense)


def test_avazu_reader(tmp_path):
    head = "id,click,hour," + ",".join(f"c{i}" for i in range(21)) + "\n"
    row = "1000,{},14102100,1005,0,1fbe01fe,f3845767,28905ebd,ecad2386,7801e8d9,07d7df22,a99f214a,ddd2926e,44956a24,1,2,15706,320,50,1722,0,35,-1,79\n"
    path = tmp_path / "train.csv"
    path.write_text(head + row.format(0) + row.format(1) + "1,2,3\n")
    with pytest.raises(MalformedLineError, match=r"train\.csv:4"):
        load_ctr_file(path, "avazu")
    data, skipped = load_ctr_file(path, "avazu", cfg=ReaderConfig(skip_malformed=True))
    assert skipped == 1 and data.labels.tolist() == [0.0, 1.0]
    assert data.dense.shape == (2, 0) and data.cats.shape == (2, 22)


def test_missing_file_and_unknown_format(tmp_path):
    with pytest.raises(MissingAssetError, match="not found"):
        load_ctr_file(tmp_path / "nope.tsv", "criteo")
    with pytest.raises(Exception, match="unknown data format"):
        load_ctr_file(tmp_path / "nope.tsv", "kdd")


def test_synthetic_round_trip_through_criteo_tsv(tmp_path):
    data = generate(SyntheticConfig(n_rows=500, scale=1e-4, seed=3))
    back, skipped = load_ctr_file(write_criteo_tsv(data, tmp_path / "syn.tsv"), "criteo")
    assert skipped == 0
    assert torch.equal(back.labels, data.labels)
    torch.testing.assert_close(back.dense, data.dense, rtol=1e-6, atol=1e-6)
    for f in range(26):  # the vocabulary relabels ids, but the partition of rows is the same
        a, b = data.cats[:, f], back.cats[:, f]
        assert torch.equal(a[:, None] == a[None], b[:, None] == b[None])


def test_splits():
    data = generate(SyntheticConfig(n_rows=1000, scale=1e-4))
    train, test = data.split_chronological(0.1)
    assert (
        len(test) == 100
        and torch.equal(test.labels, data.labels[900:])
        and torch.equal(train.cats, data.cats[:900])
    )
    tr, te = data.split_random(0.25, seed=1)
    assert len(tr) == 750 and len(te) == 250
    assert torch.equal(te.info["prob"], data.info["prob"][torch.isin(data.info["prob"], te.info["prob"])])
    tr2, _ = data.split_random(0.25, seed=1)
    assert torch.equal(tr.cats, tr2.cats)
    with pytest.raises(ValueError, match="fraction"):
        data.split_random(1.5)
    sizes = [len(b[2]) for b in data.batches(300, seed=0)]
    assert (
        sizes == [300, 300, 300, 100] and [len(b[2]) for b in data.batches(300, drop_last=True)] == [300] * 3
    )


def test_vocabulary_is_restricted_to_the_training_split():
    from ecru.ctr.data import CTRData, restrict_vocabulary_to_train

    def data(ids):
        cats = torch.tensor(ids, dtype=torch.int32)[:, None]
        return CTRData(torch.zeros(len(ids), 1), cats, torch.zeros(len(ids)), (6,))

    # id 1: twice in train; id 2: once in train, once in test; id 3: only in test; id 5: once in train
    train, test = data([1, 1, 2, 5, 0]), data([2, 3, 1, 4])
    tr, te = restrict_vocabulary_to_train(train, test, min_count=2)
    assert tr.cats[:, 0].tolist() == [1, 1, 0, 0, 0]
    assert te.cats[:, 0].tolist() == [0, 0, 1, 0]
    tr1, te1 = restrict_vocabulary_to_train(train, test, min_count=1)
    assert tr1.cats[:, 0].tolist() == [1, 1, 2, 5, 0] and te1.cats[:, 0].tolist() == [2, 0, 1, 0]
    assert train.cats[:, 0].tolist() == [1, 1, 2, 5, 0]  # inputs untouched


def test_gzip_file_reads_like_the_plain_one(tmp_path, criteo_file):
    import gzip

    gz = tmp_path / "day_0.tsv.gz"
    gz.write_bytes(gzip.compress(criteo_file.read_bytes()))
    plain, _ = load_ctr_file(criteo_file, "criteo", cfg=ReaderConfig(skip_malformed=True))
    packed, skipped = load_ctr_file(gz, "criteo", cfg=ReaderConfig(skip_malformed=True))
    assert skipped == 4 and torch.equal(packed.cats, plain.cats) and torch.equal(packed.dense, plain.dense)


def test_a_malformed_first_line_does_not_decide_the_layout(tmp_path):
    path = tmp_path / "first_bad.tsv"
    path.write_text(BAD[1] + GOOD[0] + GOOD[1])
    with pytest.raises(MalformedLineError, match=r"first_bad\.tsv:1: .*expected 40"):
        load_ctr_file(path, "criteo")
    data, skipped = load_ctr_file(path, "criteo", cfg=ReaderConfig(skip_malformed=True))
    assert skipped == 1 and data.labels.tolist() == [1.0, 0.0]
    (tmp_path / "junk.tsv").write_text("a,b\n")
    with pytest.raises(MalformedLineError, match="no line among"):
        load_ctr_file(tmp_path / "junk.tsv", "criteo")
