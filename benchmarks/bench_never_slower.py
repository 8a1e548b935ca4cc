"""Never slower: a grid of post-norm, pre-norm and chain sites, in inference and training, compiled by fusenorm and
by Inductor, with a second, independent Inductor compile (the A/A) beside each, timed as users run them.

Each point is one small model: ``post`` linear -> LayerNorm (the norm's output is the model's), ``pre``
LayerNorm -> linear, ``chain`` linear -> RMSNorm -> GELU -> linear (``--norms`` adds the other norm to each).
Training times the whole step (forward, a loss, backward). Timing: plain calls, no CUDA graphs, so each
compile's host cost counts; ``--calls`` calls between two CUDA events, in rounds whose order rotates, medians
over the rounds. Per point: ``speedup`` (median over rounds of t_inductor / t_fusenorm), ``aa`` (t_inductor /
t_aa), ``slower``: the speedup below 1 by more than the A/A's own distance from 1, ``same_code``: fusenorm's
compiled code is Inductor's line for line (comments aside), so that a slower median there is the timer's. The
summary gives the worst speedup and how many points were slower, overall and where fusenorm's code differs.
What fusenorm fused is read from its match reports.

    python benchmarks/bench_never_slower.py --out benchmarks/results/never_slower_h100.json
    python benchmarks/bench_never_slower.py --dry-run     # CPU, tiny shapes: exercises the code only
"""

from __future__ import annotations

import copy
import os
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._inductor.utils import run_and_get_code

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

KINDS = ("post", "pre", "chain")
MODES = ("infer", "train")
NORM_OF = {"post": "ln", "pre": "ln", "chain": "rms"}
SHAPES = "256x256,384x768,512x512,1024x1024,2048x2048"
ROWS = "32768,262144"
# The timer's own floor: an A/A that happens to land on 1.000 does not make 0.5% below it a slowdown (points
# where nothing was fused compile to Inductor's own code and scatter by about that much).
NOISE = 0.01
DRY = {"shapes": "32x48", "rows": "64", "rounds": 2, "calls": 1}


class Site(nn.Module):
    def __init__(self, kind: str, norm: str, k: int, n: int, device, dtype):
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        self.kind = kind
        width = k if kind == "pre" else n
        self.norm = nn.LayerNorm(width, **kw) if norm == "ln" else nn.RMSNorm(width, eps=1e-6, **kw)
        self.a = nn.Linear(k, n, **kw)
        self.b = nn.Linear(n, n, **kw) if kind == "chain" else None
        with torch.no_grad():  # an affine that is not the identity
            self.norm.weight.normal_(1.0, 0.1)

    def forward(self, x):
        if self.kind == "pre":
            return self.a(self.norm(x))
        h = self.norm(self.a(x))
        return self.b(F.gelu(h)) if self.kind == "chain" else h


def points(args) -> list[dict]:
    norms = common.choices(args.parser, "--norms", args.norms, ("default", "ln", "rms")) if args.norms else ["default"]
    out = []
    for kind in common.choices(args.parser, "--kinds", args.kinds, KINDS):
        for norm in [NORM_OF[kind] if n == "default" else n for n in norms]:
            for shape in args.shapes.split(","):
                k, n = (int(v) for v in shape.split("x"))
                for m in (int(v) for v in args.rows.split(",")):
                    for mode in common.choices(args.parser, "--modes", args.modes, MODES):
                        out.append({"kind": kind, "norm": norm, "K": k, "N": n, "M": m, "mode": mode})
    return out


def _call(cm, model, x, mode: str):
    if mode == "infer":
        def infer():
            with torch.no_grad():
                return cm(x)
        return infer

    def step():
        model.zero_grad(set_to_none=True)
        loss = cm(x).float().square().mean()
        loss.backward()
        return loss.detach()
    return step


