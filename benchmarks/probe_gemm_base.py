"""Probe for the next kernels (issue: GEMM + norm at Hopper speed): how close a persistent TMA Triton GEMM
gets to cuBLAS on the skinny M = 262144 shapes, and what a "row block per program" LayerNorm epilogue costs.

Not used by the plugin. It measures, per (K, N), bf16, M = 262144:
- cuBLAS ``a @ w.t()``;
- ``gemm_tma``: persistent, device-side TMA descriptors, grouped tile order, a few tile configs;
- ``ln_rowblock``: persistent over blocks of BLOCK_M rows; each program runs the GEMM over all N tiles of
  its row block, stores each tile of h (into y) and folds its row statistics into running (mean, M2) with
  Chan's formula; then re-reads its row block (still in L2: BLOCK_M x N x 2 bytes per program) and
  normalizes in place. No cross-program reduction, no atomics, any N that BLOCK_N divides;
- Inductor (dynamic=False): ``layer_norm(a @ w.t())`` (t_unfused) and ``layer_norm(h)`` alone (t_norm),
  giving the seed's metric: hidden = (t_unfused - t_fused) / t_norm.

    python benchmarks/probe_gemm_base.py --out benchmarks/results/probe_gemm_base_h200.json
"""

from __future__ import annotations

import argparse
import datetime
import json

import torch
import triton
import triton.language as tl

SHAPES = [(256, 256), (512, 512), (1024, 1024), (2048, 2048), (512, 2048), (2048, 512)]
GEMM_CONFIGS = [  # (BLOCK_M, BLOCK_N, BLOCK_K, num_stages, num_warps)
    (128, 128, 64, 4, 8),
    (128, 256, 64, 3, 8),
    (128, 128, 128, 3, 8),
    (256, 128, 64, 3, 8),
]
LN_CONFIGS = [(64, 128, 64, 4, 4), (128, 128, 64, 4, 8), (64, 256, 64, 3, 8), (128, 256, 64, 3, 8)]


@triton.jit
def gemm_tma(a_ptr, w_ptr, c_ptr, M, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
             BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, NUM_SMS: tl.constexpr):
    """c = a @ w.T; a [M, K], w [N, K], c [M, N], all row-major, persistent over output tiles."""
    a_desc = tl.make_tensor_descriptor(a_ptr, [M, K], [K, 1], [BLOCK_M, BLOCK_K])
    w_desc = tl.make_tensor_descriptor(w_ptr, [N, K], [K, 1], [BLOCK_N, BLOCK_K])
    c_desc = tl.make_tensor_descriptor(c_ptr, [M, N], [N, 1], [BLOCK_M, BLOCK_N])
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    group = GROUP_M * num_pid_n
    for tile in tl.range(tl.program_id(0), num_pid_m * num_pid_n, NUM_SMS, flatten=True):
        first_m = (tile // group) * GROUP_M
        size_m = tl.minimum(num_pid_m - first_m, GROUP_M)
        pid_m = first_m + (tile % group) % size_m
        pid_n = (tile % group) // size_m
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ki in range(k_tiles):
            a = a_desc.load([pid_m * BLOCK_M, ki * BLOCK_K])
            w = w_desc.load([pid_n * BLOCK_N, ki * BLOCK_K])
            acc = tl.dot(a, w.T, acc)
        c_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N], acc.to(c_ptr.dtype.element_ty))


