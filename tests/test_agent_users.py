"""Agents as other Unix users (issue 12, item 3): `anchor --agent-group`, agents' own
mounts, and POSIX permissions through a mount checked as several users.

The anchor opens its runtime directory and sockets to one group; an agent of
another uid in that group reaches the service with its token (never without
one), mounts its own work volume (the mount is opened to other users with
default_permissions, so the kernel checks modes and owners), and cannot read
the runtime directory's secrets, mount another agent's volume or unmount the
operator's mounts.  The permission checks are pjdfstest-like steps run by
several users, once in a tmpfs and once in a Slates mount: every outcome and
every resulting owner and mode must agree (and the steps include denials, so
agreement is not trivial).

Needs root (CI runs as root): the users are bare uids and gids with no
/etc/passwd entries, which the kernel and FUSE accept as they are.  The
interpreter of this checkout may lie where other users cannot read it (a
pyenv under /root), so an agent's `slates` runs as root until it has
imported what it needs and then drops to the agent's uid and groups before
doing anything (RUNNER); the permission steps use the system's Python.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from slates.errors import SlatesError
from slates.node.anchor import spawn_anchor, stop_process
from slates.node.ring import SPIN_CACHE_NAME

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as other users")

AGENTS = 47110  # the agent group
ALICE = (47101, 47121)  # (uid, primary gid): an agent, in the agent group
CAROL = (47103, 47123)  # another member of the agent group (same project, other user)
BOB = (47102, 47122)  # a user outside the agent group
ROOT = (0, 0)
SYSTEM_PYTHON = "/usr/bin/python3"  # readable by every user (the Makefile installs python3)
MEMBERS = {ALICE: [AGENTS], CAROL: [AGENTS], BOB: []}


def as_user(
    user: tuple[int, int], argv: list[str], env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        argv,
        user=user[0],
        group=user[1],
        extra_groups=MEMBERS[user],
        env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": "/", **(env or {})},
        capture_output=True,
        text=True,
        timeout=120,
        cwd="/",
    )


RUNNER = r"""
import importlib, json, os, pkgutil, sys
import slates, slates_cli
for package in (slates, slates_cli):
    for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
        if not info.name.startswith(("slates.mcp", "slates.fleet")):
            importlib.import_module(info.name)
for name in ("rich.console", "rich.table", "rich.text", "difflib", "secrets", "uuid"):
    importlib.import_module(name)
