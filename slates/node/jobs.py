"""Long requests as jobs: generators that hand their slow I/O to the driver.

Theory of operation (DESIGN.md section 6a, fairness).  A shard answers
requests one at a time on one loop, so a request that reads 300 MB of a
source directory or writes a landing to disk would stall every other
client.  Such a request is written as a generator (a `JobBody`) that
yields what it needs done instead of doing it:

- `Io(fn)`: run `fn()` off the loop (a worker thread; `fn` touches only the
  disk, never the service's state) and send its result back in, or throw
  its SlatesError in;
- `Pause()`: commit what the job changed so far and let other requests run
  before going on.

The service advances a job (`ShardService.step`) between other requests,
with the job's own client, principal and event buffer, so the bookkeeping
of a request (saved replies, the "done" event) happens once, when the
generator returns its result.  The shard's driver owns the threads.  A
connection waits for its job before its next request, so one client's
requests stay ordered; other connections go on.  A job's state between
steps is committed like any request's: a shard restarted mid-job recovers
to the last committed step, and the service drops what the unfinished
job left (a capture's scratch volume).

Pure types; no I/O here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Generator
from typing import Any

from slates.errors import SlatesError
from slates.node.principals import Principal
from slates.node.protocol import Request

__all__ = ["Io", "Pause", "JobBody", "Job", "Sent", "Thrown", "Outcome"]


@dataclasses.dataclass(frozen=True, slots=True)
class Io:
    """Run `fn` off the loop; its result, or its SlatesError, goes back to the job."""

    fn: Callable[[], Any]


@dataclasses.dataclass(frozen=True, slots=True)
class Pause:
    """Commit the job's changes so far; other requests may run before it goes on."""


JobBody = Generator[Io | Pause, Any, Any]


@dataclasses.dataclass(frozen=True, slots=True)
class Sent:
    value: Any = None


@dataclasses.dataclass(frozen=True, slots=True)
class Thrown:
    error: SlatesError


Outcome = Sent | Thrown


@dataclasses.dataclass(slots=True)
class Job:
    """One running long request: whose it is, and what it waits for now."""

    client: str
    principal: Principal
    request: Request
    body: JobBody
    waiting: Io | Pause
