"""End-to-end tests of `slates demo`: run the real command, check its figures.

Theory of operation: each test runs `python -m slates_cli.main` in a child
process, as a user would, and checks stdout, stderr and the exit code.  The
JSON figures are checked against facts the test gathers itself where it can
(the sample left on disk with --keep: its bytes and sizes), so a demo that
reported made-up numbers would fail.  If `slates_cli` is not installed (no
`pip install -e .` yet), the child gets the repository root on its
PYTHONPATH, which holds both packages.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from slates.core.volume import INODE_COST

__all__: list[str] = []

REPO = Path(__file__).resolve().parent.parent
MIB = 1 << 20
PAGE = 4096
CONF_BASE = b"quality=80\ncache=off\n"


@pytest.fixture(scope="session")
def cli_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    env = dict(os.environ)
    if importlib.util.find_spec("slates_cli") is None:
        paths = [str(REPO), env.get("PYTHONPATH", "")]
        env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    env["COLUMNS"] = "100"
    return env


def run_cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "slates_cli.main", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def tree_sizes(root: Path) -> dict[str, int]:
    return {
        "/" + path.relative_to(root).as_posix(): path.stat().st_size
        for path in sorted(root.rglob("*"))
        if path.is_file()
    }


@pytest.fixture(scope="module")
def kept_run(
    cli_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> tuple[dict[str, Any], Path]:
    sample = tmp_path_factory.mktemp("kept") / "sample"
    done = run_cli(cli_env, "demo", "--json", "--keep", str(sample))
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    result: dict[str, Any] = json.loads(done.stdout)
    return result, sample


def test_sample_is_written_and_reported(kept_run: tuple[dict[str, Any], Path]) -> None:
    result, sample = kept_run
    on_disk = tree_sizes(sample)
    assert set(on_disk) == {
        "/image.conf",
        "/src/decoder.rs",
        "/src/cache.rs",
        "/README.md",
        "/assets/model.bin",
    }
    assert result["sample"]["files"] == on_disk
    assert result["sample"]["kept"] is True
    assert Path(result["sample"]["path"]) == sample.resolve()
    model = (sample / "assets" / "model.bin").read_bytes()
    assert len(model) == MIB
    assert len(set(model)) == 256  # pseudo-random, not a constant fill


def test_live_overlay_leaves_the_disk_alone(kept_run: tuple[dict[str, Any], Path]) -> None:
    result, sample = kept_run
    overlay = result["overlay"]
    assert overlay["base_bytes_read_at_create"] == 0
    assert overlay["base_reads_at_create"] == 0
    assert overlay["volume_reads"] == "quality=90\ncache=off\n"
    assert overlay["disk_holds"] == CONF_BASE.decode()
    assert (sample / "image.conf").read_bytes() == CONF_BASE
    assert overlay["unique_bytes_after_write"] == PAGE

    rename = overlay["rename"]
    assert rename["inode_base_path"] == "/src"
    assert rename["listing"] == ["cache.rs", "decoder.rs"]
    assert rename["decoder_matches_disk"] is True
    assert rename["base_bytes_read"] == 0
    assert rename["referenced_bytes_delta"] == 0
    assert (sample / "src" / "decoder.rs").is_file()
    assert not (sample / "source").exists()

    assert overlay["unlink"]["visible_in_volume"] is False
    assert overlay["unlink"]["on_disk"] is True
    assert (sample / "README.md").is_file()
    assert overlay["root_whiteouts"] == ["README.md", "src"]
    assert overlay["root_listing"] == ["assets", "image.conf", "source"]


def test_clones_share_one_copy(kept_run: tuple[dict[str, Any], Path]) -> None:
    result, sample = kept_run
    clones = result["clones"]
    content = sum(tree_sizes(sample).values())
    after_capture = clones["host_physical_after_capture"]
    # One real copy (deduplicated at most) plus the metadata of the captured inodes.
    assert MIB <= after_capture <= content + 16 * INODE_COST
    rows = clones["clones"]
    assert len(rows) == 3
    assert len({row["offset"] for row in rows}) == 3
    for index, row in enumerate(rows, start=1):
        assert row["referenced_bytes"] == content
        assert row["referenced_bytes"] >= MIB
        assert row["unique_bytes"] == PAGE
        assert row["host_physical_bytes"] == after_capture + index * PAGE
    physical = clones["host_physical_bytes"]
    assert physical == after_capture + 3 * PAGE
    assert physical < MIB * 11 // 10 + 3 * PAGE
    assert physical < clones["full_copies_bytes"] / 2
    assert clones["host_private_bytes"] == 3 * PAGE

    snap = clones["snapshot_clone"]
    assert snap["unique_bytes"] == 0
    assert snap["referenced_bytes"] == content
    assert snap["sees_source_edit"] is True
    assert snap["source_unique_after_snapshot"] == 0


def test_bounded_clone_refuses_and_keeps_content(kept_run: tuple[dict[str, Any], Path]) -> None:
    bounded = kept_run[0]["clones"]["bounded"]
    assert bounded["error_code"] == "CapacityExhausted"
    assert bounded["refused_write_bytes"] > bounded["quota_bytes"]
    assert bounded["content_unchanged"] is True
    assert bounded["charged_after_small_write"] == PAGE
    assert bounded["charged_after_refusal"] == bounded["charged_after_small_write"]
    assert bounded["error_details"]["limit"] == bounded["quota_bytes"]


def test_seal_shares_identical_chunks(kept_run: tuple[dict[str, Any], Path]) -> None:
    first, twin = kept_run[0]["seal"]
    assert (first["chunks_new"], first["chunks_shared"], first["bytes_sealed"]) == (1, 0, PAGE)
    assert first["host_physical_after"] == first["host_physical_before"]
    assert twin["same_edit_as"] == first["volume"]
    assert (twin["chunks_new"], twin["chunks_shared"]) == (0, 1)
    assert twin["host_physical_after"] == twin["host_physical_before"] - PAGE


def test_human_output(cli_env: dict[str, str]) -> None:
    done = run_cli(cli_env, "demo")
    assert done.returncode == 0, done.stderr
    for expected in (
        "quality=90\\ncache=off\\n",
        "quality=80\\ncache=off\\n",
        "CapacityExhausted",
        "clone-3",
        "keeps base path /src",
    ):
        assert expected in done.stdout
    assert "removed afterwards" in done.stdout


def test_keep_refuses_a_non_empty_directory(cli_env: dict[str, str], tmp_path: Path) -> None:
    target = tmp_path / "busy"
    target.mkdir()
    (target / "precious.txt").write_bytes(b"do not touch\n")
    done = run_cli(cli_env, "demo", "--json", "--keep", str(target))
    assert done.returncode == 2
    assert done.stdout == ""
    assert done.stderr.startswith("error: InvalidArgument: ")
    assert str(target) in done.stderr and "not empty" in done.stderr
    assert "Traceback" not in done.stderr
    assert sorted(p.name for p in target.iterdir()) == ["precious.txt"]
    assert (target / "precious.txt").read_bytes() == b"do not touch\n"


def test_keep_refuses_a_file(cli_env: dict[str, str], tmp_path: Path) -> None:
    target = tmp_path / "a-file"
    target.write_bytes(b"x")
    done = run_cli(cli_env, "demo", "--keep", str(target))
    assert done.returncode == 2
    assert done.stderr.startswith("error: InvalidArgument: ")
    assert target.read_bytes() == b"x"


@pytest.mark.parametrize(
    ("error", "code"),
    [("CapacityExhausted", 1), ("MissingContent", 1), ("AccessDenied", 2)],
)
def test_error_exit_codes_follow_fault(cli_env: dict[str, str], error: str, code: int) -> None:
    # Drive the real click command with a library call that fails.
    script = (
        "import sys, slates.errors as e, slates_cli.main as m, slates_cli.demo as d\n"
        "def boom(keep):\n"
        f"    raise e.{error}('made to fail', path='/x')\n"
        "d.run_demo = boom  # main imports it when the command runs\n"
        "m.main(['demo', '--json'])\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        env=cli_env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == code, done.stderr
    assert done.stderr == f"error: {error}: made to fail\n"
    assert done.stdout == ""


@pytest.mark.skipif(
    not os.path.exists("/dev/fuse") or os.geteuid() != 0,
    reason="the workspace demo mounts a volume: it needs /dev/fuse and root (CI has both)",
)
def test_workspace_demo_mounts_a_real_workspace() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "slates_cli.main", "demo", "--workspace", "--json"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    observed = json.loads(done.stdout)
    assert observed["image_conf_in_mount"] == "quality=90\ncache=off\n"
    assert observed["image_conf_on_disk"] == "quality=80\ncache=off\n"
    assert observed["program_output"] == "quality 90"
    assert observed["clone_reads"] == "quality=90\ncache=off\n"
    assert observed["project_unchanged"] is True
    assert [m["volume"] for m in observed["mounts"]] == [observed["volume"]]
    submits = observed["submits"]
    assert [submits[a]["version"] for a in ("agent-2", "agent-1")] == [1, 2]
    (conflict,) = submits["agent-3"]["conflicts"]
    assert (conflict["kind"], conflict["path"], conflict["base"]) == (
        "overlap",
        "/image.conf",
        [8, 10],
    )
    assert (conflict["base_bytes"], conflict["accepted"], conflict["proposed"]) == (
        "80",
        "90",
        "60",
    )
    assert observed["head"] == 2
    assert observed["head_image_conf"] == "quality=90\ncache=on\n"
    # The agent's git repository and build output stayed private to its work volume.
    assert set(observed["changed"]) == {"/image.conf", "/src/decoder.c"}
    assert observed["submits"]["agent-1"]["private"] > 0
    assert not Path(observed["mountpoint"]).exists()  # cleaned up
