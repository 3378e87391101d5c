"""Refining whole-file rewrites vs git, side by side: the pure refinement, then real submits.

(a) Pure.  A seeded 1 MiB source file (code-like lines); "ours" rewrites it
with 10 scattered changes (lines changed inside, inserted, deleted), "theirs"
with 10 others elsewhere.  Timed, median of --rounds: `refine(base, ours)`;
the whole Slates merge of the two rewrites (refine both, map_edits_pairwise
as the service does for same-base submissions, apply); `git merge-file -p`
of the same three files (a process, as git runs it); `git diff --no-index`
of base and ours.  The Slates merge must equal git's byte for byte.

(b) Service.  A real anchor (bench/merge_bench.py's) and the SDK: a green
volume captured from a directory; per round two work volumes each `write`
the whole 1 MiB file (truncate and rewrite, as tools do), then submit one
after the other; the same on a green created with `rewrites="exact"` (the
literal whole replacement, as before refinement: the second submit is a
conflict); the first agent's changes made as precise `edit`s instead
(nothing to refine); and 100 agents each rewriting their own 32 KiB file
(3 changes each), submitting one after another.  Beside them, `git
merge-file` for the same merges (each file's base, the agent's content, the
head's content of that file; for the 100 files, git itself would take a
one-sided change without merge-file, so its figure is an upper bound).
Conflicts are counted and the run still finishes.  Every submit is checked:
the head holds what git's merge (or the agent's content) says.

    python bench/refine_bench.py [--rounds 3] [--agents 100]
"""

from __future__ import annotations

import argparse
import importlib.util
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

if importlib.util.find_spec("slates") is None:  # run from a checkout, not installed
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import merge_bench
from benchlib import git_env

from slates import AsyncClient
from slates.merge.changes import Edit, map_edits_pairwise
from slates.merge.ranges import apply
from slates.merge.refine import refine

__all__ = ["main"]

BIG = 1 << 20
CHANGES = 10  # per side, in the 1 MiB file
SMALL = 32 << 10
SMALL_CHANGES = 3
WORDS = ["alpha", "beta", "gamma", "delta", "value", "count", "index", "self", "item", "node"]


class BenchFailure(RuntimeError):
    """A merge result is not what git's merge (or the agent's content) says it must be."""


def source(rng: random.Random, size: int) -> list[bytes]:
    """Code-like lines adding up to about `size` bytes."""
    lines: list[bytes] = []
    total = 0
    while total < size:
        indent = " " * 4 * rng.randint(0, 3)
        name, *args = rng.sample(WORDS, rng.randint(2, 5))
        line = f"{indent}{name}_{rng.randint(0, 999)} = compute({', '.join(args)})\n".encode()
        lines.append(line)
        total += len(line)
    return lines


def rewrite(rng: random.Random, lines: list[bytes], where: list[int]) -> bytes:
    """The file with a change at each chosen line: a word renamed inside the line, a line
    inserted after it, or the line deleted."""
    out = list(lines)
    for number, at in sorted(enumerate(where), key=lambda pair: -pair[1]):
        kind = number % 3
        if kind == 0:
            word = rng.choice(WORDS).encode()
            out[at] = out[at].replace(b"compute(", b"compute(" + word + b"_new, ", 1)
        elif kind == 1:
            out.insert(at + 1, f"    added_{number} = {rng.choice(WORDS)}\n".encode())
        else:
            del out[at]
    return b"".join(out)


def two_rewrites(rng: random.Random, lines: list[bytes], changes: int) -> tuple[bytes, bytes]:
    """Ours and theirs, each with `changes` changes at lines at least 8 apart from any other."""
    spots = rng.sample(range(4, len(lines) - 4, 8), 2 * changes)
    return rewrite(rng, lines, spots[0::2]), rewrite(rng, lines, spots[1::2])


def median_time(action: Callable[[], object], rounds: int) -> float:
    samples = []
    for _ in range(rounds):
        started = time.perf_counter()
        action()
        samples.append(time.perf_counter() - started)
    return statistics.median(samples)


