"""Agents working in mounts as real agents do, with editors, sed, make and git (issue 11).

Three agents each mount a work volume over one green version of a small C
project that is a git repository with a .gitignore.  Each changes a
different function of the same file its own way: one rewrites the file
whole (Python's open(p, "w")), one runs `sed -i`, one saves through a
temporary file and a rename, as editors do.  Each builds with make, runs
the program and commits with git, then submits with the CLI.  All three
are accepted; the head holds all three changes and builds; no `.git/` path
and no build output is in any version.  Then every agent goes on in the
same mount for a second round, which merges like the first, and its git
history and build outputs are still there.  Two agents changing the same
line still conflict, and the report shows exactly the bytes that differ.

Needs root and /dev/fuse (CI has both), git, make and a C compiler.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from slates import Client
from tests.anchor_fixture import Service, service
from tests.test_mount import mounted

__all__ = ["service"]

pytestmark = pytest.mark.skipif(
    not os.path.exists("/dev/fuse") or os.geteuid() != 0 or shutil.which("cc") is None,
    reason="FUSE mounts need /dev/fuse and root, and the project needs a C compiler",
)

SLATES = str(Path(sys.executable).with_name("slates"))
FUNCTIONS = ("alpha", "beta", "gamma", "delta", "epsilon", "zeta")


def calc_source() -> str:
    """A C file of six functions, each a few lines apart, then main()."""
    parts = ['#include <stdio.h>\n\n#include "calc.h"\n']
    for number, name in enumerate(FUNCTIONS, 1):
        parts.append(
            f"\n/* {name}: step {number} of the pipeline */\n"
            f"int {name}(int x)\n{{\n    int y = x * {number};\n"
            f"    y = y + {number};\n    return y;\n}}\n"
        )
    return "".join(parts)


MAIN = """#include <stdio.h>
#include "calc.h"

int main(void)
{
    int x = 1;
    x = alpha(x); x = beta(x); x = gamma(x);
    x = delta(x); x = epsilon(x); x = zeta(x);
    printf("%d\\n", x);
    return 0;
}
"""
MAKEFILE = """CC ?= cc
CFLAGS ?= -O0 -Wall
OBJS = build/calc.o build/main.o

calc: $(OBJS)
\t$(CC) -o $@ $(OBJS)

build/%.o: src/%.c src/calc.h
\t@mkdir -p build
\t$(CC) $(CFLAGS) -c -o $@ $<

clean:
\trm -rf build calc
"""
GITIGNORE = "build/\n/calc\n*.o\n"


def git(where: Path, *args: str) -> str:
    done = subprocess.run(
        ["git", "-c", "user.name=agent", "-c", "user.email=agent@example.invalid", *args],
        cwd=where,
        capture_output=True,
        text=True,
        check=True,
    )
    return done.stdout


def slates(runtime: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [SLATES, *args, "--runtime-dir", str(runtime)], capture_output=True, text=True, check=False
    )
    if check and done.returncode != 0:
        raise AssertionError(f"slates {' '.join(args)}: {done.returncode}\n{done.stderr}")
    return done


def submit(runtime: Path, work: str) -> dict[str, Any]:
    result: dict[str, Any] = json.loads(slates(runtime, "submit", work, "--json").stdout)
    return result


@pytest.fixture
def project(tmp_path: Path) -> Path:
    base = tmp_path / "project"
    (base / "src").mkdir(parents=True)
    (base / "src" / "calc.c").write_text(calc_source())
    (base / "src" / "calc.h").write_text("".join(f"int {n}(int x);\n" for n in FUNCTIONS))
    (base / "src" / "main.c").write_text(MAIN)
    (base / "Makefile").write_text(MAKEFILE)
    (base / ".gitignore").write_text(GITIGNORE)
    os.chmod(base / "src" / "calc.c", 0o644)
    git(base, "init", "-q", "-b", "main")
    git(base, "add", "-A")
    git(base, "commit", "-q", "-m", "v0")
    return base


def rewrite_whole(path: Path, old: str, new: str) -> None:
    """What an agent's write tool does: read, change, write the whole file back."""
    text = path.read_text()
    with open(path, "w") as out:  # O_TRUNC, then the whole content
        out.write(text.replace(old, new))


def sed_in_place(path: Path, old: str, new: str) -> None:
    pattern = "".join("\\" + c if c in "\\/.*[]^$" else c for c in old)
    replacement = "".join("\\" + c if c in "\\/&" else c for c in new)
    subprocess.run(["sed", "-i", f"s/{pattern}/{replacement}/", str(path)], check=True)


def save_through_rename(path: Path, old: str, new: str) -> None:
    """What editors do: write a new file beside it, then rename it over the old name."""
    temporary = path.with_name(f".{path.name}.swp")
    temporary.write_text(path.read_text().replace(old, new))
    os.rename(temporary, path)


