"""The FlashNormAttention block (LayerNorm_{H*D} -> GDPA -> + ln_q -> RMSNorm_{H*D} -> + q): written with
``fusenorm::gdpa`` (jagged q) or as the dense einsum/matmul composite, it becomes one
``fusenorm::flash_norm_attention`` (exact counts; the GDPA op and both norms vanish from the compiled graphs,
forward and backward), compiled results match eager (output and every gradient: q, k, v, norm weights),
near-misses are left alone and the report names why, and the config switch turns it off."""

import pytest
import torch
import torch._inductor.config as inductor_config

import fusenorm_inductor
from fusenorm_inductor import config

from .models import (
    GDPA_ACTIVATIONS, FlashNormAttentionBlock, assert_matches_eager, attention_inputs, fusenorm_counts, saved_bytes,
)

fusenorm = torch.ops.fusenorm
FUSED_OPS = {"fna": 1, "fna_bwd": 1, "gdpa": 0, "gdpa_bwd": 0}
UNFUSED_GDPA = {"fna": 0, "fna_bwd": 0, "gdpa": 1, "gdpa_bwd": 1}


def skips(*patterns):
    return [s.reason for s in fusenorm_inductor.last_report().skips if s.pattern in patterns]


def rewrites(pattern):
    return [r for r in fusenorm_inductor.last_report().rewrites if r.pattern == pattern]


def check(make, inputs, device, dtype=torch.float32) -> dict:
    """Compiled vs eager (outputs and all gradients); returns how often the attention ops appear in the
    graphs Inductor compiles (forward and backward, after every fusenorm pass)."""
    graphs = []
    with inductor_config.patch(post_grad_custom_post_pass=graphs.append):
        assert_matches_eager(make, inputs, dtype, device)
    targets = {"fna": fusenorm.flash_norm_attention.default, "fna_bwd": fusenorm.flash_norm_attention_backward.default,
               "gdpa": fusenorm.gdpa.default, "gdpa_bwd": fusenorm.gdpa_backward.default}
    counts = {k: sum(len(g.find_nodes(op="call_function", target=t)) for g in graphs) for k, t in targets.items()}
    norms = sum(len(g.find_nodes(op="call_function", target=t)) for g in graphs
                for t in (fusenorm.norm.default, fusenorm.norm_backward.default))
    assert norms == 0, "canonical norms must be fused or decomposed"
    return counts


def check_forward(make, inputs, device) -> dict:
    """Inference only (no_grad: one graph to compile): for the dense near-misses, whose unfused attention
    costs Inductor several C++ kernels per graph on CPU. Compiled vs eager output; op counts as ``check``."""
    torch.manual_seed(0)
    m = make().to(device)
    inputs = tuple(i.to(device) for i in inputs)
    graphs = []
    with torch.no_grad(), inductor_config.patch(post_grad_custom_post_pass=graphs.append):
        got = torch.compile(m, backend="fusenorm", dynamic=False)(*inputs)
        ref = m(*inputs)
    torch.testing.assert_close(got, ref, atol=2e-5 * ref.abs().max().item(), rtol=1e-5)
    return {"fna": sum(len(g.find_nodes(op="call_function", target=fusenorm.flash_norm_attention.default))
                       for g in graphs)}


@pytest.fixture(autouse=True)
def _fused_in_training():
    """The tests below check the rewrites in training too, and the dense form's rewrite (off by default:
    test_dense_form_off_by_default); by default the gdpa form is fused for inference only
    (test_block_training_gate checks the default)."""
    with config.patch({"patterns.attention_block_training": True, "patterns.attention_block_dense": True}):
        yield


def test_dense_form_off_by_default(device):
    """Default: the dense composite is recognized but left to Inductor, in inference too, and the report says
    why (its rewrite computes the padded rows and measures slower than Inductor's composite)."""
    dense = lambda: FlashNormAttentionBlock(2, 16, "einsum", "gelu_tanh", 0.5, True)  # noqa: E731
    with config.patch({"patterns.attention_block_dense": False}):
        assert check_forward(dense, attention_inputs("einsum"), device)["fna"] == 0
        assert any("padded row" in r and "config.patterns.attention_block_dense" in r
                   for r in skips("attention_block_dense")), skips("attention_block_dense")


# ---- form (i): written with fusenorm::gdpa ------------------------------------------------------------


def test_block_training_gate(device):
    """Default: either form is left unfused when gradients are needed (reported with the reason, outputs
    and gradients still match eager) and fused under no_grad."""
    gdpa = lambda: FlashNormAttentionBlock(2, 16, "gdpa", "fast_gelu", 0.5, True)  # noqa: E731
    dense = lambda: FlashNormAttentionBlock(2, 16, "einsum", "gelu_tanh", 0.5, True)  # noqa: E731
    with config.patch({"patterns.attention_block_training": False}):
        assert check(gdpa, attention_inputs("gdpa"), device) == UNFUSED_GDPA
        assert any("gradients needed" in r and "inference only" in r for r in skips("attention_block"))
        torch._dynamo.reset()
        assert check_forward(gdpa, attention_inputs("gdpa"), device) == {"fna": 1}
        torch._dynamo.reset()
        assert check(dense, attention_inputs("einsum"), device)["fna"] == 0
        assert any("gradients needed" in r and "0.63-0.75x" in r for r in skips("attention_block_dense"))
        torch._dynamo.reset()
        assert check_forward(dense, attention_inputs("einsum"), device)["fna"] == 1


