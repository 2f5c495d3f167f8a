"""The README usage snippet of the L2L pillar, kept runnable."""


def test_readme_snippet():
    import functools

    import torch

    from ecru.l2l import L2L, L2LConfig
    from ecru.models import tiny_llama

    model = tiny_llama(num_layers=4)
    engine = L2L.from_hf(
        model,
        optimizer=functools.partial(torch.optim.AdamW, lr=1e-2),
        config=L2LConfig(micro_batch_size=2, stash="host"),
    )
    ids = torch.randint(3, 128, (6, 16))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    losses = [engine.step(batch) for _ in range(5)]
    assert losses[-1] < losses[0]
    model.load_state_dict(engine.state_dict(), strict=True)


def test_readme_snippet_disk_tier_and_layer_drop(tmp_path):
    import functools

    import torch
    from torch import nn

    from ecru.l2l import L2L, L2LConfig

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(6)], nn.Linear(16, 1))
    config = L2LConfig(micro_batch_size=4, store="disk", store_dir=str(tmp_path))  # blocks live on disk
    engine = L2L.from_sequential(
        model,
        loss_fn=nn.MSELoss(),
        config=config,
        optimizer=functools.partial(torch.optim.AdamW, lr=1e-2, fused=True),
    )
    x, y = torch.randn(16, 16), torch.randn(16, 1)
    losses = [engine.step((x, y), blocks=[0, 2, 4, 5, 6] if s % 2 else None) for s in range(10)]  # layer drop
    engine.close()
    assert losses[-1] < losses[0]


def test_readme_snippet_any_decoder_forward_and_export(tmp_path):
    import functools

    import torch

    from ecru.l2l import L2L, L2LConfig
    from ecru.models import tiny_llama

    adamw = functools.partial(torch.optim.AdamW, lr=1e-2, fused=True)
    engine = L2L.from_hf(tiny_llama(num_layers=4), optimizer=adamw, config=L2LConfig(micro_batch_size=2))
    ids = torch.randint(3, 128, (6, 16))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    losses = [engine.step(batch) for _ in range(5)]
    print(f"train {losses[0]:.3f} -> {losses[-1]:.3f}, eval {engine.forward(batch).loss:.3f}")
    engine.save_pretrained(tmp_path / "hf")
    assert losses[-1] < losses[0] and (tmp_path / "hf" / "config.json").is_file()
