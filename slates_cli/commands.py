"""The daemon-backed `slates` commands: status, volumes, snapshots, clones, files, merges.

Theory of operation: every command here is thin over the blocking SDK
(slates.sdk.Client).  It parses its arguments, opens one Client on the
runtime directory (`--runtime-dir`, else the SDK's default:
$SLATES_RUNTIME_DIR, /run/slates for root, ...), makes its calls, closes
the client and prints what came back: rich tables for people (one volume's
facts as plain aligned lines, `facts_text`), or the SDK's own data as JSON
with `--json`.  No command computes figures of its own.
The client acts as $SLATES_TOKEN's agent when it is set (mount and
unmount too), else as the operator.

Start-up: a command is a fresh process, so it loads only what it uses.
The Client talks over plain sockets without rings (slates.sdk.blocking: no
trio, no ring extension), json loads only for `--json`, and rich only
where a table or a spinner is shown: not for one volume's facts, so `volume
create` (with `--mount` too), `volume show`, `clone`, `green create` and
`work create` print without it.  Nothing of the service's side loads
but the wire and the state file: sizes are parsed (slates.node.anchor)
only when given, and the quota is shown against this module's UNLIMITED,
not the core's.  Each command connects to what it needs, once: a volume
named by id needs no lookup, so `mount VOLUME_ID` asks the anchor alone,
and `volume create --mount DIR` makes a workspace in one process (a
Python start and click's import are most of a command's time).
tests/test_cli_startup.py checks the modules and the connections.

Errors: a slates.errors.SlatesError ends the command through main.py's
`_fail` (`error: <code>: <message>` on stderr; exit 2 for the caller's
faults, 1 otherwise).  main.py hands `_fail` over in `register`, because
this module must not import main.py: `python -m slates_cli.main` runs
main.py as `__main__`, and importing it again would build a second
command group.  Input that can be checked without the service (sizes,
options that exclude each other) is checked before connecting, so bad input
changes nothing.

Volumes are named on the command line by id (`vol-<shard>-<n>`, which
routes with no lookup) or by name: a name is looked up across every
shard's volume list and must match exactly one volume.  Something shaped
like an id is always taken as an id.

Files move in pieces of at most CHUNK bytes per request, so one request
never outgrows the client's ring.  `write` truncates the file with its
first piece and appends the rest: a reader may see a partly written file,
and a failure part way leaves the pieces written so far.  `read` stops at
the first short piece.

Green and work volumes (DESIGN.md section 5): `green create`, `work
create`, `submit`, `rebase`, `versions` and `changed` are as thin as the
rest.  A submit or rebase that the service refuses because of conflicts is
not an error of the service: its result (`ok` false and the conflicts) is
printed on stdout, each conflict with its path, kind, ranges and the base,
accepted and proposed bytes (escaped as Python shows bytes, cut at
slates_cli.conflicts.SHOWN_BYTES), a one-line `error: Conflict: ...` goes
to stderr, and the exit code is CONFLICT_EXIT (3), apart from the 1 and 2
of failures.  In JSON, bytes are strings with one character per byte
(latin-1): `text.encode("latin-1")` gives the bytes back.

Long work shows progress on stderr (a rich spinner while `--capture`
reads its base, or while `green create --base` captures it), never in
`--json` mode.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, NoReturn

import click

from slates.errors import InvalidArgument, SlatesError

if TYPE_CHECKING:
    from rich.table import Table
    from rich.text import Text

    from slates.sdk import Client

__all__ = [
    "CHUNK",
    "facts_text",
    "terminal_columns",
    "register",
    "status",
    "volume",
    "volume_create",
    "volume_list",
    "volume_show",
    "volume_delete",
    "snapshot",
    "clone",
    "read",
    "write",
    "ls",
    "mount",
    "unmount",
    "green",
    "green_create",
    "work",
    "work_create",
    "submit",
    "rebase",
    "versions",
    "changed",
    "CONFLICT_EXIT",
    "parse_quota",
    "format_bytes",
    "format_quota",
]

CHUNK = 256 << 10
"""Most bytes one read or write request carries (well under a ring's message limit)."""
CONFLICT_EXIT = 3
"""The exit code of a submit or rebase refused because of conflicts."""

UNLIMITED = 1 << 62
"""The limit a dynamic volume without a maximum reports: slates.core.host.UNLIMITED,
restated because importing slates.core (all of the pure core loads with it) would cost
every table with a quota tens of ms (tests/test_cli_startup.py checks the two agree)."""

_UNITS = (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10))

Fail = Callable[[SlatesError], NoReturn]
_fail_hook: Fail | None = None


