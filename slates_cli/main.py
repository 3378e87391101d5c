"""The `slates` command: parse arguments, call the library, print the result.

Theory of operation: `main` is a click group; each command calls one
library function that returns plain data and prints it, as rich tables for
people or as JSON (`--json`) for programs.  No command computes figures of
its own.  A slates.errors.SlatesError is printed as
`error: <code>: <message>` on stderr; the exit code is 2 when the caller is
at fault (`fault == "caller"`, e.g. InvalidArgument) and 1 otherwise.
click's own usage errors also exit with 2.  A submit or rebase refused
because of conflicts exits with 3 (slates_cli.commands.CONFLICT_EXIT).

Commands: `demo` (the README Quick start's walk through the core,
slates_cli.demo), `anchor` (start the service), and the daemon-backed
commands of DESIGN.md section 8 (status, volume, snapshot, clone, read,
write, ls, mount, unmount, green create, work create, submit, rebase,
versions, changed), which live in slates_cli.commands and attach to `main`
through its `register`.  `mcp` serves the MCP server of slates.mcp on
stdin/stdout.

Start-up: the commands of slates_cli.land (land, read-base, rewitness),
slates_cli.agents (agent) and slates_cli.fleet (fleet) load only when one
of them is named (LAZY_COMMANDS, through _LazyGroup), so every other
command skips importing and building them; the command list of `--help`
shows their summaries from LAZY_COMMANDS without loading them.  Help finds
its width as click does, without the shutil import click makes for it
(help_width).  A `slates` process (the console script, `python -m
slates_cli.main`: `main` called without arguments) ends at once when its
command is done: standard output and error flushed, then os._exit with the
command's exit code, skipping the interpreter's teardown of every module
(several ms).  It does so only when nothing could still need the teardown:
one thread, no atexit callbacks, and not a serving command (QUICK_EXIT_NEVER);
else, and whenever `main` is called with arguments (tests, CliRunner), it
exits as any Python program does.  The garbage collector, paused by the
package for the imports of a `slates` process, resumes once this module is
loaded (slates_cli.resume_collector).
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from typing import TYPE_CHECKING, Any, NoReturn

import click

from slates.errors import SlatesError

from . import resume_collector
from .commands import register, runtime_dir_option, terminal_columns

if TYPE_CHECKING:
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    from .demo import DemoResult

__all__ = [
    "main",
    "demo",
    "exit_code_for",
    "format_size",
    "format_units",
    "help_width",
    "print_demo",
]

KIB = 1024
MIB = 1024 * 1024

LAZY_COMMANDS: dict[str, tuple[str, str, str]] = {
    "agent": (
        "slates_cli.agents",
        "agent",
        "Agents' credentials: what an agent may do is less than the operator.",
    ),
    "fleet": (
        "slates_cli.fleet",
        "fleet",
        "Many hosts: the fleet's CA, enrolled hosts and their liveness.",
    ),
    "land": (
        "slates_cli.land",
        "land",
        "Land a green version or a work volume into a directory, with a human's approval.",
    ),
    "read-base": (
        "slates_cli.land",
        "read_base",
        "Print what MANIFEST's target directory holds at PATH now.",
    ),
    "rewitness": (
        "slates_cli.land",
        "rewitness",
        "Record what the disk holds now as MANIFEST's witness: a new manifest to approve.",
    ),
}
"""Commands loaded when named: their name, module, attribute, and the first paragraph of
their help (what `--help`'s command list shows; tests/test_cli_startup.py checks that it
is the command's own)."""
QUICK_EXIT_NEVER = frozenset({"anchor", "mcp", "demo"})
"""Commands that run services or start processes: they exit through the interpreter's
teardown, whatever they leave behind."""
HELP_MAX_WIDTH = 80
"""click's default widest help (HelpFormatter's max_width)."""


def help_width() -> int:
    """The width click gives help when nothing sets one: the terminal's columns
    (slates_cli.commands.terminal_columns, found as shutil finds them) at most
    HELP_MAX_WIDTH, less 2, and at least 50."""
    return max(min(terminal_columns(), HELP_MAX_WIDTH) - 2, 50)


class _LazyGroup(click.Group):
    """A group whose LAZY_COMMANDS are imported (and added) on first lookup; its
    command list, and so its help, is the same as with every command added up front.
    Called as the process's entry point it ends the process quickly (see the module
    docstring)."""

    _listing = False  # True while the command list of --help is being written
    resolved: str | None = None  # the subcommand this invocation runs, once known

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*self.commands, *LAZY_COMMANDS})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in self.commands and cmd_name in LAZY_COMMANDS:
            module, attribute, summary = LAZY_COMMANDS[cmd_name]
            if self._listing:  # the list shows the summary alone: nothing to load for it
                return click.Command(cmd_name, help=summary)
            import importlib

            command: click.Command = getattr(importlib.import_module(module), attribute)
            self.add_command(command, cmd_name)
        return super().get_command(ctx, cmd_name)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        self._listing = True
        try:
            super().format_commands(ctx, formatter)
        finally:
            self._listing = False

    def resolve_command(
        self, ctx: click.Context, args: list[str]
    ) -> tuple[str | None, click.Command | None, list[str]]:
        try:
            name, command, rest = super().resolve_command(ctx, args)
        except click.exceptions.NoSuchCommand:
            for lazy in LAZY_COMMANDS:  # "did you mean" chooses among every command
                self.get_command(ctx, lazy)
            name, command, rest = super().resolve_command(ctx, args)
        self.resolved = name
        return name, command, rest

    def make_context(
        self,
        info_name: str | None,
        args: list[str],
        parent: click.Context | None = None,
        **extra: Any,
    ) -> click.Context:
        # The width every help of this invocation inherits: click's own, found without
        # the shutil import (and its compression modules) click would make for it.
        if (
            parent is None
            and extra.get("terminal_width") is None
            and self.context_settings.get("terminal_width") is None
            and click.formatting.FORCED_WIDTH is None  # CliRunner's fixed width
        ):
            extra["terminal_width"] = help_width()
        return super().make_context(info_name, args, parent, **extra)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if args or kwargs.get("args") is not None or not kwargs.get("standalone_mode", True):
            return self.main(*args, **kwargs)
        self.resolved = None
        try:
            self.main(**kwargs)  # standalone: it always ends in SystemExit
        except SystemExit as done:
            if self.resolved in QUICK_EXIT_NEVER:
                raise
            _exit_now(done)
        raise SystemExit(0)  # pragma: no cover - main never returns in standalone mode


