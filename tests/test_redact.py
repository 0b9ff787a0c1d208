"""Redaction: planted secrets of many kinds never reach a bundle; ordinary evidence survives."""

from __future__ import annotations

import json
import time
from pathlib import Path

from runbooks.collect.collector import collect
from runbooks.collect.redact import redact_json, redact_text
from runbooks.collect.target import Target
from runbooks.core.settings import Settings

# (kind, a value of that kind's real format, the line it appears in). Values are made up.
SECRETS = [
    ("aws-key-id", "AKIAIOSFODNN7EXAMPLQ", "aws_access_key_id = {}"),
    ("aws-secret", "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEYQ", "AWS_SECRET_ACCESS_KEY={}"),
    ("aws-temp-key", "ASIAY34FZKBOKMUTVV7Q", "using key {}"),
    ("gcp-api-key", "AIzaSyA1234567890abcdefghijklmnopqrstuv", "key {} loaded"),
    ("gcp-oauth", "ya29.a0AfH6SMBx1234567890abcdefghijkl", "token {}"),
    ("huggingface", "hf_AbCdEfGhIjKlMnOpQrStUvWxYz012345", "login with {}"),
    ("huggingface-org", "api_org_AbCdEfGhIjKlMnOpQrStUvWxYz0123", "org {}"),
    ("github-pat", "ghp_1234567890abcdefghijklmnopqrstuvwxyz", "git clone using {}"),
    (
        "github-fine",
        "github_pat_11ABCDEFG0123456789_abcdefghijklmnopqrstuvwxyz0123456789AB",
        "auth {}",
    ),
    ("github-oauth", "gho_1234567890abcdefghijklmnopqrstuvwxyz", "oauth {}"),
    ("gitlab", "glpat-AbCdEfGhIjKlMnOpQrSt", "gitlab {}"),
    ("slack-bot", "xoxb-123456789012-1234567890123-AbCdEfGhIjKlMnOpQrStUvWx", "slack {}"),
    ("slack-user", "xoxp-123456789012-1234567890123-AbCdEfGhIjKl", "user {}"),
    ("slack-app", "xapp-1-A0123456789-1234567890123-abcdef0123456789", "app {}"),
    ("slack-webhook", "https://hooks.slack.com/services/T000/B000/XXXXXXXXXXXXXXXX", "post {}"),
    ("openai", "sk-proj-AbCdEfGhIjKlMnOpQrStUvWxYz0123456789", "openai {}"),
    ("anthropic", "sk-ant-api03-AbCdEfGhIjKlMnOpQrStUvWxYz", "claude {}"),
    ("wandb", "0123456789abcdef0123456789abcdef01234567", "WANDB_API_KEY={}"),
    ("npm", "npm_AbCdEfGhIjKlMnOpQrStUvWxYz0123456789", "//registry/:_authToken {}"),
    (
        "pypi",
        "pypi-AgEIcHlwaS5vcmcCJGFiY2RlZmdoLTEyMzQtNTY3OC05MGFiLWNkZWYxMjM0NTY3OA",
        "upload {}",
    ),
    (
        "jwt",
        "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.dozjgNryP4J3jVmNHl0w5N_XgL0n3I9P",
        "Authorization: {}",
    ),
    ("bearer", "AbCdEfGhIjKlMnOpQrStUv0123", "Authorization: Bearer {}"),
    ("url-password", "s3cr3tPa55", "postgres://svc:{}@db.internal:5432/x"),
    ("url-password-https", "Tr0ub4dor", "https://bob:{}@git.example.com/repo.git"),
    ("cli-password", "hunter2hunter2", "train.py --password={}"),
    ("cli-token", "tok123456789abc", "launch --token {} --lr 3e-4"),
    ("cli-api-key", "apikey987654321", "client --api-key {}"),
    ("env-password", "letmein-please", "DB_PASSWORD={}"),
    ("env-secret", "verysecretvalue", "MY_APP_SECRET={}"),
    ("env-token", "t0k3nvalue99", "NGC_TOKEN={}"),
    ("azure", "AccountKey=" + "A" * 86 + "==", "conn DefaultEndpointsProtocol=https;{}"),
    ("stripe", "sk_live_" + "a1B2c3D4e5F6g7H8i9J0k1L2", "pay {}"),
    ("ngc", "nvapi-" + "AbCdEfGhIjKlMnOpQrStUvWxYz0123456789abcdefgh", "docker login {}"),
    ("json-password", "pw-in-json-123", '{{"password": "{}"}}'),
    (
        "private-key",
        "MIIEowIBAAKCAQEA1234567890abcdef",
        "-----BEGIN RSA PRIVATE KEY-----\n{}\n-----END RSA PRIVATE KEY-----",
    ),
]
BENIGN = [
    "RuntimeError: CUDA error: invalid device ordinal",
    "NCCL INFO Channel 00/02 : 0 1 2 3",
    "DataLoader worker (pid 3185) is killed by signal: Bus error.",
    "CUDA_VISIBLE_DEVICES=0,1 NCCL_DEBUG=INFO",
    "NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, GPU has fallen off the bus.",
]


