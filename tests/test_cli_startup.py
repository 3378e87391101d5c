"""The `slates` command starts without loading what only some commands need, and still works.

Theory of operation: the CLI imports click and its own command modules at
start; rich, the SDK, msgpack, pygit2 and the core load inside the
commands that use them (slates_cli/main.py, slates_cli/commands.py, slates_cli/land.py), so
`slates --help` and usage errors answer in the time Python and click take.
Commands that talk to the service use the blocking SDK client, which runs
the SDK's one implementation of each rule over plain sockets (slates.sdk.
blocking): trio, the ring extension and the shard's own modules never load
for them.  Each check runs the CLI in a fresh interpreter (a module, once
imported, stays imported) with the command's real arguments, exit code and
output, and asks that interpreter which modules it loaded and which
sockets it connected to (an audit hook on `socket.connect`).  The probe is
not blind: each check also names a module the command must have loaded,
and the sockets are checked exactly.  No timing is asserted: hyperfine
measures it (bench/RESULTS.md).

What is checked, per hot command (issue 14: create + mount from the CLI):
- `--help`, a subcommand's help and a usage error load no slates module
  but slates.errors, and none of rich, msgpack, the SDK, pathlib, socket,
  json or shutil; `--help` lists the lazily loaded commands (land, agent,
  fleet, ...) without loading their modules, by summaries that are their
  own short help at any width (and the list is the same once they are
  loaded), at the width click would choose (help_width, checked against
  click's own HelpFormatter);
- a `slates` process skips the interpreter's teardown when nothing needs
  it (its exit code and output unchanged, through a pipe), and not with a
  second thread or for a serving command (`anchor`);
- a `slates` process (the console script, `python [-X ...] -m
  slates_cli.main`) imports with the garbage collector paused and collects
  again once slates_cli.main is loaded, the modules' objects frozen; a
  collector that was off stays off, and a program or test that imports the
  CLI keeps its collector untouched (is_the_command tells which processes
  are the command);
- a request loads of the service's side (slates.node) only the runtime
  directory's state file (runtime): not the wire's server side (protocol:
  the SDK speaks it through slates.wire), never the anchor (a size parser
  lives there), the core, the merge engine, trio; nor pathlib or socket.py
  (the blocking transport uses socket's C half), nor the commands of
  slates_cli.land, slates_cli.agents and slates_cli.fleet (loaded when
  named); rich only for tables, and without tables no dataclass at all
  (the state file's records are NamedTuples);
- round trips: each command connects to the sockets it needs, each once.
  `mount VOLUME_ID` and `unmount` talk to the anchor only; a volume named
  by name is looked up on every shard once; `volume list` and `status`
  ask every shard once and the anchor never (mounts come from its state
  file); `volume create` asks every shard once (the name check, then the
  create on its home shard over the same connection), and with `--mount`
  the anchor once more, in the same process.  One volume's facts (`volume
  create`, `volume show`) print as plain aligned lines, without rich
  (facts_text: one fact a line, values in one column).  Without rings the first
  request to a shard travels in the hello's send (one round trip, not two):
  checked against a listening socket that answers nothing until it has
  both, and a refused hello still raises the shard's error.  One request
  to several shards is sent to all before any reply is awaited (two
  listening sockets that each answer only once both requests came), and a
  refusal from one leaves no reply behind.  Closing sends every shard its
  goodbye and awaits no answer (listening sockets that answer nothing see
  the client's end), and the shard still reads each goodbye: an agent's
  clients that close so never use up its client ids, while clients that
  leave without a goodbye do.

The mount flags (issue 12) are checked on real mounts: `--allow-other`
reaches the kernel's mount options, and mount and unmount carry the
agent's $SLATES_TOKEN (an agent unmounts its own mount, another agent
cannot).  `slates anchor --agent-group` is checked on a real anchor, and
the state file it rewrites on every mount (Runtime.write_state) as a
pure round trip: whole, 0640 whatever the umask, in the agent group.
The pieces both SDK transports share (slates.sdk.session: request
identity, the reconnect bound, the hello) are checked as pure functions,
and the blocking client with rings on a real service.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import json
import os
import socket
import subprocess
import sys
import threading
import types
from collections import Counter
from collections.abc import Generator
from pathlib import Path
from typing import Any

import click
import pytest
from click.testing import CliRunner
from hypothesis import given
from hypothesis import strategies as st

from slates.core.host import UNLIMITED
from slates.errors import CapacityExhausted, NotFound, SlatesError, VerificationFailed
from slates.node.anchor import spawn_anchor, stop_process
from slates.node.protocol import FrameReader, error_reply, frame, ok_reply, pack, unpack
from slates.node.runtime import AnchorState, MountInfo, Runtime, ShardInfo
from slates.node.service import MAX_AGENT_CLIENTS
from slates.sdk import Client
from slates.sdk.blocking import ALONG_MOST, BlockingShardConnection, BlockingTransport
from slates.sdk.client import _run_to_end
from slates.sdk.session import RECONNECT_SECONDS, RETRY_MOST, Reconnect, ShardSession
from slates_cli import commands, is_the_command
from slates_cli.main import LAZY_COMMANDS, help_width, main
from tests.anchor_fixture import Service, service

__all__ = ["service"]  # the fixture, re-exported for pytest

SLATES = str(Path(sys.executable).with_name("slates"))

HEAVY = ("trio", "rich", "msgpack", "pygit2", "blake3")
"""Third-party modules that only some commands need."""
NEVER_FOR_HELP = (*HEAVY, "pathlib", "socket", "json", "shutil")
"""Besides HEAVY, what only talking to the service or printing data needs."""
SLATES_FOR_HELP = frozenset({"slates", "slates.errors"})
"""The only slates modules help and usage errors load (the CLI's own modules aside)."""
NODE_FOR_A_REQUEST = frozenset({"slates.node", "slates.node.runtime"})
"""The service-side modules a request may load: the state file, nothing else."""
NEVER_FOR_A_REQUEST = (
    "trio",
    "pathlib",
    "socket",
    "slates.node.protocol",
    "slates_cli.land",
    "slates_cli.agents",
    "slates_cli.fleet",
    "pygit2",
    "slates.core",
    "slates.base",
    "slates.merge",
    "slates.land",
    "slates.fleet",
    "slates.fuse",
    "slates.mcp",
    "slates._native",
    "slates.sdk.connection",
)
"""Packages (and modules) no request of the hot commands loads anything of."""

_PROBE = """
import sys
connected = []
def _audit(event, args):
    if event == "socket.connect":
        connected.append(str(args[1]))
sys.addaudithook(_audit)
from slates_cli.main import main
code = 0
try:
    main(args=sys.argv[1:], prog_name="slates")
except SystemExit as done:
    code = done.code
loaded = sorted(sys.modules)
import json
with open({report!r}, "w") as report:
    json.dump({{"loaded": loaded, "connected": connected}}, report)
sys.exit(code)
"""


@dataclasses.dataclass(frozen=True, slots=True)
class Probe:
    """What one `slates` run loaded (module names) and connected to (socket file names)."""

    loaded: frozenset[str]
    connected: tuple[str, ...]

    def of(self, package: str) -> set[str]:
        """The loaded modules that are `package` or inside it."""
        return {m for m in self.loaded if m == package or m.startswith(package + ".")}

    def any_of(self, packages: tuple[str, ...]) -> set[str]:
        return {m for package in packages for m in self.of(package)}

    def connections(self) -> Counter[str]:
        return Counter(self.connected)


def _run(
    tmp_path: Path, *args: str, token: str | None = None
) -> tuple[subprocess.CompletedProcess[str], Probe]:
    """Run `slates ARGS` in a fresh interpreter: the result, and what it loaded and reached."""
    report = tmp_path / "probe.json"
    env = {k: v for k, v in os.environ.items() if k != "SLATES_TOKEN"}
    env["COLUMNS"] = "200"  # tables wide enough that ids are not folded
    if token is not None:
        env["SLATES_TOKEN"] = token
    probe = _PROBE.format(report=str(report))
    done = subprocess.run(
        [sys.executable, "-c", probe, *args], capture_output=True, text=True, env=env, timeout=60
    )
    seen = json.loads(report.read_text())
    report.unlink()
    return done, Probe(frozenset(seen["loaded"]), tuple(Path(a).name for a in seen["connected"]))


def _ok(done: subprocess.CompletedProcess[str]) -> Any:
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout) if done.stdout.lstrip().startswith(("{", "[")) else None


