"""Finishing a shard service's jobs in-process, for tests that drive ShardService directly.

The shard runs a job's I/O in worker threads between other requests
(slates.node.shard); a test that calls `ShardService.handle` itself runs it
inline here, in order, with the same outcomes (a SlatesError is thrown into
the job), and collects every step's events.
"""

from __future__ import annotations

from typing import Any

from slates.errors import SlatesError
from slates.node.events import Event
from slates.node.jobs import Io, Job, Outcome, Sent, Thrown
from slates.node.service import ShardService


def finish(
    service: ShardService, reply: dict[str, Any] | Job, events: list[Event], now: int = 0
) -> tuple[dict[str, Any], list[Event]]:
    """The reply of a request `handle` answered with (reply or job, events)."""
    collected = list(events)
    while isinstance(reply, Job):
        outcome: Outcome = Sent()
        if isinstance(reply.waiting, Io):
            try:
                outcome = Sent(reply.waiting.fn())
            except SlatesError as exc:
                outcome = Thrown(exc)
        reply, more = service.step(reply, outcome, now)
        collected += more
    return reply, collected
