from ecru.datasets import humanize_intent, load_banking77, load_clinc, load_clinc_domains, load_wiki_sentences


def test_clinc_splits_and_counts():
    data = load_clinc()
    assert [len(data[s]) for s in ("train", "val", "test")] == [15_000, 3_000, 4_500]
    assert [len(data[s]) for s in ("oos_train", "oos_val", "oos_test")] == [100, 100, 1_000]
    assert len(data.labels) == len(set(data.labels)) == 150
    assert len(data.domains) == 10 and all(len(v) == 15 for v in data.domains.values())
    assert {e.label for e in data["train"]} == set(data.labels)
    # every in-scope example knows its domain; out-of-scope ones have none
    assert all(e.domain in data.domains and e.label in data.domains[e.domain] for e in data["test"])
    assert all(e.label == "oos" and e.domain is None for e in data["oos_test"])
    counts = {}
    for e in data["test"]:
        counts[e.label] = counts.get(e.label, 0) + 1
    assert set(counts.values()) == {30}


def test_clinc_domains_and_wiki():
    domains = load_clinc_domains()
    assert "banking" in domains and "freeze_account" in domains["banking"]
    assert len(load_wiki_sentences()) == 14_750


def test_banking77_splits_and_counts():
    data = load_banking77()
    assert len(data["train"]) == 10_003 and len(data["test"]) == 3_080
    assert len(data.labels) == 77
    assert {e.label for e in data["test"]} == set(data.labels)
    assert data.label_index()[data.labels[5]] == 5


def test_unknown_split_names_the_choices():
    import pytest

    with pytest.raises(KeyError, match="available"):
        load_banking77()["validation"]


def test_humanize_intent():
    assert humanize_intent("freeze_account") == "freeze account"
