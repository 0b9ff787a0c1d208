"""The `cudamedic` command line: the parser assembled from the command groups' modules, and
`main`. Heavy modules are imported inside each command, not at start.

- ``evidence``: collect, classify.            - ``respond``: triage, approve.
- ``fixing``: fix, rollback, confirm, audit, breaker.  - ``fleet``: sweep.
- ``services``: serve, alerts, slack, server.  - ``operators``: metrics, history, pending, worker.
- ``common``: exit statuses, output, settings, inventory and Prefect for all of them.

Exit status (README, "Exit status"): 0 done, 1 unexpected internal error (and the documented
"found something" answers of `sweep --fail-on-drain`, `server status`, `breaker status`),
2 usage or input error (a container that does not exist on a host that answered included),
3 target cannot be reached, 4 refused / rejected / not answered, 5 rolled back, 6 rollback
failed or another failure of the response, 130 interrupted.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

from runbooks.cli.common import (
    EXIT_FAILED,
    EXIT_INPUT,
    EXIT_INTERNAL,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_REFUSED,
    EXIT_UNREACHABLE,
    _emit,
)
from runbooks.cli.evidence import classify_parser, collect_parser
from runbooks.cli.fixing import (
    audit_parser,
    breaker_parser,
    confirm_parser,
    fix_parser,
    rollback_parser,
)
from runbooks.cli.fleet import sweep_parser
from runbooks.cli.operators import history_parser, metrics_parser, pending_parser, worker_parser
from runbooks.cli.respond import approve_parser, triage_parser
from runbooks.cli.services import alerts_parser, serve_parser, server_parser, slack_parser

if TYPE_CHECKING:
    from runbooks.cli.common import Subparsers

JSON_COMMANDS = ("collect", "fix", "triage", "sweep", "audit", "classify", "pending")


def cmd_completion(args: argparse.Namespace) -> int:
    print(bash_completion(build_parser()))
    return EXIT_OK


def bash_completion(parser: argparse.ArgumentParser) -> str:
    """A bash completion script generated from the parser: subcommands, their flags, and the
    choices of their positional arguments (other words complete as file names)."""
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    cases = []
    for name, p in sub.choices.items():
        shown = [a for a in p._actions if a.help != argparse.SUPPRESS]  # never a gone flag
        words = [o for a in shown for o in a.option_strings]
        words += [str(c) for a in shown if not a.option_strings for c in a.choices or ()]
        cases.append(f'        {name}) words="{" ".join(words)}" ;;')
    top = [o for a in parser._actions for o in a.option_strings] + list(sub.choices)
    return "\n".join(
        [
            '# cudamedic bash completion: eval "$(cudamedic completion bash)"',
            "_cudamedic() {",
            '    local cur=${COMP_WORDS[COMP_CWORD]} cmd="" words="" i',
            "    for ((i = 1; i < COMP_CWORD; i++)); do",
            "        case ${COMP_WORDS[i]} in -*) ;; *) cmd=${COMP_WORDS[i]}; break ;; esac",
            "    done",
            '    case "$cmd" in',
            f'        "") words="{" ".join(top)}" ;;',
            *cases,
            "    esac",
            '    COMPREPLY=($(compgen -W "$words" -- "$cur"))',
            '    [ ${#COMPREPLY[@]} -eq 0 ] && [ -n "$cmd" ] &&',
            '        COMPREPLY=($(compgen -f -- "$cur"))',
            "    return 0",
            "}",
            "complete -F _cudamedic cudamedic",
        ]
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cudamedic",
        description="Incident response for GPU hosts running PyTorch-CUDA containers.",
    )
    parser.add_argument(
        "-v",
        "--verbose",
        action="count",
        default=0,
        help="log progress to stderr (-vv: also every HTTP request and debug detail)",
    )
    parser.add_argument("--version", action="version", version=f"cudamedic {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    for add_subcommand in SUBCOMMANDS:
        add_subcommand(sub)
    return parser


def completion_parser(sub: Subparsers) -> None:
    p = sub.add_parser("completion", help="print a shell completion script")
    p.add_argument("shell", choices=["bash"])
    p.set_defaults(func=cmd_completion)


# Every subcommand, in the order `cudamedic --help` lists them. A new one: a `NAME_parser`
# function in its group's module (its arguments, `set_defaults(func=cmd_NAME)`) and its place here.
SUBCOMMANDS: tuple[Callable[[Subparsers], None], ...] = (
    collect_parser,
    fix_parser,
    confirm_parser,
    rollback_parser,
    triage_parser,
    approve_parser,
    audit_parser,
    sweep_parser,
    serve_parser,
    alerts_parser,
    slack_parser,
    server_parser,
    breaker_parser,
    completion_parser,
    classify_parser,
    metrics_parser,
    history_parser,
    pending_parser,
    worker_parser,
)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("cudamedic")
    except PackageNotFoundError:
        return "unknown (not installed)"


def _logging(verbose: int) -> None:
    level = logging.DEBUG if verbose > 1 else logging.INFO if verbose else logging.WARNING
    terminal = logging.StreamHandler()
    terminal.setLevel(level)  # Prefect's INFO step logs propagate here: they are for its API
    logging.basicConfig(
        level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", handlers=[terminal]
    )
    # One line per HTTP request (the Prefect client's) floods -v; -vv shows them.
    for name in ("httpx", "httpcore"):
        logging.getLogger(name).setLevel(logging.DEBUG if verbose > 1 else logging.WARNING)


def main(argv: list[str] | None = None) -> int:
    import contextlib

    parser = build_parser()
    args = _parse(parser, argv)
    _logging(args.verbose)
    json_mode = args.command in JSON_COMMANDS and bool(getattr(args, "json", False))
    # --json: the one object goes to the real stdout; everything else a command says to stderr.
    args.json_out, args.json_emitted = sys.stdout, False
    try:
        with contextlib.redirect_stdout(sys.stderr) if json_mode else contextlib.nullcontext():
            code, error = _run(args)
        if json_mode and not args.json_emitted:
            from runbooks.core.cli_json import ErrorResult

            _emit(args, ErrorResult(command=args.command, exit_code=code, error=error or "failed"))
    except BrokenPipeError:
        return _reader_gone()
    return code


def _reader_gone() -> int:
    """Standard output's reader went away (`cudamedic classify - | head`): what it wanted was
    written; stop quietly, as cat or grep do, and keep Python from complaining at exit."""
    import os

    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass
    return EXIT_OK


def _parse(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """Parse; an option the subcommand does not have is that subcommand's error (its own usage,
    not the top level's), with the closest option it does have."""
    import difflib

    args, extra = parser.parse_known_args(argv)
    if not extra:
        return args
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    command: argparse.ArgumentParser = sub.choices[args.command]
    options = [o for a in command._actions if a.help != argparse.SUPPRESS for o in a.option_strings]
    hints = []
    for word in extra:
        if word.startswith("-"):
            close = difflib.get_close_matches(word.split("=", 1)[0], options, n=1, cutoff=0.6)
            if close:
                hints.append(f"{word}: did you mean {close[0]}?")
    message = f"unrecognized arguments: {' '.join(extra)}"
    command.error(message + (" (" + "; ".join(hints) + ")" if hints else ""))