def git_merge_file(
    directory: Path, env: dict[str, str], base: bytes, ours: bytes, theirs: bytes
) -> tuple[bytes | None, float]:
    """`git merge-file -p ours base theirs` on files: its result (None on a conflict) and
    how long the command took."""
    paths = [directory / name for name in ("ours", "base", "theirs")]
    for path, content in zip(paths, (ours, base, theirs), strict=True):
        path.write_bytes(content)
    started = time.perf_counter()
    done = subprocess.run(
        ["git", "merge-file", "-p", *map(str, paths)], capture_output=True, env=env, check=False
    )
    took = time.perf_counter() - started
    return (done.stdout if done.returncode == 0 else None), took


def slates_merge(base: bytes, ours: bytes, theirs: bytes) -> bytes | None:
    """Both rewrites refined and merged the way the service merges same-base submissions."""
    mine, accepted = refine(base, ours), refine(base, theirs)
    if mine is None or accepted is None:
        return None
    changes, conflicts = map_edits_pairwise([Edit(1, "/f", mine)], [[Edit(1, "/f", accepted)]])
    if conflicts:
        return None
    mapped = [e for change in changes if isinstance(change, Edit) for e in change.edits]
    return apply(apply(base, accepted), mapped)


def pure(top: Path, env: dict[str, str], rng: random.Random, rounds: int) -> None:
    lines = source(rng, BIG)
    base = b"".join(lines)
    ours, theirs = two_rewrites(rng, lines, CHANGES)
    edits = refine(base, ours) or ()
    expected, _ = git_merge_file(top, env, base, ours, theirs)
    if expected is None or slates_merge(base, ours, theirs) != expected:
        raise BenchFailure("the Slates merge of the two rewrites differs from git merge-file")
    (top / "a").write_bytes(base)
    (top / "b").write_bytes(ours)
    diff = ["git", "diff", "--no-index", "--no-color", str(top / "a"), str(top / "b")]

    def git_diff() -> None:
        subprocess.run(diff, capture_output=True, env=env, check=False)

    git_merge_s = statistics.median(
        git_merge_file(top, env, base, ours, theirs)[1] for _ in range(rounds)
    )
    figures = [
        ("git diff --no-index base ours", median_time(git_diff, rounds), "process"),
        ("git merge-file -p ours base theirs", git_merge_s, "process"),
        ("refine(base, ours)", median_time(lambda: refine(base, ours), rounds), "in process"),
        (
            "Slates merge: refine x2 + map + apply",
            median_time(lambda: slates_merge(base, ours, theirs), rounds),
            "in process",
        ),
    ]
    print(
        f"(a) pure: {len(base) / 2**20:.2f} MiB, {len(lines):,} lines; ours and theirs "
        f"{CHANGES} changes each; refine(base, ours) = {len(edits)} edits of "
        f"{sum(e.end - e.start for e in edits)} base bytes; merge == git merge-file: yes"
    )
    print(f"{'':<40}{'median ms':>10}{'x git diff':>12}{'x merge-file':>14}")
    for label, seconds, how in figures:
        print(
            f"{label:<40}{seconds * 1e3:>10.2f}{seconds / figures[0][1]:>12.2f}"
            f"{seconds / git_merge_s:>14.2f}   ({how})"
        )


@dataclass
class Submits:
    """One kind of submit over all rounds: latencies, outcomes, and git's times."""

    latencies: list[float] = field(default_factory=list)
    accepted: int = 0
    conflicts: int = 0
    refined: int = 0
    literal: int = 0
    git: list[float] = field(default_factory=list)


def _note(row: Submits, result: dict[str, Any], took: float) -> None:
    row.latencies.append(took)
    row.accepted += bool(result.get("ok"))
    row.conflicts += len(result.get("conflicts") or ())
    row.refined += len(result.get("refined") or ())
    row.literal += len(result.get("literal") or ())


