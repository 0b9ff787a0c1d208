"""Prefect flows: incident response, fleet health sweep, and their deployments.

Import `flows.server.configure` (through the CLI) before these modules: Prefect reads its
settings from the environment when it is imported.
"""

import logging


class _KnownTimeoutNote(logging.Filter):
    """Prefect warns that a task timeout cannot interrupt a blocking call in a worker thread.
    Known and designed for: every SSH/Docker call of ours carries its own timeout."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "running in a worker thread" not in record.getMessage()


logging.getLogger("prefect.task_runs").addFilter(_KnownTimeoutNote())
