"""The landing commands against a real anchor: plan, approval on a terminal, conflicts.

Approval reads the controlling terminal, so these tests run `slates land
approve` under a pseudo-terminal (pty.fork makes it the child's controlling
terminal) and answer its prompt there; a run with no terminal, or with the
answer piped to stdin, must approve nothing.
"""

from __future__ import annotations

import json
import os
import pty
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest

from slates import Client
from tests.anchor_fixture import Service, service

__all__ = ["service"]

CLI = [sys.executable, "-m", "slates_cli.main"]


@pytest.fixture
def project(tmp_path: Path) -> Path:
    root = tmp_path / "project"
    (root / "src").mkdir(parents=True)
    (root / "image.conf").write_bytes(b"quality=80\ncache=off\n")
    (root / "src" / "old.c").write_text("int old;\n")
    return root


def _accepted_green(service: Service, project: Path) -> str:
    with Client(service.runtime) as client:
        green = client.create_green("main", base=project)
        work = client.create_work(green, "agent")["id"]
        client.edit(work, "/image.conf", 8, 10, b"90")
        client.write(work, "/src/new.c", b"int new;\n")
        client.unlink(work, "/src/old.c")
        assert client.submit(work)["ok"]
        return str(green)


def _cli(service: Service, *args: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CLI, *args, "--runtime-dir", str(service.runtime)],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        start_new_session=True,  # no controlling terminal
    )


def _approve_on_a_terminal(service: Service, manifest: str, answer: str | None) -> tuple[int, str]:
    """Run `land approve` with a pty as its terminal; type `answer` at the prompt."""
    pid, master = pty.fork()
    if pid == 0:  # the child: its controlling terminal is the pty
        os.environ["COLUMNS"] = "400"  # wide: table cells are not wrapped
        os.execv(
            sys.executable,
            [*CLI, "land", "approve", manifest, "--runtime-dir", str(service.runtime)],
        )
    seen = b""
    answered = False
    deadline = time.monotonic() + 60
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.5)
            if ready:
                try:
                    data = os.read(master, 4096)
                except OSError:
                    break  # the child closed the terminal
                if not data:
                    break
                seen += data
            if not answered and b"to approve landing" in seen and answer is not None:
                os.write(master, answer.encode() + b"\n")
                answered = True
    finally:
        os.close(master)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status), seen.decode(errors="replace")


def test_plan_shows_the_manifest_and_diffs_and_changes_nothing(
    service: Service, project: Path
) -> None:
    green = _accepted_green(service, project)
    done = _cli(service, "land", green, str(project))
    assert done.returncode == 0, done.stderr
    assert "-quality=80" in done.stdout and "+quality=90" in done.stdout
    assert "src/new.c" in done.stdout and "delete" in done.stdout
    assert "slates land approve man-" in done.stdout
    plan = json.loads(_cli(service, "land", "--json", green, str(project)).stdout)
    assert {e["path"] for e in plan["entries"]} == {"image.conf", "src/new.c", "src/old.c"}
    only = json.loads(_cli(service, "land", green, str(project), "--path", "src", "--json").stdout)
    assert {e["path"] for e in only["entries"]} == {"src/new.c", "src/old.c"}
    assert only["manifest"] != plan["manifest"]  # another selection, another manifest
    assert (project / "image.conf").read_bytes() == b"quality=80\ncache=off\n"
    assert sorted(os.listdir(project / "src")) == ["old.c"]


def test_approval_needs_the_terminal_and_lands_the_manifest(
    service: Service, project: Path
) -> None:
    green = _accepted_green(service, project)
    manifest = json.loads(_cli(service, "land", "--json", green, str(project)).stdout)["manifest"]
    expected = manifest.rsplit("-", 1)[-1][:8]
    # No terminal: an answer on stdin (an agent's pipe) approves nothing.
    piped = _cli(service, "land", "approve", manifest, stdin=expected + "\n")
    assert piped.returncode != 0 and "AccessDenied" in piped.stderr
    # A wrong answer at the terminal approves nothing either.
    code, _output = _approve_on_a_terminal(service, manifest, "nope")
    assert code != 0
    assert (project / "image.conf").read_bytes() == b"quality=80\ncache=off\n"
    # The right answer lands every entry.
    code, output = _approve_on_a_terminal(service, manifest, expected)
    assert code == 0, output
    assert "applied" in output
    assert (project / "image.conf").read_bytes() == b"quality=90\ncache=off\n"
    assert sorted(os.listdir(project / "src")) == ["new.c"]
    # Approving the same manifest again makes a new grant; every entry is already there.
    code, output = _approve_on_a_terminal(service, manifest, expected)
    assert code == 0, output
    assert "identical" in output and "applied" not in output


