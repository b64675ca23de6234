"""Host-inclusive decode cost of the KV caches' `attend`, a layer, side by side in one process: fp16 (FP16Cache:
mx.fast.scaled_dot_product_attention) and the compressed caches as `rq run` makes them (32-token fp16 window, the
mode's defaults: one fused attention launch a layer on a GPU, the window's tokens coded a window's worth at a time).
Qwen3-30B-A3B attention shape (32 query heads, 4 kv heads, head dim 128) unless --shape says otherwise (Nemotron-H:
32,2,128; Gemma 4's global layers: 16,2,512, sliding: 16,8,256), NL layers, each decode step built for all
layers and queued with mx.async_eval while the previous step runs (as `rq run` decodes); µs a layer = wall time /
(steps x layers), best of rounds taken in turns.

    python3 tools/cache_step.py [--contexts 2048,32768,131072] [--layers 48] [--steps 32] [--rounds 3] [--shape HQ,HKV,D]

Writes tools/cache_step.json.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))  # _readme: the results file's format

import mlx.core as mx  # noqa: E402

from rq_core.cache.kv_cache import DEFAULT_FP16_WINDOW, FP16Cache, KVSettings, make_kv_cache  # noqa: E402

HQ, HKV, D = 32, 4, 128


def make(kind: str, layer: int):
    if kind == "fp16":
        return FP16Cache()
    return make_kv_cache(KVSettings(mode=kind, fp16_window=DEFAULT_FP16_WINDOW), layer=layer, n_kv_heads=HKV,
                         head_dim=D)


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


def table(rows: list[dict]) -> str:
    ctx = sorted({r["context"] for r in rows})
    by = {(r["cache"], r["context"]): r for r in rows}
    out = ["| cache | " + " | ".join(f"{t // 1024 if t >= 1024 else t}{'K' if t >= 1024 else ''} µs / layer (x fp16)" for t in ctx) + " |",
           "| --- |" + " --- |" * len(ctx)]
    for k in dict.fromkeys(r["cache"] for r in rows):
        out.append(f"| {k} | " + " | ".join(f"{by[k, t]['us_per_layer']:.1f} ({by[k, t]['vs_fp16']:.2f}x)"
                                             for t in ctx) + " |")
    return "\n".join(out)


def main() -> int:
    global HQ, HKV, D
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="2048,32768,131072")
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--kinds", default="fp16,isoquant3", help="fp16 and KV modes (isoquant3, turbo3, ...)")
    ap.add_argument("--shape", default=f"{HQ},{HKV},{D}", help="query heads, kv heads, head dim")
    a = ap.parse_args()
    try:
        HQ, HKV, D = (int(x) for x in a.shape.split(","))
    except ValueError:
        ap.error(f"--shape takes three integers HQ,HKV,D (got {a.shape!r})")
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
            print(f"{T:7d} {k:10s} {best[k]:8.1f} µs / layer  ({rows[-1]['vs_fp16']:.2f}x fp16)", flush=True)
        del caches
    body = table(rows) + f"\n\n{HQ} query heads, {HKV} kv heads, head dim {D}; {a.layers} layers chained."
    print(body)
    from _readme import save

    save("cache_step", {"shape": {"q_heads": HQ, "kv_heads": HKV, "head_dim": D}, "layers": a.layers, "steps": a.steps, "rounds": a.rounds, "rows": rows}, body,
         ROOT / "tools" / "cache_step.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
