"""The compatibility contract (docs/support.md, "Compatibility"): each way users run torch.compile works with
backend="fusenorm", compiled vs eager (outputs and every gradient, fresh random inputs, 257 rows), and fusenorm
either fused (exact counts, and the fused ops really run: the profiler sees them) or declined with a reason.

dynamic shapes (no recompile per batch size), mode="max-autotune", mode="reduce-overhead" (CUDA graphs), the FX
graph cache across processes, autocast, no_grad / inference_mode, DDP and FSDP2 (graph breaks at their
boundaries), a model compiled twice, and pass errors falling back to Inductor with a warning (every pass slot).
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import shutil
import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch._inductor.config as inductor_config
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.utils import counters

import fusenorm_inductor
from fusenorm_inductor import config, passes

from . import CACHES_OFF
from .models import TOL, PostNormBlock, _err, assert_matches_eager, fusenorm_counts

CUDA = torch.cuda.is_available()
ON_CUDA = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
ROOT = Path(__file__).resolve().parent.parent


class ContractNet(nn.Module):
    """``x -> LayerNorm -> linear -> gelu -> linear -> RMSNorm -> linear -> tanh -> LayerNorm``: one candidate
    of each pattern. Pre-norm takes the first LayerNorm, post-norm takes linear -> RMSNorm, the regrouped
    backward takes both of those norms' gradients (each comes from a linear's data-gradient GEMM), and the
    last LayerNorm (after tanh, returned) has no fusion partner: it is put back as written (norm_prospects)."""

    def __init__(self, k: int = 24, hidden: int = 40, n: int = 36, out: int = 32):
        super().__init__()
        self.n0, self.l1 = nn.LayerNorm(k), nn.Linear(k, hidden)
        self.l2, self.n1 = nn.Linear(hidden, n), nn.RMSNorm(n)
        self.l3, self.n2 = nn.Linear(n, out), nn.LayerNorm(out)
        with torch.no_grad():  # random affine parameters: a dropped weight or bias is caught
            for name, p in self.named_parameters():
                if name.startswith("n"):
                    p.copy_(0.1 * torch.randn_like(p) + (1.0 if name.endswith("weight") else 0.0))

    def forward(self, x):
        return self.n2(torch.tanh(self.l3(self.n1(self.l2(F.gelu(self.l1(self.n0(x))))))))


TRAIN = {"norm_linear_fwd": 1, "linear_norm_fwd": 1, "dgrad_norm_bwd": 2}
INFER = {"norm_linear_fwd": 1, "linear_norm_fwd": 1}
# What the compiled training step runs of fusenorm's ops: the two fused forwards, pre-norm's weight gradient and
# the two regrouped backwards; no canonical fusenorm::norm (the last LayerNorm went back as written).
TRAIN_OPS = {"fusenorm::norm_mm", "fusenorm::mm_normed", "fusenorm::mm_norm", "fusenorm::mm_norm_backward"}
INFER_OPS = {"fusenorm::norm_mm", "fusenorm::mm_norm"}
CANONICAL = {"canonical_layer_norm": 1, "canonical_rms_norm": 1}  # the last LayerNorm went back as written

# linear -> norm -> linear (tests/models.py): the cheapest graph that fuses forward and backward, for the tests that
# do not need every pattern (each compile costs seconds of C++ compilation on a CPU).
POST = {"linear_norm_fwd": 1, "dgrad_norm_bwd": 1}
POST_OPS = {"fusenorm::mm_norm", "fusenorm::mm_norm_backward"}


def post_block(form: str = "nn.LayerNorm") -> nn.Module:
    torch.manual_seed(0)
    return PostNormBlock(24, 40, form)


def fusenorm_ops_run(fn) -> set[str]:
    """Names of the fusenorm:: ops that ``fn`` runs (the profiler records every dispatched op).

    Call it on an already compiled model: while compiling, fake-tensor tracing dispatches ops too."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return {e.name for e in prof.events() if e.name.startswith("fusenorm::")}


