#!/usr/bin/env python3
"""Build runbooks/knowledge/model.npz, the learned component of the diagnosis, from tests/corpus.

For every corpus case with words of its own: the text the classifier gives the model
(``classify.model_input``: the salient lines as similar-incident search reads them, without a
kernel log whose OOM kills were all another container's, plus words for the structured facts)
and its label. The model: TF-IDF over words + adjacent-word pairs and over character 3-5-grams
inside words (``runbooks/diagnose/learned.py`` holds the two analyzers, shared with the scorer),
each block
L2-normalised, then scikit-learn's multinomial LogisticRegression (L2, C=10).

Calibration and the threshold come from held-out folds, never from the cases a model was trained
on: grouped 10-fold cross-validation where a group is the repository (or site) of a case's source
URL, so a thread's neighbours from the same project are never in its training fold. On those
held-out probabilities the build fits one temperature (minimum log loss) and picks the lowest
threshold at which the held-out precision of the classes the model names reaches
PRECISION_GOAL. The last model is trained on the whole corpus.

What is written is data, not code (no pickle): UTF-8 vocabularies, idf weights, float16
coefficients, intercepts and a JSON header, loaded with ``numpy.load(allow_pickle=False)``.
Deterministic up to floating-point noise; ``--check`` rebuilds and compares (tests/test_corpus.py).

Training is fast because the regression is fitted in the span of the training documents: with
X = U S V^T (thin SVD from the eigenvectors of the Gram matrix X X^T), the L2-penalised solution
on X equals the one on U S mapped back through V, so each fold fits a 400-dimensional problem
instead of a 26,000-dimensional one (same optimum; checked against a direct fit in the tests).

Usage: .venv/bin/python scripts/build_model.py [--check]
"""

from __future__ import annotations

import io
import json
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import yaml

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "tests" / "corpus"
TARGET = ROOT / "runbooks" / "knowledge" / "model.npz"
sys.path.insert(0, str(ROOT))

from runbooks.diagnose.learned import ANALYZERS, Model  # noqa: E402

C = 10.0  # inverse L2 strength (held-out accuracy is flat between 3 and 30)
MIN_DF = 2  # a feature seen in one training document only is that document's, not a wording
FOLDS = 10  # grouped folds for the calibration and the threshold
PRECISION_GOAL = 0.95  # held-out precision of the classes the model names on its own
MIN_NAMED = 20  # a threshold is judged on at least this many held-out answers
BLOCKS = ("words", "chars")


@dataclass
class Case:
    name: str
    label: str
    group: str  # repository or site of the thread
    text: str  # what the model reads (classify.model_input)
    source: str
    facts: Any = None  # runbooks.diagnose.facts.Facts of its bundle


def source_group(url: str) -> str:
    """The repository (github.com/owner/repo, gitlab.com/owner/repo) or the site of a URL."""
    rest = re.sub(r"^[a-z]+://", "", url.strip().lower())
    parts = [p for p in rest.split("/") if p]
    if not parts:
        return rest
    host = parts[0].removeprefix("www.")
    if host in ("github.com", "gitlab.com") and len(parts) >= 3:
        return "/".join([host, parts[1], parts[2]])
    return host


def corpus_cases(corpus: Path = CORPUS) -> list[Case]:
    """Every case of the corpus with its evidence text (the case.yaml is never evidence)."""
    from runbooks.collect.bundle import open_bundle
    from runbooks.diagnose.classify import model_input
    from runbooks.diagnose.facts import gather

    cases = []
    for case in sorted(p for p in corpus.iterdir() if (p / "case.yaml").exists()):
        meta = yaml.safe_load((case / "case.yaml").read_text())
        with open_bundle(case) as bundle:
            facts = gather(bundle)
        source = str(meta["source"])
        label = str(meta["incident"])
        text = model_input(facts)
        cases.append(Case(case.name, label, source_group(source), text, source, facts))
    return cases


class Counts:
    """Raw feature counts of a list of texts, one sparse matrix per block, built once; each fold
    then keeps the features of its own training documents."""

    def __init__(self, texts: Sequence[str]) -> None:
        from sklearn.feature_extraction.text import CountVectorizer

        self.matrices = []
        self.names = []
        for analyze in ANALYZERS:
            vec = CountVectorizer(analyzer=analyze)
            self.matrices.append(vec.fit_transform(texts).tocsr())
            self.names.append(vec.get_feature_names_out())


