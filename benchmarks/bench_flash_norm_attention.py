"""FlashNormAttention benchmark (issue 5): the PFFN attention block, fused, against its two baselines.

The block (docs/algorithms.md section 5), norms over the H*D features of a token:
    ln_q = LayerNorm_{H*D}(q);  o = act(ln_q K^T) * scale @ V + ln_q;  out = RMSNorm_{H*D}(o) + q
Q jagged [sum L, H, D] (B sequences, lengths uniform in [max(1, (2s - 1) Lmax), Lmax], sparsity s = 0.5),
K/V dense [B, S, H, D], bf16, activation fast_gelu, scale 1, affine norms (weights ~ 1 + 0.1 randn, LN bias
~ 0.1 randn). Per point (H, Lmax, direction), medians of GPU time (CUDA graphs) and peak memory of:
    fused     ``torch.ops.fusenorm.flash_norm_attention`` (one op: both norms, both residuals, GDPA)
    seed      baseline (a), the seed's: the project's GDPA op with the norms and residual adds compiled by
              Inductor (``torch.compile(dynamic=False)`` around the gdpa custom op)
    dense     baseline (b): ``torch.compile(dynamic=False)`` of the padded dense composite (einsum, the
              tanh-form gelu, layer_norm, rms_norm, both residual adds) over [B, Lmax, H, D]
    gdpa      the GDPA op alone: TFLOP/s on the real (unpadded) FLOPs, against the bf16 matmul rate
              measured in the same run (cuBLAS 8192^3)
fwd: the forward alone (no grad); bwd: ``torch.autograd.grad`` of one forward's output (retain_graph) with
respect to q, k, v and the norm weights, not fwd+bwd - fwd. Reported: fused / seed and fused / dense time
ratios, "less time vs seed" = 1 - fused / seed, GDPA TFLOP/s and its share of the matmul rate, peak memory,
max |fused - seed| of the output (fwd) or of dq (bwd).

Run on the GPU machine (the default grid: H in {1, 2, 4, 8} x Lmax in {512, 1024, 2048, 3000}, B = 768,
S = 128, D = 128; the dense baseline at H = 8, Lmax = 3000 needs ~40 GB):
    python benchmarks/bench_flash_norm_attention.py --out benchmarks/results/flash_norm_attention_h200.json
    python benchmarks/bench_flash_norm_attention.py --dry-run      # CPU, tiny shapes: checks the calls only
    python benchmarks/bench_flash_norm_attention.py --triton-parts --out /tmp/fna_tl.json   # the fused attention
                                        # step and GDPA's backward on the Triton kernels instead of the Gluon ones
``--H``, ``--lmax``, ``--dirs``, ``--batch`` narrow the grid; ``--resume`` keeps the rows already in --out.
The whole grid compiles two Inductor baselines per point and direction: on two GPUs, split it and merge:
    CUDA_VISIBLE_DEVICES=0 python benchmarks/bench_flash_norm_attention.py --shard 0/2 --out /tmp/fna0.json &
    CUDA_VISIBLE_DEVICES=1 python benchmarks/bench_flash_norm_attention.py --shard 1/2 --out /tmp/fna1.json &
    wait; python benchmarks/bench_flash_norm_attention.py --merge /tmp/fna0.json /tmp/fna1.json \
        --out benchmarks/results/flash_norm_attention_h200.json
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_gemm_norm as gn  # noqa: E402  (its ceilings: the matmul rate and the copy bandwidth)
import common  # noqa: E402  (the shared harness: Bench, environment, JSON/PNG output)
from common import Bench  # noqa: E402

DTYPE = torch.bfloat16
LN_EPS, RMS_EPS = 1e-5, 1e-6
DEFAULT_OUT = "benchmarks/results/flash_norm_attention_h200.json"


# ----------------------------------------------------------------------------------------------------------
# Inputs and the three implementations
# ----------------------------------------------------------------------------------------------------------


class Case:
    """One point's inputs: jagged q with its offsets, dense k/v, norm weights, and the padded views."""

    def __init__(self, batch: int, s_kv: int, heads: int, dim: int, lmax: int, sparsity: float, device: str,
                 seed: int = 0):
        g = torch.Generator(device="cpu").manual_seed(seed)
        lo = max(1, int((2 * sparsity - 1) * lmax))
        lengths = torch.randint(lo, lmax + 1, (batch,), generator=g)
        self.lengths = lengths
        self.offsets = torch.zeros(batch + 1, dtype=torch.int32)
        self.offsets[1:] = torch.cumsum(lengths, 0)
        self.offsets = self.offsets.to(device)
        self.total = int(lengths.sum())
        self.batch, self.s_kv, self.heads, self.dim, self.lmax = batch, s_kv, heads, dim, lmax
        hd = heads * dim

        def rnd(*shape, scale=1.0):
            return (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=DTYPE)

        self.q = rnd(self.total, heads, dim)
        self.k = rnd(batch, s_kv, heads, dim, scale=dim ** -0.5)
        self.v = rnd(batch, s_kv, heads, dim, scale=s_kv ** -0.5)
        self.g1 = (1 + 0.1 * torch.randn(hd, generator=g)).to(device=device, dtype=DTYPE)
        self.b1 = (0.1 * torch.randn(hd, generator=g)).to(device=device, dtype=DTYPE)
        self.g2 = (1 + 0.1 * torch.randn(hd, generator=g)).to(device=device, dtype=DTYPE)
        # The padded dense layout of q (zeros past each length) and its row mask, for baseline (b).
        idx = torch.arange(lmax)[None, :] < lengths[:, None]  # [B, Lmax]
        self.mask = idx.to(device)
        self.q_pad = torch.zeros(batch, lmax, heads, dim, device=device, dtype=DTYPE)
        self.q_pad[self.mask] = self.q
        self.params = [self.q, self.k, self.v, self.g1, self.b1, self.g2]
        self.params_pad = [self.q_pad, self.k, self.v, self.g1, self.b1, self.g2]

    def gdpa_flops(self, direction: str) -> int:
        """Real (unpadded) FLOPs of GDPA: 2 matmuls forward (S = Q K^T, O = P V), 5 backward (S again, dV,
        dP, dQ, dK), 2 * L * S * D each, per head."""
        per = 2 * self.total * self.s_kv * self.dim * self.heads
        return per * (2 if direction == "fwd" else 5)


