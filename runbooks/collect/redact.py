"""Secret redaction, applied at collection time to every text and JSON that enters a bundle.

What is replaced by ``[REDACTED]``:
- values of variables/keys whose names look like credentials (``HF_TOKEN=hf_abc`` ->
  ``HF_TOKEN=[REDACTED]``; ``"password": "x"``; ``{'db_password': 'x'}``; ``key => x``;
  ``password<TAB>x``; ``<password>x</password>``; labels such as ``db.password``; abbreviated and
  plural names: ``MYSQL_PWD``, ``SMTP_PW``, ``GCP_CREDS``, ``api_keys``, ``secrets``). A quoted
  value is masked to its closing quote, a list or object to its bracket, an unquoted one to the
  next space (``abc;tail`` is one value), or to the end of the line when the name starts it;
- passwords inside URLs (``https://user:pw@host``, ``redis://:pw@host``, ``/`` and ``@`` in
  the password), Sentry DSN keys and Azure SAS signatures (``&sig=...``);
- command-line secrets (``--password=x``, ``--token 'x'``, ``--api_key x``, ``--requirepass x``,
  ``--masterauth x``, ``--pw x``, values starting with ``-``; ``-p x`` after
  ``sshpass``/``mysql``/``... login``; ``redis-cli -a x``; ``ldapsearch -w x``; ``-P x``;
  ``curl -u user:pw``; ``wandb login <key>``; ``set NAME x`` / ``config NAME x`` when NAME is a
  credential's name);
- lines that are only base64 with mixed case and digits (a key body whose BEGIN line was cut
  off), and the body above an END line whose BEGIN is missing;
- well-known token formats anywhere (AWS/GCP/Azure keys, Hugging Face, GitHub, GitLab, Slack,
  OpenAI, Anthropic, NGC, Docker Hub, npm, PyPI, Stripe, Vault, JWTs, PEM/PGP private keys,
  Bearer/Basic credentials), and every format of runbooks/knowledge/secret_formats.yaml (gitleaks'
  rules with a literal prefix: ~100 vendors' tokens and webhook URLs);
- a token as a URL's user (`https://TOKEN@github.com/...`), `echo TOKEN | ... --password-stdin`,
  a bare 40-character AWS secret key (mixed case and digits).
Argument lists (docker inspect ``Cmd``, ``Entrypoint``, ``Args``) are judged as the command line
they form, so ``["--token", "x"]`` is redacted too. Pure: no I/O. It errs toward
over-redaction; it never removes lines (line numbers stay valid).
"""

from __future__ import annotations

import bisect
import re
import shlex
from collections.abc import Callable
from importlib import resources
from typing import Any

import yaml

MASK = "[REDACTED]"

# Words that make a name a credential's name, with the plurals people use for collections
# (`api_keys`, `secrets`); `tokens` stays evidence (max_num_batched_tokens, tokens/s).
_CREDENTIAL_WORDS = (
    r"pass(?:wd|word|phrase)?|secrets?|token|api[_-]?keys?|access[_-]?keys?|private[_-]?keys?|"
    r"secret[_-]?keys?|auth(?:orization)?|credentials?|creds?|session[_-]?id|cookie|signature|"
    r"(?<![a-z])keys?(?![a-z])|dsn|conn(?:ection)?[_-]?string|webhook|(?<![a-z])pat(?![a-z])"
)
# Abbreviations that are credential names only as a part after a prefix: MYSQL_PWD, REDIS_PW
# (a bare PWD is the working directory).
_SHORT_WORDS = r"(?<=[_.\-])pwd|(?<=[_.\-])pw(?![a-z])"
# A credential word as a part of the name (HF_TOKEN, db.password, apiKey, PASSWORD2), not
# inside a longer word (tokenizer, max_num_batched_tokens, authorized_keys).
_NAME_IS_SECRET = re.compile(
    rf"(?i)(?:^|[_.\-])(?:{_CREDENTIAL_WORDS}|pwd|pw)(?:$|[_.\-\d])|(?i:{_CREDENTIAL_WORDS})\d*$"
    r"|(?i:(?:^|[_.\-])wandb$)"  # WANDB: the W&B key itself (WANDB_PROJECT is not)
)
_NOT_SECRET_NAMES = frozenset({"pwd", "oldpwd"})
# Names with a credential word that are ML evidence, not credentials (vLLM/HF configs, metrics):
# tokenizer=..., skip_tokenizer_init=..., max_num_batched_tokens=..., authorized_keys:ro.
_EVIDENCE_NAME = re.compile(r"(?i)tokeni[sz]|tokens(?![a-z])|authorized_keys")
# Quantifiers are bounded (and possessive where backtracking is useless) so that no pattern
# rescans a long run of text from every position: hostile input stays linear.
_NAME_MAX = 128
_VALUE_MAX = 1024

