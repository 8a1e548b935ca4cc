"""The training examples (examples/) at tiny sizes on the CPU: fusenorm and plain Inductor train the same model
from the same seed to the same losses, and the match report lists the fusions each example is there to show
(MLP: every post-norm forward and regrouped backward; PFFN: each FlashNormAttention block). Plus the
report summary and the loss comparison the examples and benchmarks/bench_models.py print."""

import json
import os
import sys

import pytest
import torch
import torch._inductor.config as inductor_config

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
import _common  # noqa: E402
import infer_mlp  # noqa: E402
import train_hf  # noqa: E402
import train_mlp  # noqa: E402
import train_pffn  # noqa: E402

from fusenorm_inductor import report as fn_report  # noqa: E402
from fusenorm_inductor.report import GraphReport  # noqa: E402


@pytest.fixture(autouse=True)
def _scalar_cpp_kernels():
    """Scalar C++ kernels on the CPU: Inductor compiles them in about half the time of vectorized ones (these
    tests check losses and the report, not speed)."""
    with inductor_config.patch({"cpp.simdlen": 1}):
        yield


def test_train_mlp_fuses_every_post_norm(tmp_path):
    out = tmp_path / "mlp.json"
    # The CPU in fp32 on a GPU machine too: the losses must agree to 1e-5 (bf16 on a GPU agrees to its noise).
    result = train_mlp.main(["--device", "cpu", "--rows", "48", "--width", "24", "--depth", "2", "--steps", "4",
                             "--report", "none", "--json", str(out)])
    assert result["agreement"]["agree"], result["agreement"]
    assert result["agreement"]["max_abs_diff"] < 1e-5
    rep = result["runs"]["fusenorm"]["report"]
    # Linear -> LN -> Linear -> LN -> head: both norms' forwards fuse into the linear before them, both
    # backwards into the data-gradient GEMM of the linear after them.
    assert rep["rewrites"] == {"linear_norm_fwd": 2, "dgrad_norm_bwd": 2}
    assert (rep["norm_sites"], rep["fused_sites"], rep["unfused_sites"], rep["unaccounted_sites"]) == (2, 2, 0, 0)
    assert rep["errors"] == []
    data = json.loads(out.read_text())
    assert data["runs"]["fusenorm"]["losses"] == pytest.approx(data["runs"]["inductor"]["losses"], rel=1e-5)
    assert "reports" not in data["runs"]["fusenorm"]  # the summary only


def test_infer_mlp_serves_the_same_outputs():
    result = infer_mlp.main(["--device", "cpu", "--rows", "40", "--width", "24", "--depth", "2", "--batches", "2",
                             "--report", "none"])
    assert result["max_abs_diff"] <= 1e-5 * result["scale"]
    rep = result["report"]
    assert rep["norm_sites"] == 2 and rep["fused_sites"] == 2 and rep["errors"] == [], rep


def test_train_pffn_fuses_each_attention_block():
    result = train_pffn.main(["--fuse-training", "--batch", "2", "--lmax", "6", "--heads", "2", "--dim", "8",
                              "--ctx", "4", "--blocks", "2", "--steps", "3", "--report", "none"])
    assert result["agreement"]["agree"], result["agreement"]
    rep = result["runs"]["fusenorm"]["report"]
    assert rep["rewrites"] == {"attention_block_dense": 2}, rep
    assert (rep["norm_sites"], rep["fused_sites"], rep["unaccounted_sites"]) == (4, 4, 0)
    assert rep["other_skips"] == {}


@pytest.mark.skipif(not train_hf.have_transformers(), reason="transformers is not installed (optional extra)")
@pytest.mark.parametrize("model", ["llama", "bert"])
def test_train_hf_every_norm_site_accounted_for(model):
    result = train_hf.main(["--model", model, "--hidden", "32", "--heads", "2", "--intermediate", "64", "--layers",
                            "1", "--vocab", "64", "--batch", "2", "--seq", "8", "--steps", "2", "--report", "none"])
    r = result[model]
    assert r["agreement"]["agree"], r["agreement"]
    rep = r["runs"]["fusenorm"]["report"]
    assert rep["norm_sites"] == (3 if model == "llama" else 4)  # per layer 2, + final (llama) / embedding + head (bert)
    assert rep["unaccounted_sites"] == 0 and rep["errors"] == []
    assert rep["fused_sites"] >= 2  # llama: pre-norm and post-norm sites; bert: both post-LNs of the layer


def test_train_hf_without_transformers_exits_cleanly(monkeypatch, capsys):
    monkeypatch.setattr(train_hf, "have_transformers", lambda: False)
    assert train_hf.main([]) == {}
    assert "transformers is not installed" in capsys.readouterr().out