@triton.jit
def ln_rowblock(a_ptr, w_ptr, y_ptr, mean_ptr, rstd_ptr, M, N, K, eps, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_SMS: tl.constexpr):
    """y = LayerNorm(a @ w.T) without affine; one program owns BLOCK_M whole rows at a time."""
    a_desc = tl.make_tensor_descriptor(a_ptr, [M, K], [K, 1], [BLOCK_M, BLOCK_K])
    w_desc = tl.make_tensor_descriptor(w_ptr, [N, K], [K, 1], [BLOCK_N, BLOCK_K])
    n_tiles = N // BLOCK_N
    k_tiles = tl.cdiv(K, BLOCK_K)
    cols = tl.arange(0, BLOCK_N)
    for rb in tl.range(tl.program_id(0), tl.cdiv(M, BLOCK_M), NUM_SMS):
        rows = rb * BLOCK_M + tl.arange(0, BLOCK_M)
        run_mean = tl.zeros((BLOCK_M,), dtype=tl.float32)
        run_m2 = tl.zeros((BLOCK_M,), dtype=tl.float32)
        for j in range(n_tiles):
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for ki in range(k_tiles):
                a = a_desc.load([rb * BLOCK_M, ki * BLOCK_K])
                w = w_desc.load([j * BLOCK_N, ki * BLOCK_K])
                acc = tl.dot(a, w.T, acc)
            tmean = tl.sum(acc, axis=1) / BLOCK_N
            d = acc - tmean[:, None]
            tm2 = tl.sum(d * d, axis=1)
            # Chan: merge (j*BN, run_mean, run_m2) with (BN, tmean, tm2).
            n_old = j * BLOCK_N
            n_new = n_old + BLOCK_N
            delta = tmean - run_mean
            run_mean += delta * (BLOCK_N / n_new)
            run_m2 += tm2 + delta * delta * (n_old * BLOCK_N / n_new)
            tl.store(y_ptr + rows[:, None] * N + (j * BLOCK_N + cols)[None, :], acc.to(y_ptr.dtype.element_ty))
        rstd = tl.rsqrt(run_m2 / N + eps)
        tl.store(mean_ptr + rows, run_mean)
        tl.store(rstd_ptr + rows, rstd)
        tl.debug_barrier()  # h written by all threads of the program is visible to all of them
        for j in range(n_tiles):
            ptrs = y_ptr + rows[:, None] * N + (j * BLOCK_N + cols)[None, :]
            h = tl.load(ptrs).to(tl.float32)
            tl.store(ptrs, ((h - run_mean[:, None]) * rstd[:, None]).to(y_ptr.dtype.element_ty))
        tl.debug_barrier()


@triton.jit
def ln_fulltile(a_ptr, w_ptr, y_ptr, M, N, K, eps, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr, NUM_SMS: tl.constexpr):
    """y = LayerNorm(a @ w.T), BLOCK_N == N: the whole row in registers, normalized in the epilogue of a
    flattened persistent loop (so the next row block's loads overlap this epilogue)."""
    a_desc = tl.make_tensor_descriptor(a_ptr, [M, K], [K, 1], [BLOCK_M, BLOCK_K])
    w_desc = tl.make_tensor_descriptor(w_ptr, [N, K], [K, 1], [BLOCK_N, BLOCK_K])
    y_desc = tl.make_tensor_descriptor(y_ptr, [M, N], [N, 1], [BLOCK_M, BLOCK_N])
    k_tiles = tl.cdiv(K, BLOCK_K)
    for rb in tl.range(tl.program_id(0), tl.cdiv(M, BLOCK_M), NUM_SMS, flatten=True):
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ki in range(k_tiles):
            acc = tl.dot(a_desc.load([rb * BLOCK_M, ki * BLOCK_K]), w_desc.load([0, ki * BLOCK_K]).T, acc)
        mean = tl.sum(acc, axis=1) / N
        d = acc - mean[:, None]
        rstd = tl.rsqrt(tl.sum(d * d, axis=1) / N + eps)
        y_desc.store([rb * BLOCK_M, 0], (d * rstd[:, None]).to(y_ptr.dtype.element_ty))


FULLTILE_CONFIGS = [(128, 3, 8), (64, 4, 4), (64, 3, 8), (128, 2, 16)]  # (BLOCK_M, stages, warps), BLOCK_N = N


