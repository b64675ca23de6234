"""Host-inclusive decode cost of the KV caches' `attend`, per layer, side by side in one process (issue 4's caches on
a GPU): fp16 (FP16Cache: mx.fast.scaled_dot_product_attention), isoquant3 as `rq run` makes it (32-token fp16
window, pair codebooks: one attn_v5 launch a layer, and the window's tokens coded a window's worth at a time by one
kv_append), and isoquant3 as before session 15 (`ShiftWindowCache`: the token leaving the window coded every step, the
window copied back to the buffer's front).

Qwen3-30B-A3B attention shape (32 query heads, 4 kv heads, head dim 128), NL layers, each decode step built for all
layers and queued with mx.async_eval while the previous step runs (as `rq run` decodes); µs per layer = wall time /
(steps x layers), best of rounds taken in turns.

    python3 benchmarks/cache_step.py [--contexts 2048,32768] [--layers 48] [--steps 32] [--rounds 3] [--json]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import mlx.core as mx  # noqa: E402

from rq_core.kv_cache import DEFAULT_FP16_WINDOW, FP16Cache, KVSettings, make_kv_cache  # noqa: E402
from rq_core.kv_cache import IsoQuantCache  # noqa: E402

HQ, HKV, D = 32, 4, 128


class ShiftWindowCache(IsoQuantCache):
    """isoquant3 as before session 15: every decode step compresses the token leaving the window (one kv_append and
    four slice updates) and copies the window back to the buffer's front (two slices, two slice updates)."""

    def _spill(self, keep: int) -> None:
        n = self.fp16_len - keep
        if n <= 0 or n > 64:  # the prompt: as the cache does it
            return super()._spill(keep)
        kc, kn, vc, vn = self.compress_kv(*self._fp16(0, n))
        self._coded = self.packed_len
        self._append_packed(kc, kn, vc, vn)
        self.packed_len += n
        rk, rv = self._fp16(n)
        self._fk[:, :, self._f0 : self._f0 + keep] = rk
        self._fv[:, :, self._f0 : self._f0 + keep] = rv
        self.fp16_len = keep


def make(kind: str, layer: int):
    if kind == "fp16":
        return FP16Cache()
    s = KVSettings(mode="isoquant3", fp16_window=DEFAULT_FP16_WINDOW)
    if kind == "isoquant3":
        return make_kv_cache(s, layer=layer, n_kv_heads=HKV, head_dim=D)
    return ShiftWindowCache(head_dim=D, n_kv_heads=HKV, layer=layer, fp16_window=DEFAULT_FP16_WINDOW,
                            pair_points=s.pairs_for(D))


def fill(caches, T: int) -> None:
    for i, c in enumerate(caches):
        key = mx.random.key(i)
        k = mx.random.normal((1, HKV, T, D), key=key).astype(mx.float16)
        v = mx.random.normal((1, HKV, T, D), key=mx.random.split(key)[0]).astype(mx.float16)
        if hasattr(c, "prefill_fp16"):
            c.prefill_fp16 = T
        mx.eval(c.attend(mx.zeros((1, HQ, 1, D), mx.float16), k, v, scale=D ** -0.5))
        if hasattr(c, "end_prefill"):
            c.end_prefill()
        mx.eval([a for a in vars(c).values() if isinstance(a, mx.array)])


def run(caches, steps: int, inputs) -> float:
    out = None
    t0 = time.perf_counter()
    for s in range(steps):
        for i, c in enumerate(caches):
            q, k, v = inputs[i % len(inputs)]
            if out is not None:  # a data dependency between layers, as in a model
                q = q + out.reshape(q.shape) * 0
            out = c.attend(q, k, v, scale=D ** -0.5)
        mx.async_eval(out)
    mx.eval(out)
    mx.synchronize()
    # the contexts grow by a token a step (not trimmed back: a trimmed window would skip its spills for a while)
    return (time.perf_counter() - t0) * 1e6 / (steps * len(caches))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="2048,32768")
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--kinds", default="fp16,isoquant3,shift")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    kinds = a.kinds.split(",")
    inputs = [tuple(mx.random.normal(s, key=mx.random.key(100 + j)).astype(mx.float16)
                    for s in ((1, HQ, 1, D), (1, HKV, 1, D), (1, HKV, 1, D))) for j in range(4)]
    mx.eval(inputs)
    rows = []
    for T in (int(x) for x in a.contexts.split(",")):
        caches = {k: [make(k, i) for i in range(a.layers)] for k in kinds}
        for k in kinds:
            fill(caches[k], T)
            run(caches[k], 4, inputs)  # warm-up (kernels compiled)
        best = {k: float("inf") for k in kinds}
        for _ in range(a.rounds):
            for k in kinds:
                best[k] = min(best[k], run(caches[k], a.steps, inputs))
        for k in kinds:
            rows.append({"context": T, "cache": k, "us_per_layer": best[k], "vs_fp16": best.get("fp16", 0) / best[k]})
            if not a.json:
                print(f"{T:7d} {k:10s} {best[k]:8.1f} µs / layer  ({rows[-1]['vs_fp16']:.2f}x fp16)", flush=True)
        del caches
    if a.json:
        print(json.dumps({"device": str(mx.default_device()), "mlx": mx.__version__, "layers": a.layers,
                          "steps": a.steps, "rounds": a.rounds, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