def _mount_options(directory: Path) -> set[str]:
    """The mount options and super options of the mount at `directory` (mountinfo)."""
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        if fields[4] == str(directory):
            separator = fields.index("-")
            return {*fields[5].split(","), *fields[separator + 3].split(",")}
    raise AssertionError(f"nothing is mounted at {directory}")


def _check_help(probe: Probe, *, lazy: tuple[str, ...] = ()) -> None:
    """What help loads: click and the CLI's commands; of slates, the errors; nothing of
    NEVER_FOR_HELP; of the lazily loaded command modules, those in `lazy` at most."""
    assert probe.of("slates") <= SLATES_FOR_HELP, sorted(probe.of("slates"))
    assert not probe.any_of(NEVER_FOR_HELP), sorted(probe.any_of(NEVER_FOR_HELP))
    assert "click" in probe.loaded and "slates_cli.commands" in probe.loaded
    lazily = {module for module, _, _ in LAZY_COMMANDS.values()}
    assert probe.loaded & lazily <= set(lazy), sorted(probe.loaded & lazily)
    assert probe.connected == ()


def _check_request(probe: Probe, *, tables: bool) -> None:
    """A request's modules: the blocking SDK, the wire and the state file; rich iff tables."""
    assert "slates.sdk.blocking" in probe.loaded and "msgpack" in probe.loaded
    assert "slates.wire" in probe.loaded and "_socket" in probe.loaded
    assert probe.of("slates.node") <= NODE_FOR_A_REQUEST, sorted(probe.of("slates.node"))
    assert not probe.any_of(NEVER_FOR_A_REQUEST), sorted(probe.any_of(NEVER_FOR_A_REQUEST))
    assert ("rich" in probe.loaded) == tables, sorted(probe.of("rich"))
    if not tables:  # the state file's records are NamedTuples: no dataclass is built
        assert "dataclasses" not in probe.loaded


