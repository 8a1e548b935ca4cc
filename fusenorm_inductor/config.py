"""fusenorm's configuration, in the style of ``torch._inductor.config``.

Every option is a module attribute. Set it directly (``fusenorm_inductor.config.debug_dir = "/tmp/fn"``),
temporarily (``with fusenorm_inductor.config.patch(enabled=True): ...``), or through the environment
variable named beside it (read when this module is first imported). Boolean variables take 1/0, true/false,
yes/no or on/off (any case, surrounding spaces ignored; empty is the same as unset); any other value fails
the import with an error naming the variable. A ``FUSENORM_*`` variable that names no option warns at import
with the closest known name. An unknown option name raises ``AttributeError`` on set and on ``patch``.

The whole config is hashed into the passes' ``uuid()``, so changing an option invalidates Inductor's FX
graph cache entries that were compiled under another value.
"""

import difflib
import os
import sys
import warnings

from torch.utils._config_module import Config, install_config_module

# The environment variables are read here, not by torch's ``Config(env_name_default=...)``: that takes only
# "1" and "0" as booleans and keeps any other value as a string, so FUSENORM_ENABLE=false read as True.
_ENV_VARS: list = []  # every name read below; deleted before install_config_module (it is no option)


def _parse_bool(name: str, raw: str | None, default: bool) -> bool:
    """``raw``, the value of environment variable ``name``, as a boolean; ``default`` where unset or empty."""
    value = (raw or "").strip().lower()
    if not value:
        return default
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"fusenorm: environment variable {name}={raw!r} is not a boolean: use 1/0, true/false, "
                     f"yes/no or on/off (any case)")


def _env_bool(name: str, default: bool) -> bool:
    _ENV_VARS.append(name)
    return _parse_bool(name, os.environ.get(name), default)


def _env_opt_bool(name: str) -> bool | None:
    """``_env_bool`` where unset or empty means None (the option's automatic setting)."""
    _ENV_VARS.append(name)
    raw = os.environ.get(name)
    return None if not (raw or "").strip() else _parse_bool(name, raw, False)


def _env_str(name: str) -> str | None:
    """The string in environment variable ``name``; None where it is unset or empty."""
    _ENV_VARS.append(name)
    return os.environ.get(name) or None


def _warn_unknown_env(known: list) -> None:
    """Warn (once: this runs at import) about each FUSENORM_* variable that names no option."""
    prefix = "FUSENORM_"
    for name in sorted(os.environ):
        if name.upper().startswith(prefix) and name not in known:
            # Compared without the common prefix, which would make every name look close to every other.
            close = difflib.get_close_matches(name.upper()[len(prefix):], [k[len(prefix):] for k in known], n=1)
            hint = f"did you mean {prefix}{close[0]}?" if close else f"the known ones are {', '.join(sorted(known))}"
            warnings.warn(f"fusenorm: environment variable {name} is not a fusenorm option and is ignored; {hint}",
                          stacklevel=2)


# Run fusenorm's passes under plain ``torch.compile(model)`` (backend="inductor"). Setting it (directly,
# with ``patch``, or through ``fusenorm_inductor.enable()`` / ``disable()``) installs or uninstalls the passes
# in Inductor's config at once (through the hook passes.py registers with ``on_enabled``); graphs compiled before keep their code until ``torch._dynamo.reset()``.
# FUSENORM_ENABLE=1 installs them when the package is imported. ``backend="fusenorm"`` ignores it.
enabled: bool = Config(default=_env_bool("FUSENORM_ENABLE", False))

# Directory for per-graph dumps: the graphs before and after fusenorm's passes, as readable code, and the
# match report (every rewrite and every candidate that was not rewritten, with the reason).
debug_dir = Config(default=_env_str("FUSENORM_DEBUG_DIR"), value_type=str)

