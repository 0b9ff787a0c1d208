"""Every secret format of a maintained catalogue is redacted, through a real collection (issue 27,
finding 5). The formats are runbooks/knowledge/secret_formats.yaml: gitleaks' default rules with
a literal prefix (its header names the commit) and the few the review found it lacks. An example
of each is generated from its own pattern (so a format added to the table is tested without a
line here), planted in a lab container's environment (under a name that says nothing) and in
its log, and collected by `cudamedic collect` against the real engine: no file of the bundle
holds any of them. The review's other forms (names, flags, a token as a URL's user, `docker
login --password-stdin`, a bare AWS secret) go through the same collection."""

from __future__ import annotations

import random
import re
import shlex
import subprocess
from importlib import resources
from pathlib import Path
from re import _constants as C  # type: ignore[attr-defined]
from re import _parser as P  # type: ignore[attr-defined]
from typing import Any

import pytest
import yaml

from runbooks.collect.redact import MASK, name_is_secret, redact_json, redact_text
from runbooks.core.settings import Settings
from tests.lab.lab import LabState
from tests.test_fix import CLI, cli_env, fix_settings  # noqa: F401 - fixture

FORMATS = yaml.safe_load(
    resources.files("runbooks.knowledge").joinpath("secret_formats.yaml").read_text("utf-8")
)["formats"]
_DIGITS, _WORD = "0123456789", "abcdefXYZ0123456789_"


def _example(tree: Any, rnd: random.Random) -> str:
    """A string the parsed pattern matches: one character of each class, repeats at their
    least (at least once), the first branch."""
    out = []
    for op, av in tree:
        if op is C.LITERAL:
            out.append(chr(av))
        elif op is C.IN:
            chars: list[str] = []
            for o, a in av:
                if o is C.LITERAL:
                    chars.append(chr(a))
                elif o is C.RANGE:
                    chars += [chr(c) for c in range(a[0], a[1] + 1)]
                elif o is C.CATEGORY:
                    chars += list(_DIGITS if a is C.CATEGORY_DIGIT else _WORD)
            out.append(rnd.choice(chars))
        elif op in (C.MAX_REPEAT, C.MIN_REPEAT, C.POSSESSIVE_REPEAT):
            lo, hi, sub = av
            n = max(lo, 1) if hi == C.MAXREPEAT else max(lo, min(hi, lo + 8))
            out += [_example(sub, rnd) for _ in range(n)]
        elif op is C.SUBPATTERN:
            out.append(_example(av[3], rnd))
        elif op is C.BRANCH:
            out.append(_example(av[1][0], rnd))
        elif op is C.ANY:
            out.append("a")
    return "".join(out)


def example(fmt: dict[str, str], seed: int = 27) -> str:
    pattern = fmt["pattern"]
    rnd = random.Random(f"{fmt['id']}:{seed}")
    for _ in range(20):  # a class may draw a character that a later part of the rule refuses
        text = _example(P.parse(pattern), rnd)
        if re.fullmatch(pattern, text):
            return text
    raise AssertionError(f"no example for {fmt['id']}")


def test_the_catalogue_is_the_maintained_one() -> None:
    text = resources.files("runbooks.knowledge").joinpath("secret_formats.yaml").read_text()
    assert "github.com/gitleaks/gitleaks/blob/" in text and len(FORMATS) > 90
    ids = {f["id"] for f in FORMATS}
    for needed in ("gitlab-deploy-token", "gitlab-ptt", "gitlab-runner-authentication-token",
                   "databricks-api-token", "shopify-access-token", "linear-api-key",
                   "twilio-api-key", "grafana-service-account-token", "grafana-cloud-api-token",
                   "age-secret-key", "microsoft-teams-webhook", "slack-webhook-url",
                   "discord-webhook-url", "google-oauth-client-secret",
                   "google-oauth-refresh-token", "atlassian-api-token", "doppler-token",
                   "tailscale-key"):  # fmt: skip
        assert needed in ids, needed


@pytest.mark.parametrize("fmt", FORMATS, ids=[f["id"] for f in FORMATS])
def test_every_catalogue_format_is_redacted_in_text(fmt: dict[str, str]) -> None:
    secret = example(fmt)
    for text in (f"token {secret} end", f'{{"x": "{secret}"}}', f"Authorization: {secret}"):
        out = redact_text(text)
        assert secret not in out and MASK in out, (fmt["id"], out)


