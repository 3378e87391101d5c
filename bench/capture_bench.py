"""Another client's request latency while a shard captures a large directory (issue 12).

Side by side in one run, on one shard: a client doing 1-byte writes in a
loop, first alone (baseline), then while a second client captures a
generated tree (`--mib` MiB in 1 MiB files).  Prints the writer's p50, p99
and maximum latency in both phases, their ratio, and the capture's time.
A capture is a job (slates.node.jobs): its reads run in worker threads and
its records are committed in batches, so the writer is answered between
them.

    python bench/capture_bench.py [--mib 300]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import threading
import time
from pathlib import Path

from slates import Client
from slates.node.anchor import spawn_anchor, stop_process


def _tree(root: Path, mib: int) -> None:
    for n in range(mib):
        sub = root / f"d{n % 16}"
        sub.mkdir(parents=True, exist_ok=True)
        (sub / f"f{n}.bin").write_bytes(os.urandom(1 << 20))


def _profile(samples: list[float]) -> tuple[float, float, float]:
    ordered = sorted(samples)
    p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
    return statistics.median(ordered) * 1e3, p99 * 1e3, ordered[-1] * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=300)
    parser.add_argument("--baseline-seconds", type=float, default=3.0)
    args = parser.parse_args()
    top = Path(tempfile.mkdtemp(prefix="slates-capture-bench-"))
    anchor = None
    try:
        _tree(top / "src", args.mib)
        runtime = top / "run"
        anchor = spawn_anchor(runtime, shards=1, capacity=f"{2 * args.mib + 512}MiB")
        with Client(runtime) as client:
            busy = client.create_volume("busy")["id"]
            client.write(busy, "/x", b"a")
            latencies: list[tuple[float, float]] = []  # (when it was answered, how long it took)
            stop = threading.Event()

            def writer() -> None:
                with Client(runtime) as other:
                    while not stop.is_set():
                        started = time.perf_counter()
                        other.write(busy, "/x", b"b")
                        ended = time.perf_counter()
                        latencies.append((ended, ended - started))

            thread = threading.Thread(target=writer)
            thread.start()
            try:
                time.sleep(args.baseline_seconds)
                baseline_end = time.perf_counter()
                client.create_volume("captured", base=str(top / "src"), capture=True)
                capture_end = time.perf_counter()
            finally:
                stop.set()
                thread.join()
        alone = [took for when, took in latencies if when <= baseline_end]
        # A request waiting when the capture ended counts in full: its latency is its wait.
        during = [took for when, took in latencies if baseline_end < when <= capture_end + 1.0]
        a50, a99, amax = _profile(alone)
        d50, d99, dmax = _profile(during)
        print(f"capture of {args.mib} MiB: {capture_end - baseline_end:.2f} s")
        print(f"other client alone:          p50 {a50:.2f} ms  p99 {a99:.2f} ms  max {amax:.1f} ms")
        print(f"other client during capture: p50 {d50:.2f} ms  p99 {d99:.2f} ms  max {dmax:.1f} ms")
        ratio = f"p99 {d99 / a99:.1f}x, max {dmax / amax:.1f}x"
        print(f"ratio during/alone: {ratio} ({len(during)} writes)")
    finally:
        if anchor is not None:
            stop_process(anchor)
        shutil.rmtree(top, ignore_errors=True)


if __name__ == "__main__":
    main()
