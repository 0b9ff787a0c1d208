#!/usr/bin/env python3
"""Benchmark: the diagnosis with its learned model (issue 31) is as fast as before, side by side.

1. `cudamedic classify -` of a pasted line (a real line of a corpus case), cold: a new process
   each run, the model read from the package each time, the signatures' compiled database from
   the cache the first run wrote (logscan.cache_dir); beside it the same command with an empty
   cache each run (the baseline: every run compiled before the cache), and the same
   classification in a bare `python -c` with the learned model and with rules alone
   (`model=None`), so the model's share is seen. Runs interleaved; p50 / p95 / max and peak
   RSS of each (goal: the CLI's p50 <= 1.5 s, RSS < 200 MB).
2. A bundle whose container log is 1 GiB of real training-log lines with one error in the middle
   (built as tests/benchmarks/bench_logscan.py builds it): `grep -E -c -f <the classifier's own
   signature patterns>` beside `cudamedic classify <bundle> --json`, warm page cache, best of
   --repeat; the ratio to grep (goal <= 1.5) and peak RSS (goal < 200 MB).
3. In process: the model's load time and its scoring time for the pasted line and for the
   largest evidence text it reads (MAX_TEXT characters).

Usage: .venv/bin/python tests/benchmarks/bench_classify.py [--runs 15] [--size-mib 1024]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).parent))

from bench_logscan import build_log, timed  # noqa: E402

from runbooks.diagnose.logscan import ere_patterns  # noqa: E402

CORPUS = REPO / "tests" / "corpus"
PASTED = (  # (case, file, a text in the line): the first line of that file holding it
    "shm-too-small--dataloader-unable-to-write-buried-in-training-log",
    "containers/train.log",
    "killed by signal: Bus error",
)
CLASSIFY = (  # a pasted text classified in a bare interpreter; MODEL: "packaged" or None
    "import sys, tempfile, pathlib, json; "
    "from runbooks.diagnose.classify import classify_path, to_json; "
    "t = pathlib.Path(tempfile.mkdtemp()) / 'pasted.log'; t.write_text(sys.stdin.read()); "
    "print(json.dumps(to_json(classify_path(t, model=MODEL))))"
)


def pasted_line() -> str:
    case, rel, needle = PASTED
    return next(ln for ln in (CORPUS / case / rel).read_text().splitlines() if needle in ln)


def child_rss(argv: list[str], text: str, env: dict[str, str]) -> tuple[float, float, str]:
    """Like timed_stdin, with the child's own peak RSS (wait4 on it, not communicate)."""
    start = time.perf_counter()
    proc = subprocess.Popen(
        argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env
    )
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(text.encode())
    proc.stdin.close()
    out = proc.stdout.read()
    _, _, usage = os.wait4(proc.pid, 0)
    return time.perf_counter() - start, usage.ru_maxrss / 1024, out.decode()


def pct(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[max(0, min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1))))]


def pasted(runs: int) -> None:
    line = pasted_line()
    state = tempfile.mkdtemp(prefix="cudamedic-bench-state-")
    cache = tempfile.mkdtemp(prefix="cudamedic-bench-cache-")  # compiled signatures, kept
    env = {**os.environ, "CUDAMEDIC_STATE_DIR": state, "CUDAMEDIC_CACHE_DIR": cache}
    cli = [str(REPO / ".venv/bin/cudamedic"), "classify", "-", "--json"]
    contenders = {
        "cudamedic classify -": cli,
        # the baseline: each run compiles the signatures (as every run did before the cache)
        "  ... with an empty cache": cli,
        "python: rules + model": [sys.executable, "-c", CLASSIFY.replace("MODEL", "'packaged'")],
        "python: rules alone": [sys.executable, "-c", CLASSIFY.replace("MODEL", "None")],
    }
    times: dict[str, list[float]] = {k: [] for k in contenders}
    rss: dict[str, float] = dict.fromkeys(contenders, 0.0)
    verdicts: dict[str, str] = {}
    for _ in range(runs):
        for name, argv in contenders.items():
            run_env = env
            if name.endswith("empty cache"):
                run_env = {**env, "CUDAMEDIC_CACHE_DIR": tempfile.mkdtemp(dir=cache)}
            wall, peak, out = child_rss(argv, line, run_env)
            times[name].append(wall)
            rss[name] = max(rss[name], peak)
            verdicts[name] = json.loads(out)["incident"]
    shutil.rmtree(state, ignore_errors=True)
    shutil.rmtree(cache, ignore_errors=True)
    print(f"1. a pasted line, cold, {runs} runs each (interleaved): {line[:70]}...")
    print(f"{'command':28} {'p50 s':>6} {'p95 s':>6} {'max s':>6} {'RSS MiB':>8}  verdict")
    for name, values in times.items():
        print(
            f"{name:28} {statistics.median(values):6.2f} {pct(values, 95):6.2f} "
            f"{max(values):6.2f} {rss[name]:8.0f}  {verdicts[name]}"
        )
    cli = statistics.median(times["cudamedic classify -"])
    empty = statistics.median(times["  ... with an empty cache"])
    with_model = statistics.median(times["python: rules + model"])
    alone = statistics.median(times["python: rules alone"])
    print(
        f"   p50 with the compiled-signature cache / without: {cli / empty:.2f}; "
        f"p50 with the model / rules alone: {with_model / alone:.2f}; the CLI's p50 <= 1.5 s: "
        f"{'met' if cli <= 1.5 else 'NOT met'}; RSS < 200 MiB: "
        f"{'met' if max(rss.values()) < 200 else 'NOT met'}"
    )


