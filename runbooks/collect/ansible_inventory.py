"""Ansible inventories as Ansible reads them: every host's flattened variables and its groups.

Two sources give the same `AnsibleHosts`:

* ``ansible-inventory -i PATH --list`` when it is installed (`run_ansible_inventory`, the only
  subprocess here; `parse_ansible_json` reads its output), the source of truth;
* our own reader (`read_ansible`) for machines without Ansible: INI (``[g:vars]``,
  ``[g:children]``, ``host:port``, ranges ``node[01:16]``, ``node[a:c]``, ``node[01:16:2]``),
  YAML (``vars``/``children``/``hosts``), an inventory directory, and ``group_vars/`` and
  ``host_vars/`` next to the inventory file (or in the inventory directory).

Variables are flattened with Ansible's default precedence, lowest first: the ``all`` group's
inventory vars; the host's other groups' inventory vars (by depth, ``ansible_group_priority``,
name); ``group_vars/all``; ``group_vars/<group>`` in the same group order; the host's own
inventory vars; ``host_vars/<host>``. Not read by our reader: inventory plugins (``plugin:``
files), executable inventory scripts, vault-encrypted values; Jinja templates in values are kept
as text on both paths. Every error is an InputError naming the file.
"""

from __future__ import annotations

import ast
import contextlib
import json
import os
import re
import shlex
import signal
import string
import subprocess
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from runbooks.core.errors import InputError

MAX_HOSTS = 10_000  # hosts one inventory (or one range) may expand to
MAX_GROUPS = 10_000
YAML_EXTS = (".yml", ".yaml", ".json")  # Ansible's YAML_FILENAME_EXTENSIONS
# Ansible's INVENTORY_IGNORE_EXTS (REJECT_EXTS + .orig, .cfg, .retry) for directory sources.
IGNORE_EXTS: tuple[str, ...] = (".pyc", ".pyo", ".swp", ".bak", "~", ".rpm", ".md", ".txt")
IGNORE_EXTS += (".rst", ".orig", ".cfg", ".retry")


@dataclass(frozen=True)
class AnsibleHost:
    """One host as Ansible sees it: flattened variables and every group it is in (without
    ``all`` and ``ungrouped``), sorted."""

    vars: dict[str, Any]
    groups: tuple[str, ...]


AnsibleHosts = dict[str, AnsibleHost]


# -- the tree: groups, hosts, variables, as Ansible's InventoryData holds them ------------------
@dataclass
class _Group:
    vars: dict[str, Any] = field(default_factory=dict)
    hosts: list[str] = field(default_factory=list)
    children: list[str] = field(default_factory=list)
    priority: int = 1


@dataclass
class Tree:
    groups: dict[str, _Group] = field(
        default_factory=lambda: {"all": _Group(), "ungrouped": _Group()}
    )
    hosts: dict[str, dict[str, Any]] = field(default_factory=dict)  # host -> its own vars

    def group(self, name: Any, where: str) -> _Group:
        if not isinstance(name, str) or not name:
            raise InputError(f"{where}: invalid group name {name!r}")
        if name not in self.groups:
            if len(self.groups) >= MAX_GROUPS:
                raise InputError(f"{where}: more than {MAX_GROUPS} groups")
            self.groups[name] = _Group()
        return self.groups[name]

    def add_host(self, name: str, group: str, port: int | None, where: str) -> dict[str, Any]:
        if not name:
            raise InputError(f"{where}: empty host name")
        if name not in self.hosts:
            if len(self.hosts) >= MAX_HOSTS:
                raise InputError(f"{where}: more than {MAX_HOSTS} hosts")
            self.hosts[name] = {} if port is None else {"ansible_port": port}
        members = self.group(group, where).hosts
        if name not in members:
            members.append(name)
        return self.hosts[name]

    def add_child(self, parent: str, child: str, where: str) -> None:
        self.group(child, where)
        if parent == child or parent in self._descendants(child):
            raise InputError(f"{where}: group {child!r} as a child of {parent!r} makes a loop")
        children = self.group(parent, where).children
        if child not in children:
            children.append(child)

    def set_group_var(self, group: str, key: Any, value: Any, where: str) -> None:
        if key != "ansible_group_priority":  # the group's place in the order, not a variable
            self.group(group, where).vars[str(key)] = value
            return
        try:
            self.group(group, where).priority = int(value)
        except (TypeError, ValueError, OverflowError):
            raise InputError(f"{where}: ansible_group_priority {value!r} is not a number") from None

    def _descendants(self, name: str) -> set[str]:
        seen: set[str] = set()
        todo = [name]
        while todo:
            for child in self.groups[todo.pop()].children:
                if child not in seen:
                    seen.add(child)
                    todo.append(child)
        return seen


