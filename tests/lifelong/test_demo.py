"""The lifelong demo's sentences are computed from the run, and say what falls short."""

from types import SimpleNamespace

from ecru.lifelong import demo


def results(ours_last, ncm_last, ours_heldout):
    def r(last, transfer, heldout):
        return SimpleNamespace(agnostic={"last": last, "avg": last, "transfer_retention": transfer,
                                         "heldout_change": heldout})  # fmt: skip

    return {"zeroshot": r(70, -1.7, -1.9), "seqft": r(76, -2.2, -1.3), "ncm": r(ncm_last, -3.9, -4.5),
            "routed-lora": r(ours_last, -1.1, ours_heldout)}  # fmt: skip


def test_sentences_report_the_shortfalls():
    takeaway, shortfall = demo._sentences(results(85.9, 84.4, -1.9))
    assert "Last 85.9 (nearest class mean 84.4" in takeaway and "frozen model itself -1.7" in takeaway
    assert "lead over a training-free nearest class mean is +1.5" in shortfall
    assert "Banking77 accuracy changes by -1.9 points (the frozen model -1.9)" in shortfall


def test_no_shortfall_when_the_targets_hold():
    assert demo._sentences(results(90.0, 84.4, -0.5))[1] == ""
