"""The landing commands: `land`, `land approve`, `read-base`, `rewitness`.

Theory of operation (DESIGN.md section 6).  `slates land VOLUME TARGET`
asks the service for a plan and prints its manifest: one row per entry and
a unified diff of each text file between what the disk holds now and the
proposal.  It changes nothing.  `slates land approve MANIFEST` is the
approval interface, the only place a grant is made: it shows the
manifest, then, prominently, which entries' disk state no longer matches
their witness (they will conflict and be left alone) and why, and every
entry whose proposed mode carries setuid, setgid or sticky bits (they land
only so, owned by the service's user: highlighted in the table and
warned about again before the question), asks for
confirmation on the controlling terminal (/dev/tty,
never stdin, so a pipe from an agent cannot answer), reads the approver
credential (RUNTIME/approver.key, owner-only) and then lands the manifest,
printing every entry's outcome.  Exit codes: 0 when every entry landed,
LANDING_EXIT (4) when some entry conflicted or failed, and main.py's 1/2
for errors.  Every conflict outcome says why.  `read-base` prints what
the disk holds; `rewitness` records it as the new witness and prints the
new manifest, which needs its own approval; `rewitness --merge` instead
merges a developer's outside edit of a file into the proposal where the
two do not overlap (the developer's line is kept) and lists the entries
that overlap, which stay conflicts to resolve.  Thin over the SDK
(commands.py explains the shared pieces).
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Any

import click

from slates.errors import AccessDenied, InvalidArgument

if TYPE_CHECKING:
    from rich.table import Table
    from rich.text import Text

    from slates.sdk import Client

from .commands import _client, _echo_json, _fail, json_option, runtime_dir_option

__all__ = ["DIFF_LIMIT", "LANDING_EXIT", "land", "read_base", "rewitness"]

LANDING_EXIT = 4
DIFF_LIMIT = 256 << 10  # larger files are summarized, not diffed


class _LandGroup(click.Group):
    """`land VOLUME TARGET` plans; `land approve MANIFEST` approves."""

    def resolve_command(
        self, ctx: click.Context, args: list[str]
    ) -> tuple[str | None, click.Command | None, list[str]]:
        if args and args[0] not in self.commands:
            args = ["plan", *args]
        return super().resolve_command(ctx, args)


@click.group(
    cls=_LandGroup,
    context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False},
)
def land() -> None:
    """Land a green version or a work volume into a directory, with a human's approval.

    \b
    slates land VOLUME TARGET [--path P]...   show the plan (changes nothing)
    slates land approve MANIFEST              confirm at the terminal, then land it
    """


def _action(entry: dict[str, Any]) -> str:
    old, new = entry["witnessed"], entry["proposed"]
    if new is None:
        return "delete"
    if old is None:
        return f"create {new[0]}"
    if old[0] != new[0]:
        return f"replace {old[0]} by {new[0]}"
    if old[1] == new[1]:
        return f"mode {old[2]:o} -> {new[2]:o}"
    return f"modify {new[0]}"


def _short(state: list[Any] | None) -> str:
    if state is None:
        return "absent"
    kind, digest, mode = state
    return f"{kind} {digest[:12] if digest else ''} {mode:o}".replace("  ", " ")


_CONTROL = {c: f"\\x{c:02x}" for c in [*range(0x20), 0x7F, *range(0x80, 0xA0)]}
_CONTROL.pop(0x0A)  # newlines are kept in diffs
_CONTROL.pop(0x09)


def _safe(text: str) -> str:
    """Text a terminal shows as it is: control characters (escape sequences that
    could hide or rewrite what a reviewer sees) and undecodable bytes escaped."""
    text = text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    return text.translate(_CONTROL)


def _cell(text: str) -> Text:
    from rich.text import Text

    return Text(_safe(text).replace("\n", "\\n"))


def _special(state: list[Any] | None) -> list[str]:
    """The setuid, setgid and sticky bits a wire state's mode asks for."""
    from slates.land.manifest import State, special_bits

    if state is None:
        return []
    return special_bits(State(str(state[0]), state[1], int(state[2])))