# -- flattening: Ansible's precedence ---------------------------------------------------------
@dataclass(frozen=True)
class VarsFiles:
    """``group_vars/`` and ``host_vars/`` contents: name -> variables."""

    groups: Mapping[str, dict[str, Any]] = field(default_factory=dict)
    hosts: Mapping[str, dict[str, Any]] = field(default_factory=dict)


def flatten(tree: Tree, files: VarsFiles | None = None) -> AnsibleHosts:
    files = files or VarsFiles()
    parents: dict[str, set[str]] = {name: set() for name in tree.groups}
    for name, group in tree.groups.items():
        for child in group.children:
            parents[child].add(name)
    for name in tree.groups:  # reconcile: a group without a parent is a child of all
        if name != "all" and not parents[name]:
            parents[name].add("all")
    depth: dict[str, int] = {}

    def depth_of(name: str) -> int:  # the longest path from all; the graph has no loops
        if name not in depth:
            depth[name] = max((depth_of(p) + 1 for p in parents[name]), default=0)
        return depth[name]

    direct: dict[str, set[str]] = {host: set() for host in tree.hosts}
    for name, group in tree.groups.items():
        for host in group.hosts:
            direct[host].add(name)
    out: AnsibleHosts = {}
    for host, own in tree.hosts.items():
        if not direct[host] - {"all", "ungrouped"}:
            direct[host].add("ungrouped")  # a host in no group is in ungrouped ...
        else:
            direct[host].discard("ungrouped")  # ... and only then
        groups = _ancestors(direct[host], parents) - {"all"}
        order = sorted(groups, key=lambda g: (depth_of(g), tree.groups[g].priority, g))
        merged = dict(tree.groups["all"].vars)
        for g in order:
            merged.update(tree.groups[g].vars)
        merged.update(files.groups.get("all", {}))
        for g in order:
            merged.update(files.groups.get(g, {}))
        merged.update(own)
        merged.update(files.hosts.get(host, {}))
        out[host] = AnsibleHost(vars=merged, groups=tuple(sorted(groups - {"ungrouped"})))
    return out


def _ancestors(start: Iterable[str], parents: Mapping[str, Iterable[str]]) -> set[str]:
    seen = set(start)
    todo = list(seen)
    while todo:
        for parent in parents.get(todo.pop(), ()):
            if parent not in seen:
                seen.add(parent)
                todo.append(parent)
    return seen


# -- host patterns: host:port and ranges ------------------------------------------------------
_HOSTPORT = re.compile(r"^((?:[^:\[\]]|\[[^\]]*\])*):([0-9]+)$")
_BRACKETED = re.compile(r"^\[(.+)\]:([0-9]+)$")


def expand_host_pattern(pattern: str, where: str) -> tuple[list[str], int | None]:
    """``node[01:03]:2222`` -> (['node01', 'node02', 'node03'], 2222), as Ansible expands it."""
    port = None
    match = _BRACKETED.match(pattern) or _HOSTPORT.match(pattern)
    if match and match.group(1) and not match.group(1).endswith(("-", "_")):
        pattern, port = match.group(1), int(match.group(2))
    elif pattern.endswith(":"):
        raise InputError(f"{where}: host pattern {pattern!r} ends in ':' without a port")
    return _expand_ranges(pattern, where), port


