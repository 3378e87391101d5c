"""Where a host's Slates service lives: the runtime directory and its files.

Theory of operation: the anchor creates one runtime directory (mode 0700)
holding its state file (`anchor.json`: pids, shard count, socket paths),
one listening unix socket per shard, and its log.  Clients find the
service by reading the state file; nothing else is shared through the file
system.  The directory is chosen by, in order: an explicit argument,
$SLATES_RUNTIME_DIR, /run/slates for root, $XDG_RUNTIME_DIR/slates, and
/tmp/slates-<uid>.  Called by the anchor, shards, SDK and CLI.

Start-up: every `slates` command and every mount bridge imports this
module, so it loads no pathlib (with urllib.parse and ipaddress behind it,
~5 ms): `Runtime.directory` is the directory as a string and
`Runtime.file(name)` a file in it, which is all a client reads the state
file and reaches the anchor with; `Runtime.path` and the other Path
properties build a pathlib.Path when first asked for.  The state file's
records (AnchorState, ShardInfo, MountInfo) are typing.NamedTuples, immutable
as the frozen slotted dataclasses records are elsewhere (slates.sdk.session's
Outgoing is the same exception): building a dataclass compiles its generated
methods at import, which cost every command and every bridge 3-5 ms for these
three (the dataclasses module included); with NamedTuples the whole module
loads in about 1 ms.
"""

from __future__ import annotations

import functools
import json
import os
import stat
from typing import TYPE_CHECKING, Any, NamedTuple

from slates.errors import AccessDenied, InvalidArgument, NotFound

if TYPE_CHECKING:
    from pathlib import Path

__all__ = [
    "Runtime",
    "default_runtime_dir",
    "AnchorState",
    "ShardInfo",
    "MountInfo",
    "pid_alive",
]

STATE_NAME = "anchor.json"  # the anchor's state file in the runtime directory
STATE_TEMP = "anchor.tmp"  # written whole, then renamed over it (Runtime.write_state)


def default_runtime_dir() -> Path:
    from pathlib import Path

    return Path(_default_directory())


def _default_directory() -> str:
    explicit = os.environ.get("SLATES_RUNTIME_DIR")
    if explicit:
        return explicit
    if os.geteuid() == 0:
        return "/run/slates"
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg:
        return os.path.join(xdg, "slates")
    return f"/tmp/slates-{os.geteuid()}"


class ShardInfo(NamedTuple):
    """One shard as the state file lists it."""

    index: int  # type: ignore[assignment]  # the state file's name; hides tuple.index
    pid: int
    socket: str
    restarts: int
    state: str = "serving"  # "failed": it kept dying and is left down; the others go on


class MountInfo(NamedTuple):
    """One mount as the state file lists it."""

    directory: str
    volume: str
    pid: int  # the bridge process
    health: str  # "serving", or "restarting" while its bridge is started again