def register(group: click.Group, fail: Fail) -> None:
    """Attach this module's commands to `group`; `fail` reports a SlatesError and exits.
    (The commands of slates_cli.land and slates_cli.agents, which build on this module's
    pieces, load only when named: main.py's LAZY_COMMANDS.)"""
    global _fail_hook
    _fail_hook = fail
    for command in (status, volume, snapshot, gc, clone, read, write, ls, mount, unmount):
        group.add_command(command)
    for command in (green, work, submit, rebase, versions, changed):
        group.add_command(command)


def _fail(error: SlatesError) -> NoReturn:
    if _fail_hook is None:  # pragma: no cover - register() always runs first
        raise error
    _fail_hook(error)


# -- shared pieces -----------------------------------------------------------

runtime_dir_option = click.option(
    "--runtime-dir",
    type=click.Path(file_okay=False),
    default=None,
    help="Where the service lives (default: $SLATES_RUNTIME_DIR, /run/slates for root).",
)
json_option = click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")


@contextlib.contextmanager
def _client(runtime_dir: str | None) -> Iterator[Client]:
    """One Client for this command; a SlatesError anywhere inside ends the command.

    Without rings: a command makes a few requests and exits, and a ring pair
    (shared memory set up by the shard, a spin calibrated here) costs more
    than it saves for so few."""
    from slates.sdk import Client

    try:
        with Client(runtime_dir, rings=False) as client:
            yield client
    except SlatesError as error:
        _fail(error)


def _json_bytes(value: object) -> str:
    """Bytes in JSON: one character per byte (latin-1), so nothing is lost or guessed."""
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value).decode("latin-1")
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def _echo_json(data: Any) -> None:
    import json

    click.echo(json.dumps(data, indent=2, default=_json_bytes))


def format_bytes(nbytes: int) -> str:
    """Bytes in the largest binary unit they reach: "4.00 GiB", "12.5 KiB", "6 B"."""
    for unit, size in _UNITS:
        if abs(nbytes) >= size:
            return f"{nbytes / size:.2f} {unit}"
    return f"{nbytes} B"


def format_quota(info: dict[str, Any]) -> str:
    """A volume's capacity as people say it: "bounded 4.00 GiB", "dynamic, max 1.00 GiB"."""
    limit = int(info["limit"])
    if info["bounded"]:
        return f"bounded {format_bytes(limit)}"
    if limit >= UNLIMITED:
        return "dynamic"
    return f"dynamic, max {format_bytes(limit)}"


def _size(option: str, text: str | None) -> int | None:
    """parse_size, with the option and the text in the message (it is all a person sees)."""
    if text is None:
        return None  # before the import: slates.node.anchor is the service, slow to load
    from slates.node.anchor import parse_size

    try:
        return parse_size(text)
    except InvalidArgument as error:
        raise InvalidArgument(f"{option} {text!r}: {error.message}", **error.details) from None
    except (ValueError, OverflowError):  # parse_size lets "nan" and "inf" through
        raise InvalidArgument(f"{option} {text!r}: not a size", size=text) from None


def parse_quota(bounded: str | None, dynamic: str | None) -> tuple[int | None, int | None]:
    """--bounded SIZE / --dynamic MAX to bytes; InvalidArgument for bad sizes or both."""
    if bounded is not None and dynamic is not None:
        raise InvalidArgument("choose --bounded or --dynamic, not both")
    return _size("--bounded", bounded), _size("--dynamic", dynamic)


def _path(path: str) -> str:
    """Paths inside a volume are absolute; "src/a.c" means "/src/a.c"."""
    return path if path.startswith("/") else "/" + path


def _facts(title: str | Text, rows: list[tuple[str, str]]) -> Table:
    from rich.table import Table
    from rich.text import Text

    table = Table(title=title, title_justify="left", show_header=False)
    table.add_column("what", style="bold")
    table.add_column("value", overflow="fold")
    for what, value in rows:
        table.add_row(what, Text(value))
    return table


def _print(renderable: Table) -> None:
    """A table on stdout (rich loads here: only output for people needs it)."""
    from rich.console import Console

    Console().print(renderable)


def _spinner(what: str) -> contextlib.AbstractContextManager[object]:
    """Progress on stderr while `what` runs (never in --json mode)."""
    from rich.console import Console

    return Console(stderr=True).status(what)


def _role(info: dict[str, Any]) -> list[tuple[str, str]]:
    """What a green or work volume is to the merge (nothing for a plain volume)."""
    match info.get("role"):
        case "green":
            return [("role", f"green, head version {info['version']}")]
        case "work":
            return [("role", f"work on {info['green']}, from version {info['version']}")]
    return []


def terminal_columns() -> int:
    """The terminal's columns as shutil.get_terminal_size finds them ($COLUMNS, else the
    terminal of stdout, else 80), without importing shutil (and the compression modules
    it loads) for it."""
    try:
        columns = int(os.environ["COLUMNS"])
    except (KeyError, ValueError):
        columns = 0
    if columns > 0:
        return columns
    stdout = sys.__stdout__
    try:
        columns = os.get_terminal_size(stdout.fileno()).columns if stdout else 0
    except (ValueError, OSError):
        columns = 0
    return columns or 80


