"""Classify a bundle: run the rules, pick the root cause, explain it (PURE over `Facts`).

`diagnose(facts)` returns a `Diagnosis`: the primary incident id, a confidence, a plain-language
summary, the evidence lines that decided it, secondary findings and the recommended fix.
`healthy` when the evidence shows working GPUs and no rule matched; `unknown` when evidence is
missing or shows errors no rule explains.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from runbooks import knowledge
from runbooks.core.model import Candidate, Diagnosis, Finding, Line, Match, SimilarIncident
from runbooks.core.names import terminal_safe as safe
from runbooks.core.taxonomy import Incident
from runbooks.diagnose.facts import Facts, origin_of
from runbooks.diagnose.history import index_for
from runbooks.diagnose.judgments import memlock_low, shm_small
from runbooks.diagnose.learned import Model, packaged_model
from runbooks.diagnose.logscan import signatures
from runbooks.diagnose.remedy import propose_fix
from runbooks.diagnose.rules import (
    PRIORITY,
    STRONG,
    exclusive_mode_gpus,
    kernel_kills_are_anothers,
    rank,
    run_rules,
)
from runbooks.diagnose.similar import KnownIncident, SimilarIndex, cite, propose

if TYPE_CHECKING:
    from runbooks.diagnose.health import HealthFinding

THIN_CONFIDENCE = 0.7  # one or two pasted lines say what happened, not why it happened here
THIN_MAX_LINES = 3
HEALTHY_ONE, HEALTHY_MANY = 0.7, 0.85  # confidence of `healthy` on one / several kinds of proof


def explain(incident: str) -> str:
    return knowledge.class_info(incident).explain


def diagnose(
    facts: Facts,
    host: str | None = None,
    *,
    index: SimilarIndex | None = None,
    exclude: Iterable[str] = (),
    source_status: Mapping[str, str] | None = None,
    model: Model | Literal["packaged"] | None = "packaged",
) -> Diagnosis:
    """The diagnosis of one incident's facts. `index` (similar known incidents) adds citations
    and, when no rule fires, a proposal; `exclude` leaves named incidents out of it (a corpus
    case is not its own neighbour). `source_status`: the bundle's source name -> ok / failed /
    timeout, as the sweep's health checks read it (a hung `nvidia-smi` is a timeout). `model` is
    the learned component (runbooks/diagnose/learned.py; the packaged one unless given; None: rules
    alone).

    The first that applies: the strongest rule that matched, unless the learned model is sure of
    another class the evidence also fits (see :func:`_disputed`); a host health finding that
    drains the host (what the sweep says of the same bundle); `healthy`; a GPU held in an
    exclusive compute mode; the learned model's class when it is sure of it; the similar
    incidents' proposal when the model ranks no other cause first (else `unknown` between the
    two); a guess from the words used; `unknown`, with the two leading candidates and the check
    that tells them apart."""
    matches = sorted(run_rules(facts), key=rank, reverse=True)
    text = evidence_text(facts)
    found = index.query(text, k=SIMILAR_POOL, exclude=exclude) if index else []
    neighbours = found[:SIMILAR_CITED]
    health = _health(facts, source_status)
    common = _common_fields(facts, host, neighbours, health)
    thin = is_thin(facts)
    opinion = Opinion(packaged_model() if model == "packaged" else model, model_input(facts))
    if matches:
        diagnosis = _disputed(matches, opinion, facts, common) or _from_rules(
            matches, facts, thin, common
        )
    else:
        errors = error_lines(facts)
        healthy = _healthy(facts, errors, common)
        diagnosis = (
            _from_drain_finding(health, common)
            or (healthy and (_disputed_healthy(healthy, opinion, common) or healthy))
            or _exclusive_mode(facts, common)
            or _from_model(facts, opinion, errors, common)
            or _from_similar(facts, neighbours, opinion, errors, common)
            or _from_words(facts, thin, opinion, errors, common)
            or _unknown(facts, errors, common, opinion)
        )
    view = tuple((c, round(p, 3)) for c, p in opinion.ranked[:MODEL_VIEW])
    return diagnosis.model_copy(
        update={"similar": cite_for(diagnosis.incident, found), "model_view": view}
    )


MODEL_VIEW = 3  # the model's leading classes every diagnosis reports


class Opinion:
    """The learned model's view of one evidence text, scored once."""

    def __init__(self, model: Model | None, text: str) -> None:
        self.model = model
        self.text = text
        self._ranked: list[tuple[str, float]] | None = None

    @property
    def ranked(self) -> list[tuple[str, float]]:
        """Classes by calibrated probability (empty without a model or without text)."""
        if self._ranked is None:
            self._ranked = self.model.rank(self.text) if self.model is not None else []
        return self._ranked

    def p(self, incident: str) -> float | None:
        return dict(self.ranked).get(incident) if self.ranked else None

    def sure_of(self) -> tuple[str, float] | None:
        """The class the model is sure of (probability >= its threshold), never `unknown`."""
        if self.model is None or not self.ranked:
            return None
        top, p = self.ranked[0]
        return (top, p) if top != Incident.UNKNOWN and p >= self.model.threshold else None

    def leading(self) -> list[tuple[str, float]]:
        """The causes it ranks first (its `unknown` is no cause)."""
        return [(c, p) for c, p in self.ranked if c != Incident.UNKNOWN]


