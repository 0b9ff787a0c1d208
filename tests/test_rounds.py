"""The last blind round (tests/rounds/round15): real incidents from public threads,
gathered and second-read without looking at the classifier, scored first pass once with the
classifier of the commit that added them (docs/accuracy-rounds.tsv, docs/accuracy.md). They are
kept out of tests/corpus (the similar-incident index and the learned model never saw them) as the
held-out measure of what the next change does on incidents nobody tuned for.

Each case is well formed and sourced, no source repeats the corpus or another case, and the
classifier never does worse on a round than its recorded first pass (a regression guard; the
figures are printed at the end of `make test`).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from runbooks.core.taxonomy import Incident
from runbooks.diagnose.classify import classify_path

ROUNDS = Path(__file__).parent / "rounds"
CORPUS = Path(__file__).parent / "corpus"
# right (of the round's cases), first pass (docs/accuracy-rounds.tsv)
FIRST_PASS: dict[int, int] = {15: 43}
CASES = sorted(p for p in ROUNDS.glob("round*/*") if (p / "case.yaml").exists())
FIGURES: dict[int, tuple[int, int]] = {}


def _meta(case: Path) -> dict[str, object]:
    data = yaml.safe_load((case / "case.yaml").read_text())
    assert isinstance(data, dict)
    return data


def test_the_rounds_are_well_formed_sourced_and_new() -> None:
    corpus_sources = {
        str(_meta(c)["source"]) for c in CORPUS.iterdir() if (c / "case.yaml").exists()
    }
    seen: set[str] = set()
    for case in CASES:
        data = _meta(case)
        source = str(data["source"])
        assert source.startswith("https://"), case.name
        assert data.get("conclusion") and data.get("provenance"), case.name
        assert Incident(str(data["incident"])) and case.name.startswith(f"{data['incident']}--")
        assert data["round"] == int(case.parent.name.removeprefix("round")), case.name
        assert isinstance(data.get("thin"), bool) and isinstance(data.get("hard"), bool)
        assert source not in corpus_sources and source not in seen, case.name
        seen.add(source)
    rounds = {int(c.parent.name.removeprefix("round")) for c in CASES}
    assert rounds == set(FIRST_PASS)
    assert all(sum(c.parent.name == f"round{r}" for c in CASES) >= 60 for r in rounds)


@pytest.mark.parametrize("round_", sorted(FIRST_PASS))
def test_a_round_never_scores_below_its_first_pass(round_: int) -> None:
    cases = [c for c in CASES if c.parent.name == f"round{round_}"]
    right = sum(classify_path(c).incident == _meta(c)["incident"] for c in cases)
    FIGURES[round_] = (right, len(cases))
    assert right >= FIRST_PASS[round_], f"round {round_}: {right}/{len(cases)}"
