"""CTR prediction: DeepFM / Wide&Deep / DCN / DCN-v2 (with multi-hot fields), columnar Criteo, Avazu and
own-table (CSV/TSV/Parquet with a schema) readers, a synthetic data set with a known optimum, a training loop with CowClip and large-batch scaling
rules, and model folders (`save_model` / `load_model`) that score new files.

The public names load lazily (PEP 562), so `ecru --help`, which imports `ecru.ctr.cli`, does not import torch.
"""

from __future__ import annotations

from ecru.plugins import lazy_exports

_EXPORTS = {
    "ecru.ctr.data": ("CTRData",),
    "ecru.ctr.reader": ("MalformedLineError", "ReaderConfig", "load_ctr_file", "read_ctr_file"),
    "ecru.ctr.tokens": ("Encoder", "HashingEncoder", "VocabularyEncoder"),
    "ecru.ctr.schema": ("TableSchema", "load_schema", "predict_table", "propose_schema"),
    "ecru.ctr.metrics": ("auc", "group_auc", "logloss"),
    "ecru.ctr.model_dir": ("CTRPredictor", "load_model", "save_model"),
    "ecru.ctr.models": (
        "MODELS",
        "DCN",
        "CTRConfig",
        "CTRModel",
        "DCNv2",
        "DeepFM",
        "WideDeep",
        "build_model",
    ),
    "ecru.ctr.synthetic": (
        "SyntheticConfig",
        "expected_oracle",
        "generate",
        "oracle_summary",
        "write_criteo_tsv",
    ),
    "ecru.ctr.training": ("TrainConfig", "TrainResult", "evaluate", "predict_probs", "train"),
}
__getattr__, __dir__, __all__ = lazy_exports(__name__, _EXPORTS)
