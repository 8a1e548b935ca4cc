"""The plugin contract: the backend entry point, enable()/disable() for plain torch.compile, chaining with a
user's own pass, mode=/options=, config validation, the debug dump, the log line, and fallback on error."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch._inductor.config as inductor_config

import fusenorm_inductor
from fusenorm_inductor import config, passes

from .models import PostNormBlock, assert_matches_eager, fusenorm_counts

FUSED_BOTH = {"linear_norm_fwd": 1, "dgrad_norm_bwd": 1}


def test_backend_registered_by_entry_point():
    """``backend="fusenorm"`` resolves through the installed entry point (setup.py), no import needed."""
    code = textwrap.dedent(
        """
        import sys, torch
        from torch._dynamo.backends.registry import lookup_backend
        fn = lookup_backend("fusenorm")
        assert fn.__module__ == "fusenorm_inductor.backend", fn.__module__
        assert "fusenorm" in torch._dynamo.list_backends()
        print("ok")
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/")
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-2000:]


def test_enable_disable_plain_torch_compile():
    x = torch.randn(17, 24)
    fusenorm_inductor.enable()
    try:
        assert_matches_eager(lambda: PostNormBlock(24, 40), (x,), torch.float32, "cpu", backend="inductor")
        assert fusenorm_counts() == FUSED_BOTH
    finally:
        fusenorm_inductor.disable()
    assert inductor_config.pre_grad_custom_pass is None and inductor_config.joint_custom_pre_pass is None
    torch._dynamo.reset()
    assert_matches_eager(lambda: PostNormBlock(24, 40), (x,), torch.float32, "cpu", backend="inductor")
    assert fusenorm_counts() == FUSED_BOTH  # unchanged: nothing more was fused after disable()


def test_user_pass_in_same_slot_keeps_running():
    seen = []

    def user_pass(graph):
        seen.append(len(graph.nodes))

    with inductor_config.patch(joint_custom_pre_pass=user_pass):
        fusenorm_inductor.enable()
        try:
            assert_matches_eager(lambda: PostNormBlock(24, 40), (torch.randn(9, 24),), torch.float32, "cpu",
                                 backend="inductor")
        finally:
            fusenorm_inductor.disable()
        assert inductor_config.joint_custom_pre_pass is user_pass  # disable() gave the slot back
        assert seen, "the user's pass did not run"
        assert fusenorm_counts() == FUSED_BOTH
        # The backend chains after the user's pass too.
        seen.clear()
        torch._dynamo.reset()
        assert_matches_eager(lambda: PostNormBlock(24, 40), (torch.randn(9, 24),), torch.float32, "cpu")
        assert seen


def test_chain_and_unchain_keep_user_passes():
    def a(g):
        pass

    ours = passes.JOINT
    assert passes.chain(None, ours) is ours
    chained = passes.chain(a, ours)
    assert passes.chain(chained, ours) is chained  # idempotent
    assert passes.unchain(chained, ours) is a
    assert passes.chain([a], ours) == [a, ours] and passes.unchain([a, ours], ours) == [a]
    if isinstance(chained, list):  # this torch runs a list per slot: the user's pass stays itself
        assert chained == [a, ours]
    else:  # torch 2.11: one pass per slot
        assert chained.uuid() is None  # a plain function has no uuid: Inductor must not cache


def test_torch_names_the_users_pass_not_ours():
    """What torch says about the passes in a slot (its cache warnings name passes without a uuid) names the
    user's own pass where this torch takes a list per slot, never a wrapper of fusenorm's."""
    import torch._inductor.config as inductor_config
    from torch._inductor import codecache, custom_graph_pass

    if not hasattr(custom_graph_pass, "get_custom_graph_passes"):
        pytest.skip("this torch takes one pass per slot: fusenorm chains the user's pass in a wrapper")

    def users_own_pass(g):
        pass

    with inductor_config.patch(pre_grad_custom_pass=users_own_pass), fusenorm_inductor.config.patch(enabled=True):
        slot = custom_graph_pass.get_custom_graph_passes(inductor_config.pre_grad_custom_pass)
        missing = [codecache._custom_pass_name(p) for p in slot if not codecache._custom_pass_has_uuid(p)]
        assert missing == ["test_torch_names_the_users_pass_not_ours.<locals>.users_own_pass"], missing
    assert inductor_config.pre_grad_custom_pass is None