async def _submit(client: AsyncClient, work: str) -> tuple[dict[str, Any], float]:
    started = time.perf_counter()
    result = await client.submit(work)
    return result, time.perf_counter() - started


async def _rewrite_pair(
    client: AsyncClient,
    green: str,
    path: str,
    contents: tuple[bytes, bytes, bytes],
    rows: tuple[Submits, Submits],
    git: tuple[Path, dict[str, str]],
) -> None:
    """Two agents write one file whole (ours, theirs) and submit one after the other; the
    head must be what git merge-file makes of it (or ours alone if theirs conflicted)."""
    base, ours, theirs = contents
    name = f"rw-{green}-{path.strip('/')}"
    works = [str((await client.create_work(green, f"{name}-{i}"))["id"]) for i in (0, 1)]
    for work, content in zip(works, (ours, theirs), strict=True):
        await client.write(work, path, content, truncate=True)
    first, took = await _submit(client, works[0])
    _note(rows[0], first, took)
    second, took = await _submit(client, works[1])
    _note(rows[1], second, took)
    expected, git_s = git_merge_file(*git, base, ours, base)
    rows[0].git.append(git_s)
    merged, git_s = git_merge_file(*git, base, theirs, ours)
    rows[1].git.append(git_s)
    head = await client.read(green, path)
    want = merged if second.get("ok") else expected if first.get("ok") else base
    if head != want:
        raise BenchFailure(f"{path}: the head is not what git merge-file makes")
    for work in works:
        await client.delete_volume(work)


