"""The serving demo's numbers and sentences come from its runs (the runs themselves: `ecru demo --only serve`)."""

import pytest

from ecru.serve.entrypoints import demo


def _run(mean: float, p99: float, outputs: list[list[int]]) -> dict:
    return {"mean_s": mean, "p99_s": p99, "wall_s": 2 * p99, "outputs": outputs, "preemptions": 1}


def test_summary_takes_medians_over_the_alternating_runs():
    runs = {
        "cb": [_run(10.0, 20.0, [[1], [2, 3]]), _run(12.0, 22.0, [[1], [2, 3]])],
        "cb-srpt": [_run(7.0, 21.0, [[1], [2, 4]]), _run(8.0, 23.0, [[1], [2, 4]])],
    }
    s = demo.summarize(runs)
    assert s["mean_x_cb"] == pytest.approx(7.5 / 11.0) and s["p99_x_cb"] == pytest.approx(22.0 / 21.0)
    assert (s["cb_mean_s"], s["cb_srpt_mean_s"], s["requests"], s["same_answers"]) == (11.0, 7.5, 2, 1)
    assert s["preemptions"] == 2  # cb-srpt's two runs


def test_the_sentences_say_what_was_measured_and_when_the_gain_does_not_hold():
    shown = {"mean_x_cb": 0.71, "p99_x_cb": 1.04, "cb_mean_s": 30.0, "cb_srpt_mean_s": 21.3, "requests": 48,
             "same_answers": 47, "preemptions": 3}  # fmt: skip
    assert "0.71x cb's mean latency and 1.04x its p99" in demo._takeaway(shown)
    assert "47 of 48 answers" in demo._takeaway(shown) and "3 rows swapped out" in demo._takeaway(shown)
    assert demo._shortfall(shown) == ""
    flat = {**shown, "mean_x_cb": 0.97}
    assert "does not hold" in demo._shortfall(flat) and "0.97x" in demo._shortfall(flat)


def test_the_demo_reads_committed_workload_files():
    assert demo.TRAIN_LABELS.is_file() and demo.TRAIN_ANSWERS.is_file() and demo.TEST_LABELS.is_file()
    assert len(demo._rows(demo.TEST_LABELS)) >= demo.N_REQUESTS
    assert len(demo._rows(demo.TRAIN_ANSWERS)) >= demo.PROBE_ANSWERS
