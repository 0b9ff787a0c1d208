"""Ansible inventories as Ansible reads them: our reader and ``ansible-inventory --list`` agree.

The differential tests read each inventory under tests/fixtures/inventory with both and compare
every host's flattened variables and groups, then the Hosts cudamedic builds from them.
ansible-core is a dev dependency (pyproject.toml), so ``ansible-inventory`` is next to the
virtualenv's Python even when the virtualenv is not on PATH.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

from runbooks.collect import ansible_inventory as ansible
from runbooks.collect.inventory import Host, load_inventory
from runbooks.collect.remote.ssh import SshRunner
from runbooks.collect.target import resolve_target
from runbooks.core.errors import InputError
from runbooks.core.settings import Settings
from tests.lab.lab import LabState

FIXTURES = Path(__file__).parent / "fixtures" / "inventory"
SOURCES = [
    FIXTURES / "ini-groups" / "hosts",
    FIXTURES / "yaml-children" / "inventory.yml",
    FIXTURES / "directory",
    FIXTURES / "file-with-vars" / "hosts.yml",
]


def ansible_bin() -> Path:
    found = shutil.which("ansible-inventory") or shutil.which(
        "ansible-inventory", path=str(Path(sys.executable).parent)
    )
    if not found:
        pytest.fail("ansible-inventory is missing: ansible-core is a dev dependency (bootstrap)")
    return Path(found).parent


@pytest.fixture
def with_ansible(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """ansible-inventory on PATH, and no user or project ansible.cfg in the way."""
    monkeypatch.setenv("PATH", f"{ansible_bin()}{os.pathsep}{os.environ.get('PATH', '')}")
    config = tmp_path / "ansible.cfg"
    config.write_text("")
    monkeypatch.setenv("ANSIBLE_CONFIG", str(config))
    monkeypatch.setenv("ANSIBLE_LOCAL_TEMP", str(tmp_path / "ansible-tmp"))
    return ansible_bin() / "ansible-inventory"


@pytest.fixture
def without_ansible(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.relative_to(FIXTURES).parts[0])
def test_our_reader_and_ansible_inventory_agree(source: Path, with_ansible: Path) -> None:
    ours = ansible.read_ansible(source)
    theirs = ansible.parse_ansible_json(
        ansible.run_ansible_inventory(str(with_ansible), source, timeout=60), source
    )
    assert ours == theirs  # every host, every variable (value and type), every group
    own = load_inventory(source, reader="cudamedic")
    via_ansible = load_inventory(source, reader="ansible-inventory")
    assert (own.read_by, via_ansible.read_by) == ("cudamedic", "ansible-inventory")
    assert own.hosts == via_ansible.hosts  # addresses, ports, users, key files, jumps, groups
    assert load_inventory(source).read_by == "ansible-inventory"  # auto: Ansible when installed


def fields(host: Host) -> tuple[object, ...]:
    key = None if host.key_file is None else str(host.key_file)
    return host.address, host.port, host.user, key, host.jump, host.tags


def test_ini_groups_children_vars_ranges_and_chains(without_ansible: None) -> None:
    inv = load_inventory(FIXTURES / "ini-groups" / "hosts")
    assert sorted(inv.hosts) == [
        "edge", "login1.example.com", "login3.example.com", "nas01", "nas02",
        "node01", "node02", "node03", "node04", "nodea", "nodeb", "nodec",
    ]  # fmt: skip
    assert fields(inv.get("login3.example.com")) == (
        "login3.example.com",
        22,
        "login",
        None,
        None,
        (),
    )
    # h100 (depth 1) < prod (depth 1) < gpu (depth 2, a child of prod): gpu's vars win
    node01 = inv.get("node01")
    assert fields(node01) == (
        "node01",
        2200,
        "gpuuser",
        "/keys/gpu_ed25519",
        None,
        ("gpu", "h100", "prod"),
    )
    assert node01.gpus == 8
    assert fields(inv.get("nodeb"))[:3] == ("nodeb", 2222, "letters")  # host:port in the pattern
    assert inv.get("edge").jump == "ops@bastion.example:2201,relay.example"
    assert fields(inv.get("nas01")) == (
        "10.9.1.1",
        22,
        "produser",
        None,
        "bastion.example",
        ("prod", "storage"),
    )
    assert fields(inv.get("nas02"))[:3] == ("10.9.1.2", 22, "nasuser")  # ansible_ssh_* win
    assert inv.get("nas01").gpus == 0  # [all:vars]


def test_yaml_children_priority_and_proxyjump_none(without_ansible: None) -> None:
    inv = load_inventory(FIXTURES / "yaml-children" / "inventory.yml")
    assert sorted(inv.hosts) == [
        "bastion.example", "gpu01", "gpu02", "gpu03", "gpu04", "gpu10", "gpu12", "gpu14", "loner",
    ]  # fmt: skip
    assert fields(inv.get("gpu01"))[:2] == ("gpu01", 2301)  # rack1's priority beats gpu
    assert fields(inv.get("gpu02")) == (
        "gpu02",
        2200,
        "a100user",
        "/keys/gpu",
        None,
        ("a100", "gpu"),
    )
    assert inv.get("gpu02").gpus == 4
    assert inv.get("gpu12").jump == "jump1.example,ops@jump2.example:2022"
    assert fields(inv.get("gpu04"))[:3] == ("10.4.0.4", 2404, "four")  # host vars win
    assert inv.get("bastion.example").jump is None  # ProxyJump=none
    assert fields(inv.get("loner")) == ("10.4.9.9", 22, "root", None, None, ())


def test_directory_group_vars_and_host_vars_precedence(without_ansible: None) -> None:
    """host_vars > group_vars of the child group > of its parent > group_vars/all > the
    inventory file's own group vars; groups of one depth by name (h100 < rack)."""
    inv = load_inventory(FIXTURES / "directory")
    assert sorted(inv.hosts) == ["nas01", "node01", "node02", "node03"]
    assert fields(inv.get("node01")) == (
        "node01",
        2300,
        "gv-rack",
        "/keys/h100",
        None,
        ("gpu", "h100", "rack"),
    )
    assert fields(inv.get("node02"))[1:3] == (2402, "hv-node02")  # host_vars/node02.yml
    assert fields(inv.get("nas01")) == ("10.8.1.1", 22, "gv-all", "/keys/all", None, ("storage",))
    file_vars = load_inventory(FIXTURES / "file-with-vars" / "hosts.yml")
    assert fields(file_vars.get("n2")) == (
        "10.7.0.2",
        2999,
        "from-group-vars",
        "/keys/all.json",
        "jump.example",
        ("gpu",),
    )