def fit(counts: Counts, train: np.ndarray, labels: Sequence[str]) -> dict[str, Any]:
    """Train on the rows `train`: vocabulary and idf from those documents only, then the
    regression. Returns the arrays of a model (without calibration)."""
    from scipy import sparse
    from sklearn.linear_model import LogisticRegression

    # A case without words of its own is decided by the rules; the model never reads it.
    words = sum(np.diff(m.indptr) for m in counts.matrices)
    train = train[words[train] > 0]
    n = len(train)
    arrays: dict[str, Any] = {}
    weighted = []
    for name, matrix, names in zip(BLOCKS, counts.matrices, counts.names, strict=True):
        rows = matrix[train]
        df = np.bincount(rows.indices, minlength=matrix.shape[1])
        keep = np.flatnonzero(df >= MIN_DF)
        idf = np.log((1 + n) / (1 + df[keep])) + 1.0  # scikit-learn's smoothed idf
        block = rows[:, keep].astype(np.float64)
        block.data = 1.0 + np.log(block.data)  # sublinear tf
        block = block @ sparse.diags(idf)
        norms = np.sqrt(np.asarray(block.multiply(block).sum(axis=1)).ravel())
        norms[norms == 0] = 1.0
        weighted.append(sparse.diags(1.0 / norms) @ block)
        arrays[f"{name}_vocabulary"] = list(names[keep])
        arrays[f"{name}_idf"] = idf
    x = sparse.hstack(weighted).tocsr()
    gram = (x @ x.T).toarray()
    values, vectors = np.linalg.eigh(gram)
    span = values > 1e-10 * values.max()
    s, u = np.sqrt(values[span]), vectors[:, span]
    y = np.asarray(labels)[train]
    clf = LogisticRegression(C=C, max_iter=10_000, tol=1e-7)
    clf.fit(u * s, y)
    coef = x.T @ ((u / s) @ clf.coef_.T)  # features x classes, in the original feature space
    start = 0
    for name in BLOCKS:
        size = len(arrays[f"{name}_vocabulary"])
        arrays[f"{name}_coef"] = np.asarray(coef[start : start + size])
        start += size
    arrays["classes"] = [str(c) for c in clf.classes_]
    arrays["intercept"] = clf.intercept_
    return arrays


def to_model(arrays: dict[str, Any], temperature: float = 1.0, threshold: float = 0.9) -> Model:
    """A runtime model (runbooks/diagnose/learned.py) from trained arrays."""
    meta = {"temperature": temperature, "threshold": threshold}
    return Model.from_arrays({**_packed(arrays), "meta": json.dumps(meta)})


def held_out(
    counts: Counts,
    texts: Sequence[str],
    labels: Sequence[str],
    folds: Sequence[np.ndarray],
    classes: Sequence[str],
) -> np.ndarray:
    """Probabilities (uncalibrated) of every case from the model of the fold it was held out of,
    scored by the runtime scorer (runbooks/diagnose/learned.py) as the diagnosis scores it."""
    from threadpoolctl import threadpool_limits

    probs = np.zeros((len(labels), len(classes)))
    everyone = np.arange(len(labels))
    with threadpool_limits(1):  # small matrices: threads only contend
        for test in folds:
            arrays = fit(counts, np.setdiff1d(everyone, test), labels)
            model = to_model(arrays)
            for i in test:
                for c, v in model.probabilities(texts[i]).items():
                    probs[i, list(classes).index(c)] = v
    return probs


def temperature_for(probs: np.ndarray, truth: np.ndarray) -> float:
    """The temperature that minimises the log loss of the held-out probabilities."""
    from scipy.optimize import minimize_scalar

    logs = np.log(np.clip(probs, 1e-12, 1.0))

    def loss(t: float) -> float:
        return float(-np.log(softmax(logs / t)[np.arange(len(truth)), truth]).mean())

    best = minimize_scalar(loss, bounds=(0.05, 5.0), method="bounded")
    return round(float(best.x), 3)


def softmax(z: np.ndarray) -> np.ndarray:
    z = z - z.max(axis=1, keepdims=True)
    e = np.exp(z)
    return np.asarray(e / e.sum(axis=1, keepdims=True))