def _exit_now(done: SystemExit) -> NoReturn:
    """End the process as `raise done` would, without the interpreter's teardown, when
    nothing can need it (one thread, no atexit callbacks); else raise `done`."""
    if threading.active_count() != 1 or atexit._ncallbacks():
        raise done
    code = done.code
    try:
        if code is not None and not isinstance(code, int):
            print(code, file=sys.stderr)  # what SystemExit("message") prints
            code, done = 1, SystemExit(1)
        sys.stdout.flush()
        sys.stderr.flush()
    except (OSError, ValueError):  # a closed pipe, say: the usual exit reports it
        raise done from None
    os._exit(code or 0)


def exit_code_for(error: SlatesError) -> int:
    """2 for the caller's faults (bad input), 1 for the environment's or the system's."""
    return 2 if error.fault == "caller" else 1


def _fail(error: SlatesError) -> NoReturn:
    click.echo(f"error: {error.code}: {error.message}", err=True)
    raise SystemExit(exit_code_for(error))


def format_size(nbytes: int) -> str:
    """Exact bytes with thousands separators: "1,048,576 B"."""
    return f"{nbytes:,} B"


def format_units(nbytes: int) -> str:
    """Bytes in the largest binary unit they reach: "1.00 MiB", "4.0 KiB", "21 B"."""
    if abs(nbytes) >= MIB:
        return f"{nbytes / MIB:.2f} MiB"
    if abs(nbytes) >= KIB:
        return f"{nbytes / KIB:.1f} KiB"
    return f"{nbytes} B"


def _shown(text: str) -> Text:
    """A value as plain text (no rich markup), newlines shown as \\n."""
    from rich.text import Text

    return Text(text.replace("\n", "\\n"))