def test_auto_reads_with_ansible_only_when_installed(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    source = FIXTURES / "ini-groups" / "hosts"
    monkeypatch.setenv("PATH", str(tmp_path))
    assert load_inventory(source).read_by == "cudamedic"
    with pytest.raises(InputError, match="ansible-inventory is not installed"):
        load_inventory(source, reader="ansible-inventory")


def test_only_ansible_reads_inventory_plugins(tmp_path: Path, with_ansible: Path) -> None:
    """A `constructed` plugin file: Ansible groups hosts by an expression; we cannot, and say so."""
    inv_dir = tmp_path / "inv"
    inv_dir.mkdir()
    (inv_dir / "10-hosts.ini").write_text("[gpu]\nbig cudamedic_gpus=8\nsmall cudamedic_gpus=2\n")
    (inv_dir / "20-constructed.yml").write_text(
        "plugin: ansible.builtin.constructed\ngroups:\n  eight_gpus: cudamedic_gpus == 8\n"
    )
    inv = load_inventory(inv_dir)
    assert inv.read_by == "ansible-inventory"
    assert inv.get("big").tags == ("eight_gpus", "gpu") and inv.get("small").tags == ("gpu",)
    with pytest.raises(InputError, match="only ansible-inventory reads those") as info:
        load_inventory(inv_dir, reader="cudamedic")
    assert "20-constructed.yml" in str(info.value)


@pytest.mark.parametrize("reader", ["cudamedic", "ansible-inventory"])
@pytest.mark.parametrize(
    "text, ours, theirs",
    [
        ("[gpu]\nn1\n[rack:vars]\na=1\n", "group 'rack' is never declared", "undefined group"),
        ("[gpu]\nn1 novalue\n", "expected key=value", "Expected key=value"),
        ("[gpu:children]\nnope\n", "group 'nope' is never declared", "undefined group 'nope'"),
        ("[gpu]\nn[01:5]\n", "same width", "equal-length"),
    ],
)
def test_malformed_inventory_names_the_file_and_the_reason(
    tmp_path: Path, with_ansible: Path, reader: str, text: str, ours: str, theirs: str
) -> None:
    path = tmp_path / "hosts"
    path.write_text(text)
    with pytest.raises(InputError) as info:
        load_inventory(path, reader=reader)  # type: ignore[arg-type]
    message = str(info.value)
    assert str(path) in message and (ours if reader == "cudamedic" else theirs) in message
    assert "Traceback" not in message


def fake_ansible(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, script: str) -> None:
    bin_dir = tmp_path / "fake-bin"
    bin_dir.mkdir(exist_ok=True)
    exe = bin_dir / "ansible-inventory"
    exe.write_text("#!/bin/sh\n" + script)
    exe.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}/usr/bin{os.pathsep}/bin")


@pytest.mark.parametrize(
    "script, message",
    [
        ("sleep 30\n", "did not finish within 1s"),
        ("echo 'not json at all'\n", "is not JSON"),
        ("echo '[1, 2]'\n", "is not a JSON object"),
        ('echo \'{"_meta": {"hostvars": []}}\'\n', "_meta.hostvars is not an object"),
        ('echo \'{"gpu": {"hosts": "n1"}}\'\n', "hosts is not a list of names"),
        ("echo '[ERROR]: vault password needed' >&2; exit 5\n", "failed (exit 5): vault password"),
        ('echo \'{"_meta": {"hostvars": {"n1": {"ansible_port": 0}}}}\'\n', "must be 1..65535"),
    ],
)
def test_ansible_inventory_failures_are_input_errors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, script: str, message: str
) -> None:
    """A failing, hanging or garbling ansible-inventory is an InputError naming the file (no
    silent fallback to our reader: Ansible is the source of truth where it is installed)."""
    fake_ansible(tmp_path, monkeypatch, script)
    source = FIXTURES / "ini-groups" / "hosts"
    with pytest.raises(InputError) as info:
        load_inventory(source, timeout=1)
    assert str(source) in str(info.value) and message in str(info.value)


