"""Every regular expression cudamedic runs is linear on hostile text (issue 27, findings 2 and 3).

Evidence, pasted text and Slack commands are hostile input: one super-linear pattern lets a 100 kB
log line hold a worker (or the Slack app's GIL) for seconds to hours. This test does not list the
patterns by hand, so a new one cannot be forgotten: it collects **every** compiled `re` pattern of
runbooks/, flows/ and reports/ (module- and class-level objects, the `_Anchored` wrappers and
tables of the redactor, the inline `re.search(r"...")` calls found in the source, the signatures
of runbooks/knowledge/signatures.yaml and the model patterns of nccl_floors.yaml), and feeds each
~100 kB runs built from its own literals and character classes (read from the compiled
pattern's parse tree with `re._parser`): each prefix of the pattern repeated, each atom repeated
after the pattern's own prefix, each followed by a character that makes the match fail at the
end. Each search over one run must finish well under a second. A super-linear pattern takes
tens of seconds to hours on such a run; the alarm stops it at `LIMIT_S`.
"""

from __future__ import annotations

import ast
import importlib
import itertools
import pkgutil
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from re import _constants as C  # type: ignore[attr-defined]
from re import _parser as P  # type: ignore[attr-defined]
from typing import Any

import pytest

ROOT = Path(__file__).parents[1]
PACKAGES = ("runbooks", "flows", "reports")
SIZE = 100_000
MAX_RUNS = 24  # per pattern (the suite's time); the alternatives share them
END = "_\x01"  # fails a match at the end: a word character, then a control character
LIMIT_S = 0.5  # a linear pattern needs a few milliseconds for 100 kB
_FLAGS = {n: getattr(re, n) for n in ("I", "M", "S", "X", "A", "IGNORECASE", "MULTILINE",
                                      "DOTALL", "VERBOSE", "ASCII")}  # fmt: skip


# -- every pattern -------------------------------------------------------------------------------
def _module_names() -> Iterator[str]:
    for pkg in PACKAGES:
        yield pkg
        mod = importlib.import_module(pkg)
        for info in pkgutil.walk_packages(mod.__path__, pkg + "."):
            yield info.name


def _patterns_in(value: Any, depth: int = 0) -> Iterator[re.Pattern[Any]]:
    if isinstance(value, re.Pattern):
        yield value
    elif isinstance(getattr(value, "pattern", None), re.Pattern):  # the redactor's _Anchored
        yield value.pattern
    elif depth < 3 and isinstance(value, dict):
        for v in value.values():
            yield from _patterns_in(v, depth + 1)
    elif depth < 3 and isinstance(value, list | tuple | set | frozenset):
        for v in value:
            yield from _patterns_in(v, depth + 1)


def _flags(node: ast.expr | None) -> int:
    if node is None:
        return 0
    if isinstance(node, ast.Attribute) and node.attr in _FLAGS:
        return int(_FLAGS[node.attr])
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
        return _flags(node.left) | _flags(node.right)
    return 0


