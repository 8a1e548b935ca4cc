import sys, runpy
from fusenorm_inductor.kernels.hopper import launch as L
def jit_launch(kernel, grid, args, cluster=1, **options):
    kernel[(grid,)](*args, **options)
L.launch = jit_launch
import fusenorm_inductor.kernels.hopper.mm_norm as H
H.L.launch = jit_launch
sys.argv = ["_q.py"] + sys.argv[1:]
runpy.run_path("benchmarks/_q.py", run_name="__main__")