def _disputed(
    matches: list[Match], opinion: Opinion, facts: Facts, common: dict[str, object]
) -> Diagnosis | None:
    """`unknown` between two classes when the rules' winner is a message in the text (not a
    structured fact: nvidia-smi, the kernel log, inspect, probes always decide), the evidence is
    more than a pasted line holding it, and the learned model is sure of another class: one the
    root-cause order put second, or one no rule saw."""
    winner = matches[0]
    if not winner.rule.endswith(":signatures") or is_thin(facts):
        return None
    sure = opinion.sure_of()
    if sure is None or sure[0] == winner.incident:
        return None
    rival, p = sure
    if rival in {m.incident for m in matches if m.confidence >= STRONG}:
        why = (
            f"both matched; the root-cause order puts {winner.incident} first, the learned "
            f"model is sure of {rival} (probability {p:.2f})"
        )
    else:
        why = (
            f"a message of {winner.incident} matched, but the learned model is sure of "
            f"{rival} (probability {p:.2f})"
        )
    return _undecided(
        (winner.incident, f"rules: {winner.rule}"), (rival, "learned model"), opinion, why,
        evidence=winner.evidence, matches=tuple(matches), common=common,
    )  # fmt: skip


def _disputed_healthy(
    healthy: Diagnosis, opinion: Opinion, common: dict[str, object]
) -> Diagnosis | None:
    """Working GPUs and no known error, but the model is sure the text shows another class."""
    sure = opinion.sure_of()
    if sure is None or sure[0] == Incident.HEALTHY:
        return None
    why = f"the GPUs answer, but the learned model is sure of {sure[0]} (probability {sure[1]:.2f})"
    return _undecided(
        (Incident.HEALTHY, "positive evidence"), (sure[0], "learned model"), opinion, why,
        evidence=healthy.evidence, matches=(), common=common,
    )  # fmt: skip


def _undecided(
    first: tuple[str, str],
    second: tuple[str, str],
    opinion: Opinion,
    why: str,
    *,
    evidence: tuple[Line, ...],
    matches: tuple[Match, ...],
    common: dict[str, object],
) -> Diagnosis:
    """`unknown` naming two candidate causes and the one check that tells them apart."""
    candidates = tuple(
        Candidate(incident=c, probability=_rounded(opinion.p(c)), why=w) for c, w in (first, second)
    )
    check = tells_apart(first[0], second[0])
    return Diagnosis(
        incident=Incident.UNKNOWN,
        confidence=UNDECIDED_CONFIDENCE,
        summary=f"Not decided between {first[0]} and {second[0]}: {why}. "
        f"The check that tells them apart: {check}",
        evidence=evidence,
        matches=matches,
        basis="model",
        candidates=candidates,
        tells_apart=check,
        next_checks=(check,),
        **common,
    )


def _rounded(p: float | None) -> float | None:
    return None if p is None else round(p, 3)


def tells_apart(a: str, b: str) -> str:
    """The one check that tells class `a` from class `b` (classes.yaml `apart`, either way
    round), else the first check of the leading candidate that is a cause (`healthy` has none
    to offer)."""
    info_a, info_b = knowledge.class_info(a), knowledge.class_info(b)
    check = info_a.apart.get(b) or info_b.apart.get(a)
    if check:
        return check
    for incident, info in ((a, info_a), (b, info_b)):
        if incident not in (Incident.HEALTHY, Incident.UNKNOWN) and info.next:
            return info.next[0]
    return knowledge.class_info(Incident.UNKNOWN).next[0]


UNDECIDED_CONFIDENCE = 0.3  # `unknown` with relevant evidence: something is wrong, not what
AGREE_TOP = 2  # a proposal or word guess stands when it names one of the model's leading two
CANDIDATE_MIN = 0.1  # a cause the model gives less is no candidate (it says: none of them)


SIMILAR_CITED = 3  # incidents cited with a diagnosis
SIMILAR_POOL = 12  # the closest incidents searched for same-cause ones


def cite_for(
    incident: str, found: list[tuple[KnownIncident, float]]
) -> tuple[SimilarIncident, ...]:
    """The incidents cited with a diagnosis of `incident`: the closest of the same cause first;
    after them, from the three closest overall, those of another cause, marked as such (a
    DataLoader's bus error is not cited beside an Xid 79 thread as if it were one), the closest
    of all keeping a place when it is one of them. With no class to compare (`unknown`), the
    three closest as they come."""
    if incident == Incident.UNKNOWN:
        return cite(found[:SIMILAR_CITED])
    same = [n for n in found if n[0].incident == incident]
    other = [n for n in found[:SIMILAR_CITED] if n[0].incident != incident]
    # The closest of all, when its cause is another, keeps the last place (marked).
    keep = 1 if other and other[0] is found[0] else 0
    picked = [*same[: SIMILAR_CITED - keep], *other][:SIMILAR_CITED]
    cited = cite(picked)
    return tuple(s.model_copy(update={"same_cause": s.incident == incident}) for s in cited)