uid, gid, groups = json.loads(sys.argv[1])
os.setgroups(groups)
os.setresgid(gid, gid, gid)
os.setresuid(uid, uid, uid)
from slates_cli.main import main
sys.argv = ["slates", *sys.argv[2:]]
main()
"""


def slates(
    runtime: Path, *args: str, user: tuple[int, int] | None = None, token: str | None = None
) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "SLATES_RUNTIME_DIR": str(runtime), "HOME": "/"}
    env.pop("SLATES_TOKEN", None)
    if token is not None:
        env["SLATES_TOKEN"] = token
    if user is None:
        argv = [sys.executable, "-m", "slates_cli.main", *args]
    else:
        identity = json.dumps([user[0], user[1], MEMBERS[user]])
        argv = [sys.executable, "-c", RUNNER, identity, *args]
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120, cwd="/")


def ok(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


@pytest.fixture
def place() -> Iterator[Path]:
    """A directory other users can traverse (pytest's tmp_path is root-only)."""
    top = Path(tempfile.mkdtemp(prefix="slates-users-", dir="/tmp"))
    os.chmod(top, 0o755)
    try:
        yield top
    finally:
        for mount in _mounts_under(top):
            subprocess.run(["umount", "-l", mount], check=False)
        shutil.rmtree(top, ignore_errors=True)


def _mounts_under(top: Path) -> list[str]:
    with open("/proc/self/mounts", encoding="utf-8") as mounts:
        return [line.split()[1] for line in mounts if line.split()[1].startswith(str(top))]


@pytest.fixture
def fleet(place: Path) -> Iterator[dict[str, object]]:
    """An anchor open to the agent group, a green over an alice-owned project, and
    tokens for alice and dave (dave runs as alice's uid: tokens, not uids, decide)."""
    root = place / "projects"
    base = root / "app"
    (base / "src").mkdir(parents=True)
    (base / "src" / "main.c").write_text("int main(void) { return 0; }\n")
    (base / "README").write_text("app\n")
    for path in [root, base, *base.rglob("*")]:
        os.chown(path, *ALICE)
    runtime = place / "run"
    log_path = place / "anchor.log"
    with open(log_path, "wb") as log:
        try:
            anchor = spawn_anchor(
                runtime,
                shards=2,
                capacity="1GiB",
                log=log,
                allow_roots=(str(root),),
                agent_group=str(AGENTS),
            )
        except SlatesError:
            raise AssertionError(log_path.read_text()) from None
    try:
        tokens = {
            name: json.loads(ok(slates(runtime, "agent", "add", name, "--json")))["token"]
            for name in ("alice", "dave")
        }
        ok(slates(runtime, "green", "create", "main", "--base", str(base)))
        yield {"runtime": runtime, "tokens": tokens, "place": place, "base": base}
    finally:
        for mount in _mounts_under(place):
            slates(runtime, "unmount", mount, "--force")
        stop_process(anchor)


def test_agent_group_reaches_the_service_only_with_a_token(fleet: dict[str, object]) -> None:
    runtime = fleet["runtime"]
    assert isinstance(runtime, Path)
    tokens = fleet["tokens"]
    assert isinstance(tokens, dict)
    st = runtime.stat()
    assert (st.st_gid, st.st_mode & 0o777) == (AGENTS, 0o750)
    listed = json.loads(
        ok(slates(runtime, "volume", "list", "--json", user=ALICE, token=tokens["alice"]))
    )
    assert any(v.get("name") == "main" for v in listed)
    # A member of the group without a token is refused by the service itself.
    bare = slates(runtime, "volume", "list", "--json", user=ALICE)
    assert bare.returncode != 0 and "AccessDenied" in bare.stdout + bare.stderr
    # A user outside the group cannot even reach the sockets.
    outside = slates(runtime, "volume", "list", "--json", user=BOB, token=tokens["alice"])
    assert outside.returncode != 0
    # The runtime directory's secrets stay the operator's.
    public = {"anchor.json", SPIN_CACHE_NAME}  # the state and the spin budget are no secret
    secrets = [p for p in runtime.iterdir() if p.is_file() and p.name not in public]
    assert secrets, "the runtime directory holds the approver key and the agents file"
    for secret in secrets:
        probe = as_user(ALICE, ["cat", str(secret)])
        assert probe.returncode != 0 and "Permission denied" in probe.stderr, secret.name


def test_an_agent_mounts_its_own_work_and_nothing_else(fleet: dict[str, object]) -> None:
    runtime, place, tokens = fleet["runtime"], fleet["place"], fleet["tokens"]
    assert isinstance(runtime, Path) and isinstance(place, Path) and isinstance(tokens, dict)
    alice, dave = tokens["alice"], tokens["dave"]
    ok(slates(runtime, "work", "create", "main", "alice-w", user=ALICE, token=alice))
    made = ok(slates(runtime, "work", "create", "main", "dave-w", "--json", user=ALICE, token=dave))
    dave_w = json.loads(made)["id"]
    where = place / "alice-mnt"
    where.mkdir()
    os.chown(where, *ALICE)
    ok(slates(runtime, "mount", "alice-w", str(where), user=ALICE, token=alice))
    # Alice works in her mount as herself: files are hers, the kernel checks modes.
    edit = as_user(
        ALICE,
        ["sh", "-c", f"cd {where} && echo 'int x;' >> src/main.c && mkdir build && "
         "echo o > build/main.o && sed -i 's/return 0/return 1/' src/main.c && "
         "stat -c %u build/main.o"],
    )  # fmt: skip
    assert edit.returncode == 0, edit.stderr
    assert edit.stdout.split() == [str(ALICE[0])]
    assert "return 1" in (where / "src" / "main.c").read_text()
    submitted = json.loads(
        ok(slates(runtime, "submit", "alice-w", "--json", user=ALICE, token=alice))
    )
    assert submitted["ok"] is True
    # Another agent's volume: alice's token cannot mount it.
    other = place / "dave-mnt"
    other.mkdir()
    os.chown(other, *ALICE)
    refused = slates(runtime, "mount", dave_w, str(other), user=ALICE, token=alice)
    assert refused.returncode != 0 and "AccessDenied" in refused.stdout + refused.stderr
    assert str(other) not in _mounts_under(place)
    # A green mounts for an agent, read-only in effect: it changes only by submission.
    green_at = place / "green-mnt"
    green_at.mkdir()
    os.chown(green_at, *ALICE)
    ok(slates(runtime, "mount", "main", str(green_at), user=ALICE, token=alice))
    read = as_user(ALICE, ["cat", str(green_at / "src" / "main.c")])
    assert "return 1" in read.stdout
    write = as_user(ALICE, ["sh", "-c", f"echo x > {green_at}/README"])
    assert write.returncode != 0
    # The operator's mount is not alice's to take down.
    mine = place / "operator-mnt"
    mine.mkdir()
    ok(slates(runtime, "mount", "dave-w", str(mine)))
    taken = slates(runtime, "unmount", str(mine), "--force", user=ALICE, token=alice)
    assert taken.returncode != 0 and "AccessDenied" in taken.stdout + taken.stderr
    assert str(mine) in _mounts_under(place)
    ok(slates(runtime, "unmount", str(where), user=ALICE, token=alice))
    assert str(where) not in _mounts_under(place)


# -- pjdfstest-like permission steps, tmpfs against a Slates mount -----------------

# (user, operation, path, argument): run in order from a fresh process each.
STEPS: list[tuple[tuple[int, int], str, str, object]] = [
    (ALICE, "mkdir", "d", 0o755),
    (ALICE, "create", "d/f", 0o644),
    (ALICE, "mkdir", "sticky", 0o1777),
    (ALICE, "create", "sticky/af", 0o644),
    (ALICE, "create", "private", 0o600),
    (ALICE, "create", "shared", 0o640),
    (ALICE, "chown", "shared", (-1, AGENTS)),
    (BOB, "read", "d/f", None),
    (BOB, "write", "d/f", None),
    (BOB, "truncate", "d/f", None),
    (BOB, "create", "d/new", 0o644),
    (BOB, "unlink", "d/f", None),
    (BOB, "chmod", "d/f", 0o666),
    (BOB, "chown", "d/f", (BOB[0], -1)),
    (BOB, "utime_now", "d/f", None),
    (BOB, "utime_set", "d/f", None),
    (BOB, "read", "private", None),
    (BOB, "read", "shared", None),
    (CAROL, "read", "shared", None),
    (CAROL, "write", "shared", None),
    (BOB, "create", "sticky/bf", 0o644),
    (BOB, "unlink", "sticky/af", None),
    (BOB, "rename", "sticky/af", "sticky/moved"),
    (ALICE, "unlink", "sticky/bf", None),
    (BOB, "unlink", "sticky/bf", None),
    (ALICE, "chown", "d/f", (BOB[0], -1)),
    (ALICE, "chown", "d/f", (-1, AGENTS)),
    (ALICE, "chown", "d/f", (-1, BOB[1])),
    (ALICE, "mkdir", "setgid", 0o2775),
    (ALICE, "chown", "setgid", (-1, AGENTS)),
    (ALICE, "chmod", "setgid", 0o2775),
    (ALICE, "create", "setgid/x", 0o644),
    (ALICE, "mkdir", "setgid/sub", 0o755),
    (CAROL, "create", "setgid/carol", 0o644),
    (ALICE, "create", "tool", 0o755),
    (ALICE, "chmod", "tool", 0o4755),
    (ALICE, "write", "tool", None),
    (ALICE, "chmod", "d", 0o700),
    (BOB, "stat", "d/f", None),
    (BOB, "list", "d", None),
    (ALICE, "chmod", "d", 0o711),
    (BOB, "stat", "d/f", None),
    (BOB, "list", "d", None),
    (ROOT, "write", "private", None),
    (ROOT, "chown", "private", (BOB[0], BOB[1])),
    (BOB, "read", "private", None),
    (ALICE, "symlink", "link", "d/f"),
    (BOB, "unlink", "link", None),
    (ALICE, "link", "sticky/af", "hard"),
    (BOB, "link", "private", "stolen"),
    # What a change of content or owner takes from a file (the server's part under
    # FUSE_HANDLE_KILLPRIV_V2, slates/node/fsops.py): set-ID bits when the caller
    # lacks CAP_FSETID (the set-group-ID bit of a group-executable file, or of one
    # outside the caller's group: the kernel's own FUSE path kept that one), and on
    # every chown; the capability xattr always.
    (ALICE, "create", "src", 0o644),
    (ALICE, "write", "src", None),
    *[
        step
        for name, mode in (
            ("kept", 0o6777),
            ("written", 0o6777),
            ("cut", 0o6777),
            ("grown", 0o6777),
            ("copied", 0o6777),
            ("rootcopy", 0o6777),
            ("sgnox", 0o2666),
            ("sgmember", 0o2666),
            ("owned", 0o6755),
        )
        for step in ((ALICE, "create", name, 0o644), (ALICE, "chmod", name, mode))
    ],
    (ROOT, "write", "kept", None),
    (BOB, "write", "written", None),
    (BOB, "truncate", "cut", None),
    (BOB, "fallocate", "grown", None),
    (BOB, "copy", "copied", "src"),
    (ROOT, "copy", "rootcopy", "src"),
    (BOB, "write", "sgnox", None),  # not in the file's group: it goes
    (ALICE, "write", "sgmember", None),  # in it: it stays
    (ROOT, "chown", "owned", (BOB[0], BOB[1])),
    (ROOT, "chown", "setgid", (-1, AGENTS)),
    *[
        step
        for name in ("capped", "capowned", "capcut", "capkept")
        for step in (
            (ALICE, "create", name, 0o644),
            (ALICE, "chmod", name, 0o666),
            (ROOT, "setcap", name, None),
        )
    ],
    (ROOT, "write", "capped", None),
    (ROOT, "chown", "capowned", (ALICE[0], AGENTS)),
    (BOB, "truncate", "capcut", None),
]

STEP = r"""
import errno, json, os, sys
op, path, arg = json.loads(sys.argv[1])
try:
    if op == "mkdir": os.mkdir(path, arg); os.chmod(path, arg)
    elif op == "create": os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, arg))
    elif op == "read": open(path, "rb").read()
    elif op == "write":
        with open(path, "ab") as f: f.write(b"more\n")
    elif op == "truncate": os.truncate(path, 0)
    elif op == "unlink": os.unlink(path)
    elif op == "chmod": os.chmod(path, arg)
    elif op == "chown": os.chown(path, arg[0], arg[1])
    elif op == "utime_now": os.utime(path, None)
    elif op == "utime_set": os.utime(path, (1, 1))
    elif op == "rename": os.rename(path, arg)
    elif op == "stat": os.stat(path)
    elif op == "list": os.listdir(path)
    elif op == "symlink": os.symlink(arg, path)
    elif op == "link": os.link(path, arg)
    elif op == "fallocate":
        fd = os.open(path, os.O_WRONLY); os.posix_fallocate(fd, 0, 8192); os.close(fd)
    elif op == "copy":
        src, dst = os.open(arg, os.O_RDONLY), os.open(path, os.O_WRONLY)
        os.copy_file_range(src, dst, 4, 0, 0); os.close(src); os.close(dst)
    elif op == "setcap":  # cap_net_raw, effective (a VFS_CAP_REVISION_2 value)
        os.setxattr(path, "security.capability", bytes.fromhex("0100000200200000" + "00" * 12))
    print("ok")
except OSError as exc:
    print(errno.errorcode[exc.errno])
"""


def _run_steps(top: Path) -> list[str]:
    outcomes = []
    for user, op, path, arg in STEPS:
        argv = [SYSTEM_PYTHON, "-S", "-c", STEP, json.dumps([op, path, arg])]
        if user == ROOT:
            result = subprocess.run(argv, capture_output=True, text=True, cwd=top, timeout=60)
        else:
            result = subprocess.run(
                argv,
                user=user[0],
                group=user[1],
                extra_groups=MEMBERS[user],
                capture_output=True,
                text=True,
                cwd=top,
                timeout=60,
            )
        assert result.returncode == 0, result.stderr
        outcomes.append(f"{user[0]} {op} {path}: {result.stdout.strip()}")
    for entry in sorted(top.rglob("*")):
        st = os.lstat(entry)
        capped = not entry.is_symlink() and "security.capability" in os.listxattr(entry)
        outcomes.append(
            f"{entry.relative_to(top)} {st.st_uid} {st.st_gid} {st.st_mode:o}"
            + (" capability" if capped else "")
        )
    return outcomes


def test_permissions_through_a_mount_match_tmpfs(fleet: dict[str, object]) -> None:
    runtime, place, tokens = fleet["runtime"], fleet["place"], fleet["tokens"]
    assert isinstance(runtime, Path) and isinstance(place, Path) and isinstance(tokens, dict)
    alice = tokens["alice"]
    reference = place / "tmpfs"
    reference.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(reference)], check=True)
    try:
        os.chown(reference, *ALICE)
        os.chmod(reference, 0o755)
        ok(slates(runtime, "volume", "create", "perms", user=ALICE, token=alice))
        where = place / "perms-mnt"
        where.mkdir()
        os.chown(where, *ALICE)
        ok(slates(runtime, "mount", "perms", str(where), user=ALICE, token=alice))
        os.chown(where, *ALICE)  # the volume's root, as the tmpfs's: alice's, 0755
        os.chmod(where, 0o755)
        expected = _run_steps(reference)
        seen = _run_steps(where)
    finally:
        subprocess.run(["umount", str(reference)], check=False)
    denials = [line for line in expected if line.endswith(("EACCES", "EPERM"))]
    assert len(denials) >= 15, expected  # the steps test something: many are refused
    assert any(line.endswith(": ok") and line.startswith(str(BOB[0])) for line in expected)
    final = {line.split()[0]: line.split()[3:] for line in expected if ": " not in line}
    assert final["kept"] == ["106777"] and final["written"] == ["100777"]  # the steps bite
    assert final["sgnox"] == ["100666"] and final["sgmember"] == ["102666"]
    assert final["capkept"] == ["100666", "capability"]
    assert final["capped"] == ["100666"]
    assert seen == expected