def _proposed_cell(state: list[Any] | None) -> Text:
    from rich.text import Text

    special = _special(state)
    if not special:
        return Text(_short(state))
    return Text(f"{_short(state)} {'+'.join(special).upper()}", style="bold red reverse")


def _manifest_table(plan: dict[str, Any], title: str) -> Table:
    from rich.table import Table

    table = Table(title=_cell(title), title_justify="left")
    for column in ("action", "path", "witnessed", "proposed"):
        table.add_column(column)
    for entry in plan["entries"]:
        table.add_row(
            _action(entry),
            _cell(entry["path"]),
            _short(entry["witnessed"]),
            _proposed_cell(entry["proposed"]),
        )
    return table


def _warn_special(plan: dict[str, Any]) -> int:
    """Before the question: every entry that lands setuid, setgid or sticky (stderr).

    Returns how many there are.
    """
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    asking = [e for e in plan["entries"] if _special(e["proposed"])]
    if not asking:
        return 0
    console = Console(stderr=True)
    one = len(asking) == 1
    console.print(
        Text(
            f"WARNING: {len(asking)} {'entry lands' if one else 'entries land'} with"
            " setuid, setgid or sticky bits, owned by the user the service runs as"
            " (root, say): approve only if you meant exactly that",
            style="bold red",
        )
    )
    table = Table(show_header=True, header_style="bold red")
    for column in ("path", "mode", "bits"):
        table.add_column(column)
    for entry in asking:
        table.add_row(
            _cell(entry["path"]),
            f"{int(entry['proposed'][2]):04o}",
            Text(", ".join(_special(entry["proposed"])), style="bold red"),
        )
    console.print(table)
    return len(asking)


def _where(plan: dict[str, Any]) -> str:
    return f"{plan['manifest']}: {plan['source']} into {plan['target']}"


def _diff(path: str, disk: bytes | None, proposed: bytes | None) -> str:
    old, new = disk or b"", proposed or b""
    if len(old) > DIFF_LIMIT or len(new) > DIFF_LIMIT or b"\0" in old + new:
        return f"{path}: {len(old):,} B on disk -> {len(new):,} B proposed (not shown)\n"
    try:
        old_text, new_text = old.decode(), new.decode()
    except UnicodeDecodeError:
        return f"{path}: binary, {len(old):,} B -> {len(new):,} B (not shown)\n"
    import difflib

    lines = difflib.unified_diff(
        old_text.splitlines(keepends=True),
        new_text.splitlines(keepends=True),
        f"disk/{path}" if disk is not None else "/dev/null",
        f"proposed/{path}" if proposed is not None else "/dev/null",
    )
    return "".join(_safe(line if line.endswith("\n") else line + "\n") for line in lines)


def _show(client: Client, plan: dict[str, Any], title: str, *, err: bool = False) -> None:
    """The manifest table and each file's diff (on stderr with err, e.g. before --json)."""
    from rich.console import Console

    Console(stderr=err).print(_manifest_table(plan, f"{title} {_where(plan)}"))
    for entry in plan["entries"]:
        kinds = {s[0] for s in (entry["witnessed"], entry["proposed"]) if s is not None}
        if kinds & {"dir"} or _action(entry).startswith("mode"):
            continue
        content = client.land_content(plan["manifest"], entry["path"])
        diff = _diff(_safe(entry["path"]), content["disk"], content["proposed"])
        click.echo(diff, nl=False, err=err)


@land.command("plan")
@click.argument("volume_ref", metavar="VOLUME")
@click.argument("target", type=click.Path(file_okay=False, exists=True))
@click.option("--path", "paths", multiple=True, help="Land only this path (repeatable).")
@click.option("--version", type=click.IntRange(0), default=None, help="A green version.")
@runtime_dir_option
@json_option
def land_plan(
    volume_ref: str,
    target: str,
    paths: tuple[str, ...],
    version: int | None,
    runtime_dir: str | None,
    as_json: bool,
) -> None:
    """Show the plan to land VOLUME (a green head or version, or a work volume) into TARGET."""
    with _client(runtime_dir) as client:
        vid = client.resolve(volume_ref)
        plan = client.land_plan(vid, target, paths=list(paths) or None, version=version)
        if as_json:
            _echo_json(plan)
            return
        _show(client, plan, "Landing plan")
    click.echo(
        f"{len(plan['entries'])} entries; approve with: slates land approve {plan['manifest']}"
    )


