"""A knowledge store: a folder of learned tasks over one frozen sentence encoder (`routed-lora`).

    store = KnowledgeStore("my_store")                      # created on the first `learn`
    store.learn("support", [("my card is lost", "lost_card"), ...])
    store.predict(["where is my card"])                     # among every learned label
    store.predict(["book a table"], labels=["restaurant reservation", "lost card"])  # zero-shot for the new one

Layout (all written atomically; `store.json` is the commit point):
- `store.json`: format version, the encoder (path and fingerprint), the method's config, the task list.
- `tasks/<folder>/`: one standard peft LoRA adapter (`adapter_config.json`, `adapter_model.safetensors`),
  the task's router state (`router.safetensors`: its class prototypes, threshold and claim statistics (count,
  mean and sd of its own texts' scores); with the LDA router also
  its class means, within-class scatter, count and fourth moment sum; with `routed-lora` also its adapter
  prototypes, the class means through the task's own adapter, and its relative Mahalanobis test's texts per
  class and threshold; in stores that hold out examples also `scale`, the task's score scale fitted on held-out examples,
  `ecru.lifelong.calibration`) and `labels.json`
  (the labels as written and the names the zero-shot head embeds, `ecru.lifelong.userdata.label_name`).

Each task folder also holds `manifest.json` (ecru.io: sha256 and size of its files), checked when the task
is loaded, so a damaged or changed file is refused in one line. Relearning a task writes a new folder, then
swaps `store.json` to it, then deletes the old folder: a reader or a crash sees the old task or the new one,
never a mix, and never two. Writers hold the store's lock (`learn` trains outside it and commits under it,
against the store.json it then reads: two concurrent learns both keep their task); what a killed writer
left (temporary folders, task folders no store.json names) is deleted by the next writer. Task folders
named in store.json must lie inside `tasks/`. Every input is checked before anything is written, so a
refused command leaves the store byte for byte as it was.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import sys
import uuid
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

from ecru.errors import EcruError
from ecru.io import (
    LOCK_FILE,
    TMP_MARK,
    FolderLock,
    atomic_folder,
    atomic_write_json,
    clean_leftovers,
    inside,
    load_tensors,
    verify_manifest,
    write_manifest,
)
from ecru.lifelong.userdata import Record, label_name, task_labels

FORMAT = "ecru-lifelong-store"
VERSION = 1
METHOD = "routed-lora"
DEFAULT_MODEL = "all-MiniLM-L6-v2"
PREDICT_CHUNK = 512
"""Texts scored at a time: memory stays bounded whatever the input's length."""
LOCK_WAIT_S = 600.0
"""How long a writer waits for another writer's commit (training happens outside the lock)."""
PUBLIC_IDS = {DEFAULT_MODEL: "sentence-transformers/all-MiniLM-L6-v2"}
"""The bundled encoder's public model id, named as an exported adapter's base (not a local path)."""
CALIBRATION = 0.3
"""A new store holds out this fraction of each task's examples to fit the task's score scale
(`RoutedConfig.calibration`): its scores are probabilities."""
CLAIM_Z = 2.0
"""`predict(..., abstain=True)` abstains on a text whose claim score (`RoutedEncoder.claim_scores`: its best task's
prototype score standardised by that task's own texts' scores) is below -CLAIM_Z. Chosen on CLINC's validation
texts over 12 stores (bench/experiments/lifelong_claim_val.py: two domains taught, 4x10 to 10x30 intents x
texts; never taught: auto_and_commute, home, banking): stores meeting both targets (learned texts answered right
>= 0.90, each never-taught domain abstained >= 0.80) 7 of 12 at 2.0, 4 at 1.75 and 2.25, against 3 for the
former rule (prototype score >= the task's threshold - 0.04), whose abstention fell as a task grew (never-taught
domains abstained 0.55 on average, 0.17 at worst, against 0.82 and 0.47)."""
UNCLAIMED = "no learned task claims this text"
"""The reason of an abstention (`predict(..., abstain=True)`) when the router sends a text to no learned task."""


@dataclass(frozen=True)
class Prediction:
    """One text's predicted label (as the user wrote it) and its probability among the candidates; an
    abstention has label None, the probability its best label would have had, and the `reason`."""

    text: str
    label: str | None
    score: float
    reason: str | None = None


