"""CTR prediction: DeepFM / Wide&Deep / DCN / DCN-v2, Criteo and Avazu readers, a synthetic data set with
a known optimum, and a training loop with CowClip and large-batch scaling recipes."""

from ecru.ctr.data import CTRData, Encoder, MalformedLineError, ReaderConfig, load_ctr_file, read_ctr_file
from ecru.ctr.metrics import auc, logloss
from ecru.ctr.models import DCN, MODELS, CTRConfig, CTRModel, DCNv2, DeepFM, WideDeep, build_model
from ecru.ctr.synthetic import SyntheticConfig, expected_oracle, generate, oracle_summary, write_criteo_tsv
from ecru.ctr.train import TrainConfig, TrainResult, evaluate, train

__all__ = [
    "DCN",
    "MODELS",
    "CTRConfig",
    "CTRData",
    "CTRModel",
    "DCNv2",
    "DeepFM",
    "Encoder",
    "MalformedLineError",
    "ReaderConfig",
    "SyntheticConfig",
    "TrainConfig",
    "TrainResult",
    "WideDeep",
    "auc",
    "build_model",
    "evaluate",
    "expected_oracle",
    "generate",
    "load_ctr_file",
    "logloss",
    "oracle_summary",
    "read_ctr_file",
    "train",
    "write_criteo_tsv",
]
