"""A corpus of planted secrets, and a search for any of them in what cudamedic wrote (PURE).

Issue 8 ("Secrets and access") asks that no secret planted in a container's environment, labels,
command line or logs reaches a bundle, a report, a log, a Prefect artifact or a Slack payload.
This module makes the secrets and finds them again; the suites plant them and scan the output.

API (kept stable: the pure suite and the lab end-to-end suite both use it)::

    corpus(seed=0, per_kind=10) -> list[Planted]
        `per_kind` fresh secrets of each kind in KINDS (70 kinds: cloud keys, ML platforms, code
        hosting and registries, Slack, other services, JWT/Bearer/Basic, PEM/PGP private keys,
        passwords in URLs and on command lines, credential-named env vars, and issue 15's forms:
        abbreviated and plural names, values with spaces or punctuation, cut key bodies), drawn from
        random.Random(seed) in that kind's real format (prefix, alphabet, length). The same
        seed gives the same corpus. Every value is unique, so a leak search is unambiguous.

    Planted (frozen dataclass), one secret and the four ways it is planted:
        kind         e.g. "huggingface-token", "url-password-redis", "rsa-private-key"
        value        the secret as a person sets it: a token, a password, a webhook URL, a PEM
                     block (multi-line)
        needles      the strings that must never appear in output: (value,) for most kinds; the
                     password alone for passwords inside URLs and `--password` arguments; the
                     secret path segment of a Slack webhook; each base64 body line (>= 16 chars)
                     of a PEM block and the private_key_id of a service-account key
        env_name, env_value, env
                     an environment variable: a realistic name for the kind (unique across the
                     corpus: later ones get a `JOB<n>_` prefix), or a neutral name (`EXTRA_<n>`)
                     for kinds recognisable by their format alone; env == f"{env_name}={env_value}"
        label_key, label_value
                     a Docker label (unique keys; neutral keys for recognisable formats)
        argv         a command-line fragment, one list element per argument
                     (e.g. ("huggingface-cli", "login", "--token", "hf_..."))
        log          a log line that carries the secret (multi-line for PEM blocks)

    find_leaks(text, planted) -> list[tuple[str, str]]
        (kind, first 12 characters of the needle) for every needle found in `text`, as is,
        JSON-escaped (json.dumps(n)[1:-1]) or URL-quoted (urllib.parse.quote(n, safe="")), in
        corpus order, each needle once. Linear in the text: 4 MiB against the default corpus
        (650 secrets, ~1,400 needles) in about 0.1 s; the needle table is cached per corpus.

Limits: values hold no whitespace, quotes, backslashes, `,`, `;` or `}` (a redactor cannot
tell where such a value ends in free text); only exact needles count, a partly masked secret
does not.
"""

from __future__ import annotations

import base64
import json
import random
import re
import string
import urllib.parse
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import lru_cache

__all__ = ["KINDS", "Planted", "corpus", "find_leaks"]

UPPER_DIGITS = string.ascii_uppercase + string.digits
ALNUM = string.ascii_letters + string.digits
B64 = ALNUM + "+/"
B64URL = ALNUM + "-_"
HEX = "0123456789abcdef"
# Passwords as people type them: no whitespace, quotes, backslash, `,`, `;` or `}`.
PASSWORD = ALNUM + "!#$%^&*-_+=.~@"
# Passwords inside URLs: what needs no percent-encoding in the userinfo part.
URL_PASSWORD = ALNUM + "-._~!*"


@dataclass(frozen=True)
class Planted:
    """One planted secret and its four carriers (see the module docstring)."""

    kind: str
    value: str
    needles: tuple[str, ...]
    env_name: str
    env_value: str
    label_key: str
    label_value: str
    argv: tuple[str, ...]
    log: str

    @property
    def env(self) -> str:
        return f"{self.env_name}={self.env_value}"


@dataclass(frozen=True)
class _Kind:
    """How to make one kind: a value, and templates for its carriers.

    Templates are str.format strings over {v} (the value) and {n} (the env name); `argv` items
    are tuples of such templates. `recognisable`: found by format alone, so half the instances
    are planted under neutral env names and label keys.
    """

    name: str
    make: Callable[[random.Random], str]
    env: tuple[str, ...]
    label: tuple[str, ...]
    argv: tuple[tuple[str, ...], ...]
    log: tuple[str, ...]
    recognisable: bool = False
    env_value: str = "{v}"
    needles: Callable[[str], tuple[str, ...]] | None = None


def _s(rng: random.Random, alphabet: str, n: int) -> str:
    return "".join(rng.choice(alphabet) for _ in range(n))


def _b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def _jwt(rng: random.Random) -> str:
    alg = rng.choice(["HS256", "RS256", "ES256"])
    header = _b64url(json.dumps({"alg": alg, "typ": "JWT"}, separators=(",", ":")).encode())
    claims = {
        "sub": _s(rng, HEX, 24),
        "iss": rng.choice(["https://auth.example.com/", "vault", "kubernetes/serviceaccount"]),
        "iat": rng.randint(1_600_000_000, 1_750_000_000),
        "exp": rng.randint(1_750_000_000, 1_900_000_000),
    }
    payload = _b64url(json.dumps(claims, separators=(",", ":")).encode())
    sig_len = {"HS256": 43, "RS256": 342, "ES256": 86}[alg]
    return f"{header}.{payload}.{_s(rng, B64URL, sig_len)}"


def _pem_body(rng: random.Random, first: str, lines: int, width: int = 64) -> list[str]:
    body = (first + _s(rng, B64, width * lines))[: width * lines - rng.randint(0, width - 20)]
    return [body[i : i + width] for i in range(0, len(body), width)]


