"""Response-length predictors behind one protocol, `predict(prompts) -> lengths`, and their metrics.

- `OraclePredictor`: the recorded true lengths (an upper bound on what scheduling can gain).
- `ConstantPredictor`: one number for every prompt (the baseline a learned predictor must beat).
- `MiniLMPredictor`: a separate proxy, ridge regression on all-MiniLM-L6-v2 sentence embeddings.
- `ProbePredictor`: ridge regression on the LLM's own mean-pooled last hidden state over the prompt; it is
  also a `StatePredictor`, so the serving engine can feed it the states of its own prompt prefill.
- `EmbeddingPredictor`: ridge regression on the mean of the LLM's own input-embedding rows over the prompt's
  tokens: no forward at all, so it predicts inside the engine's `add_request` for a lookup and a dot product.
- `SelfLoRAPredictor` (in `self_predict.py`): the LLM itself, LoRA-tuned to print its answer's length.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Protocol, Self

import torch

from ecru.models.minilm import mean_pool

LENGTH_FILE = "length_predictor.safetensors"


class LengthPredictor(Protocol):
    """Predicts the response length (tokens) of each raw user prompt."""

    name: str

    def predict(self, prompts: Sequence[str]) -> list[float]: ...


class StatePredictor(Protocol):
    """Predicts response lengths from hidden states the serving engine already computed."""

    def predict_states(self, pooled: torch.Tensor) -> list[float]:
        """`pooled` [B, H]: each prompt's last hidden state (after the final norm), mean over its real
        positions. Returns one length per row, clamped to [1, cap]."""
        ...


def timed_predict(predictor: LengthPredictor, prompts: Sequence[str]) -> tuple[list[float], float]:
    """Predictions and the wall seconds they took (counted in the throughput of the policies using them)."""
    start = time.perf_counter()
    lengths = predictor.predict(prompts)
    return list(lengths), time.perf_counter() - start


def length_metrics(predicted: Sequence[float], true: Sequence[float]) -> dict[str, float]:
    """MAE (tokens), Acc-50 and Acc-100 (share of predictions within 50 / 100 tokens)."""
    err = (torch.as_tensor(predicted, dtype=torch.float64) - torch.as_tensor(true, dtype=torch.float64)).abs()
    return {
        "mae": err.mean().item(),
        "acc50": (err <= 50).double().mean().item(),
        "acc100": (err <= 100).double().mean().item(),
    }


def spearman(a: Sequence[float], b: Sequence[float]) -> float | None:
    """Rank correlation with ties averaged; None where one side is constant (a constant predictor)."""
    from scipy.stats import spearmanr

    if len(set(a)) < 2 or len(set(b)) < 2:
        return None
    return float(spearmanr(a, b).statistic)


def ridge_fit(x: torch.Tensor, y: torch.Tensor, *, lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Weights and bias of ridge regression y ~ x w + b on centred features (closed form)."""
    mu, ybar = x.mean(0), y.mean()
    xc = (x - mu).double()
    gram = xc.T @ xc + lam * torch.eye(x.shape[1], dtype=torch.float64)
    w = torch.linalg.solve(gram, xc.T @ (y.double() - ybar))
    return w.float(), (ybar - mu.double() @ w).float()


class OraclePredictor:
    """The recorded true length of each prompt."""

    name = "oracle"

    def __init__(self, lengths: Mapping[str, float]):
        self.lengths = dict(lengths)

    def predict(self, prompts: Sequence[str]) -> list[float]:
        missing = [p for p in prompts if p not in self.lengths]
        if missing:
            raise KeyError(
                f"the oracle has no recorded length for {len(missing)} prompt(s), e.g. {missing[0]!r}"
            )
        return [float(self.lengths[p]) for p in prompts]


class ConstantPredictor:
    """The same length for every prompt (e.g. the training labels' median)."""

    name = "constant"

    def __init__(self, value: float):
        self.value = float(value)

    def predict(self, prompts: Sequence[str]) -> list[float]:
        return [self.value] * len(prompts)