@pytest.mark.parametrize(
    "args",
    [
        ("--help",),
        ("status", "--help"),
        ("volume", "--help"),
        ("volume", "create", "--help"),
        ("mount", "--help"),
        ("anchor", "--help"),
        ("land", "--help"),
        ("submit", "--help"),
        ("green", "create", "--help"),
        ("volume", "create"),  # a usage error (no NAME): exit 2, nothing loaded
    ],
)
def test_help_and_usage_errors_load_no_heavy_module(tmp_path: Path, args: tuple[str, ...]) -> None:
    done, probe = _run(tmp_path, *args)
    assert done.returncode == (2 if args == ("volume", "create") else 0), done.stderr
    _check_help(probe, lazy=("slates_cli.land",) if args[0] == "land" else ())
    if args == ("--help",):
        assert "volume" in done.stdout and "mount" in done.stdout
        for name, (_, _, summary) in LAZY_COMMANDS.items():  # listed, not loaded
            assert f"  {name} " in done.stdout and summary.split()[0] in done.stdout


@given(st.integers(0, 200))
def test_the_lazy_commands_are_listed_with_their_own_help(limit: int) -> None:
    # --help lists a lazy command by the summary in LAZY_COMMANDS: what click would show
    # for the command itself, at any width.
    for name, (module, attribute, summary) in LAZY_COMMANDS.items():
        command = getattr(importlib.import_module(module), attribute)
        assert command.name == name
        listed = click.Command(name, help=summary)
        assert listed.get_short_help_str(limit) == command.get_short_help_str(limit)


def test_the_command_list_is_the_same_whether_lazy_commands_are_loaded_or_not() -> None:
    runner = CliRunner()
    lazily = runner.invoke(main, ["--help"], terminal_width=100)
    for name in LAZY_COMMANDS:
        main.get_command(click.Context(main), name)  # now loaded, as after naming one
    assert set(LAZY_COMMANDS) <= set(main.commands)
    loaded = runner.invoke(main, ["--help"], terminal_width=100)
    assert lazily.exit_code == loaded.exit_code == 0
    assert lazily.output == loaded.output


@given(
    st.one_of(
        st.none(),
        st.integers(-5, 300).map(str),
        st.sampled_from(["", "abc", "80x", " 90"]),
    )
)
def test_help_is_as_wide_as_click_would_make_it(columns: str | None) -> None:
    # help_width finds click's width without shutil: $COLUMNS, else the terminal (none
    # under pytest's capture: 80), clamped to click's bounds.
    saved = os.environ.get("COLUMNS")
    try:
        if columns is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = columns
        assert help_width() == click.HelpFormatter().width
    finally:
        if saved is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = saved


_FACT = st.text(
    st.characters(min_codepoint=33, max_codepoint=0x2FF, blacklist_categories=("Z", "C")),
    min_size=1,
    max_size=24,
)


@given(_FACT, st.lists(st.tuples(_FACT, _FACT), max_size=12))
def test_facts_are_one_line_each_under_their_title(title: str, rows: list[tuple[str, str]]) -> None:
    # Short facts (no spaces: nothing to wrap) come out one per line, in order, the names
    # in one column and the values in the next.
    saved = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "100"
    try:
        text = commands.facts_text(title, rows)
    finally:
        if saved is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = saved
    lines = text.splitlines()
    assert lines[0] == title and len(lines) == 1 + len(rows)
    facts = lines[1:]
    assert [line.split() for line in facts] == [[name, value] for name, value in rows]
    starts = {
        line.index(value, 2 + len(name)) for line, (name, value) in zip(facts, rows, strict=True)
    }
    assert len(starts) <= 1  # the values start in one column


_QUICK_PROBE = """
import os, sys, threading, time
class _Teardown:  # the interpreter's teardown clears __main__, and so deletes this
    def __del__(self, write=os.write):
        write(2, b"TEARDOWN")
_seen = _Teardown()
if os.environ.get("PROBE_THREAD"):
    threading.Thread(target=time.sleep, args=(30,), daemon=True).start()
from slates_cli.main import main
sys.argv[0] = "slates"
sys.exit(main())
"""


@pytest.mark.parametrize(
    ("args", "thread", "code", "quick"),
    [
        (("--help",), False, 0, True),
        (("volume", "create", "--help"), False, 0, True),
        (("volume", "create"), False, 2, True),  # a usage error
        (("status", "--runtime-dir", "/nonexistent/slates"), False, 2, True),  # NotFound
        (("--help",), True, 0, False),  # another thread: the usual exit
        (("anchor", "--help"), False, 0, False),  # a serving command: the usual exit
    ],
)
def test_a_slates_process_ends_without_the_teardown_when_nothing_needs_it(
    args: tuple[str, ...], thread: bool, code: int, quick: bool
) -> None:
    env = {k: v for k, v in os.environ.items() if k != "PROBE_THREAD"}
    if thread:
        env["PROBE_THREAD"] = "1"
    done = subprocess.run(
        [sys.executable, "-c", _QUICK_PROBE, *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert done.returncode == code, done.stderr
    assert ("TEARDOWN" not in done.stderr) == quick, done.stderr
    if args[-1] == "--help":  # all of it, through the pipe
        helped = CliRunner().invoke(main, list(args), prog_name="slates", terminal_width=78)
        assert done.stdout == helped.output
    elif code:
        assert "Error" in done.stderr or "error:" in done.stderr


def test_the_console_script_keeps_output_and_exit_codes(tmp_path: Path) -> None:
    # The installed `slates` (the quick exit) writes everything through a pipe and exits
    # with the command's code.
    listing = subprocess.run([SLATES, "--help"], capture_output=True, text=True, timeout=60)
    assert listing.returncode == 0
    helped = CliRunner().invoke(main, ["--help"], prog_name="slates", terminal_width=78)
    assert listing.stdout == helped.output
    usage = subprocess.run([SLATES, "mount"], capture_output=True, text=True, timeout=60)
    assert usage.returncode == 2 and "Missing argument" in usage.stderr


_COLLECTOR_REPORT = """
import atexit, gc, os, sys
if os.environ.get("PROBE_NO_COLLECTOR"):
    gc.disable()
def _report(write=os.write):
    loaded = "slates_cli" in sys.modules
    write(2, f"COLLECTOR {gc.isenabled()} {gc.get_freeze_count()} {loaded}".encode())
atexit.register(_report)  # (an atexit callback: the command exits the usual way)
"""


def _collector_at_exit(
    tmp_path: Path, command: list[str], *, disabled: bool = False
) -> tuple[bool, int]:
    """Run `command` (which loads the CLI) with a sitecustomize that reports the collector
    at exit, having turned it off first if `disabled`: (enabled, objects frozen)."""
    (tmp_path / "sitecustomize.py").write_text(_COLLECTOR_REPORT)
    env = {k: v for k, v in os.environ.items() if k != "PROBE_NO_COLLECTOR"}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), *sys.path])
    if disabled:
        env["PROBE_NO_COLLECTOR"] = "1"
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 0, done.stderr
    enabled, frozen, loaded = done.stderr.rsplit("COLLECTOR ", 1)[1].split()
    assert loaded == "True"
    return enabled == "True", int(frozen)