def _inline_patterns(path: Path) -> Iterator[tuple[str, re.Pattern[Any]]]:
    """`re.search(r"...")`, `re.compile("...")`, ... with a literal pattern, anywhere in a file."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "re"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str | bytes)
        ):
            flags = node.keywords[0].value if node.keywords else None
            if node.func.attr in ("compile", "split", "sub", "subn") and not flags:
                flags = node.args[-1] if len(node.args) > 2 else None
            elif not flags and len(node.args) > 2:
                flags = node.args[2]
            yield (
                f"{path.relative_to(ROOT)}:{node.lineno}",
                re.compile(node.args[0].value, _flags(flags)),
            )


def all_patterns() -> dict[str, re.Pattern[Any]]:
    found: dict[str, re.Pattern[Any]] = {}
    for name in _module_names():
        mod = importlib.import_module(name)
        for attr, value in vars(mod).items():
            owners = [(attr, value)]
            if isinstance(value, type) and value.__module__ == name:  # class-level patterns
                owners = [(f"{attr}.{a}", v) for a, v in vars(value).items()]
            for label, v in owners:
                for n, pat in enumerate(_patterns_in(v)):
                    found.setdefault(f"{name}.{label}[{n}]", pat)
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            for label, pat in _inline_patterns(path):
                found.setdefault(label, pat)
    from runbooks.diagnose import logscan
    from runbooks.knowledge import tables

    for sig in logscan.signatures():
        flags = re.MULTILINE | (0 if sig.exact else re.IGNORECASE)
        found[f"signatures.yaml:{sig.id}"] = re.compile(sig.pattern.encode(), flags)
    for key, pats in tables._model_patterns():
        for n, pat in enumerate(pats):
            found[f"nccl_floors.yaml:{key}[{n}]"] = pat
    return found


# -- hostile runs built from a pattern's own pieces ---------------------------------------------
_POOL = "a0Z -_./:=\"'\\\t\n()@,x9"
_CATEGORY = {
    C.CATEGORY_DIGIT: "0",
    C.CATEGORY_NOT_DIGIT: "a",
    C.CATEGORY_SPACE: " ",
    C.CATEGORY_NOT_SPACE: "a",
    C.CATEGORY_WORD: "a",
    C.CATEGORY_NOT_WORD: "-",
    C.CATEGORY_LINEBREAK: "\n",
    C.CATEGORY_NOT_LINEBREAK: "a",
}


def _class_members(items: list[Any]) -> list[str]:
    chars: list[str] = []
    negate = False
    for op, av in items:
        if op is C.NEGATE:
            negate = True
        elif op is C.LITERAL:
            chars.append(chr(av))
        elif op is C.RANGE:
            chars += [chr(av[0]), chr(av[1])]
        elif op is C.CATEGORY:
            chars.append(_CATEGORY.get(av, "a"))
    if negate:
        return [c for c in _POOL if c not in chars][:3] or ["\x01"]
    # categories first: a run of spaces or digits is what most patterns repeat
    return sorted(dict.fromkeys(chars), key=lambda c: c not in " 0a-\n")


Seq = list[list[str]]  # one choice of characters per position


def _sequences(tree: Any, cap: int = 24) -> list[Seq]:
    """The pattern as sequences of atoms (alternatives multiply, up to `cap` sequences)."""
    seqs: list[Seq] = [[]]
    for op, av in tree:
        parts: list[Seq]
        if op is C.LITERAL:
            parts = [[[chr(av)]]]
        elif op is C.NOT_LITERAL:
            parts = [[[c for c in "ax-" if ord(c) != av][:1]]]
        elif op is C.ANY:
            parts = [[["a"]]]
        elif op is C.IN:
            parts = [[_class_members(av)]]
        elif op in (C.MAX_REPEAT, C.MIN_REPEAT, C.POSSESSIVE_REPEAT):
            parts = _sequences(av[2], cap)
        elif op is C.SUBPATTERN:
            parts = _sequences(av[3], cap)
        elif op is C.ATOMIC_GROUP:
            parts = _sequences(av, cap)
        elif op is C.BRANCH:
            parts = [s for branch in av[1] for s in _sequences(branch, cap)]
        else:  # assertions, anchors, back references: nothing to type
            continue
        seqs = [s + p for s in seqs for p in parts if p][:cap] or seqs
    return [s for s in seqs if s]


def hostile_runs(pattern: re.Pattern[Any]) -> Iterator[str]:
    tree = P.parse(
        pattern.pattern.decode("latin-1")
        if isinstance(pattern.pattern, bytes)
        else pattern.pattern,
        pattern.flags & ~re.UNICODE if isinstance(pattern.pattern, bytes) else pattern.flags,
    )
    per_seq: list[list[tuple[str, str]]] = []
    for seq in _sequences(tree, cap=8):
        seq = seq[:16]
        first = "".join(c[0] for c in seq)
        prefixes = [("", first[:k]) for k in range(len(seq), 0, -1)]  # each prefix, repeated
        classes, literals = [], []  # each atom repeated after its own prefix, classes first
        for i in range(len(seq) - 1, -1, -1):
            runs = [(first[:i], c) for c in seq[i][:2]]
            (classes if len(seq[i]) > 1 else literals).extend(runs)
        mixed = [u for pair in itertools.zip_longest(classes, prefixes) for u in pair if u]
        per_seq.append(mixed + literals)
    units: dict[tuple[str, str], None] = {}  # round robin over the alternatives, up to MAX_RUNS
    for row in itertools.zip_longest(*per_seq):
        units.update((u, None) for u in row if u is not None)
    for prefix, run in list(units)[:MAX_RUNS]:
        yield prefix + run * (SIZE // len(run)) + END
        if not prefix:
            yield (run + "\n") * (SIZE // (len(run) + 1))  # as many lines


class _TooSlow(Exception):
    pass


def _alarm(signum: int, frame: Any) -> None:
    raise _TooSlow  # `re` checks for signals while it matches


def slowest(pattern: re.Pattern[Any]) -> tuple[float, str]:
    """The longest any hostile run took one `finditer` of the pattern, and that run."""
    worst, worst_run = 0.0, ""
    old = signal.signal(signal.SIGALRM, _alarm)
    try:
        for run in hostile_runs(pattern):
            text: Any = (
                run.encode("latin-1", "replace") if isinstance(pattern.pattern, bytes) else run
            )
            start = time.perf_counter()
            signal.setitimer(signal.ITIMER_REAL, LIMIT_S * 4)
            try:
                for _ in pattern.finditer(text):
                    pass
            except _TooSlow:
                pass
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
            took = time.perf_counter() - start
            if took > worst:
                worst, worst_run = took, run
            if worst > LIMIT_S:
                break
    finally:
        signal.signal(signal.SIGALRM, old)
    return worst, worst_run


PATTERNS = all_patterns()


def test_the_patterns_are_found() -> None:
    """The collection sees what it must: the two patterns of the issue, the redactor's token
    table, inline patterns, and the knowledge files' signatures."""
    names = " ".join(PATTERNS)
    for needle in ("_IS_AVAILABLE_CALL", "_ULIMIT_L", "redact._TOKENS", "_FAST_CLI_FLAG",
                   "signatures.yaml:", "nccl_floors.yaml:", "flows/slack/app.py:"):  # fmt: skip
        assert needle in names, needle
    assert len(PATTERNS) > 150, len(PATTERNS)


