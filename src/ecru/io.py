"""ecru's one I/O layer: atomic files and folders, folder locks, checksummed manifests, tensors without pickle.

- **Atomic writes** (`atomic_path`, `atomic_write_bytes/text/json`, `atomic_folder`): the data goes to a
  temporary name in the target's folder, is fsynced, renamed into place (`os.replace`) and the folder entry
  fsynced, so a reader or a crash sees the old content or the new, never half of it. Temporary names carry
  `TMP_MARK`; `clean_leftovers` deletes what a killed write left.
- **Locks** (`FolderLock`): `flock` on `DIR/.ecru.lock`. A live holder is refused in one line naming its
  process (or waited for); the kernel drops the lock when its holder dies, so a crashed run never blocks.
- **Manifests** (`write_manifest`, `verify_manifest`): every artifact file of a folder with its sha256 and
  size, checked on load, so a truncated, bit-flipped or swapped file is refused in one line.
- **Tensors and state without pickle** (`save_tensors`, `load_tensors`, `save_state`, `load_state`):
  safetensors for tensors; any nested dict/list/tuple of tensors, numbers, strings, bools and None is kept as
  a JSON skeleton in the safetensors metadata, so optimizer states and RNG states need no `torch.load`.

Nothing here imports torch at module level: `ecru --help` imports the CLI modules that import this one.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import os
import secrets
import shutil
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from ecru.errors import EcruError

if TYPE_CHECKING:
    from torch import Tensor

TMP_MARK = ".ecru-tmp-"
LOCK_FILE = ".ecru.lock"
MANIFEST = "manifest.json"
MANIFEST_FORMAT = "ecru-manifest/1"
_SUM_KEY = "ecru_sha256"
_TREE_KEY = "ecru_tree"


class ChecksumError(EcruError):
    """A file differs from what its folder's manifest recorded when ecru wrote it."""


# ---- atomic files and folders ---------------------------------------------------------------------------
def fsync_dir(path: str | os.PathLike) -> None:
    """Make the entries of folder `path` (a rename, a new or deleted file) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@functools.cache
def _umask() -> int:
    """The process umask, read once (os.umask can only be read by setting it, which races other threads)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _tmp_name(target: Path) -> Path:
    return target.with_name(f".{target.name}{TMP_MARK}{secrets.token_hex(4)}")


@contextlib.contextmanager
def atomic_path(target: str | os.PathLike, *, fsync: bool = True) -> Iterator[Path]:
    """Yield a temporary path beside `target`; write it inside the block. On success it is fsynced and renamed
    onto `target` (folder entry fsynced); on any exception it is deleted and `target` is untouched."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = _tmp_name(target)
    try:
        yield tmp
        if fsync:
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if fsync:
        fsync_dir(target.parent)


def atomic_write_bytes(path: str | os.PathLike, data: bytes, *, fsync: bool = True) -> Path:
    """Write `data` to `path` atomically (see the module docstring)."""
    with atomic_path(path, fsync=fsync) as tmp:
        tmp.write_bytes(data)
    return Path(path)


def atomic_write_text(path: str | os.PathLike, text: str, *, fsync: bool = True) -> Path:
    return atomic_write_bytes(path, text.encode(), fsync=fsync)


def atomic_write_json(path: str | os.PathLike, data: Any, *, fsync: bool = True) -> Path:
    return atomic_write_text(path, json.dumps(data, indent=2, default=str) + "\n", fsync=fsync)


def read_json_object(path: str | os.PathLike) -> dict:
    """`path`'s JSON object ({} if there is no file); an `EcruError` of one line if it is not one."""
    path = Path(path)
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8-sig"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise EcruError(f"{path}: not a JSON file ({exc}); give another path or move it away") from None
    if not isinstance(data, dict):
        raise EcruError(f"{path}: not a JSON object; give another path or move it away")
    return data


def merge_json(path: str | os.PathLike, key: str, value: Any) -> Path:
    """Set `key` of the JSON object in `path` to `value`, the other keys kept (one result file filled by several
    runs), atomically and under the folder's lock, so that two runs writing their keys at once both land."""
    path = Path(path)
    with FolderLock(path.parent, what="results folder", wait=60.0):
        data = read_json_object(path)
        data[key] = value
        return atomic_write_json(path, data)