@pytest.mark.parametrize(
    "command",
    [
        [SLATES, "--help"],  # the console script
        [sys.executable, "-m", "slates_cli.main", "--help"],  # as spawn_anchor starts it
        [sys.executable, "-X", "importtime", "-m", "slates_cli.main", "volume", "--help"],
    ],
)
def test_a_slates_process_collects_again_after_its_imports(
    tmp_path: Path, command: list[str]
) -> None:
    # The collector was paused for the imports (slates_cli) and resumed by main: enabled,
    # with the modules' objects frozen.
    enabled, frozen = _collector_at_exit(tmp_path, command)
    assert enabled and frozen > 1000
    # One that was off before the command started stays off, and nothing is frozen.
    assert _collector_at_exit(tmp_path, command, disabled=True) == (False, 0)


def test_importing_the_cli_leaves_a_programs_collector_alone(tmp_path: Path) -> None:
    program = "import slates_cli.main, slates_cli.commands, gc; gc.collect()"
    assert _collector_at_exit(tmp_path, [sys.executable, "-c", program]) == (True, 0)


@pytest.mark.parametrize(
    ("argv", "orig_argv", "command"),
    [
        (["/usr/bin/slates", "mount"], ["/usr/bin/python3", "/usr/bin/slates", "mount"], True),
        (["slates"], ["python", "slates"], True),
        (["-m", "x"], ["python", "-m", "slates_cli.main", "x"], True),
        (["-m"], ["python", "-X", "importtime", "-W", "error", "-m", "slates_cli.main"], True),
        (["-m"], ["python", "-Ximporttime", "-I", "-m", "slates_cli.main"], True),
        (["-m"], ["python", "-m", "slates_cli.demo"], False),
        (["-m"], ["python", "-m", "pytest", "-m", "slates_cli.main"], False),
        (["-c"], ["python", "-c", "import slates_cli", "-m", "slates_cli.main"], False),
        (["run.py"], ["python", "run.py", "-m", "slates_cli.main"], False),
        (["/x/pytest"], ["python", "/x/pytest", "tests/test_cli_startup.py"], False),
        (["/x/slates-bridge"], ["python", "/x/slates-bridge"], False),
        ([], [], False),
    ],
)
def test_which_processes_are_the_command(
    argv: list[str], orig_argv: list[str], command: bool
) -> None:
    assert is_the_command(argv, orig_argv) is command


def test_the_probe_sees_what_a_command_loads(tmp_path: Path) -> None:
    # The demo needs no service and runs the core: the probe reports it.
    done, probe = _run(tmp_path, "demo", "--json")
    assert done.returncode == 0, done.stderr
    assert "slates.core" in probe.loaded
    with pytest.raises(AssertionError):
        _check_help(probe)


def test_the_cli_restates_the_cores_unlimited() -> None:
    # format_quota compares with its own copy (importing slates.core for it cost ~40 ms).
    assert commands.UNLIMITED == UNLIMITED
    assert commands.format_quota({"bounded": False, "limit": UNLIMITED}) == "dynamic"
    assert commands.format_quota({"bounded": False, "limit": 1 << 30}) == "dynamic, max 1.00 GiB"


