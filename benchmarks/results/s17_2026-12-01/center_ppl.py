import sys, time, math, numpy as np, mlx.core as mx
from rq_core import eval as ev
from rq_core.kv_cache import IsoQuantCache, KVSettings
MODE = {"k": False, "v": False}
orig = IsoQuantCache.attend
def attend(self, q, k, v, **kw):
    if not hasattr(self, "_mu"):
        self._mu = (k.astype(mx.float32).mean(axis=(0, 2), keepdims=True).astype(k.dtype),
                    v.astype(mx.float32).mean(axis=(0, 2), keepdims=True).astype(v.dtype))
    mk, mv = self._mu
    if MODE["k"]: k = k - mk
    if MODE["v"]: v = v - mv
    out = orig(self, q, k, v, **kw)
    if MODE["v"]:
        B, Hq, L, d = out.shape
        H = mv.shape[1]
        out = (out.reshape(B, H, Hq // H, L, d) + mv[:, :, None]).reshape(B, Hq, L, d)
    return out
IsoQuantCache.attend = attend
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
for var in variants:
    MODE["k"] = "k" in var; MODE["v"] = "v" in var
    t = time.time()
    lps = [ev.window_logprobs(em.model, w, kv, prefill=pf) for w in wins]
    n = nll_per_window(lps)
    klw = np.array([float((mx.exp(a) * (a - b)).sum(-1).mean().item()) for a, b in zip(ref, lps)]); kl = klw.mean()
    d = n - r
    line = f"{var:6} dPPL {math.expm1(d.mean()):+.3%} ± {1.96*d.std(ddof=1)/math.sqrt(len(d)):.3%}  KL {kl:.4f}"
    if base is None: base = n; basekl = klw
    else:
        dd = n - base; line += f"  vs base dNLL {dd.mean():+.4f} ± {1.96*dd.std(ddof=1)/math.sqrt(len(dd)):.4f}"
        dk = klw - basekl; line += f" dKL {dk.mean():+.4f} ± {1.96*dk.std(ddof=1)/math.sqrt(len(dk)):.4f}"
    print(line, f"{time.time()-t:.0f}s", flush=True)
