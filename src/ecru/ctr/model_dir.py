"""A trained CTR model as a self-contained folder, and scoring new rows with it.

    DIR/model.safetensors   the weights (`model.state_dict()`)
    DIR/vocab.safetensors   per field the sorted token keys and their ids (vocabulary mode only)
    DIR/config.json         what rebuilds the model and reads new files: model name, CTRConfig, data format,
                            encoder (vocabulary or hashing settings), training settings, data content hash
    DIR/metrics.json        held-out metrics of the run (written by the CLI)
    DIR/schema.json         a table's schema (models trained on `table:FILE`)
    DIR/manifest.json       sha256 and size of the files above (ecru.io), written last: the commit point
    DIR/checkpoint.safetensors  the training checkpoint (model + optimizer state, every epoch; `--resume`)

Each file is written atomically (ecru.io), the manifest last; loading checks every file against it, so a
truncated, damaged or changed file is refused in one line. config.json and the safetensors files also carry
the same random `generation` string (folders of version 1, written before manifests, are checked by it
alone), so a folder caught between two saves is refused instead of mixing two models.
"""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from ecru.ctr.data import CTRData
from ecru.ctr.models import CTRConfig, CTRModel, build_model
from ecru.ctr.reader import (
    FORMATS,
    ReaderConfig,
    _is_parquet,
    load_ctr_file,
    malformed_lines,
    sniff_layout,
    with_blank_lines,
)
from ecru.ctr.tokens import Encoder, load_encoder
from ecru.errors import EcruError, MissingAssetError
from ecru.io import (
    atomic_write_json,
    load_tensors,
    save_tensors,
    verify_manifest,
    write_manifest,
)

FOLDER_FORMAT, FOLDER_VERSION = "ecru-ctr-model", 2
_RETRAIN = "train again with --out"


def file_digest(path: str | os.PathLike[str]) -> str:
    """The content hash (BLAKE2b, 128 bits, hex) of a file's bytes."""
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        while chunk := f.read(1 << 23):
            h.update(chunk)
    return h.hexdigest()