def _expand_ranges(pattern: str, where: str) -> list[str]:
    if "[" not in pattern:
        return [pattern]
    head, _, rest = pattern.partition("[")
    spec, closed, tail = rest.partition("]")
    bounds = spec.split(":")
    if not closed or len(bounds) not in (2, 3):
        raise InputError(f"{where}: host range in {pattern!r} must be [begin:end] or [b:e:step]")
    beg, end = bounds[0] or "0", bounds[1]
    try:
        step = int(bounds[2]) if len(bounds) == 3 else 1
        if step < 1:
            raise ValueError("step must be positive")
        if beg in string.ascii_letters and end in string.ascii_letters and len(beg) == 1:
            i, j = string.ascii_letters.index(beg), string.ascii_letters.index(end)
            if i > j:
                raise ValueError("begin must be <= end")
            items = list(string.ascii_letters[i : j + 1 : step])
        else:
            width = len(beg) if beg.startswith("0") and len(beg) > 1 else 0
            if width and len(end) != width:
                raise ValueError("begin and end must have the same width")
            lo, hi = int(beg), int(end)
            if (hi - lo) // step >= MAX_HOSTS:
                raise ValueError(f"more than {MAX_HOSTS} hosts")
            items = [str(n).zfill(width) for n in range(lo, hi + 1, step)]
    except ValueError as exc:
        raise InputError(f"{where}: host range in {pattern!r}: {exc}") from None
    out: list[str] = []
    for item in items:
        out.extend(_expand_ranges(f"{head}{item}{tail}", where))
        if len(out) > MAX_HOSTS:
            raise InputError(f"{where}: host range {pattern!r} gives more than {MAX_HOSTS} hosts")
    return out


# -- INI -------------------------------------------------------------------------------------
_SECTION = re.compile(r"^\[([^:\]\s]+)(?::(\w+))?\]\s*(?:#.*)?$")
_GROUP_NAME = re.compile(r"^([^:\]\s]+)\s*(?:#.*)?$")


def parse_value(text: str) -> Any:
    """An INI value as Ansible reads it: a Python literal if it is one, else the text."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", SyntaxWarning)
            value = ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return text
    return _plain_literal(value)


def _plain_literal(value: Any) -> Any:
    if isinstance(value, list | tuple | set | frozenset):
        return [_plain_literal(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain_literal(v) for k, v in value.items()}
    if value is Ellipsis:
        return "..."
    if isinstance(value, complex):
        return str(value)
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    return value


def parse_ini(text: str, path: Path, tree: Tree) -> None:
    """Add an INI inventory's groups, hosts and variables to the tree."""
    group, state = "ungrouped", "hosts"
    declared = {"all", "ungrouped", *tree.groups}
    referenced: dict[str, int] = {}  # group -> first line naming it in :vars or :children
    for lineno, line in enumerate(text.splitlines(), 1):
        where = f"inventory {path}:{lineno}"
        line = line.strip()
        if not line or line[0] in "#;":
            continue
        section = _SECTION.match(line)
        if section:
            group, state = section.group(1), section.group(2) or "hosts"
            if state not in ("hosts", "children", "vars"):
                raise InputError(f"{where}: section [{group}:{state}] has an unknown type")
            tree.group(group, where)
            if state == "vars":
                referenced.setdefault(group, lineno)
            else:
                declared.add(group)
            continue
        if line.startswith("["):
            raise InputError(f"{where}: invalid section {line[:80]!r}")
        if state == "hosts":
            _ini_hosts(line, group, tree, where)
        elif state == "vars":
            key, eq, value = line.partition("=")
            if not eq:
                raise InputError(f"{where}: expected key=value, got {line[:80]!r}")
            tree.set_group_var(group, key.strip(), parse_value(value.strip()), where)
        else:
            child = _GROUP_NAME.match(line)
            if not child:
                raise InputError(f"{where}: expected a group name, got {line[:80]!r}")
            referenced.setdefault(child.group(1), lineno)
            tree.add_child(group, child.group(1), where)
    for name, lineno in referenced.items():
        if name not in declared:
            raise InputError(f"inventory {path}:{lineno}: group {name!r} is never declared")


