"""The systemd unit in deploy/systemd runs the anchor as systemd would run it.

Theory of operation: the test reads deploy/systemd/slates-anchor.service and
its example drop-in the way systemd does (sections, repeated keys, an empty
assignment resetting a list, drop-in settings after the unit's), builds the
environment systemd gives the service (its Environment= lines, PATH, and
RUNTIME_DIRECTORY for RuntimeDirectory=, made with RuntimeDirectoryMode=),
and expands ExecStart= and ExecStartPost= with systemd's rules ("${VAR}" one
argument, a word "$VAR" split at whitespace, "$$" a literal "$").  Two
substitutions map the host onto this checkout: the documented install path
(/opt/slates/.venv/bin/slates) becomes this environment's `slates`, and
/run/slates a temporary directory; the drop-in's allowed roots become
directories under the temporary directory (they must exist).

It then runs the ExecStart line as a real process, runs the ExecStartPost
readiness probe (which must return once the service answers), checks with
`slates status --json` what the unit's settings should have done (capacity;
with the drop-in, an agent may name a base under an allowed root and no
other), mounts a volume, and stops the anchor by pid with SIGTERM, as
systemd does with KillMode=mixed: the anchor must exit 0 (so
Restart=on-failure does not restart it) and leave no mount, no shard or
bridge process, and no state file or socket behind.  A crash is what
Restart=on-failure with RuntimeDirectoryPreserve=restart is for: the test
kills the anchor and what is left of it with SIGKILL, runs ExecStart again
on the kept runtime directory, and checks that the new anchor reports the
lost volume and that no mount is left.  No systemd is needed
(systemd-analyze is not in CI); nothing is mocked.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import signal
import subprocess
import sysconfig
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from slates.node.anchor import is_mounted, parse_size, stop_process

REPO = Path(__file__).resolve().parent.parent
UNIT = REPO / "deploy" / "systemd" / "slates-anchor.service"
DROP_IN = REPO / "deploy" / "systemd" / "slates-anchor.service.d" / "capacity.conf"
INSTALLED_PROGRAM = "/opt/slates/.venv/bin/slates"
SYSTEMD_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
LIST_KEYS = frozenset({"Environment", "ExecStart", "ExecStartPost", "DeviceAllow"})
CLI_SECONDS = 60


# -- reading units as systemd does ---------------------------------------------

Unit = dict[str, dict[str, list[str]]]


def parse_unit(text: str) -> Unit:
    """Sections of key -> every value assigned, in order (continuation lines joined)."""
    unit: Unit = {}
    section: dict[str, list[str]] | None = None
    logical: list[str] = []
    for raw in text.splitlines():
        line = raw.strip()
        if not logical and (not line or line[0] in "#;"):
            continue
        if line.endswith("\\"):
            logical.append(line[:-1])
            continue
        line = " ".join([*logical, line]).strip()
        logical = []
        if line.startswith("[") and line.endswith("]"):
            section = unit.setdefault(line[1:-1], {})
            continue
        if section is None or "=" not in line:
            raise ValueError(f"not a unit file line: {raw!r}")
        key, value = (part.strip() for part in line.split("=", 1))
        section.setdefault(key, []).append(value)
    return unit


def with_drop_in(unit: Unit, drop_in: Unit) -> Unit:
    """The unit with a drop-in applied: an empty list assignment resets the list."""
    merged = {
        name: {key: list(values) for key, values in keys.items()} for name, keys in unit.items()
    }
    for name, keys in drop_in.items():
        target = merged.setdefault(name, {})
        for key, values in keys.items():
            for value in values:
                if key in LIST_KEYS:
                    target[key] = [] if value == "" else [*target.get(key, []), value]
                else:
                    target[key] = [value]
    return merged


def one(unit: Unit, key: str) -> str:
    values = unit["Service"].get(key, [])
    if len(values) != 1:
        raise ValueError(f"{key}= must be set once, got {values!r}")
    return values[0]


def environment(unit: Unit) -> dict[str, str]:
    """Environment= assignments (quoted words of NAME=VALUE), later ones winning."""
    env: dict[str, str] = {}
    for value in unit["Service"].get("Environment", []):
        for word in shlex.split(value):
            name, sep, setting = word.partition("=")
            if not sep or not name:
                raise ValueError(f"not an assignment: {word!r}")
            env[name] = setting
    return env


_VARIABLE = re.compile(r"\$\$|\$\{(\w+)\}")
_WHOLE_WORD = re.compile(r"\$(\w+)")


def expand_command(line: str, env: dict[str, str]) -> list[str]:
    """A command line as systemd runs it: "${VAR}" in place, a word "$VAR" split, "$$" is "$"."""
    argv: list[str] = []
    for word in shlex.split(line):
        if whole := _WHOLE_WORD.fullmatch(word):
            argv += env.get(whole.group(1), "").split()
            continue
        argv.append(
            _VARIABLE.sub(lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), ""), word)
        )
    return argv


def seconds(value: str) -> float:
    """A systemd time span as used in the unit: '90s', '2s', '60'."""
    match = re.fullmatch(r"(\d+)(s?)", value)
    if match is None:
        raise ValueError(f"not a time span this test reads: {value!r}")
    return float(match.group(1))


# -- running it -------------------------------------------------------------------


def slates_program() -> str:
    """This environment's `slates` (the checkout's .venv/bin/slates)."""
    program = Path(sysconfig.get_path("scripts")) / "slates"
    if not os.access(program, os.X_OK):
        raise AssertionError(f"no installed slates program at {program}")
    return str(program)


def on_this_host(argv: list[str]) -> list[str]:
    """Replace the documented install path by this checkout's program, in every argument."""
    return [arg.replace(INSTALLED_PROGRAM, slates_program()) for arg in argv]