def test_gdpa_block_left_to_the_gluon_gdpa(monkeypatch):
    """Where the unfused GDPA would run the sm_90 Gluon forward (faked here on the CPU), the block stays
    unfused, with the reason in the report, and the result is eager's."""
    from fusenorm_inductor.kernels.triton import gdpa as gdpa_kernels

    monkeypatch.setattr(gdpa_kernels, "gluon_unsupported", lambda q, k: None)
    gdpa = lambda: FlashNormAttentionBlock(2, 16, "gdpa", "fast_gelu", 0.5, True)  # noqa: E731
    assert check_forward(gdpa, attention_inputs("gdpa"), "cpu") == {"fna": 0}
    assert any("Gluon" in r for r in skips("attention_block"))


@pytest.mark.parametrize("activation", GDPA_ACTIVATIONS)
@pytest.mark.parametrize("affine", [True, False], ids=["affine", "plain"])
def test_gdpa_block_fused(activation, affine, device):
    """Lengths (0, 1, 37), S = 24, H = 2, D = 16: one rewrite, the GDPA and both norms gone, fwd and bwd."""
    make = lambda: FlashNormAttentionBlock(2, 16, "gdpa", activation, 0.5, affine)  # noqa: E731
    assert check(make, attention_inputs("gdpa"), device) == FUSED_OPS
    assert fusenorm_counts() == {"attention_block": 1}
    assert torch._dynamo.utils.counters["fusenorm"]["canonical_layer_norm"] == 1
    (rw,) = rewrites("attention_block")
    assert f"activation={activation}" in rw.detail and "scale=0.5" in rw.detail
    assert ("ln affine=weight+bias" if affine else "ln affine=no") in rw.detail


def test_gdpa_block_saves_less_than_unfused(device):
    """The fused block saves q, k, v, three [T] statistics and o, the RMSNorm's input (inputs and parameters
    are not new memory); Inductor's graph saves ln_q and the RMSNorm's input besides: one [T, H, D] more."""
    make = lambda: FlashNormAttentionBlock(2, 16, "gdpa", "fast_gelu", 0.5, True)  # noqa: E731
    inputs = attention_inputs("gdpa")
    unfused, fused = saved_bytes(make, inputs, "inductor", device), saved_bytes(make, inputs, "fusenorm", device)
    t, h, d = inputs[0].shape
    assert fused <= unfused - t * h * d * 4, (fused, unfused)
    assert fused <= 3 * t * 4 + t * h * d * 4, fused  # the statistics and o only


@pytest.mark.parametrize("ln_form,rms_form", [("nn.LayerNorm", "nn.RMSNorm"), ("F.layer_norm", "F.rms_norm"),
                                              ("F.layer_norm", "llama")])
@pytest.mark.parametrize("h,d", [(1, 24), (3, 8)], ids=["1head", "3heads"])
def test_gdpa_block_norm_forms_and_heads(ln_form, rms_form, h, d, device):
    make = lambda: FlashNormAttentionBlock(h, d, "gdpa", "silu", 0.25, True, ln_form, rms_form,  # noqa: E731
                                           lengths=(5, 0, 12))
    assert check(make, attention_inputs("gdpa", h, d, (5, 0, 12), s=7), device) == FUSED_OPS
    assert fusenorm_counts() == {"attention_block": 1}


# ---- form (ii): the dense padded composite ------------------------------------------------------------


@pytest.mark.parametrize("activation", GDPA_ACTIVATIONS + ("gelu_tanh",))
def test_dense_einsum_block_fused(activation, device):
    """q [3, 37, 2, 16] (the padded lengths (0, 1, 37)): every padded row computed, as in the original."""
    make = lambda: FlashNormAttentionBlock(2, 16, "einsum", activation, 0.125)  # noqa: E731
    assert check(make, attention_inputs("einsum"), device) == FUSED_OPS
    assert fusenorm_counts() == {"attention_block_dense": 1}
    (rw,) = rewrites("attention_block_dense")
    expect = "fast_gelu" if activation == "gelu_tanh" else activation
    assert f"activation={expect}," in rw.detail and "scale=0.125" in rw.detail, rw.detail


@pytest.mark.parametrize("h,d,affine", [(2, 16, True), (1, 24, False)], ids=["2heads-affine", "1head-plain"])
def test_dense_matmul_block_fused(h, d, affine, device):
    """``ln.transpose(1, 2) @ k.permute(0, 2, 3, 1)``, ``(p @ v.transpose(1, 2)).permute(0, 2, 1, 3)``."""
    make = lambda: FlashNormAttentionBlock(h, d, "matmul", "gelu", 0.5, affine, lengths=(3, 7))  # noqa: E731
    assert check(make, attention_inputs("matmul", h, d, (3, 7), s=5), device) == FUSED_OPS
    assert fusenorm_counts() == {"attention_block_dense": 1}