def save_model(
    out: str | os.PathLike[str],
    model: CTRModel,
    encoder: Encoder | None,
    *,
    name: str,
    data_format: str,
    extra: dict,
    schema: dict | None = None,
) -> Path:
    """Write `model` (built as `name`), `encoder` and a table's `schema` into the folder `out` (see the
    module docstring).

    `encoder` None: the model was trained on ids without tokens (synthetic data); it cannot score files.
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    generation = uuid.uuid4().hex
    files = ["model.safetensors", "config.json"]
    save_tensors(out / "model.safetensors", model.state_dict(), {"generation": generation})
    state = encoder.state() if encoder else {}
    vocab = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in state.items()}
    if vocab:
        save_tensors(out / "vocab.safetensors", vocab, {"generation": generation})
        files.append("vocab.safetensors")
    if schema is not None:
        atomic_write_json(out / "schema.json", schema)
        files.append("schema.json")
    config = {
        "format": FOLDER_FORMAT,
        "version": FOLDER_VERSION,
        "generation": generation,
        "model": name,
        "ctr_config": {**asdict(model.cfg), "sparse": False},
        "data_format": data_format,
        "encoder": encoder.settings() if encoder else None,
        "dense_transform": "log(1 + max(x, 0)), empty -> 0",
        **extra,
    }
    atomic_write_json(out / "config.json", config)
    write_manifest(out, files)
    return out


def _load_tensors(path: Path, generation: str) -> dict[str, Tensor]:
    if not path.is_file():
        raise MissingAssetError(f"{path} is missing; the model folder is incomplete ({_RETRAIN})")
    tensors, metadata = load_tensors(path, hint=_RETRAIN)
    if metadata.get("generation") != generation:
        raise EcruError(
            f"{path} does not belong to {path.parent / 'config.json'} (a save was interrupted); {_RETRAIN}"
        )
    return tensors


@dataclass
class CTRPredictor:
    """A loaded model folder: the model, the token encoder, and the file format it reads."""

    model: CTRModel
    encoder: Encoder | None
    """None for a model trained on synthetic ids (it scores encoded `CTRData` only)."""
    data_format: str
    config: dict

    @torch.no_grad()
    def predict_data(self, data: CTRData, *, batch_size: int = 65536) -> Tensor:
        """Click probabilities [N] (float32) of encoded rows, in order."""
        self.model.eval()
        device = next(self.model.parameters()).device
        out = [
            torch.sigmoid(self.model(d.to(device), c.to(device))).float().cpu()
            for d, c, _ in data.batches(batch_size)
        ]
        return torch.cat(out) if out else torch.zeros(0)

    def read(self, path: str | os.PathLike[str], *, skip_malformed: bool = False) -> CTRData:
        """A file of the model's format (with or without the label column), encoded with the saved tokens;
        malformed lines raise an error naming file and line, or are skipped (`data.info["skipped_lines"]`)."""
        if self.encoder is None:
            raise EcruError(
                "this model was trained on synthetic ids, which have no tokens; to score files, train on "
                "criteo:FILE (e.g. one written by `ecru ctr synth`)"
            )
        cfg = ReaderConfig(skip_malformed=skip_malformed)
        data, _ = load_ctr_file(path, self.data_format, cfg=cfg, encoder=self.encoder)
        return data

    def predict(
        self, path: str | os.PathLike[str], *, batch_size: int = 65536, skip_malformed: bool = False
    ) -> Tensor:
        """One click probability per row of the file, in file order (unseen tokens -> the OOV row); with
        `skip_malformed`, NaN for each malformed line."""
        return self.predict_file(path, batch_size=batch_size, skip_malformed=skip_malformed)[0]

    def predict_file(
        self, path: str | os.PathLike[str], *, batch_size: int = 65536, skip_malformed: bool = False
    ) -> tuple[Tensor, Tensor]:
        """(probabilities, labels), one per line of the file (after a header), in order; NaN where a line is
        blank or malformed (with `skip_malformed`), labels NaN if the file has none."""
        data = self.read(path, skip_malformed=skip_malformed)
        probs = self.predict_data(data, batch_size=batch_size)
        skipped = data.info.get("skipped_lines", 0)
        header = self.data_format != "criteo"
        return line_aligned(probs, data.labels, Path(path), self.data_format, skipped, header=header)


def line_aligned(
    probs: Tensor, labels: Tensor, path: Path, layout, skipped: int, *, header: bool
) -> tuple[Tensor, Tensor]:
    """Scores and labels of the rows read, as one value per line of the file (after a header): NaN at a
    skipped malformed line and, in a text file, at a blank one. `layout`: a format name or a TableSchema."""
    if skipped:
        rows = _aligned_rows(path, layout, len(probs), skipped)
        full_p = torch.full((len(probs) + skipped,), float("nan"))
        full_y = full_p.clone()
        full_p[rows], full_y[rows] = probs, labels
        probs, labels = full_p, full_y
    if _is_parquet(path):
        return probs, labels
    return with_blank_lines(probs, path, header=header), with_blank_lines(labels, path, header=header)


def _aligned_rows(path: Path, fmt: str, n_good: int, skipped: int) -> Tensor:
    """Positions of the well-formed rows among all data lines (the line parser finds the malformed ones)."""
    labelled = sniff_layout(path, fmt).label is not None
    bad = [row for row, _, _ in malformed_lines(path, fmt, labelled=labelled)]
    if len(bad) != skipped:
        raise EcruError(
            f"{path}: the columnar reader skipped {skipped} line(s) but the line check finds {len(bad)}; "
            "cannot align the scores with the lines (fix the malformed lines)"
        )
    keep = torch.ones(n_good + skipped, dtype=torch.bool)
    keep[bad] = False
    return keep.nonzero().squeeze(1)


def _read_config(folder: Path) -> dict:
    path = folder / "config.json"
    if not folder.is_dir():
        raise MissingAssetError(f"model folder {folder} not found; give the --out folder of `ecru ctr train`")
    if not path.is_file():
        raise MissingAssetError(
            f"{folder} holds no config.json; it is not a finished `ecru ctr train --out` folder"
        )
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise EcruError(f"{path} is unreadable ({exc}); train again with --out") from None
    if not isinstance(config, dict) or config.get("format") != FOLDER_FORMAT:
        raise EcruError(f"{path} is not an ecru CTR model config")
    if config.get("version") not in (1, FOLDER_VERSION) or config.get("data_format") not in FORMATS:
        raise EcruError(f"{path}: unsupported version {config.get('version')} or data format")
    return config


OPTIONAL_FILES = ("vocab.safetensors", "schema.json")
"""Written only by some models (vocabulary encoders; tables): verified whenever present."""


def load_model(folder: str | os.PathLike[str], *, device: str = "cpu") -> CTRPredictor:
    """Load a folder written by `save_model` (`ecru ctr train --out DIR`)."""
    folder = Path(folder).expanduser()
    config = _read_config(folder)
    if config["version"] >= 2:  # every file as written; version 1 folders predate manifests
        loaded = {"config.json", "model.safetensors"} | {f for f in OPTIONAL_FILES if (folder / f).exists()}
        verify_manifest(folder, must_list=loaded)  # a manifest that omits a file read here is refused
    generation = config["generation"]
    weights = _load_tensors(folder / "model.safetensors", generation)
    try:
        cfg = config["ctr_config"]
        ctr = CTRConfig(**{**cfg, "cardinalities": tuple(cfg["cardinalities"]), "mlp": tuple(cfg["mlp"])})
        model = build_model(config["model"], ctr)
        model.load_state_dict(weights)
    except (KeyError, TypeError, ValueError, RuntimeError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        raise EcruError(
            f"{folder / 'model.safetensors'} does not fit its config ({first}); train again"
        ) from None
    enc, encoder = config["encoder"], None
    if enc:
        vocab = (
            _load_tensors(folder / "vocab.safetensors", generation) if enc.get("kind") == "vocabulary" else {}
        )
        try:
            encoder = load_encoder(enc, {k: v.numpy() for k, v in vocab.items()})
        except (KeyError, ValueError) as exc:
            raise EcruError(f"{folder}: the saved token encoder is unreadable ({exc})") from None
    return CTRPredictor(model.to(device).eval(), encoder, config["data_format"], config)
