"""Accuracy of `classify` on the real-incident corpus (tests/corpus/*, each with its source URL).

One test per case checks that classification runs and gives a valid id. The accuracy tests
classify every case with what it was held out of, twice: leave-one-out (the case alone is left
out of the similar-incident index) and leave-one-repository-out (every case whose thread is in
the same repository or site is). In both, the learned model (runbooks/diagnose/learned.py) that
scores a case is the one of its grouped fold: trained by the code of scripts/build_model.py on
the other folds of a 10-fold split by repository or site, so it never saw the case's project. The
classifier before the model (rules, similar incidents and the words used alone:
`diagnose(model=None)`) is scored the same way beside it. The figures, per-class recall and the
reliability tables are printed in the session summary (see conftest). A case's case.yaml (the
label) is not part of the bundle layout and is never read as evidence.

Since issue 31 the corpus holds the blind rounds 6-11 (each scored first pass before it joined,
docs/accuracy-rounds.tsv): a third of it was never tuned for, so these figures are no longer
in-sample for the rules alone. The floors are regression guards under the measured figures; the
issue's goals (90 % leave-one-repository-out, 95 % right when a class is named) are not met.
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import yaml

from runbooks.core.taxonomy import Incident
from runbooks.diagnose.classify import classify_path

sys.path.insert(0, str(Path(__file__).parent.parent / "scripts"))
import build_model

CORPUS = Path(__file__).parent / "corpus"
CASES = sorted(p for p in CORPUS.iterdir() if (p / "case.yaml").exists())
# Regression floors under the figures measured on the corpus with blind rounds 6-11 in it
# (leave-one-out 0.840, leave-one-repository-out 0.833, right when named 0.904).
LOO_FLOOR = 0.82
LORO_FLOOR = 0.81
PRECISION_FLOOR = 0.88
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


DOCKER = ("docker", "compose")


def test_the_corpus_is_broad() -> None:
    """At least 800 cases from at least 300 repositories or sites, every class at least 25, at
    most a third PyTorch in Docker and a third outside plain PyTorch on Docker or a bare host,
    thin (one pasted line) and hard cases, blind rounds of at least 40 (rounds 6-11: 60)."""
    data = [expected(c) for c in CASES]
    counts = Counter(str(d["incident"]) for d in data)
    missing = {i.value: counts.get(i.value, 0) for i in Incident if counts.get(i.value, 0) < 25}
    assert not missing, f"classes with fewer than 25 cases: {missing}"
    assert len(CASES) >= 800
    assert len({build_model.source_group(str(d["source"])) for d in data}) >= 300
    in_docker = [d for d in data if d["stack"] == "pytorch" and d["orchestrator"] in DOCKER]
    assert len(in_docker) <= len(data) / 3
    other = [
        d
        for d in data
        if not (d["stack"] == "pytorch" and d["orchestrator"] in ("docker", "bare-metal"))
    ]
    assert len(other) >= len(data) / 3
    assert sum(bool(d["thin"]) for d in data) >= 50 and sum(bool(d["hard"]) for d in data) >= 50
    rounds = Counter(int(d["round"]) for d in data)
    assert all(rounds[r] >= 40 for r in (1, 2, 3, 4)), rounds
    assert all(rounds[r] >= 60 for r in (6, 7, 8, 9, 10, 11)), rounds
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


# -- the learned model: packaged, data only, scikit-learn's model ---------------------------------
def test_packaged_model_is_the_corpus() -> None:
    """runbooks/knowledge/model.npz is tests/corpus, rebuilt by scripts/build_model.py (the same
    vocabulary, classes, calibration and threshold; coefficients up to floating-point noise)."""
    import subprocess
    import sys

    script = Path(__file__).parent.parent / "scripts" / "build_model.py"
    proc = subprocess.run(
        [sys.executable, str(script), "--check"], capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr


def test_the_packaged_model_is_small_data_without_pickle() -> None:
    import numpy as np

    from runbooks.diagnose.learned import MODEL_FILE, packaged_model

    path = Path(__file__).parent.parent / "runbooks" / "knowledge" / MODEL_FILE
    assert path.stat().st_size < 3_000_000
    with np.load(path, allow_pickle=False) as data:  # an object array would raise here
        kinds = {k: data[k].dtype.kind for k in data.files}
    assert "O" not in kinds.values(), kinds
    model = packaged_model()
    assert model is not None and set(model.classes) == {i.value for i in Incident}
    assert 0.5 <= model.threshold < 1 and model.temperature > 0


def test_the_runtime_scorer_gives_scikit_learns_probabilities() -> None:
    """The model fitted the fast way (in the span of the documents) and scored by runbooks/
    learned.py in numpy gives the probabilities of scikit-learn's own TfidfVectorizer +
    LogisticRegression fitted directly on the same cases."""
    import numpy as np
    from scipy import sparse
    from sklearn.feature_extraction.text import TfidfVectorizer
    from sklearn.linear_model import LogisticRegression

    from runbooks.diagnose.learned import char_features, word_features

    cases = [c for c in _held_out_data()["cases"] if c.text]  # what the model reads
    train = np.arange(0, len(cases), 2)
    test = np.arange(1, len(cases), 8)
    texts = [c.text for c in cases]
    labels = np.array([c.label for c in cases])
    ours = build_model.to_model(build_model.fit(build_model.Counts(texts), train, list(labels)))
    blocks = [
        TfidfVectorizer(analyzer=a, sublinear_tf=True, min_df=build_model.MIN_DF)
        for a in (word_features, char_features)
    ]
    x = sparse.hstack([b.fit_transform([texts[i] for i in train]) for b in blocks]).tocsr()
    clf = LogisticRegression(C=build_model.C, max_iter=10_000, tol=1e-7).fit(x, labels[train])
    x_test = sparse.hstack([b.transform([texts[i] for i in test]) for b in blocks]).tocsr()
    theirs = clf.predict_proba(x_test)
    worst = 0.0
    for row, i in enumerate(test):
        mine = ours.probabilities(texts[i])
        for col, cls in enumerate(clf.classes_):
            worst = max(worst, abs(mine[str(cls)] - theirs[row, col]))
    assert worst < 0.01, worst


def test_the_build_groups_cases_by_repository_or_site() -> None:
    group = build_model.source_group
    assert group("https://github.com/NVIDIA/nccl/issues/1") == "github.com/nvidia/nccl"
    assert group("https://github.com/nvidia/nccl/pull/7#x") == "github.com/nvidia/nccl"
    assert group("https://discuss.pytorch.org/t/x/1") == "discuss.pytorch.org"
    assert group("https://www.reddit.com/r/a") == "reddit.com"
    folds = build_model.loro_folds(_held_out_data()["cases"])
    cases = _held_out_data()["cases"]
    for fold in folds:
        assert len({cases[i].group for i in fold}) == 1
    assert sum(len(f) for f in folds) == len(cases)


# -- held-out accuracy of the whole classifier ---------------------------------------------------
_HELD_OUT: dict[str, Any] = {}


def _held_out_data() -> dict[str, Any]:
    """The corpus cases (facts and evidence texts), read once per session."""
    if "cases" not in _HELD_OUT:
        cases = build_model.corpus_cases(CORPUS)
        _HELD_OUT.update(
            cases=cases,
            counts=build_model.Counts([c.text for c in cases]),
            fitted={},
        )
    return _HELD_OUT


def _score(name: str, folds: str, learned: bool) -> dict[str, Any]:
    """The whole classifier on held-out folds: figures, per class, reliability, misses."""
    data = _held_out_data()
    if name in data:
        return dict(data[name])
    cases = data["cases"]
    split = build_model.loo_folds(cases) if folds == "loo" else build_model.loro_folds(cases)
    held = build_model.classify_held_out(
        cases, split, learned=learned, counts=data["counts"], fitted=data["fitted"]
    )
    truth = [c.label for c in cases]
    got = [d.incident for d in held.diagnoses]
    named = [i for i, g in enumerate(got) if g != Incident.UNKNOWN]
    right_named = sum(truth[i] == got[i] for i in named)
    result = {
        "correct": sum(t == g for t, g in zip(truth, got, strict=True)),
        "total": len(truth),
        "named": len(named),
        "precision": right_named / len(named) if named else 1.0,
        "recall": _per_class(truth, got),
        "reliability": _reliability(
            [(held.diagnoses[i].confidence, truth[i] == got[i]) for i in named]
        ),
        "misses": [
            f"{c.name}: expected {t}, got {g} ({d.basis})"
            for c, t, g, d in zip(cases, truth, got, held.diagnoses, strict=True)
            if t != g
        ],
        "bases": Counter(
            (d.basis, t == g) for t, g, d in zip(truth, got, held.diagnoses, strict=True)
        ),
    }
    if learned:
        # The model alone, on the cases it reads (those with words of their own).
        first = [(f, t) for f, t in zip(held.model_first, truth, strict=True) if f[0]]
        result["model_cases"] = len(first)
        result["model_correct"] = sum(c == t for (c, _), t in first)
        named = [((c, p), t) for (c, p), t in first if c != "unknown" and p >= threshold()]
        result["model_named"] = len(named)
        result["model_precision"] = (
            sum(c == t for (c, _), t in named) / len(named) if named else 1.0
        )
        result["model_reliability"] = _reliability(
            [(p, c == t) for (c, p), t in first if c != "unknown"]
        )
    data[name] = result
    return dict(result)


def threshold() -> float:  # the packaged model's, read when asked
    from runbooks.diagnose.learned import packaged_model

    model = packaged_model()
    return model.threshold if model is not None else 1.0


def _per_class(truth: list[str], got: list[str]) -> list[tuple[str, int, float, float]]:
    rows = []
    for cls in sorted(set(truth) | set(got)):
        tp = sum(t == g == cls for t, g in zip(truth, got, strict=True))
        fp = sum(g == cls and t != cls for t, g in zip(truth, got, strict=True))
        fn = sum(t == cls and g != cls for t, g in zip(truth, got, strict=True))
        rows.append(
            (cls, tp + fn, tp / (tp + fp) if tp + fp else 1.0, tp / (tp + fn) if tp + fn else 1.0)
        )
    return rows


def _reliability(pairs: list[tuple[float, bool]]) -> list[tuple[str, int, float, float]]:
    """Per decile of the stated confidence: answers, mean confidence, share right."""
    rows = []
    for k in range(10):
        inside = [(c, ok) for c, ok in pairs if min(int(c * 10), 9) == k]
        if inside:
            mean = sum(c for c, _ in inside) / len(inside)
            rows.append(
                (
                    f"{k / 10:.1f}-{(k + 1) / 10:.1f}",
                    len(inside),
                    mean,
                    sum(ok for _, ok in inside) / len(inside),
                )
            )
    return rows


def test_corpus_accuracy_leave_one_out() -> None:
    """Each case classified without itself in the similar-incident index (the model: its fold's)."""
    after = _score("loo", "loo", learned=True)
    before = _score("loo-before", "loo", learned=False)
    REPORT.update(loo=after, loo_before=before)
    assert after["correct"] / after["total"] >= LOO_FLOOR, after["misses"]


def test_corpus_accuracy_leave_one_repository_out() -> None:
    """Each repository's cases classified by the classifier that never saw that repository (the
    similar-incident index without it, the model of a fold without it): the figure that predicts
    blind rounds best. Floors under the measured figures (issue 31's goals, 90 % and 95 % right
    when a class is named, are not met: docs/accuracy.md)."""
    after = _score("loro", "loro", learned=True)
    before = _score("loro-before", "loro", learned=False)
    REPORT.update(loro=after, loro_before=before)
    assert after["correct"] / after["total"] >= LORO_FLOOR, after["misses"]
    assert after["precision"] >= PRECISION_FLOOR, after["misses"]
    # The calibrated model alone: its confident answers are right about as often as it says.
    confident = [r for r in after["model_reliability"] if r[0] >= "0.9"]
    assert confident and all(abs(right - mean) < 0.1 for _, _, mean, right in confident)