def _health(facts: Facts, status: Mapping[str, str] | None) -> list[HealthFinding]:
    """The host health checks of the same facts (runbooks/diagnose/health.py: one engine with the
    sweep); none for a host that was not reached."""
    from runbooks.diagnose.health import check_host

    if facts.ssh_error is not None:
        return []
    return list(check_host("", facts, facts.thresholds, source_status=status).findings)


def _common_fields(
    facts: Facts,
    host: str | None,
    neighbours: list[tuple[KnownIncident, float]],
    health: list[HealthFinding],
) -> dict[str, object]:
    """What every diagnosis carries: host, container, findings and the similar incidents."""
    container = next((c.name for c in facts.containers.values() if c.inspect), None) or next(
        iter(facts.containers), None
    )
    return {
        "host": host,
        "container": container,
        "findings": (*facts.findings, *as_findings(health)),
        "similar": cite(neighbours),
    }


DRAIN_FINDING_CONFIDENCE = 0.8


def _from_drain_finding(health: list[HealthFinding], common: dict[str, object]) -> Diagnosis | None:
    """No rule matched, but a health check drains the host (e.g. `nvidia-smi` hung: the
    collector's timeout, no message to match): its class is the diagnosis, as in the sweep's
    verdict of the same bundle — never a proposal from similar incidents that contradicts it."""
    drain = [f for f in health if f.level == "drain" and f.incident != Incident.UNKNOWN]
    if not drain:
        return None
    f = drain[0]
    incident = Incident(f.incident)
    evidence = f.evidence or (Line(source="bundle.json", line=0, text=f.message),)
    return Diagnosis(
        incident=incident,
        confidence=DRAIN_FINDING_CONFIDENCE,
        summary=f"{explain(incident)} Why: {f.message} (host check {f.key}).",
        evidence=tuple(evidence),
        secondary=tuple(
            dict.fromkeys(Incident(g.incident) for g in drain[1:] if g.incident != incident)
        ),
        next_checks=knowledge.class_info(incident).next,
        **common,
    )


def _from_rules(
    matches: list[Match], facts: Facts, thin: bool, common: dict[str, object]
) -> Diagnosis:
    """The strongest match decides; on thin evidence its confidence is capped and said so."""
    primary = matches[0]
    fix = propose_fix(primary, facts)
    if fix is not None and fix.container:  # the container whose own evidence shows the fault
        common = {**common, "container": fix.container}
    confidence = min(primary.confidence, THIN_CONFIDENCE) if thin else primary.confidence
    summary = _summary(primary)
    if thin:
        summary = (
            f"{summary.rstrip('.')}. Only {thin_source(facts)} was seen: this is the most likely "
            "cause, not a finding."
        )
    return Diagnosis(
        incident=primary.incident,
        confidence=confidence,
        summary=summary,
        evidence=primary.evidence,
        secondary=tuple(dict.fromkeys(m.incident for m in matches[1:])),
        fix=fix,
        matches=tuple(matches),
        basis="thin-evidence" if thin else "evidence",
        next_checks=knowledge.class_info(primary.incident).next
        if thin or confidence < STRONG
        else (),
        **common,
    )


def _healthy(facts: Facts, errors: list[Line], common: dict[str, object]) -> Diagnosis | None:
    """`healthy`: evidence of working GPUs and no exception or error line."""
    healthy_lines = health_evidence(facts)
    if not healthy_lines or facts.exceptions or errors:
        return None
    kinds = {ln.source.rsplit(".", 1)[0] for ln in healthy_lines}
    return Diagnosis(
        incident=Incident.HEALTHY,
        confidence=HEALTHY_MANY if len(kinds) > 1 else HEALTHY_ONE,
        summary=f"{explain(Incident.HEALTHY)} What shows it working: "
        + "; ".join(ln.text.strip()[:120] for ln in healthy_lines[:2]),
        evidence=tuple(healthy_lines),
        **common,
    )


def _exclusive_mode(facts: Facts, common: dict[str, object]) -> Diagnosis | None:
    """Devices busy while a GPU is in an exclusive (or prohibited) compute mode: a setting."""
    exclusive = exclusive_mode_gpus(facts)
    if not exclusive:
        return None
    return Diagnosis(
        incident=Incident.UNKNOWN,
        confidence=0.5,
        summary="CUDA reports the devices busy or unavailable while the GPU is in an "
        "exclusive (or prohibited) compute mode: another process holds it. That is a "
        "setting, not a failing GPU: find the process (nvidia-smi), or reset the mode with "
        "`nvidia-smi -c 0`.",
        evidence=tuple(exclusive[:3]),
        next_checks=("nvidia-smi -q -d COMPUTE; nvidia-smi (which process holds the GPU).",),
        **common,
    )


