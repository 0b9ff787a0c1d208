"""`cudamedic collect` and `cudamedic classify`: gather an evidence bundle; diagnose one."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from runbooks.cli.common import (
    EXIT_INPUT,
    EXIT_OK,
    EXIT_UNREACHABLE,
    JSON_HELP,
    TARGET_HELP,
    _emit,
    _failures,
    _inventory,
    _say_failures,
    _settings,
    show,
)

if TYPE_CHECKING:
    from runbooks.cli.common import Subparsers
    from runbooks.collect.inventory import Inventory
    from runbooks.collect.target import Target
    from runbooks.core.cli_json import CollectTarget
    from runbooks.core.settings import Settings


def cmd_collect(args: argparse.Namespace) -> int:
    from runbooks.core.cli_json import CollectResult

    settings = _settings(args)
    targets = _collect_targets(args, _inventory(settings))
    results = _collect_all(args, settings, targets)
    for r in results:
        if r.missing_container is not None:
            show(f"cudamedic: error: {r.missing_container}", err=True)
    code = _collect_exit(results)
    if args.json:
        _emit(args, CollectResult(exit_code=code, targets=results))
    return code


def _collect_targets(args: argparse.Namespace, inventory: Inventory | None) -> list[Target]:
    """The targets `collect` was asked for, each once (TARGETs, and with --all every inventory
    host); a combination that makes no sense is refused."""
    from runbooks.collect.target import resolve_target
    from runbooks.core.errors import InputError

    specs = list(args.target)
    if args.all:
        if inventory is None:
            raise InputError("--all needs an inventory (--inventory or CUDAMEDIC_INVENTORY)")
        specs += sorted(inventory.hosts)
    if not specs:
        raise InputError("name a TARGET, or --all for every inventory host")
    if args.container and len(specs) > 1:
        raise InputError("--container applies to one TARGET only")
    return [resolve_target(spec, inventory) for spec in dict.fromkeys(specs)]


def _collect_all(
    args: argparse.Namespace, settings: Settings, targets: list[Target]
) -> list[CollectTarget]:
    """Collect every target, printing each bundle's path and what failed in it, in order."""
    import concurrent.futures

    from runbooks.collect.bundle import write_tar
    from runbooks.collect.collector import collect, missing_container
    from runbooks.core.cli_json import CollectTarget

    def one(target: Target) -> str:
        path = collect(
            target, settings, container=args.container, out_dir=args.out, trigger=args.trigger
        )
        return str(write_tar(path) if args.tar else path)

    # Hosts are independent: collect them at once, each bounded by its own timeouts.
    results: list[CollectTarget] = []
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(16, len(targets))) as pool:
        for target, path in zip(targets, pool.map(one, targets), strict=True):
            show(path)
            _say_failures(target.name, Path(path))
            reason, failed = _failures(Path(path))
            results.append(
                CollectTarget(
                    target=target.name,
                    bundle=path,
                    reachable=reason is None,
                    reason=reason,
                    missing_container=missing_container(Path(path)),
                    failed_sources=failed,
                )
            )
    return results


def _collect_exit(results: list[CollectTarget]) -> int:
    """A container that does not exist is a usage error; else any unreachable target counts."""
    if any(r.missing_container is not None for r in results):
        return EXIT_INPUT
    if any(not r.reachable for r in results):
        return EXIT_UNREACHABLE
    return EXIT_OK


def cmd_classify(args: argparse.Namespace) -> int:
    import json

    from runbooks.diagnose.classify import classify_path, render_explain, render_text, to_json

    settings = _settings(args)
    if str(args.path) == "-":
        diagnosis = _classify_stdin(settings.state_path)
    else:
        from runbooks.collect.bundle import is_bundle_dir
        from runbooks.collect.collector import missing_container
        from runbooks.core.errors import InputError, NoSuchContainer

        path = Path(args.path)
        if path.is_dir() and not is_bundle_dir(path):
            raise InputError(
                f"{path} is not an evidence bundle: it has none of a bundle's files "
                "(bundle.json, nvidia-smi.txt, dmesg.txt, trigger.txt, containers/, commands/). "
                "Give a bundle directory (`cudamedic collect` prints one), a bundle .tar.gz, a "
                "log file, or - for pasted text"
            )
        if path.is_dir() and (why := missing_container(path)):
            raise NoSuchContainer(f"{why} (nothing to diagnose in {args.path})")
        diagnosis = classify_path(args.path, state_dir=settings.state_path)
    if args.json:
        args.json_emitted = True
        print(json.dumps(to_json(diagnosis), indent=2), file=args.json_out, flush=True)
    else:
        show(render_text(diagnosis))
        if args.explain:
            show(render_explain(diagnosis))
    return 0


STDIN_MAX_BYTES = 16 * 1024 * 1024


def _classify_stdin(state_dir: Path) -> Any:
    """A pasted error on standard input, classified as the text a person reported."""
    import tempfile

    from runbooks.collect.redact import redact_text
    from runbooks.core.errors import InputError
    from runbooks.diagnose.classify import classify_path

    if sys.stdin.isatty():  # a person at a terminal: say what the silence waits for
        print(
            "cudamedic: paste the error text, then press Ctrl-D on a new line (Ctrl-C cancels)",
            file=sys.stderr,
            flush=True,
        )
    data = sys.stdin.buffer.read(STDIN_MAX_BYTES + 1)
    if len(data) > STDIN_MAX_BYTES:
        raise InputError(f"standard input is over {STDIN_MAX_BYTES // 2**20} MiB: pass a file")
    with tempfile.TemporaryDirectory(prefix="cudamedic-paste-") as tmp:
        text = redact_text(data.decode("utf-8", errors="replace"))
        (Path(tmp) / "trigger.txt").write_text(text, encoding="utf-8")
        return classify_path(Path(tmp), state_dir=state_dir)


def collect_parser(sub: Subparsers) -> None:
    p = sub.add_parser("collect", help="gather an evidence bundle from a host")
    p.add_argument("target", nargs="*", help=f"{TARGET_HELP} (several: collected at once)")
    p.add_argument("--all", action="store_true", help="every host of the inventory")
    p.add_argument("--container", help="the container to examine (default: every GPU container)")
    p.add_argument("--out", type=Path, help="directory for bundles (default: ./bundles)")
    p.add_argument("--inventory", type=Path, help="inventory file (YAML or Ansible YAML/INI)")
    p.add_argument("--trigger", help="the text that triggered this (e.g. a pasted error)")
    p.add_argument("--tar", action="store_true", help="also pack the bundle as .tar.gz")
    p.add_argument("--json", action="store_true", help=JSON_HELP)
    p.set_defaults(func=cmd_collect)


def classify_parser(sub: Subparsers) -> None:
    p = sub.add_parser(
        "classify",
        help="diagnose a bundle (directory, .tar.gz or a log file; - reads a pasted error)",
    )
    p.add_argument("path", type=Path, help="bundle directory, .tar.gz, log file, or - (stdin)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument(
        "--explain",
        action="store_true",
        help="also list every class that matched, its evidence and why the winner won",
    )
    p.set_defaults(func=cmd_classify)
