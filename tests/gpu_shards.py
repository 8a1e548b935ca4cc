"""Run test files on a GPU machine in parallel shards, within a wall-clock budget, and summarize.

The GPU tests are dominated by kernel compiles, which use one CPU core each: on a 16-core GPU host, shards of
the collected test ids run side by side finish several times sooner than one pytest process, which matters
where device time is rationed. Each shard is one ``pytest`` process over every n-th test id: the slow files
(the Gluon kernels' compiles) spread over all shards instead of piling up in a few, and a budget that runs
out leaves a little of every file unrun rather than whole files. Triton's on-disk cache shares compiled
kernels between the shards.

    python tests/gpu_shards.py --shards 12 --budget 540 --out /tmp/gpu tests/test_gluon_deferred_mm.py ...

Writes ``<out>/shard_<i>.log`` (each shard's ``pytest -rfEs`` output) and ``<out>/summary.txt``: the counts of
passed / failed / skipped / errors, every failure line, and the shards that ran out of time (their unfinished
tests are named as not run). Exits 1 when a test failed or errored or a shard timed out.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import time

GRACE_S = 20.0  # for an interrupted shard to print its failures
RESULT = re.compile(r"^(\S+::\S+) (PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)")


def collect(files: list[str]) -> list[str]:
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *files],
                         capture_output=True, text=True)
    ids = [line.strip() for line in out.stdout.splitlines() if "::" in line]
    if not ids:
        raise SystemExit(f"no tests collected:\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
    return ids


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("files", nargs="+")
    p.add_argument("--shards", type=int, default=max(1, (os.cpu_count() or 2) - 2))
    p.add_argument("--budget", type=float, default=540.0, help="seconds before unfinished shards are stopped")
    p.add_argument("--out", default="/tmp/gpu_shards")
    args = p.parse_args(argv)
    if args.shards < 1 or args.budget <= 0:
        p.error("--shards and --budget must be positive")
    os.makedirs(args.out, exist_ok=True)
    ids = collect(args.files)
    n = min(args.shards, len(ids))
    chunks = [ids[i::n] for i in range(n)]
    start = time.monotonic()
    procs = []
    for i, chunk in enumerate(chunks):
        log = open(os.path.join(args.out, f"shard_{i}.log"), "w")
        cmd = [sys.executable, "-m", "pytest", "-v", "-rfEs", "-p", "no:cacheprovider", *chunk]
        procs.append((subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT), log, chunk))
    timed_out = []
    for i, (proc, _, _) in enumerate(procs):
        try:
            proc.wait(timeout=max(0.1, args.budget - (time.monotonic() - start)))
        except subprocess.TimeoutExpired:
            timed_out.append(i)
    # An interrupted pytest still prints the tracebacks of the failures it has seen; a killed one prints none.
    for i in timed_out:
        procs[i][0].send_signal(signal.SIGINT)
    for i in timed_out:
        try:
            procs[i][0].wait(timeout=GRACE_S)
        except subprocess.TimeoutExpired:
            procs[i][0].kill()
            procs[i][0].wait()
    for _, log, _ in procs:
        log.close()
    counts: dict[str, int] = {}
    failures, not_run = [], []
    for i, (_, _, chunk) in enumerate(procs):
        seen = set()
        with open(os.path.join(args.out, f"shard_{i}.log")) as f:
            for line in f:
                m = RESULT.match(line)
                if m:
                    seen.add(m.group(1))
                    counts[m.group(2)] = counts.get(m.group(2), 0) + 1
                    if m.group(2) in ("FAILED", "ERROR"):
                        failures.append(line.rstrip())
                elif line.startswith(("FAILED ", "ERROR ")):
                    failures.append(line.rstrip())
        not_run += [t for t in chunk if t not in seen]
    lines = [f"{len(ids)} tests in {n} shards, {time.monotonic() - start:.0f} s",
             " ".join(f"{k.lower()}={v}" for k, v in sorted(counts.items())),
             f"not run: {len(not_run)}" + (f" (shards {timed_out} ran out of time)" if timed_out else "")]
    lines += ["", "failures:"] + sorted(set(failures)) + ["", "not run:"] + not_run
    summary = "\n".join(lines)
    with open(os.path.join(args.out, "summary.txt"), "w") as f:
        f.write(summary + "\n")
    print("\n".join(lines[:3] + sorted(set(failures))[:40]))
    return 1 if failures or timed_out else 0


if __name__ == "__main__":
    sys.exit(main())
