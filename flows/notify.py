"""What a response flow tells the people who asked for it, whatever the channel (PURE).

The incident flow depends on this interface only; flows/slack/delivery.py's `SlackThread` is the
implementation for a Slack thread.
"""

from __future__ import annotations

from typing import Any, Protocol


class Notifier(Protocol):
    requester: str

    def say(self, text: str, blocks: list[dict[str, Any]] | None = None) -> Any:
        """Tell progress (a line of the response's thread)."""

    def headline(self, text: str) -> None:
        """Change the one-line status of the response."""

    def report(self, pm: Any, markdown: str, name: str) -> None:
        """Hand over the post-mortem."""
