"""Blind rounds 6 and 7 (tests/rounds/): 132 real incidents from public threads, gathered without
looking at the classifier, scored first pass on 2026-12-04 and recorded in docs/accuracy.md and
docs/accuracy-rounds.tsv. They are not yet in tests/corpus (the similar-incident index and the
95 % corpus figure): their families have not been generalised yet (issue 31).

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
FIRST_PASS = {6: 47, 7: 45}  # right of 66, first pass (docs/accuracy.md)
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
    assert len(CASES) == 132


@pytest.mark.parametrize("round_", sorted(FIRST_PASS))
def test_a_round_never_scores_below_its_first_pass(round_: int) -> None:
    cases = [c for c in CASES if c.parent.name == f"round{round_}"]
    right = sum(classify_path(c).incident == _meta(c)["incident"] for c in cases)
    FIGURES[round_] = (right, len(cases))
    assert right >= FIRST_PASS[round_], f"round {round_}: {right}/{len(cases)}"
