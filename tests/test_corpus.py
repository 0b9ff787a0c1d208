"""Accuracy of `classify` on the real-incident corpus (tests/corpus/*, each with its source URL).

One test per case checks that classification runs and gives a valid id; the accuracy test
computes per-class precision and recall, prints them in the session summary (see conftest) and
fails under 95 % overall accuracy. Each case is classified leave-one-out: it is never its own
similar incident (the packaged index holds the whole corpus). Its case.yaml (the label) is not
part of the bundle layout and is never read as evidence. The blind first-pass figures of each
round, beside the naive baseline (scripts/baseline.py), are in docs/accuracy.md.
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
    assert data.get("conclusion") and data.get("provenance"), "what the thread concluded, and how"
    assert isinstance(data.get("round"), int) and data.get("stack") and data.get("orchestrator")
    assert isinstance(data.get("thin"), bool) and isinstance(data.get("hard"), bool)
    assert Incident(str(data["incident"]))
    assert case.name.startswith(f"{data['incident']}--")
    diagnosis = classify_path(case)
    assert Incident(diagnosis.incident)
    assert 0 <= diagnosis.confidence <= 1


def test_the_corpus_is_broad() -> None:
    """At least 350 cases, every class at least 10, a third outside plain PyTorch on Docker or a
    bare host, thin (one pasted line) and hard cases, four blind rounds of at least 40."""
    data = [expected(c) for c in CASES]
    counts = Counter(str(d["incident"]) for d in data)
    missing = {i.value: counts.get(i.value, 0) for i in Incident if counts.get(i.value, 0) < 10}
    assert not missing, f"classes with fewer than 10 cases: {missing}"
    assert len(CASES) >= 350
    other = [
        d
        for d in data
        if not (d["stack"] == "pytorch" and d["orchestrator"] in ("docker", "bare-metal"))
    ]
    assert len(other) >= len(data) / 3
    assert sum(bool(d["thin"]) for d in data) >= 50 and sum(bool(d["hard"]) for d in data) >= 50
    rounds = Counter(int(d["round"]) for d in data)
    assert all(rounds[r] >= 40 for r in (1, 2, 3, 4)), rounds
    # A blind round never reuses a thread (round 0 has a few guides holding several outputs).
    blind = [str(d["source"]) for d in data if int(d["round"]) > 0]
    earlier = {str(d["source"]) for d in data if int(d["round"]) == 0}
    assert len(blind) == len(set(blind)) and not earlier & set(blind)


def test_packaged_similar_incidents_are_the_corpus() -> None:
    """runbooks/knowledge/incidents.jsonl is tests/corpus, rebuilt by scripts/build_incidents.py."""
    import subprocess
    import sys

    script = Path(__file__).parent.parent / "scripts" / "build_incidents.py"
    proc = subprocess.run(
        [sys.executable, str(script), "--check"], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr


def test_corpus_accuracy_at_least_95_percent() -> None:
    truth: list[str] = []
    got: list[str] = []
    misses: list[str] = []
    for case in CASES:
        want = str(expected(case)["incident"])
        have = classify_path(case, exclude={case.name}).incident
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
