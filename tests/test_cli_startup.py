"""The `slates` command starts without loading what only some commands need.

Theory of operation: the CLI imports click and its own command modules at
start; rich, trio, the SDK, msgpack, pygit2 and the core load inside the
commands that use them (cli/main.py, cli/commands.py, cli/land.py), so
`slates --help` and usage errors answer in the time Python and click take.
Each test runs the CLI in a fresh interpreter (a module, once imported,
stays imported) and asks that interpreter which heavy modules it loaded.
No timing is asserted: `hyperfine -N 'slates --help'` measures it
(bench/RESULTS.md).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

HEAVY = (
    "trio",
    "rich",
    "msgpack",
    "pygit2",
    "blake3",
    "slates.sdk",
    "slates.core",
    "slates.node.service",
    "slates.base",
)

_PROBE = """
import json, sys
from slates_cli.main import main
try:
    main(args=sys.argv[1:], prog_name="slates", standalone_mode=False)
except SystemExit:
    pass
heavy = [name for name in {heavy!r} if name in sys.modules]
print("\\n" + json.dumps(heavy))
"""


def _heavy_loaded(*args: str) -> list[str]:
    probe = _PROBE.format(heavy=HEAVY)
    out = subprocess.run(
        [sys.executable, "-c", probe, *args], capture_output=True, text=True, check=True, timeout=60
    ).stdout
    loaded: list[str] = json.loads(out.rstrip().rsplit("\n", 1)[-1])
    return loaded


@pytest.mark.parametrize(
    "args",
    [
        ("--help",),
        ("status", "--help"),
        ("volume", "create", "--help"),
        ("land", "--help"),
        ("submit", "--help"),
    ],
)
def test_help_loads_no_heavy_module(args: tuple[str, ...]) -> None:
    assert _heavy_loaded(*args) == []


def test_a_command_loads_what_it_needs() -> None:
    # The probe is not blind: a command that does its work loads what it
    # needs (the demo, which needs no service, runs the core).
    loaded = _heavy_loaded("demo", "--json")
    assert "slates.core" in loaded
