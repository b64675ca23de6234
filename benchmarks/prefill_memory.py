"""Prefill of a long prompt with a compressed cache: time and peak memory, kv.prefill_fp16 (default 4096) against keeping
the whole prompt in fp16 ("all") and against the fp16 cache, side by side in one process.

Qwen3-30B-A3B-shaped model with random weights quantized as recipes/qwen3-16gb.toml (profile_gpu.build), NL layers;
a random prompt of T tokens through `generate` (chunks of 512, one token generated). Peak = MLX's peak allocation
during generate minus the memory active before it (the weights); KV = the caches' bytes after it.

    python3 benchmarks/prefill_memory.py [--layers 4] [--contexts 8192,32768] [--inflight 1,2]

Writes benchmarks/results/prefill_memory.json.
"""
from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import mlx.core as mx  # noqa: E402

from rq_core.generate import generate  # noqa: E402
from rq_core.cache.kv_cache import DEFAULT_FP16_WINDOW, KVSettings  # noqa: E402


def table(rows: list[dict], layers: int) -> str:
    out = ["| layers x context | cache | prefill s | peak over weights GiB | KV GiB |", "| --- | --- | --- | --- | --- |"]
    for r in rows:
        out.append(f"| {layers} x {r['context'] // 1024}K | {r['cache']} | {r['prefill_s']:.1f} | "
                   f"{r['peak_over_weights_bytes'] / 2**30:.2f} | {r['kv_bytes'] / 2**30:.2f} |")
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--contexts", default="8192,32768")
    ap.add_argument("--skip-fp16", action="store_true", help="the compressed caches only")
    ap.add_argument("--prefill-fp16", type=int, default=4096, help="kv.prefill_fp16 of the bounded row")
    ap.add_argument("--inflight", default="", help="also the bounded row with its decoded attention queued this many "
                    "layers ahead of the one waited for (IsoQuantCache.prefill_inflight; 0 waits for each layer), "
                    "comma-separated")
    a = ap.parse_args()
    import profile_gpu

    from rq_core.cache.kv_cache import IsoQuantCache

    model, cfg = profile_gpu.build(a.layers)
    rows = []
    for T in (int(x) for x in a.contexts.split(",")):
        prompt = mx.random.randint(0, cfg["vocab_size"], (T,), key=mx.random.key(T)).tolist()
        bound = f"isoquant3, prefill_fp16 {a.prefill_fp16}"
        default_inflight = IsoQuantCache.prefill_inflight
        settings = {"fp16": (KVSettings(mode="fp16"), default_inflight),
                    bound: (KVSettings(mode="isoquant3", fp16_window=DEFAULT_FP16_WINDOW, prefill_fp16=a.prefill_fp16),
                            default_inflight),
                    "isoquant3, whole prompt in fp16 (\"all\")": (KVSettings(
                        mode="isoquant3", fp16_window=DEFAULT_FP16_WINDOW, prefill_fp16=None), default_inflight)}
        for n in (int(x) for x in a.inflight.split(",") if x):
            settings[f"{bound}, {n} layers in flight"] = (KVSettings(
                mode="isoquant3", fp16_window=DEFAULT_FP16_WINDOW, prefill_fp16=a.prefill_fp16), n)
        if a.skip_fp16:
            del settings["fp16"]
        for name, (kv, inflight) in settings.items():
            gc.collect()
            mx.clear_cache()
            base = mx.get_active_memory()
            IsoQuantCache.prefill_inflight = inflight
            t0 = time.perf_counter()
            try:
                res = generate(model, prompt, max_tokens=1, kv=kv)
            finally:
                IsoQuantCache.prefill_inflight = default_inflight
            dt = time.perf_counter() - t0
            rows.append({"context": T, "cache": name, "prefill_s": res.prefill_s, "wall_s": dt,
                         "prefill_tok_per_s": res.prefill_tok_per_s,
                         "peak_over_weights_bytes": res.peak_memory_bytes - base, "kv_bytes": res.kv_bytes})
            r = rows[-1]
            print(f"{T:6d} {name:42s} prefill {r['prefill_s']:7.2f} s  peak +{r['peak_over_weights_bytes'] / 2**20:8.1f} MiB"
                  f"  KV {r['kv_bytes'] / 2**20:7.1f} MiB", flush=True)
            del res
    body = table(rows, a.layers)
    print(body)
    from _readme import save

    save("prefill_memory", {"layers": a.layers, "rows": rows}, body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