def _pem(label: str, first: str, lines: tuple[int, int], width: int = 64) -> Callable[..., str]:
    def make(rng: random.Random) -> str:
        body = _pem_body(rng, first, rng.randint(*lines), width)
        if label == "PGP PRIVATE KEY BLOCK":
            body = ["", *body, "=" + _s(rng, B64, 4)]
        return "\n".join([f"-----BEGIN {label}-----", *body, f"-----END {label}-----"])

    return make


def _pem_needles(value: str) -> tuple[str, ...]:
    lines = [ln.strip() for ln in value.replace("\\n", "\n").splitlines()]
    return tuple(ln for ln in lines if len(ln) >= 16 and not ln.startswith("-----"))


def _service_account(rng: random.Random) -> str:
    key = _pem("PRIVATE KEY", "MIIEvQIBADANBgkqhkiG9w0BAQEFAASC", (10, 16))(rng) + "\n"
    project = f"{rng.choice(['ml', 'train', 'infer'])}-{_s(rng, string.ascii_lowercase, 6)}"
    return json.dumps(
        {
            "type": "service_account",
            "project_id": project,
            "private_key_id": _s(rng, HEX, 40),
            "private_key": key,
            "client_email": f"trainer@{project}.iam.gserviceaccount.com",
            "client_id": _s(rng, string.digits, 21),
        },
        separators=(",", ":"),
    )


def _service_account_needles(value: str) -> tuple[str, ...]:
    data = json.loads(value)
    return (data["private_key_id"], *_pem_needles(data["private_key"]))


def _webhook(rng: random.Random) -> str:
    team, bot = "T" + _s(rng, UPPER_DIGITS, 10), "B" + _s(rng, UPPER_DIGITS, 10)
    return f"https://hooks.slack.com/services/{team}/{bot}/{_s(rng, ALNUM, 24)}"


def _sas(rng: random.Random) -> str:
    return urllib.parse.quote(base64.b64encode(rng.randbytes(32)).decode(), safe="")


def _basic(rng: random.Random) -> str:
    user = rng.choice(["admin", "ci", "svc-train", "grafana", "registry"])
    return f"{user}:{_s(rng, PASSWORD.replace(':', ''), rng.randint(14, 22))}"


def _basic_needles(value: str) -> tuple[str, ...]:
    return (value.partition(":")[2], base64.b64encode(value.encode()).decode())


def _password(lo: int = 12, hi: int = 24, alphabet: str = PASSWORD) -> Callable[..., str]:
    def make(rng: random.Random) -> str:
        # Start with a letter: a value starting with `-` reads as the next flag.
        return rng.choice(string.ascii_letters) + _s(rng, alphabet, rng.randint(lo, hi) - 1)

    return make


def _passphrase(rng: random.Random) -> str:
    """Words with spaces, as a person types a passphrase (the first word may be masked alone)."""
    return " ".join(_s(rng, string.ascii_lowercase, rng.randint(12, 14)) for _ in range(4))


def _passphrase_needles(value: str) -> tuple[str, ...]:
    return tuple(value.split()[1:])  # what a redactor that stops at the first space leaves


def _dashed_password(rng: random.Random) -> str:
    """A password that starts with `-` or holds `;` and `/` (cut short by a naive redactor)."""
    head = rng.choice(["-", "", ""]) + _s(rng, string.ascii_letters, 1)
    return head + _s(rng, ALNUM, 6) + rng.choice(";/") + _s(rng, ALNUM + "-_", rng.randint(12, 16))


def _tail_needles(value: str) -> tuple[str, ...]:
    return (value.lstrip("-").split(";")[-1].split("/")[-1],)


def _pem_cut(value: str) -> str:
    """A PEM block as a log tail shows it when its BEGIN line fell outside the tail."""
    return "\n".join(value.splitlines()[1:])


def _fixed(prefix: str, alphabet: str, lo: int, hi: int | None = None) -> Callable[..., str]:
    def make(rng: random.Random) -> str:
        return prefix + _s(rng, alphabet, rng.randint(lo, hi or lo))

    return make


_LOG_ANY = (
    "INFO using credential {v}",
    "{n}={v}",
    'DEBUG request headers={{"X-Api-Key": "{v}"}}',
    '{{"level":"debug","msg":"auth configured","token":"{v}"}}',
    "WARNING: config value {v} is deprecated",
    "export {n}={v}",
)
_LOG_NAMED = (
    "{n}={v}",
    "export {n}='{v}'",
    'config: {{"password": "{v}", "host": "db.internal"}}',
    "password: {v}",
    "settings loaded: {n}={v} (from environment)",
)


