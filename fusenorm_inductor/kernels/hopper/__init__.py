"""The sm_90 Gluon kernels: ``gemm_core`` (the one GEMM mainloop), ``epilogues`` (what runs on its accumulator
tile), one module per fused op's kernel and launcher, and ``common`` (descriptors, fitting, spill refusal,
operand checks, named FLAGS bits). Importing this package imports no Gluon; ``_compat`` decides whether the
installed triton's Gluon API serves."""
