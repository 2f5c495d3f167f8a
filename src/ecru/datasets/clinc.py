"""CLINC150 (Larson et al., EMNLP 2019; CC BY 3.0): 150 intents over 10 domains, plus out-of-scope."""

from __future__ import annotations

import json
from functools import cache

from ecru.datasets.records import Example, IntentDataset, data_dir, require_file

CLINC_DOMAINS_FILE = "domains.json"
_SPLITS = ("train", "val", "test", "oos_train", "oos_val", "oos_test")


@cache
def load_clinc_domains() -> dict[str, list[str]]:
    """Domain name -> its 15 intents, in the file's order."""
    path = require_file(data_dir("clinc150") / CLINC_DOMAINS_FILE)
    return json.loads(path.read_text())


@cache
def load_clinc() -> IntentDataset:
    """All splits; in-scope examples carry their domain, out-of-scope ones the label 'oos'."""
    raw = json.loads(require_file(data_dir("clinc150") / "data_full.json").read_text())
    domains = load_clinc_domains()
    domain_of = {intent: d for d, intents in domains.items() for intent in intents}
    splits = {
        name: [Example(text, label, domain_of.get(label)) for text, label in raw[name]] for name in _SPLITS
    }
    labels = [intent for intents in domains.values() for intent in intents]
    return IntentDataset("clinc150", splits, labels, domains)


@cache
def load_wiki_sentences() -> list[str]:
    """14,750 unlabelled Wikipedia sentences shipped with CLINC150 (CC BY-SA), for reference data."""
    path = require_file(data_dir("clinc150") / "all_wiki_sents.txt")
    return [line.strip() for line in path.read_text().splitlines() if line.strip()]
