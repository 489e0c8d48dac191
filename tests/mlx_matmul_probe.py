"""A child process that runs MLX matmuls under a given LD_PRELOAD and reports what it found.

The kernels in front of OpenBLAS (row-gemv, exact-gemm) are checked the same way: every
block of 1..`rows` rows against each row alone (invariance) and against float64 (soundness),
for B stored transposed or not, with a bias (addmm), and the attention shapes forward uses.
"""

import json
import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import json, sys
    import mlx.core as mx
    import numpy as np
    from inference_engine.blas import active_blas

    rows, outs = int(sys.argv[1]), int(sys.argv[2])
    rng = np.random.default_rng(0)
    x = rng.standard_normal((rows, 96)).astype(np.float32)
    w = rng.standard_normal((outs, 96)).astype(np.float32)  # (out, in) like a Linear weight
    bias = rng.standard_normal(outs).astype(np.float32)
    ref = x.astype(np.float64) @ w.T.astype(np.float64)
    single = [np.array(mx.array(x[i:i + 1]) @ mx.array(w).T)[0] for i in range(rows)]
    out = {"blas": active_blas(), "invariant_rows": [], "close": [], "close_notrans": [], "close_addmm": []}
    for m in range(1, rows + 1):
        block = np.array(mx.array(x[:m]) @ mx.array(w).T)
        out["invariant_rows"].append(all(np.array_equal(block[i], single[i]) for i in range(m)))
        out["close"].append(bool(np.allclose(block, ref[:m], rtol=1e-4, atol=1e-4)))
        notrans = np.array(mx.array(x[:m]) @ mx.array(np.ascontiguousarray(w.T)))  # B stored (in, out)
        out["close_notrans"].append(bool(np.allclose(notrans, ref[:m], rtol=1e-4, atol=1e-4)))
        addmm = np.array(mx.addmm(mx.array(bias), mx.array(x[:m]), mx.array(w).T))  # beta = 1: C starts as the bias
        out["close_addmm"].append(bool(np.allclose(addmm, ref[:m] + bias, rtol=1e-4, atol=1e-4)))
    # Attention as forward runs it: (l, n_kv, rep, D) @ (n_kv, D, S), then weights @ (n_kv, S, D).
    q = rng.standard_normal((5, 3, 3, 64)).astype(np.float32)
    keys = rng.standard_normal((3, 49, 64)).astype(np.float32)
    scores = np.array(mx.array(q) @ mx.array(keys).transpose(0, 2, 1)[None])
    mixed = np.array(mx.array(scores) @ mx.array(keys)[None])
    s64 = q.astype(np.float64) @ keys.transpose(0, 2, 1).astype(np.float64)[None]
    out["close_attention"] = bool(np.allclose(scores, s64, rtol=1e-4, atol=1e-4)) and bool(
        np.allclose(mixed, s64 @ keys.astype(np.float64)[None], rtol=1e-3, atol=1e-3))
    xt = np.array(mx.array(np.ascontiguousarray(x[:8].T)).T @ mx.array(w).T)  # A transposed: forwarded or copied
    out["close_trans_a"] = bool(np.allclose(xt, ref[:8], rtol=1e-4, atol=1e-4))
    print(json.dumps(out))
""")


def probe(preload: str, rows: int, outs: int) -> dict:
    """Run the probe with LD_PRELOAD=`preload` over blocks of 1..`rows` rows and `outs` outputs."""
    env = dict(os.environ, LD_PRELOAD=preload)
    run = subprocess.run([sys.executable, "-c", SCRIPT, str(rows), str(outs)], env=env, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout.strip().splitlines()[-1])
