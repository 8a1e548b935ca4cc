"""Debug aid: run each Gluon mm_norm configuration on small cases in its own subprocess (a hang shows as a
timeout), report the max error of y per 128-row block against the fp32 reference."""
import json
import subprocess
import sys

CASES = []
for kind, bm, bn, bk, st, w, n in [("gl_coop", 128, 64, 32, 4, 4, 64), ("gl_pp", 128, 64, 32, 4, 4, 64),
                                   ("gl_coop", 128, 256, 64, 2, 8, 256), ("gl_pp", 64, 256, 64, 2, 4, 256),
                                   ("gl_coop", 64, 256, 64, 3, 4, 256), ("gl_cluster", 128, 128, 64, 3, 4, 512),
                                   ("gl_cluster", 64, 256, 64, 3, 4, 1024)]:
    for res in (False, True):
        CASES.append(dict(cfg=[kind, bm, bn, bk, st, w], n=n, res=res, m=257, k=200))
    CASES.append(dict(cfg=[kind, bm, bn, bk, st, w], n=n, res=False, m=20000, k=40))


def one(c):
    import torch
    from fusenorm_inductor.kernels.triton.common import GemmConfig
    from fusenorm_inductor.kernels.triton import mm_norm as fk
    from fusenorm_inductor.ops.mm_norm import mm_norm_reference
    torch.manual_seed(0)
    m, n, k = c["m"], c["n"], c["k"]
    a = (torch.randn(m, k, device="cuda") / k**0.5).bfloat16()
    W = torch.randn(n, k, device="cuda").bfloat16()
    r = torch.randn(m, n, device="cuda").bfloat16() if c["res"] else None
    w = torch.randn(n, device="cuda")
    nb = torch.randn(n, device="cuda")
    args = (a, W.t(), None, r, w, nb, 1e-5, False, None, True)
    cfg = GemmConfig(*c["cfg"])
    base = fk.mm_norm_triton(a, W.t(), None, r, None, None, 1e-5, False, None, False, config=cfg, gemm_only=True)[0]
    out = fk.mm_norm_triton(*args, config=cfg)
    torch.cuda.synchronize()
    ref = mm_norm_reference(*args)
    hb = (a.float() @ W.float().t() + (r.float() if r is not None else 0))
    eb = (base.float() - hb).abs().amax(1)
    e = (out[0].float() - ref[0].float()).abs().amax(1)
    blocks = [round(float(e[i:i + 128].max()), 3) for i in range(0, m, 128)][:6]
    return dict(c, base_err=float(eb.max()), y_err=float(e.max()), rstd_err=float((out[3] - ref[3]).abs().max()),
                blocks=blocks, nan=int(torch.isnan(out[0]).sum()))


if __name__ == "__main__":
    if sys.argv[1:] == ["inproc"]:
        for c in CASES:
            try:
                print(json.dumps(one(c)), flush=True)
            except Exception as e:  # noqa: BLE001
                print(json.dumps(dict(c, error=f"{type(e).__name__}: {str(e)[:400]}")), flush=True)
        sys.exit(0)
    if len(sys.argv) > 1:
        print(json.dumps(one(json.loads(sys.argv[1]))))
        sys.exit(0)
    for c in CASES:
        try:
            p = subprocess.run([sys.executable, __file__, json.dumps(c)], capture_output=True, text=True, timeout=45)
            line = p.stdout.strip().splitlines()[-1] if p.returncode == 0 else json.dumps(dict(c, error=p.stderr[-600:]))
        except subprocess.TimeoutExpired:
            line = json.dumps(dict(c, error="TIMEOUT (hang)"))
        print(line, flush=True)
