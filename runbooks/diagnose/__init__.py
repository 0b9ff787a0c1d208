"""Stage 2, diagnose: from a bundle's evidence to facts, judgments and one incident class, with
its evidence, similar known incidents and the proposed remedy. Uses ``runbooks.core``,
``runbooks.knowledge`` and ``runbooks.collect``.

- ``facts``: the typed facts of a bundle; ``judgments``, ``rules``, ``logscan``: what they mean.
- ``classify``: the diagnosis (``diagnose``, ``classify_path``); ``learned``: the packaged model.
- ``similar``, ``history``: similar public incidents and the team's confirmed history.
- ``health``, ``sweep``, ``metrics``: the fleet health sweep and its Prometheus families.
- ``remedy``: the fix a diagnosis proposes (a safe container change, or a person's steps).
- ``rma``: the evidence NVIDIA asks for with an RMA.
"""

__all__ = [
    "classify",
    "facts",
    "health",
    "history",
    "judgments",
    "learned",
    "logscan",
    "metrics",
    "remedy",
    "rma",
    "rules",
    "similar",
    "sweep",
]