async def service(
    runtime: Path,
    top: Path,
    env: dict[str, str],
    tree: dict[str, bytes],
    plans: dict[str, Any],
    rounds: int,
    agents: int,
) -> dict[str, Submits]:
    names = ("first", "second", "exact first", "exact second", "precise", "small")
    rows = {name: Submits() for name in names}
    merge_dir = top / "git"
    merge_dir.mkdir()
    git = (merge_dir, env)
    async with AsyncClient(runtime) as client:
        green = await client.create_green("refine-bench", base=top / "source")
        # The literal path, side by side: a green whose policy keeps rewrites exact.
        exact = await client.create_green("exact-bench", base=top / "big", rewrites="exact")
        for r in range(rounds):
            path = f"/big{r}.txt"
            base = tree[path]
            ours, theirs = plans[path]
            await _rewrite_pair(
                client, green, path, (base, ours, theirs), (rows["first"], rows["second"]), git
            )
            await _rewrite_pair(
                client,
                exact,
                path,
                (base, ours, theirs),
                (rows["exact first"], rows["exact second"]),
                git,
            )

            # The same changes as precise edits (what a recorded edit list looks like),
            # to a copy of the base: the submit without a rewrite to refine.
            copy = f"/precise{r}.txt"
            work = str((await client.create_work(green, f"precise-{r}"))["id"])
            for edit in reversed(refine(base, ours) or ()):
                await client.edit(work, copy, edit.start, edit.end, edit.data)
            result, took = await _submit(client, work)
            _note(rows["precise"], result, took)
            rows["precise"].git.append(rows["first"].git[-1])
            if result.get("conflicts"):
                raise BenchFailure(f"{copy}: precise edits of an untouched file conflicted")
            if await client.read(green, copy) != (ours if result.get("ok") else base):
                raise BenchFailure(f"{copy}: the head does not hold the precise edits")
            await client.delete_volume(work)

            works = [
                str((await client.create_work(green, f"small-{r}-{i}"))["id"])
                for i in range(agents)
            ]
            for i, work in enumerate(works):
                await client.write(
                    work, f"/agents/f{r}-{i:03}.txt", plans["small"][r][i], truncate=True
                )
            for i, work in enumerate(works):
                name = f"/agents/f{r}-{i:03}.txt"
                result, took = await _submit(client, work)
                _note(rows["small"], result, took)
                head_before = tree[name]  # no one else changes this file
                merged, git_s = git_merge_file(
                    merge_dir, env, tree[name], plans["small"][r][i], head_before
                )
                rows["small"].git.append(git_s)
                if result.get("ok") and await client.read(green, name) != merged:
                    raise BenchFailure(f"{name}: the head is not the agent's rewrite")
            for work in works:
                await client.delete_volume(work)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--agents", type=int, default=100)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--shards", type=int, default=2)
    args = parser.parse_args()
    if args.rounds < 1 or args.agents < 1:
        parser.error("--rounds and --agents are positive")
    began = time.monotonic()
    print(merge_bench._machine())
    print("command: python " + " ".join(sys.argv))
    rng = random.Random(args.seed)
    top = Path(tempfile.mkdtemp(prefix="slates-refine-bench-"))
    try:
        (top / "home").mkdir()
        env = git_env(top / "home")
        pure(top, env, rng, max(args.rounds, 9))

        tree: dict[str, bytes] = {}
        plans: dict[str, Any] = {"small": []}
        for r in range(args.rounds):
            lines = source(rng, BIG)
            tree[f"/big{r}.txt"] = tree[f"/precise{r}.txt"] = b"".join(lines)
            plans[f"/big{r}.txt"] = two_rewrites(rng, lines, CHANGES)
            small = []
            for i in range(args.agents):
                lines = source(rng, SMALL)
                tree[f"/agents/f{r}-{i:03}.txt"] = b"".join(lines)
                spots = rng.sample(range(2, len(lines) - 2, 8), SMALL_CHANGES)
                small.append(rewrite(rng, lines, spots))
            plans["small"].append(small)
        for name, content in tree.items():
            for directory in ("source", "big") if name.startswith("/big") else ("source",):
                target = top / directory / name.lstrip("/")
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(content)
        with merge_bench._anchor(top, args.shards) as runtime:
            rows = trio.run(service, runtime, top, env, tree, plans, args.rounds, args.agents)
    finally:
        shutil.rmtree(top, ignore_errors=True)

    print(
        f"\n(b) service: {args.rounds} rounds; a 1 MiB file written whole by two agents "
        f"({CHANGES} changes each, apart), submitted one after the other; {args.agents} "
        f"agents each writing their own {SMALL >> 10} KiB file whole ({SMALL_CHANGES} changes)"
    )
    header = (
        f"{'':<34}{'submits':>8}{'ok':>5}{'confl':>7}{'refined':>9}{'literal':>9}"
        f"{'med ms':>9}{'git ms':>9}{'x git':>8}"
    )
    print(header)
    print("-" * len(header))
    labels = {
        "first": "1 MiB rewrite, first submit",
        "second": "1 MiB rewrite, second (merges)",
        "exact first": "  --rewrites exact: first",
        "exact second": "  --rewrites exact: second",
        "precise": "1 MiB, same changes as edits",
        "small": f"{args.agents} agents, own 32 KiB rewrite",
    }
    for key, label in labels.items():
        row = rows[key]
        latency, git = statistics.median(row.latencies), statistics.median(row.git)
        print(
            f"{label:<34}{len(row.latencies):>8}{row.accepted:>5}{row.conflicts:>7}"
            f"{row.refined:>9}{row.literal:>9}{latency * 1e3:>9.2f}{git * 1e3:>9.2f}"
            f"{latency / git:>8.2f}"
        )
    agents_row = rows["small"]
    print(
        f"{args.agents} agents: all submits {sum(agents_row.latencies) / args.rounds:.3f} s a "
        f"round vs {sum(agents_row.git) / args.rounds:.3f} s of git merge-file"
    )
    print(
        "\nmed ms = one submit through the SDK (median); git ms = git merge-file of the same "
        "file's base, the agent's content and the head's (median);\nrefined / literal = paths "
        "the service reports refined, or kept literal as too large to refine; confl = "
        "conflicts reported\n(--rewrites exact keeps every rewrite a whole replacement: "
        "the second agent's rewrite conflicts, as every rewrite did before refinement)"
    )
    print(f"finished in {time.monotonic() - began:.1f} s")


if __name__ == "__main__":
    main()