def model_fingerprint(folder: Path) -> str:
    """Identifies an encoder folder: its config and the names and sizes of its weight files."""
    h = hashlib.sha256((folder / "config.json").read_bytes())
    for f in sorted(folder.glob("*.safetensors")) + sorted(folder.glob("*.bin")):
        h.update(f"{f.name}:{f.stat().st_size}".encode())
    return h.hexdigest()[:16]


def resolve_model(path: str | Path | None) -> dict[str, str]:
    """{"name", "path", "fingerprint"} of the encoder: MiniLM (bundled) for None, else a Hugging Face folder."""
    if path is None:
        from ecru.models.minilm import minilm_dir

        folder = minilm_dir()
        return {"name": DEFAULT_MODEL, "path": str(folder), "fingerprint": model_fingerprint(folder)}
    folder = Path(path).expanduser().resolve()
    if not (folder / "config.json").is_file():
        raise EcruError(
            f"--model {path}: no config.json there; give a Hugging Face (sentence-transformers) encoder folder"
        )
    return {"name": folder.name, "path": str(folder), "fingerprint": model_fingerprint(folder)}


def load_encoder(record: dict[str, str]):
    """The frozen encoder a store was made with (mean pooling, L2-normalised, like MiniLM)."""
    import torch
    from transformers import AutoModel, AutoTokenizer
    from transformers.utils import logging as hf_logging

    from ecru.models import MiniLM

    folder = Path(record["path"])
    if not folder.is_dir() or model_fingerprint(folder) != record["fingerprint"]:
        raise EcruError(
            f"the store's encoder {record['path']} is missing or changed; restore it or make a new store"
        )
    tokenizer = AutoTokenizer.from_pretrained(folder)
    quiet = not sys.stderr.isatty() and hf_logging.is_progress_bar_enabled()
    if quiet:  # no loading bar in a log: an error after it stays one line
        hf_logging.disable_progress_bar()
    try:
        return MiniLM(AutoModel.from_pretrained(folder, dtype=torch.float32), tokenizer).eval()
    finally:
        if quiet:
            hf_logging.enable_progress_bar()


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", name).strip("-.")[:40] or "task"