# Rewrite LayerNorm/RMSNorm calls into fusenorm's canonical norm op before autograd. Every fusion below
# matches the canonical op, so turning this off turns all of them off.
canonicalize_norms: bool = Config(default=_env_bool("FUSENORM_CANONICALIZE_NORMS", True))

# Deferred normalization folds a norm's affine into the next linear's weight. On, inference graphs keep each
# fold per weight version (the tensors' version counters) instead of folding per call. Off by default: a
# weight written in place through ``.data`` (or any write that bypasses the version counter) would then be
# served with its old fold; per call, the fold costs one read of the weight and one write.
fold_cache: bool = Config(default=_env_bool("FUSENORM_FOLD_CACHE", False))


class patterns:
    """Per-pattern switches; the names are the pattern names in the match report and counters."""

    # linear -> [+ residual] -> norm: GEMM with the norm in its epilogue (forward).
    linear_norm_fwd: bool = Config(default=_env_bool("FUSENORM_LINEAR_NORM_FWD", True))
    # GEMM -> norm -> GEMM(s): deferred normalization. The producer GEMM writes partial row statistics beside
    # its output, each consumer GEMM applies the norm in its epilogue; norm(x) is not written where only GEMMs
    # read it. Runs after linear_norm_fwd (a row that fits one tile) and before norm_linear_fwd.
    deferred_norm: bool = Config(default=_env_bool("FUSENORM_DEFERRED_NORM", True))
    # norm -> linear(s): Lazy Pre-Norm, the norm applied inside each linear's GEMM (forward), the weight
    # gradient from the norm's input and statistics (backward).
    norm_linear_fwd: bool = Config(default=_env_bool("FUSENORM_NORM_LINEAR_FWD", True))
    # norm -> linear, backward: the linear's data-gradient GEMM with the norm backward in its epilogue.
    dgrad_norm_bwd: bool = Config(default=_env_bool("FUSENORM_DGRAD_NORM_BWD", True))
    # LayerNorm_{H*D} -> GDPA -> + ln_q -> RMSNorm_{H*D} -> + q (the FlashNormAttention block, written with
    # fusenorm::gdpa or as the dense einsum/matmul composite): one fusenorm::flash_norm_attention call
    # (pre-grad; pattern names attention_block and attention_block_dense).
    attention_block: bool = Config(default=_env_bool("FUSENORM_ATTENTION_BLOCK", True))
    # Either form of the block when gradients are needed (training). Off by default: on the H200 the fused
    # backward is slower than what it replaces. Written with gdpa: slower than gdpa + Inductor's norms
    # (docs/performance.md, FlashNormAttention). The dense composite: a PFFN training step measures 0.63-0.75x of
    # plain Inductor's (benchmarks/results/models_h200.json; its padded rows are computed too). Inference is fused.
    attention_block_training: bool = Config(default=_env_bool("FUSENORM_ATTENTION_BLOCK_TRAINING", False))
    # The dense padded composite's form (attention_block_dense) at all. Off by default: the rewrite cannot read
    # the lengths from a general boolean mask, so the fused op computes every padded row, and Inductor's dense
    # composite (cuBLAS batched GEMMs at S = 128) is faster: a PFFN inference step measured 0.67x of plain
    # Inductor's on the H200 (benchmarks/results/models_h200.json). On, the form is fused under the same
    # training gate as the gdpa form.
    attention_block_dense: bool = Config(default=_env_bool("FUSENORM_ATTENTION_BLOCK_DENSE", False))


# Run the post-norm forward, the regrouped backward and Lazy Pre-Norm on the Gluon sm_90 kernels
# (fusenorm_inductor/kernels/hopper/) where they take the inputs (sm_90 GPU, a triton with the Gluon API,
# 16-bit TMA-aligned operands, for post-norm N up to 8192 split evenly over a cluster); elsewhere, or off, the
# `tl` kernels run. On by default since their numerics passed on the
# H200 and they beat the `tl` kernels at every shape measured (docs/performance.md); the per-shape dispatch
# still keeps a shape unfused where the fused kernel does not win.
gluon: bool = Config(default=_env_bool("FUSENORM_GLUON", True))