def _plain(t):
    """A DTensor gradient (FSDP2) as the full plain tensor."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def fwd_bwd(model, inputs: tuple):
    """``models.fwd_bwd`` from zeroed gradients, keeping ``mark_dynamic`` on the inputs' leaf copies."""
    model.zero_grad(set_to_none=True)
    leaves = []
    for x in inputs:
        leaf = x.detach().clone().requires_grad_()
        for dim in getattr(x, "_dynamo_dynamic_indices", ()):
            torch._dynamo.mark_dynamic(leaf, dim)
        leaves.append(leaf)
    out = model(*leaves)
    # A fixed random cotangent: every output element and every gradient path matters.
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(7)).to(out.device, out.dtype))
    return out.detach(), [p.grad for p in model.parameters()] + [x.grad for x in leaves]


def assert_step_matches(eager: nn.Module, compiled, inputs: tuple, floor: float = TOL[torch.float32]) -> None:
    """One forward + backward of both from zeroed gradients: outputs and every gradient (parameters, inputs)
    within ``floor`` of eager, relative to the largest magnitude (fp32 on both sides)."""
    ref, got = fwd_bwd(eager, inputs), fwd_bwd(compiled, inputs)
    names = ["output"] + [f"grad {n}" for n, _ in eager.named_parameters()] + [
        f"grad input{i}" for i in range(len(inputs))]
    assert len(got[1]) == len(ref[1])
    for name, r, g in zip(names, [ref[0]] + ref[1], [got[0]] + got[1]):
        assert g is not None, f"{name}: the compiled model produced no gradient"
        g = _plain(g)
        assert g.shape == r.shape and g.dtype == r.dtype, (
            f"{name}: {g.dtype}{tuple(g.shape)} vs {r.dtype}{tuple(r.shape)}")
        assert r.abs().max() > 0, f"{name}: the reference is all zeros, the comparison would prove nothing"
        err = _err(g, r)
        assert err <= floor, f"{name}: error {err:.3g} vs eager exceeds {floor:.3g}"


def skip_reasons(pattern: str) -> list[str]:
    return [s.reason for r in fusenorm_inductor.reports() for s in r.skips if s.pattern == pattern]


def joint_rewrites(rep) -> Counter:
    return Counter(r.pattern for r in rep.rewrites if r.stage == "joint")


# ---- dynamic shapes ------------------------------------------------------------------------------------------


# Each way of asking for a symbolic batch with another norm form: every canonical pattern has its own guard.
@pytest.mark.parametrize("how,form", [("dynamic=True", "nn.LayerNorm"), ("mark_dynamic", "llama"),
                                      ("automatic", "nn.RMSNorm")])
def test_dynamic_shapes_no_recompile_per_batch_size(how, form, device):
    """Symbolic batch (M): the fusions stay on (the report says the decision was taken at the traced M), the
    fused ops run at every batch size, and Inductor compiles the forward and backward once for all of them.
    ``automatic`` (dynamic=None): the first size compiles static, the second recompiles once with a symbolic
    batch, the third compiles nothing; both graphs are fused."""
    eager = post_block(form).to(device)
    compiled = torch.compile(copy.deepcopy(eager), backend="fusenorm", dynamic=True if how == "dynamic=True" else None)
    graphs = []  # every graph Inductor compiles, forward and backward
    ops, n_graphs = [], []
    with inductor_config.patch(post_grad_custom_post_pass=graphs.append):
        for rows in (257, 33, 100):
            for _ in range(2):  # the second call of each size runs compiled code only: profile that one
                x = torch.randn(rows, 24, device=device)
                if how == "mark_dynamic":
                    torch._dynamo.mark_dynamic(x, 0)
                ran = fusenorm_ops_run(lambda: assert_step_matches(eager, compiled, (x,)))
            ops.append(ran)
            n_graphs.append(len(graphs))
    if how == "automatic":
        assert n_graphs == [2, 4, 4], n_graphs  # static fwd + bwd, then one dynamic recompile, then none
        assert fusenorm_counts() == {k: 2 * v for k, v in POST.items()}  # the static graph and the dynamic one
    else:
        assert n_graphs == [2, 2, 2], n_graphs
        assert fusenorm_counts() == POST
    assert ops == [POST_OPS, POST_OPS, POST_OPS], ops
    dynamic = [r.detail for rep in fusenorm_inductor.reports() for r in rep.rewrites if "dynamic M" in r.detail]
    # Where nothing is measured (the CPU; the tests' default of tuning.measure off) the note says one decision
    # serves every M; where it was measured, at which M and for which others.
    measured = device == "cuda" and config.tuning.measure
    want = "decided as measured at M = " if measured else "one decision for every M, not measured"
    assert len(dynamic) == 2 and all(want in d and ("not measured" in d) is not measured for d in dynamic), dynamic