def test_a_disk_conflict_exits_4_and_rewitness_needs_a_new_approval(
    service: Service, project: Path
) -> None:
    green = _accepted_green(service, project)
    m7 = json.loads(_cli(service, "land", "--json", green, str(project)).stdout)["manifest"]
    (project / "image.conf").write_bytes(b"quality=60\ncache=off\n")  # a developer's edit
    code, output = _approve_on_a_terminal(service, m7, m7.rsplit("-", 1)[-1][:8])
    assert code == 4, output
    assert "conflict" in output
    assert (project / "image.conf").read_bytes() == b"quality=60\ncache=off\n"
    shown = _cli(service, "read-base", m7, "image.conf")
    assert shown.stdout == "quality=60\ncache=off\n"
    m8 = json.loads(_cli(service, "rewitness", m7, "--path", "image.conf", "--json").stdout)
    assert m8["manifest"] != m7
    code, output = _approve_on_a_terminal(service, m8["manifest"], m8["id"][:8])
    assert code == 0, output
    assert (project / "image.conf").read_bytes() == b"quality=90\ncache=off\n"


def test_the_approval_screen_warns_of_conflicts_before_asking_and_says_why(
    service: Service, project: Path
) -> None:
    green = _accepted_green(service, project)
    m7 = json.loads(_cli(service, "land", "--json", green, str(project)).stdout)["manifest"]
    (project / "image.conf").write_bytes(b"quality=60\ncache=off\n")  # a developer's edit
    (project / "src" / "old.c").unlink()  # already deleted: identical, not a conflict
    code, output = _approve_on_a_terminal(service, m7, "nope")
    assert code != 0
    question = output.index("to approve landing")
    warning = output.index("WARNING: 1 of 3 entries no longer matches its witness")
    assert warning < question
    screen = output[warning:question]
    assert "WILL CONFLICT" in screen and "image.conf" in screen
    assert "src/new.c" not in screen and "src/old.c" not in screen
    assert "content changed since the witness (BLAKE3" in screen
    assert "1 entry will conflict" in output[question:]
    assert (project / "image.conf").read_bytes() == b"quality=60\ncache=off\n"

    code, output = _approve_on_a_terminal(service, m7, m7.rsplit("-", 1)[-1][:8])
    assert code == 4, output
    outcome = next(line for line in output.splitlines() if "conflict" in line and "image" in line)
    assert "content changed since the witness (BLAKE3" in outcome  # the outcome says why
    assert (project / "image.conf").read_bytes() == b"quality=60\ncache=off\n"
    assert sorted(os.listdir(project / "src")) == ["new.c"]


def test_an_unchanged_disk_is_said_so_before_asking(service: Service, project: Path) -> None:
    green = _accepted_green(service, project)
    m7 = json.loads(_cli(service, "land", "--json", green, str(project)).stdout)["manifest"]
    code, output = _approve_on_a_terminal(service, m7, "nope")
    assert code != 0
    assert "WARNING" not in output
    assert output.index("No entry will conflict") < output.index("to approve")


def test_rewitness_merge_keeps_the_developers_line_and_needs_a_new_approval(
    service: Service, project: Path
) -> None:
    green = _accepted_green(service, project)
    m7 = json.loads(_cli(service, "land", "--json", green, str(project)).stdout)["manifest"]
    (project / "image.conf").write_bytes(b"quality=80\ncache=on\n")  # another line
    done = _cli(service, "rewitness", m7, "--merge")
    assert done.returncode == 0, done.stderr
    assert "merged: image.conf" in done.stdout
    assert "+cache=on" not in done.stdout and "+quality=90" in done.stdout  # disk -> merged
    m8 = json.loads(_cli(service, "rewitness", m7, "--merge", "--json").stdout)
    assert m8["merged"] == ["image.conf"] and m8["unmerged"] == []
    assert m8["manifest"] != m7 and f"slates land approve {m8['manifest']}" in done.stdout
    # The old manifest's approval answer does not approve the new one.
    code, _output = _approve_on_a_terminal(service, m8["manifest"], m7.rsplit("-", 1)[-1][:8])
    assert code != 0
    assert (project / "image.conf").read_bytes() == b"quality=80\ncache=on\n"
    code, output = _approve_on_a_terminal(service, m8["manifest"], m8["id"][:8])
    assert code == 0, output
    assert "WARNING" not in output
    assert (project / "image.conf").read_bytes() == b"quality=90\ncache=on\n"
    assert sorted(os.listdir(project / "src")) == ["new.c"]


def test_rewitness_merge_leaves_an_overlapping_edit_a_conflict(
    service: Service, project: Path
) -> None:
    green = _accepted_green(service, project)
    m7 = json.loads(_cli(service, "land", "--json", green, str(project)).stdout)["manifest"]
    (project / "image.conf").write_bytes(b"quality=60\ncache=off\n")  # the same bytes
    done = _cli(service, "rewitness", m7, "--merge")
    assert done.returncode == 0, done.stderr
    assert "not merged: image.conf: the outside edit overlaps the proposal" in done.stdout
    assert f"slates land approve {m7}" in done.stdout  # nothing merged: the same manifest
    code, output = _approve_on_a_terminal(service, m7, m7.rsplit("-", 1)[-1][:8])
    assert code == 4, output
    assert (project / "image.conf").read_bytes() == b"quality=60\ncache=off\n"
