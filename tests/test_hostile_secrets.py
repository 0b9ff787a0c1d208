"""Issue 15 (secrets): every form of secret the adversarial review leaked is redacted, in a
bundle, the CLI's output, the fix journal, the audit log and the post-mortem, and on any window
of a log. The recreated container keeps its real values."""

from __future__ import annotations

import shlex
import subprocess
import uuid
from pathlib import Path

import docker
import pytest

from runbooks.collect.redact import MASK, name_is_secret, redact_argv, redact_json, redact_text
from runbooks.collect.remote.runner import BoundedBuffer
from runbooks.core.settings import Settings
from runbooks.fix.dockerrun import run_args
from tests.lab.lab import LabState
from tests.test_fix import CLI, cli_env, fix_settings  # noqa: F401 - fixture


def _v(tag: str) -> str:
    """A unique made-up secret value (mixed case and digits, like a generated password)."""
    return f"Zq{tag}x{uuid.uuid4().hex[:10]}K7"


# (the form the review found leaking, a text carrying a secret in that form, the secret)
FORMS: list[tuple[str, str, str]] = [
    ("env name *_PWD", "MYSQL_PWD={v}", _v("pwd")),
    ("env name *_PW", "SMTP_PW={v}", _v("pw")),
    ("env name *_CREDS", "GCP_CREDS={v}", _v("creds")),
    ("JSON key in the plural (api_keys)", '{{"api_keys": ["{v}"]}}', _v("keys")),
    ("JSON key in the plural (secrets)", '{{"secrets": "{v}"}}', _v("secrets")),
    ("Python dict printout", "{{'db_password': '{v}'}}", _v("dict")),
    ("Perl/Ruby hash", "key => {v}", _v("arrow")),
    ("tab-separated", "password\t{v}", _v("tab")),
    ("XML element", "<password>{v}</password>", _v("xml")),
    ("quoted value with spaces", "PASSWORD='correct horse {v}'", _v("quoted")),
    ("punctuated value", "password=abc;{v}", _v("semi")),
    ("URL password holding /", "postgres://svc:pa/{v}@db.internal:5432/ml", _v("slash")),
    ("--requirepass", "redis-server --requirepass {v}", _v("requirepass")),
    ("--masterauth", "redis-server --masterauth {v}", _v("masterauth")),
    ("redis-cli -a", "redis-cli -h cache -a {v} ping", _v("redisa")),
    ("-P", "mosquitto_pub -h broker -P {v} -t jobs", _v("bigp")),
    ("--passphrase", "gpg --batch --passphrase {v} -d key.gpg", _v("passphrase")),
    ("--pw", "tool --pw {v}", _v("pwflag")),
    ("value starting with -", "tool --password -{v}", _v("dash")),
    ("aws configure set", "aws configure set aws_secret_access_key {v}", _v("awsset")),
    ("CONFIG SET", "redis-cli CONFIG SET requirepass {v}", _v("configset")),
    ("pasted trigger", "it broke: {{'hf_token': '{v}'}}", _v("trigger")),
]


@pytest.mark.parametrize(("form", "template", "secret"), FORMS, ids=[f[0] for f in FORMS])
def test_every_form_of_the_review_is_redacted(form: str, template: str, secret: str) -> None:
    text = template.format(v=secret)
    out = redact_text(text)
    assert secret not in out and secret[2:-2] not in out, (form, out)
    assert MASK in out
    # A command line as an argument list too (a container's Cmd, a healthcheck's Test).
    if text[0].isalpha() and not set("'<>{\t") & set(text):
        argv = shlex.split(text)
        assert secret not in " ".join(redact_argv(argv)), (form, redact_argv(argv))


def test_credential_names_without_a_credential_word() -> None:
    for name in ("MYSQL_PWD", "SMTP_PW", "GCP_CREDS", "api_keys", "secrets", "app.api_keys"):
        assert name_is_secret(name), name
    for name in ("PWD", "OLDPWD", "max_tokens", "SandboxKey", "KEYBOARD", "CUDA_VERSION"):
        assert not name_is_secret(name), name


