"""Banking77 (Casanueva et al., 2020; CC BY 4.0): online-banking queries over 77 intents."""

from __future__ import annotations

import csv
import json
from functools import cache

from ecru.datasets.records import Example, IntentDataset, data_dir, require_file


@cache
def load_banking77() -> IntentDataset:
    """Splits `train` (10,003) and `test` (3,080); labels in `categories.json` order."""
    folder = data_dir("banking77")
    labels = json.loads(require_file(folder / "categories.json").read_text())
    splits = {}
    for split in ("train", "test"):
        with require_file(folder / f"{split}.csv").open(newline="") as f:
            splits[split] = [Example(row["text"], row["category"], "banking77") for row in csv.DictReader(f)]
    return IntentDataset("banking77", splits, labels)