@dataclass(frozen=True, slots=True)
class Started:
    process: subprocess.Popen[bytes]
    runtime: Path
    env: dict[str, str]
    log: Path


def service_environment(unit: Unit, runtime: Path) -> dict[str, str]:
    """What systemd gives the service: PATH, its Environment= and RUNTIME_DIRECTORY."""
    if one(unit, "RuntimeDirectory") != "slates":
        raise AssertionError("the unit's runtime directory is /run/slates")
    return {"PATH": SYSTEMD_PATH, "LANG": "C.UTF-8", **environment(unit)} | {
        "RUNTIME_DIRECTORY": str(runtime)
    }


def cli(started: Started, *args: str, token: str | None = None) -> subprocess.CompletedProcess[str]:
    """`slates ARGS --runtime-dir RUNTIME` as root would type it next to the service."""
    env = {"PATH": SYSTEMD_PATH, "LANG": "C.UTF-8", "COLUMNS": "200"}
    if token is not None:
        env["SLATES_TOKEN"] = token
    return subprocess.run(
        [slates_program(), *args, "--runtime-dir", str(started.runtime)],
        env=env,
        capture_output=True,
        text=True,
        timeout=CLI_SECONDS,
        check=False,
    )


def cli_ok(started: Started, *args: str, token: str | None = None) -> str:
    done = cli(started, *args, token=token)
    assert done.returncode == 0, (args, done.returncode, done.stderr, started.log.read_text())
    return done.stdout


def start_unit(unit: Unit, runtime: Path, log: Path) -> Started:
    """Run ExecStart= as systemd would and wait for ExecStartPost=; `runtime` exists."""
    env = service_environment(unit, runtime)
    if one(unit, "Type") != "exec":
        raise AssertionError("the test runs a foreground (Type=exec) unit")
    with open(log, "wb") as out:
        process = subprocess.Popen(
            on_this_host(expand_command(one(unit, "ExecStart"), env)),
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=out,
            cwd="/",
        )
    started = Started(process, runtime, env, log)
    try:
        wait_ready(unit, started)
    except BaseException:
        stop_leftovers(started)
        raise
    return started


@contextlib.contextmanager
def run_unit(unit: Unit, workdir: Path) -> Iterator[Started]:
    """Make the RuntimeDirectory=, start the unit, and clean up whatever is left after."""
    runtime = workdir / "run" / "slates"
    runtime.parent.mkdir()
    runtime.mkdir(mode=int(one(unit, "RuntimeDirectoryMode"), 8))
    started = start_unit(unit, runtime, workdir / "journal.log")
    try:
        yield started
    finally:
        stop_leftovers(started)
        for line in Path("/proc/self/mounts").read_text().splitlines():
            where = line.split()[1]
            if where.startswith(str(workdir)):
                subprocess.run(["fusermount3", "-u", "-z", where], check=False)


