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

With no approver configured anywhere, every answer is taken (one operator on one machine), and
audited with its identity like any other. Pure: no I/O beyond reading this process's OS user.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable

from runbooks.settings import Settings

OS_PREFIX = "os:"
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


def os_user() -> str:
    """The real OS user of this process: the uid's name (never $USER, which anyone sets); the
    invoking user under sudo."""
    import pwd

    if os.geteuid() == 0 and os.environ.get("SUDO_USER"):
        return os.environ["SUDO_USER"]
    return pwd.getpwuid(os.getuid()).pw_name


def cli_claim() -> str:
    """What `cudamedic approve` and `cudamedic triage` say they are: `os:<user>`."""
    return OS_PREFIX + os_user()


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
    settings: Settings, who: str, requester: str | None, slack_member: Callable[[str], bool]
) -> str | None:
    """Why the identity `who` may not answer a response asked for by `requester` (None: it may).
    `slack_member` says whether `who` is in an approver user group or channel (it may raise:
    the caller turns that into a refusal)."""
    if not enforced(settings):
        return None
    if four_eyes(settings) and requester and who == requester:
        return f"four-eyes rule: {who} asked for this response, someone else must approve it"
    if listed(settings, who):
        return None
    slack = settings.slack_approver_groups or settings.slack_approver_channels
    if slack and not who.startswith(OS_PREFIX) and slack_member(who):
        return None
    return f"{who} is not an approver (approvers, approver_os_users, Slack approver groups)"
