"""Who may answer a paused fix: one rule for every way of answering (the CLI, Slack, the Prefect
UI's resume form, an up-front `--yes`), applied by the flow to each answer it receives.

An answer names its identity in `by`: a Slack user id (`U…`) for a Slack click, `os:<user>` for
the CLI (the real OS user of `cudamedic approve`, mapped to the person's identity by the setting
`approver_os_users`, so four-eyes compares the same person across channels), or what a person
typed in the UI. The rule, when any approver is configured:

- the identity is an approver: listed in `approvers`, a value of `approver_os_users`, or
  (asked of Slack by the caller) a member of `slack_approver_groups`/`slack_approver_channels`;
- four-eyes (`four_eyes`, default `slack_four_eyes`): it is not the response's requester.

An up-front approval (`approved_by`, `cudamedic triage --yes`) counts only for a run that the CLI
started in this very process (`cli_run` before the run, `take_up_front` in the flow): a flow run
created through the Prefect API (an alert event, a deployment run on a worker) carries the
parameter but not the grant, so whoever can write to the Prefect API approves nothing by naming
someone. Such a run may also only target an inventory host (`started_by_cli`).

How each identity was established is recorded with it (`ESTABLISHED`), and four-eyes counts
only established ones:

- an answer is `slack-signed` when the Slack app, which verified Slack's signature of the click,
  signed it with the bot token (`proof`); `trusted-host` when `cudamedic approve` signed it with
  the fleet's `approval_key` (held by the services and by trusted hosts' service user, never by
  people: they run it through sudo); anything else (the Prefect UI's form, an API call) is
  `claimed`. A claimed identity never satisfies four-eyes: with four-eyes on it may reject, never
  approve.
- the requester is the OS user of the `cudamedic triage` process that runs the flow itself
  (`os-user`), the Slack user of a start the Slack app signed (`slack-signed`), or an alert or a
  sweep whose start the receiver or the sweep signed with `approval_key` (`automation`). A run
  created through the Prefect API without such a signature (`prefect deployment run`) has an
  unknown requester (`claimed`): anyone could have asked for it, so with four-eyes on it needs
  two different established approvers.

With no approver configured anywhere, every answer is taken (one operator on one machine), and
audited with its identity like any other. Pure: no I/O beyond reading this process's OS user.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import threading
from collections.abc import Callable

from pydantic import BaseModel

from runbooks.core.settings import Settings

OS_PREFIX = "os:"
SLACK_SIGNED, TRUSTED_HOST, OS_USER, AUTOMATION, CLAIMED = (
    "slack-signed",
    "trusted-host",
    "os-user",
    "automation",
    "claimed",
)
ESTABLISHED = (SLACK_SIGNED, TRUSTED_HOST, OS_USER, AUTOMATION)
# flow run name -> who approved up front ("" for nobody): the runs this process's CLI started
_CLI_RUNS: dict[str, str] = {}
_CLI_RUNS_LOCK = threading.Lock()


def cli_run(run_name: str, approved_by: str | None) -> None:
    """The CLI is about to start the run `run_name` (unique) in this process."""
    with _CLI_RUNS_LOCK:
        _CLI_RUNS[run_name] = approved_by or ""


def started_by_cli(run_name: str | None) -> bool:
    with _CLI_RUNS_LOCK:
        return run_name is not None and run_name in _CLI_RUNS


def take_up_front(run_name: str | None, by: str) -> bool:
    """True once when this process's CLI approved the run `run_name` up front as `by`."""
    with _CLI_RUNS_LOCK:
        if run_name is None or not by or _CLI_RUNS.get(run_name) != by:
            return False
        _CLI_RUNS[run_name] = ""
        return True


def os_user(trusted: bool = False) -> str:
    """The real OS user of this process: the uid's name (never $USER, which anyone sets); the
    invoking user under sudo (to root, or to the service user that holds the approval key:
    `trusted`)."""
    import pwd

    if (os.geteuid() == 0 or trusted) and os.environ.get("SUDO_USER"):
        return os.environ["SUDO_USER"]
    return pwd.getpwuid(os.getuid()).pw_name


def cli_claim(settings: Settings | None = None) -> str:
    """What `cudamedic approve` and `cudamedic triage` say they are: `os:<user>`."""
    trusted = settings is not None and settings.approval_key is not None
    return OS_PREFIX + os_user(trusted)


def _sign(key: str, *parts: str) -> str:
    message = "\x1f".join(("cudamedic", *parts)).encode()
    return hmac.new(key.encode(), message, hashlib.sha256).hexdigest()