def _url(scheme: str, users: tuple[str, ...], hosts: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(f"{scheme}://{u}:{{v}}@{h}" for u in users for h in hosts)


_KINDS: tuple[_Kind, ...] = (
    # --- cloud keys
    _Kind(
        "aws-access-key-id",
        _fixed("AKIA", UPPER_DIGITS.replace("0", "").replace("1", ""), 16),
        env=("AWS_ACCESS_KEY_ID",),
        label=("aws.access-key-id",),
        argv=(("aws", "configure", "set", "aws_access_key_id", "{v}"),),
        log=("aws_access_key_id = {v}", *_LOG_ANY),
        recognisable=True,
    ),
    _Kind(
        "aws-temporary-key-id",
        _fixed("ASIA", UPPER_DIGITS.replace("0", "").replace("1", ""), 16),
        env=("AWS_ACCESS_KEY_ID",),
        label=("aws.access-key-id",),
        argv=(("env", "AWS_ACCESS_KEY_ID={v}", "python", "sync.py"),),
        log=("botocore.credentials: Found credentials {v} from assume-role", *_LOG_ANY),
        recognisable=True,
    ),
    _Kind(
        "aws-secret-access-key",
        _fixed("", B64, 40),
        env=("AWS_SECRET_ACCESS_KEY", "S3_SECRET_KEY"),
        label=("aws.secret-access-key", "s3.secret_key"),
        argv=(
            ("rclone", "copy", "--s3-secret-access-key", "{v}", "s3:ckpt", "/data"),
            ("env", "AWS_SECRET_ACCESS_KEY={v}", "aws", "s3", "ls"),
        ),
        log=("aws_secret_access_key = {v}", "AWS_SECRET_ACCESS_KEY={v}", "secret_key: {v}"),
    ),
    _Kind(
        "aws-session-token",
        lambda rng: (
            rng.choice(["IQoJb3JpZ2luX2Vj", "FwoGZXIvYXdzE"]) + _s(rng, B64, rng.randint(300, 400))
        ),
        env=("AWS_SESSION_TOKEN",),
        label=("aws.session-token",),
        argv=(("env", "AWS_SESSION_TOKEN={v}", "aws", "sts", "get-caller-identity"),),
        log=("aws_session_token = {v}", *_LOG_ANY),
        recognisable=True,
    ),
    _Kind(
        "gcp-api-key",
        _fixed("AIza", B64URL, 35),
        env=("GOOGLE_API_KEY", "GEMINI_API_KEY"),
        label=("gcp.api-key",),
        argv=(("curl", "https://generativelanguage.googleapis.com/v1/models?key={v}"),),
        log=("google.api_core: using key {v}", *_LOG_ANY),
        recognisable=True,
    ),
    _Kind(
        "gcp-oauth-token",
        lambda rng: "ya29." + _s(rng, B64URL, rng.randint(140, 220)),
        env=("GOOGLE_OAUTH_ACCESS_TOKEN", "CLOUDSDK_AUTH_ACCESS_TOKEN"),
        label=("gcp.access-token",),
        argv=(("gsutil", "-o", "Credentials:gs_oauth2_refresh_token={v}", "ls"),),
        log=("refreshed access token {v} (expires in 3599s)", *_LOG_ANY),
        recognisable=True,
    ),
    _Kind(
        "gcp-service-account-key",
        _service_account,
        env=("GOOGLE_APPLICATION_CREDENTIALS_JSON", "GCP_SA_KEY"),
        label=("gcp.service-account",),
        argv=(("sh", "-c", "echo '{v}' > /tmp/sa.json && gcloud auth activate-service-account"),),
        log=("loaded credentials: {v}",),
        recognisable=True,
        needles=_service_account_needles,
    ),
    _Kind(
        "azure-storage-account-key",
        lambda rng: base64.b64encode(rng.randbytes(64)).decode(),
        env=("AZURE_STORAGE_CONNECTION_STRING",),
        label=("azure.storage-connection",),
        argv=(
            ("az", "storage", "blob", "upload", "--account-key", "{v}", "-f", "ckpt.pt"),
            (
                "azcopy",
                "--connection-string",
                "DefaultEndpointsProtocol=https;AccountName=mlckpt;AccountKey={v};"
                "EndpointSuffix=core.windows.net",
            ),
        ),
        log=(
            "DefaultEndpointsProtocol=https;AccountName=mlckpt;AccountKey={v};"
            "EndpointSuffix=core.windows.net",
            "AZURE_STORAGE_KEY={v}",
        ),
        env_value="DefaultEndpointsProtocol=https;AccountName=mlckpt;AccountKey={v};"
        "EndpointSuffix=core.windows.net",
        recognisable=True,
    ),
    _Kind(
        "azure-sas-signature",
        _sas,
        env=("AZURE_BLOB_SAS_URL", "CHECKPOINT_URL"),
        label=("azure.sas-url",),
        argv=(
            (
                "azcopy",
                "copy",
                "https://mlckpt.blob.core.windows.net/ckpt?sv=2022-11-02&ss=b&srt=sco&sp=rl"
                "&se=2030-01-01T00:00:00Z&spr=https&sig={v}",
                "/data",
            ),
        ),
        log=(
            "GET https://mlckpt.blob.core.windows.net/ckpt/model.pt?sv=2022-11-02&sr=b&sp=r"
            "&sig={v} 200",
            "download from https://mlckpt.blob.core.windows.net/c/x.bin?sp=r&st=2025-01-01"
            "&se=2030-01-01&spr=https&sv=2022-11-02&sr=c&sig={v} failed",
        ),
        env_value="https://mlckpt.blob.core.windows.net/ckpt?sv=2022-11-02&sp=rl&sig={v}",
        recognisable=True,
    ),
    _Kind(
        "azure-client-secret",
        lambda rng: _s(rng, ALNUM, 3) + rng.choice("78") + "Q~" + _s(rng, ALNUM + "_~.-", 34),
        env=("AZURE_CLIENT_SECRET", "ARM_CLIENT_SECRET"),
        label=("azure.client-secret",),
        argv=(("az", "login", "--service-principal", "-u", "app-id", "--password", "{v}"),),
        log=("client_secret: {v}", "AZURE_CLIENT_SECRET={v}", *_LOG_ANY[:2]),
        recognisable=True,
    ),
    # --- ML platforms
    _Kind(
        "huggingface-token",
        _fixed("hf_", string.ascii_letters, 34),
        env=("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HUGGINGFACE_TOKEN"),
        label=("huggingface.token",),
        argv=(
            ("huggingface-cli", "login", "--token", "{v}"),
            ("python", "serve.py", "--hf-token={v}", "--model", "meta-llama/Llama-3-8B"),
        ),
        log=("Token is valid (permission: read). Your token {v} has been saved", *_LOG_ANY),
        recognisable=True,
    ),
    _Kind(
        "huggingface-org-token",
        _fixed("api_org_", string.ascii_letters, 34),
        env=("HF_ORG_TOKEN",),
        label=("huggingface.org-token",),
        argv=(("python", "push.py", "--hub_token", "{v}"),),
        log=("pushing with org token {v}", *_LOG_ANY),
        recognisable=True,
    ),
    _Kind(
        "wandb-api-key",
        _fixed("", HEX, 40),
        env=("WANDB_API_KEY",),
        label=("wandb.api-key",),
        argv=(("wandb", "login", "{v}"), ("wandb", "login", "--relogin", "{v}")),
        log=(
            "WANDB_API_KEY={v}",
            "wandb login {v}",
            "machine api.wandb.ai login user password {v}",
        ),
    ),
    _Kind(
        "openai-api-key",
        lambda rng: "sk-" + _s(rng, ALNUM, 20) + "T3BlbkFJ" + _s(rng, ALNUM, 20),
        env=("OPENAI_API_KEY",),
        label=("openai.api-key",),
        argv=(("python", "eval.py", "--openai-api-key", "{v}"),),
        log=("openai.AuthenticationError: Incorrect API key provided: {v}", *_LOG_ANY),
        recognisable=True,
    ),
    _Kind(
        "openai-project-key",
        lambda rng: (
            rng.choice(["sk-proj-", "sk-svcacct-", "sk-admin-"])
            + _s(rng, B64URL, rng.randint(120, 160))
        ),
        env=("OPENAI_API_KEY",),
        label=("openai.api-key",),
        argv=(("python", "judge.py", "--api-key={v}"),),
        log=("Error code: 401 - Incorrect API key provided: {v}.", *_LOG_ANY),
        recognisable=True,
    ),
    _Kind(
        "anthropic-api-key",
        lambda rng: "sk-ant-api03-" + _s(rng, B64URL, 93) + "AA",
        env=("ANTHROPIC_API_KEY",),
        label=("anthropic.api-key",),
        argv=(("python", "agent.py", "--anthropic_api_key", "{v}"),),
        log=("anthropic client created with api_key={v}", *_LOG_ANY),
        recognisable=True,
    ),
    _Kind(
        "ngc-api-key",
        _fixed("nvapi-", B64URL, 64),
        env=("NGC_API_KEY", "NVIDIA_API_KEY"),
        label=("nvidia.ngc-api-key",),
        argv=(("docker", "login", "nvcr.io", "-u", "$oauthtoken", "-p", "{v}"),),
        log=("ngc config set: apikey {v}", *_LOG_ANY),
        recognisable=True,
    ),
    _Kind(
        "replicate-api-token",
        _fixed("r8_", ALNUM, 37),
        env=("REPLICATE_API_TOKEN",),
        label=("replicate.token",),
        argv=(("python", "run.py", "--replicate-token", "{v}"),),
        log=("replicate: authenticating with {v}", *_LOG_ANY),
        recognisable=True,
    ),
    _Kind(
        "kaggle-key",
        _fixed("", HEX, 32),
        env=("KAGGLE_KEY",),
        label=("kaggle.key",),
        argv=(("env", "KAGGLE_KEY={v}", "kaggle", "datasets", "download", "x/y"),),
        log=('{{"username":"trainer","key":"{v}"}}', "KAGGLE_KEY={v}"),
    ),
    # --- code hosting and package registries
    *(
        _Kind(
            kind,
            _fixed(prefix, ALNUM, n),
            env=("GITHUB_TOKEN", "GH_TOKEN", "GIT_AUTH_TOKEN"),
            label=("ci.github-token",),
            argv=(
                ("git", "clone", "https://x-access-token:{v}@github.com/org/repo.git"),
                ("gh", "auth", "login", "--with-token", "{v}"),
            ),
            log=("remote: Invalid username or token {v}", *_LOG_ANY),
            recognisable=True,
        )
        for kind, prefix, n in (
            ("github-classic-pat", "ghp_", 36),
            ("github-oauth-token", "gho_", 36),
            ("github-app-user-token", "ghu_", 36),
            ("github-app-installation-token", "ghs_", 36),
            ("github-refresh-token", "ghr_", 76),
        )
    ),
    _Kind(
        "github-fine-grained-pat",
        lambda rng: f"github_pat_11{_s(rng, UPPER_DIGITS, 20)}_{_s(rng, ALNUM, 59)}",
        env=("GITHUB_TOKEN", "GH_PAT"),
        label=("ci.github-token",),
        argv=(("git", "clone", "https://{v}@github.com/org/private.git"),),
        log=("fatal: Authentication failed for token {v}", *_LOG_ANY),
        recognisable=True,
    ),
    _Kind(
        "gitlab-pat",
        _fixed("glpat-", B64URL, 20),
        env=("GITLAB_TOKEN", "CI_JOB_TOKEN"),
        label=("ci.gitlab-token",),
        argv=(("git", "clone", "https://oauth2:{v}@gitlab.com/group/project.git"),),
        log=("401 Unauthorized: private token {v}", *_LOG_ANY),
        recognisable=True,
    ),
    _Kind(
        "npm-token",
        _fixed("npm_", ALNUM, 36),
        env=("NPM_TOKEN",),
        label=("ci.npm-token",),
        argv=(("npm", "config", "set", "//registry.npmjs.org/:_authToken={v}"),),
        log=("//registry.npmjs.org/:_authToken={v}", *_LOG_ANY),
        recognisable=True,
    ),
    _Kind(
        "pypi-token",
        lambda rng: "pypi-AgEIcHlwaS5vcmcC" + _s(rng, B64URL, rng.randint(140, 180)),
        env=("PYPI_TOKEN", "TWINE_PASSWORD"),
        label=("ci.pypi-token",),
        argv=(("twine", "upload", "-u", "__token__", "-p", "{v}", "dist/*"),),
        log=("password = {v}", *_LOG_ANY),
        recognisable=True,
    ),
    _Kind(
        "dockerhub-pat",
        _fixed("dckr_pat_", B64URL, 27),
        env=("DOCKERHUB_TOKEN", "DOCKER_PASSWORD"),
        label=("ci.dockerhub-token",),
        argv=(("docker", "login", "-u", "mlops", "-p", "{v}"),),
        log=("docker login -u mlops -p {v}", *_LOG_ANY),
        recognisable=True,
    ),
    # --- chat
    _Kind(
        "slack-bot-token",
        lambda rng: (
            f"xoxb-{_s(rng, string.digits, 12)}-{_s(rng, string.digits, 13)}-" + _s(rng, ALNUM, 24)
        ),
        env=("SLACK_BOT_TOKEN",),
        label=("slack.bot-token",),
        argv=(("python", "notify.py", "--slack-token", "{v}"),),
        log=("slack_sdk: invalid_auth for token {v}", *_LOG_ANY),
        recognisable=True,
    ),
    _Kind(
        "slack-user-token",
        lambda rng: (
            f"xoxp-{_s(rng, string.digits, 12)}-{_s(rng, string.digits, 12)}-"
            f"{_s(rng, string.digits, 13)}-{_s(rng, HEX, 32)}"
        ),
        env=("SLACK_USER_TOKEN",),
        label=("slack.user-token",),
        argv=(("curl", "-H", "Authorization: Bearer {v}", "https://slack.com/api/auth.test"),),
        log=("using slack user token {v}", *_LOG_ANY),
        recognisable=True,
    ),
    _Kind(
        "slack-app-token",
        lambda rng: (
            f"xapp-1-A{_s(rng, UPPER_DIGITS, 10)}-{_s(rng, string.digits, 13)}-" + _s(rng, HEX, 64)
        ),
        env=("SLACK_APP_TOKEN",),
        label=("slack.app-token",),
        argv=(("python", "bot.py", "--app-token={v}"),),
        log=("socket mode connecting with {v}", *_LOG_ANY),
        recognisable=True,
    ),
    _Kind(
        "slack-webhook",
        _webhook,
        env=("SLACK_WEBHOOK_URL", "ALERT_WEBHOOK"),
        label=("slack.webhook",),
        argv=(("curl", "-X", "POST", "-d", '{{"text":"done"}}', "{v}"),),
        log=("posting alert to {v}", "requests: POST {v} -> 404 no_service", *_LOG_ANY[:2]),
        recognisable=True,
        needles=lambda v: (v.rsplit("/", 1)[1],),
    ),
    # --- other services
    _Kind(
        "stripe-secret-key",
        lambda rng: rng.choice(["sk_live_", "sk_test_"]) + _s(rng, ALNUM, rng.randint(24, 99)),
        env=("STRIPE_SECRET_KEY",),
        label=("billing.stripe-key",),
        argv=(("stripe", "listen", "--api-key", "{v}"),),
        log=("stripe: No such customer (request with key {v})", *_LOG_ANY),
        recognisable=True,
    ),
    _Kind(
        "stripe-restricted-key",
        lambda rng: rng.choice(["rk_live_", "rk_test_"]) + _s(rng, ALNUM, rng.randint(24, 99)),
        env=("STRIPE_RESTRICTED_KEY",),
        label=("billing.stripe-restricted-key",),
        argv=(("python", "usage.py", "--stripe-key={v}"),),
        log=("metering with {v}", *_LOG_ANY),
        recognisable=True,
    ),
    _Kind(
        "sendgrid-api-key",
        lambda rng: f"SG.{_s(rng, B64URL, 22)}.{_s(rng, B64URL, 43)}",
        env=("SENDGRID_API_KEY",),
        label=("mail.sendgrid-key",),
        argv=(("python", "mail.py", "--sendgrid-key", "{v}"),),
        log=("sendgrid client with {v}", *_LOG_ANY),
        recognisable=True,
    ),
    _Kind(
        "digitalocean-token",
        _fixed("dop_v1_", HEX, 64),
        env=("DIGITALOCEAN_ACCESS_TOKEN",),
        label=("cloud.do-token",),
        argv=(("doctl", "auth", "init", "--access-token", "{v}"),),
        log=("doctl: using {v}", *_LOG_ANY),
        recognisable=True,
    ),
    _Kind(
        "vault-token",
        lambda rng: rng.choice(["hvs.", "hvb."]) + _s(rng, B64URL, rng.randint(90, 110)),
        env=("VAULT_TOKEN",),
        label=("vault.token",),
        argv=(("vault", "login", "{v}"),),
        log=("X-Vault-Token: {v}", *_LOG_ANY),
        recognisable=True,
    ),
    _Kind(
        "datadog-api-key",
        _fixed("", HEX, 32),
        env=("DD_API_KEY", "DATADOG_API_KEY"),
        label=("com.datadoghq.api-key",),
        argv=(("datadog-agent", "run", "--api-key={v}"),),
        log=("api_key: {v}", "DD_API_KEY={v}"),
    ),
    _Kind(
        "sentry-dsn",
        _fixed("", HEX, 32),
        env=("SENTRY_DSN",),
        label=("sentry.dsn",),
        argv=(("python", "serve.py", "--sentry-dsn", "https://{v}@o4501234.ingest.sentry.io/45"),),
        log=(
            "sentry_sdk: DSN https://{v}@o4501234.ingest.sentry.io/4505 configured",
            "sending event to https://{v}@o4501234.ingest.us.sentry.io/4505 failed",
        ),
        env_value="https://{v}@o4501234.ingest.sentry.io/4505",
        recognisable=True,
    ),
    # --- tokens in headers
    _Kind(
        "jwt",
        _jwt,
        env=("AUTH_JWT", "K8S_SA_TOKEN"),
        label=("auth.jwt",),
        argv=(("curl", "-H", "Authorization: Bearer {v}", "https://api.internal/v1/jobs"),),
        log=("Authorization: Bearer {v}", "id_token={v}", *_LOG_ANY),
        recognisable=True,
    ),
    _Kind(
        "bearer-token",
        _fixed("", B64URL + ".~", 40),
        env=("API_BEARER_TOKEN",),
        label=("api.bearer-token",),
        argv=(("curl", "-H", "Authorization: Bearer {v}", "https://api.internal/v1/jobs"),),
        log=("> Authorization: Bearer {v}", "GET /v1/jobs headers: authorization=Bearer {v}"),
    ),
    _Kind(
        "basic-auth",
        _basic,
        env=("REGISTRY_AUTH",),
        label=("registry.auth",),
        argv=(("curl", "-u", "{v}", "https://registry.internal/v2/_catalog"),),
        log=("> Authorization: Basic {b64}",),
        needles=_basic_needles,
    ),
    # --- private keys (multi-line)
    _Kind(
        "rsa-private-key",
        _pem("RSA PRIVATE KEY", "MIIEpAIBAAKCAQEA", (12, 25)),
        env=("SSH_PRIVATE_KEY", "DEPLOY_KEY"),
        label=("ssh.private-key",),
        argv=(("sh", "-c", "printf '%s' '{v}' > /root/.ssh/id_rsa"),),
        log=("{v}",),
        needles=_pem_needles,
    ),
    _Kind(
        "ec-private-key",
        _pem("EC PRIVATE KEY", "MHcCAQEEI", (3, 3)),
        env=("TLS_KEY", "JWT_SIGNING_KEY"),
        label=("tls.key",),
        argv=(("python", "serve.py", "--tls-key", "{v}"),),
        log=("loaded key:\n{v}",),
        needles=_pem_needles,
    ),
    _Kind(
        "openssh-private-key",
        _pem("OPENSSH PRIVATE KEY", "b3BlbnNzaC1rZXktdjEAAAAA", (5, 9), width=70),
        env=("SSH_KEY", "GIT_SSH_KEY"),
        label=("ssh.key",),
        argv=(("sh", "-c", "echo '{v}' | ssh-add -"),),
        log=("{v}",),
        needles=_pem_needles,
    ),
    _Kind(
        "pkcs8-private-key",
        _pem("PRIVATE KEY", "MIIEvgIBADANBgkqhkiG9w0BAQEFAASC", (10, 26)),
        env=("SERVER_KEY_PEM",),
        label=("tls.private-key",),
        argv=(("python", "serve.py", "--ssl-keyfile-content", "{v}"),),
        log=("{v}",),
        needles=_pem_needles,
    ),
    _Kind(
        "pgp-private-key",
        _pem("PGP PRIVATE KEY BLOCK", "lQOYBF", (8, 16)),
        env=("GPG_PRIVATE_KEY",),
        label=("release.gpg-key",),
        argv=(("sh", "-c", "echo '{v}' | gpg --import"),),
        log=("{v}",),
        needles=_pem_needles,
    ),
    # --- passwords
    _Kind(
        "ssh-password",
        _password(),
        env=("SSHPASS", "SSH_PASSWORD"),
        label=("ssh.password",),
        argv=(("sshpass", "-p", "{v}", "ssh", "root@gpu-07"),),
        log=("sshpass -p {v} ssh root@gpu-07", "ssh_password: {v}"),
    ),
    *(
        _Kind(
            kind,
            _password(12, 24, URL_PASSWORD),
            env=(env_name, "DATABASE_URL"),
            label=(f"{kind.split('-')[-1]}.url",),
            argv=(("python", "app.py", "--db-url", urls[0]), ("sh", "-c", f"connect {urls[-1]}")),
            log=tuple(f"connecting to {u}" for u in urls) + tuple(f"url={u}" for u in urls[:1]),
            env_value=urls[0],
        )
        for kind, env_name, urls in (
            (
                "url-password-postgres",
                "POSTGRES_DSN",
                _url("postgresql", ("svc", "airflow"), ("db.internal:5432/ml",))
                + _url("postgresql+psycopg2", ("mlflow",), ("pg:5432/mlflow",)),
            ),
            ("url-password-mysql", "MYSQL_URL", _url("mysql", ("root",), ("mysql:3306/optuna",))),
            (
                "url-password-redis",
                "REDIS_URL",
                ("redis://:{v}@redis:6379/0", "rediss://default:{v}@cache.internal:6380"),
            ),
            (
                "url-password-amqp",
                "CELERY_BROKER_URL",
                _url("amqp", ("guest", "celery"), ("rabbitmq:5672/vhost",)),
            ),
            (
                "url-password-https",
                "GIT_REMOTE",
                _url("https", ("bob",), ("git.example.com/ml/repo.git", "pypi.internal/simple")),
            ),
            (
                "url-password-mongodb-srv",
                "MONGO_URI",
                _url(
                    "mongodb+srv", ("trainer",), ("cluster0.ab1cd.mongodb.net/?retryWrites=true",)
                ),
            ),
        )
    ),
    _Kind(
        "url-query-token",
        _fixed("", B64URL, 32),
        env=("METRICS_PUSH_URL",),
        label=("metrics.push-url",),
        argv=(("curl", "https://api.example.com/v1/upload?access_token={v}&format=json"),),
        log=(
            "GET https://api.example.com/v1/status?api_key={v} 403",
            "POST https://hooks.example.com/notify?token={v}&channel=ops",
        ),
        env_value="https://push.example.com/metrics?access_token={v}",
    ),
    _Kind(
        "cli-password-equals",
        _password(),
        env=("ADMIN_PASSWORD",),
        label=("admin.password",),
        argv=(("python", "train.py", "--password={v}"), ("mlflow", "server", "--db-password={v}")),
        log=("launch: python train.py --password={v} --epochs 3", *_LOG_NAMED),
    ),
    _Kind(
        "cli-password-space",
        _password(),
        env=("DB_PASS",),
        label=("db.pass",),
        argv=(
            ("python", "migrate.py", "--password", "{v}"),
            ("wget", "--user", "ci", "--password", "{v}", "https://files.internal/data.tar"),
        ),
        log=("+ ./run.sh --password {v} --resume", *_LOG_NAMED),
    ),
    _Kind(
        "cli-token",
        _password(16, 40, ALNUM + "-_."),
        env=("LAUNCH_TOKEN", "JOB_TOKEN"),
        label=("launch.token",),
        argv=(("launch", "--token", "{v}", "--lr", "3e-4"), ("runner", "--auth-token={v}")),
        log=("cmdline: launch --token {v} --lr 3e-4", "token={v}", "auth_token: {v}"),
    ),
    _Kind(
        "cli-api-key",
        _password(20, 40, ALNUM),
        env=("CLIENT_API_KEY", "COMET_API_KEY", "PINECONE_API_KEY"),
        label=("client.api-key",),
        argv=(("client", "--api-key", "{v}"), ("python", "eval.py", "--api_key={v}")),
        log=("client --api-key {v}", "api_key={v}", 'config {{"api_key": "{v}"}}'),
    ),
    _Kind(
        "docker-login-password",
        _password(),
        env=("REGISTRY_PASSWORD",),
        label=("registry.password",),
        argv=(("docker", "login", "-u", "deploy", "-p", "{v}", "registry.internal:5000"),),
        log=("+ docker login -u deploy -p {v} registry.internal:5000", *_LOG_NAMED[:2]),
    ),
    _Kind(
        "env-db-password",
        _password(),
        env=("DB_PASSWORD", "POSTGRES_PASSWORD", "MYSQL_ROOT_PASSWORD", "REDIS_PASSWORD"),
        label=("db.password", "com.example.postgres-password"),
        argv=(("env", "{n}={v}", "python", "app.py"),),
        log=_LOG_NAMED,
    ),
    _Kind(
        "env-app-secret",
        _password(24, 50),
        env=("DJANGO_SECRET_KEY", "JWT_SECRET", "MY_APP_SECRET", "SESSION_SECRET", "SECRET_KEY"),
        label=("app.secret", "app.secret-key"),
        argv=(("env", "{n}={v}", "gunicorn", "app:wsgi"), ("flask", "run", "--secret={v}")),
        log=("{n}={v}", "secret_key: {v}", '{{"client_secret": "{v}"}}'),
    ),
    _Kind(
        "env-generic-token",
        _password(20, 48, ALNUM + "-_."),
        env=("NGC_TOKEN", "CI_TOKEN", "MLFLOW_TRACKING_TOKEN", "COMETML_TOKEN", "RUNPOD_TOKEN"),
        label=("ci.token", "mlflow.tracking-token"),
        argv=(("env", "{n}={v}", "python", "train.py"),),
        log=("{n}={v}", "token: {v}", '{{"refresh_token": "{v}"}}', "access_token={v}"),
    ),
    _Kind(
        "env-api-key",
        _password(24, 48, ALNUM + "-_"),
        env=("COHERE_API_KEY", "MISTRAL_API_KEY", "TOGETHER_API_KEY", "LANGCHAIN_API_KEY"),
        label=("llm.api-key", "llm.api_key"),
        argv=(("env", "{n}={v}", "python", "rag.py"),),
        log=("{n}={v}", "api_key: {v}", "x-api-key: {v}"),
    ),
)

# Issue 15: the forms an adversarial review found leaking (abbreviated and plural names, dict
# printouts, `=>`, tabs, XML, values with spaces or `;`, flags without a credential word at a
# boundary, positional `set NAME VALUE`, key bodies whose BEGIN line was cut off).
_KINDS += (
    _Kind(
        "abbreviated-credential-name",
        _password(),
        env=("MYSQL_PWD", "SMTP_PW", "REDIS_PW", "GCP_CREDS", "DB_CREDS", "LDAP_BIND_PW"),
        label=("app.api_keys", "app.secrets", "db.pwd", "ci.creds"),
        argv=(
            ("redis-server", "--requirepass", "{v}"),
            ("redis-server", "--masterauth", "{v}"),
            ("redis-cli", "-h", "cache", "-a", "{v}", "ping"),
            ("mosquitto_pub", "-h", "broker", "-P", "{v}", "-t", "jobs"),
            ("ldapsearch", "-D", "cn=admin", "-w", "{v}"),
            ("tool", "--pw", "{v}"),
            ("aws", "configure", "set", "aws_secret_access_key", "{v}"),
            ("redis-cli", "CONFIG", "SET", "requirepass", "{v}"),
        ),
        log=(
            "{{'db_password': '{v}', 'host': 'db'}}",
            "{{'hf_token': '{v}'}}",
            "key => {v}",
            "password\t{v}",
            "<password>{v}</password>",
            '{{"api_keys": ["{v}"]}}',
            '{{"secrets": "{v}"}}',
            "{n}={v}",
        ),
    ),
    _Kind(
        "passphrase-with-spaces",
        _passphrase,
        env=("GPG_PASSPHRASE", "KEY_PASSPHRASE"),
        label=("gpg.passphrase",),
        argv=(("gpg", "--batch", "--passphrase", "{v}", "-d", "key.gpg"),),
        log=(
            "PASSWORD='{v}'",
            'config: {{"password": "{v}", "host": "db.internal"}}',
            "{{'passphrase': '{v}'}}",
            "export {n}='{v}'",
            "<passphrase>{v}</passphrase>",
        ),
        needles=_passphrase_needles,
    ),
    _Kind(
        "punctuated-password",
        _dashed_password,
        env=("SERVICE_PASSWORD", "BROKER_PASSWORD"),
        label=("service.password",),
        argv=(("tool", "--password", "{v}"), ("tool", "--password={v}")),
        log=("password={v}", "{n}={v}", "+ tool --password {v}"),
        needles=_tail_needles,
    ),
    _Kind(
        "url-password-with-slash",
        lambda rng: _s(rng, ALNUM, 8) + "/" + _s(rng, ALNUM + "-._~", rng.randint(12, 16)),
        env=("DATABASE_URL", "WAREHOUSE_DSN"),
        label=("db.url",),
        argv=(("python", "app.py", "--db-url", "postgresql://svc:{v}@db.internal:5432/ml"),),
        log=("connecting to postgresql://svc:{v}@db.internal:5432/ml",),
        env_value="postgresql://svc:{v}@db.internal:5432/ml",
        needles=_tail_needles,
    ),
    _Kind(
        "rsa-private-key-cut",
        _pem("RSA PRIVATE KEY", "MIIEowIBAAKCAQEA", (8, 14)),
        env=("SSH_PRIVATE_KEY",),
        label=("ssh.private-key",),
        argv=(("sh", "-c", "echo '{v}' > /root/.ssh/id_rsa"),),
        log=("{cut}",),
        recognisable=True,
        needles=_pem_needles,
    ),
)

KINDS: tuple[str, ...] = tuple(k.name for k in _KINDS)


def _fill(template: str, value: str, name: str) -> str:
    b64 = base64.b64encode(value.encode()).decode()
    return template.format(v=value, n=name, b64=b64, cut=_pem_cut(value))


def corpus(seed: int = 0, per_kind: int = 10) -> list[Planted]:
    """`per_kind` fresh secrets of every kind, in that kind's real format (see module doc)."""
    rng = random.Random(seed)
    out: list[Planted] = []
    seen: set[str] = set()
    used_env: dict[str, int] = {}
    used_label: dict[str, int] = {}
    neutral = 0
    for kind in _KINDS:
        for i in range(per_kind):
            value = kind.make(rng)
            while value in seen:
                value = kind.make(rng)
            seen.add(value)
            needles = kind.needles(value) if kind.needles else (value,)
            if kind.recognisable and i % 2 == 1:
                neutral += 1
                env_name, label_key = f"EXTRA_{neutral}", f"org.example.note{neutral}"
            else:
                env_name = rng.choice(kind.env)
                label_key = rng.choice(kind.label)
                n = used_env[env_name] = used_env.get(env_name, 0) + 1
                if n > 1:
                    env_name = f"JOB{n}_{env_name}"
                n = used_label[label_key] = used_label.get(label_key, 0) + 1
                if n > 1:
                    label_key = f"job{n}.{label_key}"
            env_value = _fill(kind.env_value, value, env_name)
            argv = tuple(_fill(a, value, env_name) for a in rng.choice(kind.argv))
            log = _fill(rng.choice(kind.log), value, env_name)
            out.append(
                Planted(
                    kind=kind.name,
                    value=value,
                    needles=needles,
                    env_name=env_name,
                    env_value=env_value,
                    label_key=label_key,
                    label_value=env_value,
                    argv=argv,
                    log=log,
                )
            )
    return out


def _forms(needle: str) -> set[str]:
    return {needle, json.dumps(needle)[1:-1], urllib.parse.quote(needle, safe="")}


@dataclass(frozen=True)
class _Index:
    """Every needle form, findable from any of its `k`-character windows."""

    forms: dict[str, tuple[str, str]]  # form -> (kind, needle)
    windows: dict[str, list[tuple[str, int]]]  # k characters -> [(form, offset in form)]
    runs: re.Pattern[str]  # stretches of text that could hold a form
    k: int
    step: int


@lru_cache(maxsize=8)
def _index(planted: tuple[Planted, ...]) -> _Index:
    forms = {f: (p.kind, n) for p in planted for n in p.needles for f in _forms(n)}
    shortest = min(map(len, forms), default=1)
    # A form of length >= k + step - 1 covers a window that starts at a multiple of `step`.
    k = min(8, shortest)
    windows: dict[str, list[tuple[str, int]]] = {}
    for form in forms:
        for offset in range(len(form) - k + 1):
            windows.setdefault(form[offset : offset + k], []).append((form, offset))
    alphabet = "".join(re.escape(c) for c in sorted(set("".join(forms))))
    runs = re.compile(f"[{alphabet}]{{{shortest},}}")
    return _Index(forms, windows, runs, k, shortest - k + 1)


def find_leaks(text: str, planted: Iterable[Planted]) -> list[tuple[str, str]]:
    """(kind, needle prefix) for each planted needle in `text`: as is, JSON-escaped, URL-quoted.

    Every form is a stretch of characters from the forms' own alphabet, so only such stretches
    are searched, at every `step`-th window, in a table of all the forms' windows.
    """
    planted = tuple(planted)
    if not planted or not text:
        return []
    ix = _index(planted)
    found: set[str] = set()
    for run in ix.runs.finditer(text):
        start, end = run.span()
        for i in range(start, end - ix.k + 1, ix.step):
            for form, offset in ix.windows.get(text[i : i + ix.k], ()):
                if i - offset >= start and text.startswith(form, i - offset):
                    found.add(ix.forms[form][1])
    return [(p.kind, n[:12]) for p in planted for n in p.needles if n in found]
