"""The README usage snippet of the L2L pillar, kept runnable."""


def test_readme_snippet():
    import functools

    import torch

    from ecru.l2l import L2L, L2LConfig
    from ecru.models import tiny_llama

    model = tiny_llama(num_layers=4)
    engine = L2L.from_hf(model, optimizer=functools.partial(torch.optim.AdamW, lr=1e-2),
                         config=L2LConfig(micro_batch_size=2, stash="host"))
    ids = torch.randint(3, 128, (6, 16))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    losses = [engine.step(batch) for _ in range(5)]
    assert losses[-1] < losses[0]
    model.load_state_dict(engine.state_dict(), strict=True)