def threshold_for(
    probs: np.ndarray, truth: np.ndarray, classes: Sequence[str]
) -> tuple[float, dict[str, float]]:
    """The lowest threshold (0.30-0.99, step 0.01) at which the held-out precision of the classes
    the model names (top class not `unknown`, probability >= threshold) reaches PRECISION_GOAL
    on at least MIN_NAMED answers; 0.99 when none does."""
    top = probs.argmax(axis=1)
    best = probs.max(axis=1)
    named_class = np.array([classes[t] != "unknown" for t in top])
    chosen = 0.99
    for t in (round(x, 2) for x in np.arange(0.30, 1.0, 0.01)):
        named = named_class & (best >= t)
        if named.sum() >= MIN_NAMED and (top[named] == truth[named]).mean() >= PRECISION_GOAL:
            chosen = t
            break
    named = named_class & (best >= chosen)
    stats = {
        "precision": round(float((top[named] == truth[named]).mean()), 4) if named.any() else 1.0,
        "coverage": round(float(named.mean()), 4),
        "accuracy": round(float((top == truth).mean()), 4),
    }
    return chosen, stats


def grouped_folds(groups: Sequence[str], k: int = FOLDS) -> list[np.ndarray]:
    from sklearn.model_selection import GroupKFold

    index = np.arange(len(groups))
    return [test for _, test in GroupKFold(n_splits=k).split(index, groups=list(groups))]


def build(cases: Sequence[Case] | None = None) -> dict[str, Any]:
    """The arrays of model.npz: trained on every case, calibrated on grouped held-out folds."""
    # The model reads only cases with words of their own (classify.model_input): it is trained
    # and calibrated on those.
    cases = [c for c in (cases if cases is not None else corpus_cases()) if c.text]
    labels = [c.label for c in cases]
    classes = sorted(set(labels))
    texts = [c.text for c in cases]
    counts = Counts(texts)
    truth = np.array([classes.index(label) for label in labels])
    probs = held_out(counts, texts, labels, grouped_folds([c.group for c in cases]), classes)
    temperature = temperature_for(probs, truth)
    scaled = softmax(np.log(np.clip(probs, 1e-12, 1.0)) / temperature)
    threshold, stats = threshold_for(scaled, truth, classes)
    arrays = fit(counts, np.arange(len(cases)), labels)
    meta = {
        "format": 1,
        "trained_on": f"tests/corpus: {len(cases)} cases with text, {len(classes)} classes",
        "c": C,
        "min_df": MIN_DF,
        "temperature": temperature,
        "threshold": threshold,
        "held_out": {"folds": f"{FOLDS} grouped by repository or site", **stats},
    }
    return {**_packed(arrays), "meta": json.dumps(meta, sort_keys=True)}


def _packed(arrays: dict[str, Any]) -> dict[str, Any]:
    """The arrays as stored: vocabularies as newline-joined UTF-8 bytes, float16 coefficients."""
    out: dict[str, Any] = {
        "classes": np.array(arrays["classes"]),
        "intercept": np.asarray(arrays["intercept"], dtype=np.float64),
    }
    for name in BLOCKS:
        vocab = arrays[f"{name}_vocabulary"]
        out[f"{name}_vocabulary"] = (
            vocab
            if isinstance(vocab, np.ndarray)
            else np.frombuffer("\n".join(vocab).encode("utf-8"), dtype=np.uint8)
        )
        out[f"{name}_idf"] = np.asarray(arrays[f"{name}_idf"], dtype=np.float32)
        out[f"{name}_coef"] = np.asarray(arrays[f"{name}_coef"], dtype=np.float16)
    return out


def serialise(arrays: dict[str, Any]) -> bytes:
    buf = io.BytesIO()
    np.savez_compressed(buf, **arrays)
    return buf.getvalue()


def differences(new: dict[str, Any], old: dict[str, Any]) -> list[str]:
    """What differs between two models beyond floating-point noise."""
    out = []
    if set(new) != set(old):
        return [f"arrays {sorted(set(new) ^ set(old))}"]
    for key in new:
        a, b = new[key], old[key]
        if key == "meta":
            ma, mb = json.loads(str(a)), json.loads(str(b))
            if abs(ma["temperature"] - mb["temperature"]) > 0.02:
                out.append(f"temperature {mb['temperature']} -> {ma['temperature']}")
            if abs(ma["threshold"] - mb["threshold"]) > 0.02:
                out.append(f"threshold {mb['threshold']} -> {ma['threshold']}")
            if ma.get("trained_on") != mb.get("trained_on"):
                out.append(f"trained on {mb.get('trained_on')} -> {ma.get('trained_on')}")
        elif np.asarray(a).dtype.kind in "fc":
            if np.shape(a) != np.shape(b) or not np.allclose(a, b, rtol=1e-2, atol=5e-3):
                out.append(key)
        elif np.shape(a) != np.shape(b) or not np.array_equal(a, b):
            out.append(key)
    return out


