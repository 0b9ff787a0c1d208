"""Similar known incidents: rank the public corpus and the team's confirmed history by how much
an incident's evidence resembles theirs (BM25 over the salient lines and facts).

Every diagnosis cites the 1-3 most similar known incidents, each with the public thread (or the
team's report) and the cause it concluded; when no rule fires, the neighbours' classes make a
*proposal*, clearly marked as one. Pure except for reading the packaged corpus
(``knowledge/incidents.jsonl``, built from ``tests/corpus`` by ``scripts/build_incidents.py``)
and the team history (``STATE_DIR/history.jsonl``, written by ``runbooks/diagnose/history.py``).

Example: the salient text of a bundle whose log says ``DataLoader worker (pid 4143) is killed by
signal: Bus error`` and whose inspect has a 64 MiB /dev/shm ranks the corpus's shm-too-small
threads first.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterable, Sequence
from functools import cache
from importlib import resources
from typing import Literal

from runbooks.core.model import Frozen, SimilarIncident

MAX_SALIENT_LINES = 120
MAX_LINE = 300
MAX_DOC_TOKENS = 4000
ERRORISH = re.compile(
    r"(?i)error|fail|fatal|denied|killed|unable|cannot|can't|could not|not found|no such|"
    r"invalid|exception|timeout|timed out|warn|xid|nvrm|mismatch|insufficient|unavailable|"
    r"refused|abort|terminat|no space|oom|out of memory|bus error|is_available|not compiled|"
    r"too old|not supported|unsupported|illegal|assert|exited|signal|segmentation"
)
_TOKEN = re.compile(r"[a-z][a-z0-9_]*(?:\.[a-z0-9_]+)*|(?<![0-9])[0-9]++(?:\.[0-9]++)+")
_NOISE = re.compile(r"^(?:[0-9a-f]{6,}|[0-9]+|0x[0-9a-f]+|[a-z]?[0-9]{4,}.*)$")
_STOP_WORDS = (
    "the a an and or of to in on at for is are was were be been it this that with as by "
    "from do does did have has had i you we they he she my your our its if then else but "
    "so can could would should will may might please when which what how there here line "
    "file py self return call last most recent traceback"
)
_STOP = frozenset(_STOP_WORDS.split())


class KnownIncident(Frozen):
    """One incident whose cause is known: a public thread of the corpus, or a team report."""

    id: str
    incident: str
    kind: Literal["public", "team"] = "public"
    source: str  # the thread's URL, or the team report's path
    conclusion: str
    text: str  # salient lines and fact tokens, as indexed
    when: str | None = None  # team: the date
    host: str | None = None
    container: str | None = None
    fix: str | None = None  # team: what fixed it, e.g. "+ --shm-size=8g"


def salient_lines(text: str, limit: int = MAX_SALIENT_LINES) -> list[str]:
    """The lines of a log that carry meaning for matching: error-ish lines (the first and the
    last ones of a long log) plus the final lines, each cut to MAX_LINE characters."""
    lines = [ln.strip()[:MAX_LINE] for ln in text.splitlines() if ln.strip()]
    if len(lines) <= 12:
        return lines[:limit]
    hot = [ln for ln in lines if ERRORISH.search(ln)]
    half = limit // 2
    picked = hot if len(hot) <= limit - 8 else hot[:half] + hot[-(limit - 8 - half) :]
    return [*picked, *lines[-8:]][:limit]


def tokens(text: str) -> list[str]:
    """Lower-case words and dotted versions, without numbers, hashes and stop words, plus
    adjacent-word pairs (so `bus error` and `shared memory` weigh as phrases)."""
    words = [
        w
        for w in _TOKEN.findall(text.lower())
        if len(w) > 1 and w not in _STOP and not _NOISE.match(w)
    ][:MAX_DOC_TOKENS]
    return words + [f"{a}__{b}" for a, b in itertools.pairwise(words)]


class SimilarIndex:
    """BM25 (rank-bm25's Okapi) over known incidents; `query` returns the best matches."""

    def __init__(self, cases: Sequence[KnownIncident]) -> None:
        self.cases = tuple(cases)
        self._docs = [tokens(c.text) or ["empty"] for c in self.cases]
        self._bm25 = None
        if self.cases:
            from rank_bm25 import BM25Okapi

            self._bm25 = BM25Okapi(self._docs)

    def __len__(self) -> int:
        return len(self.cases)

    def query(
        self, text: str, k: int = 3, exclude: Iterable[str] = ()
    ) -> list[tuple[KnownIncident, float]]:
        words = list(dict.fromkeys(tokens(text)))  # a line repeated 2,000 times counts once
        if self._bm25 is None or not words:
            return []
        skip = set(exclude)
        scores = self._bm25.get_scores(words)
        ranked = sorted(
            (i for i in range(len(self.cases)) if self.cases[i].id not in skip),
            key=lambda i: scores[i],
            reverse=True,
        )
        return [(self.cases[i], float(scores[i])) for i in ranked[:k] if scores[i] > 0]


PROPOSE_MIN_SCORE = 25.0  # below this the best neighbour shares too little to propose anything
PROPOSE_MIN_SHARE = 0.6  # the winning class's share of the neighbours' summed scores


def propose(
    matches: Sequence[tuple[KnownIncident, float]],
) -> tuple[str, float] | None:
    """A class the neighbours agree on, with a guess-level confidence, or None. Only for when
    no rule fired: the proposal is never stronger than 0.5."""
    if not matches or matches[0][1] < PROPOSE_MIN_SCORE:
        return None
    votes: dict[str, float] = {}
    for case, score in matches:
        votes[case.incident] = votes.get(case.incident, 0.0) + score
    winner, weight = max(votes.items(), key=lambda kv: kv[1])
    share = weight / sum(votes.values())
    if share < PROPOSE_MIN_SHARE:
        return None
    return winner, round(min(0.5, 0.3 + 0.2 * share), 2)


def cite(matches: Sequence[tuple[KnownIncident, float]]) -> tuple[SimilarIncident, ...]:
    return tuple(
        SimilarIncident(
            id=c.id,
            incident=c.incident,
            kind=c.kind,
            source=c.source,
            conclusion=c.conclusion,
            score=round(score, 1),
            when=c.when,
            host=c.host,
            fix=c.fix,
        )
        for c, score in matches
    )


@cache
def public_incidents() -> tuple[KnownIncident, ...]:
    """The packaged corpus of public incidents (one JSON object per line)."""
    try:
        text = resources.files("runbooks.knowledge").joinpath("incidents.jsonl").read_text("utf-8")
    except FileNotFoundError:
        return ()
    return tuple(KnownIncident.model_validate_json(ln) for ln in text.splitlines() if ln.strip())


@cache
def public_index() -> SimilarIndex:
    """The index of the packaged public corpus (the team's history joins it in
    runbooks/diagnose/history.py `index_for`)."""
    return SimilarIndex(public_incidents())