def _ini_hosts(line: str, group: str, tree: Tree, where: str) -> None:
    try:
        tokens = shlex.split(line, comments=True)
    except ValueError as exc:
        raise InputError(f"{where}: {exc}") from None
    if not tokens:
        return
    names, port = expand_host_pattern(tokens[0], where)
    if any(n.strip() == "---" for n in names):
        raise InputError(f"{where}: '---' is not a host (a YAML file read as INI?)")
    hostvars = {}
    for token in tokens[1:]:
        key, eq, value = token.partition("=")
        if not eq:
            raise InputError(f"{where}: expected key=value, got {token[:80]!r}")
        hostvars[key] = parse_value(value)
    for name in names:
        tree.add_host(name, group, port, where).update(hostvars)


# -- YAML ------------------------------------------------------------------------------------
def parse_yaml(data: Mapping[Any, Any], path: Path, tree: Tree) -> None:
    """Add a YAML inventory's groups (top-level keys), hosts and variables to the tree."""
    where = f"inventory {path}"
    if not data:
        raise InputError(f"{where}: empty YAML inventory")
    if data.get("plugin"):
        raise InputError(
            f"{where}: an inventory plugin configuration; only ansible-inventory reads those"
        )
    visits = 0

    def group(name: Any, node: Any, stack: tuple[int, ...]) -> None:
        nonlocal visits
        visits += 1
        if visits > MAX_GROUPS:
            raise InputError(f"{where}: more than {MAX_GROUPS} groups (repeated anchors?)")
        if node is not None and not isinstance(node, Mapping):
            return  # Ansible skips it (with a warning)
        if id(node) in stack:  # YAML anchors can make a group its own child
            raise InputError(f"{where}: group {name!r} contains itself")
        tree.group(name, where)
        if node is None:
            return
        sections = {}
        for key in ("vars", "children", "hosts"):
            value = node.get(key)
            if isinstance(value, str):
                value = {value: None}
            if value is not None and not isinstance(value, Mapping):
                raise InputError(f"{where}: group {name!r}: {key!r} must be a mapping")
            sections[key] = value
        for key in node:  # in the file's order, as Ansible applies them
            value = sections.get(str(key)) if key in sections else None
            if not value:
                continue
            if key == "vars":
                for var, val in value.items():
                    tree.set_group_var(name, var, val, where)
            elif key == "children":
                for child, cnode in value.items():
                    group(child, cnode, (*stack, id(node)))
                    tree.add_child(name, child, where)
            else:
                _yaml_hosts(name, value, tree, where)

    for name, node in data.items():
        group(name, node, ())


def _yaml_hosts(group: str, hosts: Mapping[Any, Any], tree: Tree, where: str) -> None:
    for pattern, hostvars in hosts.items():
        if not isinstance(pattern, str):
            raise InputError(f"{where}: host {pattern!r} must be a string (quote it)")
        if hostvars is not None and not isinstance(hostvars, Mapping):
            raise InputError(f"{where}: host {pattern!r} must be a mapping")
        names, port = expand_host_pattern(pattern, where)
        for name in names:
            tree.add_host(name, group, port, where).update(
                {str(k): v for k, v in (hostvars or {}).items()}
            )


# -- files, directories, group_vars/ and host_vars/ -------------------------------------------
def load_yaml(text: str, where: str) -> Any:
    try:
        return yaml.safe_load(text)
    except (yaml.YAMLError, ValueError) as exc:  # ValueError: an integer of 5000 digits
        raise InputError(f"{where} is not valid YAML: {exc}") from None
    except RecursionError:  # PyYAML composes nested collections recursively
        raise InputError(f"{where} is nested too deeply") from None


def read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"cannot read inventory {path}: {exc}") from exc


def sniff_yaml(text: str, path: Path) -> Any:
    """The file's YAML data; None where it is not YAML and may be INI (not .yml/.yaml/.json)."""
    try:
        return load_yaml(text, f"inventory {path}")
    except InputError:
        if path.suffix.lower() in YAML_EXTS:
            raise
        return None


