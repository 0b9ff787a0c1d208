"""The lowest layer: what every stage uses. Imports nothing of cudamedic but itself (and the
packaged data of ``runbooks/`` and ``runbooks/knowledge/``).

- ``errors``: the exception types (InputError, CollectError, FixError, ...).
- ``model``: the typed records every stage passes on (bundle metadata, matches, diagnoses, fixes).
- ``taxonomy``: the incident classes and which may be fixed safely.
- ``settings``: configuration (file, environment, defaults); ``private``: owner-only file modes.
- ``names``: validation of every user-supplied name before it reaches a shell, SSH or Docker.
- ``runbook``, ``sources``, ``policy``: the declarative runbooks (what is collected, thresholds,
  which fixes may run unattended), their evidence sources and the fix policy.
- ``progress``: live progress events; ``prefect_api``: one fast raw Prefect REST call;
  ``cli_json``: the ``--json`` output schema.
"""

__all__ = [
    "cli_json",
    "errors",
    "model",
    "names",
    "policy",
    "prefect_api",
    "private",
    "progress",
    "runbook",
    "settings",
    "sources",
    "taxonomy",
]
