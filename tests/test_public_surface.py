"""What a user meets first: every public name has a docstring, ``help(config)`` lists every option with its
default, environment variable and description, a misspelled option is answered with the closest name, and
``debug_dir = ""`` is refused."""

from __future__ import annotations

import pydoc

import pytest

import fusenorm_inductor as fi
from fusenorm_inductor import config, ops


@pytest.mark.parametrize("name", fi.__all__ + [f"ops.{n}" for n in ops.__all__])
def test_public_names_have_docstrings(name):
    if name == "__version__":
        return
    obj = getattr(ops, name[4:]) if name.startswith("ops.") else getattr(fi, name)
    doc = getattr(obj, "__doc__", None) or ""
    assert doc.strip() and "CustomOpDef" not in doc, f"{name} has no docstring of its own"


def test_help_lists_every_option():
    text = pydoc.render_doc(config, renderer=pydoc.plaintext)
    for name, entry in config._config.items():
        assert f"{name} = {entry.default!r}" in text, name
    assert "(no description)" not in text
    assert "environment: FUSENORM_CPU_REFERENCE" in text


@pytest.mark.parametrize("how", ["set", "get", "patch", "nested"])
def test_a_misspelled_option_names_the_closest(how):
    with pytest.raises(AttributeError, match="did you mean 'debug_dir'|did you mean 'tuning.measure'"):
        if how == "set":
            config.debug_dri = "/tmp/x"
        elif how == "get":
            config.debug_dri  # noqa: B018
        elif how == "patch":
            with config.patch(debug_dri="/tmp/x"):
                pass
        else:
            config.tuning.meausre = False
    with pytest.raises(AttributeError, match="lists the options"):
        config.zzzzzz = 1


def test_empty_debug_dir_is_refused():
    with pytest.raises(ValueError, match="non-empty directory path"):
        config.debug_dir = ""
    with pytest.raises(ValueError, match="non-empty"):
        with config.patch(debug_dir=""):
            pass
    assert config.debug_dir is None or config.debug_dir != ""
