import sys, time, math, numpy as np, mlx.core as mx
from rq_core import eval as ev
from rq_core import kv_cache as kvc
from rq_core.kv_cache import KVSettings
ALPHA = {"k": 1.0, "v": 1.0}
orig_q = kvc.quantize_kv
def qkv(x, rotation, levels, bits, **kw):
    codes, norms = orig_q(x, rotation, levels, bits, **kw)
    a = ALPHA["k"] if levels.ndim == 2 and levels.shape[0] == 128 else ALPHA["v"]
    return codes, (norms.astype(mx.float32) * a).astype(mx.float16)
kvc.quantize_kv = qkv
em = ev.load_eval_model()
ids = ev.encode_ids(em.tokenizer, ev.load_heldout_text())
ctx = int(sys.argv[1]); nw = int(sys.argv[2]); variants = sys.argv[3].split(",")
wins = ev.windows(ids, ctx, nw)
pf = ctx // 2
ref = [ev.window_logprobs(em.model, w, KVSettings(mode="fp16"), prefill=pf) for w in wins]
def nll_per_window(lps):
    return np.array([float(-mx.take_along_axis(lp, mx.array(w[pf+1:].astype(np.int32))[:, None], axis=-1).mean().item()) for w, lp in zip(wins, lps)])
r = nll_per_window(ref)
base = None
kv = KVSettings(mode="isoquant3", fp16_window=32)
for var in variants:  # e.g. "1:1", "1:1.0605", "1.0176:1.0605"
    ak, av = map(float, var.split(":")); ALPHA["k"], ALPHA["v"] = ak, av
    t = time.time()
    lps = [ev.window_logprobs(em.model, w, kv, prefill=pf) for w in wins]
    n = nll_per_window(lps)
    klw = np.array([float((mx.exp(a) * (a - b)).sum(-1).mean().item()) for a, b in zip(ref, lps)])
    d = n - r
    line = f"{var:14} dPPL {math.expm1(d.mean()):+.3%} ± {1.96*d.std(ddof=1)/math.sqrt(len(d)):.3%}  KL {klw.mean():.4f}"
    if base is None: base, basekl = n, klw
    else:
        dd = n - base; dk = klw - basekl
        line += f"  vs base dNLL {dd.mean():+.4f} ± {1.96*dd.std(ddof=1)/math.sqrt(len(dd)):.4f} dKL {dk.mean():+.4f} ± {1.96*dk.std(ddof=1)/math.sqrt(len(dk)):.4f}"
    print(line, f"{time.time()-t:.0f}s", flush=True)
