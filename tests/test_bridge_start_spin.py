"""The spin calibration cache (slates.node.ring.cached_spin_ns) a bridge starts from.

Theory of operation: calibrating the eventfd wake-up cost takes tens of
milliseconds, so a runtime directory remembers it (issue 14: it was a third
of every mount).  These checks count calls of `calibrate_spin` (replaced in
process by a counting stub that returns a seeded value) to show that only
the first process of a boot calibrates, and feed the cache file arbitrary
bytes, other boots' lines, values out of range, symlinks and FIFOs to show
that nothing in it is trusted: the budget stays within [MIN_SPIN_NS,
MAX_SPIN_NS] and anything unusable means calibrating again.  Two real
interpreters check that a second bridge process does not calibrate.  No
timing is asserted.
"""

from __future__ import annotations

import contextlib
import os
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from slates.errors import InvalidArgument
from slates.fuse.bridge import REPLY_SPIN_NS, Bridge
from slates.node import ring
from slates.node.ring import (
    MAX_SPIN_NS,
    MIN_SPIN_NS,
    SPIN_CACHE_NAME,
    cached_spin_ns,
    parse_spin_cache,
)
from slates.node.runtime import Runtime

BOOT_ID = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
MEASURED = 23_456  # what the counting stub "measures"


class CountingCalibration:
    """Stands in for ring.calibrate_spin: counts its calls, returns `value`."""

    def __init__(self, value: int = MEASURED) -> None:
        self.value = value
        self.calls = 0

    def __call__(self, rounds: int = 200) -> int:
        self.calls += 1
        return self.value