class KnowledgeStore:
    """Learned tasks over one frozen encoder, kept in a folder (module docstring)."""

    def __init__(self, path: str | Path, *, model: str | Path | None = None):
        """Open the store at `path` (it need not exist yet: the first `learn` creates it). `model`: the encoder
        folder for a new store (default MiniLM); for an existing one it must be the store's own."""
        self.path = Path(path).expanduser()
        self.manifest = self._read_manifest()
        if model is not None or self.manifest is None:
            wanted = resolve_model(model)
            if self.manifest is not None and self.manifest["model"]["fingerprint"] != wanted["fingerprint"]:
                raise EcruError(
                    f"{self.path} was made with the encoder {self.manifest['model']['path']}, not {wanted['path']}; "
                    "drop --model or use another --store"
                )
            self.model_record = wanted
        else:
            self.model_record = self.manifest["model"]
        self._method = None

    def _read_manifest(self) -> dict[str, Any] | None:
        file = self.path / "store.json"
        if not file.exists():
            if self.path.exists() and (not self.path.is_dir() or not _only_ecru_files(self.path)):
                raise EcruError(
                    f"{self.path}: exists and is not a knowledge store (no store.json); choose another --store"
                )
            above = next(p for p in self.path.absolute().parents if p.exists())
            if not above.is_dir():
                raise EcruError(
                    f"--store {self.path}: {above} is a file, not a folder; choose another --store"
                )
            return None
        try:
            manifest = json.loads(file.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise EcruError(f"{file}: unreadable ({exc}); the store is damaged") from None
        problem = _manifest_problem(manifest)
        if problem is not None:
            raise EcruError(f"{file}: {problem}; the store is damaged or not a knowledge store")
        return manifest

    # ---- reading

    def tasks(self) -> list[dict[str, Any]]:
        """One dict per learned task: name, labels, examples, trainable_params, stored_bytes."""
        keys = ("task", "labels", "examples", "trainable_params", "stored_bytes")
        return [{k: t[k] for k in keys} for t in (self.manifest or {}).get("tasks", [])]

    def _task(self, name: str) -> dict[str, Any]:
        for t in (self.manifest or {}).get("tasks", []):
            if t["task"] == name:
                return t
        known = ", ".join(t["task"] for t in (self.manifest or {}).get("tasks", [])) or "none"
        raise EcruError(f"no task {name!r} in {self.path} (learned: {known})")

    def learned_labels(self) -> list[str]:
        """Every learned label as first written, one per name, in learning order."""
        out: dict[str, str] = {}
        for t in (self.manifest or {}).get("tasks", []):
            for label, name in zip(t["labels"], t["names"], strict=True):
                out.setdefault(name, label)
        return list(out.values())

    def method(self):
        """The routed method with every learned task loaded (built once per store object). A writer that
        commits meanwhile deletes the folders it replaced: then store.json is read again and its tasks loaded."""
        for attempt in range(3):
            if self._method is not None:
                break
            try:
                self._method = self._load_method()
            except EcruError:
                fresh = self._read_manifest()
                if attempt == 2 or fresh == self.manifest:
                    raise
                self.manifest = fresh
        return self._method

    def _load_method(self):
        method = _new_method(self.model_record, self._config())
        width = json.loads((Path(self.model_record["path"]) / "config.json").read_text()).get("hidden_size")
        for t in (self.manifest or {}).get("tasks", []):
            folder = self._folder(t)
            # stores written before manifests have none; a manifest that omits a file read here is refused
            verify_manifest(folder, required=False, must_list=TASK_FILES)
            router, _ = load_tensors(folder / "router.safetensors", hint=_DAMAGED)
            adapter, _ = load_tensors(folder / "adapter_model.safetensors", hint=_DAMAGED)
            kept = tuple(router.pop(k) for k in ADAPTER_PROTOTYPES if k in router)
            prototypes = router.get("prototypes")
            if prototypes is None or tuple(prototypes.shape) != (len(t["names"]), width):
                raise EcruError(f"{folder / 'router.safetensors'}: no prototypes for its {len(t['names'])} "
                                f"labels of width {width}; {_DAMAGED}")  # fmt: skip
            try:
                method.add_trained(
                    adapter, _router_state(router), t["names"], kept if len(kept) == 2 else None
                )
            except (KeyError, TypeError, ValueError, RuntimeError) as exc:
                raise EcruError(f"{folder}: its router state does not load ({exc}); {_DAMAGED}") from None
        return method

    def _config(self):
        from ecru.lifelong.methods import ROUTED, RoutedConfig

        if self.manifest is None:
            return replace(ROUTED[METHOD], calibration=CALIBRATION)
        saved = self.manifest["config"]
        try:
            return RoutedConfig(
                **{f.name: _tuple(saved[f.name]) for f in fields(RoutedConfig) if f.name in saved}
            )
        except (TypeError, ValueError) as exc:
            raise EcruError(
                f"{self.path / 'store.json'}: its config is invalid ({exc}); the store is damaged"
            ) from None

    def predict(self, texts: list[str], labels: list[str] | None = None, *, abstain: bool = False,
                min_score: float | None = None) -> list[Prediction]:  # fmt: skip
        """Each text's label among `labels` (names learned or not: zero-shot for the rest), or among every
        learned label when None (task-agnostic). `abstain`: a text no learned task claims (the router sends it
        to the frozen model) gets label None unless an unlearned candidate wins it (zero-shot); `min_score`:
        label None below this probability."""
        if isinstance(texts, str):
            raise EcruError("predict takes a list of texts, not one string: predict([text])")
        if min_score is not None and not 0 <= min_score <= 1:
            raise EcruError(f"min_score must be a probability in [0, 1]; got {min_score}")
        candidates = list(dict.fromkeys(labels if labels is not None else self.learned_labels()))
        if not candidates:
            raise EcruError(f"{self.path} has learned no task yet; learn one, or give the candidate labels")
        names = [label_name(c) for c in candidates]
        if not all(names):
            raise EcruError(f"empty label among {candidates}")
        learned = {n for t in (self.manifest or {}).get("tasks", []) for n in t["names"]}
        out: list[Prediction] = []
        for i in range(0, len(texts), PREDICT_CHUNK):
            chunk = list(texts[i : i + PREDICT_CHUNK])
            prob, claimed = self._probabilities(chunk, names)
            best = prob.argmax(-1)
            for k, (t, b) in enumerate(zip(chunk, best.tolist(), strict=True)):
                p = prob[k, b].item()
                reason = None
                if abstain and not claimed[k] and names[b] in learned:
                    reason = UNCLAIMED
                elif min_score is not None and p < min_score:
                    reason = f"score {p:.3f} below the minimum {min_score}"
                out.append(Prediction(t, None if reason else candidates[b], p, reason))
        return out

    def _probabilities(self, texts: list[str], names: list[str]):
        """[Q, L] probabilities of `names` for `texts` (`RoutedEncoder.probabilities`: each text's task's fitted
        scale) and [Q] whether a learned task claims the text (`CLAIM_Z`)."""
        enc = self.method().encoder()  # a fresh encoder per chunk: bounded memo
        return enc.probabilities(texts, names), enc.claim_scores(texts) >= -CLAIM_Z

    # ---- writing

    def learn(self, task: str, examples: list[Record] | list[tuple[str, str]], *, epochs: int = 3,
              batch_size: int = 16, seed: int = 0, progress: bool = False) -> dict[str, Any]:  # fmt: skip
        """Train (or retrain, replacing it) task `task` on `examples` ((text, label) pairs or `Record`s)."""
        records = [r if isinstance(r, Record) else Record(*r) for r in examples]
        if not task or not task.strip():
            raise EcruError("a task needs a non-empty name")
        if not records:
            raise EcruError(f"task {task!r}: no examples")
        if any(r.label is None for r in records):
            raise EcruError(f"task {task!r}: every example needs a label")
        by_name = task_labels(records, source=f"task {task!r}")
        trained = self._train(
            task, records, by_name, epochs=epochs, batch_size=batch_size, seed=seed, progress=progress
        )
        return self._commit(task, trained)

    def _train(self, task: str, records: list[Record], by_name: dict[str, str], **train) -> dict[str, Any]:
        from ecru.datasets import Example
        from ecru.lifelong.methods import TrainConfig
        from ecru.lifelong.stream import Task

        names = list(by_name)
        cfg = self._config()
        method = _new_method(self.model_record, cfg, TrainConfig(**train))
        examples = tuple(Example(r.text, label_name(r.label)) for r in records)
        try:
            cost = method.learn(Task(task, tuple(names), examples, ()), index=0)
        except ValueError as exc:  # e.g. no label with two examples to calibrate the router's threshold
            raise EcruError(f"task {task!r}: {exc}") from None
        weights, lora, router, adapter_prototypes = method.export_task(0)
        return {"weights": weights, "lora": lora, "router": router, "adapter_prototypes": adapter_prototypes,
                "names": names,
                "labels": [by_name[n] for n in names], "examples": len(records),
                "trainable_params": cost.trainable_params, "config": cfg}  # fmt: skip

    def _folder(self, entry: dict[str, Any]) -> Path:
        """A task's folder, refused unless it lies inside the store's `tasks/` (store.json is input too)."""
        return inside(self._tasks_dir(), str(entry["folder"]))

    def _tasks_dir(self) -> Path:
        """The store's `tasks/`, refused if it is a link: writers delete in it, never outside the store."""
        tasks = self.path / "tasks"
        if tasks.is_symlink():
            raise EcruError(
                f"{tasks} is a symbolic link, not the store's own folder; the store was tampered with"
            )
        return tasks

    def _locked(self) -> FolderLock:
        """The store's writer lock; under it, store.json is read again and leftovers of killed writers go."""
        lock = FolderLock(self.path, what="--store", wait=LOCK_WAIT_S).acquire()
        try:
            self.manifest, self._method = self._read_manifest(), None
            self._clean()
        except BaseException:
            lock.release()
            raise
        return lock

    def _clean(self) -> None:
        clean_leftovers(self.path)  # a killed commit's temporary store.json
        tasks_dir = self._tasks_dir()
        if not tasks_dir.is_dir():
            return
        clean_leftovers(tasks_dir)
        named = {t["folder"] for t in (self.manifest or {}).get("tasks", [])}
        for path in tasks_dir.iterdir():  # a killed learn's folder, or an old .tmp- one
            if path.is_dir() and not path.is_symlink() and path.name not in named:
                shutil.rmtree(path, ignore_errors=True)

    def _commit(self, task: str, trained: dict[str, Any]) -> dict[str, Any]:
        lock = self._locked()
        try:
            return self._commit_locked(task, trained)
        finally:
            lock.release()

    def _commit_locked(self, task: str, trained: dict[str, Any]) -> dict[str, Any]:
        manifest = self.manifest or {"format": FORMAT, "version": VERSION, "method": METHOD,
                                     "model": self.model_record, "config": _jsonable(asdict(trained["config"])),
                                     "tasks": []}  # fmt: skip
        if self.manifest is None:  # a new store: valid (with no task) before its first task folder exists
            atomic_write_json(self.path / "store.json", manifest)
        if manifest["model"]["fingerprint"] != self.model_record["fingerprint"]:
            raise EcruError(f"{self.path} was made meanwhile with another encoder; learn again")
        folder = f"{_slug(task)}-{uuid.uuid4().hex[:8]}"
        with atomic_folder(self._tasks_dir() / folder) as tmp:
            stored = _write_task(tmp, trained, self.model_record)
        entry = {"task": task, "folder": folder, "labels": trained["labels"], "names": trained["names"],
                 "examples": trained["examples"], "trainable_params": trained["trainable_params"],
                 "stored_bytes": stored}  # fmt: skip
        old = [t for t in manifest["tasks"] if t["task"] == task]
        manifest = {**manifest, "tasks": [t for t in manifest["tasks"] if t["task"] != task] + [entry]}
        atomic_write_json(self.path / "store.json", manifest)  # the commit point
        for t in old:
            shutil.rmtree(self._folder(t), ignore_errors=True)
        self.manifest, self._method = manifest, None
        return {k: entry[k] for k in ("task", "labels", "examples", "trainable_params", "stored_bytes")}

    def forget(self, task: str) -> None:
        """Remove task `task` (its adapter, router state and labels)."""
        self._task(task)
        lock = self._locked()
        try:
            entry = self._task(task)
            folder = self._folder(entry)
            manifest = {**self.manifest, "tasks": [t for t in self.manifest["tasks"] if t["task"] != task]}
            atomic_write_json(self.path / "store.json", manifest)
            shutil.rmtree(folder, ignore_errors=True)
            self.manifest, self._method = manifest, None
        finally:
            lock.release()

    def export(self, out: str | Path) -> list[Path]:
        """One folder per task in `out` (new or empty, outside the store): a standard peft adapter
        (`adapter_config.json`, `adapter_model.safetensors`), `router.safetensors`, `labels.json`; plus
        `export.json` (the tasks' entries, each with its folder there). Written whole or not at all."""
        if not self.manifest or not self.manifest["tasks"]:
            raise EcruError(f"{self.path}: no learned task to export")
        out, store = Path(out), self.path.resolve()
        if out.resolve() == store or store in out.resolve().parents:
            raise EcruError(f"--out {out} is inside the store {self.path}; export to a folder outside it")
        if out.is_dir() and any(out.iterdir()):
            raise EcruError(f"--out {out} is not empty; export to a new or empty folder")
        if out.is_dir():
            out.rmdir()
        entries, names = [], set()
        with atomic_folder(out) as tmp:
            for t in self.manifest["tasks"]:
                name = _unique(_slug(t["task"]), names)
                shutil.copytree(self._folder(t), tmp / name)
                entries.append({**t, "folder": name})
            atomic_write_json(tmp / "export.json", {**self.manifest, "tasks": entries})
        return [out / e["folder"] for e in entries]


def _unique(name: str, taken: set[str]) -> str:
    """`name`, or `name-2`, `name-3`, ... if taken (tasks whose names make the same folder name); now taken."""
    out, k = name, 1
    while out.lower() in taken:  # case-insensitive file systems
        k += 1
        out = f"{name}-{k}"
    taken.add(out.lower())
    return out


_TASK_ENTRY = {"task": str, "folder": str, "labels": list, "names": list, "examples": int,
               "trainable_params": int, "stored_bytes": int}  # fmt: skip


def _manifest_problem(m: Any) -> str | None:
    """What is wrong with a store.json's shape (it is input too: a hand edit is one line, not a traceback)."""
    if not isinstance(m, dict) or m.get("format") != FORMAT or m.get("version") != VERSION:
        return f"not a version {VERSION} knowledge store"
    model = m.get("model")
    if not isinstance(model, dict) or not all(
        isinstance(model.get(k), str) for k in ("name", "path", "fingerprint")
    ):
        return "its 'model' is not an encoder record (name, path, fingerprint)"
    if not isinstance(m.get("config"), dict) or not isinstance(m.get("tasks"), list):
        return "its 'config' must be an object and its 'tasks' a list"
    for t in m["tasks"]:
        wrong = [
            k for k, kind in _TASK_ENTRY.items() if not isinstance(t, dict) or not isinstance(t.get(k), kind)
        ]
        if wrong:
            return f"a task entry has no valid {', '.join(wrong)}"
        labels, names = t["labels"], t["names"]
        if len(labels) != len(names) or not all(isinstance(x, str) for x in labels + names):
            return f"task {t['task']!r}: labels and names must be two lists of as many strings"
    return None


def _new_method(model_record: dict[str, str], cfg, train=None):
    from ecru.lifelong.methods import RoutedAdapters, TrainConfig

    return RoutedAdapters(METHOD, load_encoder(model_record), train or TrainConfig(progress=False), cfg)


ROUTER_FILE_KEYS = {
    "thresholds": "threshold",
    "scatters": "scatter",
    "counts": "count",
    "fourths": "fourth",
    "rmd_thresholds": "rmd_threshold",
    "scales": "scale",
    "claim_counts": "claim_count",
    "claim_means": "claim_mean",
    "claim_sds": "claim_sd",
}
"""The router state's per-task lists -> their one-task names in `router.safetensors` (prototypes and, for the
LDA router, means and class_counts keep their names)."""


ADAPTER_PROTOTYPES = ("adapter_prototypes", "adapter_counts")
"""In `router.safetensors` with the preset that scores with them (`RoutedConfig.adapter_prototype_weight`):
[labels x dim], each label's normalised mean of its training texts through the task's adapter, and [labels]
the number of those texts."""


def _router_state(tensors: dict[str, Any]) -> dict[str, list]:
    """One task's router state, as the method's `state_dict` holds it, from its `router.safetensors`."""
    back = {v: k for k, v in ROUTER_FILE_KEYS.items()}
    scalar = {"threshold": float, "count": int, "fourth": float, "rmd_threshold": float, "scale": float,
              "claim_count": float, "claim_mean": float, "claim_sd": float}  # fmt: skip
    return {back.get(k, k): [scalar[k](v) if k in scalar else v] for k, v in tensors.items()}


TASK_FILES = ("router.safetensors", "adapter_model.safetensors")
"""What loading a task reads (its manifest must list them)."""
_DAMAGED = "the store was changed after ecru wrote it; learn the task again (ecru lifelong learn)"


def _only_ecru_files(path: Path) -> bool:
    """True if folder `path` holds nothing but what a store's writer makes before store.json (its lock,
    leftovers of killed writes, an empty or leftover-only `tasks/`): a store that was never committed."""
    for entry in path.iterdir():
        if entry.name == LOCK_FILE or TMP_MARK in entry.name:
            continue
        if entry.name == "tasks" and entry.is_dir() and all(TMP_MARK in e.name for e in entry.iterdir()):
            continue
        return False
    return True


def _write_task(folder: Path, trained: dict[str, Any], model_record: dict[str, str]) -> int:
    """Write one task's files and their manifest into `folder`; returns the files' total bytes."""
    import torch
    from safetensors.torch import save_file

    lora = trained["lora"]
    lora.base_model_name_or_path = PUBLIC_IDS.get(model_record["name"], model_record["path"])
    lora.save_pretrained(folder)  # adapter_config.json
    save_file({k: v.contiguous() for k, v in trained["weights"].items()}, folder / "adapter_model.safetensors",
              metadata={"format": "pt"})  # fmt: skip
    router = {ROUTER_FILE_KEYS.get(k, k): torch.as_tensor(v[0]) for k, v in trained["router"].items()}
    if trained["adapter_prototypes"] is not None:
        router |= dict(zip(ADAPTER_PROTOTYPES, trained["adapter_prototypes"], strict=True))
    save_file({k: (v.double() if v.ndim == 0 else v.float()).contiguous() for k, v in router.items()},
              folder / "router.safetensors")  # fmt: skip
    (folder / "labels.json").write_text(
        json.dumps({"labels": trained["labels"], "names": trained["names"]}, indent=1)
    )
    files = sorted(f.name for f in folder.iterdir())
    write_manifest(folder, files)
    return sum((folder / f).stat().st_size for f in files)


def _jsonable(value: Any) -> Any:
    return (
        list(value)
        if isinstance(value, tuple)
        else value
        if not isinstance(value, dict)
        else {k: _jsonable(v) for k, v in value.items()}
    )


def _tuple(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value
