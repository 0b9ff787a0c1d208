#!/usr/bin/env python3
"""Build runbooks/knowledge/incidents.jsonl (the public incidents similar-incident search cites)
from tests/corpus: one line per case with its class, thread URL, the cause the thread concluded
and the salient evidence text (what classify matches on). Deterministic; tests/test_corpus.py
fails when the packaged file is out of date.

Usage: .venv/bin/python scripts/build_incidents.py [--check]
"""

from __future__ import annotations

import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "tests" / "corpus"
TARGET = ROOT / "runbooks" / "knowledge" / "incidents.jsonl"


def build() -> str:
    from runbooks.collect.bundle import open_bundle
    from runbooks.diagnose.classify import evidence_text
    from runbooks.diagnose.facts import gather
    from runbooks.diagnose.similar import KnownIncident

    lines = []
    for case in sorted(p for p in CORPUS.iterdir() if (p / "case.yaml").exists()):
        meta = yaml.safe_load((case / "case.yaml").read_text())
        with open_bundle(case) as bundle:
            text = evidence_text(gather(bundle))
        known = KnownIncident(
            id=case.name,
            incident=str(meta["incident"]),
            source=str(meta["source"]),
            conclusion=" ".join(str(meta.get("conclusion") or "").split()),
            text=text,
        )
        lines.append(known.model_dump_json(exclude_defaults=True))
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    sys.path.insert(0, str(ROOT))
    text = build()
    if "--check" in argv:
        current = TARGET.read_text() if TARGET.exists() else ""
        if current != text:
            print(f"{TARGET} is out of date: run scripts/build_incidents.py", file=sys.stderr)
            return 1
        return 0
    TARGET.write_text(text)
    print(f"{TARGET}: {text.count(chr(10))} incidents")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