def facts_text(title: str, rows: list[tuple[str, str]]) -> str:
    """One thing's facts for people: `title`, then each fact's name and value in two
    columns, laid out as click lays out the options of a help page (its definition
    list), to the terminal's width.  Not a rich table: a command that shows one volume
    (`volume create` above all) would pay rich's import, tens of ms, for it."""
    formatter = click.HelpFormatter(width=max(terminal_columns(), 40))
    formatter.write_text(title)
    if rows:  # click's list needs one row at least
        formatter.indent()
        formatter.write_dl(rows)
    return formatter.getvalue()


def _volume_facts(info: dict[str, Any]) -> list[tuple[str, str]]:
    counters = info["counters"]
    # A new work volume's "base" is its version (in "role"), not a directory.
    base = info["base"] if isinstance(info["base"], str) else "-"
    return [
        ("id", str(info["id"])),
        ("name", str(info["name"])),
        ("shard", str(info["shard"])),
        *_role(info),
        ("base", base),
        ("quota", format_quota(info)),
        ("referenced", format_bytes(counters["referenced_bytes"])),
        ("unique", format_bytes(counters["unique_bytes"])),
        ("metadata", format_bytes(counters["metadata_bytes"])),
        ("charged", format_bytes(counters["charged_bytes"])),
        ("host physical", format_bytes(counters["host_physical_bytes"])),
    ]


def _show_volume(title: str, info: dict[str, Any], as_json: bool) -> None:
    """A volume a command made or described: its JSON, or its facts under `title`."""
    if as_json:
        _echo_json(info)
    else:
        click.echo(facts_text(title, _volume_facts(info)), nl=False)


def _volume_table(volumes: list[dict[str, Any]]) -> Table:
    from rich.table import Table
    from rich.text import Text

    table = Table(title="Volumes", title_justify="left")
    for column in ("id", "name", "role", "shard", "base", "quota"):
        table.add_column(column, overflow="fold")
    table.add_column("referenced", justify="right")
    table.add_column("unique", justify="right")
    table.add_column("mounted at", overflow="fold")
    for info in volumes:
        counters = info["counters"]
        role = str(info.get("role", "volume"))
        if role == "work":
            role = f"work on {info['green']} v{info['version']}"
        elif role == "green":
            role = f"green at v{info['version']}"
        table.add_row(
            Text(str(info["id"])),
            Text(str(info["name"])),
            Text(role),
            str(info["shard"]),
            Text(info["base"] or "-"),
            format_quota(info),
            format_bytes(counters["referenced_bytes"]),
            format_bytes(counters["unique_bytes"]),
            Text(str(info.get("mounted_at") or "-")),
        )
    if not volumes:
        table.caption = "no volumes"
    return table


# -- status ------------------------------------------------------------------


@click.command()
@runtime_dir_option
@json_option
def status(runtime_dir: str | None, as_json: bool) -> None:
    """The service: anchor, shards and their volumes, mounts."""
    with _client(runtime_dir) as client:
        report: dict[str, Any] = client.status()
    if as_json:
        _echo_json(report)
        return
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    console = Console()
    console.print(
        _facts(
            "Slates service",
            [
                ("anchor pid", str(report["anchor_pid"])),
                ("capacity", f"{format_bytes(report['capacity'])} ({report['capacity']:,} B)"),
                *_lost_rows(report.get("previous_anchor_lost")),
            ],
        )
    )
    shards = Table(title="Shards", title_justify="left")
    shards.add_column("shard", justify="right")
    shards.add_column("pid", justify="right")
    shards.add_column("restarts", justify="right")
    shards.add_column("volumes", overflow="fold")
    shards.add_column("snapshots", justify="right")
    shards.add_column("failed", overflow="fold")
    for shard in report["shards"]:
        volumes = "\n".join(f"{v['id']} {v['name']}" for v in shard["volumes"]) or "-"
        failed = "\n".join(f"{vid}: {e['code']}" for vid, e in shard["failed"].items()) or "-"
        shards.add_row(
            str(shard["shard"])
            + (" (failed: left down)" if shard.get("state") == "failed" else ""),
            str(shard["pid"]),
            str(shard["restarts"]),
            Text(volumes),
            str(len(shard["snapshots"])),
            Text(failed),
        )
    console.print(shards)
    if not report["mounts"]:
        console.print("Mounts: none")
        return
    mounts = Table(title="Mounts", title_justify="left")
    for column in ("directory", "volume", "bridge pid", "health"):
        mounts.add_column(column, overflow="fold")
    for mount in report["mounts"]:
        mounts.add_row(
            Text(str(mount.get("directory", "?"))),
            Text(str(mount.get("volume", "?"))),
            str(mount.get("pid", "?")),
            str(mount.get("health", "?")),
        )
    console.print(mounts)