def ridge_cv(
    x: torch.Tensor, y: torch.Tensor, lams: Sequence[float], *, folds: int = 5, seed: int = 0
) -> dict[float, float | None]:
    """lam -> out-of-fold Spearman of ridge predictions (`folds` folds of one seeded permutation of the
    rows); None where the labels or the predictions are constant (`spearman`)."""
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    scores = {}
    for lam in lams:
        oof = torch.zeros(len(x))
        for f in range(folds):
            held = perm[f::folds]
            kept = torch.ones(len(x), dtype=torch.bool)
            kept[held] = False
            w, b = ridge_fit(x[kept], y[kept], lam=lam)
            oof[held] = x[held] @ w + b
        scores[lam] = spearman(oof.tolist(), y.tolist())
    return scores


def model_key(name: str) -> str:
    """How a fitted predictor names its model: a bundled model's name, or a model folder's resolved path."""
    return str(Path(name).resolve()) if Path(name).exists() else name


def save_ridge(path: Path, w: torch.Tensor, b: torch.Tensor, *, meta_key: str, meta: dict) -> Path:
    """Fitted ridge weights and bias with their JSON metadata under `meta_key`, as one safetensors file
    written atomically."""
    from ecru.io import save_tensors

    return save_tensors(path, {"w": w, "b": b.reshape(1)}, {meta_key: json.dumps(meta)})


def read_ridge(
    path: Path, *, meta_key: str, what: str, numbers: Mapping[str, type]
) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """What `save_ridge` wrote: its metadata's `numbers` (each cast to its type) and "model" (as written),
    the weights and the bias (float32). ValueError, in one line, when the file is missing or is not `what`."""
    from safetensors import SafetensorError, safe_open

    from ecru.io import ChecksumError, verify_manifest

    try:
        verify_manifest(path.parent, [path.name], required=False)  # a folder of `ecru serve probe`
    except ChecksumError as exc:
        raise ValueError(str(exc)) from None
    if not path.is_file():
        raise ValueError(
            f"{path.parent}: no {path.name} in it; fit one with `ecru serve probe --out {path.parent}`"
        )
    try:
        with safe_open(str(path), "pt") as f:
            raw = json.loads(f.metadata()[meta_key])
            meta = {name: _number(raw[name], name, cast) for name, cast in numbers.items()}
            meta["model"] = raw["model"]
            w, b = f.get_tensor("w"), f.get_tensor("b")
        if w.ndim != 1 or b.numel() != 1 or not w.is_floating_point() or not b.is_floating_point():
            raise ValueError(f"weights of shape {tuple(w.shape)} and bias of {b.numel()} values, {w.dtype}")
        if not (torch.isfinite(w).all() and torch.isfinite(b).all()):
            raise ValueError("weights that are not finite")
    except (SafetensorError, OSError, KeyError, TypeError, ValueError, IndexError, OverflowError) as exc:
        raise ValueError(f"{path}: not {what} ({exc})") from None
    return meta, w.float(), b.float().reshape(())


