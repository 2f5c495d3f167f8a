"""Bundled real datasets: CLINC150 and Banking77, read from files shipped inside the package."""

from ecru.datasets.banking77 import load_banking77
from ecru.datasets.clinc import CLINC_DOMAINS_FILE, load_clinc, load_clinc_domains, load_wiki_sentences
from ecru.datasets.records import Example, IntentDataset, data_dir, humanize_intent

__all__ = [
    "CLINC_DOMAINS_FILE",
    "Example",
    "IntentDataset",
    "data_dir",
    "humanize_intent",
    "load_banking77",
    "load_clinc",
    "load_clinc_domains",
    "load_wiki_sentences",
]
