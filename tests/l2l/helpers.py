"""Shared fixtures of the L2L tests: padded LM batches, plain-PyTorch reference training, gradient capture."""

from __future__ import annotations

import torch
from torch import nn

# fp32 on one thread: micro-batching only reorders sums, so parity holds to rounding (observed <= 1.2e-8)
PARAM_TOL = {"atol": 1e-7, "rtol": 1e-6}
GRAD_TOL = {"atol": 1e-7, "rtol": 1e-5}


def lm_batch(*, batch: int = 5, time: int = 12, vocab: int = 128, seed: int = 0, lengths=None) -> dict:
    """Right-padded causal-LM batch with uneven lengths: pad id 0, attention 0 and label -100 at padding."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (batch, time), generator=g)
    lengths = torch.tensor(lengths or [time, time - 3, time - 5, time, 4][:batch])
    mask = (torch.arange(time)[None] < lengths[:, None]).long()
    ids = ids * mask
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


class GradRecorder(torch.optim.SGD):
    """SGD that records the exact gradient it is given for each parameter (by identity) before stepping."""

    def __init__(self, params, log: dict[int, torch.Tensor], **kw):
        super().__init__(params, **kw)
        self.log = log

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                self.log[id(p)] = p.grad.clone()
        return super().step(closure)


def named_grads(model: nn.Module, log: dict[int, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: log[id(p)] for name, p in model.named_parameters()}


def reference_step(model: nn.Module, opt: torch.optim.Optimizer, batch: dict) -> float:
    """Ordinary training: one full-batch forward and backward, one optimizer step."""
    opt.zero_grad()
    loss = model(**batch).loss
    loss.backward()
    opt.step()
    return loss.item()


def assert_params_close(ref: nn.Module, got: dict[str, torch.Tensor], **tol) -> None:
    ref_state = ref.state_dict()
    assert ref_state.keys() == got.keys()
    for name, value in ref_state.items():
        torch.testing.assert_close(got[name], value, msg=lambda m, n=name: f"{n}: {m}", **(tol or PARAM_TOL))


FAMILIES = {  # model class, extra config: sliding windows of 4 tokens where the family has them
    "qwen2": ("Qwen2", {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1}),
    "mistral": ("Mistral", {"sliding_window": 4}),
    "phi3": ("Phi3", {"sliding_window": 5}),
    "qwen3": ("Qwen3", {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 2}),
    "olmo": ("Olmo", {"clip_qkv": 0.5}),
}


def tiny_family(name: str, *, num_layers: int = 3, seed: int = 0, tie: bool = False, **extra) -> nn.Module:
    """A random tiny `<Family>ForCausalLM` in fp32 (sdpa attention), with its family's quirks switched on."""
    import transformers

    prefix, quirks = FAMILIES[name]
    config = getattr(transformers, f"{prefix}Config")(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=tie,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        **{**quirks, **extra},
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    return getattr(transformers, f"{prefix}ForCausalLM")(config).eval()
