"""fusenorm_inductor.config: the FUSENORM_* environment variables (boolean spellings, bad values, misspelled
names), ``config.enabled`` / ``config.patch(enabled=...)`` installing the passes, and what ``disable()``
leaves running (issue 16)."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch._inductor.config as inductor_config

import fusenorm_inductor
from fusenorm_inductor import config

from .models import PostNormBlock, assert_matches_eager, fusenorm_counts

FUSED_BOTH = {"linear_norm_fwd": 1, "dgrad_norm_bwd": 1}

# Every boolean option, with its variable and its default.
BOOL_OPTIONS = {
    "enabled": ("FUSENORM_ENABLE", False),
    "canonicalize_norms": ("FUSENORM_CANONICALIZE_NORMS", True),
    "patterns.linear_norm_fwd": ("FUSENORM_LINEAR_NORM_FWD", True),
    "patterns.norm_linear_fwd": ("FUSENORM_NORM_LINEAR_FWD", True),
    "patterns.deferred_norm": ("FUSENORM_DEFERRED_NORM", True),
    "fold_cache": ("FUSENORM_FOLD_CACHE", False),
    "patterns.dgrad_norm_bwd": ("FUSENORM_DGRAD_NORM_BWD", True),
    "patterns.attention_block": ("FUSENORM_ATTENTION_BLOCK", True),
    "patterns.attention_block_training": ("FUSENORM_ATTENTION_BLOCK_TRAINING", False),
    "patterns.attention_block_dense": ("FUSENORM_ATTENTION_BLOCK_DENSE", False),
    "gluon": ("FUSENORM_GLUON", True),
    "quack": ("FUSENORM_QUACK", True),
    "spin_exchange": ("FUSENORM_SPIN_EXCHANGE", True),
    "tuning.measure": ("FUSENORM_TUNE", None),  # None: the mode decides (default: the table; max-autotune: measure)
    "tuning.measure_inductor": ("FUSENORM_TUNE_INDUCTOR", True),
    "tuning.agree_across_ranks": ("FUSENORM_AGREE_ACROSS_RANKS", True),
    "fallback_on_error": ("FUSENORM_FALLBACK_ON_ERROR", True),
    "cpu_reference": ("FUSENORM_CPU_REFERENCE", False),
}
STR_OPTIONS = ["debug_dir", "tuning.cache_dir"]
TRUE_SPELLINGS = ["1", "true", "True", "TRUE", "yes", "Yes", " on ", "ON", "\ttrue\n"]
FALSE_SPELLINGS = ["0", "false", "False", "FALSE", "no", "No", " off ", "OFF", " 0 "]


def _clean_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("FUSENORM_")}
    env.update(TORCHINDUCTOR_FORCE_DISABLE_CACHES="1", **extra)
    return env


def _import_config(env: dict) -> subprocess.CompletedProcess:
    """Import fusenorm in a fresh process under ``env``; it prints (JSON) every boolean option, the string
    options, and whether the passes were installed in Inductor's config."""
    code = textwrap.dedent(
        f"""
        import json, operator
        import torch._inductor.config as ic
        import fusenorm_inductor
        c = fusenorm_inductor.config
        values = {{name: operator.attrgetter(name)(c) for name in {sorted(BOOL_OPTIONS) + STR_OPTIONS!r}}}
        values["installed"] = ic.pre_grad_custom_pass is not None
        print(json.dumps(values))
        """
    )
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd="/")


def _values(out: subprocess.CompletedProcess) -> dict:
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_every_bool_option_is_read_by_our_parser():
    """The list above is every boolean option (a new one must be added here and read with _env_bool)."""
    bools = {k for k, v in config.get_config_copy().items() if isinstance(v, bool)}
    assert bools == set(BOOL_OPTIONS)


@pytest.mark.parametrize("raw", TRUE_SPELLINGS)
def test_parse_bool_true(raw):
    assert config._parse_bool("FUSENORM_X", raw, False) is True


@pytest.mark.parametrize("raw", FALSE_SPELLINGS)
def test_parse_bool_false(raw):
    assert config._parse_bool("FUSENORM_X", raw, True) is False


@pytest.mark.parametrize("raw", [None, "", "  "])
def test_parse_bool_unset_or_empty_is_default(raw):
    assert config._parse_bool("FUSENORM_X", raw, True) is True
    assert config._parse_bool("FUSENORM_X", raw, False) is False


@pytest.mark.parametrize("raw", ["2", "maybe", "y", "n", "t", "f", "enable", "-1", "1.0", "tru e"])
def test_parse_bool_rejects_other_values(raw):
    with pytest.raises(ValueError, match=r"FUSENORM_X=.*not a boolean.*1/0, true/false, yes/no or on/off"):
        config._parse_bool("FUSENORM_X", raw, False)


