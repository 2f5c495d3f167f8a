"""Bundled prompt sources: "mixed" interleaves the CLINC150 and Banking77 queries of a split."""

from ecru.serve.prompts import _bundled, load_prompts


def test_mixed_interleaves_clinc_and_banking_and_samples_are_fixed():
    clinc, banking, mixed = (_bundled(name, "test") for name in ("clinc", "banking", "mixed"))
    assert mixed[:4] == [clinc[0], banking[0], clinc[1], banking[1]]
    assert len(mixed) == 2 * min(len(clinc), len(banking)) and len(banking) < len(clinc)
    assert (
        load_prompts("mixed", n=5, seed=1) == load_prompts("mixed", n=5, seed=1) != load_prompts("mixed", n=5)
    )
    assert set(load_prompts("banking", n=50, split="train")) <= set(_bundled("banking", "train"))
