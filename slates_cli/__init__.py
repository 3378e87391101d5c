"""slates_cli: the `slates` command-line front end.

Theory of operation: this package is thin on purpose.  `slates_cli.main`
parses arguments with click, calls a library function that returns plain
data, and prints that data (rich tables for people, JSON with `--json` for
programs).  Errors arrive as slates.errors.SlatesError and leave as
`error: <code>: <message>` on stderr with exit code 2 when the caller is at
fault and 1 otherwise.  Library-side work that is not yet in the SDK lives
beside the command that needs it (`slates_cli.demo`).

Start-up (issue 14): this package runs before anything else of a `slates`
process (the console script imports slates_cli.main, `python -m
slates_cli.main` imports this package first), so it is where the cyclic
garbage collector is paused for the start-up: importing click, typing and
the CLI's modules builds tens of thousands of objects that live as long as
the process, and the collector scanned them over and over while they were
made (about 30 collections, 3-5 ms of a command's start on the host
measured).  `slates_cli.main`, once imported, calls `resume_collector`:
what exists then is frozen (gc.freeze: never scanned again; it is the
modules' own objects, kept until exit anyway) and the collector runs as
before for everything the command does.  Only a process that is the
`slates` command pauses it (`is_the_command`); a program or a test that
imports the CLI's modules keeps its collector as it was.
"""

from __future__ import annotations

import gc
import os
import sys

__all__ = ["is_the_command", "resume_collector"]

COMMAND_NAME = "slates"
"""The console script's name (pyproject's [project.scripts])."""
COMMAND_MODULE = "slates_cli.main"
"""The module `python -m` runs as the command."""
_TAKES_A_VALUE = frozenset({"-X", "-W", "--check-hash-based-pycs"})
"""The interpreter's options (before -m) whose value is the next argument."""


def is_the_command(argv: list[str], orig_argv: list[str]) -> bool:
    """Whether a process with these `sys.argv` and `sys.orig_argv` is the `slates`
    command: the console script (argv[0] names it), or `python [options] -m
    slates_cli.main` (the form slates.node.anchor.spawn_anchor uses)."""
    if argv and os.path.basename(argv[0]) == COMMAND_NAME:
        return True
    options = iter(orig_argv[1:])
    for option in options:
        if option == "-m":
            return next(options, None) == COMMAND_MODULE
        if option in _TAKES_A_VALUE:
            next(options, None)
        elif option == "-c" or not option.startswith("-"):
            return False  # a program of its own, or a script: not the command
    return False


_paused = False


def _pause_collector() -> None:
    global _paused
    if gc.isenabled() and is_the_command(sys.argv, sys.orig_argv):
        gc.disable()
        _paused = True


def resume_collector() -> None:
    """End the start-up's pause of the collector, if this process made one: freeze what
    exists now (the imported modules' objects) and collect again from here on."""
    global _paused
    if _paused:
        _paused = False
        gc.freeze()
        gc.enable()


_pause_collector()