def _warn_conflicts(check: dict[str, Any]) -> int:
    """Before the question: which entries no longer match their witness, and why (stderr).

    Returns how many will not land (conflicts, and entries that cannot be reached).
    """
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    console = Console(stderr=True)
    trouble = [e for e in check["entries"] if e["outcome"] in ("conflict", "fail")]
    identical = sum(1 for e in check["entries"] if e["outcome"] == "identical")
    if not trouble:
        console.print(
            Text(
                "No entry will conflict: the disk still matches the witness at every entry"
                f"{f' but {identical}, which already hold the proposal' if identical else ''}.",
                style="green",
            )
        )
        return 0
    count = len(trouble)
    one = count == 1
    console.print(
        Text(
            f"WARNING: {count} of {len(check['entries'])} entries no longer "
            f"{'matches its' if one else 'match their'} witness on disk: "
            f"{'it' if one else 'they'} WILL CONFLICT"
            f"{' (or fail)' if any(e['outcome'] == 'fail' for e in trouble) else ''}"
            " and be left alone"
            " (review with read-base; rewitness or rewitness --merge makes a new manifest)",
            style="bold red",
        )
    )
    table = Table(show_header=True, header_style="bold red")
    for column in ("will", "path", "disk now", "why"):
        table.add_column(column)
    for entry in trouble:
        table.add_row(
            entry["outcome"],
            _cell(entry["path"]),
            _short(entry["disk"]),
            _cell(entry["reason"]),
        )
    console.print(table)
    return count