def test_every_planted_secret_is_redacted_in_text() -> None:
    kinds = {k for k, _, _ in SECRETS}
    assert len(kinds) >= 30
    planted = [(k, v, tpl.format(v)) for k, v, tpl in SECRETS]
    # Each secret alone, all in one text, and repeated in noise: 300+ placements.
    texts = [line for _, _, line in planted] * 8 + ["\n".join(ln for _, _, ln in planted)]
    leaks = [(k, t) for t in texts for k, v, _ in planted if v in redact_text(t)]
    assert leaks == []


def test_benign_evidence_is_kept() -> None:
    for line in BENIGN:
        assert redact_text(line) == line


def test_json_env_and_labels() -> None:
    data = {
        "Config": {
            "Env": [
                "HF_TOKEN=hf_x",
                "PATH=/usr/bin",
                "WANDB_API_KEY=abc",
                "URL=https://u:pw1234@h/x",
            ],
            "Labels": {"db.password": "pw", "team": "ml", "ci.token": "t"},
            "Cmd": ["python", "train.py", "--password=pw5678"],
        }
    }
    out = json.dumps(redact_json(data))
    for secret in ("hf_x", '"abc"', "pw1234", '"pw"', '"t"', "pw5678"):
        assert secret not in out
    assert "PATH=/usr/bin" in out and '"team": "ml"' in out


def test_secrets_planted_in_a_container_never_reach_the_bundle(
    settings: Settings, make_container, container_name: str
) -> None:
    # Values with a recognisable format go under neutral names (found by format); bare values
    # under the names they carry in practice (found by name).
    by_name = {
        "wandb": "WANDB_API_KEY",
        "bearer": "API_BEARER_TOKEN",
        "aws-secret": "AWS_SECRET_ACCESS_KEY",
        "cli-password": "ADMIN_PASSWORD",
        "cli-token": "LAUNCH_TOKEN",
        "cli-api-key": "CLIENT_API_KEY",
        "env-password": "DB_PASSWORD",
        "env-secret": "MY_APP_SECRET",
        "env-token": "NGC_TOKEN",
        "url-password": "DB_PASS",
        "url-password-https": "GIT_PASS",
        "json-password": "JSON_PASSWORD",
        "private-key": "SSH_PRIVATE_KEY",
    }
    env = {by_name.get(k, f"X{i}"): v for i, (k, v, _) in enumerate(SECRETS) if "\n" not in v}
    env.update({"HF_TOKEN": SECRETS[5][1], "DB_PASSWORD": "letmein-please"})
    labels = {"secret.token": SECRETS[7][1], "wandb.api_key": SECRETS[17][1]}
    log_lines = "; ".join(
        f"echo '{tpl.format(v)}'" for _, v, tpl in SECRETS if "'" not in tpl and "\n" not in tpl
    )
    make_container(container_name, f"{log_lines}; sleep 300", environment=env, labels=labels)
    time.sleep(1.5)
    bundle = collect(
        Target(kind="local", name="local"),
        settings,
        container=container_name,
        trigger=f"it broke, my token is {SECRETS[5][1]}",
    )
    leaks = []
    for file in Path(bundle).rglob("*"):
        if file.is_file():
            data = file.read_text(errors="replace")
            leaks += [(file.name, k) for k, v, _ in SECRETS if v in data]
    assert leaks == []
    log = (Path(bundle) / "containers" / f"{container_name}.log").read_text()
    assert log.count("[REDACTED]") >= 20


def test_each_anchored_pattern_finds_what_its_plain_search_finds() -> None:
    """The redactor skips to the literals a pattern's matches start with
    (runbooks/collect/redact.py,
    `_Anchored`); a literal missing from a pattern's anchors would let its secrets through. Each
    pattern, anchored and plain, on the fixtures and the redaction tests' modules (they hold every
    secret format the tests plant) and on windows of them, in ASCII and not."""
    import random

    from runbooks.collect import redact

    fast = {n: v for n, v in vars(redact).items() if isinstance(v, redact._Anchored)}
    assert len(fast) >= 7, fast
    here = Path(__file__).parent
    texts = [
        p.read_text(errors="replace")[:8_000]
        for p in sorted((here / "fixtures").rglob("*"))
        if p.is_file() and p.suffix in {".txt", ".log", ".xml", ".json"}
    ]
    texts += [(here / f).read_text() for f in ("test_redact.py", "test_hostile_secrets.py")]
    texts += [line.format(value) for _, value, line in SECRETS]
    rng = random.Random(17)
    windows = []
    for text in texts:
        for _ in range(2):
            at = rng.randrange(len(text) + 1)
            windows.append(text[at : at + rng.randrange(1, 2000)])
    found = 0
    for name, anchored in fast.items():
        for text in texts + windows + ["Ä " + w for w in windows[:200]]:
            plain = [m.span() for m in anchored.pattern.finditer(text)]
            starts = anchored.starts(text)
            mine, pos = [], 0
            while m := anchored.search(text, pos, starts):
                mine.append(m.span())
                pos = max(m.end(), m.start() + 1)
            assert mine == plain, (name, text[:200])
            found += len(plain)
    assert found > 100  # the texts hold secrets of every kind: the comparison is not empty