def test_ansible_json_unsafe_values_are_plain(tmp_path: Path) -> None:
    text = (
        '{"_meta": {"hostvars": {"n1": {"ansible_host": {"__ansible_unsafe": "10.0.0.1"}}}},'
        ' "all": {"children": ["gpu"]}, "gpu": {"children": ["a100"]}, "a100": {"hosts": ["n1"]}}'
    )
    hosts = ansible.parse_ansible_json(text, tmp_path / "x")
    assert hosts["n1"] == ansible.AnsibleHost(
        vars={"ansible_host": "10.0.0.1"}, groups=("a100", "gpu")
    )


@pytest.mark.parametrize(
    "pattern, names, port",
    [
        ("node[01:04:2]", ["node01", "node03"], None),
        ("node[1:10:4]-x", ["node1-x", "node5-x", "node9-x"], None),
        ("n[a:c]", ["na", "nb", "nc"], None),
        ("r[1:2]n[a:b]:2222", ["r1na", "r1nb", "r2na", "r2nb"], 2222),
        ("db[:2]", ["db0", "db1", "db2"], None),
        ("plain.example:22", ["plain.example"], 22),
    ],
)
def test_host_patterns(pattern: str, names: list[str], port: int | None) -> None:
    assert ansible.expand_host_pattern(pattern, "test") == (names, port)


@pytest.mark.parametrize(
    "pattern, message",
    [
        ("n[0:99999]", "more than 10000 hosts"),
        ("n[01:5]", "same width"),
        ("n[1:4:0]", "step must be positive"),
        ("n[c:a]", "begin must be <= end"),
        ("n[1]", "must be [begin:end]"),
        ("n[1:x]", "invalid literal"),
        ("n1:", "ends in ':'"),
    ],
)
def test_bad_host_patterns(pattern: str, message: str) -> None:
    with pytest.raises(InputError, match="test: ") as info:
        ansible.expand_host_pattern(pattern, "test")
    assert message in str(info.value)


def test_jump_chains_are_validated_hop_by_hop() -> None:
    assert Host(name="n", address="10.0.0.1", jump="a.example,ops@b.example:2222").jump
    for bad in ["a.example,", "a.example,root@$(id)", ",".join(["j.example"] * 9)]:
        with pytest.raises((ValueError, InputError)):  # names raise InputError, pydantic wraps
            Host(name="n", address="10.0.0.1", jump=bad)


def test_ssh_through_a_two_hop_proxyjump_chain(
    settings: Settings, lab: LabState, tmp_path: Path
) -> None:
    """-o ProxyJump=a,b in an Ansible inventory: SSH to a, from there to b, from there to the
    target; each sshd logs exactly one login (the hops) and the command runs on the target."""
    first, second, target = "gpu-healthy", "gpu-hang", "gpu-xid79"
    key = Path(lab.inventory).parent / "keys" / "id_ed25519"
    hop = "cudamedic-lab@127.0.0.1:{}".format
    inventory = tmp_path / "hosts"
    inventory.write_text(
        f"[lab]\n{target} ansible_host=127.0.0.1 ansible_port={lab.hosts[target].port} "
        f"ansible_user=cudamedic-lab ansible_ssh_private_key_file={key} "
        f"ansible_ssh_common_args='-o ProxyJump={hop(lab.hosts[first].port)},"
        f"{hop(lab.hosts[second].port)}'\n"
    )
    host = load_inventory(inventory, reader="cudamedic").get(target)
    assert host.jump == f"{hop(lab.hosts[first].port)},{hop(lab.hosts[second].port)}"
    logs = {n: Path(lab.hosts[n].data).parent / "sshd.log" for n in (first, second, target)}
    before = {n: log.read_text().count("Accepted publickey") for n, log in logs.items()}
    hop_settings = settings.model_copy(update={"ssh_key": key})  # the hops' key
    spec = resolve_target(target, load_inventory(inventory, reader="cudamedic"))
    assert spec.host is not None and spec.jump is None  # a chain: hops are SSH destinations
    runner = SshRunner(spec.host, hop_settings, jump_host=spec.jump)
    try:
        result = runner.run("echo via-chain", timeout=10, max_bytes=1000)
    finally:
        runner.close()
    assert result.exit_code == 0 and result.stdout.strip() == b"via-chain"
    after = {n: log.read_text().count("Accepted publickey") for n, log in logs.items()}
    assert {n: after[n] - before[n] for n in logs} == {first: 1, second: 1, target: 1}
