"""GDPA forward on sm_90 in Gluon: ``O = act(Q K^T) * scale @ V`` per sequence and head (ops/gdpa.py has the
math, the layouts and the reference).

Structure (a Hopper attention kernel without the softmax: P is elementwise in S, so no row max and no
rescaling of O):
- work items (b, h, chunk): a chunk is ``chunk`` consecutive Q tiles of ``block_m`` rows of sequence b, the
  chunks of one (b, h) adjacent; a chunk past the sequence's end is empty. Two schedules (``choose_config``):
  persistent (one program per SM walks items pid, pid + grid, ...) where every (b, h) is one item, and one
  program per item where sequences span several (the hardware then balances items of very different
  lengths, which a static walk does not).
- a loader partition (1 warp): per item the whole K and V of (b, h) ([S, D] each, S <= 128) into one of two
  buffers (the next item's land under the current item's tiles), then the item's Q tiles into a ring of
  ``q_stages`` slots; mbarriers order it all (``q_ready`` / ``q_empty`` per slot, ``kv_ready`` / ``kv_empty``
  per K/V buffer, the latter released by both consumers).
- two consumer partitions of one warpgroup each take alternate Q tiles of an item: S = Q K^T (async wgmma
  from shared memory), P = act(S) * scale in registers, rounded to the inputs' dtype and fed to the second
  wgmma as its register operand (O = P V, no trip through shared memory). With two consumers the tensor cores
  run one's GEMMs while the other computes its activation, which costs about as many cycles as the GEMMs.
- the epilogue rounds O to the dtype; a tile whose rows all belong to the sequence goes out through a
  staging tile and a TMA store (asynchronous, the next tile's work runs under it); the sequence's last,
  partial tile is stored with a row mask (a TMA store would write the next sequence's rows).
Rows of a Q tile past the sequence's end hold the next sequence's tokens (or TMA's zero fill past T): their S
rows are computed and never stored. Sequence bounds are clamped into [0, T] as in the Triton kernels, so
unvalidated offsets cannot address memory outside q and O.

q and O are read as [T, H * D] and K, V as [B * S, H * D] (views of the contiguous layouts): the tile of
head h is the box at column h * D. The box of K and V is [S, D], so S must be a power of two in [16, 128]
(no K/V rows of the next sequence enter a tile), D 64 or 128, and the dtype bf16 or fp16
(``unsupported`` says why not otherwise; the op then runs the Triton kernels).

The activations are those of activations.py, fast_gelu written as x * sigmoid(2 z) (one exp2 and one
division, as the Triton kernels' tanh); the hardware tanh (``tanh.approx.f32``, one instruction) would halve
the special-function work but errs by about 2^-11, more than the ops' error bound allows at small |P|.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch import Tensor

from . import launch as L
from ._compat import (
    fence_async_shared,
    gl,
    gluon,
    mbarrier,
    tma,
    tma_load,
    tma_store,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from .gemm_core import mma_layout
from ...ops._triton_common import num_sms
from .mm_norm import SpillError, _descriptor

__all__ = ["GdpaPlan", "gdpa_fwd_gluon", "unsupported", "choose_config"]

LOAD_REGS = 24
MMA_REGS = 232


class GdpaGluonConfig(NamedTuple):
    block_m: int  # Q rows per tile (one warpgroup's wgmma M)
    chunk: int  # Q tiles per work item
    q_stages: int  # Q tiles in flight (the loader's ring)
    persistent: bool  # one program per SM walking the items (else one program per item)

    def label(self) -> str:
        return f"gl_gdpa {self.block_m}x{self.chunk} q{self.q_stages} {'persistent' if self.persistent else 'per-item'}"


# Measured on the H200 (benchmarks/results/gdpa_gluon_h200.json): where every (b, h) is one work item the
# persistent walk wins (the next item's K and V load under the current item's tiles); where sequences span
# several items of very different lengths, one program per item wins (the hardware balances the items).
PERSISTENT = GdpaGluonConfig(64, 16, 4, True)
PER_ITEM = GdpaGluonConfig(64, 8, 4, False)


def choose_config(max_seq_len_q: int) -> GdpaGluonConfig:
    return PERSISTENT if max_seq_len_q <= PERSISTENT.block_m * PERSISTENT.chunk else PER_ITEM


@gluon.jit
def _act(x, ACT: gl.constexpr):
    """act(x) for an fp32 tile (ACT: activations.activation_code)."""
    if ACT == 0:  # fast_gelu = 0.5 x (1 + tanh(z)) = x sigmoid(2 z), z = sqrt(2/pi) (x + 0.044715 x^3)
        y = x / (1.0 + gl.exp2(x * (-2.302208198144325 - 0.1029432395800235 * x * x)))
    elif ACT == 1:  # gelu (erf)
        y = 0.5 * x * (1.0 + gl.erf(x * 0.7071067811865476))
    elif ACT == 2:  # silu
        y = x / (1.0 + gl.exp2(x * -1.4426950408889634))
    elif ACT == 3:  # relu
        y = gl.maximum(x, 0.0)
    else:
        y = x
    return y


@gluon.jit
def _item(off_ptr, item, n_chunks, H, T, BM: gl.constexpr, CH: gl.constexpr):
    """(b, h, first row, end of the sequence, Q tiles) of work item ``item`` = (b * H + h) * n_chunks + chunk:
    CH tiles of BM rows from the chunk's first row, fewer at the sequence's end, none past it. The sequence's
    bounds are clamped into [0, T]."""
    chunk = item % n_chunks
    bh = item // n_chunks
    b = bh // H
    end = gl.minimum(gl.maximum(gl.load(off_ptr + b + 1), 0), T)
    start = gl.minimum(gl.maximum(gl.load(off_ptr + b), 0), end)
    row_begin = start + chunk * (CH * BM)
    n_tiles = gl.minimum(gl.maximum(end - row_begin + (BM - 1), 0) // BM, CH)
    return b, bh - b * H, row_begin, end, n_tiles


@gluon.jit
def _loader(q_desc, k_desc, v_desc, q_bufs, k_bufs, v_bufs, q_ready, q_empty, kv_ready, kv_empty, off_ptr, T, H,
            n_chunks, n_items, CH: gl.constexpr):
    BM: gl.constexpr = q_desc.block_type.shape[0]
    D: gl.constexpr = q_desc.block_type.shape[1]
    S: gl.constexpr = k_desc.block_type.shape[0]
    NQ: gl.constexpr = q_bufs.type.shape[0]
    c = 0  # Q tiles loaded so far (the ring's position)
    j = 0  # work items with tiles so far (the K/V buffer's position)
    for item in range(gl.program_id(0), n_items, gl.num_programs(0)):
        b, h, row_begin, end, n_tiles = _item(off_ptr, item, n_chunks, H, T, BM, CH)
        if n_tiles > 0:
            kb = j % 2
            # a fresh mbarrier counts as having completed the phase before phase 0: the first laps pass
            mbarrier.wait(kv_empty.index(kb), ((j // 2) & 1) ^ 1)
            mbarrier.expect(kv_ready.index(2 * kb), k_desc.block_type.nbytes)
            tma_load(k_desc, [b * S, h * D], kv_ready.index(2 * kb), k_bufs.index(kb))
            mbarrier.expect(kv_ready.index(2 * kb + 1), v_desc.block_type.nbytes)
            tma_load(v_desc, [b * S, h * D], kv_ready.index(2 * kb + 1), v_bufs.index(kb))
            for i in range(n_tiles):
                s = (c + i) % NQ
                mbarrier.wait(q_empty.index(s), (((c + i) // NQ) & 1) ^ 1)
                mbarrier.expect(q_ready.index(s), q_desc.block_type.nbytes)
                tma_load(q_desc, [row_begin + i * BM, h * D], q_ready.index(s), q_bufs.index(s))
            c += n_tiles
            j += 1


@gluon.jit
def _store_rows(o, o_ptr, o_buf, o_desc, row0, col, end, ld_o, BM: gl.constexpr, D: gl.constexpr,
                layout: gl.constexpr):
    """Store the O tile of rows row0 .. row0 + BM, but no row at or past ``end`` (the sequence's)."""
    if row0 + BM <= end:
        tma.store_wait(0)  # the staging tile's previous store has read it
        o_buf.store(o.to(o_desc.dtype))
        fence_async_shared()
        tma_store(o_desc, [row0, col], o_buf)
    else:  # the sequence's last tile: only its own rows (TMA would write the next sequence's)
        rows = gl.arange(0, BM, layout=gl.SliceLayout(1, layout))
        cols = gl.arange(0, D, layout=gl.SliceLayout(0, layout))
        offs = gl.expand_dims(rows * ld_o, 1) + gl.expand_dims(cols, 0)
        base = o_ptr + row0.to(gl.int64) * ld_o + col
        gl.store(base + offs, o.to(o_desc.dtype), mask=gl.expand_dims(rows < end - row0, 1))


@gluon.jit
def _consumer(q_bufs, k_bufs, v_bufs, o_bufs, q_ready, q_empty, kv_ready, kv_empty, o_desc, o_ptr, off_ptr, T, H,
              n_chunks, n_items, scale, ACT: gl.constexpr, CH: gl.constexpr, CID: gl.constexpr):
    BM: gl.constexpr = q_bufs.type.shape[1]
    D: gl.constexpr = q_bufs.type.shape[2]
    S: gl.constexpr = k_bufs.type.shape[1]
    NQ: gl.constexpr = q_bufs.type.shape[0]
    dtype: gl.constexpr = q_bufs.dtype
    s_layout: gl.constexpr = mma_layout(BM, S, 4)
    o_layout: gl.constexpr = mma_layout(BM, D, 4)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    o_buf = o_bufs.index(CID)
    ld_o = H * D
    c = 0
    j = 0
    for item in range(gl.program_id(0), n_items, gl.num_programs(0)):
        b, h, row_begin, end, n_tiles = _item(off_ptr, item, n_chunks, H, T, BM, CH)
        if n_tiles > 0:
            kb = j % 2
            kv_phase = (j // 2) & 1
            k_buf = k_bufs.index(kb)
            v_buf = v_bufs.index(kb)
            # Waited for even without tiles here: a consumer releases an item's K and V only after they landed,
            # which the loader allows only once both consumers released the item two back in this buffer. So a
            # consumer with no tiles cannot run ahead and complete a buffer's phase with its own two arrivals.
            mbarrier.wait(kv_ready.index(2 * kb), kv_phase)
            for i in range(CID, n_tiles, 2):
                s = (c + i) % NQ
                mbarrier.wait(q_ready.index(s), ((c + i) // NQ) & 1)
                acc = warpgroup_mma(q_bufs.index(s), k_buf.permute((1, 0)),
                                    gl.zeros([BM, S], gl.float32, layout=s_layout), use_acc=False, is_async=True)
                acc = warpgroup_mma_wait(0, deps=(acc,))
                mbarrier.arrive(q_empty.index(s))
                p = gl.convert_layout((_act(acc, ACT) * scale).to(dtype), p_layout)
                mbarrier.wait(kv_ready.index(2 * kb + 1), kv_phase)
                o = warpgroup_mma(p, v_buf, gl.zeros([BM, D], gl.float32, layout=o_layout), use_acc=False,
                                  is_async=True)
                o = warpgroup_mma_wait(0, deps=(o,))
                _store_rows(o, o_ptr, o_buf, o_desc, row_begin + i * BM, h * D, end, ld_o, BM, D, o_layout)
            # this consumer's last read of the item's K and V has retired (each consumer arrives once)
            mbarrier.wait(kv_ready.index(2 * kb + 1), kv_phase)
            mbarrier.arrive(kv_empty.index(kb))
            c += n_tiles
            j += 1
    tma.store_wait(0)


@gluon.jit
def gdpa_fwd_kernel(q_desc, k_desc, v_desc, o_desc, o_ptr, off_ptr, T, H, n_chunks, n_items, scale,
                    ACT: gl.constexpr, CH: gl.constexpr, NQ: gl.constexpr, LOAD_REGS: gl.constexpr,
                    MMA_REGS: gl.constexpr, num_warps: gl.constexpr):
    """O for the work items of this program (module docstring)."""
    gl.static_assert(num_warps == 4, "each consumer is one warpgroup")
    BM: gl.constexpr = q_desc.block_type.shape[0]
    D: gl.constexpr = q_desc.block_type.shape[1]
    S: gl.constexpr = k_desc.block_type.shape[0]
    dtype: gl.constexpr = q_desc.dtype
    q_bufs = gl.allocate_shared_memory(dtype, [NQ, BM, D], q_desc.layout)
    k_bufs = gl.allocate_shared_memory(dtype, [2, S, D], k_desc.layout)
    v_bufs = gl.allocate_shared_memory(dtype, [2, S, D], v_desc.layout)
    o_bufs = gl.allocate_shared_memory(dtype, [2, BM, D], o_desc.layout)
    q_ready = gl.allocate_shared_memory(gl.int64, [NQ, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [NQ, 1], mbarrier.MBarrierLayout())
    kv_ready = gl.allocate_shared_memory(gl.int64, [4, 1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NQ):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(q_empty.index(i), count=1)
    for i in gl.static_range(4):
        mbarrier.init(kv_ready.index(i), count=1)
    for i in gl.static_range(2):
        mbarrier.init(kv_empty.index(i), count=2)  # both consumers release an item's K and V
    gl.warp_specialize([
        (_consumer, (q_bufs, k_bufs, v_bufs, o_bufs, q_ready, q_empty, kv_ready, kv_empty, o_desc, o_ptr, off_ptr, T,
                     H, n_chunks, n_items, scale, ACT, CH, 0)),
        (_consumer, (q_bufs, k_bufs, v_bufs, o_bufs, q_ready, q_empty, kv_ready, kv_empty, o_desc, o_ptr, off_ptr, T,
                     H, n_chunks, n_items, scale, ACT, CH, 1)),
        (_loader, (q_desc, k_desc, v_desc, q_bufs, k_bufs, v_bufs, q_ready, q_empty, kv_ready, kv_empty, off_ptr, T,
                   H, n_chunks, n_items, CH)),
    ], [4, 1], [MMA_REGS, LOAD_REGS])


# ----------------------------------------------------------------------------------------------------------
# Host side
# ----------------------------------------------------------------------------------------------------------

GLUON_DTYPES = (torch.bfloat16, torch.float16)
HEAD_DIMS = (64, 128)


def unsupported(q: Tensor, k: Tensor) -> Optional[str]:
    """Why the Gluon kernel cannot run these inputs (None: it can). The caller has validated them."""
    from ._compat import GLUON_ERROR

    if GLUON_ERROR is not None:
        return f"Gluon unavailable ({GLUON_ERROR})"
    if q.dtype not in GLUON_DTYPES:
        return f"dtype {q.dtype} (the kernel takes bf16 and fp16)"
    t, h, d = q.shape
    s = k.shape[1]
    if d not in HEAD_DIMS:
        return f"head dim {d} (the kernel takes {HEAD_DIMS})"
    if s < 16 or s > 128 or s & (s - 1):
        return f"K/V length {s} (the kernel takes a power of two in [16, 128])"
    if q.device.type != "cuda" or torch.cuda.get_device_capability(q.device)[0] != 9:
        return "not on an sm_90 GPU"
    if t >= 2 ** 31 or k.shape[0] * s >= 2 ** 31:
        return "more than 2^31 rows"
    return None


def _grid(config: GdpaGluonConfig, max_seq_len_q: int, nb: int, h: int) -> tuple[int, int]:
    """(chunks per (b, h), work items)."""
    n_chunks = max(1, -(-max_seq_len_q // (config.block_m * config.chunk)))
    return n_chunks, n_chunks * nb * h


class GdpaPlan:
    """The compiled forward for one argument signature (shapes, dtype, activation, max_seq_len_q); calling
    it launches on new tensors of the same shapes. Raises ``SpillError`` when the specialization spills."""

    def __init__(self, q, k, v, q_offsets, o, max_seq_len_q: int, act: int, scale: float,
                 config: GdpaGluonConfig) -> None:
        t, h, d = q.shape
        nb, s = k.shape[0], k.shape[1]
        self.config = config
        self.blocks = ([config.block_m, d], [s, d], [s, d], [config.block_m, d])
        self.n_chunks, self.n_items = _grid(config, max_seq_len_q, nb, h)
        self.grid = max(1, min(self.n_items, num_sms(q.device)) if config.persistent else self.n_items)
        self.consts = (act, config.chunk, config.q_stages, LOAD_REGS, MMA_REGS)
        args = self._args(q, k, v, q_offsets, o, scale, descriptors=True)
        compiled = L.compiled_kernel(gdpa_fwd_kernel, args + self.consts, 1, num_warps=4,
                                     maxnreg=L.maxnreg(4 + 4 + 4))
        if getattr(compiled, "n_spills", 0):
            raise SpillError(f"{config.label()}: this specialization spills registers ({compiled.n_spills})")
        self.compiled = compiled
        self.fast = L.fast_launcher(compiled, 4, 4, q.device)

    def _args(self, q, k, v, q_offsets, o, scale, descriptors: bool) -> tuple:
        t, h, d = q.shape
        nb, s = k.shape[0], k.shape[1]
        descs = (q.view(t, h * d), k.view(nb * s, h * d), v.view(nb * s, h * d), o.view(t, h * d))
        if descriptors:
            descs = tuple(_descriptor(x, blk) for x, blk in zip(descs, self.blocks))
        return descs + (o, q_offsets, t, h, self.n_chunks, self.n_items, float(scale))

    def __call__(self, q, k, v, q_offsets, o, scale) -> None:
        if self.fast is not None:
            args = self._args(q, k, v, q_offsets, o, scale, descriptors=False)
            self.fast(self.grid, args[:4], args[4:] + self.consts)
            return
        L.run(self.compiled, self.grid, self._args(q, k, v, q_offsets, o, scale, descriptors=True) + self.consts, 4)


_PLANS: dict = {}


def gdpa_fwd_gluon(q: Tensor, k: Tensor, v: Tensor, q_offsets: Tensor, o: Tensor, max_seq_len_q: int, act: int,
                   scale: float, config: Optional[GdpaGluonConfig] = None) -> None:
    """Write O of ``gdpa_reference`` into ``o`` (contiguous [T, H, D]); inputs contiguous, checked by the op
    and by ``unsupported``. The launch plan is cached per signature. ``config``: a benchmark hook (None:
    ``choose_config``)."""
    config = config or choose_config(max_seq_len_q)
    key = (q.shape, k.shape, q.dtype, q.device, max_seq_len_q, act, config)
    plan = _PLANS.get(key)
    if plan is None:
        plan = _PLANS[key] = GdpaPlan(q, k, v, q_offsets, o, max_seq_len_q, act, scale, config)
    plan(q, k, v, q_offsets, o, scale)


# ----------------------------------------------------------------------------------------------------------
# Offline compile (CPU tests, CI)
# ----------------------------------------------------------------------------------------------------------

_PARAMS = ("q_desc", "k_desc", "v_desc", "o_desc", "o_ptr", "off_ptr", "T", "H", "n_chunks", "n_items", "scale",
           "ACT", "CH", "NQ", "LOAD_REGS", "MMA_REGS", "num_warps")


def compile_offline(d: int, s: int, act: int, dtype: str = "bf16", config: GdpaGluonConfig = PERSISTENT):
    from .offline import compile_sm90, descriptor_type, runtime_attrs

    bm = config.block_m
    values = dict(q_desc=descriptor_type([bm, d], dtype), k_desc=descriptor_type([s, d], dtype),
                  v_desc=descriptor_type([s, d], dtype), o_desc=descriptor_type([bm, d], dtype),
                  o_ptr=f"*{dtype}", off_ptr="*i32", T="i32", H="i32", n_chunks="i32", n_items="i32",
                  scale="fp32")
    constexprs = dict(ACT=act, CH=config.chunk, NQ=config.q_stages, LOAD_REGS=LOAD_REGS, MMA_REGS=MMA_REGS, num_warps=4)
    signature = {p: values.get(p, "constexpr") for p in _PARAMS}
    attrs = runtime_attrs(signature, dict(T=1000, H=3, n_chunks=3, n_items=9))
    return compile_sm90(gdpa_fwd_kernel, signature, constexprs, 4, L.maxnreg(12), attrs)


def offline_variants() -> list[dict]:
    """Every activation at D = 64 and 128, S = 128 (the register-heaviest S), bf16, in both configurations;
    fp16 once."""
    out = [dict(op="gdpa", d=d, s=128, act=a, dtype="bf16", config=list(c)) for d in HEAD_DIMS for a in range(5)
           for c in (PERSISTENT, PER_ITEM)]
    out += [dict(op="gdpa", d=128, s=32, act=0, dtype="fp16", config=list(PERSISTENT))]
    return out


def compile_variant(v: dict):
    return compile_offline(v["d"], v["s"], v["act"], v["dtype"], GdpaGluonConfig(*v["config"]))