# Offer quack's GEMMs (the optional extra ``pip install "fusenorm[quack]"``: Dao-AILab's CuTeDSL kernels) to
# the dispatch of deferred normalization's GEMMs, timed beside the Gluon kernels and Inductor's own code; a
# no-op where quack is not installed (the match report says so once). Off: never imported.
quack: bool = Config(default=_env_bool("FUSENORM_QUACK", True))

# Let the fused kernels for rows wider than one tile (N > 256) exchange row statistics between programs
# that wait for each other ("spin" kernels, docs/design.md). They launch at most one program per SM, so all
# are resident on a whole GPU; a GPU partitioned below its SM count (MPS thread limits, green contexts)
# could hang them: set this to False there (the "coop" kernels never wait and run anywhere).
spin_exchange: bool = Config(default=_env_bool("FUSENORM_SPIN_EXCHANGE", True))


class tuning:
    """Per-shape measurements on the GPU (tuning/measure.py): which kernel configuration runs, and whether a match
    is fused at all (tuning/decide.py: only when the fused kernel beats Inductor's own code for the subgraph
    there)."""

    # How a match is decided on CUDA. None (the default): by the compile's mode: the default mode reads the
    # shipped table of the project's measurements for this GPU (tuning/table.py: no timing, no nested compile;
    # shapes or GPUs it has not measured are left to Inductor), mode="max-autotune" measures. True: measure
    # (once per shape, cached on disk) in any mode. False: every match is fused with the kernels' first
    # candidate configuration (the tests do this, so that small shapes are fused and checked).
    measure = Config(default=_env_opt_bool("FUSENORM_TUNE"), value_type=bool)
    # Time the unfused side of the decisions as Inductor's own compiled code for the matched
    # subgraph (tuning/baseline.py: one small Inductor compile per shape, cached with the measurements). Off:
    # estimate it as cuBLAS + a norm at copy speed (no nested compile).
    measure_inductor: bool = Config(default=_env_bool("FUSENORM_TUNE_INDUCTOR", True))
    # Where measurements are kept across processes; None = ~/.cache/fusenorm.
    cache_dir = Config(default=_env_str("FUSENORM_CACHE_DIR"), value_type=str)
    # Fuse only when the fused time is below the unfused estimate by this fraction. The estimate (cuBLAS +
    # a norm at copy speed) and the fused kernels' run-to-run spread (up to ~15-20% for the N > 256
    # kernels on the H200, benchmarks/results/gemm_norm_h200.json) put fusions that were measured 3%
    # faster at up to 1.22x slower than Inductor in the benchmark; 20% was the smallest margin with no
    # slower point in that run. Lower it only with your own measurements.
    margin: float = 0.20
    # The same for the Gluon sm_90 kernels, whose timings spread less: in their H200 benchmark
    # (benchmarks/results/gemm_norm_gluon_fwd_h200.json) every shape measured >= 13% faster than the
    # estimate was faster than Inductor; 15% keeps a little room.
    margin_gluon: float = 0.15
    # The same for a deferred-normalization site: its forward GEMMs in sequence, timed in turn with Inductor's
    # own compiled site on the same inputs (medians of alternating rounds), so no estimate is in the
    # comparison and the margin only has to cover the timings' spread. It must stay well below the norm's
    # share of the site, which is all a deferral can save (docs/performance.md, "Norms between linears"):
    # with the whole-row margins no site ever deferred.
    margin_deferred: float = 0.05
    # The same for a training step (the fused forward with the backward it implies against Inductor's forward
    # and backward of the site), which decides a training graph's site after its forward won: both sides
    # compiled and timed in alternating rounds on the same inputs, so again only the timings' spread to cover.
    margin_step: float = 0.05
    # Without CUDA graphs each side of the decision takes at least host_weight x its host time per call.
    # Weighted because the compiled graph's own host work per step (guards, wrappers, allocations) runs on
    # the same thread: on the H200, a one-op step's host time was about twice the op's own, so a fused
    # kernel measured 42% faster than Inductor's pair ran no faster there, and one 19% faster ran 8% slower
    # (benchmarks/results/host_cost_h200.json). 0 ignores host times.
    host_weight: float = 2.0
    # Under torch.distributed, rank 0 makes every fuse decision (from its cache or by measuring) and broadcasts
    # it, so all ranks compile the same graphs. This needs every rank to compile the same graphs in the same
    # order (SPMD training, as with DDP or FSDP); turn it off where ranks compile different graphs (then each
    # rank decides alone, and timings can make them decide differently).
    agree_across_ranks: bool = Config(default=_env_bool("FUSENORM_AGREE_ACROSS_RANKS", True))
    # Milliseconds per CUDA-graph replay of a timed candidate (triton's do_bench_cudagraph replays 10 times,
    # so a candidate costs the first compile ~10x this): short, since the decisions only need the medians'
    # spread well inside the margins above.
    rep_ms: float = 10.0
    # Threads that compile a decision's candidate kernels ahead of timing them, each candidate's first call in
    # its own thread (triton's compile runs much of its work outside the GIL, and ptxas in a subprocess): the
    # compiles are most of a first step's measuring. 1 (the default until the parallel path has run on a
    # GPU) compiles them one at a time, in the timing loop.
    compile_threads: int = 1