def _number(value, name: str, cast: type) -> int | float:
    """A fitted file's setting: an integer >= 1 (a cap, a stride) or a finite number >= 0 (a penalty)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{name} {value!r}, not a finite number")
    if (cast is int and (value != int(value) or value < 1)) or value < 0:
        raise ValueError(f"{name} {value!r}, out of range")
    return cast(value)


class _RidgeOnFeatures:
    """Ridge regression on features of the prompt; subclasses define `features`. Predictions clamped to [1, cap].
    `lam=None` chooses the penalty among `LAMS` by 5-fold out-of-fold Spearman on the training rows
    (`ridge_cv`; the scores kept in `cv`)."""

    LAMS = (0.1, 0.3, 1.0, 3.0, 10.0)

    def __init__(self, *, lam: float | None = 1.0, cap: int = 256):
        self.lam, self.cap = lam, cap
        self.w: torch.Tensor | None = None
        self.b: torch.Tensor | None = None
        self.cv: dict[float, float | None] = {}

    def features(self, prompts: Sequence[str]) -> torch.Tensor:
        raise NotImplementedError

    def fit(self, prompts: Sequence[str], labels: Sequence[float]) -> Self:
        return self._fit(self.features(prompts), labels)

    def predict(self, prompts: Sequence[str]) -> list[float]:
        return self._regress(self.features(prompts))

    def _fit(self, x: torch.Tensor, labels: Sequence[float]) -> Self:
        y = torch.as_tensor(labels, dtype=torch.float32)
        if self.lam is None:
            self.cv = ridge_cv(x, y, self.LAMS)
            ranked = {lam: float("-inf") if rho is None else rho for lam, rho in self.cv.items()}
            self.lam = max(self.LAMS, key=ranked.__getitem__)  # the first, the smallest, on a tie
        self.w, self.b = ridge_fit(x, y, lam=self.lam)
        return self

    def _regress(self, features: torch.Tensor) -> list[float]:
        if self.w is None:
            raise RuntimeError(f"{type(self).__name__} is not fitted: call fit(prompts, labels) first")
        return (features @ self.w + self.b).clamp(1, self.cap).tolist()


class MiniLMPredictor(_RidgeOnFeatures):
    """A proxy model: ridge regression on all-MiniLM-L6-v2 embeddings of the raw prompt."""

    name = "minilm"
    _encoder = None  # loaded on first use

    def features(self, prompts: Sequence[str]) -> torch.Tensor:
        if self._encoder is None:
            from ecru.models import load_minilm

            self._encoder = load_minilm()
        return self._encoder.encode(list(prompts))


class ProbePredictor(_RidgeOnFeatures):
    """A probe on the LLM itself: mean-pooled last hidden state of the chat-templated prompt, then ridge.

    `predict_states` takes those pooled states directly (`StatePredictor`): an engine that prefills the
    prompt anyway gets the prediction for a dot product (`RequestEngine(..., state_predictor=probe)`)."""

    name = "probe"

    def __init__(self, model, tokenizer, *, lam: float = 10.0, cap: int = 256, batch_size: int = 16):
        super().__init__(lam=lam, cap=cap)
        self.model, self.tokenizer, self.batch_size = model, tokenizer, batch_size

    @torch.no_grad()
    def features(self, prompts: Sequence[str]) -> torch.Tensor:
        from ecru.serve.engine.static import left_pad, positions
        from ecru.serve.prompts import encode_chat

        ids = encode_chat(self.tokenizer, prompts)
        out = []
        for i in range(0, len(ids), self.batch_size):
            x, mask = left_pad(ids[i : i + self.batch_size], self.tokenizer.pad_token_id or 0)
            decoder = self.model.get_decoder()  # the last hidden state without the LM head's logits
            hidden = decoder(input_ids=x, attention_mask=mask, position_ids=positions(mask)).last_hidden_state
            out.append(mean_pool(hidden, mask))
        return torch.cat(out)

    def predict_states(self, pooled: torch.Tensor) -> list[float]:
        return self._regress(pooled)


class EmbeddingPredictor(_RidgeOnFeatures):
    """The LLM's own input embeddings: ridge on the mean of its embedding rows over the prompt's token ids
    as the engine receives them (chat-templated messages, or a raw completion prompt). No forward runs,
    only a lookup and a dot product (0.07 ms a request on SmolLM2, against ~20 ms for a MiniLM forward), so
    the engine can predict inside `add_request`: pass `predict=predictor.engine_predict` to `RequestEngine`
    (or `ServedModel.engine`).

    `lam=None` (the default) chooses the ridge penalty by cross-validation on the training prompts (`cv`).
    `save` / `load` keep a fitted one in a folder (`ecru serve probe` writes it, `ecru serve api/run
    --length-predictor DIR` serve with it)."""

    name = "embed"

    def __init__(self, model, tokenizer, *, lam: float | None = None, cap: int = 256, key: str | None = None):
        super().__init__(lam=lam, cap=cap)
        self.embeddings, self.tokenizer = model.get_input_embeddings(), tokenizer
        self.key = key
        """The name of the model whose embeddings it reads (recorded by `save`, checked by front ends)."""

    def save(self, folder: str | Path) -> Path:
        """Write the fitted weights to `folder`/length_predictor.safetensors (atomically)."""
        if self.w is None:
            raise RuntimeError("EmbeddingPredictor is not fitted: nothing to save")
        meta = {"cap": self.cap, "lam": self.lam, "model": self.key}
        return save_ridge(Path(folder) / LENGTH_FILE, self.w, self.b, meta_key="predictor", meta=meta)

    @classmethod
    def load(cls, folder: str | Path, model, tokenizer) -> EmbeddingPredictor:
        """A predictor written by `save`, reading `model`'s embeddings; ValueError when `folder` holds none
        or its weights do not fit the model's embedding width."""
        meta, w, b = read_length_file(folder)
        out = cls(model, tokenizer, lam=meta["lam"], cap=meta["cap"], key=meta["model"])
        width = out.embeddings.weight.shape[1]
        if len(w) != width:
            raise ValueError(
                f"{Path(folder) / LENGTH_FILE}: it reads embeddings of width {len(w)}, the model's are {width}"
            )
        out.w, out.b = w, b
        return out

    @torch.no_grad()
    def id_features(self, ids: Sequence[Sequence[int]]) -> torch.Tensor:
        table = self.embeddings.weight
        rows = [torch.as_tensor(list(i), dtype=torch.long) for i in ids]
        if any(len(r) == 0 for r in rows):
            raise ValueError("an empty prompt has no tokens to average")
        if any(r.min() < 0 or r.max() >= len(table) for r in rows):
            raise ValueError(f"a token id outside the model's vocabulary of {len(table)}")
        return torch.stack([table[r].float().mean(0) for r in rows])

    def features(self, prompts: Sequence[str]) -> torch.Tensor:
        """Raw user texts, each as one user turn in the model's chat template."""
        from ecru.serve.prompts import encode_chat

        return self.id_features(encode_chat(self.tokenizer, prompts))

    def fit_ids(self, ids: Sequence[Sequence[int]], labels: Sequence[float]) -> Self:
        """Fit on prompts given as the engine will see them: token ids."""
        return self._fit(self.id_features(ids), labels)

    def predict_ids(self, ids: Sequence[Sequence[int]]) -> list[float]:
        return self._regress(self.id_features(ids))

    def engine_predict(self, prompt: Sequence[int], params=None) -> float:
        """`RequestEngine`'s `predict` hook (`PredictLength`): one request's prompt ids -> its length."""
        return self.predict_ids([prompt])[0]