def test_the_runs_reproduce_the_issues_cases() -> None:
    """The generator builds the runs of the issue from the patterns themselves."""
    runs = list(hostile_runs(re.compile(r"\bxox[abposre]-[A-Za-z0-9\-]{10,}(?![A-Za-z0-9_\-])")))
    assert any(re.match(r"(xox[a-z]-){3}", r) and r.endswith(END) for r in runs)
    runs = list(hostile_runs(re.compile(r"is_available\(\)[)\"'\s]*(?:->|=)?\s*$")))
    assert any(r.startswith("is_available()   ") and r.endswith(END) for r in runs)


@pytest.mark.parametrize("name", sorted(PATTERNS))
def test_every_pattern_is_linear_on_hostile_runs(name: str) -> None:
    took, run = slowest(PATTERNS[name])
    assert took < LIMIT_S, (
        f"{name} took {took:.2f} s on a {len(run)}-character run of {run[:40]!r}...{run[-8:]!r}"
    )


# -- the issue's reproductions, through the code that ran them ---------------------------------
def _timed(fn: Any, *args: Any) -> float:
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


def test_a_pasted_why_of_is_available_lines_is_diagnosed_at_once(tmp_path: Path) -> None:
    """200 lines of `is_available()` and spaces (79 kB) took `classify` 31 s; `/cudamedic why`
    of 20,000 characters held the Slack app's GIL for 15 s. And ulimit-shaped lines."""
    from flows.slack.app import diagnose_text
    from runbooks.collect.evidence.probes import parse_ulimit

    diagnose_text("warm up: the knowledge tables load once", tmp_path)

    pasted = ("print(torch.cuda.is_available()" + " " * 360 + "\n") * 200
    assert _timed(diagnose_text, pasted, tmp_path) < 3.0
    assert _timed(diagnose_text, pasted[:20000], tmp_path) < 2.0
    assert _timed(parse_ulimit, "memlock " * 12_000 + "x") < LIMIT_S
    assert _timed(parse_ulimit, "stack " * 16_000 + "x") < LIMIT_S
    # what the patterns read is unchanged
    assert parse_ulimit("max locked memory       (kbytes, -l) 64\n").memlock_kb == 64
    assert parse_ulimit("stack size (kbytes, -s) unlimited\n").stack_kb == -1
    assert parse_ulimit("memlock  unlimited  \n").memlock_kb == -1


@pytest.mark.parametrize(
    "run",
    [
        "-xoxb" * 16_000 + "_",
        "-xapp-1" * 12_000 + "_",
        "-eyJ" * 20_000 + "_",
        "\x01-pw " * 16_000,
        "--token " * 12_000,
        "AccountKey=" * 9_000 + "!",
        "set -" * 20_000 + "_",
    ],
    ids=["xoxb", "xapp", "jwt", "flag", "flag-words", "azure", "set-config"],
)
def test_the_redactor_is_linear_on_the_issues_runs(run: str) -> None:
    """`-xoxb` x n + `_` (80 kB) took the redactor 9 s, a 120 kB log line `collect` 28 s."""
    from runbooks.collect.redact import redact_text

    assert _timed(redact_text, run) < 1.0
    assert _timed(redact_text, run + "\n" + run) < 2.0


def test_tokens_still_redacted_after_the_linear_rewrite() -> None:
    from runbooks.collect.redact import MASK, redact_text

    slack = "xoxb-" + "1234567890-" * 3 + "abcdefABCDEF"
    jwt = (
        "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0."
        "dozjgNryP4J3jVmNHl0w5N_XgL0n3I9PlFUP0THsR8U"
    )
    for line in (f"token={slack}", f"auth: {jwt}", "run --pw s3cr3t -v", f"x={jwt} y"):
        out = redact_text(line)
        assert MASK in out and "s3cr3t" not in out and slack not in out and jwt not in out, out
