"""Stage 3, fix: make the safe fix a diagnosis proposed, with a dry-run plan, approval, a lock,
verification and automatic rollback, all journaled and audited. Uses the stages below it and
``reports`` (the post-mortem a fix writes).

- ``plan``: the fix plan (the create request and the docker-run diff); ``dockerrun``: a
  container as the `docker run` flags that make it.
- ``fixer``: one fix end to end; ``recreate``: the container swap; ``fixlock``: one fix per
  container at a time.
- ``journal``, ``audit``: what was done, locally and as Prefect events.
- ``approvals``: who may answer a paused fix; ``breaker``: the fleet-wide circuit breaker.
"""

__all__ = [
    "approvals",
    "audit",
    "breaker",
    "dockerrun",
    "fixer",
    "fixlock",
    "journal",
    "plan",
    "recreate",
]
