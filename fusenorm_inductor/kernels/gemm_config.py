"""What every GEMM kernel family of fusenorm shares without importing another: the configuration record the
dispatch times, caches and reports (``GemmConfig``, for our ``tl`` kernels in kernels/triton and our Gluon
kernels in kernels/hopper), and the device's SM count that sizes their persistent grids."""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch


@functools.lru_cache(maxsize=None)
def num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter: a few persistent programs, so the persistent loops are exercised
    return torch.cuda.get_device_properties(device).multi_processor_count


class GemmConfig(NamedTuple):
    """One configuration of a fused GEMM kernel (what ``tuning`` times, caches and reports).

    kind: "row"  TMA-fed persistent kernel, one tile holds whole rows (N <= TMA_MAX_BLOCK_N);
          "coop" TMA-fed persistent kernel, rows span N tiles, the last tile of a row block to finish
                 normalizes it (cooperative finalize in L2);
          "spin" the same kernel, but the tiles of a row block wait for each other's row partials and each
                 normalizes itself from registers (needs every program resident: one per SM at most);
          "ptr"  masked pointer loads, any strides and dtypes (single tile, or GEMM + finalize kernel);
          "tma"  (pre-norm, norm_mm_kernels.py) TMA-fed persistent GEMM over [M, N] tiles, row statistics
                 from the A tiles of every tile;
          "tma_rows" (pre-norm) the same GEMM, each program taking whole row blocks: statistics from the
                 first N tile's A tiles only.
    progs_per_sm: persistent programs per SM (2 lets one program's epilogue overlap another's loads).
    prefetch: (backward) load the saved tensor's tile before the K loop, so its latency hides under the GEMM
              (costs registers across the loop).
    stats_regs: (deferred GEMM) the output's partial statistics summed in registers from the values as stored,
                instead of read back from the staging tile (no second pass over it; more registers live).
    """

    kind: str
    block_m: int
    block_n: int
    block_k: int
    stages: int
    warps: int
    progs_per_sm: int = 1
    prefetch: bool = False
    stats_regs: bool = False

    def label(self) -> str:
        per_sm = f" x{self.progs_per_sm}" if self.progs_per_sm != 1 else ""
        pf = " pf" if self.prefetch else ""
        rs = " rs" if self.stats_regs else ""
        return (f"{self.kind} {self.block_m}x{self.block_n}x{self.block_k} s{self.stages} w{self.warps}"
                f"{per_sm}{pf}{rs}")
