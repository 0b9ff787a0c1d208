"""The evidence NVIDIA asks for with an RMA, for a `gpu-hardware-fault` verdict.

NVIDIA's RMA process asks for the output of `nvidia-bug-report.sh` (shipped with the driver:
it writes ``nvidia-bug-report.log.gz`` into the current directory, a gzip of the driver's logs
and command outputs), the GPU's serial number and the Xid errors seen. A response runs the tool
on the host only with the same approval as a fix (flows/incident.py), in a fresh directory under
/tmp, and keeps where the file is, its size and its sha256 (the file stays on the host: it can
hold personal data, NVIDIA's script warns, and it is for NVIDIA, not for cudamedic's reports).
`rma_item` (PURE) writes the post-mortem's "open an RMA" action item from those and the facts.
"""

from __future__ import annotations

import re

from runbooks.collect.redact import redact_text
from runbooks.collect.remote.runner import CommandRunner
from runbooks.core.model import Frozen
from runbooks.diagnose.facts import Facts
from runbooks.diagnose.rules import recent

TIMEOUT_S = 900.0  # the script may take minutes on a big node ("may hang", says NVIDIA)
# Run in a fresh directory (the tool writes into the current one); print what was made.
_SCRIPT = (
    'd=$(mktemp -d /tmp/cudamedic-bug-report.XXXXXX) && cd "$d" && {{ {tool} >/dev/null 2>&1; '
    'for f in "$d/nvidia-bug-report.log.gz" "$d/nvidia-bug-report.log"; do '
    '[ -f "$f" ] && {{ echo "path=$f"; echo "size=$(wc -c < "$f")"; '
    'echo "sha256=$(sha256sum "$f" | cut -d\' \' -f1)"; break; }}; done; }}'
)
_FIELD = re.compile(r"^(path|size|sha256)=(\S{1,400})$")


class BugReport(Frozen):
    status: str  # ok | failed | timeout | error
    path: str | None = None
    size: int | None = None
    sha256: str | None = None
    error: str | None = None


def parse_answer(text: str) -> BugReport:
    """The ``path=/size=/sha256=`` lines the command prints (PURE)."""
    got: dict[str, str] = {}
    for line in text.splitlines()[:20]:
        if (m := _FIELD.match(line.strip())) is not None:
            got[m.group(1)] = m.group(2)
    size = got.get("size", "")
    digest = got.get("sha256", "")
    if "path" not in got or not size.isdigit() or not re.fullmatch(r"[0-9a-f]{64}", digest):
        return BugReport(status="failed", error="nvidia-bug-report.sh wrote no report file")
    return BugReport(status="ok", path=got["path"], size=int(size), sha256=digest)


def run_bug_report(runner: CommandRunner, tool: str = "nvidia-bug-report.sh") -> BugReport:
    """Run the tool on the host (via `runner`); never raises for what happens there."""
    res = runner.run(_SCRIPT.format(tool=tool), timeout=TIMEOUT_S, max_bytes=65536)
    if res.timed_out:
        return BugReport(status="timeout", error=f"no report within {TIMEOUT_S:g} s")
    report = parse_answer(res.stdout.decode("utf-8", "replace"))
    if report.status != "ok":
        said = redact_text(res.stderr.decode("utf-8", "replace").strip()[-300:])
        return report.model_copy(update={"error": f"{report.error}{': ' + said if said else ''}"})
    return report


def rma_item(facts: Facts, report: BugReport | None, offered: bool) -> str:
    """The "open an RMA" action item (PURE): the GPU(s) and their serials, the Xid lines, and the
    bug report (kept, or how to get it)."""
    xids = [
        x
        for x in (facts.kernel.xids if facts.kernel else ())
        if recent(facts, x.timestamp, x.uptime_s)
    ]
    pcis = {(x.pci or "").lower().removeprefix("0000:") for x in xids if x.pci}
    gpus = list(facts.smi_xml.gpus) if facts.smi_xml is not None else []
    named = [
        g for g in gpus if (g.bus_id or "").lower().split(":", 1)[-1][:5] in {p[:5] for p in pcis}
    ]
    shown = named or gpus
    serials = (
        ", ".join(
            f"GPU {g.bus_id or g.position} serial {g.serial or 'not reported'}" for g in shown
        )
        if shown
        else "the GPU's serial is not in the evidence (`nvidia-smi -q -x`: <serial>)"
    )
    lines = "; ".join(f"`{x.line.text[:200]}`" for x in xids[:5]) or "no Xid line in the kernel log"
    if report is not None and report.status == "ok":
        kept = (
            f"nvidia-bug-report: {report.path} on the host, {report.size} bytes, "
            f"sha256 {report.sha256}"
        )
    elif report is not None:
        kept = f"nvidia-bug-report.sh failed ({report.status}: {report.error}); run it by hand"
    elif offered:
        kept = "nvidia-bug-report.sh was offered and not approved; run it on the host as root"
    else:
        kept = "run nvidia-bug-report.sh on the host as root and attach nvidia-bug-report.log.gz"
    return f"Open an RMA with NVIDIA: {serials}. Xid: {lines}. {kept}."
