"""The first training step, compile included, of fusenorm and of Inductor: each in a process of its own,
with cold caches (fresh Inductor, Triton and fusenorm cache directories) and then warm (a second process on the
same directories), in the default mode and under ``mode="max-autotune"``; the two backends alternate.

Models: the MLP tower of examples/train_mlp.py (6 x Linear -> LayerNorm, BCE head; d = 512 and 1024, M rows),
and a Llama-style stack (``llama``: RMSNorm -> attention (SDPA) -> residual, RMSNorm -> SwiGLU MLP -> residual;
4 layers, width 1024, 16 heads, batch 8 x 1024 tokens), bf16. Inductor's FX graph and AOTAutograd caches keep
their defaults (on), as users run them: "warm" is the second run of a user's script.

    python benchmarks/bench_first_step.py --out benchmarks/results/first_step_h100.json
    python benchmarks/bench_first_step.py --models mlp512 --modes default      # a subset
    python benchmarks/bench_first_step.py --dry-run                              # CPU, tiny: the code only

Rows: model, mode ("default" or "max-autotune"), caches ("cold" or "warm"), t_first_fusenorm_s,
t_first_inductor_s, ratio (fusenorm / Inductor), fused (what fusenorm rewrote in that process).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODELS = ("mlp512", "mlp1024", "llama")
MODES = ("default", "max-autotune")


def _llama(d: int, layers: int, heads: int, device, dtype):
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.n1, self.n2 = nn.RMSNorm(d, eps=1e-6), nn.RMSNorm(d, eps=1e-6)
            self.qkv, self.o = nn.Linear(d, 3 * d, bias=False), nn.Linear(d, d, bias=False)
            self.gate, self.up = nn.Linear(d, 4 * d, bias=False), nn.Linear(d, 4 * d, bias=False)
            self.down = nn.Linear(4 * d, d, bias=False)

        def forward(self, x):
            b, s, _ = x.shape
            q, k, v = self.qkv(self.n1(x)).view(b, s, 3, heads, d // heads).unbind(2)
            a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
            x = x + self.o(a.transpose(1, 2).reshape(b, s, d))
            h = self.n2(x)
            return x + self.down(F.silu(self.gate(h)) * self.up(h))

    class Stack(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.Sequential(*[Block() for _ in range(layers)])
            self.norm = nn.RMSNorm(d, eps=1e-6)

        def forward(self, x):
            return self.norm(self.blocks(x))

    return Stack().to(device, dtype)


def child(a) -> dict:
    """One process: build the model, compile it, time its first training step (wall seconds)."""
    sys.path[:0] = [ROOT, os.path.join(ROOT, "examples")]
    import torch

    import _common  # examples/_common.py
    import train_mlp

    import fusenorm_inductor

    dev = "cuda" if torch.cuda.is_available() and not a.dry_run else "cpu"
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    torch.manual_seed(0)
    if a.model.startswith("mlp"):
        d = 32 if a.dry_run else int(a.model[3:])
        model = train_mlp.MLP(d, d, 6).to(dev, dtype)
        batch = train_mlp.make_batches(64 if a.dry_run else a.rows, d, 1, dev, dtype)[0]

        def step(m, opt):
            return _common.train_step(m, opt, batch, train_mlp.bce_loss)
    else:
        d, heads, b, s = (64, 4, 2, 16) if a.dry_run else (1024, 16, 8, 1024)
        model = _llama(d, 2 if a.dry_run else 4, heads, dev, dtype)
        x = torch.randn(b, s, d, device=dev, dtype=dtype)

        def step(m, opt):
            loss = m(x).float().square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss
    _common.warm_up_compiler(dev)
    if dev == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    mode = None if a.mode == "default" else a.mode
    compiled = torch.compile(model, backend=a.backend, mode=mode, dynamic=False)
    step(compiled, _common.make_optimizer(model, 1e-3, dev))
    if dev == "cuda":
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    fused = sorted({w.pattern for r in fusenorm_inductor.reports() for w in (r.rewrites or [])
                    if not w.pattern.startswith("canonical")})
    return {"first_s": wall, "fused": fused}


def run_child(model: str, mode: str, backend: str, caches: str, args) -> dict:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": os.path.join(caches, "inductor"),
           "TRITON_CACHE_DIR": os.path.join(caches, "triton"), "FUSENORM_CACHE_DIR": os.path.join(caches, "fusenorm")}
    if args.dry_run:
        env["FUSENORM_CPU_REFERENCE"] = "1"
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--model", model, "--mode", mode, "--backend",
           backend, "--rows", str(args.rows)] + (["--dry-run"] if args.dry_run else [])
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout)
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    return {"error": (out.stderr or out.stdout)[-600:]}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--rows", type=int, default=262144, help="the MLP's rows per step")
    p.add_argument("--timeout", type=int, default=900, help="seconds per process")
    p.add_argument("--out", default=None)
    p.add_argument("--dry-run", action="store_true")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--mode", help=argparse.SUPPRESS)
    p.add_argument("--backend", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        print("RESULT " + json.dumps(child(a)), flush=True)
        return {}
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import common

    rows = []
    out = a.out or ("/tmp/first_step_dry_run.json" if a.dry_run else "benchmarks/results/first_step.json")
    for model in a.models.split(","):
        for mode in a.modes.split(","):
            dirs = {b: tempfile.mkdtemp(prefix=f"fn_first_{b}_") for b in ("fusenorm", "inductor")}
            for caches in ("cold", "warm"):  # the same directories: the second process finds them filled
                row = {"model": model, "mode": mode, "caches": caches}
                order = ("fusenorm", "inductor") if len(rows) % 2 == 0 else ("inductor", "fusenorm")
                for backend in order:
                    r = run_child(model, mode, backend, dirs[backend], a)
                    row[f"t_first_{backend}_s"] = r.get("first_s")
                    if backend == "fusenorm":
                        row["fused"] = r.get("fused")
                    if "error" in r:
                        row[f"error_{backend}"] = r["error"]
                f, i = row.get("t_first_fusenorm_s"), row.get("t_first_inductor_s")
                row["ratio"] = f / i if f and i else None
                rows.append(row)
                print(json.dumps(row)[:400], flush=True)
                data = {"meta": {**common.environment("cpu" if a.dry_run else "cuda"),
                                 "script": "benchmarks/bench_first_step.py", "dry_run": a.dry_run,
                                 "timer": "wall seconds from torch.compile to the first training step's end, "
                                          "one process per run, after a tiny warm-up compile"},
                        "rows": rows}
                common.write_json(out, data, quiet=True)
    print(f"wrote {out}")
    return {"rows": rows}


if __name__ == "__main__":
    main()