class AnchorState(NamedTuple):
    """What the anchor publishes in its state file (`anchor.json`)."""

    pid: int
    shards: tuple[ShardInfo, ...]
    capacity: int
    mounts: tuple[MountInfo, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {
            "pid": self.pid,
            "capacity": self.capacity,
            "shards": [
                {
                    "index": s.index,
                    "pid": s.pid,
                    "socket": s.socket,
                    "restarts": s.restarts,
                    "state": s.state,
                }
                for s in self.shards
            ],
            "mounts": [
                {"directory": m.directory, "volume": m.volume, "pid": m.pid, "health": m.health}
                for m in self.mounts
            ],
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> AnchorState:
        try:
            shards = tuple(
                ShardInfo(
                    int(s["index"]),
                    int(s["pid"]),
                    str(s["socket"]),
                    int(s["restarts"]),
                    str(s.get("state", "serving")),
                )
                for s in data["shards"]
            )
            mounts = tuple(
                MountInfo(str(m["directory"]), str(m["volume"]), int(m["pid"]), str(m["health"]))
                for m in data.get("mounts", [])
            )
            return cls(int(data["pid"]), shards, int(data["capacity"]), mounts)
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidArgument("malformed anchor state file", reason=str(exc)) from None


class Runtime:
    def __init__(self, path: str | os.PathLike[str] | None = None) -> None:
        self.directory: str = os.fspath(path) if path is not None else _default_directory()
        self.agent_group: int | None = None  # set by prepare: the group the state file is read by

    @functools.cached_property
    def path(self) -> Path:
        """The runtime directory as a pathlib.Path (pathlib loads here, on first use)."""
        from pathlib import Path

        return Path(self.directory)

    def file(self, name: str) -> str:
        """The path of the file `name` in the runtime directory, as a string."""
        return os.path.join(self.directory, name)

    @property
    def state_file(self) -> Path:
        return self.path / STATE_NAME

    @property
    def lost_file(self) -> Path:
        """What the last anchor that died took with it (written by the next one)."""
        return self.path / "lost.json"

    def volumes_file(self, index: int) -> Path:
        """The names of shard `index`'s volumes, for the next anchor to report if this
        one dies."""
        return self.path / f"shard-{index}.volumes.json"

    @property
    def anchor_socket(self) -> Path:
        return self.path / "anchor.sock"

    def shard_socket(self, index: int) -> Path:
        return self.path / f"shard-{index}.sock"

    @property
    def approver_key_file(self) -> Path:
        """The approver credential: only the approval interface reads it (owner-only, 0600)."""
        return self.path / "approver.key"

    def ensure_approver_key(self) -> Path:
        """Create the approver credential at first start; keep it across restarts.

        Written to a temporary name and renamed, so a crash never leaves an
        empty credential; one that is too short or not private is replaced.
        """
        path = self.approver_key_file
        try:
            st = path.lstat()
            private = stat.S_ISREG(st.st_mode) and not stat.S_IMODE(st.st_mode) & 0o077
            if private and len(path.read_bytes().strip()) >= 32:
                return path
        except FileNotFoundError:
            pass
        import secrets  # here: only a new key needs it, and every bridge imports this module

        temp = path.with_name(f".{path.name}.{os.getpid()}")
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "wb") as out:
            out.write(secrets.token_hex(32).encode())
            out.flush()
            os.fsync(out.fileno())
        os.replace(temp, path)
        return path

    @property
    def log_file(self) -> Path:
        return self.path / "anchor.log"

    def prepare(self, group: int | None = None) -> None:
        """Create the directory 0700, or check that an existing one is ours and make it
        private.  With an agent `group`, the directory is 0750 to that group (its members
        reach the sockets and the state file; every secret in it stays 0600)."""
        self.path.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = self.path.stat()
        if st.st_uid != os.geteuid():
            raise AccessDenied("the runtime directory belongs to another user", path=str(self.path))
        self.agent_group = group
        if group is None:
            if stat.S_IMODE(st.st_mode) & 0o077:
                os.chmod(self.path, 0o700)
            return
        os.chown(self.path, -1, group)
        os.chmod(self.path, 0o750)
        for secret in self.path.iterdir():  # a previous anchor's files: none readable
            if secret.is_file() and not secret.is_symlink():
                os.chmod(secret, stat.S_IMODE(secret.stat().st_mode) & 0o700)

    def write_state(self, state: AnchorState) -> None:
        """The state file is the one file agents of the agent group may read (0640).

        Written to `anchor.tmp` and renamed over `anchor.json`, so a reader sees the old
        state or the new, whole.  Through the descriptor (os.write, fchown, fchmod), not
        pathlib's text file and paths: a mount waits for this before its answer, and
        the text layer's calls and two path lookups cost it ~0.1-0.3 ms."""
        tmp = self.file(STATE_TEMP)
        data = json.dumps(state.to_json()).encode()
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            if self.agent_group is not None:
                os.fchown(fd, -1, self.agent_group)
            os.fchmod(fd, 0o640)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
        finally:
            os.close(fd)
        os.replace(tmp, self.file(STATE_NAME))

    def read_state(self) -> AnchorState:
        try:
            with open(self.file(STATE_NAME), "rb") as state_file:
                data = json.loads(state_file.read())
        except FileNotFoundError:
            raise NotFound(
                "no Slates anchor is running here; start one with `slates anchor`",
                runtime_dir=str(self.path),
            ) from None
        except json.JSONDecodeError as exc:
            raise InvalidArgument("malformed anchor state file", reason=str(exc)) from None
        state = AnchorState.from_json(data)
        if not pid_alive(state.pid):
            raise NotFound(
                "no Slates anchor is running here (its state file is stale); start one with "
                "`slates anchor`",
                runtime_dir=str(self.path),
            )
        return state


def pid_alive(pid: int) -> bool:
    if pid <= 0:  # 0 is "no process yet" in the state file; kill(0) would name our group
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # alive, and another user's
    return True
