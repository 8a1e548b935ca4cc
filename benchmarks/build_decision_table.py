"""Build the default mode's decision table (fusenorm_inductor/tuning/table.py) from a tuning cache that measured
decisions filled on one GPU: run a grid with measuring on, then turn what it measured into the shipped table.

    FUSENORM_TUNE=1 FUSENORM_CACHE_DIR=/tmp/tc python benchmarks/bench_never_slower.py --out never_slower_h100.json
    python benchmarks/build_decision_table.py /tmp/tc/tuning-v1.json --results never_slower_h100.json \
        --out fusenorm_inductor/tuning/tables/h100.json

Each decision entry of the cache (a site's measured fused and unfused times, host times, training-step
times, the configuration measured fastest, each GEMM's for a deferred site) becomes one point under its
signature (the decision key without M). Entries measured in another Inductor mode, bucket entries,
launch-only entries and failed measurements are left out. With ``--merge``, the points of an existing table
are kept where the new cache has none; ``--host-minima`` lowers each point's host times to those an earlier
table measured for it (host times are the least of timed loops, and only noise raises them).
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
        if kind == "unfused_host_us":  # the bare unfused pair's host time (measure.unfused_host_us)
            if isinstance(entry, dict) and isinstance(entry.get("us"), (int, float)) and rest[1] == "default":
                extra.update(unfused_host_us=entry["us"])
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


def lower_host_times(points: list[dict], others: list[dict]) -> int:
    """Each point's host times lowered to another measurement's of the same point (signature and M; the fused
    side only where it ran the same configuration). A host time is the least of timed loops (measure.host_us):
    noise only adds to it, so the least over two runs on the same GPU family is the better figure. Returns how
    many points changed."""
    by = {(p["signature"], p["M"]): p for p in others}
    changed = 0
    for p in points:
        o = by.get((p["signature"], p["M"]))
        if o is None:
            continue
        before = (p.get("h_fused_us"), p.get("h_unfused_us"))
        if o.get("config") == p.get("config") and isinstance(o.get("h_fused_us"), (int, float)) \
                and isinstance(p.get("h_fused_us"), (int, float)):
            p["h_fused_us"] = min(p["h_fused_us"], o["h_fused_us"])
        if isinstance(o.get("h_unfused_us"), (int, float)) and isinstance(p.get("h_unfused_us"), (int, float)):
            p["h_unfused_us"] = min(p["h_unfused_us"], o["h_unfused_us"])
        changed += before != (p.get("h_fused_us"), p.get("h_unfused_us"))
    return changed


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("cache", help="a tuning cache file (tuning-v*.json) filled by measured decisions, or a table "
                                  "built before (its points and measurement facts are taken as they are)")
    ap.add_argument("--results", help="the benchmark results file of the same run (its meta names the GPU)")
    ap.add_argument("--family", help="h100 or h200 (default: from the GPU name)")
    ap.add_argument("--merge", action="store_true", help="keep an existing --out table's other points")
    ap.add_argument("--unfused-host-us", type=float,
                    help="the bare unfused pair's host time of the run, us, where its cache lacks it (caches "
                         "written before it was kept there; the run's decision reasons name it)")
    ap.add_argument("--host-minima", nargs="+", default=[], metavar="TABLE",
                    help="tables of earlier runs on the same GPU family: each point's host times lowered to theirs "
                         "(lower_host_times)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    with open(args.cache) as f:
        loaded = json.load(f)
    base = loaded if isinstance(loaded.get("points"), list) and "version" in loaded else None
    if base is not None:
        points = base["points"]
        extra = {k: base.get(k) for k in ("copy_gbps", "unfused_host_us") if base.get(k) is not None}
    else:
        points, extra = points_of(loaded)
    meta = {}
    if base is not None:
        meta = {k: base.get(k) for k in ("gpu", "torch", "triton", "date", "commit")}
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
    lowered = 0
    for other in args.host_minima:
        with open(other) as f:
            lowered += lower_host_times(points, json.load(f).get("points", []))
    source = base["source"] if base is not None else \
        f"{os.path.basename(args.cache)} measured with {meta.get('script', 'a benchmark')}"
    if args.host_minima:
        source += (f"; host times the least of this run's and {len(args.host_minima)} earlier table(s)' "
                   f"({lowered} points lowered)")
    data = {"version": table.TABLE_VERSION, "family": fam, "gpu": gpu, "torch": meta.get("torch"),
            "triton": meta.get("triton"), "date": (meta.get("date") or "")[:10], "commit": meta.get("commit"),
            "source": source,
            "copy_gbps": extra.get("copy_gbps"),
            "unfused_host_us": extra.get("unfused_host_us", args.unfused_host_us), "points": sorted(points, key=lambda p: (p["signature"], p["M"]))}
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(data, f, indent=0, sort_keys=True)
        f.write("\n")
    print(f"wrote {args.out}: {len(points)} points, family {fam}, copy {extra.get('copy_gbps')} GB/s")
    return data


if __name__ == "__main__":
    main()
