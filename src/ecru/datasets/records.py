"""Typed records shared by the dataset loaders."""

from __future__ import annotations

from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from ecru.errors import MissingAssetError


@dataclass(frozen=True)
class Example:
    """One labelled utterance."""

    text: str
    label: str
    domain: str | None = None


@dataclass
class IntentDataset:
    """Splits of an intent-classification dataset and its label inventory."""

    name: str
    splits: dict[str, list[Example]]
    labels: list[str]
    domains: dict[str, list[str]] = field(default_factory=dict)

    def __getitem__(self, split: str) -> list[Example]:
        if split not in self.splits:
            raise KeyError(f"{self.name} has no split {split!r}; available: {sorted(self.splits)}")
        return self.splits[split]

    def label_index(self) -> dict[str, int]:
        return {label: i for i, label in enumerate(self.labels)}


def data_dir(name: str) -> Path:
    """Folder of a bundled dataset inside the installed package."""
    path = Path(str(resources.files("ecru.datasets") / "data" / name))
    if not path.is_dir():
        raise MissingAssetError(
            f"bundled dataset folder {path} is missing; reinstall ecru with `make install` "
            "(or `pip install -e .`) from a complete checkout"
        )
    return path


def require_file(path: Path) -> Path:
    if not path.is_file():
        raise MissingAssetError(
            f"data file {path} is missing; restore it with `git checkout -- {path.name}` in its folder "
            "or reinstall ecru from a complete checkout"
        )
    return path


def humanize_intent(label: str) -> str:
    """'freeze_account' -> 'freeze account' (the zero-shot class prompt)."""
    return label.replace("_", " ").strip()
