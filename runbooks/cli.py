"""The `cudamedic` command line. Heavy modules are imported inside each command, not at start.

Exit status: 0 done (a diagnosis was made, a bundle was written), 2 usage or input error,
3 target error (host unreachable and nothing could be collected), 1 unexpected internal error.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from runbooks.inventory import Inventory
    from runbooks.settings import Settings
    from runbooks.target import Target


def _settings(args: argparse.Namespace, **extra: object) -> Settings:
    from runbooks.settings import load_settings

    return load_settings(inventory=getattr(args, "inventory", None), **extra)


def _inventory(settings: Settings) -> Inventory | None:
    from runbooks.inventory import load_inventory

    return load_inventory(settings.inventory) if settings.inventory else None


def cmd_collect(args: argparse.Namespace) -> int:
    import concurrent.futures

    from runbooks.bundle import write_tar
    from runbooks.collect import collect
    from runbooks.errors import InputError
    from runbooks.target import resolve_target

    settings = _settings(args)
    inventory = _inventory(settings)
    specs = list(args.target)
    if args.all:
        if inventory is None:
            raise InputError("--all needs an inventory (--inventory or CUDAMEDIC_INVENTORY)")
        specs += sorted(inventory.hosts)
    if not specs:
        raise InputError("name a TARGET, or --all for every inventory host")
    if args.container and len(specs) > 1:
        raise InputError("--container applies to one TARGET only")
    targets = [resolve_target(spec, inventory) for spec in dict.fromkeys(specs)]

    def one(target: Target) -> str:
        path = collect(
            target, settings, container=args.container, out_dir=args.out, trigger=args.trigger
        )
        return str(write_tar(path) if args.tar else path)

    # Hosts are independent: collect them at once, each bounded by its own timeouts.
    unreachable = 0
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(16, len(targets))) as pool:
        for path in pool.map(one, targets):
            print(path)
            if _unreachable(Path(path)):
                unreachable += 1
    if unreachable:
        print(
            f"cudamedic: {unreachable} target(s) could not be reached; see bundle.json",
            file=sys.stderr,
        )
        return 3
    return 0


def _unreachable(bundle: Path) -> bool:
    """Did the bundle's collection fail to reach its host at all?"""
    import json

    meta = bundle / "bundle.json"
    if not meta.exists():  # a .tar.gz: the directory beside it holds the same bundle.json
        meta = bundle.with_name(bundle.name.removesuffix(".tar.gz")) / "bundle.json"
    try:
        findings = json.loads(meta.read_text()).get("findings", [])
    except (OSError, ValueError):
        return False
    return any(f.get("code") == "target-unreachable" for f in findings)


def cmd_classify(args: argparse.Namespace) -> int:
    import json

    from runbooks.classify import classify_path, render_text, to_json

    diagnosis = classify_path(args.path)
    if args.json:
        print(json.dumps(to_json(diagnosis), indent=2))
    else:
        print(render_text(diagnosis))
    return 0


def cmd_fix(args: argparse.Namespace) -> int:
    from runbooks.fixer import (
        execute,
        prepare,
        refusal,
        render_outcome,
        render_plan,
        write_postmortem,
    )
    from runbooks.journal import now
    from runbooks.policy import load_policy
    from runbooks.target import resolve_target

    started = now()
    settings = _settings(args, policy=args.policy)
    target = resolve_target(args.target, _inventory(settings))
    policy = load_policy(settings.policy)
    prepared = prepare(target, args.container, settings, trigger=args.trigger)
    print(render_plan(prepared))
    if prepared.plan is None:
        return 0
    if not args.apply:
        print("dry run: nothing was changed. Add --apply (and --yes) to make this change.")
        return 0
    confirmed = args.yes or _confirm(f"Apply this change to {target.name}/{args.container}?")
    tags = target.host.tags if target.host else ()
    why = refusal(prepared.plan, tags, policy, settings, confirmed)
    if why is not None:
        print(f"cudamedic: refused: {why}", file=sys.stderr)
        return 4
    outcome = execute(target, prepared, settings)
    print(render_outcome(outcome))
    report = write_postmortem(prepared, outcome, settings, target.name, started, args.trigger)
    print(f"report: {report}")
    return {"fixed": 0, "recovered": 0, "rolled-back": 5}.get(outcome.status, 6)


def cmd_rollback(args: argparse.Namespace) -> int:
    from runbooks.fixer import render_outcome, rollback
    from runbooks.target import resolve_target

    settings = _settings(args)
    target = resolve_target(args.target, _inventory(settings))
    outcome = rollback(target, args.container, settings)
    print(render_outcome(outcome))
    return 0 if outcome.status in ("rolled-back", "recovered", "nothing-to-do") else 6


def _confirm(question: str) -> bool:
    if not sys.stdin.isatty():
        return False
    answer = input(f"{question} [y/N] ").strip().lower()
    return answer in ("y", "yes")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cudamedic",
        description="Incident response for GPU hosts running PyTorch-CUDA containers.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress to stderr")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("collect", help="gather an evidence bundle from a host")
    p.add_argument(
        "target",
        nargs="*",
        help="'local', an inventory host name, or ssh://user@host[:port] (several: "
        "collected at once)",
    )
    p.add_argument("--all", action="store_true", help="every host of the inventory")
    p.add_argument("--container", help="the container to examine (default: every GPU container)")
    p.add_argument("--out", type=Path, help="directory for bundles (default: ./bundles)")
    p.add_argument("--inventory", type=Path, help="inventory file (YAML or Ansible YAML/INI)")
    p.add_argument("--trigger", help="the text that triggered this (e.g. a pasted error)")
    p.add_argument("--tar", action="store_true", help="also pack the bundle as .tar.gz")
    p.set_defaults(func=cmd_collect)

    p = sub.add_parser("fix", help="plan (and with --apply, make) the safe fix for a container")
    p.add_argument("target", help="'local', an inventory host name, or ssh://user@host[:port]")
    p.add_argument("--container", required=True)
    p.add_argument("--apply", action="store_true", help="make the change (default: dry run)")
    p.add_argument("--yes", action="store_true", help="do not ask for confirmation")
    p.add_argument("--policy", type=Path, help="fix policy (unattended classes, blast radius)")
    p.add_argument("--inventory", type=Path)
    p.add_argument("--trigger", help="the text that triggered this")
    p.set_defaults(func=cmd_fix)

    p = sub.add_parser("rollback", help="restore the container a fix replaced (its backup)")
    p.add_argument("target")
    p.add_argument("--container", required=True)
    p.add_argument("--inventory", type=Path)
    p.set_defaults(func=cmd_rollback)

    p = sub.add_parser("classify", help="diagnose a bundle (directory, .tar.gz or a log file)")
    p.add_argument("path", type=Path)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_classify)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    from runbooks.errors import CudamedicError, InputError, TargetError

    try:
        return int(args.func(args))
    except InputError as exc:
        print(f"cudamedic: error: {exc}", file=sys.stderr)
        return 2
    except TargetError as exc:
        print(f"cudamedic: target error: {exc}", file=sys.stderr)
        return 3
    except CudamedicError as exc:
        print(f"cudamedic: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("cudamedic: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
