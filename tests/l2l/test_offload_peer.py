"""bench/l2l_offload_peer.py at a tiny size: ecru's disk tier and accelerate's disk offload both give the
plain model's loss on the same folder and batch."""

import pytest
import torch

from tests.bench_scripts import load_bench_script

TINY = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 128,
    "max_position_embeddings": 64,
    "tie_word_embeddings": True,
}


@pytest.fixture(scope="module")
def peer():
    return load_bench_script("l2l_offload_peer")


def test_both_arms_match_the_plain_model(peer, tmp_path):
    from transformers import AutoModelForCausalLM

    folder = peer.build_folder(tmp_path / "model", layers=3, shape=TINY)
    batch = peer.batch_of(TINY["vocab_size"], sequences=3, tokens=16)
    plain = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        want = float(plain(**batch).loss)
    got_ecru, *_ = peer.ecru_loss(folder, batch, tmp_path)
    # a 0.05 MiB budget: the embeddings fit, the blocks go to disk
    got_acc, *_ = peer.accelerate_loss(folder, batch, tmp_path, max_memory_mb=0.05)
    assert got_ecru == pytest.approx(want, rel=1e-5, abs=1e-6)
    assert got_acc == pytest.approx(want, rel=1e-5, abs=1e-6)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]  # the store and the offload are removed


def test_summary_takes_medians_and_the_loss_difference(peer):
    runs = [
        {
            "arm": "accelerate",
            "loss": 1.0,
            "load_s": 2.0,
            "eval_s": 10.0,
            "peak_rss_mb": 400.0,
            "peak_anon_rss_mb": 40.0,
        },
        {
            "arm": "ecru",
            "loss": 1.0 + 1e-6,
            "load_s": 4.0,
            "eval_s": 5.0,
            "peak_rss_mb": 200.0,
            "peak_anon_rss_mb": 20.0,
        },
        {
            "arm": "ecru",
            "loss": 1.0 + 1e-6,
            "load_s": 6.0,
            "eval_s": 7.0,
            "peak_rss_mb": 300.0,
            "peak_anon_rss_mb": 30.0,
        },
        {
            "arm": "accelerate",
            "loss": 1.0,
            "load_s": 4.0,
            "eval_s": 12.0,
            "peak_rss_mb": 600.0,
            "peak_anon_rss_mb": 60.0,
        },
    ]
    s = peer.summarize(runs, folder_bytes=3 * 2**20, max_memory_mb=1)
    assert s["median"]["ecru"] == {
        "load_s": 5.0,
        "eval_s": 6.0,
        "peak_rss_mb": 250.0,
        "peak_anon_rss_mb": 25.0,
    }
    assert s["ecru_over_accelerate"]["eval_s"] == pytest.approx(6.0 / 11.0)
    assert s["loss_max_abs_diff"] == pytest.approx(1e-6) and s["folder_over_budget"] == pytest.approx(3.0)


def test_peak_memory_counts_an_allocation(peer):
    memory = peer.PeakMemory()
    block = torch.ones(64 * 2**20)  # 256 MiB of this process's own memory
    got = memory.stop()
    assert got["peak_anon_rss_mb"] >= 256 and got["peak_rss_mb"] >= got["peak_anon_rss_mb"] - 1
    del block