# ---- modes ---------------------------------------------------------------------------------------------------


def test_max_autotune(device):
    eager = post_block().to(device)
    compiled = torch.compile(copy.deepcopy(eager), backend="fusenorm", mode="max-autotune")
    assert_step_matches(eager, compiled, (torch.randn(257, 24, device=device),))
    x = torch.randn(257, 24, device=device)
    ran = fusenorm_ops_run(lambda: assert_step_matches(eager, compiled, (x,)))
    # On CUDA max-autotune also captures CUDA graphs: a replay dispatches no op for the profiler to see.
    assert ran == POST_OPS if device == "cpu" else ran <= POST_OPS
    assert fusenorm_counts() == POST


@ON_CUDA
def test_reduce_overhead_cuda_graphs():
    """mode="reduce-overhead": the fused graphs are captured and replayed as CUDA graphs (no skip), and each
    step still matches eager (warm-up, recording, two replays)."""
    torch.manual_seed(0)
    eager = ContractNet().cuda()
    compiled = torch.compile(copy.deepcopy(eager), backend="fusenorm", mode="reduce-overhead")
    for _ in range(4):
        torch.compiler.cudagraph_mark_step_begin()
        assert_step_matches(eager, compiled, (torch.randn(257, 24, device="cuda"),))
    assert fusenorm_counts() == TRAIN
    assert counters["inductor"]["cudagraph_skips"] == 0, "CUDA graphs were skipped for a fused graph"


# ---- the FX graph cache -------------------------------------------------------------------------------------

_CACHE_RUN = textwrap.dedent(
    """
    import copy, json, sys
    import torch
    from torch._dynamo.utils import counters
    from fusenorm_inductor import passes
    from tests.test_contract import assert_step_matches, fusenorm_ops_run, post_block

    device = sys.argv[1]
    eager = post_block().to(device)
    compiled = torch.compile(copy.deepcopy(eager), backend="fusenorm")
    assert_step_matches(eager, compiled, (torch.randn(257, 24, device=device),))
    x = torch.randn(257, 24, device=device)
    ops = fusenorm_ops_run(lambda: assert_step_matches(eager, compiled, (x,)))
    print(json.dumps({"fusenorm": dict(counters["fusenorm"]), "ops": sorted(ops), "uuid": passes.JOINT.uuid(),
                      "cache": {k: v for k, v in counters["inductor"].items() if k.startswith("fxgraph_cache")}}))
    """
)