def _lost_rows(lost: Any) -> list[tuple[str, str]]:
    """What a previous anchor that died took with it (its RAM), if one did."""
    if not isinstance(lost, dict):
        return []
    names = ", ".join(lost.get("volumes", [])) or "none"
    return [("previous anchor", f"pid {lost.get('pid')} died; its volumes were lost: {names}")]


# -- volumes -----------------------------------------------------------------


@click.group()
def volume() -> None:
    """Create, list, show and delete volumes."""


@volume.command("create")
@click.argument("name")
@click.option("--base", metavar="PATH", default=None, help="Start over this live directory.")
@click.option(
    "--from", "from_snapshot", metavar="SNAPSHOT", default=None, help="Start from a snapshot."
)
@click.option("--capture", is_flag=True, help="Read the base once into Slates (with --base).")
@click.option("--bounded", metavar="SIZE", default=None, help="Reserve SIZE, e.g. 4GiB.")
@click.option("--dynamic", metavar="MAX", default=None, help="Grow on demand up to MAX.")
@click.option("--case-insensitive", is_flag=True, help="Names match regardless of case.")
@click.option(
    "--mount",
    "mount_at",
    metavar="DIR",
    type=click.Path(file_okay=False),
    default=None,
    help="Then mount it at DIR (empty, yours), as `slates mount` does; if that fails, "
    "the volume is deleted again.",
)
@runtime_dir_option
@json_option
def volume_create(
    name: str,
    base: str | None,
    from_snapshot: str | None,
    capture: bool,
    bounded: str | None,
    dynamic: str | None,
    case_insensitive: bool,
    mount_at: str | None,
    runtime_dir: str | None,
    as_json: bool,
) -> None:
    """Create volume NAME: empty, over a base directory, or from a snapshot.

    With --mount DIR it is also mounted there by the same command: one
    process instead of two, the quickest way to a workspace."""
    try:
        bounded_bytes, dynamic_bytes = parse_quota(bounded, dynamic)
        if base is not None and from_snapshot is not None:
            raise InvalidArgument("choose --base or --from, not both")
        if capture and base is None:
            raise InvalidArgument("--capture needs --base (the directory to capture)")
    except SlatesError as error:
        _fail(error)
    with _client(runtime_dir) as client:
        spinner: contextlib.AbstractContextManager[object] = contextlib.nullcontext()
        if capture and not as_json:
            spinner = _spinner(f"capturing {base} ...")
        with spinner:
            info: dict[str, Any] = client.create_volume(
                name,
                base=base,
                from_snapshot=from_snapshot,
                capture=capture,
                bounded=bounded_bytes,
                dynamic=dynamic_bytes,
                case_insensitive=case_insensitive,
            )
        mounted = None if mount_at is None else _mount_created(client, str(info["id"]), mount_at)
    if as_json:
        _echo_json(info if mounted is None else {**info, "mount": mounted})
        return
    _show_volume(f"Created volume {info['id']}", info, as_json=False)
    if mounted is not None:
        click.echo(_mounted_line(mounted))


def _mount_created(client: Client, vid: str, directory: str) -> dict[str, Any]:
    """Mount the volume just created; if the mount fails, delete the volume again, so a
    failed `volume create --mount` leaves nothing behind (its error says if it did)."""
    try:
        mounted: dict[str, Any] = client.mount(vid, directory)
    except SlatesError as error:
        try:
            client.delete_volume(vid)
        except SlatesError as also:
            raise type(error)(
                f"{error.message} (volume {vid} was created and is left: {also.code}: "
                f"{also.message})",
                **{**error.details, "volume": vid},
            ) from None
        raise
    return mounted


def _mounted_line(result: dict[str, Any]) -> str:
    return f"{result['volume']} mounted at {result['directory']} (bridge pid {result['pid']})"


@volume.command("list")
@runtime_dir_option
@json_option
def volume_list(runtime_dir: str | None, as_json: bool) -> None:
    """Every volume on this host, with its quota and counters."""
    with _client(runtime_dir) as client:
        volumes: list[dict[str, Any]] = _with_mounts(client, client.list_volumes())
    if as_json:
        _echo_json(volumes)
    else:
        _print(_volume_table(volumes))