# Graphs whose tensors are all on the CPU: fusenorm's fused ops have no CPU kernels, only their plain-torch
# reference implementations, which run slower than Inductor's own code. Off (the default), such a graph is
# compiled exactly as plain Inductor compiles it, and the match report lists what would be rewritten on a
# GPU. On, the rewrites happen and the references run (the tests and the CPU runs of the examples use it to
# check the rewritten graphs).
cpu_reference: bool = Config(default=_env_bool("FUSENORM_CPU_REFERENCE", False))


# When a pass raises, log a warning and leave the graph to plain Inductor (the graph is restored from a
# copy taken before the pass). Tests set this to False to see the error.
fallback_on_error: bool = Config(default=_env_bool("FUSENORM_FALLBACK_ON_ERROR", True))


_warn_unknown_env(_ENV_VARS)
del _ENV_VARS
install_config_module(sys.modules[__name__])


def _options_help(source: str, options: dict) -> str:
    """Every option with its default, its environment variable and the comment above it in this file (its one
    description), for ``help(fusenorm_inductor.config)``."""
    import re
    import textwrap

    out, comment, prefix = [], [], ""
    for line in source.splitlines():
        stripped = line.strip()
        if not stripped:
            comment = []
            continue
        indent = len(line) - len(line.lstrip())
        if indent == 0 and not stripped.startswith("#"):
            group = re.match(r"class (\w+)", line)
            prefix = group.group(1) + "." if group else ""
        if stripped.startswith("#"):
            comment.append(stripped.lstrip("#").strip())
            continue
        match = re.match(r"\s*(\w+)\s*(?::[^=]+)?=", line)
        name = prefix + match.group(1) if match else None
        if name in options:
            env = re.search(r"_env_\w+\(\"(FUSENORM_\w+)\"", line)
            head = f"{name} = {options[name].default!r}" + (f"    (environment: {env.group(1)})" if env else "")
            text = " ".join(comment) or "(no description)"
            out += [head, textwrap.indent(textwrap.fill(text, 100), "    "), ""]
        comment = []
    return "\n\nOptions\n-------\n" + "\n".join(out)


with open(__file__, encoding="utf-8") as _f:
    globals()["__doc__"] = (__doc__ or "") + _options_help(_f.read(), sys.modules[__name__]._config)