def test_requests_run_without_trio_and_still_work(service: Service, tmp_path: Path) -> None:
    runtime = ("--runtime-dir", str(service.runtime))
    every_shard = Counter({"shard-0.sock": 1, "shard-1.sock": 1})
    anchor = Counter({"anchor.sock": 1})

    done, probe = _run(tmp_path, "status", "--json", *runtime)
    report = _ok(done)
    assert [shard["shard"] for shard in report["shards"]] == [0, 1]
    _check_request(probe, tables=False)
    assert "blake3" not in probe.loaded
    assert probe.connections() == every_shard

    done, probe = _run(tmp_path, "volume", "create", "quick", "--json", *runtime)
    created = _ok(done)
    assert created["name"] == "quick"
    _check_request(probe, tables=False)
    assert "blake3" in probe.loaded  # a new volume's shard is its name's hash
    assert probe.connections() == every_shard  # the name check, then the create

    # The product's form: mount by the id create printed; the anchor alone is asked.
    directory = tmp_path / "mnt"
    directory.mkdir()
    done, probe = _run(tmp_path, "mount", created["id"], str(directory), "--json", *runtime)
    mounted = _ok(done)
    try:
        assert mounted["volume"] == created["id"]
        _check_request(probe, tables=False)
        assert probe.connections() == anchor
        (directory / "hello").write_bytes(b"through the mount")
        done, probe = _run(tmp_path, "volume", "list", "--json", *runtime)
        listed = _ok(done)
        assert [(v["name"], v["mounted_at"]) for v in listed] == [("quick", str(directory))]
        _check_request(probe, tables=False)
        assert "blake3" not in probe.loaded
        assert probe.connections() == every_shard  # mounts: the anchor's state file
    finally:
        done, probe = _run(tmp_path, "unmount", str(directory), *runtime)
    _ok(done)
    _check_request(probe, tables=False)
    assert probe.connections() == anchor

    # By name, the volume is looked up on every shard once, then the anchor mounts it.
    done, probe = _run(tmp_path, "mount", "quick", str(directory), *runtime)
    try:
        _ok(done)
        assert created["id"] in done.stdout and str(directory) in done.stdout
        _check_request(probe, tables=False)
        assert probe.connections() == every_shard + anchor
    finally:
        done, _ = _run(tmp_path, "unmount", str(directory), *runtime)
    _ok(done)
    done, _ = _run(tmp_path, "read", "quick", "/hello", *runtime)
    assert _ok(done) is None and done.stdout == "through the mount"

    # Tables for people load rich, and still no trio, no core (the quota), no anchor.
    done, probe = _run(tmp_path, "status", *runtime)
    _ok(done)
    assert "Shards" in done.stdout and created["id"] in done.stdout
    _check_request(probe, tables=True)
    assert probe.connections() == every_shard
    done, probe = _run(tmp_path, "volume", "list", *runtime)
    _ok(done)
    assert created["id"] in done.stdout and "dynamic" in done.stdout
    _check_request(probe, tables=True)
    assert probe.connections() == every_shard
    base = tmp_path / "project"
    base.mkdir()
    # One volume's facts are no table: plain lines, without rich.
    done, probe = _run(tmp_path, "volume", "create", "facts", "--base", str(base), *runtime)
    _ok(done)
    made = next(line for line in done.stdout.splitlines() if line.startswith("Created volume"))
    lines = done.stdout.splitlines()
    assert lines[0] == made and lines[2].split() == ["name", "facts"] and "dynamic" in lines[5]
    _check_request(probe, tables=False)
    assert probe.connections() == every_shard
    done, probe = _run(tmp_path, "volume", "show", "facts", *runtime)
    assert _ok(done) is None and done.stdout.splitlines()[1:] == lines[1:]
    _check_request(probe, tables=False)


def test_create_and_mount_in_one_command(service: Service, tmp_path: Path) -> None:
    runtime = ("--runtime-dir", str(service.runtime))
    base = tmp_path / "project"
    base.mkdir()
    (base / "a.txt").write_bytes(b"from the base\n")
    directory = tmp_path / "mnt"
    directory.mkdir()
    done, probe = _run(
        tmp_path, "volume", "create", "both", "--base", str(base), "--mount", str(directory),
        "--json", *runtime,
    )  # fmt: skip
    created = _ok(done)
    try:
        assert created["name"] == "both" and created["base"] == str(base)
        assert created["mount"]["volume"] == created["id"]
        assert created["mount"]["directory"] == str(directory)
        assert (directory / "a.txt").read_bytes() == b"from the base\n"
        _check_request(probe, tables=False)
        assert probe.connections() == Counter(
            {"shard-0.sock": 1, "shard-1.sock": 1, "anchor.sock": 1}
        )
        with Client(service.runtime) as client:
            assert [(m["volume"], m["directory"]) for m in client.mounts()] == [
                (created["id"], str(directory))
            ]
    finally:
        done, _ = _run(tmp_path, "unmount", str(directory), *runtime)
    _ok(done)


def test_the_blocking_client_with_rings_needs_no_trio(service: Service, tmp_path: Path) -> None:
    # Rings (the SDK's default), and a 3 MiB message, too large for a ring: it and its
    # reply travel on the socket while the client waits on the reply ring.
    script = f"""
import os, sys
from slates import Client
big = os.urandom(3 << 20)
with Client({str(service.runtime)!r}) as client:
    vid = client.create_volume("rings")["id"]
    client.write(vid, "/small", b"over the ring")
    assert client.read(vid, "/small") == b"over the ring"
    assert client.write(vid, "/big", big) == len(big)
    assert client.read(vid, "/big") == big
print(sorted(m for m in ("trio", "slates.sdk.connection", "slates.node.ring") if m in sys.modules))
"""
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["['slates.node.ring']"]


def test_a_blocking_call_that_would_wait_on_an_event_loop_is_refused() -> None:
    @types.coroutine
    def suspends() -> Generator[None, None, None]:
        yield  # what an await on trio does when it must wait

    async def waits() -> int:
        await suspends()
        return 1

    async def finishes() -> int:
        return 2

    assert _run_to_end(finishes()) == 2
    with pytest.raises(VerificationFailed):
        _run_to_end(waits())


