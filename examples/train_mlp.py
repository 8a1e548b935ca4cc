"""Train a small ads-style MLP (Linear -> LayerNorm blocks) with backend="fusenorm" and with plain Inductor
from the same seed; print fusenorm's match report, both losses side by side, and both step times.

    python examples/train_mlp.py                  # CPU: small sizes, a few seconds after compiling
    python examples/train_mlp.py --rows 262144 --depth 6 --width 1024 --plot /tmp/mlp.png
                                                   # CUDA (bf16 by default): the seed's shapes, widths 256-2048
    python examples/train_mlp.py --norm none      # the same stack with the norms replaced by identity

On CUDA the defaults are the seed's shapes (M = 262144 rows, 6 blocks, width 512, 200 steps). The labels come
from a fixed random linear teacher, so the loss decreases and the two curves can be compared.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402


class MLPBlock(nn.Module):
    """Linear -> LayerNorm [-> activation]: the post-norm block of ads/recommendation towers."""

    def __init__(self, d_in: int, d_out: int, act: str, norm: str = "layer", affine: bool = True) -> None:
        super().__init__()
        self.linear = nn.Linear(d_in, d_out)
        self.norm = {"layer": lambda: nn.LayerNorm(d_out, elementwise_affine=affine),
                     "rms": lambda: nn.RMSNorm(d_out, elementwise_affine=affine),
                     "none": nn.Identity}[norm]()
        self.act = {"none": nn.Identity(), "relu": nn.ReLU(), "gelu": nn.GELU()}[act]

    def forward(self, x):
        return self.act(self.norm(self.linear(x)))


class MLP(nn.Module):
    def __init__(self, d_in: int, width: int, depth: int, act: str = "none", norm: str = "layer",
                 affine: bool = True) -> None:
        super().__init__()
        dims = [d_in] + [width] * depth
        self.blocks = nn.Sequential(*[MLPBlock(a, b, act, norm, affine) for a, b in zip(dims, dims[1:])])
        self.head = nn.Linear(width, 1)

    def forward(self, x):
        return self.head(self.blocks(x)).squeeze(-1)


def make_batches(rows: int, width: int, n: int, device: str, dtype: torch.dtype, seed: int = 1) -> list:
    """``n`` batches (x [rows, width], y [rows] in {0, 1}): y = [x . w + noise > 0] for a fixed teacher w."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    teacher = torch.randn(width, generator=gen) / width**0.5
    out = []
    for _ in range(n):
        x = torch.randn(rows, width, generator=gen)
        y = ((x @ teacher + 0.3 * torch.randn(rows, generator=gen)) > 0).float()
        out.append((x.to(device, dtype), y.to(device)))
    return out


def bce_loss(model, batch):
    x, y = batch
    return nn.functional.binary_cross_entropy_with_logits(model(x).float(), y)


def parse_args(argv=None):
    cuda = torch.cuda.is_available()
    p = _common.make_parser(__doc__)
    p.add_argument("--rows", type=int, default=262144 if cuda else 1024, help="batch rows (M)")
    p.add_argument("--width", type=int, default=512 if cuda else 64, help="every layer's width (d)")
    p.add_argument("--depth", type=int, default=6 if cuda else 4, help="Linear -> norm blocks")
    p.add_argument("--act", default="none", choices=["none", "relu", "gelu"],
                   help="activation after each norm ('none': the baselines' Linear -> LayerNorm stack, where the "
                        "norm's backward also fuses into the next linear's data-gradient GEMM)")
    p.add_argument("--norm", default="layer", choices=["layer", "rms", "none"],
                   help="LayerNorm (default), RMSNorm, or identity (the stack without norms)")
    p.add_argument("--no-affine", action="store_true", help="norms without weight and bias")
    _common.add_common_args(p, steps_cpu=20, steps_cuda=200, lr=1e-3, report="full")
    args = p.parse_args(argv)
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    device, dtype = _common.pick_device(args.dtype, args.device)
    batches = make_batches(args.rows, args.width, args.batches, device, dtype)
    config = {"rows": args.rows, "width": args.width, "depth": args.depth, "act": args.act, "norm": args.norm,
              "affine": not args.no_affine}
    result = _common.compare(
        lambda: MLP(args.width, args.width, args.depth, args.act, args.norm, not args.no_affine), batches,
        bce_loss, steps=args.steps, lr=args.lr, device=device, dtype=dtype, seed=args.seed,
        timed=_common.timed_steps(args), backends=args.backends.split(","))
    act = "" if args.act == "none" else " -> " + args.act
    norm = {"layer": "LayerNorm", "rms": "RMSNorm", "none": "identity"}[args.norm]
    return _common.finish(f"{args.depth} x (Linear -> {norm}{act})", result, args, device, dtype, config)


if __name__ == "__main__":
    main()