def build_and_commit(where: Path, message: str) -> int:
    subprocess.run(["make", "-s", "-j2"], cwd=where, check=True, capture_output=True)
    value = int(subprocess.run([str(where / "calc")], capture_output=True, check=True).stdout)
    git(where, "add", "-A")  # .gitignore keeps build/ and calc out
    git(where, "commit", "-q", "-m", message)
    return value


def expected_value(steps: dict[str, tuple[int, int]]) -> int:
    """What calc prints when function `name` multiplies by a and adds b (steps[name])."""
    x = 1
    for number, name in enumerate(FUNCTIONS, 1):
        a, b = steps.get(name, (number, number))
        x = x * a + b
    return x


def head_tree(client: Client, green: str, into: Path, path: str = "/") -> None:
    """Write the green head's files into a directory (to build it), but for .git/: the
    repository version 0 captured, which every work volume starts from."""
    for entry in client.list(green, path):
        child = f"{path.rstrip('/')}/{entry['name']}"
        if child == "/.git":
            continue
        target = into / child.lstrip("/")
        if entry["kind"] == "dir":
            target.mkdir(parents=True, exist_ok=True)
            head_tree(client, green, into, child)
        elif entry["kind"] == "file":
            target.write_bytes(client.read(green, child))


@pytest.fixture
def three_mounts(
    service: Service, project: Path, tmp_path: Path
) -> Iterator[tuple[Client, str, list[tuple[str, Path]]]]:
    runtime = service.runtime
    slates(runtime, "green", "create", "main", "--base", str(project))
    names = ["agent1", "agent2", "agent3"]
    for name in names:
        slates(runtime, "work", "create", "main", name)
    with Client(runtime) as client:
        green = client.resolve("main", "green")
        ids = [client.resolve(name, "work") for name in names]
        with (
            mounted(client, ids[0], tmp_path / "a1") as m1,
            mounted(client, ids[1], tmp_path / "a2") as m2,
            mounted(client, ids[2], tmp_path / "a3") as m3,
        ):
            yield client, green, list(zip(names, (m1, m2, m3), strict=True))


def all_version_paths(client: Client, green: str) -> set[str]:
    ledger = client.ledger(green, limit=1000)
    return {path for version in ledger["versions"] for path in version["paths"]}


def test_three_agents_with_real_tools_in_mounts_all_merge_twice(
    service: Service, three_mounts: tuple[Client, str, list[tuple[str, Path]]], tmp_path: Path
) -> None:
    client, green, agents = three_mounts
    runtime = service.runtime
    tools = (rewrite_whole, sed_in_place, save_through_rename)
    # Round 1: alpha, beta, gamma change their multipliers, each with its own tool.
    changes = {"alpha": (11, 1), "beta": (12, 2), "gamma": (13, 3)}
    for (_name, where), tool, function in zip(agents, tools, changes, strict=True):
        a, b = changes[function]
        number = FUNCTIONS.index(function) + 1
        tool(where / "src" / "calc.c", f"int y = x * {number};", f"int y = x * {a};")
        if tool is not sed_in_place:
            continue
        # sed -i keeps the file's mode (it sets POSIX ACLs, refused, then chmods).
        assert stat.S_IMODE((where / "src" / "calc.c").stat().st_mode) == 0o644
    for (_name, where), function in zip(agents, changes, strict=True):
        alone = {function: (changes[function][0], FUNCTIONS.index(function) + 1)}
        assert build_and_commit(where, f"{function} round 1") == expected_value(alone)
        assert "nothing to commit" in git(where, "status")
    results = [submit(runtime, name) for name, _where in agents]
    for result in results:
        assert result["ok"] and result["made_version"], result
        assert result["private"] > 0, result  # .git/ internals, build/, calc
    assert [r["version"] for r in results] == [1, 2, 3]
    assert all(r["rebased"] for r in results), [r.get("kept_base") for r in results]
    # The sed -i and the rename saves were folded into edits of the same file and refined.
    assert all(r["refined"] == ["/src/calc.c"] for r in results), results
    # No .git/ path and no build output is in any version.
    paths = all_version_paths(client, green)
    assert paths == {"/src/calc.c"}, paths
    merged = client.read(green, "/src/calc.c").decode()
    for function, (a, _b) in changes.items():
        assert f"int y = x * {a};" in merged, function
    # The head builds, and computes all three changes.
    built = tmp_path / "head"
    built.mkdir()
    head_tree(client, green, built)
    assert not (built / "build").exists() and not (built / "calc").exists()
    assert client.read(green, "/.git/HEAD") == (tmp_path / "project" / ".git" / "HEAD").read_bytes()
    subprocess.run(["make", "-s"], cwd=built, check=True, capture_output=True)
    round_one = {f: (a, FUNCTIONS.index(f) + 1) for f, (a, _b) in changes.items()}
    value = int(subprocess.run([str(built / "calc")], capture_output=True, check=True).stdout)
    assert value == expected_value(round_one)
    # Each mount moved onto the version it made: the last one sees everything, its
    # git history and build outputs are still there, and git sees a clean tree for
    # what it committed (the other agents' accepted changes show as modifications).
    name, last = agents[2]
    assert client.read(client.resolve(name, "work"), "/src/calc.c").decode() == merged
    assert (last / "src" / "calc.c").read_text() == merged
    assert git(last, "log", "--format=%s").split("\n")[:2] == ["gamma round 1", "v0"]
    assert (last / "build" / "calc.o").exists() and (last / "calc").exists()
    assert git(last, "status", "--porcelain") == " M src/calc.c\n"
    # Round 2, in the same mounts: delta, epsilon, zeta (adds change now), other tools.
    more = {"delta": (4, 40), "epsilon": (5, 50), "zeta": (6, 60)}
    for (_name, where), tool, function in zip(agents, reversed(tools), more, strict=True):
        number = FUNCTIONS.index(function) + 1
        tool(where / "src" / "calc.c", f"y = y + {number};", f"y = y + {more[function][1]};")
        build_and_commit(where, f"{function} round 2")
    second = [submit(runtime, name) for name, _where in agents]
    for result in second:
        assert result["ok"] and result["made_version"], result
    assert [r["version"] for r in second] == [4, 5, 6]
    assert all_version_paths(client, green) == {"/src/calc.c"}
    final = client.read(green, "/src/calc.c").decode()
    for function, (_a, b) in more.items():
        assert f"y = y + {b};" in final, function
    for function, (a, _b) in changes.items():
        assert f"int y = x * {a};" in final, function
    _name, last = agents[2]
    assert (last / "src" / "calc.c").read_text() == final
    subprocess.run(["make", "-s"], cwd=last, check=True, capture_output=True)
    value = int(subprocess.run([str(last / "calc")], capture_output=True, check=True).stdout)
    assert value == expected_value({**round_one, **more})
    # Nothing to submit now: it says so and makes no version.
    again = slates(runtime, "submit", "agent3")
    assert "nothing to submit" in again.stdout and again.returncode == 0
    assert client.versions(green) == 6


