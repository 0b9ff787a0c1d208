"""Runtime settings: one pydantic-settings object, built at the entry point and passed down.

Sources, highest first: keyword arguments, `CUDAMEDIC_*` environment variables, the config file
named by `CUDAMEDIC_CONFIG` (YAML), defaults. Example: `CUDAMEDIC_SSH_CONNECT_TIMEOUT=5`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml
from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from runbooks.core.errors import InputError


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="CUDAMEDIC_", extra="ignore")

    inventory: Path | None = None
    # The fleet's name: what its workers share in Prefect (sweep state, locks) is kept under it,
    # so several fleets (staging, production) may use one Prefect server.
    fleet: str = Field(default="default", pattern=r"^[a-z0-9][a-z0-9-]{0,39}$")
    out_dir: Path = Path("bundles")
    # SSH
    known_hosts: Path | None = None  # default: ~/.ssh/known_hosts (+ system file)
    ssh_config: Path | None = None  # default: ~/.ssh/config when it exists
    ssh_key: Path | None = None
    ssh_user: str | None = None
    ssh_connect_timeout: float = Field(default=10.0, gt=0)
    ssh_password: SecretStr | None = None  # discouraged; keys preferred
    # Docker
    docker_host: str | None = None  # local target only; default DOCKER_HOST / the local socket
    docker_timeout: float = Field(default=20.0, gt=0)
    # Collection bounds
    command_timeout: float = Field(default=30.0, gt=0)
    exec_timeout: float = Field(default=20.0, gt=0)
    log_tail_lines: int = Field(default=5000, gt=0)
    log_tail_bytes: int = Field(default=8 * 1024 * 1024, gt=0)
    output_max_bytes: int = Field(default=16 * 1024 * 1024, gt=0)
    # nccl-tests
    nccl_tests_path: str = "all_reduce_perf"
    nccl_tests_gpus: int | None = Field(default=None, gt=0)  # default: every GPU nvidia-smi lists
    nccl_tests_budget: float = Field(default=120.0, gt=0)
    nccl_tests_enabled: bool = True
    # Runbooks (default: the packaged runbooks/incident.yaml and runbooks/sweep.yaml)
    runbook: Path | None = None
    sweep_runbook: Path | None = None
    # Fixes
    state_dir: Path = Path("~/.local/state/cudamedic")  # journal, locks, audit log
    policy: Path | None = None  # fix policy (deploy/policy.example.yaml)
    fix_settle_s: float = Field(default=5.0, ge=0)
    fix_stop_timeout: int = Field(default=10, ge=0)
    fix_health_timeout: float = Field(default=60.0, gt=0)
    fix_backup_retention_h: float = Field(default=24.0, ge=0)
    # How long a fix's lock on the target protects it before a run on another machine may take
    # over (default: the longest a fix can take, from the timeouts above; runbooks/fix/fixlock.py)
    fix_lease_s: float | None = Field(default=None, gt=0)
    # Reports and the Prefect service
    report_dir: Path | None = None  # default: OUT_DIR/reports
    # a git repository (path or remote, bare or not) each post-mortem is also committed to, with
    # an index page (reports/gitstore.py); None: none
    reports_git: str | None = Field(default=None, max_length=1000)
    # how a response runs NVIDIA's bug report on a host (it needs root: e.g. "sudo -n
    # nvidia-bug-report.sh" for a non-root SSH user with a sudoers rule for it)
    bug_report_command: str = Field(
        default="nvidia-bug-report.sh", pattern=r"^[A-Za-z0-9_./ -]{1,200}$"
    )
    sweep_schedule: str = "*/15 * * * *"  # cron for `cudamedic serve`
    sweep_timezone: str = "UTC"
    prefect_port: int = Field(default=4200, gt=0, lt=65536)  # the embedded local server
    # A flow run without a heartbeat for this long is set to Crashed (its worker died; Prefect
    # sends one every PREFECT_FLOWS_HEARTBEAT_FREQUENCY seconds, default 180): flows/automations.py
    crash_after_s: float = Field(default=450.0, ge=45)
    prefect_home: Path | None = None  # default: STATE_DIR/prefect (its SQLite database)
    # The HTTP endpoints (`cudamedic alerts`, `cudamedic slack`): limits against slow or idle
    # clients (keep http_max_connections well under the unit's LimitNOFILE)
    http_max_connections: int = Field(default=100, gt=0)  # past it, the longest idle is closed
    http_header_timeout: float = Field(default=10.0, gt=0)  # connect -> complete request head
    http_body_timeout: float = Field(default=10.0, gt=0)  # request head -> complete body
    # The alert receiver (`cudamedic alerts`): Alertmanager webhooks start responses
    alert_listen: str = "127.0.0.1"
    alert_port: int = Field(default=9095, gt=0, lt=65536)
    alert_token: SecretStr | None = None
    # Approvals: one rule for every way of answering a paused fix (the CLI, Slack, the Prefect
    # UI), checked by the flow (runbooks/fix/approvals.py; deploy/OPERATIONS.md "Who may approve").
    # Nothing configured here or in slack_approver_groups/channels: any answer is taken.
    approvers: tuple[str, ...] = ()  # identities that approve: Slack user ids (U...), names
    approver_os_users: dict[str, str] = {}  # OS user of `cudamedic approve` -> their identity
    four_eyes: bool | None = None  # the requester may not approve (default: slack_four_eyes)
    # A secret shared by the fleet's services (workers, `serve`, the alert receiver) and the
    # trusted hosts where people run `cudamedic approve` (readable only by the service user:
    # people run it through sudo). It signs what they vouch for: an OS user's answer, an alert's
    # or a sweep's start. Without it such answers and starts are only claimed.
    approval_key: SecretStr | None = None
    # How long `cudamedic approve` waits for a run whose process waits (a triage's, `serve`'s)
    # to take the answer and say its verdict; such a run takes it within seconds (it polls
    # every 2 s), so none by then means its process is gone.
    approve_wait_s: float = Field(default=60.0, gt=0)
    # Where a waiting approval is announced (flows/announce.py), whoever started the response:
    # a Slack channel of approvers (needs slack_bot_token) and/or a plain JSON webhook.
    slack_approvals_channel: str | None = Field(default=None, pattern=r"^[A-Z0-9]{2,40}$")
    approval_webhook: str | None = Field(default=None, pattern=r"^https?://[^\s]{1,2000}$")
    approval_webhook_token: SecretStr | None = None  # sent as Authorization: Bearer
    # The Prefect work pool of `cudamedic worker` (deploy/prefect.yaml's CUDAMEDIC_WORK_POOL)
    work_pool: str | None = Field(default=None, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,99}$")
    # Slack (`cudamedic slack`; docs: README "Slack"); tokens from the environment or this file
    slack_bot_token: SecretStr | None = None  # xoxb-...
    slack_signing_secret: SecretStr | None = None  # HTTP mode
    slack_app_token: SecretStr | None = None  # xapp-...: Socket Mode (no public endpoint)
    slack_api_url: str | None = None  # default Slack's; a proxy or a test server
    slack_channel: str | None = None  # where sweep news goes
    slack_approver_groups: tuple[str, ...] = ()  # user group ids (S...) whose members approve
    slack_approver_channels: tuple[str, ...] = ()  # or members of these channels (C...)
    slack_four_eyes: bool = True  # the old name of four_eyes (read when four_eyes is unset)
    slack_listen: str = "127.0.0.1"
    slack_port: int = Field(default=3000, gt=0, lt=65536)
    slack_timeout: int = Field(default=10, gt=0)  # seconds for one Web API call (before retries)
    slack_outbox_flush_s: float = Field(default=60.0, gt=0)  # the app resends what failed

    @property
    def state_path(self) -> Path:
        return self.state_dir.expanduser()

    @property
    def reports_path(self) -> Path:
        return (self.report_dir or self.out_dir / "reports").expanduser()

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (init_settings, env_settings, _YamlFileSource(settings_cls))


class _YamlFileSource(PydanticBaseSettingsSource):
    """Reads the YAML file named by CUDAMEDIC_CONFIG (read at build time, never at import)."""

    def __init__(self, settings_cls: type[BaseSettings]) -> None:
        super().__init__(settings_cls)
        self._data = _load_config_file(os.environ.get("CUDAMEDIC_CONFIG"))

    def get_field_value(self, field: Any, field_name: str) -> tuple[Any, str, bool]:
        return self._data.get(field_name), field_name, False

    def __call__(self) -> dict[str, Any]:
        return {k: v for k, v in self._data.items() if k in self.settings_cls.model_fields}


def _load_config_file(path: str | None) -> dict[str, Any]:
    if not path:
        return {}
    try:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError, ValueError) as exc:  # ValueError: bad UTF-8, 5000 digits
        raise InputError(f"cannot read config file {path}: {exc}") from exc
    except RecursionError:  # PyYAML composes nested collections recursively
        raise InputError(f"cannot read config file {path}: nested too deeply") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise InputError(f"config file {path} must be a YAML mapping, got {type(data).__name__}")
    return data


def load_settings(**overrides: Any) -> Settings:
    """Build Settings, turning validation errors into one clear InputError."""
    from pydantic import ValidationError

    try:
        return Settings(**{k: v for k, v in overrides.items() if v is not None})
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()
        )
        raise InputError(f"invalid settings: {problems}") from exc