@pytest.mark.parametrize("value,spellings", [(False, FALSE_SPELLINGS), (True, TRUE_SPELLINGS)])
def test_env_sets_every_bool_option(value, spellings):
    """Every boolean variable, set to a spelling of ``value`` (each its own), sets its option to ``value``;
    FUSENORM_ENABLE installs the passes only when true (``false`` used to enable them). The string variables
    are taken as they are ("1"/"0" used to become booleans), an empty one as unset. None of these warns."""
    env = _clean_env(**{var: spellings[i % len(spellings)] for i, (var, _) in enumerate(BOOL_OPTIONS.values())})
    strings = {"debug_dir": "1", "tuning.cache_dir": "0"} if value else {"debug_dir": "", "tuning.cache_dir": "/c"}
    env.update(FUSENORM_DEBUG_DIR=strings["debug_dir"], FUSENORM_CACHE_DIR=strings["tuning.cache_dir"])
    out = _import_config(env)
    assert _values(out) == {**{name: value for name in BOOL_OPTIONS}, "installed": value,
                            **{k: v or None for k, v in strings.items()}}
    assert "UserWarning: fusenorm" not in out.stderr, out.stderr[-3000:]


def test_env_unset_gives_defaults():
    got = _values(_import_config(_clean_env()))
    assert got == {**{name: default for name, (_, default) in BOOL_OPTIONS.items()}, "installed": False,
                   "debug_dir": None, "tuning.cache_dir": None}


@pytest.mark.parametrize("var", ["FUSENORM_ENABLE", "FUSENORM_SPIN_EXCHANGE"])
def test_env_bad_bool_value_fails_import_naming_the_variable(var):
    out = _import_config(_clean_env(**{var: "maybe"}))
    assert out.returncode != 0
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("ValueError") and f"{var}='maybe'" in last, out.stderr[-3000:]
    assert "1/0, true/false, yes/no or on/off" in last


def test_misspelled_env_var_warns_once_with_closest_name():
    env = _clean_env(FUSENORM_ENABLED="1", FUSENORM_SPIN_EXCHNGE="0", fusenorm_tune="0", FUSENORM_XYZZY="1")
    out = _import_config(env)
    # Ignored: every option keeps its default.
    assert _values(out) == {**{name: default for name, (_, default) in BOOL_OPTIONS.items()}, "installed": False,
                            "debug_dir": None, "tuning.cache_dir": None}
    warnings = [ln for ln in out.stderr.splitlines() if "UserWarning" in ln]
    assert len(warnings) == 4, out.stderr[-3000:]  # once each
    expected = {"FUSENORM_ENABLED": "did you mean FUSENORM_ENABLE?",
                "FUSENORM_SPIN_EXCHNGE": "did you mean FUSENORM_SPIN_EXCHANGE?",
                "fusenorm_tune": "did you mean FUSENORM_TUNE?",
                "FUSENORM_XYZZY": "the known ones are FUSENORM_AGREE_ACROSS_RANKS, FUSENORM_ATTENTION_BLOCK,"}
    for name, hint in expected.items():
        (line,) = [ln for ln in warnings if f"environment variable {name} " in ln]
        assert "is not a fusenorm option and is ignored" in line and hint in line, line


def _slots_hold_ours() -> bool:
    from fusenorm_inductor import passes

    return (passes._contains(inductor_config.pre_grad_custom_pass, passes.PRE_GRAD)
            and passes._contains(inductor_config.joint_custom_pre_pass, passes.JOINT))


def _compile_plain_inductor() -> None:
    """A Linear -> LayerNorm -> Linear block under plain ``torch.compile`` (backend="inductor"), from scratch."""
    torch._dynamo.reset()
    assert_matches_eager(lambda: PostNormBlock(24, 40), (torch.randn(9, 24),), torch.float32, "cpu",
                         backend="inductor")


def test_config_patch_enabled_runs_passes_under_plain_inductor():
    assert not config.enabled and not _slots_hold_ours()
    _compile_plain_inductor()
    assert fusenorm_counts() == {} and fusenorm_inductor.last_report() is None
    with config.patch(enabled=True):
        assert config.enabled and _slots_hold_ours()
        _compile_plain_inductor()
        assert fusenorm_counts() == FUSED_BOTH
        assert fusenorm_inductor.last_report() is not None
    assert not config.enabled
    assert inductor_config.pre_grad_custom_pass is None and inductor_config.joint_custom_pre_pass is None
    _compile_plain_inductor()
    assert fusenorm_counts() == FUSED_BOTH  # unchanged: nothing fused once the patch exited


