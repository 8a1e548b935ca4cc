"""Every Gluon kernel variant the dispatch can launch compiles for sm_90a, without spills, within shared memory.

Gluon has no interpreter, so the CPU suite (and CI) compiles each specialization ``mm_norm``'s dispatch can
pick (``kernels/hopper/mm_norm.offline_variants``: ``candidates`` over a grid of N, K and save_normed, with
the epilogue's heaviest and lightest flag sets, and the plain-epilogue GEMM base) with ``triton.compile`` for
a CUDA target: API drift in a newer triton, register spills and shared-memory overflows fail here before any
GPU sees them. Numerics are checked on the H200 (test_gluon_mm_norm.py). The other Gluon ops' offline modules
(norm_mm, mm_norm_backward, gdpa, deferred_mm) list their variants the same way (kernels/hopper/offline.py).

The compiles run in worker processes without TRITON_INTERPRET (conftest sets it on CPU machines, and the
interpreter replaces the jit functions the compiler needs), beside the rest of the session (offline_compile.py:
conftest.py starts them once the tests are collected); the tests that check their results are marked
``offline_compile`` and run last, each op's variants in chunks, so the run shows their progress.
"""

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from fusenorm_inductor.kernels.hopper import _compat  # noqa: E402

from . import offline_compile  # noqa: E402

pytestmark = pytest.mark.skipif(not _compat.available(), reason=f"no usable Gluon: {_compat.GLUON_ERROR}")

# Each op's variants (offline.variants(), in this order) are checked in this many chunks of consecutive variants:
# one test per chunk, in the order the workers compile them.
CHUNKS = {"mm_norm": 8, "mm_norm_backward": 4, "norm_mm": 1, "gdpa": 4, "deferred_mm": 4}


@pytest.fixture(scope="module", params=offline_compile.PYTHONS, ids=offline_compile.python_id)
def python(request):
    return request.param


@pytest.fixture(scope="module")
def compiles():
    return offline_compile.pool()


