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


SLIDING, FULL = "sliding_attention", "full_attention"
FAMILIES = {  # model class prefix, extra config: each family's quirks switched on and made to bite
    "qwen2": ("Qwen2", {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1}),
    "mistral": ("Mistral", {"sliding_window": 4}),
    "phi3": ("Phi3", {"sliding_window": 5}),
    "qwen3": ("Qwen3", {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 2}),
    "olmo": ("Olmo", {"clip_qkv": 0.5}),
    "olmo2": ("Olmo2", {}),
    # Gemma 2: scaled embeddings, soft-capped attention and final logits, alternating sliding/full layers
    "gemma2": (
        "Gemma2",
        {
            "head_dim": 8,
            "query_pre_attn_scalar": 8,
            "sliding_window": 4,
            "final_logit_softcapping": 0.5,
            "attn_logit_softcapping": 2.0,
            "layer_types": (SLIDING, FULL),
            "attn": "eager",
        },
    ),  # fmt: skip
    # Gemma 3 (text): rotary embeddings per layer type, q/k norms, sliding/full layers
    "gemma3": (
        "Gemma3Text",
        {
            "head_dim": 8,
            "query_pre_attn_scalar": 8,
            "sliding_window": 4,
            "layer_types": (SLIDING, SLIDING, FULL),
        },
    ),  # fmt: skip
    "cohere": ("Cohere", {"logit_scale": 0.5, "use_qk_norm": False}),
    "granite": (
        "Granite",
        {
            "logits_scaling": 4.0,
            "embedding_multiplier": 3.0,
            "residual_multiplier": 0.5,
            "attention_multiplier": 0.3,
        },
    ),  # fmt: skip
    "stablelm": ("StableLm", {"partial_rotary_factor": 0.5, "use_qkv_bias": True, "qk_layernorm": True}),
}


def tiny_family(name: str, *, num_layers: int = 3, seed: int = 0, tie: bool = False, **extra) -> nn.Module:
    """A random tiny `<Family>ForCausalLM` in fp32 (sdpa attention where the family has it), with its family's quirks switched on."""
    import transformers

    prefix, quirks = FAMILIES[name]
    quirks = dict(quirks)
    attn = quirks.pop("attn", "sdpa")  # Gemma 2's soft-capped attention has no sdpa path
    if "layer_types" in quirks:  # the pattern repeated over the layers
        pattern = quirks["layer_types"]
        quirks["layer_types"] = [pattern[i % len(pattern)] for i in range(num_layers)]
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
    config._attn_implementation = attn
    torch.manual_seed(seed)
    cls = "Gemma3ForCausalLM" if prefix == "Gemma3Text" else f"{prefix}ForCausalLM"
    return getattr(transformers, cls)(config).eval()
