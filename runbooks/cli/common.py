"""What every command group shares: exit statuses, terminal output, settings, the
inventory and the Prefect connection."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeAlias

if TYPE_CHECKING:
    from runbooks.collect.inventory import Inventory
    from runbooks.core.cli_json import FailedSource
    from runbooks.core.settings import Settings

    Subparsers: TypeAlias = argparse._SubParsersAction[argparse.ArgumentParser]

EXIT_OK, EXIT_INTERNAL, EXIT_INPUT, EXIT_UNREACHABLE = 0, 1, 2, 3
EXIT_REFUSED, EXIT_ROLLED_BACK, EXIT_FAILED, EXIT_INTERRUPTED = 4, 5, 6, 130


# What a fix or a response ended as -> exit status (README, "Exit status").
OUTCOME_EXIT = {
    "fixed": EXIT_OK,
    "recovered": EXIT_OK,
    "planned": EXIT_OK,
    "diagnosed": EXIT_OK,
    "needs-a-person": EXIT_OK,
    "nothing-to-fix": EXIT_OK,
    "no-such-container": EXIT_INPUT,
    "rejected": EXIT_REFUSED,
    "refused": EXIT_REFUSED,
    "approval-timed-out": EXIT_REFUSED,
    "rolled-back": EXIT_ROLLED_BACK,
    "unreachable": EXIT_UNREACHABLE,
    "locked": EXIT_REFUSED,
}


def show(text: object, *, err: bool = False) -> None:
    """Print text that may carry what a target sent (log lines, names, messages): control
    characters (ESC, CR, BEL, ...) are shown escaped, never sent to the terminal raw.
    `err`: to standard error (warnings, reasons)."""
    from runbooks.core.names import terminal_safe

    print(terminal_safe(str(text)), file=sys.stderr if err else sys.stdout)


def _progress() -> Any:
    """Show the steps of a flow run in this process as they run, on standard error: a live line
    on a terminal, plain lines otherwise (runbooks/core/progress.py). Standard output is untouched,
    so --json keeps it one object."""
    from runbooks.core.progress import attach

    return attach(sys.stderr, live=sys.stderr.isatty())


def _emit(args: argparse.Namespace, result: Any) -> None:
    """The one JSON object of a --json command, on the real standard output."""
    args.json_emitted = True
    print(result.dumps(), file=args.json_out, flush=True)


def _failures(bundle: Path) -> tuple[str | None, list[FailedSource]]:
    """Why a bundle's target could not be reached (None: it was), and its failed sources."""
    from runbooks.collect.collector import failed_sources, finding_message
    from runbooks.core.cli_json import FailedSource

    reason = finding_message(bundle, "target-unreachable")
    return reason, [FailedSource(name=n, error=e) for n, e in failed_sources(bundle)]


def _say_failures(name: str, bundle: Path) -> None:
    """Say on stderr why `name` could not be reached and which sources failed, one line each
    (the sources never tried because the host was unreachable: on one line)."""
    from runbooks.collect.collector import NOT_RUN_UNREACHABLE

    reason, failed = _failures(bundle)
    if reason is not None:
        show(f"cudamedic: {name} could not be reached: {reason}", err=True)
    elif failed:
        show(f"cudamedic: {name}: {len(failed)} source(s) failed (bundle {bundle}):", err=True)
    for f in failed:
        if f.error != NOT_RUN_UNREACHABLE:
            show(f"  {f.name}: {f.error}", err=True)
    if not_run := [f.name for f in failed if f.error == NOT_RUN_UNREACHABLE]:
        show(f"  not run (host unreachable): {', '.join(not_run)}", err=True)


def _settings(args: argparse.Namespace, **extra: object) -> Settings:
    from runbooks.core.settings import load_settings

    return load_settings(inventory=getattr(args, "inventory", None), **extra)


def _inventory(settings: Settings) -> Inventory | None:
    from runbooks.collect.inventory import load_inventory

    return load_inventory(settings.inventory) if settings.inventory else None


def _required_inventory(settings: Settings, who: str) -> Inventory:
    from runbooks.core.errors import InputError

    inventory = _inventory(settings)
    if inventory is None:
        raise InputError(f"{who} needs an inventory (--inventory or CUDAMEDIC_INVENTORY)")
    return inventory


def _prefect(args: argparse.Namespace, settings: Settings) -> str:
    """Point this process at the Prefect API (PREFECT_API_URL, else the embedded local server,
    started on first use). Must run before prefect is imported."""
    import os

    from flows.server import configure

    if not getattr(args, "verbose", False):
        # Step logs reach the Prefect API at INFO (the UI's Logs tab); the terminal shows
        # Prefect's warnings only (logging.yml's console handler, set by Prefect's own override).
        os.environ.setdefault("PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL", "WARNING")
    return configure(settings)


def _confirm(question: str) -> bool:
    if not sys.stdin.isatty():
        return False
    answer = input(f"{question} [y/N] ").strip().lower()
    return answer in ("y", "yes")


# -- the subcommands' parsers: one function each, listed in SUBCOMMANDS -----------------------
TARGET_HELP = "'local', an inventory host name, or ssh://user@host[:port]"


JSON_HELP = "print one JSON object (docs/cli-json.md)"