# -- the whole classifier on held-out folds (tests/test_corpus.py prints it) ---------------------
@dataclass
class HeldOut:
    """Each case's diagnosis by the whole classifier (rules + the model of the fold it was held
    out of + similar incidents without its fold), and the fold model's own first class."""

    diagnoses: list[Any]
    model_first: list[tuple[str, float]]


def classify_held_out(
    cases: Sequence[Case],
    folds: Sequence[np.ndarray],
    *,
    learned: bool = True,
    counts: Counts | None = None,
    fitted: dict[frozenset[int], Model] | None = None,
) -> HeldOut:
    """Diagnose every case with what it was held out of: the similar-incident index without the
    cases of its fold in `folds` (one case: leave-one-out; its repository or site:
    leave-one-repository-out), and the model of the grouped fold (FOLDS folds by repository or
    site, calibration and threshold as packaged) that never saw the case's repository or site.
    `learned=False`: rules and similar incidents alone (the classifier before the model).
    `fitted` caches the fold models by held-out rows."""
    from threadpoolctl import threadpool_limits

    from runbooks.diagnose.classify import diagnose
    from runbooks.diagnose.history import index_for
    from runbooks.diagnose.learned import packaged_model

    packaged = packaged_model()
    temperature = packaged.temperature if packaged else 1.0
    threshold = packaged.threshold if packaged else 0.9
    labels = [c.label for c in cases]
    counts = counts or Counts([c.text for c in cases])
    fitted = {} if fitted is None else fitted
    everyone = np.arange(len(cases))
    models: list[Model | None] = [None] * len(cases)
    first: list[tuple[str, float]] = [("", 0.0)] * len(cases)
    with threadpool_limits(1):
        if learned:
            for test in grouped_folds([c.group for c in cases]):
                key = frozenset(int(i) for i in test)
                if key not in fitted:
                    arrays = fit(counts, np.setdiff1d(everyone, test), labels)
                    fitted[key] = to_model(arrays, temperature, threshold)
                for i in test:
                    models[i] = fitted[key]
                    first[i] = (fitted[key].rank(cases[i].text) or [("", 0.0)])[0]
        index = index_for(None)
        diagnoses: list[Any] = [None] * len(cases)
        for test in folds:
            names = {cases[i].name for i in test}
            for i in test:
                diagnoses[i] = diagnose(cases[i].facts, index=index, exclude=names, model=models[i])
    return HeldOut(diagnoses, first)


def loo_folds(cases: Sequence[Case]) -> list[np.ndarray]:
    return [np.array([i]) for i in range(len(cases))]


def loro_folds(cases: Sequence[Case]) -> list[np.ndarray]:
    """One fold per repository or site: every case of it held out together."""
    groups: dict[str, list[int]] = {}
    for i, c in enumerate(cases):
        groups.setdefault(c.group, []).append(i)
    return [np.array(v) for _, v in sorted(groups.items())]


def main(argv: list[str]) -> int:
    arrays = build()
    if "--check" in argv:
        if not TARGET.exists():
            print(f"{TARGET} is missing: run scripts/build_model.py", file=sys.stderr)
            return 1
        with np.load(TARGET, allow_pickle=False) as data:
            old = {k: data[k] for k in data.files}
        diff = differences(arrays, old)
        if diff:
            print(f"{TARGET} is out of date ({', '.join(diff)}): run scripts/build_model.py",
                  file=sys.stderr)  # fmt: skip
            return 1
        return 0
    TARGET.write_bytes(serialise(arrays))
    meta = json.loads(str(arrays["meta"]))
    print(f"{TARGET}: {TARGET.stat().st_size / 1e6:.2f} MB, {meta['trained_on']}")
    print(f"held out: {json.dumps(meta['held_out'])}")
    print(f"temperature {meta['temperature']}, threshold {meta['threshold']}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
