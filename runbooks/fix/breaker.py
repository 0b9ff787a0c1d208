"""The fleet-wide circuit breaker for unattended fixes (PURE).

Each unattended fix is recorded; once `max_unattended_fixes` happened within `window_min`, the
breaker trips and stays open — no more unattended fixes anywhere — until a person resets it
(`cudamedic breaker reset`). Fixes a person approves are not counted and still run. The flows
keep the state in one shared place (a Prefect Variable) and change it under a Prefect lock, so
every worker of the fleet sees the same breaker.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from runbooks.core.model import Frozen
from runbooks.core.runbook import Breaker


class BreakerState(Frozen):
    tripped_at: datetime | None = None
    reason: str = ""
    fixes: tuple[datetime, ...] = ()  # unattended fixes inside the window
    reset_by: str | None = None
    reset_at: datetime | None = None

    @property
    def tripped(self) -> bool:
        return self.tripped_at is not None


def admit(state: BreakerState, cfg: Breaker, now: datetime) -> tuple[bool, BreakerState, str]:
    """May one more unattended fix run now? Returns (allowed, new state, why not).

    An allowed fix is counted in the new state; the fix that reaches the limit still runs and
    trips the breaker for the next one."""
    if state.tripped:
        return False, state, f"circuit breaker open since {state.tripped_at}: {state.reason}"
    cutoff = now - timedelta(minutes=cfg.window_min)
    recent = tuple(t for t in state.fixes if t >= cutoff)
    if len(recent) >= cfg.max_unattended_fixes:
        reason = (
            f"{len(recent)} unattended fixes within {cfg.window_min:g} min "
            f"(limit {cfg.max_unattended_fixes})"
        )
        tripped = state.model_copy(update={"fixes": recent, "tripped_at": now, "reason": reason})
        return False, tripped, f"circuit breaker tripped: {reason}; a person must reset it"
    counted = state.model_copy(update={"fixes": (*recent, now)})
    return True, counted, ""


def reset(state: BreakerState, by: str, now: datetime) -> BreakerState:
    return BreakerState(reset_by=by, reset_at=now, fixes=())