def _run(args: argparse.Namespace) -> tuple[int, str | None]:
    """Run the command: its exit status, and the error it stopped on (None: none)."""
    from runbooks.core.errors import (
        CudamedicError,
        FixError,
        InputError,
        RollbackFailed,
        TargetError,
    )
    from runbooks.core.names import terminal_safe as safe

    def fail(code: int, prefix: str, message: str) -> tuple[int, str]:
        print(f"cudamedic: {prefix}: {safe(message)}", file=sys.stderr)
        return code, message

    try:
        return int(args.func(args)), None
    except InputError as exc:
        return fail(EXIT_INPUT, "error", str(exc))
    except TargetError as exc:
        return fail(EXIT_UNREACHABLE, "target error", str(exc))
    except RollbackFailed as exc:
        return fail(EXIT_FAILED, "error", str(exc))
    except FixError as exc:  # another fix holds the lock, the container changed, ...: refused
        return fail(EXIT_REFUSED, "refused", str(exc))
    except CudamedicError as exc:
        return fail(EXIT_INTERNAL, "error", str(exc))
    except BrokenPipeError:  # the reader of standard output went away: main() stops quietly
        raise
    except KeyboardInterrupt as exc:  # flows/triage.py says what became of a response
        said = safe(str(exc))
        print(f"cudamedic: interrupted{': ' + said if said else ''}", file=sys.stderr)
        return EXIT_INTERRUPTED, "interrupted" + (f": {said}" if said else "")
    except Exception as exc:  # a bug or an unexpected failure: one line, the details with -v
        if args.verbose:
            raise
        return fail(
            EXIT_INTERNAL,
            "internal error",
            f"{type(exc).__name__}: {exc} (run with -v for details)",
        )
    finally:
        _flush_events()


def _flush_events() -> None:
    """Send the audit events this process emitted before it exits (Prefect sends them in the
    background; a short-lived command could end first)."""
    if "prefect.events.worker" in sys.modules:
        from runbooks.fix.audit import flush

        try:
            flush()
        except Exception as exc:  # never worth a traceback at exit
            logging.getLogger(__name__).warning("audit events not flushed: %s", exc)