@contextlib.contextmanager
def atomic_folder(target: str | os.PathLike, *, replace: bool = False) -> Iterator[Path]:
    """Yield an empty temporary folder beside `target`; fill it inside the block. On success its files are
    fsynced and it is renamed to `target`; on an exception it is deleted. `target` must not exist, or with
    `replace` an existing one is first renamed aside (a temporary name, deleted after): a kill leaves the old
    folder, the new one, or neither (never a half-written one), and `clean_leftovers` removes what it left."""
    target = Path(target)
    if target.exists() and not replace:
        raise FileExistsError(f"{target} exists")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = _tmp_name(target)
    tmp.mkdir()
    try:
        yield tmp
        for file in sorted(p for p in tmp.rglob("*") if p.is_file()):
            with open(file, "rb") as f:
                os.fsync(f.fileno())
        fsync_dir(tmp)
        old = _tmp_name(target) if target.exists() else None
        if old is not None:
            target.rename(old)
        tmp.rename(target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_dir(target.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def clean_leftovers(folder: str | os.PathLike) -> list[Path]:
    """Delete the temporary files and folders that killed atomic writes left directly in `folder`."""
    removed = []
    for path in Path(folder).glob(f".*{TMP_MARK}*"):
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
        removed.append(path)
    return removed


def decode_line(raw: bytes) -> str:
    """A line of a user's file as text, a leading byte-order mark dropped (Excel's "CSV UTF-8" writes one);
    `ValueError` saying where, if it is not valid UTF-8."""
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        at = exc.start + len(raw) - len(exc.object)  # exc.start counts from after a BOM
        raise ValueError(
            f"not valid UTF-8 (byte 0x{raw[at]:02x} at column {at + 1}); save the file as UTF-8"
        ) from None


class BadLine(ValueError):
    """A line of a user's file that is wrong as it stands; the message says what and how to fix it."""


T = TypeVar("T")


def read_jsonl(path: str | os.PathLike, parse: Callable[[dict], T], *, expected: str) -> list[T]:
    """`parse` of each non-blank line of a user's JSONL file. A line that is not UTF-8, not a JSON object or
    refused by `parse` is one `EcruError` naming file:line: a `BadLine` with its message, any other error
    (a missing key, a wrong type) saying `expected`."""
    out = []
    for n, raw in enumerate(Path(path).read_bytes().splitlines(), 1):
        if not raw.strip():
            continue
        try:
            text = decode_line(raw)
        except ValueError as exc:
            raise EcruError(f"{path}:{n}: {exc}") from None
        try:
            row = json.loads(text)
            if not isinstance(row, dict):
                raise TypeError(f"a JSON {type(row).__name__}, not an object")
            out.append(parse(row))
        except BadLine as exc:
            raise EcruError(f"{path}:{n}: {exc}") from None
        except (KeyError, TypeError, ValueError) as exc:
            raise EcruError(f"{path}:{n}: expected {expected} ({exc})") from None
    return out


def inside(folder: str | os.PathLike, name: str) -> Path:
    """`folder/name`, refused unless it resolves to a path strictly inside `folder` (no `..`, no absolute
    path, no symlink out): names read from a file must not reach outside its folder."""
    root = Path(folder).resolve()
    path = (root / name).resolve()
    if path == root or root not in path.parents:
        raise EcruError(
            f"{folder}: the entry {name!r} points outside the folder; the folder was tampered with"
        )
    return path


# ---- locks ----------------------------------------------------------------------------------------------
class FolderLock:
    """An exclusive lock on a folder (`flock` on `DIR/.ecru.lock`), held from `acquire` to `release`.

    `wait` seconds: how long to wait for a live holder before refusing (0: refuse at once). A holder that
    died released its lock with its process.
    """

    def __init__(
        self, folder: str | os.PathLike, *, what: str = "folder", wait: float = 0.0, name: str = LOCK_FILE
    ):
        self.folder, self.what, self.wait, self.name = (
            Path(folder),
            what,
            wait,
            name,
        )  # name: one file's own lock
        self._file = None

    def acquire(self) -> FolderLock:
        self.folder.mkdir(parents=True, exist_ok=True)
        f = open(self.folder / self.name, "a+")  # noqa: SIM115 - held open until release()
        deadline = time.monotonic() + self.wait
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    f.seek(0)
                    holder = f.read().strip() or "unknown"
                    f.close()
                    raise EcruError(
                        f"{self.folder} is in use by another ecru process (pid {holder}); wait for it to "
                        f"finish or use another {self.what}"
                    ) from None
                time.sleep(0.05)
        f.seek(0)
        f.truncate()
        f.write(f"{os.getpid()}\n")
        f.flush()
        self._file = f
        return self

    def release(self) -> None:
        if self._file is not None and not self._file.closed:
            fcntl.flock(self._file, fcntl.LOCK_UN)
            self._file.close()
        self._file = None

    def __enter__(self) -> FolderLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


# ---- manifests ------------------------------------------------------------------------------------------
def sha256_file(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def file_entry(path: str | os.PathLike) -> dict:
    """A manifest entry: the file's sha256 and size."""
    return {"sha256": sha256_file(path), "size": Path(path).stat().st_size}


def write_manifest(
    folder: str | os.PathLike,
    files: Iterable[str] | Mapping[str, dict],
    *,
    meta: dict | None = None,
    name: str = MANIFEST,
) -> Path:
    """Record sha256 and size of each of `files` (names relative to `folder`; or their `file_entry`s, computed
    when written), and the caller's JSON `meta`, in `folder/name`, atomically: written last, it is the
    commit point of the folder's content."""
    folder = Path(folder)
    entries = dict(files) if isinstance(files, Mapping) else {f: file_entry(folder / f) for f in files}
    return atomic_write_json(folder / name, {"format": MANIFEST_FORMAT, "files": entries, "meta": meta or {}})


def read_manifest(folder: str | os.PathLike, *, name: str = MANIFEST) -> dict | None:
    """The manifest (`files`: name -> sha256 and size; `meta`), or None if the folder has none."""
    path = Path(folder) / name
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        ok = data.get("format") == MANIFEST_FORMAT and isinstance(data["files"], dict)
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        ok = False
    if not ok:
        raise ChecksumError(
            f"{path} is damaged or not an ecru manifest; the folder was changed after ecru wrote it"
        )
    data.setdefault("meta", {})
    return data


def verify_manifest(
    folder: str | os.PathLike,
    names: Iterable[str] | None = None,
    *,
    name: str = MANIFEST,
    required: bool = True,
    must_list: Iterable[str] = (),
) -> dict | None:
    """Check `names` (default: every file the manifest lists) and `must_list` (what the caller will read: a
    manifest that omits one is refused) against the manifest and return it; one-line error if any differs.
    Without a manifest: an error if `required`, else None (nothing checked)."""
    folder = Path(folder)
    manifest = read_manifest(folder, name=name)
    if manifest is None:
        if required:
            raise ChecksumError(f"{folder} has no {name}; it was not written (whole) by ecru")
        return None
    files = manifest["files"]
    for f in sorted({*(files if names is None else names), *must_list}):
        _verify_file(folder, f, files.get(f))
    return manifest


def _verify_file(folder: Path, name: str, entry: dict | None) -> None:
    path = inside(folder, name)
    if entry is None:
        raise ChecksumError(
            f"{path} is not in {folder / MANIFEST}; the folder was changed after ecru wrote it"
        )
    if not path.is_file():
        raise ChecksumError(f"{path} is missing; the folder is incomplete")
    if path.stat().st_size != entry.get("size") or sha256_file(path) != entry.get("sha256"):
        raise ChecksumError(f"checksum mismatch in {path}; the folder was changed after ecru wrote it")


# ---- tensors and state without pickle ------------------------------------------------------------------
def save_tensors(
    path: str | os.PathLike,
    tensors: dict[str, Tensor],
    metadata: dict[str, str] | None = None,
    *,
    fsync: bool = True,
) -> Path:
    """Write `tensors` as one safetensors file, atomically (shared or strided tensors are copied first)."""
    from safetensors.torch import save_file

    seen: set[int] = set()
    out = {}
    for k, t in tensors.items():
        t = t.detach().cpu()
        storage = t.untyped_storage()
        whole = t.is_contiguous() and storage.nbytes() == t.numel() * t.element_size()
        # safetensors refuses tensors that share memory (tied weights, views into one flat buffer)
        out[k] = t if whole and storage.data_ptr() not in seen else t.clone(memory_format=_contiguous())
        seen.add(storage.data_ptr())
    with atomic_path(path, fsync=fsync) as tmp:
        save_file(out, str(tmp), metadata)
    return Path(path)


def _contiguous():
    import torch

    return torch.contiguous_format


def load_tensors(path: str | os.PathLike, *, hint: str = "") -> tuple[dict[str, Tensor], dict[str, str]]:
    """(tensors, metadata) of a safetensors file; a missing, truncated or garbage file is one `EcruError`
    naming it (`hint`: how to fix it, appended)."""
    from safetensors import safe_open

    path = Path(path)
    fix = f"; {hint}" if hint else ""
    if not path.is_file():
        raise EcruError(f"{path} is missing{fix}")
    try:
        with safe_open(str(path), framework="pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata() or {})
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own SafetensorError, OSError, ...
        raise EcruError(f"{path} is damaged or not a safetensors file ({_first_line(exc)}){fix}") from None


def _first_line(exc: BaseException) -> str:
    return (str(exc).splitlines() or [type(exc).__name__])[0][:200]


def save_state(path: str | os.PathLike, state: Any, *, fsync: bool = True, checksum: bool = True) -> Path:
    """Write a nested state (dicts, lists, tuples, tensors, numbers, strings, bools, None) without pickle:
    tensors into a safetensors file, the rest as a JSON skeleton in its metadata, with the sha256 of both
    (`checksum`; off where a manifest already covers the file) so that `load_state` refuses a flipped bit."""
    tensors: dict[str, Tensor] = {}
    skeleton = json.dumps(_to_skeleton(state, tensors))
    metadata = {_TREE_KEY: skeleton} | ({_SUM_KEY: _state_sum(tensors, skeleton)} if checksum else {})
    return save_tensors(path, tensors, metadata, fsync=fsync)


def load_state(path: str | os.PathLike, *, hint: str = "") -> Any:
    """What `save_state` wrote (its checksum verified when it has one)."""
    tensors, metadata = load_tensors(path, hint=hint)
    fix = f"; {hint}" if hint else ""
    if _SUM_KEY in metadata and metadata[_SUM_KEY] != _state_sum(tensors, metadata.get(_TREE_KEY, "")):
        raise ChecksumError(f"checksum mismatch in {path}; it was changed after ecru wrote it{fix}")
    try:
        return _from_skeleton(json.loads(metadata[_TREE_KEY]), tensors)
    except (KeyError, ValueError, TypeError, IndexError) as exc:
        raise EcruError(f"{path} holds no ecru state ({_first_line(exc)}){fix}") from None


def _state_sum(tensors: dict[str, Tensor], skeleton: str) -> str:
    """sha256 of a state's skeleton and of each tensor's name, dtype, shape and bytes."""
    import torch

    h = hashlib.sha256(skeleton.encode())
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def to_json_tree(obj: Any) -> Any:
    """A JSON-able form of a small nested state (tensors inline as lists); `from_json_tree` inverts it."""
    return _to_skeleton(obj, None)


def from_json_tree(node: Any) -> Any:
    return _from_skeleton(node, {})


def _to_skeleton(obj: Any, tensors: dict[str, Tensor] | None) -> Any:
    import torch

    if isinstance(obj, torch.Tensor):
        if tensors is None:
            t = obj.detach().cpu()
            return {
                "__tensor__": {"dtype": str(t.dtype), "shape": list(t.shape), "data": t.flatten().tolist()}
            }
        key = str(len(tensors))
        tensors[key] = obj
        return {"__tensor__": key}
    if obj is None or isinstance(obj, bool | int | float | str):
        return obj
    if isinstance(obj, tuple | list):
        items = [_to_skeleton(v, tensors) for v in obj]
        return {"__tuple__": items} if isinstance(obj, tuple) else items
    if isinstance(obj, dict):
        return {"__dict__": [[_to_skeleton(k, tensors), _to_skeleton(v, tensors)] for k, v in obj.items()]}
    if isinstance(obj, torch.dtype | torch.device):
        return {"__torch__": str(obj)}
    raise TypeError(f"cannot save a {type(obj).__name__} without pickle")


def _from_skeleton(node: Any, tensors: dict[str, Tensor]) -> Any:
    if isinstance(node, list):
        return [_from_skeleton(v, tensors) for v in node]
    if not isinstance(node, dict):
        return node
    if "__tensor__" in node:
        ref = node["__tensor__"]
        if isinstance(ref, dict):
            import torch

            dtype = getattr(torch, ref["dtype"].removeprefix("torch."))
            return torch.tensor(ref["data"], dtype=dtype).reshape(ref["shape"])
        return tensors[ref]
    if "__tuple__" in node:
        return tuple(_from_skeleton(v, tensors) for v in node["__tuple__"])
    if "__torch__" in node:
        import torch

        text = node["__torch__"]
        return (
            getattr(torch, text.removeprefix("torch.")) if text.startswith("torch.") else torch.device(text)
        )
    return {_from_skeleton(k, tensors): _from_skeleton(v, tensors) for k, v in node["__dict__"]}
