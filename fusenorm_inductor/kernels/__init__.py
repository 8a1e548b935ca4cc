"""Hand-scheduled GPU kernels that ``tl`` cannot express well, by architecture.

- ``hopper/``: sm_90 kernels in Gluon (``triton.experimental.gluon``): one persistent, warp-specialized GEMM
  core with pluggable epilogues (docs/design.md, "The kernels today"). Imported only when a CUDA tensor reaches an op
  on sm_90 with a triton whose Gluon API ``hopper._compat`` recognizes.
"""
