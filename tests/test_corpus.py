"""Accuracy of `classify` on the real-incident corpus (tests/corpus/*, each with its source URL).

One test per case checks that classification runs and gives a valid id; the accuracy test
computes per-class precision and recall, prints them in the session summary (see conftest) and
fails under 95 % overall accuracy.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import yaml

from runbooks.classify import classify_path
from runbooks.taxonomy import Incident

CORPUS = Path(__file__).parent / "corpus"
CASES = sorted(p for p in CORPUS.iterdir() if (p / "case.yaml").exists())
REPORT: dict[str, object] = {}


def expected(case: Path) -> dict[str, object]:
    data = yaml.safe_load((case / "case.yaml").read_text())
    assert isinstance(data, dict)
    return data


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_case_is_well_formed_and_classifies(case: Path) -> None:
    data = expected(case)
    assert str(data["source"]).startswith("http"), "every case names its public source"
    assert Incident(str(data["incident"]))
    assert case.name.startswith(f"{data['incident']}--")
    diagnosis = classify_path(case)
    assert Incident(diagnosis.incident)
    assert 0 <= diagnosis.confidence <= 1


def test_every_class_has_three_cases() -> None:
    counts = Counter(str(expected(c)["incident"]) for c in CASES)
    missing = {i.value: counts.get(i.value, 0) for i in Incident if counts.get(i.value, 0) < 3}
    assert not missing, f"classes with fewer than 3 cases: {missing}"
    assert len(CASES) >= 80


def test_corpus_accuracy_at_least_95_percent() -> None:
    truth: list[str] = []
    got: list[str] = []
    misses: list[str] = []
    for case in CASES:
        want = str(expected(case)["incident"])
        have = classify_path(case).incident
        truth.append(want)
        got.append(have)
        if want != have:
            misses.append(f"{case.name}: expected {want}, got {have}")
    correct = sum(t == g for t, g in zip(truth, got, strict=True))
    accuracy = correct / len(truth)
    rows = []
    for cls in sorted(set(truth) | set(got)):
        tp = sum(t == g == cls for t, g in zip(truth, got, strict=True))
        fp = sum(g == cls and t != cls for t, g in zip(truth, got, strict=True))
        fn = sum(t == cls and g != cls for t, g in zip(truth, got, strict=True))
        precision = tp / (tp + fp) if tp + fp else 1.0
        recall = tp / (tp + fn) if tp + fn else 1.0
        rows.append((cls, tp + fn, precision, recall))
    REPORT.update(accuracy=accuracy, correct=correct, total=len(truth), rows=rows, misses=misses)
    assert accuracy >= 0.95, f"accuracy {accuracy:.3f} < 0.95; misses: {misses}"
