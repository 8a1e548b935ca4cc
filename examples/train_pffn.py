"""Train a Kunlun-style PFFN stack (FlashNormAttention blocks with their projections) with backend="fusenorm"
and with plain Inductor from the same seed; print the match report, both losses, both step times.

Per block, on padded tokens x [B, Lmax, d_model] with a boolean padding mask [B, Lmax] and a short dense
context c [B, S, d_ctx] (shared by the blocks):

    q = Linear(x) [B, Lmax, H*D];  k, v = Linear(c), Linear(c) viewed [B, S, H, D]
    ln_q = LayerNorm_{H*D}(q) viewed [B, Lmax, H, D]
    o    = einsum(fast_gelu(einsum(ln_q, k)) * D^-1/2, v) + ln_q       # GDPA: an activation, no softmax
    o    = o * mask[:, :, None, None]                                  # padded rows zeroed
    y    = RMSNorm_{H*D}(o) + q
    x    = x + Linear(y)                                               # output projection, residual

then a masked mean over the valid tokens, a linear head and an MSE loss against a fixed random teacher's
targets. This is the padded dense composite that fusenorm's ``attention_block_dense`` pattern recognizes
(``patterns/attention_block.py``). By default fusenorm leaves it to Inductor: the rewrite computes every padded
row and measures slower than Inductor's dense composite on the H200 (config.patterns.attention_block_dense). With
``--fuse-training`` (that switch and config.patterns.attention_block_training on) fusenorm rewrites each block's
LN -> GDPA -> + ln_q -> mask -> RMSNorm -> + q into one ``fusenorm::flash_norm_attention`` (masked rows become
where(mask, out, q), as in the original).

    python examples/train_pffn.py --fuse-training # CPU: tiny sizes, seconds after compiling
    python examples/train_pffn.py --batch 256 --lmax 512 --heads 2 --dim 128 --ctx 128 --blocks 3 [--fuse-training]
                                                   # CUDA defaults (bf16): fits an H200 with room to spare

Sequence lengths are uniform in [Lmax/2, Lmax] (half the rows padded at worst, ~25% on average).
"""

from __future__ import annotations

import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402


class PFFNBlock(nn.Module):
    """Projections around one FlashNormAttention block (LayerNorm and RMSNorm over all H*D features)."""

    def __init__(self, d_model: int, d_ctx: int, heads: int, dim: int) -> None:
        super().__init__()
        self.h, self.d = heads, dim
        hd = heads * dim
        self.q_proj = nn.Linear(d_model, hd)
        self.k_proj = nn.Linear(d_ctx, hd)
        self.v_proj = nn.Linear(d_ctx, hd)
        self.ln = nn.LayerNorm(hd, eps=1e-5)
        self.rms = nn.RMSNorm(hd, eps=1e-6)
        self.out_proj = nn.Linear(hd, d_model)
        self.scale = dim**-0.5

    def forward(self, x, ctx, mask):
        b, lq, _ = x.shape
        s = ctx.shape[1]
        q = self.q_proj(x)  # [B, L, H*D]
        k = self.k_proj(ctx).view(b, s, self.h, self.d)
        v = self.v_proj(ctx).view(b, s, self.h, self.d)
        ln_q = self.ln(q).view(b, lq, self.h, self.d)
        scores = torch.einsum("blhd,bshd->bhls", ln_q, k)
        p = F.gelu(scores, approximate="tanh") * self.scale  # fast_gelu
        o = torch.einsum("bhls,bshd->blhd", p, v) + ln_q
        o = o * mask[:, :, None, None]  # boolean padding mask: padded rows are 0, so their output is q
        y = self.rms(o.reshape(b, lq, self.h * self.d)) + q
        return x + self.out_proj(y)