def test_config_patch_enabled_false_inside_enable_restores_it():
    fusenorm_inductor.enable()
    try:
        with config.patch(enabled=False):
            assert not _slots_hold_ours()
            _compile_plain_inductor()
            assert fusenorm_counts() == {}
        assert config.enabled and _slots_hold_ours()
        _compile_plain_inductor()
        assert fusenorm_counts() == FUSED_BOTH
    finally:
        fusenorm_inductor.disable()
    assert not _slots_hold_ours()


def test_config_enabled_attribute_installs_and_uninstalls():
    try:
        config.enabled = True
        assert _slots_hold_ours()
        _compile_plain_inductor()
        assert fusenorm_counts() == FUSED_BOTH
    finally:
        config.enabled = False
    assert inductor_config.pre_grad_custom_pass is None and inductor_config.joint_custom_pre_pass is None
    _compile_plain_inductor()
    assert fusenorm_counts() == FUSED_BOTH  # nothing more fused


def test_config_enabled_keeps_users_pass():
    def user_pass(graph):
        pass

    with inductor_config.patch(joint_custom_pre_pass=user_pass):
        with config.patch(enabled=True):
            assert _slots_hold_ours()
        assert inductor_config.joint_custom_pre_pass is user_pass


def _ran_fused_op(fn, *args) -> bool:
    """Whether calling ``fn`` runs fusenorm's fused GEMM + norm op (by the profiler's operator events)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn(*args)
    return any(e.name.startswith("fusenorm::mm_norm") for e in prof.events())


def test_disable_without_reset_keeps_compiled_fused_code():
    """What disable()'s docstring and the README say: code compiled while enabled keeps running fused until
    ``torch._dynamo.reset()``; after the reset it recompiles without fusenorm."""
    assert "torch._dynamo.reset()" in fusenorm_inductor.disable.__doc__
    torch.manual_seed(0)
    m = PostNormBlock(24, 40).eval()
    x = torch.randn(9, 24)
    with torch.no_grad():
        compiled = torch.compile(m, backend="inductor", dynamic=False)
        fusenorm_inductor.enable()
        try:
            compiled(x)
            assert _ran_fused_op(compiled, x)
        finally:
            fusenorm_inductor.disable()
        assert _ran_fused_op(compiled, x)  # still fused: disable() alone does not recompile
        torch._dynamo.reset()
        assert not _ran_fused_op(compiled, x)  # recompiled as plain Inductor
        torch.testing.assert_close(compiled(x), m(x), atol=1e-5, rtol=1e-5)


# ---- values checked when set ------------------------------------------------------------------------------

BAD_VALUES = [
    ("enabled", "no"),  # a non-empty string is true to Python: it used to turn fusenorm on
    ("enabled", 1),
    ("patterns.linear_norm_fwd", "off"),
    ("tuning.measure", "yes"),
    ("tuning.margin", -5),
    ("tuning.margin", 1.0),
    ("tuning.margin", float("nan")),
    ("tuning.margin_gluon", "0.1"),
    ("tuning.host_weight", -1.0),
    ("tuning.host_weight", True),
    ("tuning.rep_ms", 0),
    ("tuning.compile_threads", 0),
    ("tuning.compile_threads", True),
    ("debug_dir", 123),
    ("tuning.cache_dir", 1.5),
]


def _set(name: str, value: object) -> None:
    """``config.<name> = value`` as a user writes it (``config.tuning.margin = ...`` for a nested one)."""
    *section, attr = name.split(".")
    setattr(getattr(config, section[0]) if section else config, attr, value)


@pytest.mark.parametrize("how", ["attribute", "patch"])
@pytest.mark.parametrize("name,value", BAD_VALUES)
def test_bad_values_are_refused_naming_the_option(name, value, how):
    before = config.__getattr__(name)
    with pytest.raises(ValueError, match=rf"config\.{name} = .* it must be"):
        if how == "attribute":
            _set(name, value)
        else:
            with config.patch({name: value}):
                pass
    assert config.__getattr__(name) == before
    assert config.enabled is False


@pytest.mark.parametrize("name,value", [("tuning.margin", 0.0), ("tuning.margin", 0.5), ("tuning.host_weight", 0),
                                        ("tuning.rep_ms", 2.5), ("debug_dir", None), ("gluon", False)])
def test_good_values_are_kept(name, value):
    with config.patch({name: value}):
        assert config.__getattr__(name) == value


def test_a_path_is_stored_as_str(tmp_path):
    with config.patch(debug_dir=tmp_path):
        assert config.debug_dir == str(tmp_path) and isinstance(config.debug_dir, str)
