"""The Slack side of cudamedic.

- ``app``: the Slack app that starts responses and takes approvals (``cudamedic slack``).
- ``delivery``: what the flows post (progress threads, approval requests, post-mortems, sweep
  news), never failing a flow; ``outbox``: where messages wait and refused ones are kept, in the
  Prefect server the fleet shares.
"""

__all__ = ["app", "delivery", "outbox"]