def _from_model(
    facts: Facts, opinion: Opinion, errors: list[Line], common: dict[str, object]
) -> Diagnosis | None:
    """No rule matched and the learned model is sure of a class: its class, marked as the
    model's (the probability is calibrated on held-out folds; see docs/accuracy.md)."""
    sure = opinion.sure_of()
    if sure is None or opinion.model is None:
        return None
    incident, p = sure
    words = opinion.model.weighed(opinion.text, incident)
    return Diagnosis(
        incident=incident,
        confidence=round(p, 2),
        summary=f"No known message matched. The learned model is sure of {incident} "
        f"(probability {p:.2f}){_from_words_read(words)}: {explain(incident)} "
        "It judges how incidents are worded, it did not find a known message: confirm it "
        "with the check below.",
        evidence=_last_errors(facts, errors),
        basis="model",
        next_checks=knowledge.class_info(incident).next,
        **common,
    )


def _from_words_read(words: list[str]) -> str:
    return f", from the words {', '.join(repr(w) for w in words)}" if words else ""


def _backing(opinion: Opinion, incident: str) -> float | None:
    """The model's probability of a guess's class (a proposal, the words used) when it ranks it
    among its leading two (AGREE_TOP, at least CANDIDATE_MIN). The guess stands either way: a
    model sure of another class has already decided (:func:`_from_model` comes first), and on
    blind rounds 6 and 7 withholding every guess outside the model's leading two lost four right
    guesses for one wrong one."""
    p = dict(opinion.leading()[:AGREE_TOP]).get(incident)
    return p if p is not None and p >= CANDIDATE_MIN else None


def _backed(p: float | None) -> str:
    if p is None:
        return ""
    return f" The learned model ranks it among its two leading classes (probability {p:.2f})."


def _from_similar(
    facts: Facts,
    neighbours: list[tuple[KnownIncident, float]],
    opinion: Opinion,
    errors: list[Line],
    common: dict[str, object],
) -> Diagnosis | None:
    """A proposal from the most similar known incidents (only when there was text), with the
    learned model's probability of it when it ranks it among its leading two; `unknown` between
    the two when the model ranks another cause first. Neighbours vote with the same cases the
    model learned from: held out by repository over the corpus of 1,003, the proposals the model
    ranked first were right 61 times in 72, the others 5 times in 18."""
    proposal = propose(neighbours) if facts.text_bytes else None
    if proposal is None:
        return None
    incident, confidence = proposal
    first = neighbours[0][0]
    evidence = tuple((facts.exceptions or errors)[-3:])
    leading = opinion.leading()
    if leading and leading[0][0] != incident:
        rival, p_rival = leading[0]
        why = (
            f"the most similar known incidents point to {incident} (closest: {first.source}), "
            f"the learned model ranks {rival} first (probability {p_rival:.2f})"
        )
        return _undecided(
            (incident, "similar incidents"), (rival, "learned model"), opinion, why,
            evidence=evidence, matches=(), common=common,
        )  # fmt: skip
    p = _backing(opinion, incident)
    return Diagnosis(
        incident=incident,
        confidence=confidence if p is None else round(p, 2),
        summary=f"No rule matched. The most similar known incidents point to {incident}: "
        f"{explain(incident)} This is a proposal from similar incidents, not a finding "
        f"(closest: {first.source}).{_backed(p)}",
        evidence=evidence,
        basis="similar-incidents",
        next_checks=knowledge.class_info(incident).next,
        **common,
    )


def _last_errors(facts: Facts, errors: list[Line]) -> tuple[Line, ...]:
    """The last three exceptions, else error lines, else error-ish lines."""
    return tuple((facts.exceptions or errors or facts.errorish)[-3:])


def _from_words(
    facts: Facts, thin: bool, opinion: Opinion, errors: list[Line], common: dict[str, object]
) -> Diagnosis | None:
    """A guess from the class vocabulary the evidence uses (see :func:`word_guess`), with the
    learned model's probability of it when it ranks it among its leading two."""
    guess = word_guess(facts, thin)
    if guess is None:
        return None
    incident, words = guess
    p = _backing(opinion, incident)
    return Diagnosis(
        incident=incident,
        confidence=WORD_GUESS_CONFIDENCE if p is None else round(p, 2),
        summary=f"No known message matched. The words used ({', '.join(words[:4])}) point "
        f"to {incident}: {explain(incident)} This is a guess, not a finding.{_backed(p)}",
        evidence=_last_errors(facts, errors),
        basis="keywords",
        next_checks=knowledge.class_info(incident).next,
        **common,
    )


