"""Alias of ``fusenorm_inductor``. It also makes ``TORCH_LOGS="+fusenorm"`` valid: torch accepts a log
name only if a module of that name can be imported, and fusenorm logs on the "fusenorm" logger."""

from fusenorm_inductor import *  # noqa: F401,F403
from fusenorm_inductor import __all__, __version__  # noqa: F401
