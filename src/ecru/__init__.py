"""ecru: Enhancing Computational Resource Utilization for large neural networks on PyTorch.

Subpackages: `l2l` (layer-to-layer training), `cowclip` and `ctr` (large-batch CTR training), `serve`
(sequence scheduling for LLM inference), `lifelong` (continual knowledge injection), `models` and
`datasets` (bundled real assets). Importing ecru loads nothing heavy and touches no device.
"""

__version__ = "0.1.0"
__all__ = ["__version__"]
