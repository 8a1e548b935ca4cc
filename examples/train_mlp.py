"""Train a small ads-style MLP (Linear -> LayerNorm blocks) with backend="fusenorm" and with plain Inductor
from the same seed; print fusenorm's match report, both losses side by side, and on CUDA both step times.

    python examples/train_mlp.py                 # CPU: small sizes, a few seconds after compiling
    python examples/train_mlp.py --rows 262144   # CUDA: the seed's row count (bf16 by default on CUDA)
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time

import torch
import torch.nn as nn


class MLPBlock(nn.Module):
    """Linear -> LayerNorm [-> activation]: the post-norm block of ads/recommendation towers."""

    def __init__(self, d_in: int, d_out: int, act: str) -> None:
        super().__init__()
        self.linear = nn.Linear(d_in, d_out)
        self.norm = nn.LayerNorm(d_out)
        self.act = {"none": nn.Identity(), "relu": nn.ReLU(), "gelu": nn.GELU()}[act]

    def forward(self, x):
        return self.act(self.norm(self.linear(x)))


class MLP(nn.Module):
    def __init__(self, d_in: int, width: int, depth: int, act: str = "none") -> None:
        super().__init__()
        dims = [d_in] + [width] * depth
        self.blocks = nn.Sequential(*[MLPBlock(a, b, act) for a, b in zip(dims, dims[1:])])
        self.head = nn.Linear(width, 1)

    def forward(self, x):
        return self.head(self.blocks(x)).squeeze(-1)


def train(model, data, steps: int, device: str):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses, times = [], []
    for step in range(steps):
        x, y = data[step % len(data)]
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = nn.functional.binary_cross_entropy_with_logits(model(x).float(), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    return losses, times


def main() -> None:
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=65536 if cuda else 1024, help="batch rows (M)")
    p.add_argument("--width", type=int, default=512 if cuda else 64)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--steps", type=int, default=60 if cuda else 20)
    p.add_argument("--act", default="none", choices=["none", "relu", "gelu"],
                   help="activation after each norm ('none': the baselines' Linear -> LayerNorm stack, where the "
                        "norm's backward also fuses into the next linear's data-gradient GEMM)")
    p.add_argument("--dtype", default="bfloat16" if cuda else "float32", choices=["float32", "bfloat16", "float16"])
    args = p.parse_args()
    device, dtype = ("cuda" if cuda else "cpu"), getattr(torch, args.dtype)
    os.environ.setdefault("TORCHINDUCTOR_FORCE_DISABLE_CACHES", "1")  # so the passes (and report) always run

    torch.manual_seed(0)
    base = MLP(args.width, args.width, args.depth, args.act).to(device, dtype)
    gen = torch.Generator(device="cpu").manual_seed(1)
    data = [(torch.randn(args.rows, args.width, generator=gen).to(device, dtype),
             torch.randint(0, 2, (args.rows,), generator=gen).float().to(device)) for _ in range(4)]

    results = {}
    for backend in ("fusenorm", "inductor"):
        torch._dynamo.reset()
        model = torch.compile(copy.deepcopy(base), backend=backend, dynamic=False)
        results[backend] = train(model, data, args.steps, device)
        if backend == "fusenorm":
            import fusenorm_inductor

            report = fusenorm_inductor.last_report()
            if report is not None:
                print(report.to_markdown())
            else:  # an FX graph cache hit compiles nothing, so the passes (and their report) did not run
                print("(no match report: the graph came from Inductor's FX graph cache; run with "
                      "TORCHINDUCTOR_FORCE_DISABLE_CACHES=1 to see it)")

    act = "" if args.act == "none" else " -> " + args.act
    print(f"{args.depth} x (Linear -> LayerNorm{act}), rows={args.rows}, width={args.width}, {args.dtype}, {device}")
    print(f"{'step':>5} {'loss fusenorm':>14} {'loss inductor':>14}")
    for i, (a, b) in enumerate(zip(results["fusenorm"][0], results["inductor"][0])):
        if i % max(1, args.steps // 10) == 0 or i == args.steps - 1:
            print(f"{i:5d} {a:14.6f} {b:14.6f}")
    if cuda:
        skip = min(10, args.steps // 2)  # first steps include compilation and autotuning
        t = {k: statistics.median(v[1][skip:]) * 1e3 for k, v in results.items()}
        print(f"median step time: fusenorm {t['fusenorm']:.3f} ms, inductor {t['inductor']:.3f} ms, "
              f"speedup {t['inductor'] / t['fusenorm']:.3f}x")


if __name__ == "__main__":
    main()