def test_two_agents_changing_one_line_conflict_and_the_report_shows_the_differing_bytes(
    service: Service, three_mounts: tuple[Client, str, list[tuple[str, Path]]]
) -> None:
    client, green, agents = three_mounts
    runtime = service.runtime
    (_n1, first), (_n2, second), _third = agents
    rewrite_whole(first / "src" / "calc.c", "int y = x * 4;", "int y = x * 44;")
    sed_in_place(second / "src" / "calc.c", "int y = x * 4;", "int y = x * 77;")
    assert submit(runtime, "agent1")["ok"]
    done = slates(runtime, "submit", "agent2", "--json", check=False)
    assert done.returncode == 3, done.stderr
    result = json.loads(done.stdout)
    (conflict,) = result["conflicts"]
    assert conflict["path"] == "/src/calc.c" and conflict["kind"] == "overlap"
    assert conflict["rewrite"] is True
    region = conflict["region"]
    source = calc_source()
    line = source[: source.index("int y = x * 4;")].count("\n") + 1
    # JSON carries bytes as one character per byte.
    assert (region["accepted"]["data"], region["proposed"]["data"]) == ("44", "77"), region
    assert region["accepted"]["line"] == region["proposed"]["line"] == line
    text = slates(runtime, "submit", "agent2", check=False).stdout
    assert f"line {line}" in text and "77" in text
    # The head keeps the accepted change; the second agent keeps its own.
    assert "int y = x * 44;" in client.read(green, "/src/calc.c").decode()
    assert "int y = x * 77;" in (second / "src" / "calc.c").read_text()


def test_submit_dry_run_lists_what_would_be_submitted(
    service: Service, three_mounts: tuple[Client, str, list[tuple[str, Path]]]
) -> None:
    client, green, agents = three_mounts
    runtime = service.runtime
    _name, where = agents[0]
    (where / "src" / "new.c").write_text("int fresh;\n")
    build_and_commit(where, "built")  # build outputs and git internals stay private
    done = slates(runtime, "submit", "agent1", "--dry-run")
    assert done.stdout.splitlines()[1:] == ["  /src/new.c"], done.stdout
    assert "private path" in done.stdout
    assert client.versions(green) == 0  # nothing was made
    result = json.loads(slates(runtime, "submit", "agent1", "--dry-run", "--json").stdout)
    assert result["dry_run"] and not result["made_version"] and result["paths"] == ["/src/new.c"]
