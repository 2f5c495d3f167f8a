"""Layer-to-layer training (L2L, Pudipeddi et al. 2020): a model larger than device memory trains from
an eager parameter server on the host, one block at a time across all micro-batches."""

from ecru.l2l.config import L2LConfig, L2LInputError
from ecru.l2l.engine import L2L
from ecru.l2l.store import ParameterStore

__all__ = ["L2L", "L2LConfig", "L2LInputError", "ParameterStore"]
