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
    takeaway, shortfall = demo._sentences(results(84.9, 84.4, -1.9))
    assert "Last 84.9, +0.5 points over a training-free nearest class mean (84.4" in takeaway
    assert "frozen model itself -1.7" in takeaway
    assert "lead over a nearest class mean does not hold in this run (+0.5 < +1 points)" in shortfall
    assert "Banking77 accuracy changes by -1.9 points (the frozen model -1.9)" in shortfall


def test_no_shortfall_when_the_targets_hold():
    assert demo._sentences(results(90.0, 84.4, -0.5))[1] == ""


def test_answers_abstain_below_the_stores_claim_z_and_answer_otherwise():
    import torch

    from ecru.lifelong.store import CLAIM_Z, UNCLAIMED

    class Encoder:
        def probabilities(self, texts, names):
            return torch.tensor([[0.1, 0.9], [0.6, 0.4]])

        def claim_scores(self, texts):
            return torch.tensor([0.2, -CLAIM_Z - 0.01])

    method = SimpleNamespace(names=[["freeze account"], ["routing"]], encoder=Encoder)
    task = SimpleNamespace(test=[SimpleNamespace(text="block my card")])
    exp = SimpleNamespace(evaluator=SimpleNamespace(stream=SimpleNamespace(tasks=[task])))
    first, asked = demo._answers(method, exp)
    assert first == "'block my card' -> routing (probability 0.90)"
    assert asked.startswith(f"{demo.ASKED[0]!r} -> abstains: {UNCLAIMED} (claim score -2.01 < -2.0)")
