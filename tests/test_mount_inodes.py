"""Inode numbers through a mount: base files keep the numbers the base gave them.

Tools remember inode numbers (git's index records st_ino for every file),
so a workspace over a directory must report the base file's own number, for
as long as the file lives, also after it is changed.  Files the workspace
creates get numbers tagged above any base number (PRIVATE_ST_INO), so the
two never collide.  Needs root and /dev/fuse (CI has both).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from slates import Client
from slates.core.volume import PRIVATE_ST_INO
from tests.anchor_fixture import Service, service
from tests.test_mount import mounted

__all__ = ["service"]

pytestmark = pytest.mark.skipif(
    not os.path.exists("/dev/fuse") or os.geteuid() != 0,
    reason="FUSE mounts need /dev/fuse and root (CI has both)",
)

GIT_ENV = {
    **os.environ,
    "GIT_AUTHOR_NAME": "t",
    "GIT_AUTHOR_EMAIL": "t@example.invalid",
    "GIT_COMMITTER_NAME": "t",
    "GIT_COMMITTER_EMAIL": "t@example.invalid",
}


def _git(where: Path, *args: str) -> str:
    done = subprocess.run(
        ["git", *args], cwd=where, env=GIT_ENV, capture_output=True, text=True, check=True
    )
    return done.stdout


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    (root / "src").mkdir(parents=True)
    for i in range(30):
        (root / "src" / f"m{i:02}.c").write_text(f"int m{i} = {i};\n")
    (root / "README").write_text("readme\n")
    os.link(root / "README", root / "README.hard")
    _git(root, "init", "-q")
    _git(root, "add", "-A")
    _git(root, "commit", "-qm", "base")
    _git(root, "status", "--porcelain")  # settle the index (no racy entries left)
    return root


def _numbers(root: Path) -> dict[str, int]:
    return {
        str(p.relative_to(root)): p.lstat().st_ino
        for p in sorted(root.rglob("*"))
        if ".git" not in p.parts and not p.is_dir()
    }


@pytest.mark.parametrize("kind", ["live base", "green (captured)"])
def test_base_files_keep_their_inode_numbers(
    service: Service, repo: Path, tmp_path: Path, kind: str
) -> None:
    expected = _numbers(repo)
    with Client(service.runtime) as client:
        if kind == "live base":
            volume = str(client.create_volume("ws", base=repo)["id"])
        else:
            volume = str(client.create_work(client.create_green("g", base=repo), "ws")["id"])
        with mounted(client, volume, tmp_path / "mnt") as mnt:
            assert _numbers(mnt) == expected
            # readdir's d_ino agrees with stat.
            for entry in os.scandir(mnt / "src"):
                assert entry.inode() == entry.stat(follow_symlinks=False).st_ino
            # Changing a file (copy-up of its content) keeps its number.
            with open(mnt / "src" / "m03.c", "r+b") as f:
                f.write(b"long")
            (mnt / "README").write_text("rewritten\n")
            assert os.stat(mnt / "src" / "m03.c").st_ino == expected["src/m03.c"]
            assert os.stat(mnt / "README").st_ino == expected["README"]
            assert os.stat(mnt / "README.hard").st_ino == expected["README"]
            # A new file gets a number of its own, above every base number.
            (mnt / "src" / "new.c").write_text("int n;\n")
            new = os.stat(mnt / "src" / "new.c").st_ino
            assert new >= PRIVATE_ST_INO and new not in expected.values()


def test_git_status_in_a_fresh_workspace_does_not_rewrite_the_index(
    service: Service, repo: Path, tmp_path: Path
) -> None:
    """The index written in the directory matches the mount: git re-reads nothing."""
    with Client(service.runtime) as client:
        volume = str(client.create_volume("ws", base=repo)["id"])
        with mounted(client, volume, tmp_path / "mnt") as mnt:
            index = (mnt / ".git" / "index").read_bytes()
            assert _git(mnt, "status", "--porcelain") == ""
            assert (mnt / ".git" / "index").read_bytes() == index
            (mnt / "src" / "m07.c").write_text("int changed;\n")
            assert _git(mnt, "status", "--porcelain") == " M src/m07.c\n"