def _unknown(
    facts: Facts,
    errors: list[Line],
    common: dict[str, object],
    opinion: Opinion,
) -> Diagnosis:
    """`unknown`, saying whether the evidence was about the GPUs at all (else confidence 0);
    with relevant evidence, two candidate causes (the model's leading two) and the check between
    them."""
    evidence = _last_errors(facts, errors)
    relevant = bool(evidence) or has_gpu_evidence(facts) or _kernel_gpu_lines(facts)
    none_of_them = _sure_of_none(opinion)
    lead = opinion.leading()[:2] if relevant and none_of_them is None else []
    if len(lead) == 2 and lead[0][1] >= CANDIDATE_MIN:
        (a, pa), (b, pb) = lead
        return _undecided(
            (a, "learned model"), (b, "learned model"), opinion,
            f"no known message matched, and the learned model is not sure of any class "
            f"({a} {pa:.2f}, {b} {pb:.2f})",
            evidence=evidence, matches=(), common=common,
        )  # fmt: skip
    summary = _unknown_summary(facts, evidence, relevant)
    if none_of_them is not None:
        summary += (
            " The learned model is sure this is none of the known classes (probability "
            f"{none_of_them:.2f}): like the corpus threads whose cause was outside them "
            "(a Python dependency, a port in use, a missing model file)."
        )
    return Diagnosis(
        incident=Incident.UNKNOWN,
        confidence=UNDECIDED_CONFIDENCE if relevant else 0.0,
        summary=summary,
        evidence=evidence,
        basis="model" if none_of_them is not None else "evidence" if relevant else "no-evidence",
        next_checks=knowledge.class_info(Incident.UNKNOWN).next,
        **common,
    )


def _sure_of_none(opinion: Opinion) -> float | None:
    """The model's probability that the evidence shows none of the classes, when it is sure."""
    if opinion.model is None or not opinion.ranked:
        return None
    top, p = opinion.ranked[0]
    return p if top == Incident.UNKNOWN and p >= opinion.model.threshold else None


def _unknown_summary(facts: Facts, evidence: tuple[Line, ...], relevant: bool) -> str:
    if evidence:
        return (
            f"{explain(Incident.UNKNOWN)} No known error message matched; the last error "
            f"was: {evidence[-1].text.strip()}"
        )
    if facts.ssh_error:
        return f"Nothing could be checked: the host could not be reached: {facts.ssh_error}"
    if not facts.text_bytes and not relevant:
        return "Nothing to diagnose: the evidence is empty."
    if not relevant:
        return (
            "Nothing in the evidence says anything about the GPUs or an error: no nvidia-smi, "
            "kernel log, container or known error message was found."
        )
    return explain(Incident.UNKNOWN)


WORD_GUESS_CONFIDENCE = 0.35
WORD_GUESS_MIN = 2  # distinct class words in a longer text, and a lead over the runner-up


def host_findings(facts: Facts) -> list[Finding]:
    """The host health checks of the same facts (runbooks/diagnose/health.py, one engine with the
    sweep),
    as findings of the diagnosis: code ``CODE@SUBJECT``, ``error`` for what drains a host."""
    return as_findings(_health(facts, None))


def as_findings(health: Iterable[HealthFinding]) -> list[Finding]:
    """Health findings as findings of a diagnosis."""
    return [
        Finding(
            code=f.key,
            message=f"{f.incident}: {f.message}",
            source=f.evidence[0].source if f.evidence else "",
            line=f.evidence[0].line if f.evidence else None,
            severity="error" if f.level == "drain" else "warning",
        )
        for f in health
    ]


def word_guess(facts: Facts, thin: bool) -> tuple[str, list[str]] | None:
    """The class whose vocabulary (classes.yaml `words`) the evidence uses most, when no rule,
    health evidence or close incident decided: at least WORD_GUESS_MIN distinct words and more
    than any other class. A last resort, always reported as a guess."""
    text = "\n".join(facts.salient).lower()
    if not text.strip():
        return None
    scores: list[tuple[int, str, list[str]]] = []
    for incident, info in knowledge.class_table().items():
        found = [w for w in info.words if _word_in(w, text)]
        if found:
            scores.append((len(found), incident, found))
    scores.sort(reverse=True)
    # One pasted line may carry one telling word; a longer text must use at least two.
    least = 1 if thin else WORD_GUESS_MIN
    if not scores or scores[0][0] < least:
        return None
    if len(scores) > 1 and scores[1][0] >= scores[0][0]:
        return None
    return scores[0][1], scores[0][2]


def _word_in(word: str, text: str) -> bool:
    """A word or phrase, not inside a longer word (`ram` is not in `param`)."""
    start = text.find(word)
    while start >= 0:
        end = start + len(word)
        before = text[start - 1] if start else " "
        after = text[end] if end < len(text) else " "
        if not (word[0].isalnum() and before.isalnum()) and not (
            word[-1].isalnum() and after.isalnum()
        ):
            return True
        start = text.find(word, start + 1)
    return False


def _summary(match: Match) -> str:
    text = explain(match.incident)
    if match.reason and not match.reason.startswith("matched "):
        text += f" Why: {match.reason}."
    elif match.evidence:
        text += f" Decided by: {match.evidence[0].text.strip()[:200]}"
    return text