def _bench(fn):
    from triton.testing import do_bench

    fn()
    torch.cuda.synchronize()
    return do_bench(fn, warmup=25, rep=150, return_mode="median")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=262144)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    m = args.rows
    rows = []
    for k, n in SHAPES:
        torch.manual_seed(0)
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
        ref = a @ w.t()
        r = {"M": m, "K": k, "N": n, "cublas_ms": _bench(lambda: a @ w.t())}
        best = None
        for bm, bn, bk, st, nw in GEMM_CONFIGS:
            if bn > n:
                continue
            c = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            grid = (min(sms, triton.cdiv(m, bm) * triton.cdiv(n, bn)),)

            def run():
                gemm_tma[grid](a, w, c, m, n, k, bm, bn, bk, 8, sms, num_stages=st, num_warps=nw)

            try:
                t = _bench(run)
            except Exception as e:  # a config that does not compile is reported, not fatal
                r[f"gemm_{bm}x{bn}x{bk}_s{st}_w{nw}"] = f"failed: {type(e).__name__}"
                continue
            err = (c.float() - ref.float()).abs().max().item()
            r[f"gemm_{bm}x{bn}x{bk}_s{st}_w{nw}"] = {"ms": t, "maxerr": err}
            if err < 0.1 and (best is None or t < best[0]):
                best = (t, f"{bm}x{bn}x{bk}_s{st}_w{nw}")
        r["gemm_best_ms"], r["gemm_best_cfg"] = best if best else (None, None)
        if best:
            r["gemm_best_vs_cublas"] = r["cublas_ms"] / best[0]
        ln_ref = torch.nn.functional.layer_norm(ref.float(), (n,))
        best_ln = None
        for bm, bn, bk, st, nw in LN_CONFIGS:
            if bn > n or n % bn:
                continue
            y = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            mean = torch.empty(m, device="cuda")
            rstd = torch.empty(m, device="cuda")
            grid = (min(sms, triton.cdiv(m, bm)),)

            def run_ln():
                ln_rowblock[grid](a, w, y, mean, rstd, m, n, k, 1e-5, bm, bn, bk, sms, num_stages=st, num_warps=nw)

            try:
                t = _bench(run_ln)
            except Exception as e:
                r[f"ln_{bm}x{bn}x{bk}_s{st}_w{nw}"] = f"failed: {type(e).__name__}"
                continue
            err = (y.float() - ln_ref).abs().max().item()
            r[f"ln_{bm}x{bn}x{bk}_s{st}_w{nw}"] = {"ms": t, "maxerr": err}
            if err < 0.1 and (best_ln is None or t < best_ln[0]):
                best_ln = (t, f"{bm}x{bn}x{bk}_s{st}_w{nw}")
        for bm, st, nw in FULLTILE_CONFIGS if n <= 1024 else []:
            y = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            grid = (min(sms, triton.cdiv(m, bm)),)

            def run_full():
                ln_fulltile[grid](a, w, y, m, n, k, 1e-5, bm, n, 64, sms, num_stages=st, num_warps=nw)

            name = f"lnfull_{bm}x{n}x64_s{st}_w{nw}"
            try:
                t = _bench(run_full)
            except Exception as e:
                r[name] = f"failed: {type(e).__name__}: {str(e)[:80]}"
                continue
            err = (y.float() - ln_ref).abs().max().item()
            r[name] = {"ms": t, "maxerr": err}
            if err < 0.1 and (best_ln is None or t < best_ln[0]):
                best_ln = (t, name)
        r["ln_best_ms"], r["ln_best_cfg"] = best_ln if best_ln else (None, None)
        torch._dynamo.reset()
        unfused = torch.compile(lambda a, w: torch.nn.functional.layer_norm(a @ w.t(), (n,)), dynamic=False)
        r["inductor_unfused_ms"] = _bench(lambda: unfused(a, w))
        torch._dynamo.reset()
        norm_only = torch.compile(lambda h: torch.nn.functional.layer_norm(h, (n,)), dynamic=False)
        r["inductor_norm_ms"] = _bench(lambda: norm_only(ref))
        if best_ln:
            r["ln_hidden"] = (r["inductor_unfused_ms"] - best_ln[0]) / r["inductor_norm_ms"]
        rows.append(r)
        print(json.dumps(r), flush=True)
    print(f"\n{'K':>5} {'N':>5} | {'cuBLAS':>7} {'gemm':>7} {'x':>5} {'cfg':>18} | {'unfused':>7} {'norm':>6} "
          f"{'ln fused':>8} {'hidden':>7} {'cfg':>16}")
    for r in rows:
        g = r["gemm_best_ms"] or float("nan")
        f = r["ln_best_ms"] or float("nan")
        print(f"{r['K']:5d} {r['N']:5d} | {r['cublas_ms']:7.3f} {g:7.3f} {r['cublas_ms'] / g:5.2f} "
              f"{str(r['gemm_best_cfg']):>18} | {r['inductor_unfused_ms']:7.3f} {r['inductor_norm_ms']:6.3f} "
              f"{f:8.3f} {r.get('ln_hidden', float('nan')):7.2f} {str(r['ln_best_cfg']):>16}")
    if args.out:
        meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
                "date": datetime.date.today().isoformat(), "dtype": "bfloat16"}
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