def test_dense_bool_mask_kept_exactly(device):
    """``o * mask[..., None, None]`` with a boolean mask: fused, masked rows are q (where(mask, out, q))."""
    make = lambda: FlashNormAttentionBlock(2, 16, "einsum", "relu", 0.5, mask="bool")  # noqa: E731
    assert check(make, attention_inputs("einsum"), device) == FUSED_OPS
    assert fusenorm_counts() == {"attention_block_dense": 1}
    assert "bool padding mask" in rewrites("attention_block_dense")[0].detail


# ---- near-misses: left alone, still correct, and reported ---------------------------------------------


@pytest.mark.parametrize(
    "kwargs,residual,reason",
    [
        (dict(per_head=True), False, "per head"),
        (dict(residual1="other"), True, "first residual is not ln_q"),
        (dict(residual2="other"), True, "second residual is not q"),
        (dict(partial="ln_gdpa"), False, "partial block (LayerNorm -> GDPA only"),
        (dict(partial="gdpa_rms"), False, "partial block (GDPA -> + residual -> RMSNorm only"),
        (dict(rms_form="nn.LayerNorm"), False, "norm after the attention is a LayerNorm"),
    ],
    ids=["norm-over-D", "residual1-elsewhere", "residual2-elsewhere", "partial-ln-gdpa", "partial-gdpa-rms",
         "layernorm-after"],
)
def test_gdpa_near_miss_not_fused(kwargs, residual, reason, device):
    make = lambda: FlashNormAttentionBlock(2, 16, "gdpa", **kwargs)  # noqa: E731
    assert check(make, attention_inputs("gdpa", residual=residual), device) == UNFUSED_GDPA
    assert "attention_block" not in fusenorm_counts()
    assert any(reason in r for r in skips("attention_block")), skips("attention_block")


@pytest.mark.parametrize(
    "kwargs,reason",
    [
        (dict(activation="softmax"), "softmax instead of an elementwise activation"),
        (dict(mask="float"), "only a boolean mask keeps the block's semantics"),
        (dict(per_head=True), "per head"),
    ],
    ids=["softmax", "float-mask", "norm-over-D"],
)
def test_dense_near_miss_not_fused(kwargs, reason, device):
    make = lambda: FlashNormAttentionBlock(2, 16, "einsum", **kwargs)  # noqa: E731
    assert check_forward(make, attention_inputs("einsum"), device) == {"fna": 0}
    assert "attention_block_dense" not in fusenorm_counts()
    assert any(reason in r for r in skips("attention_block_dense")), skips("attention_block_dense")


def test_dynamic_shapes_left_to_inductor(device):
    torch.manual_seed(0)
    m = FlashNormAttentionBlock(2, 16, "einsum", "silu").to(device)
    q, k, v = (t.to(device) for t in attention_inputs("einsum"))
    with torch.no_grad():
        got = torch.compile(m, backend="fusenorm", dynamic=True)(q, k, v)
        torch.testing.assert_close(got, m(q, k, v), atol=1e-4, rtol=1e-4)
    assert not {"attention_block", "attention_block_dense"} & set(fusenorm_counts())
    assert any("dynamic shapes" in r for rep in fusenorm_inductor.reports() for s in rep.skips
               if s.pattern == "attention_block_dense" for r in [s.reason])


@pytest.mark.parametrize("form", ["gdpa", "einsum"])
def test_switch_off_leaves_block_unfused(form, device):
    make = lambda: FlashNormAttentionBlock(2, 16, form, "fast_gelu")  # noqa: E731
    with config.patch({"patterns.attention_block": False}):
        if form == "gdpa":
            assert check(make, attention_inputs(form), device) == UNFUSED_GDPA
        else:
            assert check_forward(make, attention_inputs(form), device) == {"fna": 0}
    assert not {"attention_block", "attention_block_dense"} & set(fusenorm_counts())
    assert any("disabled by config (patterns.attention_block)" in r
               for r in skips("attention_block", "attention_block_dense"))


def test_dense_rewrite_skips_the_offset_check(device):
    """The dense form's offsets are built by the rewrite (valid by construction): the fused op is called with
    check_offsets=False (no host read, no device sync per call); the gdpa form's offsets come from the user
    and stay checked."""
    def fna_flags(form, inputs):
        graphs = []
        with inductor_config.patch(post_grad_custom_post_pass=graphs.append):
            assert_matches_eager(lambda: FlashNormAttentionBlock(2, 16, form, "relu", 0.5), inputs,
                                 torch.float32, device)
        return [n.args[12] if len(n.args) > 12 else n.kwargs.get("check_offsets", True) for g in graphs
                for n in g.find_nodes(op="call_function", target=fusenorm.flash_norm_attention.default)]

    assert fna_flags("einsum", attention_inputs("einsum")) == [False]
    torch._dynamo.reset()
    assert fna_flags("gdpa", attention_inputs("gdpa")) == [True]