def _chunk(variants: list, op: str, chunk: int) -> list:
    """The indices of the op's variants in chunk ``chunk`` of ``CHUNKS[op]``."""
    mine = [i for i, v in enumerate(variants) if v.get("op", "mm_norm") == op]
    n = CHUNKS[op]
    return mine[chunk * len(mine) // n:(chunk + 1) * len(mine) // n]


@pytest.fixture(scope="module")
def compiled(python, compiles):
    """Every variant's result for this interpreter (kernels/hopper/offline._compile_one's)."""
    return compiles.results(python, range(len(compiles.variants(python))))


def _label(v):
    from fusenorm_inductor.kernels.triton.common import GemmConfig

    if v.get("op") == "gdpa":
        return f"gdpa {v['kind']} D={v['d']} S={v['s']} act={v['act']} {v['dtype']} {v['config']}"
    if v.get("op") == "deferred_mm":
        return (f"deferred_mm {GemmConfig(*v['config']).label()} N={v['n']} K={v['k']} {v['flags']} "
                f"out_tile={v['out_tile']}")
    base = " gemm-base" if v["gemm_only"] else ""
    op = v.get("op", "mm_norm")
    return f"{op} {GemmConfig(*v['config']).label()} N={v['n']} {v['flags']} save={v['save_normed']}{base}"


def _gemm(compiled):
    return [v for v in compiled if v.get("op") != "gdpa"]


@pytest.mark.offline_compile
@pytest.mark.parametrize("op, chunk", [(op, i) for op, n in CHUNKS.items() for i in range(n)])
def test_all_compile_without_spills(python, compiles, op, chunk):
    from fusenorm_inductor.kernels.hopper.launch import SMEM_LIMIT

    indices = _chunk(compiles.variants(python), op, chunk)
    assert indices, f"no {op} variants in chunk {chunk}"
    bad = []
    for v in compiles.results(python, indices):
        if not v["ok"]:
            bad.append(f"{_label(v)}: {v['error']}")
        elif v["spill_bytes"] and not _known_spill(v):
            bad.append(f"{_label(v)}: {v['spill_bytes']} bytes of local memory per thread (spills)")
        elif v["shared"] > SMEM_LIMIT:
            bad.append(f"{_label(v)}: {v['shared']} bytes of shared memory > {SMEM_LIMIT}")
    assert not bad, "\n".join(bad)


@pytest.mark.offline_compile
def test_every_path_is_compiled(compiled):
    gdpa = {(v["kind"], v["d"], v["act"]) for v in compiled if v.get("op") == "gdpa"}
    assert gdpa == {(k, d, a) for k in ("fwd", "dq", "dkdv", "fna", "fnb") for d in (64, 128) for a in range(5)}, gdpa
    compiled = _gemm(compiled)
    kinds = {v["config"][0] for v in compiled}
    # the deferred GEMMs' CTA pairs where the compiling triton's Gluon has the multi-CTA API (not 3.6)
    pair_kinds = set() if compiled[0]["triton"].startswith("3.6.") else {"gl_pair", "gl_pair_pp"}
    assert kinds == {"gl_coop", "gl_pp", "gl_cluster", "gl_rows"} | pair_kinds, kinds
    clusters = {v["n"] for v in compiled if v["config"][0] == "gl_cluster"}
    assert {320, 1000, 2048, 4096} <= clusters, clusters
    assert any(v["gemm_only"] for v in compiled) and any(v["save_normed"] for v in compiled)
    assert {v["config"][0] for v in compiled if v.get("op") == "norm_mm"} == {"gl_coop", "gl_pp", "gl_rows"}
    backward = {(v["config"][0], v["flags"]) for v in compiled if v.get("op") == "mm_norm_backward"}
    assert {k for k, _ in backward} == {"gl_coop", "gl_pp", "gl_cluster"} and len(backward) == 12, backward
    from fusenorm_inductor.kernels.hopper import deferred_mm

    deferred = [v for v in compiled if v.get("op") == "deferred_mm"]
    # CTA pairs where the compiling triton's Gluon has the multi-CTA API (not 3.6), for the flag sets without
    # a residual, B as [N, K]
    pair_kinds = {deferred_mm.PAIR_KIND, deferred_mm.PAIR_PP_KIND}
    pairs = [v for v in deferred if v["config"][0] in pair_kinds]
    assert bool(pairs) == (not deferred[0]["triton"].startswith("3.6."))
    assert {v["config"][0] for v in deferred} == {"gl_coop", "gl_pp"} | (pair_kinds if pairs else set())
    assert {v["flags"] for v in deferred} == set(deferred_mm.OFFLINE_FLAGS) - (
        set() if pairs else set(deferred_mm.PAIR_ONLY_FLAGS))
    assert all(not deferred_mm.OFFLINE_FLAGS[v["flags"]]["residual"] and not v["b_kn"] for v in pairs)
    assert not pairs or set(deferred_mm.PAIR_ONLY_FLAGS) <= {v["flags"] for v in pairs}
    # every statistics group width of the grid, and LayerNorm's groups that straddle N (NaN-padded bias)
    assert {v["out_tile"] for v in deferred} == {0, *deferred_mm.OFFLINE_OUT_TILES}
    assert any(v["flags"].startswith(("prod_ln", "chain_ln")) and v["n"] % v["out_tile"] for v in deferred)


_KNOWN_BWD_SPILLS = {("ln_full", "gl_pp", 128, 128), ("ln_full", "gl_pp", 64, 256),
                     ("ln_full", "gl_cluster", 128, 256), ("ln_full", "gl_coop", 128, 128),
                     ("rms_full", "gl_pp", 128, 128)}


def _known_spill(v) -> bool:
    """The specializations known to spill (8 to ~300 bytes per thread; the launcher refuses to run any kernel
    that spills and falls back to the tl path): LayerNorm with bias, residual, affine (and hh) at 256-wide
    tiles, where N is not a multiple of the tile (the masked statistics) or over a cluster (Chan's merge):
    on triton 3.6 only those; triton 3.9 spills more of the same flag set (58 of 423 variants). Anything else
    that spills is a regression. The variants compile with the runtime's specializations (cpu_compile.runtime_attrs:
    16-divisible pointers and sizes, fp32 norm weights where the op passes them), so a spill the H200 would
    meet at launch shows here."""
    if v.get("op") == "gdpa":
        # FlashNormAttention's attention step without norm weights, and its whole block at H = 1, with erf GELU at
        # D = 128: 8-16 bytes on triton 3.6 (refused at launch: the Triton kernels run that activation there)
        return (v["triton"].startswith("3.6.") and v["kind"] in ("fna", "fnb") and v["act"] == 1 and v["d"] == 128
                and v["spill_bytes"] <= 16)
    if v.get("op") == "norm_mm":
        # the pre-norm forward: clean on triton 3.6; triton 3.9 spills 8 bytes in most of its LayerNorm variants
        # with a bias (refused at launch like any spill: the tl kernels run there)
        return not v["triton"].startswith("3.6.") and v["flags"] != "rms"
    if v.get("op") == "mm_norm_backward":
        if not v["triton"].startswith("3.6."):
            # Newer tritons spill more of the backward (triton 3.9: 8-370 bytes in 68 of 192 variants, LayerNorm
            # over clusters in every cluster tile): refused at launch like any spill, the dispatch times the next
            # candidate or the tl kernels. test_backward_fits_one_tile_without_spills keeps one-tile rows on Gluon.
            return True
        # the backward's epilogue at 240 registers per consumer thread, with extra, from x and an fp32 weight:
        # LayerNorm at 128 x 128 and 64 x 256 ping-pong tiles, 128 x 128 cooperative tiles of 4 warps and
        # 128 x 256 cluster tiles (8-168 bytes); RMSNorm at 128 x 128 ping-pong tiles (8 bytes)
        return (v["flags"], *v["config"][:3]) in _KNOWN_BWD_SPILLS
    return v["flags"] == "ln_full" and (v["n"] % v["config"][2] != 0 or v["config"][0] == "gl_cluster"
                                        or v["config"][2] == 256)


# Triton 3.9 spills every 256-wide backward candidate of LayerNorm with an affine weight (8-104 bytes): those
# shapes run the tl kernels there (docs/support.md, "Hopper kernels").
_NO_CLEAN_BWD_NEXT = {(256, "ln_full"), (256, "ln_normed")}


@pytest.mark.offline_compile
def test_backward_fits_one_tile_without_spills(compiled):
    """Every tile width of one-tile rows (N <= 256) and every flag set keeps at least one backward candidate
    that does not spill on triton 3.6 (on newer tritons all but ``_NO_CLEAN_BWD_NEXT``): there the Gluon path
    is never lost to spills alone."""
    clean, seen = set(), set()
    for v in _gemm(compiled):
        if v.get("op") != "mm_norm_backward" or v["config"][0] == "gl_cluster":
            continue
        key = (v["config"][2], v["flags"])
        seen.add(key)
        if v["ok"] and not v["spill_bytes"]:
            clean.add(key)
    allowed = set() if compiled[0]["triton"].startswith("3.6.") else _NO_CLEAN_BWD_NEXT
    assert seen and seen - clean <= allowed, sorted(seen - clean - allowed)


@pytest.mark.offline_compile
def test_cluster_barrier_exactly_where_rows_are_exchanged(compiled):
    """Cluster barriers where CTAs exchange row statistics (``gl_cluster``), and in the CTA pairs (pair_core),
    where the compiler syncs the pair around the kernel (barriers one CTA arrives on in the other's shared
    memory are initialized, and released, for both); nowhere else."""
    for v in _gemm(compiled):
        exchanges = v["config"][0] == "gl_cluster" and not v["gemm_only"]  # forward and backward alike
        pair = v["config"][0] in ("gl_pair", "gl_pair_pp")
        assert v["cluster_barrier"] == (exchanges or pair), _label(v)


def test_on_by_default_and_switchable():
    from fusenorm_inductor import config
    from fusenorm_inductor.tuning import mm_norm as fwd_t

    a = torch.empty((257, 64), dtype=torch.bfloat16)
    b = torch.empty((128, 64), dtype=torch.bfloat16).t()
    assert config.gluon
    assert "not on CUDA" in fwd_t.gluon_unsupported(a, b, None, None, None, None, None, False)
    with config.patch(gluon=False):
        assert "config.gluon" in fwd_t.gluon_unsupported(a, b, None, None, None, None, None, False)


def test_gdpa_gluon_takes_only_what_it_can():
    from fusenorm_inductor import config
    from fusenorm_inductor.kernels.triton import gdpa as gk

    def reason(t=4, h=2, d=128, s=128, dtype=torch.bfloat16):
        return gk.gluon_unsupported(torch.empty(t, h, d, dtype=dtype), torch.empty(1, s, h, d, dtype=dtype))

    assert "sm_90" in reason() and "sm_90" in reason(d=64, s=16, dtype=torch.float16)
    assert "K/V length 256" in reason(s=256) and "K/V length 40" in reason(s=40)
    assert "head dim 32" in reason(d=32) and "dtype" in reason(dtype=torch.float32)
    with config.patch(gluon=False):
        assert "config.gluon" in reason()
    from fusenorm_inductor.kernels.hopper import gdpa as hopper

    base = torch.empty(4 * 2 * 128 + 1, dtype=torch.bfloat16)
    assert hopper.misaligned(base[:-1].view(4, 2, 128)) is None
    assert "16-byte" in hopper.misaligned(base[:-1].view(4, 2, 128), base[1:].view(4, 2, 128))


def test_gdpa_gluon_launch_guard():
    """``run_gluon``: a launch whose specialization spills falls back and is not compiled again; a tensor TMA
    cannot address falls back without a launch; otherwise the launch runs."""
    from fusenorm_inductor.kernels.hopper.common import SpillError
    from fusenorm_inductor.kernels.triton import gdpa as gk

    calls = []

    def spills():
        calls.append("spill")
        raise SpillError("test")

    ok = torch.empty(64, dtype=torch.bfloat16)
    key = ("test-spill", len(gk._GLUON_SPILLED))
    assert not gk.run_gluon(key, (ok,), spills) and not gk.run_gluon(key, (ok,), spills)
    assert calls == ["spill"]
    assert not gk.run_gluon(("test-aligned",), (ok[1:],), lambda: calls.append("misaligned"))
    assert gk.run_gluon(("test-aligned",), (ok,), lambda: calls.append("ran"))
    assert calls == ["spill", "ran"]
    gk._GLUON_SPILLED.discard(key)


def test_rejects_what_this_path_cannot_take():
    from fusenorm_inductor.kernels.hopper import mm_norm as hopper

    a = torch.empty((257, 40), dtype=torch.bfloat16)
    b = torch.empty((64, 40), dtype=torch.bfloat16).t()
    assert "not on CUDA" in hopper.unsupported(a, b, None, None, None, None, None, False)
    assert hopper.cluster_shape(4096) == (8, 2) and hopper.cluster_shape(8192) == (8, 4)
    assert hopper.cluster_shape(3000) == (6, 2) and hopper.cluster_shape(4352) is None  # 17 tiles: no even split


def test_deferred_mm_configs_split_their_statistics_tiles():
    """``deferred_mm``'s candidates: tiles at most the next power of two of N wide (128 rows), each split
    into whole statistics tiles of out_tile columns, or holding the whole row where one statistics tile
    covers it; an out_tile no tile splits is refused with the reason."""
    from fusenorm_inductor.kernels.hopper import deferred_mm as hopper

    def cands(n, out_tile, k=256):
        a = torch.empty((1000, k), device="meta", dtype=torch.bfloat16)
        b = torch.empty((k, n), device="meta", dtype=torch.bfloat16)
        return [(c.kind, c.block_n) for c in hopper.candidates(a, b, out_tile)]

    assert cands(4096, 0) == [("gl_coop", 256), ("gl_pp", 128), ("gl_coop", 128)]
    assert cands(4096, 256) == [("gl_coop", 256)] and cands(4096, 64) == cands(4096, 0)
    assert cands(40, 0) == cands(40, 48) == cands(40, 64) == [("gl_pp", 64), ("gl_coop", 64)]
    assert cands(200, 256) == [("gl_coop", 256)] and cands(1000, 96) == [] and cands(1000, 4) == []
    assert hopper.out_group(256, 1000, hopper.LN, 32) == 32 and hopper.out_group(64, 40, hopper.RMS, 48) == 64
    assert hopper.out_group(128, 4096, hopper.NONE, 96) == 0 and hopper.out_group(128, 200, hopper.LN, 256) is None
    assert all(c.stages >= 2 for n in (40, 256, 4096) for k in (40, 1000) for c in
               hopper.candidates(torch.empty((8, k), device="meta"), torch.empty((k, n), device="meta"), 0))
    a = torch.empty((257, 40), dtype=torch.bfloat16)
    b = torch.empty((64, 40), dtype=torch.bfloat16).t()
    assert "not on CUDA" in hopper.unsupported(a, b, None, hopper.LN, 32)


def test_deferred_mm_offers_register_statistics_on_ping_pong_tiles():
    """The output statistics summed in registers (``stats_regs``) come as extra candidates after the others:
    ping-pong tiles only, for statistics tiles of 128 columns where N is a multiple of 128 (narrower groups
    and groups straddling N spill there) up to N = 512 (where they were faster); the kernel's REG_STATS is
    set only where statistics are written."""
    from fusenorm_inductor.kernels.hopper import deferred_mm as hopper

    a = torch.empty((1000, 1024), device="meta", dtype=torch.bfloat16)

    def regs(n, out_tile):
        b = torch.empty((n, 1024), device="meta", dtype=torch.bfloat16).t()
        cands = hopper.candidates(a, b, out_tile)
        flags = [c.stats_regs for c in cands]
        assert flags == sorted(flags) and len(set(cands)) == len(cands)  # after the others, each once
        return sorted(c.kind for c in cands if c.stats_regs)

    pp = sorted(["gl_pp"] + ([hopper.PAIR_PP_KIND] if hopper.pair_core.unavailable() is None else []))
    assert regs(512, 128) == regs(256, 128) == pp
    assert regs(384, 64) == regs(384, 256) == regs(384, 0) == regs(64, 128) == regs(1024, 128) == []
    assert regs(200, 128) == []  # a group straddles N
    assert regs(128, 128) == ["gl_pp"]  # one tile holds the row
    cfg = hopper.fit_config("gl_pp", 128, 128, 64, 5, 4, 2)._replace(stats_regs=True)
    assert cfg.label().endswith(" rs")
    shape = hopper.launch_shape(cfg)
    kw = dict(bias=True, residual=False, a_norm=hopper.LN, out_tile=128)
    assert hopper._constexprs(cfg, shape, 1024, False, out_norm=hopper.LN, **kw)["REG_STATS"]
    assert not hopper._constexprs(cfg, shape, 1024, False, out_norm=hopper.NONE, **kw)["REG_STATS"]


def test_deferred_mm_offers_the_cta_pair_where_it_can_run():
    """The CTA-pair tiles (pair_core: one consumer, 128 x 256 per CTA; two in ping-pong, 128 x 128 each) lead
    ``deferred_mm``'s candidates for rows wider than 128 where this triton's Gluon has the multi-CTA API (never
    on 3.6), with B an nn.Linear weight and no residual; they are never offered with a residual, row-scaled
    residual terms, a row-major B or rows of 128."""
    from fusenorm_inductor.kernels.hopper import deferred_mm as hopper
    from fusenorm_inductor.kernels.hopper import pair_core

    a = torch.empty((1000, 1024), device="meta", dtype=torch.bfloat16)
    weight = torch.empty((2048, 1024), device="meta", dtype=torch.bfloat16)

    def kinds(b, out_tile=128, **kw):
        return [c.kind for c in hopper.candidates(a, b, out_tile, **kw)]

    here = pair_core.unavailable() is None
    pairs = [hopper.PAIR_KIND, hopper.PAIR_PP_KIND]
    assert (kinds(weight.t())[:2] == pairs) == here and (kinds(weight.t(), 0)[:2] == pairs) == here
    others = (kinds(weight.t(), residual=True) + kinds(weight.t(), res_rows=True) + kinds(weight.t().contiguous())
              + kinds(weight[:128].t()))
    assert not set(pairs) & set(others)
    pair = hopper.fit_config(hopper.PAIR_KIND, 128, 256, 64, 4, 8, 1)
    assert hopper.launch_shape(pair).ctas == 2 and hopper._blocks(pair, hopper.launch_shape(pair), False) == (
        [256, 64], [256, 64], [256, 256], [256, 256])
    pp = hopper.launch_shape(hopper.fit_config(hopper.PAIR_PP_KIND, 128, 128, 64, 5, 4, 2))
    assert (pp.ctas, pp.ncons, pp.num_warps) == (2, 2, 4)
    with pytest.raises(ValueError, match="residual"):
        hopper._constexprs(pair, hopper.launch_shape(pair), 1024, False, bias=True, residual=True, a_norm=hopper.LN,
                           out_norm=hopper.LN, out_tile=128)


def test_backward_column_sums_fold_programs_and_clusters():
    """The launcher's sum of the backward's per-warp dw/db rows: program p of a cluster of c holds the
    cluster's N tile p % c, so its rows add into columns (p % c) * BN and up."""
    from fusenorm_inductor.kernels.hopper.mm_norm_backward import _columns

    programs, warps, bn = 6, 4, 8
    part = torch.randn(programs * warps, bn)
    per_program = part.view(programs, warps, bn).sum(1)
    for c, n in ((1, 8), (1, 5), (2, 13), (3, 24)):
        want = torch.cat([per_program[r::c].sum(0) for r in range(c)])[:n]
        torch.testing.assert_close(_columns(part, programs, c, n), want)


@pytest.mark.parametrize("launcher", ["fwd", "fna", "fnb"])
def test_gdpa_launchers_pass_every_kernel_argument(monkeypatch, launcher):
    """The Q-tile launchers (kernels/hopper/gdpa._launch_q_tiles) on the CPU, with the plan captured instead of
    compiled: descriptors, runtime arguments and compile-time arguments line up with the kernel's parameters
    (one TMA box per descriptor), and the FLAGS say which norm weights are present."""
    import inspect

    from fusenorm_inductor.kernels.hopper import gdpa as hopper

    captured = []
    monkeypatch.setattr(hopper, "_launch", lambda key, make, descs, rest: captured.append((key, make(), descs, rest)))
    monkeypatch.setattr(hopper, "Plan", lambda *a: a)
    monkeypatch.setattr(hopper, "num_sms", lambda device: 132)
    h = 1 if launcher == "fnb" else 2
    bf16 = torch.bfloat16
    q, o = torch.randn(100, h, 128, dtype=bf16), torch.empty(100, h, 128, dtype=bf16)
    k = torch.randn(3, 128, h, 128, dtype=bf16)
    offs = torch.tensor([0, 40, 60, 100], dtype=torch.int32)
    stats, w = torch.zeros(100), torch.ones(h * 128)
    if launcher == "fwd":
        hopper.gdpa_fwd_gluon(q, k, k, offs, o, 40, 0, 0.5)
        kernel, flags = hopper.gdpa_fwd_kernel, None
    elif launcher == "fna":
        hopper.fna_attention_gluon(q, k, k, offs, 40, w, None, stats, stats, o, torch.zeros(100, h), 0, 0.5)
        kernel = hopper.gdpa_fna_kernel
        flags = hopper.FLAG_LN_WEIGHT.value | (hopper.FLAG_STAGED_STATS.value if hopper.STAGE_STATS else 0)
    else:
        hopper.fna_block_gluon(q, k, k, offs, 40, None, None, w, 1e-5, 1e-6, o, stats, stats, stats, o.clone(), 0,
                               0.5)
        kernel, flags = hopper.gdpa_fnb_kernel, hopper.FLAG_BLOCK.value | hopper.FLAG_RMS_WEIGHT.value
    (key, plan, descs, rest), = captured
    _, _, plan_descs, blocks, plan_rest, consts, grid, _, _ = plan
    params = list(inspect.signature(kernel.fn).parameters)
    assert key[0] == launcher and plan_descs is descs and plan_rest is rest and grid == 3 * h
    assert len(blocks) == len(descs) and all(p.endswith("_desc") for p in params[:len(descs)])
    assert len(descs) + len(rest) + len(consts) + 1 == len(params) and params[-1] == "num_warps"
    assert params[len(descs)] == "o_ptr" and rest[0] is o
    assert ("FLAGS" in params) == (flags is not None)
    if flags is not None:
        assert consts[params.index("FLAGS") - len(descs) - len(rest)] == flags
