"""Secret redaction, applied at collection time to every text and JSON that enters a bundle.

What is replaced by ``[REDACTED]``:
- values of variables/keys whose names look like credentials (``HF_TOKEN=hf_abc`` ->
  ``HF_TOKEN=[REDACTED]``; ``"password": "x"``; labels such as ``db.password``);
- passwords inside URLs (``https://user:pw@host`` -> ``https://user:[REDACTED]@host``);
- command-line secrets (``--password=x``, ``--token x``, ``--api-key x``);
- well-known token formats anywhere (AWS/GCP keys, Hugging Face, GitHub, Slack, OpenAI,
  W&B-style hex keys after a key name, JWTs, PEM private keys, Bearer tokens).
Pure: no I/O. It errs toward over-redaction; it never removes lines (line numbers stay valid).
"""

from __future__ import annotations

import re
from typing import Any

MASK = "[REDACTED]"

_CREDENTIAL_WORDS = (
    r"pass(?:wd|word|phrase)?|secret|token|api[_-]?key|access[_-]?key|private[_-]?key|"
    r"secret[_-]?key|auth(?:orization)?|credentials?|session[_-]?id|cookie|signature|"
    r"(?<![a-z])key(?![a-z])|dsn|conn(?:ection)?[_-]?string|webhook"
)
_NAME_IS_SECRET = re.compile(
    rf"(?i)(?:^|[_.\-])(?:{_CREDENTIAL_WORDS})(?:$|[_.\-])|(?i:{_CREDENTIAL_WORDS})$"
)

# NAME=value / NAME: value where NAME looks like a credential (env lines, configs, logs).
_ASSIGN = re.compile(
    rf"(?i)(?P<name>\b[A-Za-z0-9_.\-]*(?:{_CREDENTIAL_WORDS})[A-Za-z0-9_.\-]*)"
    r"(?P<sep>\s*[=:]\s*|\"\s*:\s*\")(?P<quote>[\"']?)(?P<value>[^\s\"',;}]+)"
)
_URL_CRED = re.compile(
    r"(?P<pre>\b[a-zA-Z][a-zA-Z0-9+.\-]*://[^\s:/@\"']+:)(?P<pw>[^\s@/\"']+)(?P<at>@)"
)
_CLI_FLAG = re.compile(
    r"(?i)(?P<flag>--?(?:[a-z0-9]+-)*(?:password|passwd|pass|token|secret|api-key|apikey|"
    r"access-key|secret-key|key|auth|credentials?))(?P<sep>=|\s+)(?P<value>(?!-)[^\s\"']+)"
)
_BEARER = re.compile(r"(?i)\b(?P<kind>bearer|basic|token)\s+(?P<value>[A-Za-z0-9._~+/=\-]{12,})")
_PEM = re.compile(
    r"-----BEGIN (?P<kind>[A-Z ]*PRIVATE KEY)-----.*?(?:-----END (?P=kind)-----|\Z)", re.DOTALL
)
_TOKENS = re.compile(
    "|".join(
        [
            r"\bAKIA[0-9A-Z]{16}\b",  # AWS access key id
            r"\bASIA[0-9A-Z]{16}\b",  # AWS temporary key id
            r"\bAIza[0-9A-Za-z_\-]{35}\b",  # Google API key
            r"\bya29\.[0-9A-Za-z_\-]{20,}",  # Google OAuth token
            r"\bhf_[A-Za-z0-9]{30,}\b",  # Hugging Face
            r"\bapi_org_[A-Za-z0-9]{30,}\b",  # Hugging Face org
            r"\bgh[pousr]_[A-Za-z0-9]{36,}\b",  # GitHub
            r"\bgithub_pat_[A-Za-z0-9_]{40,}\b",
            r"\bglpat-[A-Za-z0-9_\-]{20,}\b",  # GitLab
            r"\bxox[abposre]-[A-Za-z0-9\-]{10,}\b",  # Slack tokens
            r"\bxapp-[0-9]-[A-Za-z0-9\-]{10,}\b",  # Slack app-level token
            r"https://hooks\.slack\.com/services/[A-Za-z0-9/]+",
            r"\bsk-(?:ant-|proj-)?[A-Za-z0-9_\-]{20,}\b",  # OpenAI / Anthropic
            r"\bnpm_[A-Za-z0-9]{36}\b",
            r"\bpypi-[A-Za-z0-9_\-]{50,}\b",
            r"\bdop_v1_[a-f0-9]{64}\b",  # DigitalOcean
            r"\bSG\.[A-Za-z0-9_\-]{22}\.[A-Za-z0-9_\-]{43}\b",  # SendGrid
            r"\bsk_live_[0-9a-zA-Z]{24,}\b",  # Stripe
            r"\brk_live_[0-9a-zA-Z]{24,}\b",
            r"\bAccountKey=[A-Za-z0-9+/=]{40,}",  # Azure storage
            r"\beyJ[A-Za-z0-9_\-]{8,}\.eyJ[A-Za-z0-9_\-]{8,}\.[A-Za-z0-9_\-]{8,}",  # JWT
            r"\bnvapi-[A-Za-z0-9_\-]{40,}\b",  # NVIDIA NGC
        ]
    )
)


def name_is_secret(name: str) -> bool:
    """True when a variable/label/key name looks like it holds a credential."""
    return bool(_NAME_IS_SECRET.search(name))


def redact_text(text: str) -> str:
    """Redact secrets in free text (logs, command output, command lines)."""
    if not text:
        return text
    text = _PEM.sub(lambda m: f"-----BEGIN {m.group('kind')}-----{MASK}", text)
    text = _URL_CRED.sub(lambda m: f"{m.group('pre')}{MASK}{m.group('at')}", text)
    text = _TOKENS.sub(MASK, text)
    text = _BEARER.sub(lambda m: f"{m.group('kind')} {MASK}", text)
    text = _ASSIGN.sub(_assign_repl, text)
    text = _CLI_FLAG.sub(lambda m: f"{m.group('flag')}{m.group('sep')}{MASK}", text)
    return text


def _assign_repl(m: re.Match[str]) -> str:
    if m.group("value") == MASK:
        return m.group(0)
    return f"{m.group('name')}{m.group('sep')}{m.group('quote')}{MASK}"


def redact_json(value: Any, key: str = "") -> Any:
    """Redact a JSON-like structure (docker inspect, docker info) recursively.

    A string under a credential-like key is replaced whole; other strings go through
    redact_text; ``Env`` entries ``NAME=value`` are judged by NAME.
    """
    if isinstance(value, dict):
        return {k: redact_json(v, str(k)) for k, v in value.items()}
    if isinstance(value, list):
        if key == "Env":
            return [_redact_env_item(v) if isinstance(v, str) else redact_json(v) for v in value]
        return [redact_json(v, key) for v in value]
    if isinstance(value, str):
        if key and name_is_secret(key) and value:
            return MASK
        return redact_text(value)
    return value


def _redact_env_item(item: str) -> str:
    name, sep, val = item.partition("=")
    if sep and name_is_secret(name) and val:
        return f"{name}={MASK}"
    return redact_text(item)