# NAME=value in every spelling a log or a config printout uses, where NAME holds a credential
# word (DB_PASSWORD, hfTokenPath, SECRETVALUE, API_KEYS, MYSQL_PWD): `NAME=v`, `NAME: v`,
# `"NAME": "v"` (also escaped inside a JSON string), Python's `{'NAME': 'v'}`, `NAME => v`,
# `NAME := v`, `NAME<TAB>v`, `<NAME>v</NAME>`. The match starts at the word: scanning from every
# name start is twice as slow.
_ASSIGN = re.compile(
    rf"(?i)(?P<name>(?:{_CREDENTIAL_WORDS}|{_SHORT_WORDS})[A-Za-z0-9_.\-]{{0,{_NAME_MAX}}}+)"
    r"(?:\\?[\"'])?"  # the name's closing quote
    r"(?:(?P<sep>[ \t]*(?:=>|:=|[=:])[ \t]*(?:\r?\n[ \t]*)?)|(?P<tab>\t+)|(?P<xml>>))"
    r"(?P<q>\\?[\"'])?"  # the value's opening quote
)
# A value runs to the end of its quotes (spaces and all), or to the next space: `abc;tail`
# is one value. A value whose closing quote is missing runs to the end of the line.
_UNQUOTED_VALUE = re.compile(rf"[^\s\"'\\]{{1,{_VALUE_MAX}}}")
# A name that starts its line (`env` output, a .env file, YAML, `export NAME=...`): there the
# value runs to the end of the line, as the shell and YAML read it (`KEY=a b c`).
_LINE_VALUE = re.compile(rf"[^\n]{{1,{_VALUE_MAX}}}")
_STARTS_LINE = re.compile(r"[ \t]*(?:export[ \t]+|-[ \t]+)?[A-Za-z0-9_.\-]*")
_XML_VALUE = re.compile(rf"[^<\n]{{1,{_VALUE_MAX}}}")
# A list or an object (`"api_keys": ["a", "b"]`) is masked whole, to its closing bracket.
_BRACKETED_VALUE = re.compile(rf"\[[^\]\n]{{0,{_VALUE_MAX}}}\]?|\{{[^}}\n]{{0,{_VALUE_MAX}}}}}?")
_QUOTED_VALUE = {
    '"': re.compile(rf"(?:[^\"\\\n]|\\.){{0,{_VALUE_MAX}}}+"),
    "'": re.compile(rf"[^'\n]{{0,{_VALUE_MAX}}}"),
    '\\"': re.compile(rf"(?:[^\"\\\n]|\\[^\"]){{0,{_VALUE_MAX}}}+"),
    "\\'": re.compile(rf"(?:[^'\\\n]|\\[^'\\]){{0,{_VALUE_MAX}}}+"),
}
# user:password@ in a URL; the password may hold `/`, `:` and `@` (the last `@` ends it).
_URL_CRED = re.compile(
    r"(?P<pre>\b[a-zA-Z][a-zA-Z0-9+.\-]{0,31}://[^\s:/@\"']{0,256}:)(?P<pw>[^\s\"'<>]{1,256})"
    r"(?P<at>@)"
)
# A token as a URL's user (`https://TOKEN@github.com/org/repo`, `postgres://TOKEN@db`): a user of
# 16+ characters with letters and digits is masked (a person's user name is kept).
_URL_USER = re.compile(
    r"(?P<pre>\b[a-zA-Z][a-zA-Z0-9+.\-]{0,31}://)(?P<user>[\w.~%\-]{16,256}+)(?=@)"
)
# A bare AWS secret access key: 40 characters of base64 with upper and lower case and digits,
# standing alone (a git or docker hash is lower-case hex).
_BARE_AWS_SECRET = re.compile(r"(?<![A-Za-z0-9/+=])[A-Za-z0-9/+]{40}(?![A-Za-z0-9/+=])")
# --password V, --requirepass V, --masterauth=V, --passphrase 'a b', --pw V, -pw V: a flag whose
# name ends in a credential word. The value may start with `-` (not `--`: that is the next flag);
# unquoted, it runs to the next flag or the end of the line (`--passphrase a b c -d x`: a command
# line printed with its arguments joined by spaces does not say where a value ends).
_FLAG_WORDS = (
    r"pass(?:wd|word|phrase)?|pwd|pw|secrets?|token|api[-_]?keys?|access[-_]?keys?|"
    r"secret[-_]?keys?|keys?|auth|credentials?|creds?|dsn|pat|api"
)
_CLI_FLAG = re.compile(
    rf"(?i)(?<![\w\-])(?P<flag>--?[a-z0-9_\-]{{0,64}}?(?:{_FLAG_WORDS}))(?P<sep>=|[ \t]+)"
    rf"(?P<value>\"[^\"\n]{{0,{_VALUE_MAX}}}\"?|'[^'\n]{{0,{_VALUE_MAX}}}'?"
    # words up to one that starts with `-` (a lazy scan with a look-ahead was quadratic)
    rf"|(?!--[a-z])[^\s\"'][^\s\"']{{0,{_VALUE_MAX}}}+"
    rf"(?:[ \t]++(?!-)[^\s\"']{{1,{_VALUE_MAX}}}+){{0,64}}+)"
)
# Positional secrets of a few commands: `sshpass -p pw`, `docker login -u me -p pw`,
# `mysql -ppw`, `curl -u user:pw`, `wandb login <key>`, a .netrc `password <key>`,
# `redis-cli -a pw`, `mosquitto_pub -P pw`, `ldapsearch -w pw`, `-P pw` (not a port or a count),
# `aws configure set aws_secret_access_key V`, `CONFIG SET requirepass V`, `git config
# user.password V`.
_CLI_CONTEXT = re.compile(
    r"(?P<pre>(?i:\b(?:sshpass|mysql(?:dump|admin)?|login)\b[^\n;&|]{0,256}?[ \t]-p[ \t]*['\"]?"
    r"|\bcurl\b[^\n;&|]{0,512}?[ \t](?:-u|--user)[= \t]*['\"]?[^\s:'\"]{0,256}:"
    r"|\bwandb[ \t]+login[ \t]+(?:--?[a-z\-]+[ \t]+)*['\"]?(?=[A-Za-z0-9_\-]{32})"
    r"|\bredis-cli\b[^\n;&|]{0,256}?[ \t]-a[ \t]+['\"]?"
    r"|\bldap[a-z]*\b[^\n;&|]{0,256}?[ \t]-w[ \t]+['\"]?"
    r"|\b(?:set|config)(?:[ \t]++--?[a-z][\w\-]{0,32}+){0,8}+[ \t]+['\"]?"
    rf"[\w.\-/:]{{0,64}}?(?:{_CREDENTIAL_WORDS}|{_SHORT_WORDS})[\w.\-]{{0,64}}['\"]?[ \t]+['\"]?"
    r"|\bmachine\s+\S+\s+(?:login\s+\S+\s+)?password\s+"
    # `echo TOKEN | docker login --password-stdin` (and any --password-stdin)
    r"|\becho[ \t]+(?:-[neE]{1,3}[ \t]+)?['\"]?(?=[^\n|]{0,1024}\|[^\n|]{0,256}--password-stdin))"
    r"|(?<![\w\-])-P[ \t]+['\"]?(?![0-9]+(?:\s|$)))"
    rf"(?P<value>(?!-)[^\s'\"]{{1,{_VALUE_MAX}}})"
)
_BEARER = re.compile(r"(?i)\b(?P<kind>bearer|basic|token)\s++(?P<value>[A-Za-z0-9._~+/=\-]{12,})")
_PEM = re.compile(
    r"-----BEGIN (?P<kind>[A-Z ]*PRIVATE KEY(?: BLOCK)?)-----.*?(?:-----END (?P=kind)-----|\Z)",
    re.DOTALL,
)
# Every branch starts with a literal (the anchor the search skips to, see `_Anchored`) that no
# token character precedes: in a run like `-xoxb-xoxb...` or `-eyJ-eyJ...` only the first anchor
# starts a match, so the run is scanned once, not once per anchor (issue 27: quadratic).
_TOKEN_FORMATS = [
    ("AKIA", r"[0-9A-Z]{16}(?![A-Za-z0-9_\-])"),  # AWS access key id
    ("ASIA", r"[0-9A-Z]{16}(?![A-Za-z0-9_\-])"),  # AWS temporary key id
    ("IQoJb3JpZ2luX2Vj", r"[A-Za-z0-9/+=]{40,}"),  # AWS session token
    ("FwoGZXIvYXdzE", r"[A-Za-z0-9/+=]{40,}"),  # AWS session token (older)
    ("AIza", r"[0-9A-Za-z_\-]{35}(?![A-Za-z0-9_\-])"),  # Google API key
    ("ya29.", r"[0-9A-Za-z_\-]{20,}"),  # Google OAuth token
    ("AccountKey=", r"[A-Za-z0-9+/=]{40,}"),  # Azure storage
    ("hf_", r"[A-Za-z0-9]{30,}+(?![A-Za-z0-9_\-])"),  # Hugging Face
    ("api_org_", r"[A-Za-z0-9]{30,}+(?![A-Za-z0-9_\-])"),  # Hugging Face org
    ("gh", r"[pousr]_[A-Za-z0-9]{36,}+(?![A-Za-z0-9_\-])"),  # GitHub
    ("github_pat_", r"[A-Za-z0-9_]{40,}+(?![A-Za-z0-9_\-])"),
    ("glpat-", r"[A-Za-z0-9_\-]{20,}+(?![A-Za-z0-9_\-])"),  # GitLab
    ("xox", r"[abposre]-[A-Za-z0-9\-]{10,}+(?![A-Za-z0-9_\-])"),  # Slack tokens
    ("xapp-", r"[0-9]-[A-Za-z0-9\-]{10,}+(?![A-Za-z0-9_\-])"),  # Slack app-level token
    ("https://hooks.slack.com/services/", r"[A-Za-z0-9/]+"),
    ("sk-", r"(?:ant-|proj-)?[A-Za-z0-9_\-]{20,}+(?![A-Za-z0-9_\-])"),  # OpenAI / Anthropic
    ("nvapi-", r"[A-Za-z0-9_\-]{40,}+(?![A-Za-z0-9_\-])"),  # NVIDIA NGC
    ("r8_", r"[A-Za-z0-9]{30,}+(?![A-Za-z0-9_\-])"),  # Replicate
    ("npm_", r"[A-Za-z0-9]{36}(?![A-Za-z0-9_\-])"),
    ("pypi-", r"[A-Za-z0-9_\-]{50,}+(?![A-Za-z0-9_\-])"),
    ("dckr_pat_", r"[A-Za-z0-9_\-]{20,}"),  # Docker Hub
    ("dop_v1_", r"[a-f0-9]{64}(?![A-Za-z0-9_\-])"),  # DigitalOcean
    ("hv", r"[sbr]\.[A-Za-z0-9_\-]{24,}"),  # HashiCorp Vault
    ("SG.", r"[A-Za-z0-9_\-]{22}\.[A-Za-z0-9_\-]{43}(?![A-Za-z0-9_\-])"),  # SendGrid
    ("sk_", r"(?:live|test)_[0-9a-zA-Z]{24,}+(?![A-Za-z0-9_\-])"),  # Stripe
    ("rk_", r"(?:live|test)_[0-9a-zA-Z]{24,}+(?![A-Za-z0-9_\-])"),  # Stripe restricted key
    ("eyJ", r"[A-Za-z0-9_\-]{8,}+\.eyJ[A-Za-z0-9_\-]{8,}+\.[A-Za-z0-9_\-]{8,}"),  # JWT
]
_TOKENS = re.compile(
    "|".join(rf"(?<![\w\-]){re.escape(head)}{tail}" for head, tail in _TOKEN_FORMATS)
)


