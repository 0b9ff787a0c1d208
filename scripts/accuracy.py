#!/usr/bin/env python3
"""Score the classifier and the naive baseline on real-incident cases, side by side.

Each case is a directory with ``case.yaml`` (``incident``: the class the public thread concluded)
and evidence files in the bundle layout. Prints accuracy, per-class recall and the misses.

Usage:
  .venv/bin/python scripts/accuracy.py tests/corpus                 # the whole corpus
  .venv/bin/python scripts/accuracy.py tests/corpus --round 3       # one blind round
  .venv/bin/python scripts/accuracy.py DIR --json                   # figures as JSON

Score a round *before* changing anything for it, and record the figure in docs/accuracy.md.
The packaged learned model was trained on every case of tests/corpus: on the corpus this script
is not held out for it (the held-out corpus figures are `make test`'s, tests/test_corpus.py).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from collections import Counter
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from baseline import baseline, case_text


def find_cases(roots: list[Path]) -> list[Path]:
    cases: list[Path] = []
    for root in roots:
        if (root / "case.yaml").exists():
            cases.append(root)
        else:
            cases.extend(sorted(p for p in root.iterdir() if (p / "case.yaml").exists()))
    return cases


def evidence_only(case: Path, dest: Path) -> Path:
    """A copy of the case without its case.yaml: the classifier must see the evidence only
    (the case's label and conclusion would give the answer away)."""
    target = dest / case.name
    shutil.copytree(case, target, ignore=shutil.ignore_patterns("case.yaml"))
    return target


def classify_case(case: Path, tmp: Path) -> str:
    import inspect

    from runbooks.diagnose.classify import classify_path

    bundle = evidence_only(case, tmp)
    if "exclude" in inspect.signature(classify_path).parameters:
        # A corpus case is not its own similar incident (leave-one-out).
        return classify_path(bundle, exclude={case.name}).incident
    return classify_path(bundle).incident


def score(cases: list[Path]) -> dict[str, object]:
    rows = []
    tmp = Path(tempfile.mkdtemp(prefix="cudamedic-accuracy-"))
    try:
        results = [classify_case(case, tmp) for case in cases]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    for case, got in zip(cases, results, strict=True):
        meta = yaml.safe_load((case / "case.yaml").read_text()) or {}
        want = str(meta.get("incident"))
        base = baseline(case_text(case))
        rows.append(
            {
                "case": case.name,
                "want": want,
                "got": got,
                "baseline": base,
                "thin": bool(meta.get("thin")),
                "hard": bool(meta.get("hard")),
                "stack": str(meta.get("stack") or ""),
            }
        )
    total = len(rows)
    ok = sum(r["want"] == r["got"] for r in rows)
    ok_base = sum(r["want"] == r["baseline"] for r in rows)
    per_class: dict[str, dict[str, float]] = {}
    support = Counter(str(r["want"]) for r in rows)
    for cls, n in sorted(support.items()):
        hit = sum(r["want"] == cls == r["got"] for r in rows)
        hit_b = sum(r["want"] == cls == r["baseline"] for r in rows)
        predicted = sum(r["got"] == cls for r in rows)
        per_class[cls] = {
            "cases": n,
            "recall": hit / n,
            "precision": hit / predicted if predicted else 1.0,
            "baseline_recall": hit_b / n,
        }
    return {
        "cases": total,
        "correct": ok,
        "accuracy": ok / total if total else 0.0,
        "baseline_correct": ok_base,
        "baseline_accuracy": ok_base / total if total else 0.0,
        "per_class": per_class,
        "misses": [r for r in rows if r["want"] != r["got"]],
        "rows": rows,
    }


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("roots", nargs="+", type=Path)
    ap.add_argument("--round", type=int, default=None, help="only cases with this `round:`")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    cases = find_cases(args.roots)
    if args.round is not None:
        cases = [
            c
            for c in cases
            if (yaml.safe_load((c / "case.yaml").read_text()) or {}).get("round", 0) == args.round
        ]
    if not cases:
        print("no cases found", file=sys.stderr)
        return 2
    result = score(cases)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(
        f"cases {result['cases']}: classifier {result['correct']} "
        f"({100 * float(result['accuracy']):.1f} %), naive baseline {result['baseline_correct']} "
        f"({100 * float(result['baseline_accuracy']):.1f} %)"
    )
    print(f"{'class':28} {'cases':>5} {'recall':>7} {'prec.':>6} {'baseline':>8}")
    for cls, r in result["per_class"].items():  # type: ignore[attr-defined]
        print(
            f"{cls:28} {r['cases']:5d} {100 * r['recall']:6.0f}% {100 * r['precision']:5.0f}% "
            f"{100 * r['baseline_recall']:7.0f}%"
        )
    misses = result["misses"]
    if misses:
        print("misses:")
        for m in misses:  # type: ignore[attr-defined]
            print(f"  {m['case']}: expected {m['want']}, got {m['got']} (baseline {m['baseline']})")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except BrokenPipeError:  # `| head`
        sys.exit(0)
