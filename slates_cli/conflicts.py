"""How the CLI shows one conflict of a refused submit or rebase.

Theory of operation (DESIGN.md section 5a, issue 11).  `render_conflict`
turns one conflict as the service sends it (slates.merge.changes'
conflict_to_wire, plus "version" and, for byte ranges, "region": the wire
form of slates.merge.report.Region) into a rich Table in the style of the
other `slates` tables: path, kind, the version that holds the accepted
change and the two ranges (and, for edits refined from a whole-file
rewrite, that they were); then, with a region, where the sides differ:

    context        38 │ line 38: value = 266
                   39 │ line 39: value = 273
    accepted (v3)  line 40: line 40: value = 281
                   differs at [812, 815): '281'
    proposed       line 40: line 40: value = 999
                   differs at [812, 815): '999'
    base           line 40 at [812, 815): '280'
    context        41 │ line 41: value = 287

Each side's lines are the region's bytes with the shared context that
completes their first and last lines; the differing bytes are styled (in
a terminal) and repeated on a "differs" line (everywhere; cut at
SHOWN_BYTES), so that plain output shows them too.  At most SHOWN_LINES
lines of a side are shown, each cut at SHOWN_WIDTH characters, with at
most SHOWN_AROUND characters of its line on either side of the region.  Context lines
are numbered as in the head file.  Text is shown with control and format
characters escaped (\\r, \\t, \\x1b, \\u202e), so a CRLF or a bidi override is
visible and nothing reaches the terminal raw.  A binary region, or a
conflict without one, shows bytes as Python writes them, cut at
SHOWN_BYTES, as the CLI always has.

Pure rendering: dicts in, rich renderables out; slates_cli/commands.py prints them.
"""

from __future__ import annotations

import unicodedata
from typing import Any

from rich.table import Table
from rich.text import Text

__all__ = ["SHOWN_BYTES", "SHOWN_LINES", "byte_range", "shown_bytes", "escape", "render_conflict"]

SHOWN_BYTES = 64  # bytes shown of a binary side or a range without a region
SHOWN_LINES = 12  # lines shown of each side of a text region; the rest are counted
SHOWN_WIDTH = 160  # characters shown of one line (minified code has long ones)
SHOWN_AROUND = 60  # characters of a line shown before and after the region on it

_DIFFERS = "bold reverse"


def byte_range(span: list[int] | tuple[int, int] | None) -> str:
    """A byte range as the product writes it: "[8, 10)"; "-" for none."""
    return "-" if span is None else f"[{span[0]}, {span[1]})"


def shown_bytes(data: bytes | None, *, total: int | None = None) -> str:
    """Bytes as Python shows them (b'quality=80\\n'), cut at SHOWN_BYTES; "-" for none.

    `total` is the whole length when `data` is already a cut (a truncated side).
    """
    if data is None:
        return "-"
    data = bytes(data)
    whole = len(data) if total is None else total
    if len(data) <= SHOWN_BYTES and whole == len(data):
        return repr(data)
    return f"{data[:SHOWN_BYTES]!r}... ({whole:,} B in all)"


def escape(text: str) -> str:
    """Control and format characters as escapes (a tab too); printable text as it is."""
    out = []
    for char in text:
        if char == "\t":
            out.append("\\t")
        elif unicodedata.category(char) in ("Cc", "Cf", "Zl", "Zp", "Cs"):
            out.append(char.encode("unicode_escape", "backslashreplace").decode("ascii"))
        else:
            out.append(char)
    return "".join(out)


def _decoded(data: bytes) -> str:
    """Bytes of a text file as text (a cut may split a character: it shows as \\xNN)."""
    return escape(bytes(data).decode("utf-8", "backslashreplace"))


def render_conflict(number: int, total: int, conflict: dict[str, Any]) -> Table:
    """One conflict as a table: its facts, then where accepted and proposed differ."""
    table = Table(
        title=Text(f"Conflict {number} of {total}: {conflict['path']}"),
        title_justify="left",
        show_header=False,
    )
    table.add_column("what", style="bold")
    table.add_column("value", overflow="fold")
    version = conflict.get("version")
    for what, value in (
        ("path", str(conflict["path"])),
        ("kind", str(conflict["kind"])),
        ("accepted in", f"version {version}"),
        ("base range", byte_range(conflict.get("base"))),
        ("head range", byte_range(conflict.get("head"))),
    ):
        table.add_row(what, Text(value))
    if conflict.get("rewrite"):
        table.add_row("rewrite", Text("edits refined from a whole-file rewrite (DESIGN 5a)"))
    region = conflict.get("region")
    if not isinstance(region, dict):
        table.add_row("base", Text(shown_bytes(conflict.get("base_bytes"))))
        table.add_row("accepted", Text(shown_bytes(conflict.get("accepted"))))
        table.add_row("proposed", Text(shown_bytes(conflict.get("proposed"))))
        return table
    accepted_label = "accepted" if version is None else f"accepted (v{version})"
    if region.get("text"):
        _text_rows(table, region, accepted_label)
    else:
        _binary_rows(table, region, accepted_label)
    return table


def _ends_mid_line(side: dict[str, Any], lead: bytes) -> bool:
    """Whether the bytes after this side's region continue its last line."""
    data = bytes(side["data"])
    return not data.endswith(b"\n") if data else bool(lead)


