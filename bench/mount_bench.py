"""Read a generated tree through a Slates mount and directly, side by side.

Prints, for cold and warm passes of `find . -type f | xargs cat`, the time on
the plain directory and through a mounted Slates volume over it, the ratio,
and how many userspace requests each Slates pass sent (the bridge's own
counters).  Run as root: `python bench/mount_bench.py [--files N]`.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from slates import Client
from slates.fuse.bridge import kernel_requests
from slates.node.anchor import spawn_anchor

__all__ = ["main"]


def _tree(root: Path, files: int) -> None:
    for i in range(files):
        directory = root / f"d{i // 100:03}"
        directory.mkdir(parents=True, exist_ok=True)
        (directory / f"f{i:05}.c").write_bytes(os.urandom(200 + (i * 7919) % 8000))


def _drop_caches() -> None:
    subprocess.run(["sync"], check=True)
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def _pass(where: Path, runtime: Path) -> tuple[float, int]:
    """One pass: (seconds, userspace requests the bridge received during it)."""
    before = kernel_requests(runtime)
    started = time.perf_counter()
    subprocess.run(
        "find . -type f -print0 | xargs -0 cat > /dev/null", shell=True, cwd=where, check=True
    )
    elapsed = time.perf_counter() - started
    after = kernel_requests(runtime)
    return elapsed, after - before


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--files", type=int, default=5000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    top = Path(tempfile.mkdtemp(prefix="slates-bench-"))
    source, runtime, mnt = top / "source", top / "run", top / "mnt"
    _tree(source, args.files)
    mnt.mkdir()
    anchor = spawn_anchor(runtime, shards=2, capacity="4GiB")
    try:
        with Client(runtime) as client:
            volume = client.create_volume("bench", base=source)
            client.mount(volume["id"], mnt)
            try:
                rows = []
                requests: list[tuple[int, int, int]] = []
                for label, where in (("plain directory", source), ("slates mount", mnt)):
                    cold, warm, steady = [], [], []
                    for _ in range(args.rounds):
                        _drop_caches()
                        cold_s, cold_n = _pass(where, runtime)
                        warm_s, warm_n = _pass(where, runtime)
                        steady_s, steady_n = _pass(where, runtime)
                        cold.append(cold_s)
                        warm.append(warm_s)
                        steady.append(steady_s)
                        if where == mnt:
                            requests.append((cold_n, warm_n, steady_n))
                    rows.append(
                        (
                            label,
                            statistics.median(cold),
                            statistics.median(warm),
                            statistics.median(steady),
                        )
                    )
            finally:
                client.unmount(mnt)
    finally:
        anchor.terminate()
        anchor.wait()
        shutil.rmtree(top, ignore_errors=True)
    base = rows[0][1:]
    print(f"{args.files} files, median of {args.rounds} rounds (cold: page cache dropped;")
    print("warm: the pass after it; steady: the pass after that)")
    header = ("cold s", "warm s", "steady s", "cold x", "warm x", "steady x")
    print(f"{'':18}" + "".join(f"{h:>10}" for h in header))
    for label, *times in rows:
        ratios = [t / b for t, b in zip(times, base, strict=True)]
        print(
            f"{label:18}"
            + "".join(f"{v:10.3f}" for v in times)
            + "".join(f"{r:10.2f}" for r in ratios)
        )
    print("x = time / plain directory time")
    print("userspace requests per Slates pass (cold, warm, steady):", requests)


if __name__ == "__main__":
    main()