def check_yaml_file(data: Any, path: Path) -> None:
    """A .yml/.yaml/.json inventory must be a mapping (for Ansible as for us)."""
    if path.suffix.lower() in YAML_EXTS and not isinstance(data, Mapping):
        raise InputError(
            f"inventory {path} must be a mapping ('hosts:' or Ansible groups such as 'all:')"
        )


def parse_source(text: str, data: Any, path: Path, tree: Tree) -> None:
    """One inventory file: YAML when it is a YAML mapping, else INI (not for .yml/.yaml/.json)."""
    check_yaml_file(data, path)
    if isinstance(data, Mapping):
        parse_yaml(data, path, tree)
    else:
        parse_ini(text, path, tree)


def read_ansible(path: Path, first: tuple[str, Any] | None = None) -> AnsibleHosts:
    """Our reader: a file or a directory of files, plus the group_vars/ and host_vars/ next to
    it. ``first`` is the file's text and its YAML data when the caller has read them already."""
    tree = Tree()
    if path.is_dir():
        for source in _directory_sources(path):
            text = read_text(source)
            parse_source(text, sniff_yaml(text, source), source, tree)
        base = path
    else:
        if first is None:
            text = read_text(path)
            first = (text, sniff_yaml(text, path))
        parse_source(*first, path, tree)
        base = path.parent
    if not tree.hosts:
        raise InputError(f"inventory {path}: no hosts")
    files = VarsFiles(
        groups=_vars_dir(base / "group_vars", tree.groups),
        hosts=_vars_dir(base / "host_vars", tree.hosts),
    )
    return flatten(tree, files)


def _directory_sources(path: Path) -> list[Path]:
    out: list[Path] = []
    for entry in sorted(path.iterdir()):
        name = entry.name
        if name.startswith(".") or name in ("group_vars", "host_vars", "vars_plugins"):
            continue
        if name.endswith(IGNORE_EXTS):
            continue
        out.extend(_directory_sources(entry) if entry.is_dir() else [entry])
    return out


def _vars_dir(directory: Path, names: Iterable[str]) -> dict[str, dict[str, Any]]:
    """group_vars/<name>[.yml|.yaml|.json] or group_vars/<name>/ (its files, sorted): the first
    of those that exists, as Ansible's host_group_vars plugin finds them."""
    out: dict[str, dict[str, Any]] = {}
    if not directory.is_dir():
        return out
    for name in names:
        merged: dict[str, Any] = {}
        for file in _vars_files(directory, name):
            data = load_yaml(read_text(file), f"vars file {file}")
            if data is None:
                continue
            if not isinstance(data, Mapping):
                raise InputError(f"vars file {file} must be a YAML mapping")
            merged.update({str(k): v for k, v in data.items()})
        if merged:
            out[name] = merged
    return out


def _vars_files(directory: Path, name: str) -> list[Path]:
    if "/" in name or name in (".", ".."):
        return []
    for ext in ("", *YAML_EXTS):
        candidate = directory / (name + ext)
        if candidate.is_dir():
            return _dir_vars_files(candidate)
        if candidate.is_file():
            return [candidate]
    return []


def _dir_vars_files(directory: Path) -> list[Path]:
    out: list[Path] = []
    for entry in sorted(directory.iterdir()):
        if entry.name.startswith(".") or entry.name.endswith("~"):
            continue
        if entry.is_dir() and not entry.suffix:
            out.extend(_dir_vars_files(entry))
        elif entry.is_file() and (not entry.suffix or entry.suffix in YAML_EXTS):
            out.append(entry)
    return out