def _confirm_on_terminal(manifest: str, target: str, conflicts: int = 0, special: int = 0) -> None:
    """A human types the manifest id's first characters on the controlling terminal."""
    try:
        tty = os.open("/dev/tty", os.O_RDWR | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError:
        raise AccessDenied("approval needs a person at a terminal (no /dev/tty)") from None
    import termios

    expected = manifest.rsplit("-", 1)[-1][:8]
    try:
        termios.tcflush(tty, termios.TCIFLUSH)  # nothing typed ahead counts
        warning = ""
        if conflicts:
            warning = f"{conflicts} {'entry' if conflicts == 1 else 'entries'} will conflict; "
        if special:
            warning += f"{special} {'entry' if special == 1 else 'entries'} SETUID/SETGID/STICKY; "
        prompt = (
            f"Type {expected} to approve landing {manifest} into {_safe(target)} "
            f"({warning}anything else refuses): "
        )
        os.write(tty, prompt.encode("utf-8", "backslashreplace"))
        answer = b""
        while not answer.endswith(b"\n") and len(answer) < 256:
            piece = os.read(tty, 256)
            if not piece:
                break
            answer += piece
    finally:
        os.close(tty)
    if answer.decode(errors="replace").strip() != expected:
        raise AccessDenied("the landing was not approved", manifest=manifest)


def _credential(runtime_dir: str | None, path: str | None) -> bytes:
    from pathlib import Path  # here: --help needs no pathlib (nor its urllib and ipaddress)

    from slates.node.runtime import Runtime

    location = Path(path) if path else Runtime(runtime_dir).approver_key_file
    try:
        data = location.read_bytes().strip()
    except OSError as exc:
        raise AccessDenied(
            "cannot read the approver credential",
            path=str(location),
            reason=exc.strerror,
        ) from None
    if not data:
        raise AccessDenied("the approver credential is empty", path=str(location))
    return data


def _outcomes(result: dict[str, Any]) -> Table:
    from rich.table import Table

    title = _cell(f"Landing {result['manifest']} into {result['target']}")
    table = Table(title=title, title_justify="left")
    for column in ("outcome", "path", "disk before", "reason"):
        table.add_column(column)
    for entry in result["entries"]:
        table.add_row(
            entry["outcome"],
            _cell(entry["path"]),
            _short(entry["disk"]),
            _cell(str(entry.get("reason", ""))),
        )
    return table


@land.command("approve")
@click.argument("manifest")
@click.option(
    "--credential",
    "credential_file",
    type=click.Path(dir_okay=False),
    default=None,
    help="The approver credential file (default: RUNTIME/approver.key).",
)
@runtime_dir_option
@json_option
def land_approve(
    manifest: str, credential_file: str | None, runtime_dir: str | None, as_json: bool
) -> None:
    """Show MANIFEST, confirm at the terminal, and land it (the only way a grant is made)."""
    import secrets

    from rich.console import Console

    from slates.node.protocol import shard_of

    with _client(runtime_dir) as client:
        plan = client.land_show(manifest)
        _show(client, plan, "Approve landing", err=True)
        check = client.call(shard_of(manifest), "land.check", manifest=manifest)
        conflicts = _warn_conflicts(check)
        special = _warn_special(plan)
        _confirm_on_terminal(manifest, plan["target"], conflicts, special)
        grant = client.call(
            shard_of(manifest),
            "land.grant",
            manifest=manifest,
            credential=_credential(runtime_dir, credential_file),
            nonce=secrets.token_hex(16),
        )
        result = client.land_apply(manifest, grant["grant"])
    if as_json:
        _echo_json(result)
    else:
        Console().print(_outcomes(result))
    if not result["complete"]:
        outcomes = [e["outcome"] for e in result["entries"]]
        click.echo(
            f"error: LandingConflict: {outcomes.count('conflict')} conflicting entries left "
            f"alone, {outcomes.count('failed')} failed, {outcomes.count('not attempted')} "
            "not attempted; read-base and rewitness after review, then approve the new manifest",
            err=True,
        )
        raise SystemExit(LANDING_EXIT)


@click.command("read-base")
@click.argument("manifest")
@click.argument("path")
@runtime_dir_option
def read_base(manifest: str, path: str, runtime_dir: str | None) -> None:
    """Print what MANIFEST's target directory holds at PATH now."""
    with _client(runtime_dir) as client:
        data = client.read_base(manifest, path)
    if data is None:
        _fail(InvalidArgument("the target holds nothing at this path", path=path))
    sys.stdout.buffer.write(data)
    sys.stdout.flush()


@click.command()
@click.argument("manifest")
@click.option("--path", "paths", multiple=True, help="Rewitness only this path (repeatable).")
@click.option(
    "--merge",
    is_flag=True,
    help="Merge each outside edit of a file into the proposal where they do not overlap.",
)
@runtime_dir_option
@json_option
def rewitness(
    manifest: str,
    paths: tuple[str, ...],
    merge: bool,
    runtime_dir: str | None,
    as_json: bool,
) -> None:
    """Record what the disk holds now as MANIFEST's witness: a new manifest to approve.

    With --merge, a file the developer edited on disk keeps that edit: the new manifest
    witnesses the disk and proposes the agents' change merged into it.  Entries whose
    outside edit overlaps the proposal stay as they are (they conflict) and are listed.
    """
    with _client(runtime_dir) as client:
        renewed = client.rewitness(manifest, list(paths) or None, merge=merge)
        if as_json:
            _echo_json(renewed)
            return
        _show(client, renewed, "New manifest")
    if merge:
        for path in renewed["merged"]:
            click.echo(f"merged: {_safe(path)}: the outside edit is kept, the proposal merged in")
        for item in renewed["unmerged"]:
            click.echo(f"not merged: {_safe(item['path'])}: {_safe(item['reason'])}")
        if not renewed["merged"] and not renewed["unmerged"]:
            click.echo("nothing to merge: no selected entry has an outside edit")
    click.echo(f"approve with: slates land approve {renewed['manifest']}")