def fused_block(q, k, v, g1, b1, g2, offsets, lmax):
    return torch.ops.fusenorm.flash_norm_attention(
        q, k, v, offsets, lmax, g1, b1, g2, LN_EPS, RMS_EPS, "fast_gelu", 1.0
    )[0]


def seed_block(q, k, v, g1, b1, g2, offsets, lmax):
    """Baseline (a): the GDPA op (opaque to Inductor) with the norms and residuals around it."""
    t, h, d = q.shape
    ln = F.layer_norm(q.reshape(t, h * d), (h * d,), g1, b1, LN_EPS).view(t, h, d)
    o = torch.ops.fusenorm.gdpa(ln, k, v, offsets, lmax, "fast_gelu", 1.0) + ln
    return F.rms_norm(o.reshape(t, h * d), (h * d,), g2, RMS_EPS).view(t, h, d) + q


def dense_block(q, k, v, g1, b1, g2, mask):
    """Baseline (b): the padded dense composite; padded rows computed and then zeroed by the mask."""
    b, lq, h, d = q.shape
    ln = F.layer_norm(q.reshape(b, lq, h * d), (h * d,), g1, b1, LN_EPS).view(b, lq, h, d)
    s = torch.einsum("blhd,bshd->bhls", ln, k)
    p = F.gelu(s, approximate="tanh")
    o = torch.einsum("bhls,bshd->blhd", p, v) + ln
    out = F.rms_norm(o.reshape(b, lq, h * d), (h * d,), g2, RMS_EPS).view(b, lq, h, d) + q
    return out * mask[:, :, None, None]


# ----------------------------------------------------------------------------------------------------------
# Timing one point
# ----------------------------------------------------------------------------------------------------------