def answer_proof(key: str, via: str, run_id: str, decision: str, by: str) -> str:
    """The signature of one answer (`via`: "slack" with the bot token, "os" with approval_key)."""
    return _sign(key, "answer", via, run_id, decision, by)


def start_proof(key: str, *parts: str) -> str:
    """The signature of a response's start: ("slack", channel, ts, requester, target) by the
    Slack app with the bot token; (detected_by, target, container) by the alert receiver or
    the sweep with approval_key."""
    return _sign(key, "start", *parts)


def _secret(value: object) -> str:
    getter = getattr(value, "get_secret_value", None)
    return str(getter()) if getter is not None else ""


def answer_established(settings: Settings, run_id: str, decision: str, by: str, proof: str) -> str:
    """How the identity `by` of an answer was established (`ESTABLISHED`, else `CLAIMED`)."""
    if proof:
        bot, key = _secret(settings.slack_bot_token), _secret(settings.approval_key)
        slack = not by.startswith(OS_PREFIX)
        if bot and slack and _same(proof, answer_proof(bot, "slack", run_id, decision, by)):
            return SLACK_SIGNED
        if key and not slack and _same(proof, answer_proof(key, "os", run_id, decision, by)):
            return TRUSTED_HOST
    return CLAIMED


def start_established(settings: Settings, proof: str, *parts: str) -> bool:
    """Whether an alert's or a sweep's start carries approval_key's signature of `parts`."""
    key = _secret(settings.approval_key)
    return bool(key and proof and _same(proof, start_proof(key, *parts)))


def slack_start_established(settings: Settings, proof: str, *parts: str) -> bool:
    bot = _secret(settings.slack_bot_token)
    return bool(bot and proof and _same(proof, start_proof(bot, "slack", *parts)))


def _same(a: str, b: str) -> bool:
    return hmac.compare_digest(a.encode(), b.encode())


def identity(settings: Settings, by: str) -> str:
    """The person an answer's `by` names: `os:<user>` mapped by approver_os_users, else as is."""
    by = by.strip()
    if by.startswith(OS_PREFIX):
        return settings.approver_os_users.get(by[len(OS_PREFIX) :], by)
    return by


def enforced(settings: Settings) -> bool:
    """Whether the rule applies: some approver is configured."""
    return bool(
        settings.approvers
        or settings.approver_os_users
        or settings.slack_approver_groups
        or settings.slack_approver_channels
    )


def four_eyes(settings: Settings) -> bool:
    return settings.slack_four_eyes if settings.four_eyes is None else settings.four_eyes


def listed(settings: Settings, who: str) -> bool:
    """An approver named in the settings themselves (no Slack needed)."""
    return who in settings.approvers or who in settings.approver_os_users.values()


def refusal(
    settings: Settings,
    who: str,
    requester: str | None,
    slack_member: Callable[[str], bool],
    *,
    established: str,
    decision: str = "approve",
) -> str | None:
    """Why the identity `who` (established as `established`) may not give `decision` to a
    response asked for by `requester` (None: it may). `slack_member` says whether `who` is in an
    approver user group or channel (it may raise: the caller turns that into a refusal)."""
    if not enforced(settings):
        return None
    if four_eyes(settings) and decision == "approve" and established not in ESTABLISHED:
        return (
            f"{who} is only claimed (typed in the Prefect UI or sent through its API): four-eyes "
            "counts an approval from the Slack app, or from `cudamedic approve` on a host that "
            "holds the approval key"
        )
    if four_eyes(settings) and requester and who == requester:
        return f"four-eyes rule: {who} asked for this response, someone else must approve it"
    if listed(settings, who):
        return None
    slack = settings.slack_approver_groups or settings.slack_approver_channels
    if slack and not who.startswith(OS_PREFIX) and slack_member(who):
        return None
    return f"{who} is not an approver (approvers, approver_os_users, Slack approver groups)"


class WaitingApproval(BaseModel):
    """One fix (or RMA evidence run) that waits for a person: what is announced, kept with the
    run in Prefect, and listed by `cudamedic pending`."""

    run_id: str
    fleet: str
    host: str
    container: str | None = None
    incident: str
    confidence: float
    summary: str
    diff: list[str] = []
    evidence: list[str] = []
    offer: str = ""  # what else an approval runs (the RMA evidence of a hardware fault)
    requester: str
    detected_by: str
    asked_at: str  # ISO 8601, UTC
    expires_at: str
    approve: str  # the command that approves
    reject: str
    url: str | None = None  # the run's page in the Prefect UI
