"""The benchmark stream: CLINC150's 10 domains as tasks, in fixed orders, with Banking77 held out.

A task is one domain: 15 intents, train utterances (subsampled per intent) and test utterances. The held-out
probe is the Banking77 test set (77-way), never trained on. Subsampling is seeded and per intent/class, so
every method of a run sees exactly the same examples.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from ecru.datasets import Example, load_banking77, load_clinc, load_wiki_sentences
from ecru.errors import EcruError

# Fixed domain orders: the file's order, its reverse, and an interleaving of the two halves.
_BASE = ["banking", "credit_cards", "kitchen_and_dining", "home", "auto_and_commute",
         "travel", "utility", "work", "small_talk", "meta"]  # fmt: skip
ORDERS: tuple[tuple[str, ...], ...] = (
    tuple(_BASE),
    tuple(reversed(_BASE)),
    (
        "travel",
        "banking",
        "small_talk",
        "home",
        "utility",
        "credit_cards",
        "meta",
        "kitchen_and_dining",
        "work",
        "auto_and_commute",
    ),  # fmt: skip
)


@dataclass(frozen=True)
class StreamConfig:
    """Which tasks, in which order, with how many examples."""

    tasks: int = 10
    """Number of CLINC domains in the stream (1..10), the first `tasks` of the chosen order."""
    order: int = 0
    """Index into `ORDERS` (0: file order, 1: reversed, 2: interleaved)."""
    train_per_intent: int = 100
    """Training utterances per intent (CLINC has 100); fewer makes a quicker stream."""
    test_per_intent: int = 30
    """Test utterances per intent (CLINC has 30)."""
    heldout_per_class: int = 40
    """Banking77 test utterances per class (it has 40); 0 disables the held-out probe."""
    reference_size: int = 2000
    """Unlabelled reference sentences for distillation: CLINC out-of-scope utterances, then Wikipedia."""
    seed: int = 0
    """Seed of the subsampling (the methods have their own training seed)."""
    split: str = "test"
    """'test' to report; 'val' to tune: CLINC's validation utterances (20 per intent) and Banking77's
    training set as the held-out probe, so no test utterance is seen while choosing hyper-parameters."""

    def __post_init__(self) -> None:
        if not 1 <= self.tasks <= len(_BASE):
            raise EcruError(f"tasks must be in 1..{len(_BASE)} (CLINC150 has 10 domains); got {self.tasks}")
        if not 0 <= self.order < len(ORDERS):
            raise EcruError(f"order must be in 0..{len(ORDERS) - 1}; got {self.order}")
        for name in ("train_per_intent", "test_per_intent"):
            if not 1 <= getattr(self, name) <= 100:
                raise EcruError(f"{name} must be in 1..100; got {getattr(self, name)}")
        if not 0 <= self.heldout_per_class <= 40:
            raise EcruError(f"heldout_per_class must be in 0..40; got {self.heldout_per_class}")
        if self.split not in ("test", "val"):
            raise EcruError(f"split must be 'test' or 'val'; got {self.split!r}")
        if self.reference_size < 1:
            raise EcruError(f"reference_size must be >= 1; got {self.reference_size}")


@dataclass(frozen=True)
class Task:
    """One domain of the stream."""

    name: str
    intents: tuple[str, ...]
    train: tuple[Example, ...]
    test: tuple[Example, ...]


@dataclass(frozen=True)
class Stream:
    """The tasks in training order, the held-out probe and the reference sentences."""

    tasks: tuple[Task, ...]
    heldout: tuple[Example, ...]
    heldout_labels: tuple[str, ...]
    reference: tuple[str, ...]


def _per_label(examples: list[Example], labels: tuple[str, ...] | list[str], k: int, rng: random.Random):
    by_label: dict[str, list[Example]] = {label: [] for label in labels}
    for e in examples:
        if e.label in by_label:
            by_label[e.label].append(e)
    return tuple(e for label in labels for e in rng.sample(by_label[label], min(k, len(by_label[label]))))


def reference_sentences(n: int, *, seed: int = 0) -> tuple[str, ...]:
    """CLINC out-of-scope utterances (train + val), then a seeded sample of Wikipedia sentences."""
    clinc = load_clinc()
    oos = [e.text for e in clinc["oos_train"] + clinc["oos_val"]]
    wiki = random.Random(seed).sample(load_wiki_sentences(), max(0, n - len(oos)))
    return tuple((oos + wiki)[:n])


def build_clinc_stream(cfg: StreamConfig) -> Stream:
    """The CLINC task stream described by `cfg` (deterministic given `cfg`)."""
    clinc, rng = load_clinc(), random.Random(cfg.seed)
    tasks = []
    for name in ORDERS[cfg.order][: cfg.tasks]:
        intents = tuple(clinc.domains[name])
        train = _per_label(clinc["train"], intents, cfg.train_per_intent, rng)
        test = _per_label(clinc[cfg.split], intents, cfg.test_per_intent, rng)
        tasks.append(Task(name, intents, train, test))
    banking = load_banking77()
    heldout = _per_label(
        banking["test" if cfg.split == "test" else "train"], banking.labels, cfg.heldout_per_class, rng
    )
    return Stream(
        tuple(tasks), heldout, tuple(banking.labels), reference_sentences(cfg.reference_size, seed=cfg.seed)
    )