def _timed(bench: Bench, direction: str, fn, inputs: list[torch.Tensor]) -> dict:
    """fn(*inputs) alone (no grad), or the backward alone of one forward (retain_graph) with respect to all
    inputs."""
    if direction == "fwd":
        with torch.no_grad():
            return bench.measure(lambda: fn(*inputs))
    leaves = [t.detach().requires_grad_() for t in inputs]
    out = fn(*leaves)
    # The same upstream gradient for every implementation (max_abs_diff compares dq), drawn on the CPU: after
    # a failed CUDA-graph capture the CUDA generator refuses to advance ("Offset increment outside graph
    # capture"), which cost the first H200 run its backward baselines.
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.device, out.dtype)
    return bench.measure(lambda: torch.autograd.grad(out, leaves, grad, retain_graph=True))


def run_point(case: Case, direction: str, bench: Bench, ceilings: dict, dense: bool) -> dict:
    row = {"B": case.batch, "S": case.s_kv, "H": case.heads, "D": case.dim, "Lmax": case.lmax, "dir": direction,
           "T": case.total}
    off, lmax = case.offsets, case.lmax
    seed_c = torch.compile(lambda *a: seed_block(*a, off, lmax), dynamic=False)
    dense_c = torch.compile(lambda *a: dense_block(*a, case.mask), dynamic=False)
    calls = {
        "fused": (lambda *a: fused_block(*a, off, lmax), case.params),
        "seed": (seed_c, case.params),
        "gdpa": (lambda q, k, v: torch.ops.fusenorm.gdpa(q, k, v, off, lmax, "fast_gelu", 1.0), case.params[:3]),
    }
    if dense:
        calls["dense"] = (dense_c, case.params_pad)
    outs = {}
    for name, (fn, inputs) in calls.items():
        try:
            res = _timed(bench, direction, fn, inputs)
            row[f"t_{name}_ms"], row[f"peak_{name}_mib"] = res["ms"], res["peak_mib"]
            if res["note"]:  # e.g. the CUDA-graph timer failed and do_bench timed it (launches included)
                row[f"note_{name}"] = res["note"]
            outs[name] = res["out"]
        except Exception as e:  # noqa: BLE001 (one failing implementation is recorded, the rest still run)
            row[f"error_{name}"] = f"{type(e).__name__}: {str(e)[:300]}"
        finally:
            if bench.cuda:
                torch.cuda.empty_cache()
    if "fused" in outs and "seed" in outs:
        a, b = outs["fused"], outs["seed"]
        a, b = (a, b) if direction == "fwd" else (a[0], b[0])  # bwd: dq
        row["max_abs_diff"] = (a.float() - b.float()).abs().max().item()
    derive(row, case, ceilings)
    return row


def derive(r: dict, case: Case, ceilings: dict) -> None:
    t_f, t_s, t_d, t_g = (r.get(f"t_{n}_ms") for n in ("fused", "seed", "dense", "gdpa"))
    if t_f and t_s:
        r["fused_over_seed"] = t_f / t_s
        r["less_time_vs_seed"] = 1 - t_f / t_s
    if t_f and t_d:
        r["dense_over_fused"] = t_d / t_f
    if t_g:
        tflops = case.gdpa_flops(r["dir"]) / t_g / 1e9
        r["gdpa_tflops"] = tflops
        r["gdpa_share_of_matmul"] = tflops / ceilings["matmul_tflops"]
    # The names issue 19's table uses for the same figures: baseline (a) is "seed", (b) is "dense".
    for alias, key in (("t_a_ms", "t_seed_ms"), ("t_b_ms", "t_dense_ms"), ("gdpa_peak_frac", "gdpa_share_of_matmul")):
        if key in r:
            r[alias] = r[key]


def line(r: dict) -> str:
    def f(key, spec=".3f"):
        v = r.get(key)
        return format(v, spec) if isinstance(v, (int, float)) else "-"

    errs = ",".join(k[6:] for k in r if k.startswith("error_"))
    return (f"H={r['H']} Lmax={r['Lmax']:5d} {r['dir']} | fused {f('t_fused_ms')} seed {f('t_seed_ms')} "
            f"dense {f('t_dense_ms')} gdpa {f('t_gdpa_ms')} ms | less vs seed {f('less_time_vs_seed', '+.0%')} "
            f"dense/fused {f('dense_over_fused', '.1f')}x | gdpa {f('gdpa_tflops', '.0f')} TFLOP/s "
            f"({f('gdpa_share_of_matmul', '.0%')}) | peak fused/seed {f('peak_fused_mib', '.0f')}/"
            f"{f('peak_seed_mib', '.0f')} MiB | diff {f('max_abs_diff', '.3g')}"
            + (f" | errors: {errs}" if errs else ""))


