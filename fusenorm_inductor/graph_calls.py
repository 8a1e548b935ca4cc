"""How Inductor's generated code calls fusenorm's fused GEMM + norm ops: straight into their CUDA launchers.

A compiled graph calls a fallback op as ``torch.ops.fusenorm.mm_norm.default(...)``: the dispatcher's round
trip into Python and ``torch.library.custom_op``'s Python autograd layer cost about as much host time as the
kernel launch itself, and a compiled graph needs neither. The joint graph the passes rewrite already holds
the backward, so the ops in the forward and backward graphs never run autograd, and Inductor has fixed their
arguments' layouts (the fake kernels checked them at compile time).

So each op registered here (``register``) keeps Inductor's own fallback lowering (the layout constraint Inductor's implicit
fallback gives a custom op, the fake kernel, the outputs) with one change: the line the wrapper writes calls
``extern_kernels.fusenorm_<op>``, a plain function that runs the op's CUDA kernel for CUDA tensors and the
op itself on any other device (under the profiler the CUDA call is recorded as ``fusenorm::<op>``, as a
dispatched call would be). ``extern_kernels`` is the namespace every Inductor wrapper imports for its
cuBLAS calls, so a graph loaded from Inductor's caches finds the functions as long as ``install`` ran in the
process (the backend and ``enable()`` run it). The C++ wrapper (AOTInductor) and the FX wrapper keep the op.
"""

from __future__ import annotations

import logging
from typing import Callable

import torch

log = logging.getLogger("fusenorm")

# op name -> the op's CUDA function (what the dispatcher would call for CUDA tensors), registered by the op's
# module (``register``); this module imports none of them.
_OPS: dict[str, Callable] = {}

PREFIX = "fusenorm_"
_installed: list = []  # [True] once install() has run, [True, "ok"] once it succeeded


def call_name(op_name: str) -> str:
    """The attribute of ``extern_kernels`` (and the name in generated code) that calls ``op_name``."""
    return PREFIX + op_name


def wrap(qualname: str, cuda_fn: Callable, op: Callable) -> Callable:
    """What a compiled graph calls for the op named ``qualname``: ``cuda_fn`` for CUDA tensors, ``op`` otherwise
    (measure.py times a no-op through it: the graph call's own host cost)."""

    def call(*args, **kwargs):
        # The first argument of every op of _OPS is a tensor on the op's device.
        if args[0].is_cuda:
            if torch.autograd._profiler_enabled():  # a profile names the op as it would a dispatched call
                with torch.profiler.record_function(qualname):
                    return cuda_fn(*args, **kwargs)
            return cuda_fn(*args, **kwargs)
        return op(*args, **kwargs)

    return call


def register(op_name: str, cuda_fn: Callable) -> None:
    """Let compiled graphs call ``torch.ops.fusenorm.<op_name>`` straight into ``cuda_fn`` (the op's module
    calls this once it has defined the op); an op registered after ``install`` is installed at once."""
    _OPS[op_name] = cuda_fn
    if _installed == [True, "ok"]:
        _install_op(op_name)


def _direct(op_name: str) -> Callable:
    cuda_fn = _OPS[op_name]
    call = wrap(f"fusenorm::{op_name}", cuda_fn, getattr(torch.ops.fusenorm, op_name).default)
    call.__name__ = call.__qualname__ = call_name(op_name)
    return call


def active() -> bool:
    """Whether graphs compiled now call the fused ops directly: ``install`` succeeded and Inductor writes a
    Python wrapper (the C++ wrapper keeps the dispatcher call)."""
    import torch._inductor.config as inductor_config

    return _installed == [True, "ok"] and not inductor_config.cpp_wrapper


def _python_wrapper() -> bool:
    from torch._inductor.virtualized import V

    return not getattr(V.graph, "cpp_wrapper", False) and not getattr(V.graph, "fx_wrapper", False)


def _lowering(op, name: str, inner: Callable) -> Callable:
    """``inner`` (Inductor's fallback lowering of ``op``), with the fallback kernels it makes calling
    ``extern_kernels.<name>``."""
    from torch._inductor import ir
    from torch._inductor.virtualized import V

    def handler(*args, **kwargs):
        first = len(V.graph.buffers)
        out = inner(*args, **kwargs)
        if _python_wrapper():
            for buf in V.graph.buffers[first:]:
                if isinstance(buf, ir.FallbackKernel) and buf.op_overload is op:
                    buf.python_kernel_name = f"extern_kernels.{name}"
        return out

    handler.__dict__.update(inner.__dict__)  # _is_fallback_handler and whatever else Inductor marks
    handler._fusenorm_direct = True
    return handler


def _install_op(op_name: str) -> None:
    from torch._inductor import lowering
    from torch._inductor.select_algorithm import extern_kernels
    from torch._library.utils import get_layout_constraint_tag

    op = getattr(torch.ops.fusenorm, op_name).default
    name = call_name(op_name)
    setattr(extern_kernels, name, _direct(op_name))
    if op not in lowering.lowerings:
        # What GraphLowering.call_function does for a custom op it meets without a lowering.
        constraint = lowering.tag_to_layout_constraint(get_layout_constraint_tag(op, with_default=True))
        lowering.make_fallback(op, layout_constraint=constraint, warn=False)
    inner = lowering.lowerings[op]
    if not getattr(inner, "_fusenorm_direct", False):
        lowering.lowerings[op] = _lowering(op, name, inner)


def install() -> None:
    """Put the direct calls on ``extern_kernels`` and Inductor's lowerings of the registered ops on them (once
    per process; the callers import ``fusenorm_inductor.ops`` first, which registers every op; where this
    torch's Inductor lacks a piece, the ops keep their dispatcher calls)."""
    if _installed:
        return
    _installed.append(True)
    try:
        for op_name in _OPS:
            _install_op(op_name)
        _installed.append("ok")
    except Exception as e:  # noqa: BLE001 - another torch: the dispatcher path stays, slower on the host only
        log.info("fusenorm: direct graph calls unavailable on this torch (%s: %s)", type(e).__name__, e)