def test_a_secret_under_a_plural_key_is_masked_whole_in_json() -> None:
    data = {"Config": {"Labels": {"app.secrets": "s1", "team": "ml"}}, "api_keys": ["k1", "k2"]}
    out = redact_json(data)
    assert out["Config"]["Labels"] == {"app.secrets": MASK, "team": "ml"}
    assert "k1" not in str(out) and "k2" not in str(out)


def test_docker_run_shows_cmd_healthcheck_and_labels_redacted() -> None:
    secret = [_v(str(i)) for i in range(5)]
    inspect = {
        "Config": {
            "Image": "redis:7",
            "Cmd": ["redis-server", "--requirepass", secret[0], "--masterauth", secret[1]],
            "Healthcheck": {"Test": ["CMD-SHELL", f"redis-cli -a {secret[2]} ping"]},
            "Labels": {"app.api_keys": secret[3], "note": f"password='a b {secret[4]}'"},
        },
        "HostConfig": {},
    }
    shown = "\n".join(run_args(inspect))
    assert not [s for s in secret if s in shown], shown
    assert "--requirepass" in shown and "--masterauth" in shown and "ping" in shown


PEM_BODY = [
    "MIIEowIBAAKCAQEAu9Zq3Ks1Wc2gYpE7oQfVtR4nLm8xHj2bAcD5eFgH6iJkLmN0",
    "pQ1rS2tU3vW4xY5zA6bC7dE8fG9hI0jK1lM2nO3pQ4rS5tU6vW7xY8zA9bC0dE1",
    "fG2hI3jK4lM5nO6pQ7rS8tU9vW0xY1zA2bC3dE4fG5hI6jK7lM8nO9pQ0rS1tU2",
    "vW3xY4zA5bC6dE7fG8hI9jK0lM1n",
]


def test_a_key_body_whose_begin_line_was_cut_off_is_redacted() -> None:
    # The log tail starts inside the key: no BEGIN line, with and without its END line.
    for tail in (
        "\n".join([*PEM_BODY, "-----END RSA PRIVATE KEY-----", "step 1 loss 2.3"]),
        "\n".join(["loading key", *PEM_BODY[:3]]),
    ):
        out = redact_text(tail)
        assert not [ln for ln in PEM_BODY if ln in out and len(ln) >= 16], out
        assert "step 1 loss 2.3" in out or "loading key" in out


def test_redaction_holds_on_any_window_of_a_log() -> None:
    """A token or a password cut in half by the byte limit: its remaining half never survives,
    whichever byte the cut falls on, keeping the head or the tail."""
    token = "hf_" + "AbCdEfGhIjKlMnOpQrStUvWxYz012345"
    password = _v("cut")
    log = (
        "step 1 loss 2.31\n"
        f"INFO login with {token} ok\n"
        f"DB_PASSWORD={password}\n"
        + "\n".join(["-----BEGIN RSA PRIVATE KEY-----", *PEM_BODY, "-----END RSA PRIVATE KEY-----"])
        + "\nstep 2 loss 2.29\n"
    ).encode()
    pieces = [token[i : i + 8] for i in range(0, len(token) - 8, 4)]
    pieces += [password[i : i + 8] for i in range(0, len(password) - 8, 4)]
    pieces += [ln[i : i + 16] for ln in PEM_BODY for i in range(0, len(ln) - 16, 8)]
    leaks = []
    for keep in ("head", "tail"):
        for limit in range(1, len(log)):
            buf = BoundedBuffer(limit, keep)  # type: ignore[arg-type]
            for i in range(0, len(log), 7):  # written in chunks, as a stream arrives
                buf.write(log[i : i + 7])
            out = redact_text(buf.getvalue().decode())
            leaks += [(keep, limit, p) for p in pieces if p in out]
    assert leaks == []
    whole = BoundedBuffer(len(log), "tail")
    whole.write(log)
    assert whole.getvalue() == log  # nothing is dropped when nothing was cut