del _f


def on_enabled(hook) -> None:
    """Register ``hook(value)``, called when ``enabled`` is set (directly, by ``patch`` or by ``enable()``),
    before the value is stored: passes.py registers the installation of its passes here, so that this module
    holds data only and imports nothing of fusenorm's. A hook that raises leaves the option as it was."""
    _FusenormConfigModule.enabled_hooks.append(hook)


def _number(lo: float, hi: float | None = None, lo_open: bool = False):
    """A check for a real number in [lo, hi) ((lo, hi) with ``lo_open``; no upper bound where hi is None)."""

    def check(v: object) -> bool:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v:
            return False
        return (v > lo if lo_open else v >= lo) and (hi is None or v < hi)

    return check


def _path_or_none(v: object) -> bool:
    # "" would name no directory (the dumps written nowhere, or in the working directory): refused, not guessed
    return v is None or (isinstance(v, (str, os.PathLike)) and os.fspath(v) != "")


# What each non-boolean option takes (every other option is a bool): (check, what the error says it must be).
_VALUES = {
    "debug_dir": (_path_or_none, "a non-empty directory path (str or os.PathLike) or None"),
    "tuning.cache_dir": (_path_or_none, "a non-empty directory path (str or os.PathLike) or None"),
    "tuning.measure": (lambda v: v is None or isinstance(v, bool),
                       "None (the mode decides), True (measure) or False (fuse every match)"),
    "tuning.margin": (_number(0.0, 1.0), "a fraction in [0, 1)"),
    "tuning.margin_gluon": (_number(0.0, 1.0), "a fraction in [0, 1)"),
    "tuning.margin_deferred": (_number(0.0, 1.0), "a fraction in [0, 1)"),
    "tuning.margin_step": (_number(0.0, 1.0), "a fraction in [0, 1)"),
    "tuning.host_weight": (_number(0.0), "a number >= 0"),
    "tuning.rep_ms": (_number(0.0, lo_open=True), "a number of milliseconds > 0"),
    "tuning.compile_threads": (lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1,
                               "an int >= 1"),
}


def _checked(name: str, value: object) -> object:
    """``value`` as the option ``name`` stores it (paths as str), or ValueError naming the option, the value
    and what it takes: a wrong type (``enabled = "no"``, which Python would read as true) is refused, not
    coerced."""
    check, what = _VALUES.get(name, (lambda v: isinstance(v, bool), "True or False"))
    if not check(value):
        raise ValueError(f"fusenorm: config.{name} = {value!r} is not valid: it must be {what}")
    return os.fspath(value) if isinstance(value, os.PathLike) else value


class _FusenormConfigModule(type(sys.modules[__name__])):
    """The installed config module, plus: every value is checked when set (``_checked``; ``patch`` sets
    through here too), and setting ``enabled`` runs the hooks of ``on_enabled`` first."""

    enabled_hooks: list = []

    def _unknown(self, name: str) -> AttributeError:
        groups = {k.split(".")[0] for k in self._config if "." in k}
        close = difflib.get_close_matches(name, [*self._config, *sorted(groups)], n=1)
        hint = f"did you mean {close[0]!r}?" if close else "help(fusenorm_inductor.config) lists the options"
        return AttributeError(f"fusenorm: config has no option {name!r}; {hint}")

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name.startswith("__"):  # Python's own probes (__path__, __wrapped__, ...): not a user's typo
                raise
            raise self._unknown(name) from None

    def __setattr__(self, name: str, value: object) -> None:
        if name in self._config:
            value = _checked(name, value)
        elif name not in self._bypass_keys and not name.startswith("_"):
            raise self._unknown(name)
        if name == "enabled":
            for hook in self.enabled_hooks:
                hook(value)
        super().__setattr__(name, value)


object.__setattr__(sys.modules[__name__], "__class__", _FusenormConfigModule)  # past ConfigModule's __setattr__