def _facts(title: str, rows: list[tuple[str, str | Text]]) -> Table:
    from rich.table import Table
    from rich.text import Text

    table = Table(title=title, title_justify="left", show_header=False)
    table.add_column("what", style="bold")
    table.add_column("observed", overflow="fold")
    for what, observed in rows:
        table.add_row(what, observed if isinstance(observed, Text) else Text(observed))
    return table


def _both(nbytes: int) -> str:
    return f"{format_size(nbytes)} ({format_units(nbytes)})"


def _yes(flag: bool) -> str:
    return "yes" if flag else "NO"


def print_demo(result: DemoResult, console: Console) -> None:
    from rich.table import Table

    sample = result["sample"]
    files = Table(title="1. Sample project", title_justify="left")
    files.add_column("path")
    files.add_column("bytes on disk", justify="right")
    for path, size in sample["files"].items():
        files.add_row(path, format_size(size))
    files.caption = f"written to {sample['path']}" + (
        "" if sample["kept"] else " (removed afterwards)"
    )
    console.print(files)

    overlay = result["overlay"]
    rename = overlay["rename"]
    unlink = overlay["unlink"]
    edit = f"replace [{overlay['edit_start']}, {overlay['edit_end']}) with {overlay['edit_data']}"
    console.print(
        _facts(
            "2. Volume over the live directory",
            [
                (
                    "creating the volume read",
                    f"{overlay['base_reads_at_create']} base reads, "
                    f"{format_size(overlay['base_bytes_read_at_create'])}",
                ),
                (f"{overlay['edit_path']}", edit),
                ("the volume reads", _shown(overlay["volume_reads"])),
                ("the disk still holds", _shown(overlay["disk_holds"])),
                (
                    "copy-on-write",
                    f"read {format_size(overlay['base_bytes_read_by_write'])} from the base, "
                    f"{format_size(overlay['unique_bytes_after_write'])} unique",
                ),
                (
                    f"rename {rename['old_path']} -> {rename['new_path']}",
                    f"inode {rename['inode']} keeps base path {rename['inode_base_path']} "
                    f"(redirect); content copied "
                    f"{format_size(rename['referenced_bytes_delta'])}, base bytes read "
                    f"{rename['base_bytes_read']}, metadata "
                    f"{format_size(rename['metadata_bytes_delta'])}",
                ),
                (f"{rename['new_path']} lists", ", ".join(rename["listing"])),
                (
                    f"{rename['new_path']}/decoder.rs matches the disk",
                    _yes(rename["decoder_matches_disk"]),
                ),
                (
                    f"unlink {unlink['path']}",
                    f"visible in the volume: {_yes(unlink['visible_in_volume'])}; "
                    f"still on disk: {_yes(unlink['on_disk'])}",
                ),
                ("root whiteouts", ", ".join(overlay["root_whiteouts"])),
                ("the volume's root lists", ", ".join(overlay["root_listing"])),
                ("the disk's root lists", ", ".join(overlay["disk_listing"])),
            ],
        )
    )

    clones = result["clones"]
    table = Table(
        title=f"3. Three clones of snapshot {clones['snapshot_id']}, "
        f"each changing 2 bytes of /assets/model.bin",
        title_justify="left",
    )
    table.add_column("volume")
    table.add_column("offset", justify="right")
    table.add_column("referenced B", justify="right")
    table.add_column("unique B", justify="right")
    table.add_column("host physical B", justify="right")
    for row in clones["clones"]:
        table.add_row(
            row["name"],
            f"{row['offset']:,}",
            f"{row['referenced_bytes']:,}",
            f"{row['unique_bytes']:,}",
            f"{row['host_physical_bytes']:,}",
        )
    snap = clones["snapshot_clone"]
    table.add_row(
        f"clone of {snap['snapshot_id']}",
        "",
        f"{snap['referenced_bytes']:,}",
        f"{snap['unique_bytes']:,}",
        f"{snap['host_physical_bytes']:,}",
    )
    console.print(table)
    console.print(
        _facts(
            "   Sharing",
            [
                ("host physical after capture", _both(clones["host_physical_after_capture"])),
                (
                    "after the three clone writes",
                    f"{_both(clones['host_physical_bytes'])}: chunks "
                    f"{format_units(clones['host_chunk_bytes'])} + private "
                    f"{format_units(clones['host_private_bytes'])}",
                ),
                ("three full copies would hold", _both(clones["full_copies_bytes"])),
                (
                    f"clone of {snap['snapshot_id']}",
                    f"sees {snap['source']}'s edit: {_yes(snap['sees_source_edit'])}; "
                    f"{snap['source']} unique after its snapshot: "
                    f"{format_size(snap['source_unique_after_snapshot'])}",
                ),
            ],
        )
    )

    bounded = clones["bounded"]
    console.print(
        _facts(
            "   Bounded clone (Capacity.reserved)",
            [
                ("quota", format_size(bounded["quota_bytes"])),
                (
                    f"write {bounded['small_write_bytes']} bytes",
                    f"accepted; charged {format_size(bounded['charged_after_small_write'])}",
                ),
                (
                    f"write {format_size(bounded['refused_write_bytes'])} "
                    f"at {bounded['refused_write_offset']:,}",
                    f"refused: {bounded['error_code'] or 'NOT REFUSED'}: "
                    f"{bounded['error_message']}",
                ),
                ("content unchanged after the refusal", _yes(bounded["content_unchanged"])),
                ("charged after the refusal", format_size(bounded["charged_after_refusal"])),
            ],
        )
    )

    seals = Table(title="4. Seal (BLAKE3 chunks)", title_justify="left")
    seals.add_column("volume")
    for column in ("files", "chunks new", "shared", "sealed B", "host B before", "after"):
        seals.add_column(column, justify="right")
    for seal in result["seal"]:
        seals.add_row(
            seal["volume"],
            str(seal["files"]),
            str(seal["chunks_new"]),
            str(seal["chunks_shared"]),
            f"{seal['bytes_sealed']:,}",
            f"{seal['host_physical_before']:,}",
            f"{seal['host_physical_after']:,}",
        )
    twins = [
        f"{s['volume']} is a new clone making {s['same_edit_as']}'s exact edit"
        for s in result["seal"]
        if s["same_edit_as"]
    ]
    if twins:
        seals.caption = "; ".join(twins)
    console.print(seals)