def big_log(size_mib: int, repeat: int) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="cudamedic-bench-"))
    try:
        bundle = tmp / "bundle"
        (bundle / "containers").mkdir(parents=True)
        log = bundle / "containers" / "train.log"
        build_log(log, size_mib * 1024 * 1024)
        patterns = tmp / "patterns.txt"
        signatures = list(ere_patterns("log"))
        patterns.write_text("\n".join(signatures) + "\n")
        contenders = {
            "grep -E -c": ["grep", "-E", "-c", "-f", str(patterns), str(log)],
            "cudamedic classify": [
                str(REPO / ".venv/bin/cudamedic"), "classify", str(bundle), "--json"
            ],
        }  # fmt: skip
        subprocess.run(["cat", str(log)], stdout=subprocess.DEVNULL, check=True)  # warm cache
        best: dict[str, tuple[float, float, str]] = {}
        for _ in range(repeat):
            for name, argv in contenders.items():
                wall, peak, out, _code = timed(argv)
                old = best.get(name)
                best[name] = (
                    min(wall, old[0]) if old else wall,
                    max(peak, old[1]) if old else peak,
                    out,
                )
        size = log.stat().st_size
        base = best["grep -E -c"][0]
        print(
            f"2. a {size / 2**30:.2f} GiB container log, {len(signatures)} signature "
            f"patterns, best of {repeat} (interleaved, warm cache)"
        )
        print(f"{'tool':22} {'wall s':>7} {'GiB/s':>6} {'RSS MiB':>8} {'x grep':>7}")
        for name, (wall, peak, _) in best.items():
            speed = size / 2**30 / wall
            print(f"{name:22} {wall:7.2f} {speed:6.2f} {peak:8.0f} {wall / base:7.2f}")
        ratio = best["cudamedic classify"][0] / base
        rss = best["cudamedic classify"][1]
        verdict = json.loads(best["cudamedic classify"][2])
        print(
            f"   verdict {verdict['incident']} ({verdict['basis']}); goal <= 1.5x grep: "
            f"{'met' if ratio <= 1.5 else 'NOT met'}; RSS < 200 MiB: "
            f"{'met' if rss < 200 else 'NOT met'}"
        )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def in_process() -> None:
    from runbooks.diagnose import learned

    start = time.perf_counter()
    learned.packaged_model.cache_clear()
    model = learned.packaged_model()
    load = time.perf_counter() - start
    assert model is not None
    line = pasted_line()
    start = time.perf_counter()
    model.rank(line)
    one = time.perf_counter() - start
    text = (CORPUS / PASTED[0] / PASTED[1]).read_text()
    big = (text * (learned.MAX_TEXT // max(1, len(text)) + 1))[: learned.MAX_TEXT]
    start = time.perf_counter()
    model.rank(big)
    most = time.perf_counter() - start
    size = (REPO / "runbooks" / "knowledge" / learned.MODEL_FILE).stat().st_size
    print(
        f"3. the model ({size / 1e6:.2f} MB, {sum(len(b.vocabulary) for b in model.blocks)} "
        f"features, {len(model.classes)} classes): load {load * 1000:.0f} ms; scoring the "
        f"pasted line {one * 1000:.1f} ms, a {len(big):,}-character text {most * 1000:.0f} ms"
    )


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=15)
    ap.add_argument("--size-mib", type=int, default=1024)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    pasted(args.runs)
    big_log(args.size_mib, args.repeat)
    in_process()
    return 0


if __name__ == "__main__":
    sys.exit(main())