@contextlib.contextmanager
def _counted(counting: CountingCalibration, cpus: int = 2) -> Iterator[CountingCalibration]:
    """ring.calibrate_spin replaced by `counting`, on a host of `cpus` usable CPUs."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ring, "calibrate_spin", counting)
        patch.setattr(os, "sched_getaffinity", lambda pid: set(range(cpus)))
        yield counting


@pytest.fixture
def calibration() -> Iterator[CountingCalibration]:
    with _counted(CountingCalibration()) as counting:
        yield counting


def _line(value: int | str, boot: str = BOOT_ID) -> bytes:
    return f"v1 {boot} {value}\n".encode()


def test_only_the_first_process_calibrates(
    tmp_path: Path, calibration: CountingCalibration
) -> None:
    assert cached_spin_ns(tmp_path) == MEASURED
    assert cached_spin_ns(tmp_path) == MEASURED
    assert calibration.calls == 1
    cache = tmp_path / SPIN_CACHE_NAME
    assert cache.read_bytes() == _line(MEASURED)
    assert stat.S_IMODE(cache.stat().st_mode) == 0o644
    assert [p.name for p in tmp_path.iterdir()] == [SPIN_CACHE_NAME]  # no temp file left


@pytest.mark.parametrize(
    ("value", "expected"),
    [(0, MIN_SPIN_NS), (1, MIN_SPIN_NS), (MAX_SPIN_NS + 1, MAX_SPIN_NS), (10**11, MAX_SPIN_NS)],
)
def test_a_value_out_of_range_is_clamped_not_trusted(
    tmp_path: Path, calibration: CountingCalibration, value: int, expected: int
) -> None:
    (tmp_path / SPIN_CACHE_NAME).write_bytes(_line(value))
    assert cached_spin_ns(tmp_path) == expected
    assert calibration.calls == 0


@pytest.mark.parametrize(
    "content",
    [
        b"",
        b"garbage",
        _line(5000, boot="another-boot"),
        _line(-5000),
        _line("5e3"),
        _line(10**13),  # more digits than any budget
        b"v2 " + _line(5000)[3:],
        _line(5000) + b"extra",
        "v1 " + BOOT_ID + " \u0665\u0660\u0660\u0660\n",  # digits, but not ASCII ones
    ],
    ids=repr,
)
def test_a_malformed_or_other_boot_file_means_calibrating_again(
    tmp_path: Path, calibration: CountingCalibration, content: bytes | str
) -> None:
    raw = content.encode() if isinstance(content, str) else content
    (tmp_path / SPIN_CACHE_NAME).write_bytes(raw)
    assert cached_spin_ns(tmp_path) == MEASURED
    assert calibration.calls == 1
    assert (tmp_path / SPIN_CACHE_NAME).read_bytes() == _line(MEASURED)  # replaced


def test_a_symlink_or_a_fifo_is_not_followed_or_waited_on(
    tmp_path: Path, calibration: CountingCalibration
) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.write_bytes(_line(MAX_SPIN_NS))
    cache = tmp_path / SPIN_CACHE_NAME
    cache.symlink_to(elsewhere)
    assert cached_spin_ns(tmp_path) == MEASURED
    assert elsewhere.read_bytes() == _line(MAX_SPIN_NS)  # replaced the link, not its target
    cache.unlink()
    os.mkfifo(cache)
    assert cached_spin_ns(tmp_path) == MEASURED  # a FIFO with no writer: no hang
    assert calibration.calls == 2
    assert cache.read_bytes() == _line(MEASURED)


def test_a_directory_it_cannot_write_only_costs_calibrating(
    tmp_path: Path, calibration: CountingCalibration
) -> None:
    missing = tmp_path / "missing"
    assert cached_spin_ns(missing) == MEASURED
    assert cached_spin_ns(missing) == MEASURED
    assert calibration.calls == 2
    assert not missing.exists()


def test_one_cpu_means_no_spin_and_no_file(tmp_path: Path) -> None:
    with _counted(CountingCalibration(), cpus=1) as calibration:
        assert cached_spin_ns(tmp_path) == 0
    assert calibration.calls == 0
    assert not (tmp_path / SPIN_CACHE_NAME).exists()


@given(st.binary(max_size=200), st.integers(min_value=-(10**6), max_value=10**7))
def test_whatever_the_file_holds_the_budget_stays_in_bounds(content: bytes, value: int) -> None:
    with tempfile.TemporaryDirectory() as scratch, _counted(CountingCalibration(value)) as counting:
        (Path(scratch) / SPIN_CACHE_NAME).write_bytes(content)
        remembered = parse_spin_cache(content, BOOT_ID)
        spin = cached_spin_ns(scratch)
        assert MIN_SPIN_NS <= spin <= MAX_SPIN_NS
        assert counting.calls == (remembered is None)
        if remembered is not None:
            assert spin == remembered
        again = parse_spin_cache((Path(scratch) / SPIN_CACHE_NAME).read_bytes(), BOOT_ID)
        assert again == spin  # what is left behind is well-formed and says the same


def test_parse_spin_cache_needs_a_boot_id() -> None:
    assert parse_spin_cache(b"v1  5000\n", "") is None
    assert parse_spin_cache(_line(5000), BOOT_ID) == 5000


def test_the_bridge_spins_at_least_the_reply_spin(
    tmp_path: Path, calibration: CountingCalibration
) -> None:
    (tmp_path / SPIN_CACHE_NAME).write_bytes(_line(MAX_SPIN_NS))
    bridge = Bridge(Runtime(tmp_path), "vol-0-1")
    bridge.configure()  # sets the C half's (process-global) spin; no mount here
    bridge.configure(0)
    bridge.configure(MAX_SPIN_NS)
    for bad in (-1, MAX_SPIN_NS + 1):
        with pytest.raises(InvalidArgument):
            bridge.configure(bad)
    assert calibration.calls == 0
    assert REPLY_SPIN_NS <= MAX_SPIN_NS


_BRIDGE_PROCESS = """
import sys
from slates.node import ring
from slates.node.runtime import Runtime
calls = []
measure = ring.calibrate_spin
ring.calibrate_spin = lambda rounds=200: calls.append(rounds) or measure(rounds=20)
from slates.fuse.bridge import Bridge
Bridge(Runtime(sys.argv[1]), "vol-0-1").configure()
print(len(calls))
"""


@pytest.mark.skipif(
    len(os.sched_getaffinity(0)) < 2, reason="on one usable CPU nothing is ever calibrated"
)
def test_a_second_bridge_process_does_not_calibrate_again(tmp_path: Path) -> None:
    def calibrations() -> int:
        done = subprocess.run(
            [sys.executable, "-c", _BRIDGE_PROCESS, str(tmp_path)],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        return int(done.stdout)

    assert calibrations() == 1
    first = (tmp_path / SPIN_CACHE_NAME).read_bytes()
    assert calibrations() == 0
    assert (tmp_path / SPIN_CACHE_NAME).read_bytes() == first
    spin = parse_spin_cache(first, BOOT_ID)
    assert spin is not None and MIN_SPIN_NS <= spin <= MAX_SPIN_NS