@click.group(cls=_LazyGroup)
def main() -> None:
    """Slates: private, in-RAM, copy-on-write workspaces over a shared starting point."""


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Print every figure as JSON.")
@click.option(
    "--keep",
    metavar="DIR",
    default=None,
    help="Write the sample project to DIR (absent or empty) and leave it there.",
)
@click.option(
    "--workspace",
    is_flag=True,
    help="Run a real service and mount: an agent's workspace over a sample project.",
)
def demo(as_json: bool, keep: str | None, workspace: bool) -> None:
    """Walk through volumes, clones, capacity and sealing on a generated sample project."""
    import json

    from rich.console import Console

    from .demo import run_demo

    try:
        if workspace:
            from .workspace_demo import run_workspace_demo

            observed = run_workspace_demo()
            if as_json:
                click.echo(json.dumps(observed, indent=2))
            else:
                print_workspace_demo(observed, Console())
            return
        result = run_demo(keep)
    except SlatesError as error:
        _fail(error)
    if as_json:
        click.echo(json.dumps(result, indent=2))
    else:
        print_demo(result, Console())


def print_workspace_demo(observed: dict[str, Any], console: Console) -> None:
    counters = observed["counters"]
    rows: list[tuple[str, str | Text]] = [
        ("project (captured as green v0)", observed["project"]),
        ("agent-1's work volume", f"{observed['volume']} mounted at {observed['mountpoint']}"),
        ("ls in the mount", ", ".join(observed["listing"])),
        ("image.conf in the mount", _shown(observed["image_conf_in_mount"])),
        ("image.conf on disk", _shown(observed["image_conf_on_disk"])),
        ("git log in the mount", observed["git_log"]),
        ("make && ./app in the mount", observed["program_output"]),
        ("snapshot, then clone", f"{observed['snapshot']} -> {observed['clone']}"),
        ("the clone reads", _shown(observed["clone_reads"])),
        (
            "volume counters",
            f"referenced {format_units(counters['referenced_bytes'])}, "
            f"unique {format_units(counters['unique_bytes'])}",
        ),
        ("project directory unchanged", _yes(observed["project_unchanged"])),
    ]
    console.print(_facts("An agent's workspace, mounted", rows))
    merge_rows: list[tuple[str, str | Text]] = [("green volume", observed["green"])]
    for name, outcome in observed["submits"].items():
        if outcome["ok"]:
            private = outcome["private"]
            kept = f"; {private} private paths (.git/, app) kept in the work volume"
            merge_rows.append(
                (
                    f"submit {name}",
                    f"accepted as version {outcome['version']}{kept if private else ''}",
                )
            )
            continue
        for conflict in outcome["conflicts"]:
            merge_rows.append(
                (
                    f"submit {name}",
                    f"conflict ({conflict['kind']}) at {conflict['path']} "
                    f"[{conflict['base'][0]}, {conflict['base'][1]}): "
                    f"base {conflict['base_bytes']!r}, accepted {conflict['accepted']!r}, "
                    f"proposed {conflict['proposed']!r}; nothing changed",
                )
            )
    merge_rows += [
        ("head version", str(observed["head"])),
        ("image.conf at the head", _shown(observed["head_image_conf"])),
        ("changed since version 0", ", ".join(observed["changed"])),
    ]
    console.print(_facts("Three agents submit to the green volume", merge_rows))