def test_mode_and_options_pass_through():
    x = torch.randn(9, 24)
    m = PostNormBlock(24, 40)
    out = torch.compile(m, backend="fusenorm", mode="max-autotune-no-cudagraphs")(x)
    torch.testing.assert_close(out, m(x), atol=1e-5, rtol=1e-5)
    torch._dynamo.reset()
    out = torch.compile(m, backend="fusenorm", options={"epilogue_fusion": False})(x)
    torch.testing.assert_close(out, m(x), atol=1e-5, rtol=1e-5)
    assert fusenorm_counts()["linear_norm_fwd"] == 2
    torch._dynamo.reset()
    with pytest.raises(Exception, match="Unexpected optimization option"):
        torch.compile(m, backend="fusenorm", options={"no_such_option": 1})(x)


def test_config_validates_names_and_env(tmp_path):
    with pytest.raises(AttributeError, match="has no option 'no_such_option'"):
        config.no_such_option = 1
    with pytest.raises(AttributeError, match="has no option 'no_such_option'"):
        with config.patch(no_such_option=1):
            pass
    code = "import fusenorm_inductor.config as c; print(c.debug_dir, c.patterns.dgrad_norm_bwd, c.enabled)"
    env = dict(os.environ, FUSENORM_DEBUG_DIR=str(tmp_path), FUSENORM_DGRAD_NORM_BWD="0", FUSENORM_ENABLE="1")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.stdout.split() == [str(tmp_path), "False", "True"], out.stderr[-2000:]


def test_debug_dump_and_report(tmp_path):
    with config.patch(debug_dir=str(tmp_path)):
        assert_matches_eager(lambda: PostNormBlock(24, 40, residual="right"),
                             (torch.randn(2, 9, 24), torch.randn(2, 9, 40)), torch.float32, "cpu")
    (run_dir,) = list(tmp_path.iterdir())  # one run folder per process (run-<time>-<pid>-<random>)
    (graph_dir,) = [p for p in run_dir.iterdir() if p.is_dir()]
    names = {p.name for p in graph_dir.iterdir()}
    for stage in ("pre_grad", "joint", "forward", "backward"):
        assert {f"{stage}.before.py", f"{stage}.after.py"} <= names
    assert "fusenorm.mm_norm.default" in (graph_dir / "forward.after.py").read_text()
    assert "fusenorm.mm_norm_backward.default" in (graph_dir / "backward.after.py").read_text()
    assert "mm_norm" not in (graph_dir / "forward.before.py").read_text()
    report = json.loads((graph_dir / "report.json").read_text())
    fused = [r for r in report["rewrites"] if r["pattern"] == "linear_norm_fwd"]
    assert len(fused) == 1 and fused[0]["shapes"]["N"] == 40 and fused[0]["dtype"] == "float32"
    assert "residual=yes" in fused[0]["detail"] and fused[0]["kernel"]
    # The model's output gradient arrives as a tangent: that norm-backward candidate is reported as seen.
    assert "linear_norm_fwd" in (graph_dir / "report.md").read_text()


def test_torch_logs_summary_line():
    code = textwrap.dedent(
        """
        import torch
        m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16))
        torch.compile(m, backend="fusenorm")(torch.randn(4, 8)).sum().backward()
        """
    )
    env = dict(os.environ, TORCH_LOGS="+fusenorm", TORCHINDUCTOR_FORCE_DISABLE_CACHES="1")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd="/")
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [ln for ln in out.stderr.splitlines() if "fusenorm [" in ln]
    assert any("joint: linear_norm_fwd x1" in ln for ln in lines), out.stderr[-3000:]


def test_pass_error_falls_back_with_warning(monkeypatch):
    from fusenorm_inductor.patterns import post_norm

    rewrite = post_norm.LinearNormFwd.rewrite

    def boom(self, graph, m, rep):
        rewrite(self, graph, m, rep)  # half the graph rewritten and counted, then a failure
        raise RuntimeError("injected failure")

    monkeypatch.setattr(post_norm.LinearNormFwd, "rewrite", boom)
    x = torch.randn(9, 24)
    with config.patch(fallback_on_error=True), pytest.warns(UserWarning, match="injected failure"):
        assert_matches_eager(lambda: PostNormBlock(24, 40), (x,), torch.float32, "cpu")
    assert fusenorm_counts() == {}  # the restored graph holds no rewrite, so none is counted
    rep = fusenorm_inductor.last_report()
    assert rep.errors and not [r for r in rep.rewrites if r.stage == "joint"]