@given(st.lists(st.booleans(), min_size=1, max_size=30))
def test_both_transports_share_one_request_identity(failures: list[bool]) -> None:
    # The blocking and the trio transport both take sequence numbers, acks and reply
    # checks from ShardSession: a reply to another request is refused, and an error
    # reply (True) is raised as its named error and still counts as answered.
    session = ShardSession("client-1", rings=False)
    answered = 0
    for seq, fails in enumerate(failures, 1):
        outgoing = session.start("status", {"n": seq})
        message = unpack(outgoing.message)
        assert (message["seq"], message["ack"], message["args"]) == (seq, answered, {"n": seq})
        with pytest.raises(VerificationFailed):
            session.finish(outgoing, pack(ok_reply(seq + 1, None)))
        if fails:
            with pytest.raises(NotFound):
                session.finish(outgoing, pack(error_reply(seq, NotFound("gone"))))
        else:
            assert session.finish(outgoing, pack(ok_reply(seq, {"n": seq}))) == {"n": seq}
        answered = seq


@given(st.lists(st.floats(0, 1.0), min_size=1, max_size=200))
def test_reconnecting_is_bounded(gaps: list[float]) -> None:
    reconnect = Reconnect(100.0, "/run/slates/shard-0.sock")
    now = 100.0
    for gap in gaps:
        if now > 100.0 + RECONNECT_SECONDS:
            with pytest.raises(SlatesError, match="did not answer"):
                reconnect.after_failure(now)
            return
        delay = reconnect.after_failure(now)
        assert 0 < delay <= RETRY_MOST
        now += delay + gap


def test_a_hello_answer_without_the_ring_pair_is_refused_and_closes_what_came() -> None:
    session = ShardSession("client-1", rings=True, token="slates-alice-x")
    assert unpack(session.hello()[4:]) == {
        "client": "client-1",
        "rings": True,
        "token": "slates-alice-x",
    }
    read_end, write_end = os.pipe()
    with pytest.raises(VerificationFailed):
        session.accept_hello(pack({"ok": True}), [read_end])
    with pytest.raises(OSError):
        os.close(read_end)  # closed by the refusal: nothing leaks
    os.close(write_end)


def _pipelining_shard(
    listener: socket.socket, answer: dict[str, Any], seen: list[int], wait: float
) -> None:
    """One connection: wait (at most `wait` s) for the hello and the request *before*
    answering anything, note how many frames came, then answer the hello with `answer`
    and, if it is ok, the request (read now if it had not come) with "pong"."""
    conn, _ = listener.accept()
    listener.close()  # a client that reconnects finds nobody, and fails within its bound
    with conn:
        conn.settimeout(wait)
        reader = FrameReader()
        frames: list[bytes] = []
        with contextlib.suppress(TimeoutError):
            while len(frames) < 2:
                data = conn.recv(1 << 16)
                if not data:
                    break
                reader.feed(data)
                while (payload := reader.next_frame()) is not None:
                    frames.append(payload)
        seen.append(len(frames))
        conn.sendall(frame(pack(answer)))
        conn.settimeout(5.0)
        while answer.get("ok") and len(frames) < 2 and (data := conn.recv(1 << 16)):
            reader.feed(data)
            while (payload := reader.next_frame()) is not None:
                frames.append(payload)
        if answer.get("ok") and len(frames) == 2:
            request = unpack(frames[1])
            conn.sendall(frame(pack(ok_reply(request["seq"], ["pong", request["op"]]))))


