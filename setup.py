"""fusenorm: normalization fused into neighbouring GEMMs under torch.compile.

``patterns/`` is a top-level folder of the repository; it ships as ``fusenorm_inductor.patterns`` through the
symbolic link ``fusenorm_inductor/patterns -> ../patterns`` (a link rather than a ``package_dir`` mapping, so
that a source checkout and every kind of editable install import it the same way; wheels copy the files).
The ``torch_dynamo_backends`` entry point makes ``torch.compile(model, backend="fusenorm")`` work with no
import. The one-file module ``fusenorm`` exists so that ``TORCH_LOGS="+fusenorm"`` names an importable
module (torch checks log names against importable modules when it is imported).
"""

from setuptools import setup

setup(
    name="fusenorm",
    version="0.1.0",
    description="torch.compile plugin fusing LayerNorm/RMSNorm into neighbouring GEMMs (Triton kernels)",
    python_requires=">=3.10",
    packages=[
        "fusenorm_inductor", "fusenorm_inductor.ops", "fusenorm_inductor.patterns", "fusenorm_inductor.kernels",
        "fusenorm_inductor.kernels.triton", "fusenorm_inductor.tuning",
        "fusenorm_inductor.kernels.hopper", "fusenorm_inductor.backends",
    ],
    package_data={"fusenorm_inductor.tuning": ["tables/*.json"]},  # the default mode's decision tables
    py_modules=["fusenorm"],
    install_requires=["torch>=2.11", "sympy"],
    extras_require={
        "test": ["pytest", "numpy<2.4", "hypothesis"],
        "plot": ["matplotlib"],
        "examples": ["transformers"],
        # quack's GEMMs for deferred normalization (fusenorm_inductor/backends/quack.py): the pair run on the GPU
        # machine; quack 0.6.4 pins the CUTLASS DSL exactly, and its CUDA 13 libraries come with the cu13 extra.
        "quack": ["quack-kernels==0.6.4", "nvidia-cutlass-dsl[cu13]==4.6.2"],
    },
    entry_points={"torch_dynamo_backends": ["fusenorm = fusenorm_inductor.backend:fusenorm_backend"]},
)