def thin_source(facts: Facts) -> str:
    """What thin evidence was: the pasted text (`classify -`, a trigger), a container log (a
    log file given to `classify`), or a few lines of both."""
    sources = {s.source for s in facts.scans if s.lines}
    if sources and sources <= {"trigger.txt"}:
        return "pasted text"
    if sources and all(s.startswith("containers/") and s.endswith(".log") for s in sources):
        return "a short container log"
    return "a few lines of text"


def is_thin(facts: Facts) -> bool:
    """Only a few pasted lines: no structured evidence (nvidia-smi, kernel log, inspect,
    probes, nccl-tests) and at most THIN_MAX_LINES lines of text in all."""
    if has_gpu_evidence(facts) or facts.kernel is not None:
        return False
    if any(c.inspect is not None or c.ulimits or c.shm for c in facts.containers.values()):
        return False
    lines = sum(s.lines for s in facts.scans)
    return 0 < lines <= THIN_MAX_LINES


def has_gpu_evidence(facts: Facts) -> bool:
    """Did anything show the state of the GPUs (working or not)?"""
    return (
        (facts.smi is not None and facts.smi.status != "empty")
        or bool(facts.smi_xml and facts.smi_xml.gpus)
        or facts.nccl is not None
        or any(
            c.smi is not None or c.gpu_list is not None or (c.torch and c.torch.present)
            for c in facts.containers.values()
        )
    )


def error_lines(facts: Facts) -> list[Line]:
    """Lines that some signature of a cause or symptom matched, even below a rule's bar: an
    error was seen, so `healthy` would contradict the evidence."""
    strong = {
        s.id
        for s in signatures()
        if s.role in ("cause", "symptom") and s.incident != Incident.HEALTHY
    }
    out: list[Line] = []
    for scan in facts.scans:
        if origin_of(scan.source) == "probe":
            continue
        for sid, h in scan.hits.items():
            if sid in strong:
                out.extend(h.lines())
    return sorted(out, key=lambda ln: (ln.source, ln.line))


def _kernel_gpu_lines(facts: Facts) -> bool:
    return facts.kernel is not None and bool(facts.kernel.xids or facts.kernel.nvrm)


def health_evidence(facts: Facts) -> list[Line]:
    """Positive evidence that the GPUs work: nvidia-smi listing GPUs (host or inside a
    container), a CUDA probe or environment report saying CUDA is available, an nccl-tests run
    that reached its bandwidth. The absence of errors alone is not evidence of health."""
    lines: list[Line] = []
    tables = [facts.smi, *(c.smi for c in facts.containers.values())]
    for smi in tables:
        if smi is not None and smi.status == "ok" and smi.gpus:
            first = smi.gpus[0].line
            lines.append(
                first
                or Line(
                    source=smi.source,
                    line=0,
                    text=f"{len(smi.gpus)} GPUs, driver {smi.driver_version}",
                )
            )
    for smi in tables:
        if smi is not None and smi.status == "ok" and not smi.gpus:
            # The table cut short: a process on the GPU, or the header naming the driver,
            # still shows the driver answering.
            if smi.processes:
                lines.append(smi.processes[0].line)
            elif smi.driver_version and smi.status_line is not None:
                lines.append(smi.status_line)
    if not lines and facts.smi_xml is not None and facts.smi_xml.gpus:
        g = facts.smi_xml.gpus[0]
        lines.append(Line(source="nvidia-smi.xml", line=0, text=f"{g.product_name} {g.bus_id}"))
    if facts.nccl is not None and facts.nccl.avg_busbw is not None:
        lines.append(
            Line(
                source="nccl-tests.txt",
                line=0,
                text=f"# Avg bus bandwidth    : {facts.nccl.avg_busbw}",
            )
        )
    for c in facts.containers.values():
        if c.gpu_list:
            lines.append(
                Line(
                    source=f"containers/{c.name}.exec-nvidia-smi-L.txt", line=1, text=c.gpu_list[0]
                )
            )
        if c.torch is not None and c.torch.is_available and c.torch.line:
            lines.append(c.torch.line)
        progress = [ln for ln in c.log_tail if _PROGRESS.search(ln.text)]
        if progress and progress[-1] == c.log_tail[-1]:
            lines.append(progress[-1])  # the workload's log ends in training/serving progress
    healthy_sigs = [s.id for s in signatures() if s.incident == Incident.HEALTHY]
    for scan in facts.scans:
        if origin_of(scan.source) == "probe":
            continue
        for sid in healthy_sigs:
            if sid in scan.hits:
                lines.extend(scan.hits[sid].lines()[:1])
    for report in facts.env_reports:
        if report.cuda_available:
            lines.extend(ln for ln in report.lines if "vailable" in ln.text or "True" in ln.text)
    return lines