@pytest.mark.parametrize(("refused", "size"), [(False, 10), (True, 10), (False, 100 << 10)])
def test_the_first_request_rides_with_the_hello(tmp_path: Path, refused: bool, size: int) -> None:
    """...when small: a large one (a file's piece) waits for the hello's answer, as the
    shard reads a hello's stream with a small frame limit."""
    large = size > ALONG_MOST
    path = str(tmp_path / "shard.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(1)
    answer = error_reply(0, NotFound("no such agent")) if refused else {"ok": True}
    seen: list[int] = []
    wait = 0.5 if large else 5.0  # a large request does not come before the answer
    server = threading.Thread(target=_pipelining_shard, args=(listener, answer, seen, wait))
    server.start()
    connection = BlockingShardConnection(path, ShardSession("client-1", rings=False))
    try:
        if refused:
            with pytest.raises(NotFound, match="no such agent"):
                connection.request("ping", {"data": b"x" * size})
        else:
            assert connection.request("ping", {"data": b"x" * size}) == ["pong", "ping"]
    finally:
        connection.close()
        server.join(10)
        listener.close()
    assert seen == [1 if large else 2]  # what came before any answer


def _shard_not_answering_goodbyes(
    listener: socket.socket, ends: list[str], patience: float
) -> None:
    """Answer the hello and one request; on the goodbye, answer nothing until the
    client's end comes (within `patience` s): "closed" then, "awaited" if the client
    waited for an answer instead."""
    conn, _ = listener.accept()
    listener.close()
    with conn:
        conn.settimeout(patience)
        reader = FrameReader()
        answered = 0
        frames: list[dict[str, Any]] = []
        while data := conn.recv(1 << 16):
            reader.feed(data)
            while (payload := reader.next_frame()) is not None:
                frames.append(unpack(payload))
            for message in frames[answered:]:
                if "client" in message:
                    conn.sendall(frame(pack({"ok": True})))
                elif message["op"] == "bye":
                    try:
                        ends.append("closed" if not conn.recv(1 << 16) else "more")
                    except TimeoutError:
                        ends.append("awaited")
                    return
                else:
                    conn.sendall(frame(pack(ok_reply(message["seq"], "pong"))))
            answered = len(frames)


def test_closing_says_goodbye_to_every_shard_and_awaits_no_answer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A client that awaited the answers would wait up to BYE_SECONDS, far past the shards'
    # patience; one that does not closes each connection after its goodbye.
    monkeypatch.setattr("slates.sdk.blocking.BYE_SECONDS", 60.0)
    paths = [str(tmp_path / f"shard-{i}.sock") for i in range(2)]
    ends: list[str] = []
    servers = []
    for path in paths:
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(path)
        listener.listen(1)
        server = threading.Thread(target=_shard_not_answering_goodbyes, args=(listener, ends, 20.0))
        server.start()
        servers.append(server)
    transport = BlockingTransport("client-1", rings=False, token=None)
    transport.open(paths)
    try:
        assert [_run_to_end(transport.request(i, "ping", {})) for i in (0, 1)] == ["pong"] * 2
    finally:
        _run_to_end(transport.close())
        for server in servers:
            server.join(30)
    assert ends == ["closed", "closed"]
    assert all(shard.sock is None for shard in transport.shards)


def test_a_goodbye_not_awaited_still_ends_the_client_at_the_shard(service: Service) -> None:
    # An agent may hold MAX_AGENT_CLIENTS client ids with saved replies per shard.  Clients
    # that leave without a goodbye use them up (the check is not blind); clients that say
    # goodbye and close without its answer never do: the shard read each goodbye.
    token = _add_agent(service, "many")
    for _ in range(MAX_AGENT_CLIENTS + 8):
        with Client(service.runtime, rings=False, token=token) as client:
            client.call(0, "status")
    shard = str(service.runtime / "shard-0.sock")
    gone = 0
    with pytest.raises(CapacityExhausted, match="too many client ids"):
        while gone <= MAX_AGENT_CLIENTS:
            connection = BlockingShardConnection(
                shard, ShardSession(f"gone-{gone}", rings=False, token=token)
            )
            try:
                connection.request("status", {})
            finally:
                connection.close()  # gone without a goodbye
            gone += 1
    assert gone == MAX_AGENT_CLIENTS


def _shard_answering_once_both_asked(
    listener: socket.socket, index: int, together: threading.Barrier, waits: list[str]
) -> None:
    """One connection: the hello answered at once; each request answered only once the
    other shard has its request too (the barrier breaks if the client awaited us first):
    NotFound for "missing" on shard 0, else [index, op, seq]."""
    conn, _ = listener.accept()
    listener.close()
    with conn:
        conn.settimeout(20.0)
        reader = FrameReader()
        with contextlib.suppress(OSError):
            while data := conn.recv(1 << 16):
                reader.feed(data)
                while (payload := reader.next_frame()) is not None:
                    message = unpack(payload)
                    if "client" in message:
                        conn.sendall(frame(pack({"ok": True})))
                        continue
                    if message["op"] == "bye":
                        continue
                    try:
                        together.wait(5.0)
                        waits.append("together")
                    except threading.BrokenBarrierError:
                        waits.append("alone")
                    seq = message["seq"]
                    if message["op"] == "missing" and index == 0:
                        reply = error_reply(seq, NotFound("not here", shard=index))
                    else:
                        reply = ok_reply(seq, [index, message["op"], seq])
                    conn.sendall(frame(pack(reply)))


def test_one_request_to_several_shards_is_sent_to_all_before_any_reply(tmp_path: Path) -> None:
    together = threading.Barrier(2)
    waits: list[str] = []
    servers = []
    paths = [str(tmp_path / f"shard-{i}.sock") for i in range(2)]
    for index, path in enumerate(paths):
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(path)
        listener.listen(1)
        server = threading.Thread(
            target=_shard_answering_once_both_asked, args=(listener, index, together, waits)
        )
        server.start()
        servers.append(server)
    transport = BlockingTransport("client-1", rings=False, token=None)
    transport.open(paths)
    try:
        # Both connect with the request in the hello's send, then both replies are read.
        assert _run_to_end(transport.request_each([0, 1], "list", {})) == [
            [0, "list", 1],
            [1, "list", 1],
        ]
        # A refusal is raised once both replies are in: none is left for the next request.
        with pytest.raises(NotFound, match="not here"):
            _run_to_end(transport.request_each([0, 1], "missing", {}))
        assert _run_to_end(transport.request_each([1, 0], "list", {})) == [
            [1, "list", 3],
            [0, "list", 3],
        ]
    finally:
        _run_to_end(transport.close())
        for server in servers:
            server.join(30)
    assert waits == ["together"] * 6


def _add_agent(service: Service, name: str) -> str:
    done = subprocess.run(
        [SLATES, "agent", "add", name, "--runtime-dir", str(service.runtime)],
        capture_output=True,
        text=True,
        check=True,
    )
    return done.stdout.strip()


def test_mount_flags_and_the_agents_token(service: Service, tmp_path: Path) -> None:
    runtime = ("--runtime-dir", str(service.runtime))
    alice, bob = _add_agent(service, "alice"), _add_agent(service, "bob")
    with Client(service.runtime) as operator:
        green = operator.create_green("main")
    with Client(service.runtime, token=alice) as as_alice:
        work = as_alice.create_work(green, "alice-work")["id"]
    directory = tmp_path / "alice"
    directory.mkdir()

    done, _ = _run(
        tmp_path, "mount", "alice-work", str(directory), "--allow-other", *runtime, token=alice
    )
    assert _ok(done) is None and work in done.stdout
    try:
        assert "allow_other" in _mount_options(directory)
        # The mount is Alice's: Bob may not take it down, Alice may.
        done, _ = _run(tmp_path, "unmount", str(directory), *runtime, token=bob)
        assert done.returncode == 2 and "AccessDenied" in done.stderr, done.stderr
    finally:
        done, _ = _run(tmp_path, "unmount", str(directory), *runtime, token=alice)
    _ok(done)

    # Without the flag, the kernel keeps the mount to its owner.
    done, _ = _run(tmp_path, "mount", work, str(directory), *runtime, token=alice)
    _ok(done)
    try:
        assert "allow_other" not in _mount_options(directory)
    finally:
        done, _ = _run(tmp_path, "unmount", str(directory), *runtime, token=alice)
    _ok(done)


def test_anchor_takes_an_agent_group(tmp_path: Path) -> None:
    runtime = tmp_path / "run"
    group = os.getgid()
    anchor = spawn_anchor(runtime, shards=1, capacity="64MiB", agent_group=str(group))
    try:
        st = runtime.stat()
        assert (st.st_gid, st.st_mode & 0o777) == (group, 0o750)  # the group reaches it
        state = (runtime / "anchor.json").stat()  # and reads the state file, 0640
        assert (state.st_gid, state.st_mode & 0o777) == (group, 0o640)
        done, _ = _run(tmp_path, "status", "--json", "--runtime-dir", str(runtime))
        assert len(_ok(done)["shards"]) == 1
    finally:
        stop_process(anchor)


def test_the_state_file_is_replaced_whole_and_private(tmp_path: Path) -> None:
    """Runtime.write_state (through the descriptor: a mount waits for it) writes what
    read_state reads back, replaces the last state whole (no temporary file left), and
    leaves the file 0640 whatever the umask, in the agent group when there is one."""
    runtime = Runtime(tmp_path)
    shard = ShardInfo(0, os.getpid(), str(tmp_path / "shard-0.sock"), 2, "serving")
    first = AnchorState(os.getpid(), (shard,), 8 << 30)
    second = first._replace(mounts=(MountInfo("/m/\u00e9", "vol-0-1", 7, "serving"),))
    old_umask = os.umask(0o077)
    try:
        runtime.write_state(first)
        assert runtime.read_state() == first
        runtime.agent_group = os.getgid()
        runtime.write_state(second)
    finally:
        os.umask(old_umask)
    assert runtime.read_state() == second
    assert sorted(p.name for p in tmp_path.iterdir()) == ["anchor.json"]
    st = (tmp_path / "anchor.json").stat()
    assert (st.st_mode & 0o777, st.st_gid) == (0o640, os.getgid())
    assert json.loads((tmp_path / "anchor.json").read_bytes()) == second.to_json()


def test_the_mount_bridge_loads_no_core_merge_or_trio() -> None:
    """Every mount starts a bridge process: it needs the ring, the wire and the base's
    beneath-walk, not the pure core, the merge engine or trio (issue 14: its start was
    most of a mount's 110-140 ms)."""
    probe = (
        "import sys, slates.fuse.bridge; "
        "print(' '.join(m for m in ('slates.core', 'slates.merge', 'slates.base.capturing', "
        "'slates.base.live', 'trio', 'pygit2', 'slates.base.beneath') if m in sys.modules))"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True
    )
    assert done.stdout.split() == ["slates.base.beneath"]


BRIDGE_NEEDS = ("slates._native", "slates.node.protocol", "socket", "msgpack", "argparse")
"""What a bridge cannot start without (so the probe below is not blind)."""
NEVER_FOR_THE_BRIDGE = (
    "trio",
    "pygit2",
    "slates.core",
    "slates.merge",
    "slates.sdk",
    "slates_cli",
    "click",
    "rich",
    "uuid",
    "statistics",
    "subprocess",
    "asyncio",
    "logging",
    "tempfile",
    "hashlib",
    "concurrent",
)
"""What a bridge's start must not load (issue 14: its start is most of a mount): the
heavy packages, and stdlib modules it once loaded for one call (uuid for a client id,
statistics for a median)."""

_BRIDGE_PROBE = """
import json, runpy, sys
sys.argv = ["slates-bridge", "--volume", "vol-0-1", "--mountpoint", sys.argv[1]]
try:
    runpy.run_module("slates.fuse.bridge", run_name="__main__", alter_sys=True)
except SystemExit as done:
    code = done.code
print(json.dumps({"code": code, "loaded": sorted(sys.modules)}))
"""


def test_the_bridge_starts_lean(tmp_path: Path) -> None:
    """The bridge as the anchor runs it (`-m slates.fuse.bridge`), up to its first check
    (a mountpoint that does not exist): it loads what it needs and nothing of the rest."""
    missing = tmp_path / "missing"
    done = subprocess.run(
        [sys.executable, "-c", _BRIDGE_PROBE, str(missing)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    seen = json.loads(done.stdout)
    assert seen["code"] == 1 and "mountpoint does not exist" in done.stderr, done.stderr
    probe = Probe(frozenset(seen["loaded"]), ())
    assert all(probe.of(module) for module in BRIDGE_NEEDS), sorted(probe.loaded)
    assert not probe.any_of(NEVER_FOR_THE_BRIDGE), sorted(probe.any_of(NEVER_FOR_THE_BRIDGE))