@main.command()
@runtime_dir_option
@click.option(
    "--shards",
    type=click.IntRange(1, 256),
    default=None,
    help="Daemon shard processes (default: the number of cores).",
)
@click.option(
    "--capacity", default="8GiB", show_default=True, help="Host memory Slates may use, e.g. 4GiB."
)
@click.option("--daemon", is_flag=True, help="Detach once serving (logs go to anchor.log).")
@click.option(
    "--allow-root",
    "allow_roots",
    metavar="DIR",
    multiple=True,
    help="Agents (slates agent add) may name bases and landing targets under DIR (repeatable).",
)
@click.option(
    "--agent-group",
    metavar="GROUP",
    default=None,
    help="A group (name or number) whose members, the agents' users, may reach the service.",
)
@click.option(
    "--fleet",
    metavar="CONFIG",
    type=click.Path(dir_okay=False, exists=True),
    default=None,
    help="Join a fleet of hosts (a JSON host configuration: see `slates fleet`).",
)
def anchor(
    runtime_dir: str | None,
    shards: int | None,
    capacity: str,
    daemon: bool,
    allow_roots: tuple[str, ...],
    agent_group: str | None,
    fleet: str | None,
) -> None:
    """Start the service: shared memory, shards, supervision.

    A previous anchor that died here is reported (what it lost) and its
    stale mounts cleaned up."""
    from slates.node.anchor import parse_size, run_anchor
    from slates.node.runtime import Runtime

    try:
        code = run_anchor(
            Runtime(runtime_dir),
            shards or os.cpu_count() or 1,
            parse_size(capacity),
            daemon=daemon,
            allow_roots=allow_roots,
            agent_group=agent_group,
            fleet=fleet,
        )
    except SlatesError as exc:
        _fail(exc)
    raise SystemExit(code)


@main.command("mcp")
@runtime_dir_option
@click.option(
    "--token-file",
    type=click.Path(dir_okay=False, exists=True),
    default=None,
    help="An agent's credential (slates agent add): every tool acts as that agent.",
)
def mcp_server(runtime_dir: str | None, token_file: str | None) -> None:
    """Serve Slates to an agent over the Model Context Protocol on stdin/stdout.

    Work volumes, files, submit, rebase, versions, landing plans and read_base;
    nothing that lands a plan on disk.  With --token-file the session has that
    agent's rights only (else $SLATES_TOKEN's, else the operator's).
    """
    from slates.mcp import run_stdio

    token = None
    if token_file is not None:
        with open(token_file) as credential:
            token = credential.read().strip() or None
    run_stdio(runtime_dir, token)


register(main, _fail)
resume_collector()  # every module a command needs at start is loaded: see slates_cli


if __name__ == "__main__":
    main(prog_name="slates")
