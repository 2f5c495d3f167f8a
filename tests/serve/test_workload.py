from collections import Counter

import pytest

from ecru.serve.workload import FORMS, HELD_OUT_FORMS, QUERY_FORMS, WorkloadConfig, build_mixed_workload


@pytest.fixture(scope="module")
def workload():
    return build_mixed_workload(WorkloadConfig(n_train=1600, n_test=600))


def test_sizes_and_forms(workload):
    train, test = workload["train"], workload["test"]
    assert len(train) == 1600 and len(test) == 600
    assert not {p.form for p in train} & set(HELD_OUT_FORMS)
    assert Counter(p.form for p in test).keys() == FORMS.keys()
    assert {p.source for p in train} == {"wiki", "clinc", "banking"}
    assert all(p.source != "wiki" for p in train + test if p.form in QUERY_FORMS)


def test_test_prompts_are_unseen(workload):
    train_prompts = {p.prompt for p in workload["train"]}
    assert not train_prompts & {p.prompt for p in workload["test"]}
    train_texts = " ".join(p.prompt for p in workload["train"])
    # no test prompt's source text occurs in any training prompt
    leaked = [p for p in workload["test"] if p.prompt.split(": ", 1)[-1] in train_texts]
    assert len(leaked) <= 3  # a few very short queries can recur verbatim in the data sets themselves
    assert len({p.id for p in workload["train"] + workload["test"]}) == 2200


def test_deterministic_and_validated():
    a = build_mixed_workload(WorkloadConfig(n_train=20, n_test=20, seed=3))
    b = build_mixed_workload(WorkloadConfig(n_train=20, n_test=20, seed=3))
    assert a == b
    with pytest.raises(ValueError):
        WorkloadConfig(n_test=2)