def measure_point(p: dict, args, device: str, dtype) -> dict:
    import fusenorm_inductor as fi

    torch.manual_seed(0)
    base = Site(p["kind"], p["norm"], p["K"], p["N"], device, dtype)
    x = torch.randn(p["M"], p["K"], device=device, dtype=dtype)
    row = dict(p)
    fns, reps, codes = {}, [], {}
    for name in ("inductor", "fusenorm", "inductor_aa"):
        model = common.own_code(copy.deepcopy(base))
        fi.report.clear()
        t0 = time.perf_counter()
        cm = torch.compile(model, backend="fusenorm" if name == "fusenorm" else "inductor", dynamic=False,
                           mode=args.mode)
        fn = _call(cm, model, x, p["mode"])
        _, codes[name] = run_and_get_code(fn)
        common.sync() if device == "cuda" else None
        row[f"compile_{name}_s"] = time.perf_counter() - t0
        if name == "fusenorm":
            reps = fi.reports()
        fns[name] = fn
    found = common.fused_patterns(reps)
    row.update({k: v for k, v in found.items() if k in ("fused", "fusenorm_errors")})
    # The decisions' own figures (measured fused vs unfused times, or why not), to set beside the step's.
    row["decisions"] = [f"{r.pattern}: {r.kernel} | {r.detail}"[:400] for rep in reps for r in rep.rewrites
                        if not r.pattern.startswith("canonical")]
    row["not_fused"] = sorted({f"{s.pattern}: {s.reason}"[:300] for rep in reps for s in rep.skips
                               if not s.pattern.startswith("canonical")})
    for fn in fns.values():
        for _ in range(3):
            fn()

    def run(name, _i):
        for _ in range(args.calls):
            fns[name]()

    times = common.event_rounds(tuple(fns), run, args.rounds, device == "cuda")
    med = common.medians(times)
    row.update({f"t_{k}_ms": v / args.calls for k, v in med.items()})
    row["speedup"] = common.ratio_median(times, "inductor", "fusenorm")
    row["aa"] = common.ratio_median(times, "inductor", "inductor_aa")
    row["slower"] = row["speedup"] < 1 - max(abs(1 - row["aa"]), NOISE)
    # Where fusenorm left the graph to Inductor, its compiled code must be Inductor's line for line (comments
    # aside): then a slower median is the timer's, not the code's.
    row["same_code"] = _same_code(codes["fusenorm"], codes["inductor"])
    if device == "cuda":
        for name in ("inductor", "fusenorm"):
            row[f"peak_{name}_mib"] = common.peak_mib(fns[name])
    if args.kernels and (row["fused"] != "none" or row["slower"]):
        # Where the time goes: each call's GPU time by kernel, fusenorm's and Inductor's.
        for name in ("inductor", "fusenorm"):
            row[f"kernels_{name}_ms"] = common.profile_kernels(fns[name], args.kernels)
    return row


