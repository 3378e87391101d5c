"""Operators' commands (issue 13, item 6 and release): green list, volume list with roles
and mounts, volume delete --force, snapshot delete, gc, agent add/list/remove.

Each runs as a user would, the `slates` CLI against a real anchor.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.anchor_fixture import Service, service

__all__ = ["service"]

SLATES = str(Path(sys.executable).with_name("slates"))


def run(
    service: Service, *args: str, check: bool = True, stdin: str = ""
) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [SLATES, *args, "--runtime-dir", str(service.runtime)],
        input=stdin,
        env={**os.environ, "COLUMNS": "250"},  # wide enough that tables do not fold
        capture_output=True,
        text=True,
        check=False,
    )
    if check and done.returncode != 0:
        raise AssertionError(f"slates {' '.join(args)}: {done.returncode}\n{done.stderr}")
    return done


def as_json(service: Service, *args: str) -> Any:
    return json.loads(run(service, *args, "--json").stdout)


def test_green_list_volume_list_and_safe_deletes(service: Service, tmp_path: Path) -> None:
    project = tmp_path / "project"
    project.mkdir()
    (project / "a.txt").write_text("a\n")
    green = as_json(service, "green", "create", "main", "--base", str(project), "--keep", "5")
    work = as_json(service, "work", "create", "main", "agent")
    (listed,) = as_json(service, "green", "list")
    assert listed["id"] == green["id"] and listed["works"] == [work["id"]]
    roles = {
        v["name"]: (v["role"], v["green"], v["version"]) for v in as_json(service, "volume", "list")
    }
    assert roles == {"main": ("green", None, 0), "agent": ("work", green["id"], 0)}
    table = run(service, "volume", "list").stdout
    assert f"work on {green['id']} v0" in table
    # A second green of that name is refused; the green with a work volume is kept.
    refused = run(service, "green", "create", "main", check=False)
    assert refused.returncode != 0 and "AlreadyExists" in refused.stderr
    refused = run(service, "volume", "delete", "main", check=False)
    assert refused.returncode != 0 and "work volumes" in refused.stderr
    run(service, "volume", "delete", "agent")
    run(service, "volume", "delete", "main")  # v0 only: nothing unlanded
    assert as_json(service, "green", "list") == []


@pytest.mark.skipif(
    not os.path.exists("/dev/fuse") or os.geteuid() != 0,
    reason="FUSE mounts need /dev/fuse and root (CI has both)",
)
def test_a_mounted_volume_shows_where_and_is_kept_unless_forced(
    service: Service, tmp_path: Path
) -> None:
    volume = as_json(service, "volume", "create", "mounted")["id"]
    where = tmp_path / "mnt"
    where.mkdir()
    run(service, "mount", volume, str(where))
    try:
        (shown,) = as_json(service, "volume", "list")
        assert shown["mounted_at"] == str(where)
        refused = run(service, "volume", "delete", volume, check=False)
        assert refused.returncode != 0 and "mounted" in refused.stderr
    finally:
        run(service, "unmount", str(where))
    run(service, "volume", "delete", volume)


def test_snapshot_delete_and_gc(service: Service) -> None:
    volume = as_json(service, "volume", "create", "v")["id"]
    run(service, "write", volume, "/data", stdin="x" * 100_000)
    snap = run(service, "snapshot", volume).stdout.strip()
    clone = as_json(service, "clone", snap, "c")["id"]
    refused = run(service, "snapshot", "delete", snap, check=False)
    assert refused.returncode != 0 and "cloned" in refused.stderr
    run(service, "snapshot", "delete", snap, "--force")
    assert "data" in run(service, "ls", clone, "/").stdout  # the clone keeps what it shares
    collected = as_json(service, "gc")
    assert {"pruned", "freed_bytes", "host_physical_bytes"} <= collected.keys()
    assert "freed" in run(service, "gc").stdout


def test_agent_credentials_from_the_cli(service: Service) -> None:
    token = run(service, "agent", "add", "alice").stdout.strip()
    assert token.startswith("slates-alice-")
    assert run(service, "agent", "list").stdout.split() == ["alice"]
    refused = run(service, "agent", "add", "alice", check=False)
    assert refused.returncode != 0 and "AlreadyExists" in refused.stderr
    run(service, "agent", "remove", "alice")
    assert run(service, "agent", "list").stdout.split() == []
