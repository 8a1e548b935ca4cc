# What conftest.py sets in the environment to keep Inductor from serving a graph out of its caches (a graph served
# from them skips fusenorm's passes); a test that checks cache hits in a subprocess leaves these out of its
# environment.
CACHES_OFF = {"TORCHINDUCTOR_FX_GRAPH_CACHE": "0", "TORCHINDUCTOR_AUTOGRAD_CACHE": "0",
              "TORCH_DYNAMO_AUTOMATIC_DYNAMIC_LOCAL_PGO": "0"}
