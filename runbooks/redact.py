"""Secret redaction, applied at collection time to every text and JSON that enters a bundle.

What is replaced by ``[REDACTED]``:
- values of variables/keys whose names look like credentials (``HF_TOKEN=hf_abc`` ->
  ``HF_TOKEN=[REDACTED]``; ``"password": "x"``; labels such as ``db.password``);
- passwords inside URLs (``https://user:pw@host``, ``redis://:pw@host``), Sentry DSN keys
  and Azure SAS signatures (``&sig=...``);
- command-line secrets (``--password=x``, ``--token 'x'``, ``--api_key x``; ``-p x`` after
  ``sshpass``/``mysql``/``... login``; ``curl -u user:pw``; ``wandb login <key>``);
- well-known token formats anywhere (AWS/GCP/Azure keys, Hugging Face, GitHub, GitLab, Slack,
  OpenAI, Anthropic, NGC, Docker Hub, npm, PyPI, Stripe, Vault, JWTs, PEM/PGP private keys,
  Bearer/Basic credentials).
Argument lists (docker inspect ``Cmd``, ``Entrypoint``, ``Args``) are judged as the command line
they form, so ``["--token", "x"]`` is redacted too. Pure: no I/O. It errs toward
over-redaction; it never removes lines (line numbers stay valid).
"""

from __future__ import annotations

import re
import shlex
from typing import Any

MASK = "[REDACTED]"

_CREDENTIAL_WORDS = (
    r"pass(?:wd|word|phrase)?|secret|token|api[_-]?key|access[_-]?key|private[_-]?key|"
    r"secret[_-]?key|auth(?:orization)?|credentials?|session[_-]?id|cookie|signature|"
    r"(?<![a-z])key(?![a-z])|dsn|conn(?:ection)?[_-]?string|webhook"
)
# A credential word as a part of the name (HF_TOKEN, db.password, apiKey, PASSWORD2), not
# inside a longer word (tokenizer, max_num_batched_tokens, authorized_keys).
_NAME_IS_SECRET = re.compile(
    rf"(?i)(?:^|[_.\-])(?:{_CREDENTIAL_WORDS})(?:$|[_.\-\d])|(?i:{_CREDENTIAL_WORDS})\d*$"
)
# Names with a credential word that are ML evidence, not credentials (vLLM/HF configs, metrics):
# tokenizer=..., skip_tokenizer_init=..., max_num_batched_tokens=..., authorized_keys:ro.
_EVIDENCE_NAME = re.compile(r"(?i)tokeni[sz]|tokens(?![a-z])|authorized_keys")
# Quantifiers are bounded (and possessive where backtracking is useless) so that no pattern
# rescans a long run of text from every position: hostile input stays linear.
_NAME_MAX = 128

