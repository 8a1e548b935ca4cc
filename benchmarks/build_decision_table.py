"""Build the default mode's decision table (fusenorm_inductor/tuning/table.py) from a tuning cache that measured
decisions filled on one GPU: run a grid with measuring on, then turn what it measured into the shipped table.

    FUSENORM_TUNE=1 FUSENORM_CACHE_DIR=/tmp/tc python benchmarks/bench_never_slower.py --out never_slower_h100.json
    python benchmarks/build_decision_table.py /tmp/tc/tuning-v1.json --results never_slower_h100.json \
        --out fusenorm_inductor/tuning/tables/h100.json

Each decision entry of the cache (a site's measured fused and unfused times, host times, training-step
times, the configuration measured fastest, each GEMM's for a deferred site) becomes one point under its
signature (the decision key without M). Entries measured in another Inductor mode, bucket entries,
launch-only entries and failed measurements are left out. With ``--merge``, the points of an existing table
are kept where the new cache has none.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from fusenorm_inductor.tuning import table  # noqa: E402
from fusenorm_inductor.tuning.measure import LAUNCH_ONLY, TABLE  # noqa: E402

TIMES = ("t_fused_ms", "t_unfused_ms", "h_fused_us", "h_unfused_us", "t_fused_step_ms", "t_unfused_step_ms")


def points_of(cache: dict) -> tuple[list[dict], dict]:
    """(the points, {"copy_gbps": ..., "device": ...}) of a tuning cache's entries."""
    points, extra = [], {}
    for disk_key, entry in sorted(cache.items()):
        parts = json.loads(disk_key)
        device, kind, rest = parts[0], parts[2], parts[3:]
        if kind == "copy_gbps":
            if isinstance(entry, dict) and isinstance(entry.get("gbps"), (int, float)) and rest[1] == "default":
                extra.update(copy_gbps=entry["gbps"], device=device)
            continue
        if not isinstance(entry, dict) or rest[-2] != "default":  # measured under max-autotune: other baselines
            continue
        if entry.get("unfused_by") in (LAUNCH_ONLY, TABLE) or entry.get("t_unfused_ms") is None:
            continue
        sig, m = table.signature(rest)
        if sig is None or not isinstance(entry.get("t_fused_ms"), (int, float)):
            continue
        p = {"kind": kind, "signature": sig, "M": m, "config": entry.get("config"),
             "unfused_by": entry.get("unfused_by")}
        p.update({k: entry.get(k) for k in TIMES if isinstance(entry.get(k), (int, float))})
        if isinstance(entry.get("gemm_labels"), list):
            p["gemm_labels"] = entry["gemm_labels"]
        points.append(p)
    return points, extra


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("cache", help="a tuning cache file (tuning-v*.json) filled by measured decisions")
    ap.add_argument("--results", help="the benchmark results file of the same run (its meta names the GPU)")
    ap.add_argument("--family", help="h100 or h200 (default: from the GPU name)")
    ap.add_argument("--merge", action="store_true", help="keep an existing --out table's other points")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    with open(args.cache) as f:
        points, extra = points_of(json.load(f))
    meta = {}
    if args.results:
        with open(args.results) as f:
            meta = json.load(f).get("meta", {})
    gpu = meta.get("gpu") or (extra.get("device") or "").split("|")[0]
    fam = args.family or next((f.lower() for f in ("H100", "H200") if f in gpu.upper()), None)
    if fam is None:
        ap.error(f"cannot tell the GPU family of {gpu!r}: pass --family")
    if args.merge and os.path.exists(args.out):
        with open(args.out) as f:
            old = json.load(f)
        have = {(p["signature"], p["M"]) for p in points}
        points += [p for p in old.get("points", []) if (p["signature"], p["M"]) not in have]
    data = {"version": table.TABLE_VERSION, "family": fam, "gpu": gpu, "torch": meta.get("torch"),
            "triton": meta.get("triton"), "date": (meta.get("date") or "")[:10], "commit": meta.get("commit"),
            "source": f"{os.path.basename(args.cache)} measured with {meta.get('script', 'a benchmark')}",
            "copy_gbps": extra.get("copy_gbps"), "points": sorted(points, key=lambda p: (p["signature"], p["M"]))}
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(data, f, indent=0, sort_keys=True)
        f.write("\n")
    print(f"wrote {args.out}: {len(points)} points, family {fam}, copy {extra.get('copy_gbps')} GB/s")
    return data


if __name__ == "__main__":
    main()
