"""What the testbed tests share: the deploy/testbed commands, a host's runtime, waiting.

A test module's Bed subclasses TestbedCalls with what it keeps of its own
(the links it started, the green it made, what was acknowledged); the
module's fixture runs `up 3` and `down`.  Used by tests/test_fleet_testbed.py
and tests/test_fleet_failover.py.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TypeVar

from slates.errors import SlatesError

REPO = Path(__file__).resolve().parent.parent
TESTBED = REPO / "deploy" / "testbed"
PYTHON = REPO / ".venv" / "bin" / "python"
HOSTS = ("h1", "h2", "h3")
COMMAND_SECONDS = 180
WAIT_SECONDS = 60.0
T = TypeVar("T")


def print_anchor_logs(
    state_dir: Path, hosts: Iterable[str], *, last: int, words: tuple[str, ...] = ()
) -> None:
    """The tail of each host's anchor log (only lines with one of `words`, if any are
    given), for a failed test's report."""
    for host in hosts:
        log = state_dir / host / "logs" / "anchor.log"
        if log.exists():
            lines = log.read_text(errors="replace").splitlines()
            wanted = [ln for ln in lines if not words or any(w in ln for w in words)]
            print(f"--- {host}", *wanted[-last:], sep="\n")


def wait_for(what: str, probe: Callable[[], T | None], timeout: float = WAIT_SECONDS) -> T:
    """Poll `probe` until it returns something (not None or False); a SlatesError it
    raises means "not yet", and is the reason given if the time runs out."""
    started = time.monotonic()
    last: BaseException | None = None
    while True:
        try:
            found = probe()
        except SlatesError as exc:
            found, last = None, exc
        if found is not None and found is not False:
            print(f"{what}: {time.monotonic() - started:.1f} s")
            return found
        if time.monotonic() - started > timeout:
            raise AssertionError(f"not within {timeout} s: {what} (last error: {last!r})")
        time.sleep(0.25)


@dataclasses.dataclass
class TestbedCalls:
    """One testbed by name and state directory (SLATES_TESTBED_NAME/DIR)."""

    __test__ = False  # not a test class, whatever its name says to pytest

    name: str
    state_dir: Path

    @property
    def env(self) -> dict[str, str]:
        return {
            **os.environ,
            "SLATES_TESTBED_NAME": self.name,
            "SLATES_TESTBED_DIR": str(self.state_dir),
        }

    def call(self, verb: str, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(TESTBED / verb), *args],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=COMMAND_SECONDS,
            check=False,
        )

    def ok(self, verb: str, *args: str) -> str:
        done = self.call(verb, *args)
        assert done.returncode == 0, f"{verb} {args}: {done.returncode}\n{done.stdout}{done.stderr}"
        return done.stdout

    def runtime(self, host: str) -> Path:
        return self.state_dir / host / "runtime"