def read_length_file(folder: str | Path) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """A saved `EmbeddingPredictor`'s metadata (cap, lam, model), weights and bias, without a model (front
    ends check the metadata before loading one); ValueError when `folder` holds none."""
    path = Path(folder) / LENGTH_FILE
    return read_ridge(
        path, meta_key="predictor", what="a length predictor", numbers={"cap": int, "lam": float}
    )


def fit_length_predictor(
    served, prompts: Sequence[Sequence[int]], lengths: Sequence[float], *, cap: int, holdout: int = 5
) -> tuple[EmbeddingPredictor, dict]:
    """An `EmbeddingPredictor` for `served` (a `ServedModel`) from `prompts` (token ids, as served) and their
    answers' `lengths`. Every `holdout`-th prompt is first held out to report how well predictions of
    unseen prompts rank and match (with the penalty chosen on the others, `held_out_lam`); the predictor
    returned is then fitted on all (its penalty chosen on all, `lam`)."""
    train = [i for i in range(len(prompts)) if i % holdout]
    held = EmbeddingPredictor(served.model, served.tokenizer, cap=cap)
    held.fit_ids([prompts[i] for i in train], [lengths[i] for i in train])
    pred, true = held.predict_ids(prompts[::holdout]), [float(n) for n in lengths[::holdout]]
    full = EmbeddingPredictor(served.model, served.tokenizer, cap=cap, key=model_key(served.name))
    full.fit_ids(prompts, lengths)
    report = {"prompts": len(prompts), "held_out_prompts": len(pred), **length_metrics(pred, true),
              "spearman": spearman(pred, true), "held_out_lam": held.lam, "lam": full.lam}  # fmt: skip
    return full, report