def stop_leftovers(started: Started) -> None:
    """After a failure: stop the anchor (SIGTERM, then SIGKILL) and any child it left."""
    children: list[int] = []
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        state = json.loads((started.runtime / "anchor.json").read_text())
        children = [int(s["pid"]) for s in state["shards"] + state["mounts"]]
    stop_process(started.process)
    for pid in children:
        if alive(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def wait_ready(unit: Unit, started: Started) -> None:
    """Run ExecStartPost= within TimeoutStartSec; systemd fails the start if the main
    process exits meanwhile, and so does this."""
    probe = subprocess.Popen(
        on_this_host(expand_command(one(unit, "ExecStartPost"), started.env)),
        env=started.env,
        stdin=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + seconds(one(unit, "TimeoutStartSec"))
    try:
        while probe.poll() is None and started.process.poll() is None:
            if time.monotonic() > deadline:
                raise AssertionError("not ready within TimeoutStartSec", started.log.read_text())
            time.sleep(0.05)
    finally:
        if probe.poll() is None:
            probe.kill()
        probe.wait()
    assert started.process.poll() is None, ("the anchor exited", started.log.read_text())
    assert probe.returncode == 0, ("the readiness probe failed", started.log.read_text())


def status(started: Started) -> dict[str, Any]:
    report: dict[str, Any] = json.loads(cli_ok(started, "status", "--json"))
    return report


def alive(pid: int) -> bool:
    """Whether `pid` is a live (not zombie) process."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return False
    return fields[0] != "Z"


def stop_as_systemd(unit: Unit, started: Started, others: list[int]) -> None:
    """SIGTERM to the main pid only (KillMode=mixed), then wait within TimeoutStopSec."""
    assert one(unit, "KillMode") == "mixed"
    assert one(unit, "KillSignal") == "SIGTERM"
    started.process.send_signal(signal.SIGTERM)
    code = started.process.wait(timeout=seconds(one(unit, "TimeoutStopSec")))
    assert code == 0, ("a SIGTERM stop is a clean exit", code, started.log.read_text())
    deadline = time.monotonic() + 10  # children exit before the anchor; reaping may lag
    while any(alive(pid) for pid in others) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [pid for pid in others if alive(pid)] == []
    assert not (started.runtime / "anchor.json").exists()
    assert sorted(started.runtime.glob("*.sock")) == []


# -- tests -------------------------------------------------------------------------


def unit_alone() -> Unit:
    return parse_unit(UNIT.read_text())


def unit_with_drop_in(workdir: Path) -> tuple[Unit, list[Path]]:
    """The unit and its example drop-in, the drop-in's allowed roots moved under `workdir`."""
    drop_in = parse_unit(DROP_IN.read_text())
    unit = with_drop_in(unit_alone(), drop_in)
    args = shlex.split(environment(unit).get("SLATES_ANCHOR_ARGS", ""))
    roots: list[Path] = []
    moved: list[str] = []
    for previous, arg in zip(["", *args], args, strict=False):
        if previous == "--allow-root":
            root = workdir / "roots" / arg.lstrip("/")
            root.mkdir(parents=True)
            roots.append(root)
            arg = str(root)
        moved.append(arg)
    unit["Service"]["Environment"].append(shlex.quote(f"SLATES_ANCHOR_ARGS={shlex.join(moved)}"))
    return unit, roots


def test_the_unit_reads_back_as_written() -> None:
    unit = unit_alone()
    env = environment(unit) | {"RUNTIME_DIRECTORY": "/run/slates"}
    argv = expand_command(one(unit, "ExecStart"), env)
    assert argv == [
        INSTALLED_PROGRAM,
        "anchor",
        "--runtime-dir",
        "/run/slates",
        "--capacity",
        env["SLATES_CAPACITY"],
    ]  # SLATES_ANCHOR_ARGS is empty: no argument at all
    assert one(unit, "Restart") == "on-failure"
    assert int(one(unit, "RuntimeDirectoryMode"), 8) == 0o700
    for namespacing in ("PrivateDevices", "PrivateTmp", "ProtectSystem", "ProtectHome"):
        assert namespacing not in unit["Service"], f"{namespacing} would hide the mounts"
    assert unit["Service"]["DeviceAllow"] == ["/dev/fuse rw"]


def test_the_unit_serves_mounts_and_stops_cleanly_on_sigterm(tmp_path: Path) -> None:
    unit = unit_alone()
    with run_unit(unit, tmp_path) as started:
        report = status(started)
        assert report["anchor_pid"] == started.process.pid
        assert report["capacity"] == parse_size(environment(unit)["SLATES_CAPACITY"])
        cli_ok(started, "volume", "create", "scratch")
        mountpoint = tmp_path / "mnt"
        mountpoint.mkdir()
        cli_ok(started, "mount", "scratch", str(mountpoint))
        (mountpoint / "hello.txt").write_bytes(b"served by the unit\n")
        assert cli_ok(started, "read", "scratch", "/hello.txt") == "served by the unit\n"
        report = status(started)
        children = [s["pid"] for s in report["shards"]] + [m["pid"] for m in report["mounts"]]
        assert len(report["mounts"]) == 1 and is_mounted(str(mountpoint))
        stop_as_systemd(unit, started, children)
        assert not is_mounted(str(mountpoint))


def test_the_drop_in_sets_capacity_and_allowed_roots(tmp_path: Path) -> None:
    base_capacity = parse_size(environment(unit_alone())["SLATES_CAPACITY"])
    unit, roots = unit_with_drop_in(tmp_path)
    capacity = parse_size(environment(unit)["SLATES_CAPACITY"])
    assert capacity != base_capacity, "the example drop-in changes the capacity"
    assert roots, "the example drop-in allows some roots"
    inside = roots[0] / "project"
    inside.mkdir()
    (inside / "README").write_text("inside an allowed root\n")
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    with run_unit(unit, tmp_path) as started:
        report = status(started)
        assert report["capacity"] == capacity
        token = json.loads(cli_ok(started, "agent", "add", "deployer", "--json"))["token"]
        cli_ok(started, "volume", "create", "inside", "--base", str(inside), token=token)
        refused = cli(started, "volume", "create", "outside", "--base", str(outside), token=token)
        assert refused.returncode != 0
        assert refused.stderr.startswith("error: AccessDenied:"), refused.stderr
        children = [s["pid"] for s in status(started)["shards"]]
        stop_as_systemd(unit, started, children)


def test_after_a_crash_the_restarted_anchor_cleans_up_what_the_dead_one_left(
    tmp_path: Path,
) -> None:
    unit = unit_alone()
    # Restart=on-failure restarts an anchor killed by a signal, and the runtime
    # directory survives that restart: the next anchor reads what the dead one left.
    assert one(unit, "Restart") == "on-failure"
    assert one(unit, "RuntimeDirectoryPreserve") == "restart"
    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir()
    with run_unit(unit, tmp_path) as first:
        cli_ok(first, "volume", "create", "doomed")
        cli_ok(first, "mount", "doomed", str(mountpoint))
        report = status(first)
        children = [s["pid"] for s in report["shards"]] + [m["pid"] for m in report["mounts"]]
        first.process.send_signal(signal.SIGKILL)
        assert first.process.wait(timeout=CLI_SECONDS) == -signal.SIGKILL
        for pid in children:  # KillMode=mixed: what is left of the unit gets SIGKILL
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        # The bridge unmounts when its anchor dies (PDEATHSIG) unless the SIGKILL
        # comes first; either way the next anchor must leave no mount there.
        second = start_unit(unit, first.runtime, tmp_path / "journal-2.log")
        try:
            report = status(second)
            lost = report["previous_anchor_lost"]
            assert lost["pid"] == first.process.pid
            assert lost["volumes"] == ["doomed"]
            assert lost["mounts"] == [str(mountpoint)]
            assert not is_mounted(str(mountpoint))
            stop_as_systemd(unit, second, [s["pid"] for s in report["shards"]])
        finally:
            stop_leftovers(second)


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("/p a ${X} b", ["/p", "a", "one two", "b"]),
        ("/p $X", ["/p", "one", "two"]),
        ("/p $EMPTY c", ["/p", "c"]),
        ("/bin/sh -c 'echo $$X ${X}'", ["/bin/sh", "-c", "echo $X one two"]),
    ],
)
def test_command_lines_expand_as_systemd_documents(line: str, expected: list[str]) -> None:
    assert expand_command(line, {"X": "one two", "EMPTY": ""}) == expected
