"""fusenorm's configuration, in the style of ``torch._inductor.config``.

Every option is a module attribute. Set it directly (``fusenorm_inductor.config.debug_dir = "/tmp/fn"``),
temporarily (``with fusenorm_inductor.config.patch(enabled=True): ...``), or through the environment
variable named beside it (read when this module is first imported; "1"/"0" for booleans). An unknown
option name raises ``AttributeError`` on set and on ``patch``.

The whole config is hashed into the passes' ``uuid()``, so changing an option invalidates Inductor's FX
graph cache entries that were compiled under another value.
"""

import sys

from torch.utils._config_module import Config, install_config_module

# Run fusenorm's passes under plain ``torch.compile(model)`` (backend="inductor").
# ``fusenorm_inductor.enable()`` / ``disable()`` set this and install/uninstall the passes; setting it by
# hand after import has no effect until ``enable()`` is called. ``backend="fusenorm"`` ignores it.
enabled: bool = Config(env_name_default="FUSENORM_ENABLE", default=False)

# Directory for per-graph dumps: the graphs before and after fusenorm's passes, as readable code, and the
# match report (every rewrite and every candidate that was not rewritten, with the reason).
debug_dir = Config(env_name_default="FUSENORM_DEBUG_DIR", default=None, value_type=str)

# Rewrite LayerNorm/RMSNorm calls into fusenorm's canonical norm op before autograd. Every fusion below
# matches the canonical op, so turning this off turns all of them off.
canonicalize_norms: bool = Config(env_name_default="FUSENORM_CANONICALIZE_NORMS", default=True)


class patterns:
    """Per-pattern switches; the names are the pattern names in the match report and counters."""

    # linear -> [+ residual] -> norm: GEMM with the norm in its epilogue (forward).
    linear_norm_fwd: bool = Config(env_name_default="FUSENORM_LINEAR_NORM_FWD", default=True)
    # norm -> linear(s): Lazy Pre-Norm, the norm applied inside each linear's GEMM (forward), the weight
    # gradient from the norm's input and statistics (backward).
    norm_linear_fwd: bool = Config(env_name_default="FUSENORM_NORM_LINEAR_FWD", default=True)
    # norm -> linear, backward: the linear's data-gradient GEMM with the norm backward in its epilogue.
    dgrad_norm_bwd: bool = Config(env_name_default="FUSENORM_DGRAD_NORM_BWD", default=True)
    # LayerNorm_{H*D} -> GDPA -> + ln_q -> RMSNorm_{H*D} -> + q (the FlashNormAttention block, written with
    # fusenorm::gdpa or as the dense einsum/matmul composite): one fusenorm::flash_norm_attention call
    # (pre-grad; pattern names attention_block and attention_block_dense).
    attention_block: bool = Config(env_name_default="FUSENORM_ATTENTION_BLOCK", default=True)
    # Either form of the block when gradients are needed (training). Off by default: on the H200 the fused
    # backward is slower than what it replaces. Written with gdpa: 18-30% slower than gdpa + Inductor's norms
    # (README, Performance, Attention). The dense composite: a PFFN training step measures 0.63x of plain
    # Inductor's (benchmarks/results/models_h200.json; its padded rows are computed too). Inference is fused.
    attention_block_training: bool = Config(env_name_default="FUSENORM_ATTENTION_BLOCK_TRAINING", default=False)


# Run the post-norm forward on the Gluon sm_90 kernels (fusenorm_inductor/kernels/hopper/) where they take
# the inputs (sm_90 GPU, a triton with the Gluon API, 16-bit TMA-aligned operands, N <= 4096). Off until
# their numerics have passed on the H200: then the `tl` kernels run as before.
gluon: bool = Config(env_name_default="FUSENORM_GLUON", default=False)

# Let the fused kernels for rows wider than one tile (N > 256) exchange row statistics between programs
# that wait for each other ("spin" kernels, docs/design.md). They launch at most one program per SM, so all
# are resident on a whole GPU; a GPU partitioned below its SM count (MPS thread limits, green contexts)
# could hang them: set this to False there (the "coop" kernels never wait and run anywhere).
spin_exchange: bool = Config(env_name_default="FUSENORM_SPIN_EXCHANGE", default=True)


class tuning:
    """Per-shape measurements on the GPU (ops/tuning.py): which kernel configuration runs, and whether a
    match is fused at all (only when the fused kernel beats cuBLAS + a copy-speed norm on that shape)."""

    # Measure on CUDA (once per shape, cached on disk). Off: every match is fused with the kernels' first
    # candidate configuration (the tests do this, so that small shapes are fused and checked).
    measure: bool = Config(env_name_default="FUSENORM_TUNE", default=True)
    # Where measurements are kept across processes; None = ~/.cache/fusenorm.
    cache_dir = Config(env_name_default="FUSENORM_CACHE_DIR", default=None, value_type=str)
    # Fuse only when the fused time is below the unfused estimate by this fraction. The estimate (cuBLAS +
    # a norm at copy speed) and the fused kernels' run-to-run spread (up to ~15-20% for the N > 256
    # kernels on the H200, benchmarks/results/gemm_norm_h200.json) put fusions that were measured 3%
    # faster at up to 1.22x slower than Inductor in the benchmark; 20% was the smallest margin with no
    # slower point in that run. Lower it only with your own measurements.
    margin: float = 0.20
    # Milliseconds of CUDA-graph replays per timed candidate.
    rep_ms: float = 25.0


# When a pass raises, log a warning and leave the graph to plain Inductor (the graph is restored from a
# copy taken before the pass). Tests set this to False to see the error.
fallback_on_error: bool = Config(env_name_default="FUSENORM_FALLBACK_ON_ERROR", default=True)


install_config_module(sys.modules[__name__])