# -- ansible-inventory --------------------------------------------------------------------------
def run_ansible_inventory(executable: str, path: Path, timeout: float) -> str:
    """``ansible-inventory -i PATH --list``'s JSON text. Run without a shell, in the inventory's
    directory (so playbook-adjacent group_vars are the inventory's own), with unparsable sources
    made errors; killed with its children after ``timeout`` seconds."""
    where = f"inventory {path}"
    cwd = path if path.is_dir() else path.parent
    env = {
        **os.environ,
        "ANSIBLE_INVENTORY_UNPARSED_FAILED": "True",
        "ANSIBLE_INVENTORY_ANY_UNPARSED_IS_FAILED": "True",
        "ANSIBLE_NOCOLOR": "True",
    }
    argv = [executable, "-i", str(path.resolve()), "--list"]
    try:
        proc = subprocess.Popen(
            argv,
            cwd=cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,  # its own process group: a timeout ends its children too
        )
    except OSError as exc:
        raise InputError(f"{where}: cannot run {executable}: {exc}") from exc
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise InputError(
            f"{where}: ansible-inventory did not finish within {timeout:g}s "
            "(a slow dynamic inventory or a prompt?)"
        ) from None
    if proc.returncode != 0:
        raise InputError(
            f"{where}: ansible-inventory failed (exit {proc.returncode}): {_ansible_error(err)}"
        )
    return out.decode("utf-8", errors="replace")


_PLUGIN_FAILED = re.compile(r"^\[WARNING\]: *Failed to parse .*?with '?(\w+)'? plugin: *(.*)$")


def _ansible_error(stderr: bytes) -> str:
    """What ansible-inventory's stderr says is wrong: each plugin's reason and the errors."""
    lines = [ln.strip() for ln in stderr.decode("utf-8", errors="replace").splitlines()]
    said = []
    for line in lines:
        failed = _PLUGIN_FAILED.match(line)
        if failed:
            said.append(f"{failed.group(1)} plugin: {failed.group(2)}")
        elif line.startswith(("[ERROR]", "ERROR!")):
            said.append(line.removeprefix("[ERROR]:").removeprefix("ERROR!").strip())
    text = "; ".join(said) or " | ".join(ln for ln in lines if ln)[-800:] or "no error output"
    return text if len(text) <= 1200 else text[:600] + " ... " + text[-600:]


def parse_ansible_json(text: str, path: Path) -> AnsibleHosts:
    """``ansible-inventory --list`` output -> hosts with flattened vars and all their groups."""
    where = f"inventory {path}: ansible-inventory output"
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise InputError(f"{where} is not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise InputError(f"{where} is not a JSON object")
    meta = data.get("_meta", {})
    hostvars = meta.get("hostvars", {}) if isinstance(meta, dict) else None
    if not isinstance(hostvars, dict):
        raise InputError(f"{where}: _meta.hostvars is not an object")
    parents: dict[str, set[str]] = {}
    direct: dict[str, set[str]] = {str(h): set() for h in hostvars}
    for name, group in data.items():
        if name == "_meta":
            continue
        if not isinstance(group, dict):
            raise InputError(f"{where}: group {name!r} is not an object")
        for key in ("hosts", "children"):
            members = group.get(key, [])
            if not isinstance(members, list) or not all(isinstance(m, str) for m in members):
                raise InputError(f"{where}: group {name!r}: {key} is not a list of names")
        for child in group.get("children", []):
            parents.setdefault(child, set()).add(name)
        for host in group.get("hosts", []):
            direct.setdefault(host, set()).add(name)
    out: AnsibleHosts = {}
    for host, groups in direct.items():
        hvars = _unwrap(hostvars.get(host, {}))
        if not isinstance(hvars, dict):
            raise InputError(f"{where}: hostvars of {host!r} is not an object")
        every = _ancestors(groups, parents) - {"all", "ungrouped"}
        out[host] = AnsibleHost(vars=hvars, groups=tuple(sorted(every)))
    return out


def _unwrap(value: Any, depth: int = 0) -> Any:
    """JSON as Ansible encodes it -> plain values (``{"__ansible_unsafe": x}`` -> x)."""
    if depth > 100:
        raise InputError("ansible-inventory output is nested too deeply")
    if isinstance(value, dict):
        if set(value) == {"__ansible_unsafe"}:
            return value["__ansible_unsafe"]
        if "__ansible_vault" in value:
            return "<vault-encrypted>"
        return {k: _unwrap(v, depth + 1) for k, v in value.items()}
    if isinstance(value, list):
        return [_unwrap(v, depth + 1) for v in value]
    return value