# A log line reporting progress: a loss, a step/epoch/iteration counter, a throughput.
_PROGRESS = re.compile(
    r"(?i)(['\"]?loss['\"]?\s*+[:=]\s*+[0-9.]++|\b(epoch|step|iter(ation)?)\b\s*+[:=#]?\s*+\[?[0-9]+|"
    r"(?<![0-9.])[0-9.]++\s*+(it/s|s/it|samples/s|tokens/s|img/s))"
)


def evidence_text(facts: Facts) -> str:
    """What similar-incident search matches on: the salient lines plus words for the facts."""
    return "\n".join([*facts.salient, " ".join(fact_words(facts))])


def model_input(facts: Facts) -> str:
    """What the learned model reads: the salient lines, as similar-incident search reads them,
    and the facts as words; but not a kernel log whose OOM kills were all another container's
    (on a shared host that log is another workload's story, as the host-oom rule judges it).
    Empty when the incident has no words of its own (the workload's log, a pasted text, a
    person's command output): fact words alone (a container that asked for no GPU) or a host's
    kernel log alone are normal until something says otherwise."""
    if not facts.own_text:
        return ""
    kernel = [] if kernel_kills_are_anothers(facts) else facts.kernel_text
    return "\n".join([*facts.own_text, *kernel, " ".join(fact_words(facts))])


def fact_words(facts: Facts) -> list[str]:
    """Structured facts as words, so that incidents alike in structure (a 64 MiB /dev/shm, no
    GPU request, driver not loaded) rank close even when their logs say different things."""
    words: list[str] = []
    if facts.smi is not None:
        words.append(f"factsmi_{facts.smi.status.replace('-', '_')}")
    for c in facts.containers.values():
        if c.smi is not None:
            words.append(f"factcontainer_smi_{c.smi.status.replace('-', '_')}")
        if c.inspect is not None:
            words.append("factgpu_access" if c.inspect.has_gpu_access else "factno_gpu_request")
            if c.inspect.oom_killed:
                words.append("factoomkilled")
            if shm_small(c, facts.thresholds):
                words.append("factshm_default")
        memlock = c.ulimits.memlock_kb if c.ulimits is not None else None
        if memlock_low(memlock, facts.thresholds):
            words.append("factmemlock_low")
    if facts.kernel is not None:
        words.extend(f"factxid_{x.code}" for x in facts.kernel.xids[:20])
    for report in facts.env_reports:
        if report.built_without_cuda:
            words.append("facttorch_cpu")
        if report.cuda_available is False:
            words.append("factcuda_unavailable")
    return words


def classify_path(
    path: object,
    *,
    state_dir: Path | None = None,
    exclude: Iterable[str] = (),
    model: Model | Literal["packaged"] | None = "packaged",
) -> Diagnosis:
    """Open a bundle (directory, .tar.gz or single log file) and diagnose it, citing similar
    known incidents (the packaged corpus, plus the team's confirmed history in `state_dir`);
    `model` as for :func:`diagnose`."""
    from runbooks.collect.bundle import open_bundle
    from runbooks.diagnose.facts import gather

    with open_bundle(Path(str(path))) as bundle:
        facts = gather(bundle)
        host = bundle.meta.host if bundle.meta else None
        status = {s.name: s.status for s in bundle.meta.sources} if bundle.meta else None
    return diagnose(
        facts,
        host=host,
        index=index_for(state_dir),
        exclude=exclude,
        source_status=status,
        model=model,
    )


def render_text(d: Diagnosis) -> str:
    """The diagnosis as a person reads it in a terminal (evidence text shown escaped)."""
    label = {
        "thin-evidence": "  - a guess from a few lines of text",
        "similar-incidents": "  - a proposal from similar incidents",
        "keywords": "  - a guess from the words used",
        "model": "  - named by the learned model, not a known message",
        "no-evidence": "  - nothing relevant seen",
    }
    tag = label.get(d.basis, "")
    if d.candidates:
        tag = "  - not decided between two causes"
    out = [f"incident:   {d.incident}  (confidence {d.confidence:.2f}){tag}"]
    if d.host or d.container:
        out.append(
            f"where:      host {safe(d.host or '?')}"
            + (f", container {safe(d.container)}" if d.container else "")
        )
    out.append(f"summary:    {safe(d.summary)}")
    if d.candidates:
        out.append("candidates:")
        out.extend(f"  - {candidate_line(c)}" for c in d.candidates)
        out.append(f"tells them apart: {safe(d.tells_apart)}")
    if d.evidence:
        out.append("evidence:")
        for ln in d.evidence:
            where = f"{ln.source}:{ln.line}" if ln.line else ln.source
            out.append(f"  {safe(where)}: {safe(ln.text.strip()[:300])}")
    if d.secondary:
        out.append(f"secondary:  {', '.join(d.secondary)}")
    warnings = [f for f in d.findings if f.severity != "info"]
    if warnings:
        out.append("findings:")
        out.extend(f"  [{f.severity}] {f.code}: {safe(f.message)}" for f in warnings[:10])
    if d.fix is not None:
        if d.fix.safe:
            out.append(f"fix (safe, automatic): recreate {safe(d.fix.container or '')} with")
            out.extend(f"  {delta}" for delta in d.fix.docker_run)
        else:
            out.append("fix (manual):")
        out.extend(f"  - {safe(step)}" for step in d.fix.steps)
        if d.fix.note:
            out.append(f"  note: {safe(d.fix.note)}")
    if d.next_checks and not d.candidates:  # with candidates: the check that tells them apart
        out.append("check next:")
        out.extend(f"  - {c}" for c in d.next_checks)
    if d.similar:
        out.append("similar known incidents:")
        out.extend(f"  - {similar_line(s)}" for s in d.similar)
    return "\n".join(out)


