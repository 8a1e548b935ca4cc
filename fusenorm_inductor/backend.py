"""``torch.compile(model, backend="fusenorm")``: Inductor with fusenorm's passes.

Registered through the ``torch_dynamo_backends`` entry point in setup.py, so no import is needed. Accepts
``mode=`` and ``options=`` exactly as the Inductor backend does (they reach it unchanged, fusenorm's passes
chained after any custom pass the options or ``torch._inductor.config`` already hold).
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from . import passes


def fusenorm_backend(
    gm: torch.fx.GraphModule,
    example_inputs: list,
    mode: Optional[str] = None,
    options: Optional[dict[str, Any]] = None,
):
    """The ``"fusenorm"`` torch.compile backend: Inductor (with ``mode`` and ``options`` as Inductor takes them)
    with fusenorm's passes, whatever ``config.enabled`` says. Use ``torch.compile(model, backend="fusenorm")``."""
    from torch import _TorchCompileInductorWrapper

    inductor = _TorchCompileInductorWrapper(mode, passes.config_patches(options), dynamic=None)
    return inductor(gm, example_inputs)