def test_loss_agreement_flags_a_wrong_curve():
    ok = _common.loss_agreement([1.0, 0.8, 0.6, 0.5], [1.0, 0.8, 0.6, 0.501], torch.bfloat16)
    assert ok["agree"] and ok["max_abs_diff"] == pytest.approx(1e-3)
    bad = _common.loss_agreement([1.0, 0.9, 0.9, 0.9], [1.0, 0.8, 0.6, 0.5], torch.bfloat16)
    assert not bad["agree"] and bad["final_rel_diff"] == pytest.approx(0.8)
    assert not _common.loss_agreement([1.0, float("nan")], [1.0, 0.5], torch.float32)["agree"]


def test_report_summary_accounts_for_every_norm_site():
    rep = GraphReport("000_0/0")
    for i in range(4):
        rep.rewrite("canonical_layer_norm", "pre_grad", [f"ln{i}"], {}, "float32", "fusenorm::norm")
    rep.rewrite("linear_norm_fwd", "joint", ["norm", "addmm"], {}, "float32", "fusenorm::mm_norm")
    rep.rewrite("dgrad_norm_bwd", "joint", ["norm_backward", "mm"], {}, "float32", "fusenorm::mm_norm_backward")
    rep.skip("linear_norm_fwd", "joint", "norm_1", "norm input is not a linear's output")
    rep.skip("norm_linear_fwd", "joint", "norm_1", "left unfused: fusion would not win")
    rep.skip("dgrad_norm_bwd", "joint", "norm_backward_1", "left unfused: fusion would not win")
    s = fn_report.summarize([rep])
    assert (s["norm_sites"], s["fused_sites"], s["unfused_sites"]) == (4, 1, 1)
    assert s["unaccounted_sites"] == 2  # two canonical norms without a rewrite or a reason
    assert s["unfused_reasons"] == {
        "linear_norm_fwd: norm input is not a linear's output | norm_linear_fwd: left unfused: fusion would not win": 1}
    assert s["backward"] == {"fused": 1, "unfused": {"left unfused: fusion would not win": 1}}
    assert "UNACCOUNTED 2" in fn_report.format_summary(s)


@pytest.mark.parametrize("device, caveat", [("cpu", True), ("cuda", False)])
def test_plot_title_says_when_a_speedup_is_cpu_wall_clock(device, caveat):
    from unittest import mock

    run = {"losses": [1.0, 0.5], "step_ms": [9.0, 1.0, 1.0], "median_ms": 1.0}
    result = {"runs": {"fusenorm": run, "inductor": run}, "timed": 1, "speedup": 1.25, "device": device}
    ax_loss, ax_t = mock.MagicMock(), mock.MagicMock()
    _common.plot_panels((ax_loss, ax_t), "mlp", result)
    title = ax_t.set_title.call_args[0][0]
    assert "1.250x" in title and ("not a performance number" in title) == caveat, title


def test_bench_models_floor_strips_every_norm():
    """The models benchmark's floor (the model without its norms) replaces every LayerNorm / RMSNorm module,
    nested ones included, and nothing else."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    import bench_models

    nn = torch.nn
    m = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.Sequential(nn.Linear(4, 4), nn.RMSNorm(4)))
    bench_models.strip_norms(m)
    kinds = [type(x).__name__ for x in m.modules()]
    assert kinds.count("Identity") == 2 and kinds.count("Linear") == 2
    assert not any(k.endswith(("LayerNorm", "RMSNorm")) for k in kinds)


@pytest.mark.skipif(not train_hf.have_transformers(), reason="transformers is not installed (optional extra)")
@pytest.mark.parametrize("model", ["gpt2", "t5"])
def test_train_hf_gpt2_and_t5_encoder(model):
    """GPT-2 (pre-LayerNorm; its Conv1D projections reach the norms through views, so they stay unfused) and the
    T5 encoder (T5LayerNorm, an RMSNorm: pre-norm sites) train to Inductor's losses, every site accounted for."""
    result = train_hf.main(["--model", model, "--hidden", "32", "--heads", "2", "--intermediate", "64", "--layers",
                            "1", "--vocab", "64", "--batch", "2", "--seq", "8", "--steps", "2", "--report", "none"])
    r = result[model]
    assert r["agreement"]["agree"], r["agreement"]
    rep = r["runs"]["fusenorm"]["report"]
    assert rep["norm_sites"] == 3 and rep["unaccounted_sites"] == 0 and rep["errors"] == []
    if model == "t5" and not torch.cuda.is_available():
        assert rep["fused_sites"] == 3  # unmeasured on the CPU: every pre-norm site is taken
    elif model == "t5":
        # On a GPU each site is timed: a site left unfused has the reasons of the patterns that could take it.
        assert all("norm_linear_fwd" in why or "deferred_norm" in why for why in rep["unfused_reasons"]), rep