def candidate_line(c: Candidate) -> str:
    """One candidate cause: "gpu-hardware-fault (learned model, probability 0.93)"."""
    p = f", probability {c.probability:.2f}" if c.probability is not None else ""
    return safe(f"{c.incident} ({c.why}{p})")


def similar_line(s: SimilarIncident) -> str:
    """One cited incident: "[shm-too-small] thread URL — what it concluded"; one of another
    cause than the diagnosis is marked "[different cause: gpu-hardware-fault]"."""
    label = f"different cause: {s.incident}" if s.same_cause is False else s.incident
    if s.kind == "team":
        where = f"on {s.host or '?'} on {s.when or '?'}"
        fixed = f", fixed by `{s.fix}`" if s.fix else ""
        return safe(f"[{label}] this happened {where}{fixed} (report {s.source})")
    return safe(f"[{label}] {s.source} - {s.conclusion[:220]}")


def render_explain(d: Diagnosis) -> str:
    """Every class that matched, its evidence, and why the winner won (`classify --explain`)."""
    out = ["matched classes (strongest root cause first):"]
    if not d.matches:
        out.append("  none: no rule matched.")
    for n, m in enumerate(d.matches, 1):
        strong = "strong" if m.confidence >= STRONG else "weak"
        priority = PRIORITY.get(Incident(m.incident), 0)
        out.append(
            f"  {n}. {m.incident}  confidence {m.confidence:.2f} ({strong}), "
            f"root-cause priority {priority}, rule {m.rule}"
        )
        if m.reason:
            out.append(f"     why: {safe(m.reason)}")
        out.extend(
            f"     {safe(ln.source)}:{ln.line}: {safe(ln.text.strip()[:200])}"
            for ln in m.evidence[:4]
        )
    if len(d.matches) > 1:
        win, runner = d.matches[0], d.matches[1]
        if (win.confidence >= STRONG) != (runner.confidence >= STRONG):
            why = f"it is a strong match (>= {STRONG}) and {runner.incident} is not"
        elif PRIORITY.get(Incident(win.incident), 0) != PRIORITY.get(Incident(runner.incident), 0):
            why = (
                f"both are {'strong' if win.confidence >= STRONG else 'weak'} matches and "
                f"{win.incident} is the deeper cause (a root cause outranks its symptoms: "
                f"priority {PRIORITY.get(Incident(win.incident), 0)} over "
                f"{PRIORITY.get(Incident(runner.incident), 0)})"
            )
        else:
            why = "equal priority: the higher confidence wins"
        out.append(f"winner: {win.incident}, because {why}.")
    elif d.matches:
        out.append(f"winner: {d.matches[0].incident}, the only class that matched.")
    else:
        out.append(f"verdict: {d.incident} ({d.basis}).")
    if d.candidates:
        out.append(
            f"verdict: unknown, not decided between {d.candidates[0].incident} and "
            f"{d.candidates[1].incident} ({d.basis})."
        )
    model = packaged_model()
    if model is not None and d.model_view:
        view = ", ".join(f"{c} {p:.2f}" for c, p in d.model_view)
        out.append(f"learned model: {view} (it names a class at {model.threshold:.2f} or more).")
    return "\n".join(out)


def to_json(d: Diagnosis) -> dict[str, object]:
    """`classify --json`: one object, with the `schema` of every --json (docs/cli-json.md)."""
    from runbooks.core.cli_json import SCHEMA

    return {
        "schema": SCHEMA,
        "command": "classify",
        "exit_code": 0,
        "incident": d.incident,
        "confidence": d.confidence,
        "basis": d.basis,
        "guess": d.guess,
        "summary": d.summary,
        "evidence": [ln.model_dump() for ln in d.evidence],
        "secondary": list(d.secondary),
        "fix": d.fix.model_dump(mode="json") if d.fix is not None else None,
        "host": d.host,
        "container": d.container,
        "findings": [f.model_dump() for f in d.findings],
        "next_checks": list(d.next_checks),
        "similar": [s.model_dump() for s in d.similar],
        "candidates": [c.model_dump() for c in d.candidates],
        "tells_apart": d.tells_apart or None,
        "model": [{"incident": c, "probability": p} for c, p in d.model_view],
        "matches": [
            {"incident": m.incident, "confidence": m.confidence, "reason": m.reason, "rule": m.rule}
            for m in d.matches
        ],
    }