# NAME=value / NAME: value / "NAME": "value" (also escaped inside a JSON string) where NAME
# holds a credential word (DB_PASSWORD, hfTokenPath, SECRETVALUE, API_KEYS). The match starts
# at the word: scanning from every name start is twice as slow.
_ASSIGN = re.compile(
    rf"(?i)(?P<name>(?:{_CREDENTIAL_WORDS})[A-Za-z0-9_.\-]{{0,{_NAME_MAX}}}+)"
    r"(?:\s*[=:]\s*|\\?\"\s*:\s*\\?\")[\"']?"
)
_ASSIGNED_VALUE = re.compile(r"[^\s\"',;}\\]+")
_URL_CRED = re.compile(
    r"(?P<pre>\b[a-zA-Z][a-zA-Z0-9+.\-]{0,31}://[^\s:/@\"']*:)(?P<pw>[^\s/\"']+)(?P<at>@)"
)
_CLI_FLAG = re.compile(
    r"(?i)(?P<flag>--?(?:[a-z0-9]{1,32}[-_]){0,8}(?:password|passwd|pass|token|secret|"
    r"api[-_]?key|access[-_]?key|secret[-_]?key|key|auth|credentials?|dsn))(?P<sep>=|\s+)"
    r"(?P<quote>[\"']?)(?P<value>(?!-)[^\s\"']+)"
)
# Positional secrets of a few commands: `sshpass -p pw`, `docker login -u me -p pw`,
# `mysql -ppw`, `curl -u user:pw`, `wandb login <key>`, a .netrc `password <key>`.
_CLI_CONTEXT = re.compile(
    r"(?P<pre>\b(?:sshpass|mysql(?:dump|admin)?|login)\b[^\n;&|]{0,256}?[ \t]-p[ \t]*['\"]?"
    r"|\bcurl\b[^\n;&|]{0,512}?[ \t](?:-u|--user)[= \t]*['\"]?[^\s:'\"]{0,256}:"
    r"|\bwandb[ \t]+login[ \t]+(?:--?[a-z\-]+[ \t]+)*['\"]?(?=[A-Za-z0-9_\-]{32})"
    r"|\bmachine\s+\S+\s+(?:login\s+\S+\s+)?password\s+)"
    r"(?P<value>(?!-)[^\s'\"]+)"
)
_BEARER = re.compile(r"(?i)\b(?P<kind>bearer|basic|token)\s+(?P<value>[A-Za-z0-9._~+/=\-]{12,})")
_PEM = re.compile(
    r"-----BEGIN (?P<kind>[A-Z ]*PRIVATE KEY(?: BLOCK)?)-----.*?(?:-----END (?P=kind)-----|\Z)",
    re.DOTALL,
)
# Every branch starts with \b: one that does not makes `re` try the whole alternation at
# every position (15x slower on a large log).
_TOKENS = re.compile(
    "|".join(
        [
            r"\bAKIA[0-9A-Z]{16}(?![A-Za-z0-9_\-])",  # AWS access key id
            r"\bASIA[0-9A-Z]{16}(?![A-Za-z0-9_\-])",  # AWS temporary key id
            r"\b(?:IQoJb3JpZ2luX2Vj|FwoGZXIvYXdzE)[A-Za-z0-9/+=]{40,}",  # AWS session token
            r"\bAIza[0-9A-Za-z_\-]{35}(?![A-Za-z0-9_\-])",  # Google API key
            r"\bya29\.[0-9A-Za-z_\-]{20,}",  # Google OAuth token
            r"\bAccountKey=[A-Za-z0-9+/=]{40,}",  # Azure storage
            r"\bhf_[A-Za-z0-9]{30,}(?![A-Za-z0-9_\-])",  # Hugging Face
            r"\bapi_org_[A-Za-z0-9]{30,}(?![A-Za-z0-9_\-])",  # Hugging Face org
            r"\bgh[pousr]_[A-Za-z0-9]{36,}(?![A-Za-z0-9_\-])",  # GitHub
            r"\bgithub_pat_[A-Za-z0-9_]{40,}(?![A-Za-z0-9_\-])",
            r"\bglpat-[A-Za-z0-9_\-]{20,}(?![A-Za-z0-9_\-])",  # GitLab
            r"\bxox[abposre]-[A-Za-z0-9\-]{10,}(?![A-Za-z0-9_\-])",  # Slack tokens
            r"\bxapp-[0-9]-[A-Za-z0-9\-]{10,}(?![A-Za-z0-9_\-])",  # Slack app-level token
            r"\bhttps://hooks\.slack\.com/services/[A-Za-z0-9/]+",
            r"\bsk-(?:ant-|proj-)?[A-Za-z0-9_\-]{20,}(?![A-Za-z0-9_\-])",  # OpenAI / Anthropic
            r"\bnvapi-[A-Za-z0-9_\-]{40,}(?![A-Za-z0-9_\-])",  # NVIDIA NGC
            r"\br8_[A-Za-z0-9]{30,}(?![A-Za-z0-9_\-])",  # Replicate
            r"\bnpm_[A-Za-z0-9]{36}(?![A-Za-z0-9_\-])",
            r"\bpypi-[A-Za-z0-9_\-]{50,}(?![A-Za-z0-9_\-])",
            r"\bdckr_pat_[A-Za-z0-9_\-]{20,}",  # Docker Hub
            r"\bdop_v1_[a-f0-9]{64}(?![A-Za-z0-9_\-])",  # DigitalOcean
            r"\bhv[sbr]\.[A-Za-z0-9_\-]{24,}",  # HashiCorp Vault
            r"\bSG\.[A-Za-z0-9_\-]{22}\.[A-Za-z0-9_\-]{43}(?![A-Za-z0-9_\-])",  # SendGrid
            r"\b[sr]k_(?:live|test)_[0-9a-zA-Z]{24,}(?![A-Za-z0-9_\-])",  # Stripe
            r"\beyJ[A-Za-z0-9_\-]{8,}\.eyJ[A-Za-z0-9_\-]{8,}\.[A-Za-z0-9_\-]{8,}",  # JWT
        ]
    )
)
# Formats known by what surrounds them (kept as they are).
_TOKENS_IN_CONTEXT = re.compile(
    "|".join(
        [
            r"(?<=[?&]sig=)[A-Za-z0-9%+/=]{16,}",  # Azure SAS signature
            r"(?<=://)[0-9a-f]{32}(?=(?::[0-9a-f]{32})?@)",  # Sentry DSN key
            r"(?<![\w~.\-])[\w~.\-]{3}\dQ~[\w~.\-]{31,34}",  # Azure AD client secret
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
    text = _TOKENS_IN_CONTEXT.sub(MASK, text)
    text = _BEARER.sub(lambda m: f"{m.group('kind')} {MASK}", text)
    text = _redact_assignments(text)
    text = _CLI_FLAG.sub(
        lambda m: f"{m.group('flag')}{m.group('sep')}{m.group('quote')}{MASK}", text
    )
    text = _CLI_CONTEXT.sub(lambda m: f"{m.group('pre')}{MASK}", text)
    return text


def _redact_assignments(text: str) -> str:
    """``NAME=value`` -> ``NAME=[REDACTED]``; a value may hold another one (``tokenizer=x``)."""
    out: list[str] = []
    done = 0  # text[:done] is in `out`
    m = _ASSIGN.search(text)
    while m:
        pos = m.end()  # the value starts here; evidence keeps it
        if not _EVIDENCE_NAME.match(m.group("name")):
            value = _ASSIGNED_VALUE.match(text, pos)
            if value and value.group() != MASK:
                out += [text[done:pos], MASK]
                done = pos = value.end()
        m = _ASSIGN.search(text, pos)
    out.append(text[done:])
    return "".join(out)


def redact_argv(argv: list[str]) -> list[str]:
    """Redact an argument list as the command line it forms (a flag and its value are two items).

    ``["login", "--token", "x"]`` -> ``["login", "--token", "[REDACTED]"]``. Each argument is
    redacted on its own first (``sh -c "..."``). A masked value runs to the end of its argument
    (``--password=a b``, ``["-p", "a b"]``). When the redacted line no longer splits into as
    many arguments, it is returned whole as one item.
    """
    argv = [_masked_to_end(redact_text(a), a.startswith("-")) for a in argv]
    line = shlex.join(argv)
    clean = redact_text(line)
    if clean == line:
        return argv
    try:
        out = shlex.split(clean)
    except ValueError:
        return [clean]
    if len(out) != len(argv):
        return [clean]
    return [_masked_to_end(new, new != old) for new, old in zip(out, argv, strict=True)]


def _masked_to_end(arg: str, is_value: bool) -> str:
    at = arg.find(MASK) if is_value else -1
    return arg if at < 0 else arg[: at + len(MASK)]


# docker inspect keys whose value is an argument list.
_ARGV_KEYS = frozenset({"Cmd", "Entrypoint", "Args", "Test"})


def redact_json(value: Any, key: str = "") -> Any:
    """Redact a JSON-like structure (docker inspect, docker info) recursively.

    A string under a credential-like key is replaced whole; other strings go through
    redact_text; ``Env`` entries ``NAME=value`` are judged by NAME; argument lists (``Cmd``,
    ``Entrypoint``, ``Args``, healthcheck ``Test``) go through redact_argv.
    """
    if isinstance(value, dict):
        out = {k: redact_json(v, str(k)) for k, v in value.items()}
        path, args = value.get("Path"), value.get("Args")
        if (
            isinstance(path, str)
            and isinstance(args, list)
            and all(isinstance(a, str) for a in args)
        ):
            # docker inspect: the process's argv is Path + Args.
            argv = redact_argv([path, *args])
            out["Args"] = argv[1:] if len(argv) == len(args) + 1 else argv
        return out
    if isinstance(value, list):
        if key == "Env":
            return [_redact_env_item(v) if isinstance(v, str) else redact_json(v) for v in value]
        if key in _ARGV_KEYS and all(isinstance(v, str) for v in value):
            return redact_argv(value)
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
