"""`slates demo --workspace`: the product's main job, end to end, with a real mount.

Theory of operation: start an anchor in a private runtime directory, make a
green volume from a sample project (captured once), give agent 1 a work
volume and mount it, and work in it the way an agent would: edit a file
with ordinary file calls and `sed -i`, run git and a compiler, take a
snapshot and clone it for a second attempt.  Two more agents edit the same
file through the SDK; all three submit: two compatible edits combine, the
competing one comes back as a structured conflict and changes nothing.
Agent 1's git repository and build output (ignored by the project's
.gitignore) stay private to its work volume: never submitted.
Every step is a real process or system call; the script then shows that
the project directory was never written, unmounts, and stops the anchor it
started.  It returns a plain dict of what it observed, for the CLI to print.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from slates import Client
from slates.errors import SlatesError
from slates.node.anchor import spawn_anchor, stop_process

__all__ = ["run_workspace_demo"]


def _sample(root: Path) -> None:
    (root / "src").mkdir(parents=True)
    (root / "image.conf").write_bytes(b"quality=80\ncache=off\n")
    (root / "src" / "decoder.c").write_text("int quality(void) { return 80; }\n")
    (root / "src" / "main.c").write_text(
        "#include <stdio.h>\nint quality(void);\n"
        'int main(void) { printf("quality %d\\n", quality()); return 0; }\n'
    )
    (root / "Makefile").write_text(
        "app: src/main.c src/decoder.c\n\tcc -o app src/main.c src/decoder.c\n"
    )
    (root / ".gitignore").write_text("/app\n*.o\n")


def _digest(root: Path) -> str:
    h = hashlib.sha256()
    for path in sorted(root.rglob("*")):
        h.update(str(path.relative_to(root)).encode())
        st = path.lstat()
        h.update(f"{st.st_mode}:{st.st_size}:{st.st_mtime_ns}".encode())
        if path.is_file():
            h.update(path.read_bytes())
    return h.hexdigest()


def _run(command: list[str], cwd: Path) -> str:
    env = {
        **os.environ,
        "GIT_AUTHOR_NAME": "agent",
        "GIT_AUTHOR_EMAIL": "agent@example.invalid",
        "GIT_COMMITTER_NAME": "agent",
        "GIT_COMMITTER_EMAIL": "agent@example.invalid",
    }
    done = subprocess.run(
        command, cwd=cwd, env=env, capture_output=True, text=True, timeout=120, check=False
    )
    if done.returncode != 0:
        raise SlatesError(f"{' '.join(command)} failed in the mount", output=done.stderr[-500:])
    return done.stdout


def _outcome(submitted: dict[str, Any]) -> dict[str, Any]:
    """A submit's result with its conflicts' bytes as text (the demo's files are ASCII)."""

    def text(value: object) -> object:
        if isinstance(value, bytes):
            return value.decode("utf-8", "replace")
        if isinstance(value, dict):
            return {k: text(v) for k, v in value.items()}
        return value

    return {**submitted, "conflicts": [text(c) for c in submitted["conflicts"]]}


def run_workspace_demo() -> dict[str, Any]:
    top = Path(tempfile.mkdtemp(prefix="slates-workspace-demo-"))
    runtime, project, mnt = top / "run", top / "project", top / "mnt"
    _sample(project)
    mnt.mkdir()
    before = _digest(project)
    anchor = spawn_anchor(runtime, shards=2, capacity="1GiB")
    result: dict[str, Any] = {"project": str(project), "mountpoint": str(mnt)}
    try:
        with Client(runtime) as client:
            green = client.create_green("image", base=project)  # captured: v0
            work = client.create_work(green, "agent-1")
            result["green"], result["volume"] = green, work["id"]
            client.mount(work["id"], mnt)
            try:
                result["listing"] = sorted(os.listdir(mnt))
                conf = mnt / "image.conf"
                with open(conf, "r+b") as f:  # an ordinary edit: replace [8, 10) with 90
                    f.seek(8)
                    f.write(b"90")
                result["image_conf_in_mount"] = conf.read_text()
                # sed -i saves a new file over the old one: still an edit of decoder.c.
                _run(["sed", "-i", "s/80/90/", "src/decoder.c"], mnt)
                _run(["git", "init", "-q"], mnt)
                _run(["git", "add", "-A"], mnt)
                _run(["git", "commit", "-qm", "agent work"], mnt)
                _run(["make", "-s"], mnt)
                result["program_output"] = _run(["./app"], mnt).strip()
                result["git_log"] = _run(["git", "log", "--oneline"], mnt).strip()
                snapshot = client.snapshot(work["id"])
                attempt = client.clone(snapshot, "agent-1-attempt-2")
                result["snapshot"] = snapshot
                result["clone"] = attempt["id"]
                result["clone_reads"] = client.read(attempt["id"], "/image.conf").decode()
                result["counters"] = client.counters(work["id"])
                result["mounts"] = client.status()["mounts"]
                # Two more agents edit the same file through the SDK, from v0.
                cache = client.create_work(green, "agent-2")
                client.edit(cache["id"], "/image.conf", 17, 20, b"on")  # cache=off -> on
                rival = client.create_work(green, "agent-3")
                client.edit(rival["id"], "/image.conf", 8, 10, b"60")  # the same 80 -> 60
                result["submits"] = {
                    name: _outcome(client.submit(vid))  # agent-1's runs the mount's barrier first
                    for name, vid in (
                        ("agent-2", cache["id"]),
                        ("agent-1", work["id"]),
                        ("agent-3", rival["id"]),
                    )
                }
            finally:
                client.unmount(mnt)
            result["head"] = client.versions(green)
            result["head_image_conf"] = client.read(green, "/image.conf").decode()
            result["changed"] = client.changed_since(green, 0)
        result["image_conf_on_disk"] = (project / "image.conf").read_text()
        result["project_unchanged"] = _digest(project) == before
    finally:
        stop_process(anchor, timeout=30)
        shutil.rmtree(top, ignore_errors=True)
    return result
