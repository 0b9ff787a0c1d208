"""Live progress of a response or a sweep, for the person at the terminal (issue 19).

The flows say when a step starts and what came of it through one logger, ``cudamedic.progress``
(`begin`, `end`, `host_checked`); the step names are defined here, once. Nothing is shown unless
someone attaches a view (`attach`): the CLI does when it runs a flow in its own process — a live
line (rich) when standard error is a terminal, plain lines on standard error otherwise. Flows run
by `serve` or a worker log the same records to nobody (the logger does not propagate); their
steps reach the Prefect UI through the run logger as before.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from typing import IO, Any

LOGGER = "cudamedic.progress"

# step -> what it is doing, as a person reads it while it runs
STEPS: dict[str, str] = {
    "start": "starting the flow run",
    "recover": "finishing an interrupted fix",
    "collect": "collecting evidence",
    "classify": "diagnosing",
    "dcgm": "running NVIDIA DCGM's diagnostic",
    "plan": "planning the fix",
    "approval": "waiting for approval",
    "apply": "applying the fix (recreate the container, then verify it)",
    "verify": "verifying",
    "report": "writing the report",
    "sweep": "checking hosts",
}

_log = logging.getLogger(LOGGER)
_log.propagate = False  # never the root logger's terminal handler (-v): only an attached view
_log.setLevel(logging.INFO)
_open: list[str] = []  # the steps of this process begun and not ended, oldest first


def running() -> str | None:
    """The step of this process that runs now (None: none), e.g. `apply` while a fix runs."""
    return _open[-1] if _open else None


def _say(kind: str, step: str, detail: str = "", **extra: Any) -> None:
    if step not in STEPS:
        raise ValueError(f"unknown progress step {step!r}")
    if kind == "begin" and step not in _open:
        _open.append(step)
    elif kind == "end" and step in _open:
        _open.remove(step)
    _log.info(
        "%s %s%s",
        kind,
        step,
        f": {detail}" if detail else "",
        extra={"progress": {"kind": kind, "step": step, "detail": detail, **extra}},
    )


def begin(step: str, detail: str = "", **extra: Any) -> None:
    """`step` starts; `detail` says on what (`from gpu-healthy / train`)."""
    _say("begin", step, detail, **extra)


def end(step: str, detail: str = "") -> None:
    """`step` is done; `detail` says what came of it."""
    _say("end", step, detail)


def sweep_started(total: int) -> None:
    begin("sweep", f"({total} in all)", total=total)


def host_checked(host: str, verdict: str) -> None:
    """One host of a sweep is checked (the view counts them against the sweep's total)."""
    _say("host", "sweep", f"{host}: {verdict}")


# -- views ----------------------------------------------------------------------------------------
class _View(logging.Handler):
    """Shared bookkeeping: when each step began, how many hosts of a sweep are done."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.began: dict[str, float] = {}
        self.total = 0
        self.done = 0

    def emit(self, record: logging.LogRecord) -> None:
        info = getattr(record, "progress", None)
        if not isinstance(info, dict):
            return
        from runbooks.core.names import terminal_safe

        kind, step = info["kind"], info["step"]
        detail = terminal_safe(str(info.get("detail") or ""))
        if kind == "begin":
            self.began[step] = time.monotonic()
            if step == "sweep":
                self.total, self.done = int(info.get("total") or 0), 0
            self.started(step, f"{STEPS[step]}{' ' + detail if detail else ''}")
        elif kind == "end":
            t0 = self.began.pop(step, None)
            took = f" in {time.monotonic() - t0:.1f} s" if t0 is not None else ""
            self.finished(step, f"done{took}{': ' + detail if detail else ''}")
        else:
            self.done += 1
            self.host(step, f"{self.done}/{self.total} hosts done ({detail})")

    def started(self, step: str, text: str) -> None:
        raise NotImplementedError

    def finished(self, step: str, text: str) -> None:
        raise NotImplementedError

    def host(self, step: str, text: str) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        pass


class PlainView(_View):
    """One line per event on a stream (standard error that is not a terminal): for logs and
    tests. `cudamedic: [collect] collecting evidence from gpu-healthy / train`."""

    def __init__(self, stream: IO[str]) -> None:
        super().__init__()
        self.stream = stream

    def _line(self, step: str, text: str) -> None:
        self.stream.write(f"cudamedic: [{step}] {text}\n")
        self.stream.flush()

    started = finished = host = _line


class LiveView(_View):
    """A terminal: one live status line (rich) for the step running now; each finished step
    stays above it as one line. Waiting for approval stops the live line, so the plan and the
    question are printed on a quiet terminal."""

    def __init__(self, stream: IO[str]) -> None:
        super().__init__()
        from rich.console import Console

        self.console = Console(file=stream, highlight=False, soft_wrap=True)
        self.status: Any = None

    def _show(self, text: str) -> None:
        from rich.text import Text

        if self.status is None:
            self.status = self.console.status(Text(text), spinner="dots")
            self.status.start()
        else:
            self.status.update(Text(text))

    def started(self, step: str, text: str) -> None:
        from rich.text import Text

        if step == "approval":  # a person is asked now: no spinner over the question
            self.stop()
            self.console.print(Text(f"… {text}", style="yellow"))
            return
        self._show(text + " …")

    def finished(self, step: str, text: str) -> None:
        from rich.text import Text

        line = Text("✓ ", style="green")
        line.append(f"{step:<9}", style="bold")
        line.append(text)
        self.console.print(line)

    def host(self, step: str, text: str) -> None:
        self._show(f"{STEPS['sweep']}: {text} …")

    def stop(self) -> None:
        if self.status is not None:
            self.status.stop()
            self.status = None


@contextlib.contextmanager
def attach(stream: IO[str], *, live: bool) -> Iterator[None]:
    """Show progress on `stream` while the block runs: a live line when `live` (a terminal),
    plain lines otherwise."""
    view: _View = LiveView(stream) if live else PlainView(stream)
    _log.addHandler(view)
    try:
        yield
    finally:
        _log.removeHandler(view)
        view.stop()