# The review's forms that are not a format: (carrier, text with {v}, value)
OTHER_FORMS = [
    ("name GITHUB_PAT", "GITHUB_PAT={v}", "Zq1githubpatK7x"),
    ("name GH_PAT", "GH_PAT={v}", "Zq2ghpatK7xyzw"),
    ("name *_PAT", "DEPLOY_PAT={v}", "Zq3deploypatK7x"),
    ("flag --github-pat", "gh-sync --github-pat {v} --repo a/b", "Zq4flagpatK7xyz"),
    ("flag --api", "client --api {v} -v", "Zq5flagapiK7xyz"),
    ("token as an https user", "git clone https://{v}@github.com/o/r", "Zq6Ab12Cd34Ef56Gh"),
    ("token as a postgres user", "postgres://{v}@db.internal/ml", "Zq7Ab12Cd34Ef56Gh"),
    ("--password-stdin", "echo {v} | docker login -u ci --password-stdin", "Zq8stdinK7x"),
    ("bare AWS secret", "AKIAIOSFODNN7EXAMPLE {v}", "wJalrXUtnFEMI/K7MDENG/bPxRfiCYZq9AAKEY01"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("form", "template", "value"), OTHER_FORMS, ids=[f[0] for f in OTHER_FORMS]
)
def test_the_reviews_other_forms_are_redacted(form: str, template: str, value: str) -> None:
    out = redact_text(template.format(v=value))
    assert value not in out and MASK in out, (form, out)


def test_credential_names_of_the_review() -> None:
    for name in ("GITHUB_PAT", "GH_PAT", "DEPLOY_PAT", "WANDB"):
        assert name_is_secret(name), name
    for name in ("PATH", "WANDB_PROJECT", "PATIENCE", "COMPAT_MODE"):
        assert not name_is_secret(name), name
    assert redact_json({"Env": ["WANDB=Zq1wandbK7"]}) == {"Env": [f"WANDB={MASK}"]}


def test_no_secret_of_the_catalogue_survives_a_real_collection(
    fix_settings: Settings,  # noqa: F811
    make_container: Any,
    container_name: str,
    lab: LabState,
    tmp_path: Path,
) -> None:
    secrets = {f["id"]: example(f, seed=1) for f in FORMATS}
    other = {form: template.format(v=value) for form, template, value in OTHER_FORMS}
    values = {**secrets, **{form: value for form, _, value in OTHER_FORMS}}
    env = {f"CM_VALUE_{n}": s for n, s in enumerate(secrets.values())}  # names that say nothing
    env |= {"GITHUB_PAT": "Zq1githubpatK7x", "GH_PAT": "Zq2ghpatK7xyzw", "WANDB": "Zq0wandbK7xy"}
    values["WANDB"] = "Zq0wandbK7xy"
    lines = [f"step {n}: {s}" for n, s in enumerate(secrets.values())] + list(other.values())
    script = (
        "printf '%s\\n' "
        + " ".join(shlex.quote(ln) for ln in lines)
        + "; echo done-printing; { trap 'exit 0' TERM; sleep 3600 & wait; }"
    )
    c = make_container(container_name, script, environment=env)
    for _ in range(100):
        if b"done-printing" in c.logs():
            break
        c.reload()
    out = subprocess.run(
        [*CLI, "collect", "gpu-healthy", "--container", container_name],
        capture_output=True, text=True, env=cli_env(lab, fix_settings), timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    files = [f for f in Path(fix_settings.out_dir).rglob("*") if f.is_file()]
    texts = {str(f): f.read_bytes().decode("utf-8", "replace") for f in files}
    logs = [t for name, t in texts.items() if "log" in name and "step 0" in t]
    assert logs, sorted(texts)  # the log was collected (and so every line was judged)
    assert any("CM_VALUE_0" in t for t in texts.values())  # and the environment
    leaks = sorted({k for k, v in values.items() for t in texts.values() if v in t})
    assert leaks == [], leaks
    assert leaks == [] and out.stdout.count(MASK) + sum(t.count(MASK) for t in texts.values())