class PFFNStack(nn.Module):
    def __init__(self, d_model: int, d_ctx: int, heads: int, dim: int, blocks: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([PFFNBlock(d_model, d_ctx, heads, dim) for _ in range(blocks)])
        self.head = nn.Linear(d_model, 1)

    def forward(self, x, ctx, mask):
        for blk in self.blocks:
            x = blk(x, ctx, mask)
        m = mask[..., None].to(x.dtype)
        pooled = (x * m).sum(1) / m.sum(1).clamp_min(1)
        return self.head(pooled).squeeze(-1)


def make_batches(batch: int, lmax: int, s_ctx: int, d_model: int, d_ctx: int, n: int, device: str,
                 dtype: torch.dtype, seed: int = 1) -> list:
    """``n`` batches (x [B, Lmax, d_model] zero past each length, ctx [B, S, d_ctx], mask [B, Lmax] bool,
    target [B]); target = tanh of a fixed teacher's projection of the mean valid token and of the context."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    w_x = torch.randn(d_model, generator=gen) / d_model**0.5
    w_c = torch.randn(d_ctx, generator=gen) / d_ctx**0.5
    out = []
    for _ in range(n):
        lengths = torch.randint(max(1, lmax // 2), lmax + 1, (batch,), generator=gen)
        mask = torch.arange(lmax)[None, :] < lengths[:, None]
        x = torch.randn(batch, lmax, d_model, generator=gen) * mask[..., None]
        ctx = torch.randn(batch, s_ctx, d_ctx, generator=gen)
        # Each term ~ N(0, 1): sums of (length) and (S) unit normals, scaled back.
        tokens = (x.sum(1) @ w_x) / lengths.sqrt()
        context = (ctx.sum(1) @ w_c) / s_ctx**0.5
        target = torch.tanh(tokens + context)
        out.append((x.to(device, dtype), ctx.to(device, dtype), mask.to(device), target.to(device)))
    return out


def mse_loss(model, batch):
    x, ctx, mask, target = batch
    return F.mse_loss(model(x, ctx, mask).float(), target)


def parse_args(argv=None):
    cuda = torch.cuda.is_available()
    p = _common.make_parser(__doc__)
    p.add_argument("--batch", type=int, default=256 if cuda else 4, help="sequences (B)")
    p.add_argument("--lmax", type=int, default=512 if cuda else 12, help="padded query length (Lmax)")
    p.add_argument("--heads", type=int, default=2, help="H")
    p.add_argument("--dim", type=int, default=128 if cuda else 16, help="head dim D")
    p.add_argument("--ctx", type=int, default=128 if cuda else 8, help="K/V (context) length S (<= 256)")
    p.add_argument("--d-model", type=int, default=None, help="token width (default H*D)")
    p.add_argument("--d-ctx", type=int, default=None, help="context width (default H*D)")
    p.add_argument("--blocks", type=int, default=3 if cuda else 2)
    p.add_argument("--fuse-training", action="store_true",
                   help="fuse the block, in training too (config.patterns.attention_block_dense and "
                        "attention_block_training; off by default: the fused block measures slower on the H200)")
    _common.add_common_args(p, steps_cpu=12, steps_cuda=200, lr=1e-3, report="full")
    args = p.parse_args(argv)
    hd = args.heads * args.dim
    args.d_model, args.d_ctx = args.d_model or hd, args.d_ctx or hd
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    device, dtype = _common.pick_device(args.dtype, args.device)
    batches = make_batches(args.batch, args.lmax, args.ctx, args.d_model, args.d_ctx, args.batches, device, dtype)
    config = {"B": args.batch, "Lmax": args.lmax, "H": args.heads, "D": args.dim, "S": args.ctx,
              "d_model": args.d_model, "d_ctx": args.d_ctx, "blocks": args.blocks,
              "fused_in_training": args.fuse_training}
    from fusenorm_inductor import config as fn_config

    with fn_config.patch({"patterns.attention_block_training": args.fuse_training,
                          "patterns.attention_block_dense": args.fuse_training}):
        result = _common.compare(
            lambda: PFFNStack(args.d_model, args.d_ctx, args.heads, args.dim, args.blocks), batches, mse_loss,
            steps=args.steps, lr=args.lr, device=device, dtype=dtype, seed=args.seed,
            timed=_common.timed_steps(args), backends=args.backends.split(","))
    return _common.finish(f"PFFN {args.blocks} x FlashNormAttention block", result, args, device, dtype, config)


if __name__ == "__main__":
    main()
