"""Inventory, targets and settings: good input is read, bad input is a clear InputError."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from runbooks.collect.inventory import load_inventory
from runbooks.collect.target import resolve_target
from runbooks.core.errors import InputError
from runbooks.core.names import container_name
from runbooks.core.settings import load_settings


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_native_inventory_with_defaults_and_jump(tmp_path: Path) -> None:
    inv = load_inventory(
        write(
            tmp_path,
            "inv.yaml",
            """
defaults: {user: ubuntu, key_file: ~/.ssh/k}
hosts:
  bastion: {address: bastion.example.com}
  node07: {address: 10.0.0.7, port: 2222, gpus: 8, tags: [h100, prod], jump: bastion}
""",
        )
    )
    node = inv.get("node07")
    assert (node.address, node.port, node.user, node.gpus) == ("10.0.0.7", 2222, "ubuntu", 8)
    assert node.key_file == Path("~/.ssh/k").expanduser()
    assert node.tags == ("h100", "prod")
    target = resolve_target("node07", inv)
    assert target.jump is not None and target.jump.address == "bastion.example.com"
    assert [h.name for h in inv.with_tag("prod")] == ["node07"]


def test_ansible_yaml_inventory(tmp_path: Path) -> None:
    inv = load_inventory(
        write(
            tmp_path,
            "hosts.yml",
            """
all:
  children:
    gpu:
      vars: {ansible_user: ops}
      hosts:
        n1: {ansible_host: 10.1.0.1, ansible_port: 2201}
        n2: {ansible_host: 10.1.0.2, ansible_ssh_common_args: "-o ProxyJump=ops@jump.example:22"}
""",
        )
    )
    assert inv.get("n1").port == 2201 and inv.get("n1").user == "ops"
    assert inv.get("n1").tags == ("gpu",)
    assert inv.get("n2").jump == "ops@jump.example:22"


def test_ansible_ini_inventory(tmp_path: Path) -> None:
    inv = load_inventory(
        write(
            tmp_path,
            "hosts",
            """
# GPU nodes
[h100]
n1 ansible_host=10.2.0.1 ansible_user=root cudamedic_gpus=8
n2 ansible_host=10.2.0.2 ansible_ssh_common_args='-J bastion.example'

[prod]
n1

[h100:vars]
foo=bar
""",
        )
    )
    assert inv.get("n1").tags == ("h100", "prod")
    assert inv.get("n1").gpus == 8
    assert inv.get("n2").jump == "bastion.example"


@pytest.mark.parametrize(
    "text, message",
    [
        ("- just\n- a list\n", "must be a mapping"),
        ("hosts:\n  n1: {address: 'x; touch /tmp/pwned'}\n", "not a DNS name or IP address"),
        ("hosts:\n  n1: {address: 10.0.0.1, port: 70000}\n", "must be 1..65535"),
        ("hosts:\n  n1: {address: 10.0.0.1, port: ssh}\n", "not a number"),
        ("hosts:\n  n1: {address: 10.0.0.1, jump: nowhere}\n", "jump host 'nowhere' is not in"),
        ("hosts:\n  n1: {address: 10.0.0.1, colour: red}\n", "colour"),
        ("hosts:\n  'bad name;': {address: 10.0.0.1}\n", "invalid host name"),
        ("hosts:\n  n1: {address: 10.0.0.1, user: 'root; id'}\n", "invalid user name"),
        ("hosts: [1, 2\n", "not valid YAML"),
        ("hosts:\n  n1: 5\n", "must be a mapping"),
    ],
)
def test_malformed_inventory_is_a_clear_error(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(InputError, match="inventory") as info:
        load_inventory(write(tmp_path, "inv.yaml", text))
    assert message in str(info.value)


def test_unreadable_inventory_and_binary_junk(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="cannot read inventory"):
        load_inventory(tmp_path / "missing.yaml")
    junk = tmp_path / "junk.yaml"
    junk.write_bytes(bytes(range(256)))
    with pytest.raises(InputError):
        load_inventory(junk)


def test_cli_with_a_malformed_inventory_exits_2_without_traceback(tmp_path: Path) -> None:
    inv = write(tmp_path, "inv.yaml", "hosts:\n  n1: {address: 10.0.0.1, port: 0}\n")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "runbooks.cli",
            "collect",
            "n1",
            "--inventory",
            str(inv),
            "--out",
            str(tmp_path / "b"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "port" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    "spec, host, port, user",
    [
        ("ssh://root@10.0.0.7:2222", "10.0.0.7", 2222, "root"),
        ("ssh://gpu-node-3", "gpu-node-3", 22, None),
        ("ssh://ops@[::1]:22", "::1", 22, "ops"),
    ],
)
def test_ssh_targets(spec: str, host: str, port: int, user: str | None) -> None:
    target = resolve_target(spec, None)
    assert target.host is not None
    assert (target.host.address, target.host.port, target.host.user) == (host, port, user)


@pytest.mark.parametrize(
    "spec, message",
    [
        ("ssh://root:hunter2@10.0.0.7", "passwords in ssh:// targets"),
        ("ssh://root@10.0.0.7:99999", "invalid target"),
        ("ssh://root@$(reboot)", "not a DNS name"),
        ("ssh://root@host/path", "expected ssh://"),
        ("node;rm -rf /", "invalid host name"),
        ("node07", "no inventory is configured"),
    ],
)
def test_bad_targets(spec: str, message: str) -> None:
    with pytest.raises(InputError) as info:
        resolve_target(spec, None)
    assert message in str(info.value)
    assert "hunter2" not in str(info.value)


@pytest.mark.parametrize(
    "name",
    ["x; touch /tmp/pwned", "$(id)", "a b", "", "-rf", "../etc", "`reboot`", "a\nb", "x" * 300],
)
def test_container_names_with_shell_metacharacters_are_refused(name: str) -> None:
    with pytest.raises(InputError, match="invalid container name"):
        container_name(name)


def test_settings_from_env_and_config_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = write(tmp_path, "c.yaml", "command_timeout: 7\nlog_tail_lines: 100\n")
    monkeypatch.setenv("CUDAMEDIC_CONFIG", str(config))
    monkeypatch.setenv("CUDAMEDIC_LOG_TAIL_LINES", "200")
    settings = load_settings()
    assert settings.command_timeout == 7 and settings.log_tail_lines == 200
    monkeypatch.setenv("CUDAMEDIC_COMMAND_TIMEOUT", "-1")
    with pytest.raises(InputError, match="command_timeout"):
        load_settings()
    write(tmp_path, "c.yaml", "[1, 2]\n")
    monkeypatch.delenv("CUDAMEDIC_COMMAND_TIMEOUT")
    with pytest.raises(InputError, match="must be a YAML mapping"):
        load_settings()