def _cache_run(tmp_path: Path, device: str, **env_extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_FORCE_DISABLE_CACHES" and k not in CACHES_OFF}
    env.update(TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"), FUSENORM_CACHE_DIR=str(tmp_path / "fusenorm"),
               FUSENORM_TUNE="0",  # the tests' setting: every match fused, whatever the GPU measures
               TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS="0",  # a fresh cache dir: building the header costs more
               **env_extra)
    out = subprocess.run([sys.executable, "-c", _CACHE_RUN, device], capture_output=True, text=True, env=env,
                         cwd=ROOT, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_fx_graph_cache_second_process_runs_fused_code(tmp_path, device):
    """A second process with the same cache dir is served forward and backward from Inductor's FX graph cache
    (fusenorm's fusion passes do not run: no counts) and still runs the fused ops, matching eager. The passes' uuid()
    is in the cache key (a pass without one would make Inductor bypass the cache: no hit)."""
    first = _cache_run(tmp_path, device)
    assert first["cache"] == {"fxgraph_cache_miss": 2}, first
    assert first["fusenorm"] == {"canonical_layer_norm": 1, **POST}, first
    assert set(first["ops"]) == POST_OPS, first
    second = _cache_run(tmp_path, device)
    assert second["uuid"] == first["uuid"], "the passes' uuid differs between processes (were sources edited?)"
    assert second["cache"] == {"fxgraph_cache_hit": 2}, second
    # Served from the cache: the joint pass (every fusion) did not run. The pre-grad pass (canonical norms)
    # runs before the cache lookup up to torch 2.12 and after it (so not at all on a hit) from torch 2.13.
    assert second["fusenorm"] in ({}, {"canonical_layer_norm": 1}), second
    assert set(second["ops"]) == POST_OPS, second


def test_pass_uuid_tracks_source_and_config(tmp_path, monkeypatch):
    """The uuid Inductor's caches key on hashes every source file of the package and the whole config."""
    pkg = Path(fusenorm_inductor.__file__).resolve().parent
    sources = passes._source_files()
    for rel in ("backend.py", "passes.py", "config.py", "ops/mm_norm.py", "patterns/post_norm.py",
                "patterns/canonical_norms.py"):
        assert str((pkg / rel).resolve()) in {str(Path(s).resolve()) for s in sources}, rel
    uuid = passes.JOINT.uuid()
    assert uuid == passes.JOINT.uuid() and uuid != passes.PRE_GRAD.uuid()
    with config.patch({"patterns.linear_norm_fwd": False}):
        assert passes.JOINT.uuid() != uuid
    with config.patch({"tuning.margin": 0.5}):
        assert passes.JOINT.uuid() != uuid

    def copies(name: str, files, edit: bool = False) -> tuple[str, ...]:
        out = []
        for i, src in enumerate(files):
            dst = tmp_path / name / f"{i}.py"
            dst.parent.mkdir(exist_ok=True)
            shutil.copy(src, dst)
            out.append(str(dst))
        if edit:
            with open(out[-1], "a") as f:
                f.write("\n# changed\n")
        return tuple(out)

    snapshot = copies("a", sources)  # one snapshot of the sources, copied twice and once with a change
    same, changed = copies("b", snapshot), copies("c", snapshot, edit=True)
    uuids = []
    for files in (snapshot, same, changed):
        monkeypatch.setattr(passes, "_source_files", lambda files=files: files)
        uuids.append(passes.JOINT.uuid())
    assert uuids[0] == uuids[1], "the hash is of the contents, not the paths"
    assert uuids[2] != uuids[0], "a changed source file must change the uuid"


# ---- autocast and inference ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "device,dtype",
    [("cpu", torch.bfloat16), pytest.param("cuda", torch.bfloat16, marks=ON_CUDA),
     pytest.param("cuda", torch.float16, marks=ON_CUDA)],
    ids=["cpu-bf16", "cuda-bf16", "cuda-fp16"],
)
def test_autocast(device, dtype):
    """Post-norm and both regrouped backwards are fused under autocast; pre-norm is declined (autocast casts the
    fp32 norm output before the linear) and the report names the cast."""
    assert_matches_eager(ContractNet, (torch.randn(257, 24),), torch.float32, device, autocast=dtype)
    assert fusenorm_counts() == {"linear_norm_fwd": 1, "dgrad_norm_bwd": 2}
    assert any("not a linear (call_function convert_element_type" in r for r in skip_reasons("norm_linear_fwd")), (
        skip_reasons("norm_linear_fwd"))


@pytest.mark.parametrize("grad_mode", ["training", "no_grad", "inference_mode"])
def test_training_and_inference(grad_mode, device):
    """Every pattern in training; in inference (no backward) the forward ones only."""
    torch.manual_seed(0)
    eager = ContractNet().to(device)
    compiled = torch.compile(copy.deepcopy(eager), backend="fusenorm")
    ctx = {"training": contextlib.nullcontext, "no_grad": torch.no_grad, "inference_mode": torch.inference_mode}
    for _ in range(2):  # compile, then run compiled code only
        x = torch.randn(257, 24, device=device)
        if grad_mode == "training":
            ran = fusenorm_ops_run(lambda: assert_step_matches(eager, compiled, (x,)))
        else:
            with ctx[grad_mode]():
                ran = fusenorm_ops_run(lambda: torch.testing.assert_close(compiled(x), eager(x), atol=2e-5, rtol=2e-5))
    assert ran == (TRAIN_OPS if grad_mode == "training" else INFER_OPS)
    assert fusenorm_counts() == (TRAIN if grad_mode == "training" else INFER)


# ---- DDP and FSDP2 -------------------------------------------------------------------------------------------


class TwoBlocks(nn.Module):
    """Two post-norm blocks of different widths (one class: a second frame of the same code under FSDP2)."""

    def __init__(self):
        super().__init__()
        self.a = PostNormBlock(24, 40, "nn.LayerNorm", out=32)
        self.b = PostNormBlock(32, 48, "nn.RMSNorm", out=24)

    def forward(self, x):
        return self.b(self.a(x))


@pytest.fixture
def process_group(tmp_path, device):
    """A one-process group (gloo on CPU, NCCL on CUDA), rendezvous through a file: no port, no network."""
    import torch.distributed as dist

    if device == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if device == "cuda" else "gloo", store=dist.FileStore(str(tmp_path / "store"), 1),
                            rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _one_graph_per_block() -> None:
    fused = [r for r in fusenorm_inductor.reports() if r.rewrites]
    assert len(fused) == 2, f"expected one compiled graph per block, got {[r.graph_id for r in fused]}"
    for rep in fused:
        assert joint_rewrites(rep) == {"linear_norm_fwd": 1, "dgrad_norm_bwd": 1}, (rep.graph_id, rep.rewrites)


def test_ddp_matches_inside_each_bucket(process_group, device, monkeypatch):
    """DDP's graph breaks at its gradient-bucket boundaries (DDPOptimizer): with buckets of one block each, the
    backend compiles one graph per block, and each block is fused inside its graph."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    eager = TwoBlocks().to(device)
    model = copy.deepcopy(eager)
    # Smaller than a block's parameters, larger than any one linear's: a bucket (and a graph) per block.
    cap = 0.75 * sum(p.numel() * p.element_size() for p in model.b.parameters())
    monkeypatch.setattr(torch.distributed, "_DEFAULT_FIRST_BUCKET_BYTES", int(cap))  # DDPOptimizer's first bucket
    compiled = torch.compile(DDP(model, bucket_cap_mb=cap / 2**20), backend="fusenorm")
    for _ in range(2):
        assert_step_matches(eager, compiled, (torch.randn(257, 24, device=device),))
    _one_graph_per_block()


def test_fsdp2_matches_inside_each_shard(process_group, device):
    """FSDP2 (fully_shard per block): Dynamo breaks the graph at each block's FSDP hooks, so each block is its own
    graph; the second block recompiles the same forward code with other widths (Dynamo passes the norm's
    normalized_shape as a symbolic input there), and is still fused."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    eager = TwoBlocks().to(device)
    model = copy.deepcopy(eager)
    mesh = init_device_mesh(device, (1,))
    for module in (model.a, model.b, model):
        fully_shard(module, mesh=mesh)
    compiled = torch.compile(model, backend="fusenorm")
    for _ in range(2):
        assert_step_matches(eager, compiled, (torch.randn(257, 24, device=device),))
    _one_graph_per_block()


# ---- compiled twice ------------------------------------------------------------------------------------------


def test_model_compiled_twice(device):
    """Two torch.compile calls on one model both run fused code; a plain-Inductor compile of the same model next
    to them runs none (the backend's passes do not leak into Inductor's global config); after
    torch._dynamo.reset() the model compiles and fuses again."""
    eager = post_block().to(device)
    model = copy.deepcopy(eager)
    first = torch.compile(model, backend="fusenorm")
    second = torch.compile(model, backend="fusenorm")
    plain = torch.compile(model)

    def runs(compiled) -> set[str]:
        assert_step_matches(eager, compiled, (torch.randn(257, 24, device=device),))
        x = torch.randn(257, 24, device=device)
        return fusenorm_ops_run(lambda: assert_step_matches(eager, compiled, (x,)))

    assert runs(first) == POST_OPS
    assert runs(second) == POST_OPS
    assert runs(plain) == set()
    assert inductor_config.pre_grad_custom_pass is None and inductor_config.joint_custom_pre_pass is None
    assert fusenorm_counts() == POST  # the second wrapper reused the first one's compiled code
    torch._dynamo.reset()
    assert runs(torch.compile(model, backend="fusenorm")) == POST_OPS
    assert fusenorm_counts() == {k: 2 * v for k, v in POST.items()}


# ---- errors fall back to Inductor ----------------------------------------------------------------------------


def _fail_after(original):
    def failing(*args, **kwargs):
        original(*args, **kwargs)  # the graph half rewritten (and counted), then a failure
        raise RuntimeError("injected failure")

    return failing


# One failure per place a pass runs: the pre-grad slot, the joint slot (the last fusion pattern, after the
# others rewrote: all of it is rolled back; test_plugin.py fails the first one), and the decomposition, which is
# also the joint slot's own fallback.
@pytest.mark.parametrize("slot", ["canonical_norms", "dgrad_norm_bwd", "decompose"])
def test_pass_error_falls_back_with_warning(slot, device, monkeypatch):
    """An exception anywhere in fusenorm's passes warns and compiles the graph as plain Inductor would: counts
    rolled back, the error in the report, no fused op runs. In the decomposition of the unfused canonical norms
    (which is also the joint stage's fallback), the canonical ops stay and run their reference implementation."""
    from fusenorm_inductor.patterns import canonical_norms, decompose, dgrad_norm_backward

    target = {"canonical_norms": (canonical_norms.LayerNormCall, "rewrite"),
              "dgrad_norm_bwd": (dgrad_norm_backward.DgradNormBwd, "rewrite"),
              "decompose": (decompose, "decompose_node")}[slot]
    monkeypatch.setattr(*target, _fail_after(getattr(*target)))
    if slot == "decompose":  # every norm reaches the joint graph canonical, so one is left there to decompose
        from fusenorm_inductor.patterns import prospects

        monkeypatch.setattr(prospects.NormProspects, "prospects", lambda self, op, orig: [])
    # The joint-stage failures need every pattern (all rewritten, then rolled back) and an unfused norm.
    torch.manual_seed(0)
    eager = (post_block() if slot == "canonical_norms" else ContractNet()).to(device)
    compiled = torch.compile(copy.deepcopy(eager), backend="fusenorm")
    with config.patch(fallback_on_error=True), pytest.warns(UserWarning, match="injected failure") as warned:
        assert_step_matches(eager, compiled, (torch.randn(257, 24, device=device),))
    x = torch.randn(257, 24, device=device)
    ran = fusenorm_ops_run(lambda: assert_step_matches(eager, compiled, (x,)))
    (rep,) = fusenorm_inductor.reports()
    stage = "pre_grad" if slot == "canonical_norms" else "joint"
    assert rep.errors and rep.errors[0].startswith(f"{stage} pass failed (RuntimeError: injected failure)"), rep.errors
    assert not [r for r in rep.rewrites if r.stage == stage]
    assert fusenorm_counts() == {}
    if slot == "canonical_norms":
        assert dict(counters["fusenorm"]) == {} and ran == set()
    elif slot == "decompose":
        assert any("decomposing the canonical norms failed too" in str(w.message) for w in warned)
        assert dict(counters["fusenorm"]) == {"canonical_layer_norm": 2, "canonical_rms_norm": 1}
        assert ran == {"fusenorm::norm", "fusenorm::norm_backward"}  # the reference ops, unfused
    else:
        assert dict(counters["fusenorm"]) == CANONICAL and ran == set()  # all decomposed back to aten


def test_debug_dump_failure_does_not_fail_compile(tmp_path):
    """A debugging aid that fails (here debug_dir names a file, not a directory) warns; the graph is still fused."""
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    with config.patch(debug_dir=str(not_a_dir), fallback_on_error=True), pytest.warns(
            UserWarning, match="debug dumps of graph .* not written in .*file"):
        assert_matches_eager(post_block, (torch.randn(257, 24),), torch.float32, "cpu")
    assert fusenorm_counts() == POST
