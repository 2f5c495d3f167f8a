"""A mixed serving workload whose response lengths depend on the request, built from the bundled text.

Real traffic mixes requests that want one word with requests that want a story; the instruction form
decides most of the answer's length. Each prompt here is one instruction form applied to one source text
(a Wikipedia sentence from CLINC150's `all_wiki_sents.txt`, a CLINC150 or a Banking77 query). The split
keeps test prompts unseen: test source texts never appear in training prompts, and the forms in
`HELD_OUT_FORMS` appear only in the test split, so a length predictor is scored on new instructions too.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

# name -> template; {text} is the source text, {n} a small count drawn per prompt
FORMS: dict[str, str] = {
    "one-word": "In one word, what is the main topic of this text? Text: {text}",
    "yes-no": "Answer only yes or no: is this text about a person? Text: {text}",
    "keywords": "Give {n} keywords for this text, comma-separated, nothing else. Text: {text}",
    "title": "Write a short title for this text. Text: {text}",
    "translate": "Translate into French: {text}",
    "rephrase": "Rephrase this in one sentence of plain English: {text}",
    "summary": "Summarize this in one sentence: {text}",
    "list": "List {n} facts or ideas related to this text, one per line: {text}",
    "explain": "Explain in a paragraph what this text is about and why it matters: {text}",
    "questions": "Write {n} questions a curious reader might ask about this text: {text}",
    "story": "Write a short story of about {n} sentences inspired by this: {text}",
    "essay": "Write a detailed essay of several paragraphs about the topic of this text: {text}",
    "reply": "You are a helpful assistant. Reply to this customer message: {text}",
    "email": "Write a polite email of about {n} sentences about this request: {text}",
}
HELD_OUT_FORMS = ("questions", "email")
"""Forms that appear in the test split only."""


@dataclass(frozen=True)
class WorkloadPrompt:
    id: str
    prompt: str
    form: str
    source: str
    """Where the text came from: wiki, clinc or banking."""


@dataclass(frozen=True)
class WorkloadConfig:
    n_train: int = 1600
    """Training prompts (seen forms only)."""
    n_test: int = 600
    """Test prompts (unseen source texts; every form, the held-out ones included)."""
    seed: int = 0

    def __post_init__(self) -> None:
        if self.n_train < 1 or self.n_test < len(FORMS):
            raise ValueError(f"n_train must be >= 1 and n_test >= {len(FORMS)} (one per form)")


QUERY_FORMS = ("reply", "email")
"""Forms that take a customer query (CLINC150 or Banking77); the others take any text."""


def _pools(seed: int) -> dict[str, list[tuple[str, str]]]:
    """(source, text) pairs, shuffled with `seed`: "query" (CLINC150 and Banking77) and "any" (wiki too)."""
    from ecru.datasets import load_banking77, load_clinc, load_wiki_sentences

    wiki = [("wiki", t) for t in load_wiki_sentences() if 8 <= len(t.split()) <= 40]
    queries = [("clinc", e.text) for e in load_clinc()["train"]]
    queries += [("banking", e.text) for e in load_banking77()["train"]]
    rng = random.Random(seed)
    rng.shuffle(wiki)
    rng.shuffle(queries)
    mixed = wiki[:4000] + queries[:2000]
    rng.shuffle(mixed)
    return {"query": queries[2000:], "any": mixed}


def _prompts(forms: list[str], n: int, pools, rng: random.Random, split: str) -> list[WorkloadPrompt]:
    out = []
    for i in range(n):
        form = forms[i % len(forms)]
        source, text = pools["query" if form in QUERY_FORMS else "any"].pop()
        prompt = FORMS[form].format(text=text, n=rng.randint(3, 10))
        out.append(WorkloadPrompt(id=f"{split}-{i:05d}", prompt=prompt, form=form, source=source))
    return out


def build_mixed_workload(cfg: WorkloadConfig = WorkloadConfig()) -> dict[str, list[WorkloadPrompt]]:
    """`{"train": [...], "test": [...]}`: no source text in both; held-out forms in test only.

    Texts are popped from shuffled pools, so no text serves two prompts.
    """
    rng = random.Random(cfg.seed)
    pools = _pools(cfg.seed)
    seen = [f for f in FORMS if f not in HELD_OUT_FORMS]
    train = _prompts(seen, cfg.n_train, pools, rng, "train")
    test = _prompts(list(FORMS), cfg.n_test, pools, rng, "test")
    return {"train": train, "test": test}