def _code_lines(codes: list[str]) -> list[str]:
    """Every graph's output code without blank and comment lines (kernel paths, source-node lists)."""
    return [line for code in codes for line in code.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def _same_code(ours: list[str], theirs: list[str]):
    """Whether two compiles produced the same code (None where either was served without its code)."""
    return _code_lines(ours) == _code_lines(theirs) if ours and theirs else None


def summarize(rows: list[dict]) -> dict:
    ok = [r for r in rows if "speedup" in r]
    worst = min(ok, key=lambda r: r["speedup"], default=None)
    own = [r for r in ok if r.get("same_code") is not True]  # fusenorm's code differs (or is unknown)
    worst_own = min(own, key=lambda r: r["speedup"], default=None)
    keys = ("kind", "norm", "K", "N", "M", "mode", "aa", "fused")
    return {"points": len(rows), "measured": len(ok), "slower_beyond_aa": sum(r["slower"] for r in ok),
            "slower_beyond_aa_with_fusenorms_code": sum(r["slower"] for r in own),
            "same_code_points": sum(r.get("same_code") is True for r in ok),
            "worst_speedup": worst and worst["speedup"],
            "worst_point": worst and {k: worst[k] for k in keys},
            "worst_speedup_with_fusenorms_code": worst_own and worst_own["speedup"],
            "worst_point_with_fusenorms_code": worst_own and {k: worst_own[k] for k in keys},
            "fused_points": sum(r.get("fused", "none") != "none" for r in ok)}


def main(argv=None) -> dict:
    p = common.doc_parser(__doc__)
    p.add_argument("--kinds", default=",".join(KINDS))
    p.add_argument("--norms", default=None, help="comma list of ln, rms, default (each kind's own norm); default: "
                                                 "each kind's own")
    p.add_argument("--shapes", default=None, help=f"KxN,... (default {SHAPES})")
    p.add_argument("--rows", default=None, help=f"M values (default {ROWS})")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--rounds", type=int, default=None, help="rotating rounds (default 7)")
    p.add_argument("--calls", type=int, default=None, help="calls between two events (default 10)")
    p.add_argument("--kernels", type=int, default=0, help="CALLS: profile where a point fused or was slower: "
                                                          "GPU ms per call by kernel (0: off)")
    p.add_argument("--mode", default=None, choices=(None, "max-autotune", "max-autotune-no-cudagraphs"),
                   help="torch.compile's mode for all three compiles (default: Inductor's default mode, where "
                        "fusenorm decides from its table; max-autotune-no-cudagraphs: fusenorm measures, and "
                        "the calls stay plain)")
    p.add_argument("--out", default=None)
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes (times meaningless)")
    args = p.parse_args(argv)
    args.parser = p
    dry = args.dry_run or not torch.cuda.is_available()
    device, dtype = ("cpu", torch.float32) if dry else ("cuda", torch.bfloat16)
    args.shapes = args.shapes or (DRY["shapes"] if dry else SHAPES)
    args.rows = args.rows or (DRY["rows"] if dry else ROWS)
    args.rounds = args.rounds or (DRY["rounds"] if dry else 7)
    args.calls = args.calls or (DRY["calls"] if dry else 10)
    out = args.out or ("/tmp/never_slower_dry_run.json" if dry else "benchmarks/results/never_slower.json")
    rows = []
    grid = points(args)
    for i, pt in enumerate(grid):
        t0 = time.perf_counter()
        try:
            r = measure_point(pt, args, device, dtype)
        except Exception as e:  # noqa: BLE001 - one point's failure is a row that says so, not a lost run
            r = {**pt, "error": f"{type(e).__name__}: {str(e)[:300]}"}
        rows.append(r)
        print(f"[{i + 1}/{len(grid)}] {pt['kind']} {pt['norm']} {pt['K']}x{pt['N']} M={pt['M']} {pt['mode']}: "
              + (f"speedup {r['speedup']:.3f} (A/A {r['aa']:.3f}){' SLOWER' if r['slower'] else ''}, "
                 f"fused: {r['fused']}" if "speedup" in r else r["error"]) + f" ({time.perf_counter() - t0:.0f} s)",
              flush=True)
        common.write_json(out, _data(rows, args, device, dtype, dry), quiet=True)  # a run cut short keeps its rows
    data = _data(rows, args, device, dtype, dry)
    common.write_json(out, data)
    print("summary:", data["summary"])
    return data


def _data(rows, args, device, dtype, dry) -> dict:
    return {"meta": {**common.environment(device), "script": "benchmarks/bench_never_slower.py", "dry_run": dry,
                     "dtype": str(dtype).replace("torch.", ""), "rounds": args.rounds, "calls": args.calls,
                     "mode": args.mode or "default",
                     "timer": "CUDA events around --calls plain calls (no CUDA graphs), rotating rounds, medians",
                     "metrics": {"speedup": "median over rounds of t_inductor / t_fusenorm",
                                 "aa": "median over rounds of t_inductor / t_inductor_aa (a second compile)",
                                 "slower": f"speedup < 1 - max(|1 - aa|, {NOISE})",
                                 "same_code": "fusenorm's compiled code equals Inductor's, comments aside (None: "
                                              "a compile served without its code)"},
                     "fusenorm_decisions": {"1": "measured (FUSENORM_TUNE=1)", "0": "every match fused (FUSENORM_TUNE=0)"}.get(
                         os.environ.get("FUSENORM_TUNE", ""),
                         "measured (max-autotune)" if args.mode else "the default mode's table")},
            "rows": rows, "summary": summarize(rows)}


if __name__ == "__main__":
    main()
