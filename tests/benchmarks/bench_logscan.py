#!/usr/bin/env python3
"""Benchmark: classifying a bundle with a 1 GiB container log vs `grep -E -c` (same signatures).

Builds the log from real lines (noise and errors taken from the corpus under tests/corpus, each
with its source there), then runs, side by side in one run and on a warm page cache:
  - grep -E -c -f <the classifier's own signature patterns>   (the baseline)
  - rg -c -f <same>                                             (reference, if installed)
  - cudamedic classify <bundle> --json                          (the whole classification)
and prints wall time, peak RSS and the ratio to grep. Usage:
  .venv/bin/python tests/benchmarks/bench_logscan.py [--size-mib 1024] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from runbooks.diagnose.logscan import ere_patterns  # noqa: E402

CORPUS = REPO / "tests" / "corpus"
NOISE_CASES = [  # long real training logs in the corpus (their case.yaml names the source)
    "healthy--xid63-row-remap-recorded-training-continues/containers/train.log",
    "cuda-oom--epipolarpose-oom-buried-in-training-log",
    "nccl-timeout--ofa-v100-allreduce-after-hours-buried",
]
ERRORS = [
    "RuntimeError: DataLoader worker (pid 3185) is killed by signal: Bus error. It is possible "
    "that dataloader's workers are out of shared memory. Please try to raise your shared memory "
    "limit.",
]


def noise_lines() -> list[bytes]:
    lines: list[bytes] = []
    for spec in NOISE_CASES:
        path = CORPUS / spec
        files = [path] if path.is_file() else sorted(path.rglob("*.log"))
        for f in files:
            lines.extend(ln + b"\n" for ln in f.read_bytes().splitlines()[:400] if ln.strip())
    if not lines:
        raise SystemExit("no noise lines found in the corpus")
    return lines


def build_log(path: Path, size: int) -> None:
    rng = random.Random(7)
    pool = noise_lines()
    block = b"".join(rng.choice(pool) for _ in range(20000))
    with path.open("wb") as fh:
        written = 0
        inserted = False
        while written < size:
            fh.write(block)
            written += len(block)
            if not inserted and written > size // 2:
                fh.write(ERRORS[0].encode() + b"\n")
                inserted = True


def timed(argv: list[str]) -> tuple[float, float, str, int]:
    """Wall seconds, peak RSS MiB, stdout, exit code of one run."""
    start = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    assert proc.stdout is not None
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    return wall, usage.ru_maxrss / 1024, out.decode(), os.waitstatus_to_exitcode(status)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size-mib", type=int, default=1024)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="cudamedic-bench-"))
    try:
        bundle = tmp / "bundle"
        (bundle / "containers").mkdir(parents=True)
        log = bundle / "containers" / "train.log"
        build_log(log, args.size_mib * 1024 * 1024)
        patterns = tmp / "patterns.txt"
        patterns.write_text("\n".join(ere_patterns("log")) + "\n")
        n_patterns = len(patterns.read_text().splitlines())
        contenders = {
            "grep -E -c": ["grep", "-E", "-c", "-f", str(patterns), str(log)],
            "cudamedic classify": [
                str(REPO / ".venv/bin/cudamedic"),
                "classify",
                str(bundle),
                "--json",
            ],
        }
        if shutil.which("rg"):
            contenders["rg -c (reference)"] = ["rg", "-c", "-f", str(patterns), str(log)]
        subprocess.run(["cat", str(log)], stdout=subprocess.DEVNULL, check=True)  # warm cache
        results: dict[str, tuple[float, float]] = {}
        for name, argv in contenders.items():
            runs = [timed(argv) for _ in range(args.repeat)]
            best = min(runs, key=lambda r: r[0])
            results[name] = (best[0], max(r[1] for r in runs))
            if name == "cudamedic classify":
                verdict = json.loads(best[2])["incident"]
            if name == "grep -E -c":
                grep_count = best[2].strip()
        base = results["grep -E -c"][0]
        size = log.stat().st_size
        print(f"log: {size / 2**30:.2f} GiB, {n_patterns} signatures; best of {args.repeat} runs")
        print(f"{'tool':24} {'wall s':>8} {'GiB/s':>7} {'peak RSS MiB':>13} {'x grep':>7}")
        for name, (wall, rss) in results.items():
            print(
                f"{name:24} {wall:8.2f} {size / 2**30 / wall:7.2f} {rss:13.0f} {wall / base:7.2f}"
            )
        print(f"grep matching lines: {grep_count}; cudamedic verdict: {verdict}")
        return 0
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