def _catalogue() -> list[tuple[str, str]]:
    """(prefix, pattern) of every format of runbooks/knowledge/secret_formats.yaml (gitleaks'
    rules with a literal prefix, and the few it lacks)."""
    text = resources.files("runbooks.knowledge").joinpath("secret_formats.yaml").read_text("utf-8")
    return [(str(f["prefix"]), str(f["pattern"])) for f in yaml.safe_load(text)["formats"]]


_CATALOGUE_FORMATS = _catalogue()
# As the token formats: a match starts where no token character precedes its prefix; the first
# characters of the prefixes are checked first (one class, not a hundred branches per position).
_FIRST = "".join(sorted({c for p, _ in _CATALOGUE_FORMATS for c in (p[0].lower(), p[0].upper())}))
_CATALOGUE = re.compile(
    rf"(?=[{re.escape(_FIRST)}])(?<![\w\-])(?:"
    + "|".join(f"(?:{p})" for _, p in _CATALOGUE_FORMATS)
    + ")"
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


class _Anchored:
    """A pattern whose every match starts at a known distance from one of a few literals: `re`
    tries a pattern at every position of a text, while ``str.find`` skips to the few places where
    a match can start (a 200 kB `nvidia-smi -q -x` is redacted 10x faster). The literals are
    found in the text lowered (a superset of the places: the pattern decides). A pattern without
    anchors is searched the plain way, and only when the text holds one of `needs`. Text that is
    not ASCII, where case folding can change lengths or match `K` (Kelvin) to `k`, is searched the
    plain way. The matches are exactly those of the plain search (tests/test_redact.py)."""

    def __init__(
        self,
        pattern: re.Pattern[str],
        anchors: list[tuple[str, int]] | None = None,
        needs: tuple[str, ...] = (),
    ) -> None:
        self.pattern = pattern
        self.anchors = [(word.lower(), offset) for word, offset in anchors or []]
        self.needs = tuple(n.lower() for n in needs)

    def starts(self, text: str) -> list[int] | None:
        """Where a match may start, in order; None: search every position."""
        if not text.isascii():
            return None
        low = text.lower()
        if not self.anchors:
            return None if any(n in low for n in self.needs) else []
        found = set()
        for word, offset in self.anchors:
            at = low.find(word)
            while at >= 0:
                if at + offset >= 0:
                    found.add(at + offset)
                at = low.find(word, at + 1)
        return sorted(found)

    def search(self, text: str, pos: int, starts: list[int] | None) -> re.Match[str] | None:
        """The leftmost match at `pos` or after (`starts`: of this text)."""
        if starts is None:
            return self.pattern.search(text, pos)
        for at in starts[bisect.bisect_left(starts, pos) :]:
            if m := self.pattern.match(text, at):
                return m
        return None

    def sub(self, repl: Callable[[re.Match[str]], str] | str, text: str) -> str:
        starts = self.starts(text)
        if starts == []:
            return text
        out: list[str] = []
        done = pos = 0
        while m := self.search(text, pos, starts):
            out += [text[done : m.start()], repl(m) if callable(repl) else repl]
            done, pos = m.end(), max(m.end(), m.start() + 1)
        return "".join(out) + text[done:]


def _words(*words: str) -> list[tuple[str, int]]:
    return [(w, 0) for w in words]


# The literals each pattern's matches start with (tests/test_redact.py checks each pattern
# against its plain search on every fixture).
_CREDENTIAL_STEMS = _words(
    "pass", "secret", "token", "api", "access", "private", "auth", "cred", "session", "cookie",
    "signature", "key", "dsn", "conn", "webhook", "pw", "pat",
)  # fmt: skip
_FAST_ASSIGN = _Anchored(_ASSIGN, _CREDENTIAL_STEMS)
_FAST_TOKENS = _Anchored(_TOKENS, _words(*(head for head, _ in _TOKEN_FORMATS)))
_FAST_CATALOGUE = _Anchored(_CATALOGUE, _words(*(prefix for prefix, _ in _CATALOGUE_FORMATS)))
_FAST_TOKENS_IN_CONTEXT = _Anchored(_TOKENS_IN_CONTEXT, [("sig=", 4), ("://", 3), ("q~", -4)])
_FAST_URL_CRED = _Anchored(_URL_CRED, needs=("://",))
_FAST_URL_USER = _Anchored(_URL_USER, needs=("://",))
_FAST_BEARER = _Anchored(_BEARER, _words("bearer", "basic", "token"))
_FAST_CLI_FLAG = _Anchored(_CLI_FLAG, _words("-"))
_FAST_CLI_CONTEXT = _Anchored(
    _CLI_CONTEXT,
    _words("sshpass", "mysql", "login", "curl", "wandb", "redis-cli", "ldap", "set", "config",
           "machine", "-p", "echo"),
)  # fmt: skip


def name_is_secret(name: str) -> bool:
    """True when a variable/label/key name looks like it holds a credential."""
    return name.lower() not in _NOT_SECRET_NAMES and bool(_NAME_IS_SECRET.search(name))


def redact_text(text: str) -> str:
    """Redact secrets in free text (logs, command output, command lines)."""
    if not text:
        return text
    text = _PEM.sub(lambda m: f"-----BEGIN {m.group('kind')}-----{MASK}", text)
    text = _redact_key_lines(text)
    text = _FAST_URL_CRED.sub(lambda m: f"{m.group('pre')}{MASK}{m.group('at')}", text)
    text = _FAST_URL_USER.sub(lambda m: m["pre"] + (MASK if _mixed(m["user"]) else m["user"]), text)
    text = _BARE_AWS_SECRET.sub(lambda m: MASK if _mixed(m[0], upper=True) else m[0], text)
    text = _FAST_TOKENS.sub(MASK, text)
    text = _FAST_CATALOGUE.sub(MASK, text)
    text = _FAST_TOKENS_IN_CONTEXT.sub(MASK, text)
    text = _FAST_BEARER.sub(lambda m: f"{m.group('kind')} {MASK}", text)
    text = _redact_assignments(text)
    text = _FAST_CLI_FLAG.sub(
        lambda m: f"{m.group('flag')}{m.group('sep')}{_mask(m['value'])}", text
    )
    text = _FAST_CLI_CONTEXT.sub(lambda m: f"{m.group('pre')}{MASK}", text)
    return text


def _mixed(word: str, upper: bool = False) -> bool:
    """Letters and digits (and both cases when `upper`): a token, not a name or a hash."""
    digits, lower, capital = (
        any(f(c) for c in word) for f in (str.isdigit, str.islower, str.isupper)
    )
    return digits and (lower or capital) and (not upper or (lower and capital))


def _mask(value: str) -> str:
    """A value replaced by MASK, keeping the quotes around it."""
    q = value[0] if value[0] in "\"'" else ""
    return f"{q}{MASK}{q if len(value) > 1 and value.endswith(q) else ''}" if q else MASK


def _redact_assignments(text: str) -> str:
    """``NAME=value`` -> ``NAME=[REDACTED]``; a value may hold another one (``tokenizer=x``)."""
    out: list[str] = []
    done = 0  # text[:done] is in `out`
    starts = _FAST_ASSIGN.starts(text)
    m = _FAST_ASSIGN.search(text, 0, starts)
    while m:
        pos = m.end()  # the value starts here; evidence keeps it
        if not _EVIDENCE_NAME.match(m.group("name")) and not text.startswith(MASK, pos):
            if m["q"]:
                value = _QUOTED_VALUE[m["q"]].match(text, pos)
            elif m["xml"]:
                value = _XML_VALUE.match(text, pos)
            elif text.startswith(("[", "{"), pos):
                value = _BRACKETED_VALUE.match(text, pos)
            elif _starts_line(text, m.start()):
                value = _LINE_VALUE.match(text, pos)
            else:
                value = _UNQUOTED_VALUE.match(text, pos)
            if value and value.end() > pos:
                out += [text[done:pos], MASK]
                done = pos = value.end()
        m = _FAST_ASSIGN.search(text, pos, starts)
    out.append(text[done:])
    return "".join(out)


def _starts_line(text: str, at: int) -> bool:
    """True when the name whose credential word is at `at` is the first thing on its line."""
    start = text.rfind("\n", max(0, at - 256), at) + 1
    if start == 0 and at > 256:
        return False
    return _STARTS_LINE.fullmatch(text, start, at) is not None


# A line that is only base64 (a PEM/OpenSSH key body whose BEGIN line was cut off, a base64
# secret on its own line), with upper and lower case and digits: a hash in hex is not one.
_KEY_LINE = re.compile(r"(?m)^([ \t]*)([A-Za-z0-9+/]{40,4096}={0,2})([ \t]*\r?)$")
_PEM_END = re.compile(r"-----END [A-Z ]*PRIVATE KEY(?: BLOCK)?-----")
_BASE64_LINE = re.compile(r"(?<![ \t])[ \t]*+[A-Za-z0-9+/=]{4,4096}+[ \t]*+\r?")


def _redact_key_lines(text: str) -> str:
    """Base64-only lines, and the body above an END line whose BEGIN is not in the text."""

    def line(m: re.Match[str]) -> str:
        body = m[2]
        mixed = any(c.isupper() for c in body) and any(c.islower() for c in body)
        return f"{m[1]}{MASK}{m[3]}" if mixed and any(c.isdigit() for c in body) else m[0]

    text = _KEY_LINE.sub(line, text)
    if "-----END " not in text:
        return text
    lines = text.split("\n")
    for i, ln in enumerate(lines):
        if _PEM_END.search(ln):
            j = i - 1
            while j >= 0 and _BASE64_LINE.fullmatch(lines[j]) and lines[j].strip() != "":
                lines[j] = MASK
                j -= 1
    return "\n".join(lines)


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
