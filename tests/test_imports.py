"""The house's rules, read from the source (ast, nothing imported or run) (issue 28).

The pipeline's stages, lowest first; a module may import its own stage and the stages below it:

    runbooks.core, runbooks.knowledge  what every stage uses (errors, models, taxonomy, settings)
    runbooks.collect                    reach a host, gather a bundle, read it back
    runbooks.diagnose                   facts, rules, the diagnosis, similar incidents, the sweep
    reports                             post-mortem and Slack rendering (of core's models)
    runbooks.fix                        plan, approve, lock, recreate, verify, roll back
    flows                               the Prefect flows, the Slack app, the HTTP endpoints
    runbooks.cli                        the `cudamedic` command

Every module belongs to one stage; no import goes up; an import into another runbooks stage names
a module that stage's `__init__` lists in `__all__` (its public face); no two modules import each
other, directly or round a longer circle (imports inside functions and under TYPE_CHECKING count:
each is a dependency all the same).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("runbooks", "flows", "reports")
STAGES = (
    ("runbooks.core", 0),
    ("runbooks.knowledge", 0),
    ("runbooks.collect", 1),
    ("runbooks.diagnose", 2),
    ("reports", 3),
    ("runbooks.fix", 4),
    ("flows", 5),
    ("runbooks.cli", 6),
)


def _modules() -> dict[str, Path]:
    out = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            out[name] = path
    return out


MODULES = _modules()


def _imports(name: str, path: Path) -> set[str]:
    """The modules of ours that `name` imports (a `from X import y` of a module y counts as
    X.y, else as X)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text("utf-8"))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join([*base, node.module] if node.module else base)
            else:
                module = node.module or ""
            for alias in node.names:
                sub = f"{module}.{alias.name}"
                found.add(sub if sub in MODULES else module)
    return {m for m in found if m in MODULES and m != name}


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def stage_of(module: str) -> tuple[str, int] | None:
    """The stage a module belongs to: the longest stage prefix; `runbooks` itself (the version)
    is core's."""
    if module == "runbooks":
        return ("runbooks.core", 0)
    best = None
    for stage, rank in STAGES:
        if (module == stage or module.startswith(stage + ".")) and (
            best is None or len(stage) > len(best[0])
        ):
            best = (stage, rank)
    return best


def _public(stage: str) -> set[str] | None:
    """The names in a stage package's `__all__`, or None where it has none."""
    init = MODULES.get(stage)
    if init is None or init.name != "__init__.py":
        return None
    for node in ast.parse(init.read_text("utf-8")).body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
        ):
            return {ast.literal_eval(e) for e in node.value.elts}  # type: ignore[attr-defined]
    return None


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one node (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on.add(start)
        while work:
            node, edges = work[-1]
            nxt = next(edges, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on.add(nxt)
                    work.append((nxt, iter(sorted(graph.get(nxt, ())))))
                elif nxt in on:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    top = stack.pop()
                    on.discard(top)
                    component.append(top)
                    if top == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


def test_every_module_belongs_to_a_stage() -> None:
    homeless = [m for m in MODULES if stage_of(m) is None]
    # a module at the top of runbooks/ is in no stage: it belongs in one of the packages
    homeless += [m for m in MODULES if m.count(".") == 1 and m.startswith("runbooks.")]
    homeless = [m for m in homeless if m not in dict(STAGES)]
    assert not homeless, f"modules in no stage: {sorted(set(homeless))}"


def test_no_import_goes_up_a_stage() -> None:
    upward = []
    for module, imported in GRAPH.items():
        mine = stage_of(module)
        for other in imported:
            theirs = stage_of(other)
            if mine and theirs and theirs[1] > mine[1]:
                upward.append(f"{module} ({mine[0]}) imports {other} ({theirs[0]})")
    assert not upward, "imports up a stage:\n" + "\n".join(sorted(upward))


def test_another_stage_is_used_through_its_public_face() -> None:
    private = []
    for module, imported in GRAPH.items():
        mine = stage_of(module)
        for other in imported:
            theirs = stage_of(other)
            if not mine or not theirs or theirs[0] == mine[0] or other in (theirs[0], "runbooks"):
                continue
            public = _public(theirs[0])
            first = other[len(theirs[0]) + 1 :].split(".")[0]
            if public is not None and first not in public:
                private.append(f"{module} imports {other}, not in {theirs[0]}.__all__")
    assert not private, "\n".join(sorted(private))


def test_no_import_circle_between_modules() -> None:
    circles = _cycles(GRAPH)
    assert not circles, "import circles: " + "; ".join(" <-> ".join(c) for c in circles)


def test_no_import_circle_between_stages() -> None:
    stages: dict[str, set[str]] = {s: set() for s, _ in STAGES}
    for module, imported in GRAPH.items():
        mine = stage_of(module)
        for other in imported:
            theirs = stage_of(other)
            if mine and theirs and theirs[0] != mine[0]:
                stages[mine[0]].add(theirs[0])
    circles = _cycles(stages)
    assert not circles, "stage circles: " + "; ".join(" <-> ".join(c) for c in circles)


def test_the_rules_catch_what_they_are_for() -> None:
    """The checks themselves, on small graphs: a circle and an upward import are found."""
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []
    assert stage_of("runbooks.collect.remote.ssh") == ("runbooks.collect", 1)
    assert stage_of("flows.slack.app") == ("flows", 5)
    assert stage_of("runbooks.cli.main") == ("runbooks.cli", 6)
    assert "collector" in (_public("runbooks.collect") or set())