def summarize(rows: list[dict]) -> dict:
    out = {}
    for d in ("fwd", "bwd"):
        rs = [r for r in rows if r["dir"] == d]
        for key in ("less_time_vs_seed", "dense_over_fused", "gdpa_share_of_matmul"):
            vals = sorted(r[key] for r in rs if key in r)
            if vals:
                out[f"{d}_{key}"] = {"min": vals[0], "median": vals[len(vals) // 2], "max": vals[-1]}
    return out


def plot(data: dict, path: str) -> None:
    plt = common.pyplot()
    if plt is None:
        return
    rows = data["rows"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, d in zip(axes, ("fwd", "bwd")):
        rs = sorted((r for r in rows if r["dir"] == d), key=lambda r: (r["H"], r["Lmax"]))
        labels = [f"H{r['H']}\nL{r['Lmax']}" for r in rs]
        x = range(len(rs))
        ax.bar([i - 0.2 for i in x], [100 * r.get("less_time_vs_seed", 0) for r in rs], 0.4,
               label="less time vs (a) GDPA + Inductor norms, %")
        ax.bar([i + 0.2 for i in x], [10 * r.get("dense_over_fused", 0) for r in rs], 0.4,
               label="speedup vs (b) dense composite, x10")
        ax.axhline(40 if d == "fwd" else 20, color="k", ls="--", lw=0.8, label="target vs (a)")
        ax.set_xticks(list(x), labels, fontsize=7)
        ax.set_title(f"{d}: {data['meta'].get('gpu', '')}")
        ax.legend(fontsize=7)
    fig.tight_layout()
    common.save_figure(fig, path, dpi=120)


# ----------------------------------------------------------------------------------------------------------
# Driver
# ----------------------------------------------------------------------------------------------------------


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=None, help="sequences (default 768; dry run 3)")
    p.add_argument("--skv", type=int, default=None, help="K/V length (default 128; dry run 16)")
    p.add_argument("--dim", type=int, default=None, help="head dim (default 128; dry run 16)")
    p.add_argument("--H", default=None, help="comma list of head counts (default 1,2,4,8)")
    p.add_argument("--lmax", default=None, help="comma list of max Q lengths (default 512,1024,2048,3000)")
    p.add_argument("--dirs", default="fwd,bwd")
    p.add_argument("--sparsity", type=float, default=0.5)
    p.add_argument("--no-dense", action="store_true", help="skip baseline (b) (its memory grows with B*Lmax*H)")
    p.add_argument("--timer", choices=["cudagraph", "events"], default="cudagraph")
    p.add_argument("--rep-ms", type=float, default=30.0)
    p.add_argument("--out", default=None)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes (times meaningless)")
    p.add_argument("--shard", default="0/1", help="i/n: measure every n-th (H, Lmax) pair from the i-th")
    p.add_argument("--merge", nargs="+", metavar="JSON", help="merge partial runs (--shard) into --out, plot")
    p.add_argument("--triton-parts", action="store_true",
                   help="switch off the sm_90 Gluon kernels to time the Triton ones they replace: the fused block's "
                        "attention step and whole block at H = 1 (flash_norm_attention_kernels.GLUON_ATTENTION, "
                        "GLUON_BLOCK) and GDPA's backward (gdpa_kernels.GLUON_BACKWARD)")
    a = p.parse_args(argv)
    dry = a.dry_run
    a.batch = a.batch or (3 if dry else 768)
    a.skv = a.skv or (16 if dry else 128)
    a.dim = a.dim or (16 if dry else 128)
    a.H = [int(x) for x in (a.H or ("1,2" if dry else "1,2,4,8")).split(",")]
    a.lmax = [int(x) for x in (a.lmax or ("8,24" if dry else "512,1024,2048,3000")).split(",")]
    a.dirs = a.dirs.split(",")
    a.out = a.out or ("/tmp/flash_norm_attention_dry.json" if dry else DEFAULT_OUT)
    return a


def pairs(args) -> list[tuple[int, int]]:
    """The (H, Lmax) pairs of this shard, costly ones (large H * Lmax) spread over the shards."""
    i, n = map(int, args.shard.split("/"))
    if not 0 <= i < n:
        raise SystemExit(f"--shard {args.shard}: expected i/n with 0 <= i < n")
    every = sorted(((h, lmax) for h in args.H for lmax in args.lmax), key=lambda p: p[0] * p[1])
    return every[i::n]


def merge_runs(paths: list[str], out: str) -> None:
    data = common.merge(paths, key=lambda r: (r["H"], r["Lmax"], r["dir"]))
    data["summary"] = summarize(data["rows"])
    common.write_json(out, data)
    print(data["summary"])
    plot(data, common.png_path(out))


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.merge:
        merge_runs(args.merge, args.out)
        return
    device = "cpu" if args.dry_run else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU (or --dry-run)")
    import fusenorm_inductor  # noqa: F401  (registers torch.ops.fusenorm.*)
    from fusenorm_inductor.ops import flash_norm_attention as fna

    # The op's offset check reads the offsets on the host (a sync per call, and no CUDA-graph capture): the
    # benchmark's offsets are valid by construction, so it times the kernels without it (gdpa has no check
    # on CUDA by default).
    fna.CHECK_OFFSETS = False
    from fusenorm_inductor.kernels.hopper import gdpa as hopper_gdpa
    from fusenorm_inductor.kernels.triton import flash_norm_attention as flash_norm_attention_kernels, gdpa as gdpa_kernels

    if args.triton_parts:
        flash_norm_attention_kernels.GLUON_ATTENTION = False
        flash_norm_attention_kernels.GLUON_BLOCK = False
        gdpa_kernels.GLUON_BACKWARD = False

    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    bench = Bench(args.timer, args.rep_ms, device)
    ceilings = gn.measure_ceilings(bench, device, args.dry_run)
    done = common.read_rows(args.out, lambda r: (r["H"], r["Lmax"], r["dir"])) if args.resume else {}
    meta = {
        **common.environment(device, python=False),  # gpu, torch, triton, date, commit
        "dtype": "bfloat16", "ceilings": ceilings,
        "timer": "wall clock, CPU (dry run)" if device != "cuda" else f"{args.timer} median, ms",
        "offset_checks": "off (flash_norm_attention.CHECK_OFFSETS = False; gdpa does not check on CUDA)",
        "gluon_switches": {"GLUON_ATTENTION": flash_norm_attention_kernels.GLUON_ATTENTION,
                           "GLUON_BACKWARD": gdpa_kernels.GLUON_BACKWARD,
                           "GLUON_BLOCK": flash_norm_attention_kernels.GLUON_BLOCK,
                           "STAGE_STATS": hopper_gdpa.STAGE_STATS},
        "shape": {"B": args.batch, "S": args.skv, "D": args.dim, "sparsity": args.sparsity,
                  "activation": "fast_gelu", "scale": 1.0, "ln_eps": LN_EPS, "rms_eps": RMS_EPS},
    }
    rows = list(done.values())
    for h, lmax in pairs(args):  # one (H, Lmax) pair: its inputs are shared by both directions
        case = None
        for d in args.dirs:
            if (h, lmax, d) in done:
                continue
            case = case or Case(args.batch, args.skv, h, args.dim, lmax, args.sparsity, device)
            t0 = time.time()
            torch._dynamo.reset()
            r = run_point(case, d, bench, ceilings, dense=not args.no_dense)
            r["point_s"] = time.time() - t0
            print(line(r), flush=True)
            rows.append(r)
            common.write_json(args.out, {"meta": meta, "rows": rows, "summary": summarize(rows)}, quiet=True)
        case = None
        if device == "cuda":
            torch.cuda.empty_cache()
    data = {"meta": meta, "rows": rows, "summary": summarize(rows)}
    common.write_json(args.out, data)
    print(data["summary"])
    plot(data, common.png_path(args.out))


if __name__ == "__main__":
    main()