def _with_mounts(client: Client, volumes: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each volume with the directory it is mounted at (None), from the anchor's state."""
    where = {m["volume"]: m["directory"] for m in client.mounts()}
    return [{**v, "mounted_at": where.get(v["id"])} for v in volumes]


@volume.command("show")
@click.argument("volume_ref", metavar="VOLUME")
@runtime_dir_option
@json_option
def volume_show(volume_ref: str, runtime_dir: str | None, as_json: bool) -> None:
    """One volume (by id or unique name): quota and counters."""
    with _client(runtime_dir) as client:
        info: dict[str, Any] = client.show_volume(client.resolve(volume_ref))
    _show_volume(f"Volume {info['id']}", info, as_json)


@volume.command("delete")
@click.argument("volume_ref", metavar="VOLUME")
@click.option("--force", is_flag=True, help="Delete it even if mounted or still in use.")
@runtime_dir_option
@json_option
def volume_delete(volume_ref: str, force: bool, runtime_dir: str | None, as_json: bool) -> None:
    """Delete a volume (by id or unique name); its snapshots stay.

    Refused while it is mounted, and for a green volume while it has work
    volumes or versions no landing has written to disk, unless --force.
    """
    with _client(runtime_dir) as client:
        vid = client.resolve(volume_ref)
        client.delete_volume(vid, force=force)
    if as_json:
        _echo_json({"deleted": vid})
    else:
        click.echo(f"deleted {vid}")


# -- snapshots and clones ----------------------------------------------------


class _TakeByDefault(click.Group):
    """`slates snapshot VOLUME` takes a snapshot; `slates snapshot delete SNAP` deletes."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if args and args[0] not in self.commands and not args[0].startswith("-"):
            args = ["take", *args]
        return super().parse_args(ctx, args)


@click.group(cls=_TakeByDefault)
def snapshot() -> None:
    """Snapshots: `slates snapshot VOLUME` takes one; `slates snapshot delete SNAP`."""


@snapshot.command("take", hidden=True)
@click.argument("volume_ref", metavar="VOLUME")
@runtime_dir_option
@json_option
def snapshot_take(volume_ref: str, runtime_dir: str | None, as_json: bool) -> None:
    """Take a snapshot of VOLUME (by id or unique name); prints the snapshot id."""
    with _client(runtime_dir) as client:
        vid = client.resolve(volume_ref)
        snapshot_id = str(client.snapshot(vid))
    if as_json:
        _echo_json({"snapshot": snapshot_id, "volume": vid})
    else:
        click.echo(snapshot_id)


@snapshot.command("delete")
@click.argument("snapshot_id", metavar="SNAP")
@click.option("--force", is_flag=True, help="Delete it even if volumes were cloned from it.")
@runtime_dir_option
def snapshot_delete(snapshot_id: str, force: bool, runtime_dir: str | None) -> None:
    """Delete snapshot SNAP; its content goes once nothing else shares it.

    Refused while a landing plan or a green's ledger needs it, and, unless
    --force, while volumes cloned from it live (they keep what they share).
    """
    with _client(runtime_dir) as client:
        client.delete_snapshot(snapshot_id, force=force)
    click.echo(f"deleted {snapshot_id}")


@click.command()
@runtime_dir_option
@json_option
def gc(runtime_dir: str | None, as_json: bool) -> None:
    """Collect now: prune green volumes by their --keep, free unused content, and say
    how much physical memory came back."""
    with _client(runtime_dir) as client:
        result = client.gc()
    if as_json:
        _echo_json(result)
        return
    pruned = sum(len(v) for v in result["pruned"].values())
    reaped = result.get("reaped") or {"bridges": [], "mounts": []}
    click.echo(
        f"freed {format_bytes(result['freed_bytes'])}; pruned {pruned} versions; "
        f"the host holds {format_bytes(result['host_physical_bytes'])}; "
        f"reaped {len(reaped['bridges'])} orphaned bridges and {len(reaped['mounts'])} stale mounts"
    )


@click.command()
@click.argument("snapshot_id", metavar="SNAPSHOT")
@click.argument("name")
@click.option("--bounded", metavar="SIZE", default=None, help="Reserve SIZE, e.g. 4GiB.")
@click.option("--dynamic", metavar="MAX", default=None, help="Grow on demand up to MAX.")
@runtime_dir_option
@json_option
def clone(
    snapshot_id: str,
    name: str,
    bounded: str | None,
    dynamic: str | None,
    runtime_dir: str | None,
    as_json: bool,
) -> None:
    """Create volume NAME from SNAPSHOT (sharing its content, copy on write)."""
    try:
        bounded_bytes, dynamic_bytes = parse_quota(bounded, dynamic)
    except SlatesError as error:
        _fail(error)
    with _client(runtime_dir) as client:
        info: dict[str, Any] = client.clone(
            snapshot_id, name, bounded=bounded_bytes, dynamic=dynamic_bytes
        )
    _show_volume(f"Cloned {snapshot_id} as volume {info['id']}", info, as_json)


# -- files -------------------------------------------------------------------


@click.command()
@click.argument("volume_ref", metavar="VOLUME")
@click.argument("path")
@runtime_dir_option
def read(volume_ref: str, path: str, runtime_dir: str | None) -> None:
    """Copy the file PATH of VOLUME to stdout, byte for byte."""
    out = sys.stdout.buffer
    with _client(runtime_dir) as client:
        vid = client.resolve(volume_ref)
        offset = 0
        while True:
            piece = bytes(client.read(vid, _path(path), offset, CHUNK))
            out.write(piece)
            offset += len(piece)
            if len(piece) < CHUNK:
                break
    out.flush()


@click.command()
@click.argument("volume_ref", metavar="VOLUME")
@click.argument("path")
@runtime_dir_option
@json_option
def write(volume_ref: str, path: str, runtime_dir: str | None, as_json: bool) -> None:
    """Replace the file PATH of VOLUME (created if absent) with stdin."""
    source = sys.stdin.buffer
    with _client(runtime_dir) as client:
        vid = client.resolve(volume_ref)
        target = _path(path)
        offset = 0
        first = True
        while True:
            piece = source.read(CHUNK)
            if not piece and not first:
                break
            offset += int(client.write(vid, target, piece, offset, truncate=first))
            first = False
    if as_json:
        _echo_json({"volume": vid, "path": target, "written": offset})
    else:
        click.echo(f"wrote {offset:,} B to {vid}:{target}")


@click.command()
@click.argument("volume_ref", metavar="VOLUME")
@click.argument("path", default="/")
@runtime_dir_option
@json_option
def ls(volume_ref: str, path: str, runtime_dir: str | None, as_json: bool) -> None:
    """List the directory PATH (default /) of VOLUME."""
    with _client(runtime_dir) as client:
        vid = client.resolve(volume_ref)
        entries: list[dict[str, Any]] = client.list(vid, _path(path))
    if as_json:
        _echo_json(entries)
        return
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    table = Table(title=f"{vid}:{_path(path)}", title_justify="left")
    table.add_column("name", overflow="fold")
    table.add_column("kind")
    for entry in entries:
        table.add_row(Text(str(entry["name"])), str(entry["kind"]))
    if not entries:
        table.caption = "empty"
    Console().print(table)


# -- mounts ------------------------------------------------------------------


@click.command()
@click.argument("volume_ref", metavar="VOLUME")
@click.argument("directory", type=click.Path(file_okay=False))
@runtime_dir_option
@json_option
@click.option(
    "--writeback/--no-writeback",
    default=False,
    help="Kernel writeback cache (default off): the kernel gathers writes (builds run "
    "faster); small-file creates, deletes and rereads after a close cost more requests.",
)
@click.option(
    "--allow-other",
    is_flag=True,
    help="Let other users' processes enter the mount (each file's permissions still apply).",
)
def mount(
    volume_ref: str,
    directory: str,
    runtime_dir: str | None,
    as_json: bool,
    writeback: bool,
    allow_other: bool,
) -> None:
    """Serve VOLUME at DIRECTORY (empty, yours); returns once it serves.

    With $SLATES_TOKEN set, the mount is the agent's: it sees and changes
    what that agent may."""
    with _client(runtime_dir) as client:
        vid = client.resolve(volume_ref)
        result = client.mount(vid, directory, writeback=writeback, allow_other=allow_other)
    if as_json:
        _echo_json(result)
    else:
        click.echo(_mounted_line(result))


@click.command()
@click.argument("directory", type=click.Path(file_okay=False))
@runtime_dir_option
@json_option
@click.option("--force", is_flag=True, help="Detach lazily even while processes use it.")
def unmount(directory: str, runtime_dir: str | None, as_json: bool, force: bool) -> None:
    """Flush and detach the mount at DIRECTORY (refused while in use, unless --force)."""
    with _client(runtime_dir) as client:
        result = client.unmount(directory, force=force)
    if as_json:
        _echo_json(result)
    else:
        click.echo(f"unmounted {result['directory']}")


# -- green and work volumes --------------------------------------------------


def _refused(what: str, vid: str, result: dict[str, Any], as_json: bool, kept: str) -> NoReturn:
    """Print a refused submit or rebase (stdout), say so on stderr, exit CONFLICT_EXIT."""
    from rich.console import Console

    from .conflicts import render_conflict

    conflicts: list[dict[str, Any]] = result["conflicts"]
    if as_json:
        _echo_json(result)
    else:
        console = Console()
        for number, conflict in enumerate(conflicts, 1):
            console.print(render_conflict(number, len(conflicts), conflict))
    against = ", ".join(str(v) for v in sorted({c["version"] for c in conflicts})) or "?"
    count = f"{len(conflicts)} conflict{'' if len(conflicts) == 1 else 's'}"
    click.echo(
        f"error: Conflict: {what} of {vid} refused: {count} with version {against}; {kept}",
        err=True,
    )
    raise SystemExit(CONFLICT_EXIT)


@click.group()
def green() -> None:
    """Green volumes: the shared, ordered versions that work volumes submit to."""


@green.command("list")
@runtime_dir_option
@json_option
def green_list(runtime_dir: str | None, as_json: bool) -> None:
    """The green volumes: head version, work volumes on them, where they are mounted."""
    with _client(runtime_dir) as client:
        volumes = _with_mounts(client, client.list_volumes())
    greens = [v for v in volumes if v.get("role") == "green"]
    for info in greens:
        info["works"] = sorted(v["id"] for v in volumes if v.get("green") == info["id"])
    if as_json:
        _echo_json(greens)
    else:
        _print(_volume_table(greens))


@green.command("create")
@click.argument("name")
@click.option("--base", metavar="PATH", default=None, help="Capture this directory as version 0.")
@click.option("--bounded", metavar="SIZE", default=None, help="Reserve SIZE, e.g. 4GiB.")
@click.option("--dynamic", metavar="MAX", default=None, help="Grow on demand up to MAX.")
@click.option("--case-insensitive", is_flag=True, help="Names match regardless of case.")
@click.option(
    "--private",
    "private",
    metavar="PATTERN",
    multiple=True,
    help="Also keep paths matching this gitignore pattern private to work volumes (repeatable).",
)
@click.option(
    "--submit-ignored",
    is_flag=True,
    help="Submit what the repository's ignore files ignore (.git/ and --private stay private).",
)
@click.option(
    "--keep",
    type=click.IntRange(min=1),
    default=100,
    show_default=True,
    help="Versions kept whole behind the head (older ones no work volume needs are pruned).",
)
@click.option(
    "--rewrites",
    type=click.Choice(["refine", "exact"]),
    default="refine",
    show_default=True,
    help="exact: a file rewritten whole is submitted as one replacement of all of it.",
)
@runtime_dir_option
@json_option
def green_create(
    name: str,
    base: str | None,
    bounded: str | None,
    dynamic: str | None,
    case_insensitive: bool,
    private: tuple[str, ...],
    submit_ignored: bool,
    keep: int,
    rewrites: str,
    runtime_dir: str | None,
    as_json: bool,
) -> None:
    """Create green volume NAME at version 0: empty, or a captured copy of PATH.

    It changes only by submissions from its work volumes.  Work volumes keep
    .git/ and what the repository's .gitignore files and .git/info/exclude
    ignore to themselves: visible there, never submitted, never landed.  A
    file rewritten whole (an editor's save, sed -i, open(p, "w")) is
    submitted as the edits that remain, so it merges like precise edits.
    """
    try:
        bounded_bytes, dynamic_bytes = parse_quota(bounded, dynamic)
    except SlatesError as error:
        _fail(error)
    with _client(runtime_dir) as client:
        spinner: contextlib.AbstractContextManager[object] = contextlib.nullcontext()
        if base is not None and not as_json:
            spinner = _spinner(f"capturing {base} ...")
        with spinner:
            gid = client.create_green(
                name,
                base=base,
                bounded=bounded_bytes,
                dynamic=dynamic_bytes,
                case_insensitive=case_insensitive,
                private=private,
                submit_ignored=submit_ignored,
                rewrites=rewrites,
                keep=keep,
            )
        info: dict[str, Any] = client.show_volume(gid)
    _show_volume(f"Created green volume {gid}", info, as_json)


@click.group()
def work() -> None:
    """Work volumes: one agent's private copy of a green version."""


@work.command("create")
@click.argument("green_ref", metavar="GREEN")
@click.argument("name")
@click.option(
    "--version",
    metavar="N",
    type=click.IntRange(min=0),
    default=None,
    help="Start from version N (default: the head).",
)
@click.option(
    "--at",
    type=click.Choice(["here", "owner"]),
    default="here",
    show_default=True,
    help="Another host's green: make the volume on this host (its content read from the "
    "holders as it is used) or on the green's owner.",
)
@runtime_dir_option
@json_option
def work_create(
    green_ref: str,
    name: str,
    version: int | None,
    at: str,
    runtime_dir: str | None,
    as_json: bool,
) -> None:
    """Create work volume NAME on a version of GREEN (by id or unique name); nothing is copied."""
    with _client(runtime_dir) as client:
        info: dict[str, Any] = client.create_work(
            client.resolve(green_ref, "green"), name, version=version, at=at
        )
    _show_volume(f"Created work volume {info['id']}", info, as_json)


@click.command()
@click.argument("work_ref", metavar="WORK")
@click.option(
    "--dry-run",
    is_flag=True,
    help="List what would be submitted, and its conflicts; change nothing.",
)
@click.option(
    "--durability",
    type=click.Choice(["restart", "host", "region"]),
    default=None,
    help="Wait until the version reaches this scope (host: f+1 holders on other hosts).",
)
@runtime_dir_option
@json_option
def submit(
    work_ref: str, dry_run: bool, durability: str | None, runtime_dir: str | None, as_json: bool
) -> None:
    """Offer WORK's changes (by id or unique name) to its green volume.

    Accepted, they become the green volume's new head version, and WORK
    moves onto it (also while mounted), keeping its private paths (.git/,
    ignored build outputs) and going on from there.  Refused because of
    conflicts, each conflict is printed (path, kind, ranges, and the
    smallest region where the sides differ), the green head is unchanged,
    the work volume keeps its edits, and the exit code is 3.  With nothing
    to submit, it says so and makes no version (exit 0).  Acceptance is not
    a test result.
    """
    with _client(runtime_dir) as client:
        vid = client.resolve(work_ref, "work")
        result: dict[str, Any] = client.submit(vid, dry_run=dry_run, durability=durability)
    if not result["ok"]:
        kept = "the green head is unchanged and the work volume keeps its edits"
        _refused("submit", vid, result, as_json, kept)
    if as_json:
        _echo_json(result)
        return
    private = result["private"]
    kept = f"; {private} private path{'' if private == 1 else 's'} kept in the work volume"
    if dry_run:
        click.echo(f"{vid}: would submit {len(result['paths'])} paths{kept if private else ''}")
        for path in result["paths"]:
            click.echo(f"  {path}")
    elif result["nothing"]:
        click.echo(f"{vid}: nothing to submit; no version was made{kept if private else ''}")
    else:
        click.echo(
            f"{vid}: accepted; the green head is version {result['version']}"
            f"{kept if private else ''}"
        )
        if durability is not None:
            click.echo(f"  durability: {result['durability']} (asked: {durability})")
    for path in result["refined"]:
        click.echo(f"  {path}: rewritten whole; submitted as the edits that remain", err=True)
    for path in result["literal"]:
        click.echo(f"  {path}: rewritten whole, too large to refine: submitted whole", err=True)


@click.command()
@click.argument("work_ref", metavar="WORK")
@runtime_dir_option
@json_option
def rebase(work_ref: str, runtime_dir: str | None, as_json: bool) -> None:
    """Move WORK (by id or unique name) onto its green head, keeping its changes.

    Publishes nothing (submit does).  Refused because of conflicts, each
    conflict is printed as by submit, the work volume is unchanged, and the
    exit code is 3.
    """
    with _client(runtime_dir) as client:
        vid = client.resolve(work_ref, "work")
        result: dict[str, Any] = client.rebase(vid)
    if not result["ok"]:
        _refused("rebase", vid, result, as_json, "the work volume is unchanged")
    if as_json:
        _echo_json(result)
    else:
        click.echo(f"{vid}: rebased onto version {result['version']}")


@click.command()
@click.argument("green_ref", metavar="GREEN")
@click.option(
    "--limit",
    metavar="N",
    type=click.IntRange(min=0),
    default=100,
    show_default=True,
    help="Show the last N versions.",
)
@runtime_dir_option
@json_option
def versions(green_ref: str, limit: int, runtime_dir: str | None, as_json: bool) -> None:
    """The versions of GREEN (by id or unique name): base, work volume, changed paths."""
    with _client(runtime_dir) as client:
        ledger: dict[str, Any] = client.ledger(client.resolve(green_ref, "green"), limit=limit)
    if as_json:
        _echo_json(ledger)
        return
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    table = Table(
        title=Text(f"Versions of {ledger['green']} (head {ledger['head']})"), title_justify="left"
    )
    table.add_column("version", justify="right")
    table.add_column("base", justify="right")
    table.add_column("work", overflow="fold")
    table.add_column("changed paths", overflow="fold")
    for entry in ledger["versions"]:
        table.add_row(
            str(entry["version"]),
            "-" if entry["base"] < 0 else str(entry["base"]),
            Text(entry["work"] or "-"),
            Text("(pruned)" if entry.get("pruned") else "\n".join(entry["paths"]) or "-"),
        )
    if not ledger["versions"]:
        table.caption = "none shown"
    Console().print(table)


@click.command()
@click.argument("green_ref", metavar="GREEN")
@click.option(
    "--since",
    metavar="VERSION",
    type=click.IntRange(min=0),
    required=True,
    help="Paths changed by the versions after this one.",
)
@runtime_dir_option
@json_option
def changed(green_ref: str, since: int, runtime_dir: str | None, as_json: bool) -> None:
    """Paths of GREEN (by id or unique name) changed after version VERSION, one per line."""
    with _client(runtime_dir) as client:
        paths = client.changed_since(client.resolve(green_ref, "green"), since)
    if as_json:
        _echo_json(paths)
    else:
        for path in paths:
            click.echo(path)