def _text_rows(table: Table, region: dict[str, Any], accepted_label: str) -> None:
    accepted, proposed = region["accepted"], region["proposed"]
    before, after = bytes(region["before"]), bytes(region["after"])
    *context_before, lead = before.split(b"\n")
    after_lines = after.split(b"\n") if after else []
    if after.endswith(b"\n"):
        after_lines.pop()  # the context ended with its newline
    tail = after_lines[0] if after_lines else b""
    accepted_mid = _ends_mid_line(accepted, lead)
    context_after = after_lines[1:] if accepted_mid else after_lines
    if context_before:
        first = (accepted["line"] or 1) - len(context_before)
        table.add_row("context", _numbered_lines(first, context_before))
    if accepted["start"] == accepted["end"] and proposed["start"] == proposed["end"]:
        table.add_row("differs", Text("nowhere here: both sides hold the same bytes"))
    for label, side in ((accepted_label, accepted), ("proposed", proposed)):
        mid = _ends_mid_line(side, lead)
        table.add_row(label, _side_text(side, lead, tail if mid else b""))
    base = region.get("base")
    if isinstance(base, dict):
        where = f"line {base['line']} at " if base.get("line") else "at "
        table.add_row(
            "base",
            Text(f"{where}{byte_range((base['start'], base['end']))}: ")
            + _quoted(base["data"], base),
        )
    if context_after:
        line = accepted["line"] or 1
        # The next line, unless the region is an insertion point at a line's start.
        first = (accepted["end_line"] or line) + 1 if accepted["data"] or accepted_mid else line
        table.add_row("context", _numbered_lines(first, context_after))


def _numbered_lines(first: int, lines: list[bytes]) -> Text:
    width = len(str(first + len(lines) - 1))
    shown = [Text(_decoded(line)) for line in lines]
    for line in shown:
        line.truncate(SHOWN_WIDTH, overflow="ellipsis")
    return Text("\n").join(_prefixed(first + i, line, width) for i, line in enumerate(shown))


def _quoted(data: bytes, side: dict[str, Any]) -> Text:
    """The differing bytes as quoted, escaped text, or "nothing" for an empty side."""
    size = side["end"] - side["start"]
    if not size:
        return Text("nothing (an insertion point)")
    shown = Text("'") + Text(_decoded(data[:SHOWN_BYTES]), style=_DIFFERS) + Text("'")
    if size > SHOWN_BYTES:
        shown += Text(f"... ({size:,} B in all)")
    return shown


def _side_text(side: dict[str, Any], lead: bytes, tail: bytes) -> Text:
    """The lines that hold one side's region, numbered, with its bytes marked.

    `lead` and `tail` are the shared bytes that complete its first and last
    line (no tail when the region ends its line).
    """
    data = bytes(side["data"])
    lines: list[Text] = []
    shown_lead = _decoded(lead)
    if len(shown_lead) > SHOWN_AROUND:
        shown_lead = "..." + shown_lead[-SHOWN_AROUND:]
    current = Text(shown_lead)
    for index, piece in enumerate(data.split(b"\n")):
        if index:
            lines.append(current)
            current = Text()
        current += Text(_decoded(piece), style=_DIFFERS)
    shown_tail = _decoded(tail)
    if len(shown_tail) > SHOWN_AROUND:
        shown_tail = shown_tail[:SHOWN_AROUND] + "..."
    current += Text(" ...") if side.get("truncated") else Text(shown_tail)
    if current.plain or not lines:
        lines.append(current)  # (else the region ended with its last line's newline)
    for line in lines:
        line.truncate(SHOWN_WIDTH, overflow="ellipsis")
    first = side["line"] or 1
    if len(lines) == 1:
        body = Text(f"line {first}: ") + lines[0]
    else:
        width = len(str(first + len(lines) - 1))
        numbered = [_prefixed(first + i, line, width) for i, line in enumerate(lines)]
        if len(numbered) > SHOWN_LINES:
            keep = SHOWN_LINES // 2
            hidden = Text(f"... {len(numbered) - 2 * keep} more lines")
            numbered = [*numbered[:keep], hidden, *numbered[-keep:]]
        body = Text(f"lines {first}-{first + len(lines) - 1}:\n") + Text("\n").join(numbered)
    return (
        body
        + Text(f"\ndiffers at {byte_range((side['start'], side['end']))}: ")
        + _quoted(data, side)
    )


def _prefixed(number: int, line: Text, width: int) -> Text:
    return Text(f"{number:>{width}} │ ") + line


def _binary_rows(table: Table, region: dict[str, Any], accepted_label: str) -> None:
    rows = [(accepted_label, region["accepted"]), ("proposed", region["proposed"])]
    if isinstance(region.get("base"), dict):
        rows.append(("base", region["base"]))
    table.add_row("before", Text(shown_bytes(region["before"])))
    for label, side in rows:
        total = side["end"] - side["start"]
        table.add_row(
            label,
            Text(f"bytes {byte_range((side['start'], side['end']))}: ")
            + Text(shown_bytes(side["data"], total=total), style=_DIFFERS),
        )
    table.add_row("after", Text(shown_bytes(region["after"])))
