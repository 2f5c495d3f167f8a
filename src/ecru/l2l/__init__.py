"""Layer-to-layer training (L2L, Pudipeddi et al. 2020): a model larger than device memory trains from
an eager parameter server on the host, one block at a time across all micro-batches.

The public names load on first use (PEP 562): `ecru --help` imports `ecru.l2l.cli`, and that must not
import torch.
"""

from __future__ import annotations

from ecru.plugins import lazy_exports

_EXPORTS = {
    "ecru.l2l.config": ("L2LConfig", "L2LInputError"),
    "ecru.l2l.engine": ("L2L",),
    "ecru.l2l.plan": ("PlanConfig", "StepPlan", "step_plan"),
    "ecru.l2l.store": ("ParameterStore", "Store"),
}
__getattr__, __dir__, __all__ = lazy_exports(__name__, _EXPORTS)