def test_secrets_in_every_carrier_never_leave_through_the_cli(
    fix_settings: Settings,  # noqa: F811
    make_container,
    container_name: str,
    lab: LabState,
    gpu_engine: docker.DockerClient,
    tmp_path: Path,
) -> None:
    """Through the real CLI and Docker engine: a container carrying each form in its env,
    labels, command, healthcheck and logs (and a pasted trigger) is collected, planned and
    fixed; nothing cudamedic printed or wrote holds a secret, and the recreated container keeps
    the real values."""
    s = {tag: _v(tag) for tag in ("env1", "env2", "env3", "lab1", "lab2", "cmd1", "cmd2")}
    s |= {tag: _v(tag) for tag in ("cmd3", "cmd4", "hc", "log1", "log2", "log3", "log4")}
    s |= {tag: _v(tag) for tag in ("log5", "log6", "log7", "trig")}
    log_lines = [
        f"{{'db_password': '{s['log1']}'}}",
        f"key => {s['log2']}",
        f"password\t{s['log3']}",
        f"<password>{s['log4']}</password>",
        f"PASSWORD='correct horse {s['log5']}'",
        f"password=abc;{s['log6']}",
        f"connecting to postgres://svc:pa/{s['log7']}@db.internal:5432/ml",
        *PEM_BODY,
        "-----END RSA PRIVATE KEY-----",
    ]
    noop = (
        f": redis-server --requirepass {s['cmd1']} --masterauth {s['cmd2']}; "
        f": aws configure set aws_secret_access_key {s['cmd3']}; : tool --password -{s['cmd4']}; "
    )
    script = (
        noop
        + "printf '%s\\n' "
        + " ".join(shlex.quote(ln) for ln in log_lines)
        + "; dd if=/dev/zero of=/dev/shm/batch-0 bs=1M count=256; "
        + "{ trap 'exit 0' TERM; sleep 3600 & wait; }"
    )
    c = make_container(
        container_name,
        script,
        environment={"MYSQL_PWD": s["env1"], "SMTP_PW": s["env2"], "GCP_CREDS": s["env3"]},
        labels={"app.api_keys": s["lab1"], "app.secrets": s["lab2"]},
        healthcheck={
            "test": ["CMD-SHELL", f"redis-cli -a {s['hc']} ping || true"],
            "interval": 1_000_000_000,
        },
    )
    for _ in range(50):
        if b"END RSA" in c.logs():
            break
        c.reload()
    trigger = f"it broke: {{'hf_token': '{s['trig']}'}}"
    env = cli_env(lab, fix_settings)
    outputs = []
    for args in (
        ["collect", "gpu-healthy", "--container", container_name, "--trigger", trigger],
        ["fix", "gpu-healthy", "--container", container_name, "--trigger", trigger],
        ["fix", "gpu-healthy", "--container", container_name, "--trigger", trigger, "--apply"],
    ):
        args += ["--yes"] if "--apply" in args else []
        proc = subprocess.run([*CLI, *args], capture_output=True, text=True, env=env, timeout=180)
        outputs.append((" ".join(args[:1] + args[-1:]), proc.stdout + proc.stderr))
        assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "[REDACTED]" in outputs[1][1]  # the plan shows the redacted command and labels
    written = [
        (str(f), f.read_bytes().decode("utf-8", "replace"))
        for root in (fix_settings.out_dir, fix_settings.state_path)
        for f in Path(root).rglob("*")
        if f.is_file()
    ]
    assert any("post-mortem" in name or name.endswith(".md") for name, _ in written), [
        n for n, _ in written
    ]
    assert any("audit" in name for name, _ in written)
    leaks = [
        (where, tag)
        for where, text in outputs + written
        for tag, secret in s.items()
        if secret in text
    ]
    pem = [(where, ln[:12]) for where, text in outputs + written for ln in PEM_BODY if ln in text]
    assert leaks == [] and pem == []
    # The recreated container still has its real values.
    new = gpu_engine.containers.get(container_name)
    assert new.id != c.id
    assert f"MYSQL_PWD={s['env1']}" in new.attrs["Config"]["Env"]
    assert new.attrs["Config"]["Labels"]["app.api_keys"] == s["lab1"]
    assert s["hc"] in " ".join(new.attrs["Config"]["Healthcheck"]["Test"])
