"""Where a long prompt's prefill peaks: MLX's peak allocation chunk by chunk (reset after each), then end_prefill, for
the fp16 cache, isoquant3 with the whole prompt in fp16, and isoquant3 with kv.prefill_fp16. Qwen3-30B-A3B shape,
NL layers of random quantized weights (profile_gpu.build). Session 16's diagnosis of kv.prefill_fp16's peak."""
from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import mlx.core as mx  # noqa: E402

from rq_core.generate import cache_arrays  # noqa: E402
from rq_core.kv_cache import DEFAULT_FP16_WINDOW, KVSettings  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--every", type=int, default=8, help="print every Nth chunk")
    a = ap.parse_args()
    import profile_gpu

    model, cfg = profile_gpu.build(a.layers)
    T, C = a.context, 512
    prompt = mx.random.randint(0, cfg["vocab_size"], (1, T), key=mx.random.key(T))
    for name, kv in {"iso prefill_fp16 4096": KVSettings(mode="isoquant3", fp16_window=DEFAULT_FP16_WINDOW,
                                                        prefill_fp16=4096),
                     "iso whole prompt fp16": KVSettings(mode="isoquant3", fp16_window=DEFAULT_FP16_WINDOW),
                     "fp16": KVSettings(mode="fp16")}.items():
        gc.collect()
        mx.clear_cache()
        cache = model.make_cache(kv)
        base = mx.get_active_memory()
        peaks = []
        for i in range(0, T, C):
            mx.reset_peak_memory()
            out = model(prompt[:, i:i + C], cache=cache)
            if i + C < T:
                mx.eval(cache_arrays(cache))
            else:
                mx.eval(out[:, -1, :])
            peaks.append((i // C, (mx.get_peak_memory() - base) / 2**20, (mx.get_active_memory() - base) / 2**20))
        mx.reset_peak_memory()
        for c in cache:
            c.end_prefill()
        mx.eval(cache_arrays(cache))
        endp = (mx.get_peak_memory() - base) / 2**20
        top = max(peaks, key=lambda p: p[1])
        print(f"== {name}: max chunk peak +{top[1]:.1f} MiB at chunk {top[0]}; end_prefill peak +{endp:.1f}", flush=True)
        for j, pk, act in peaks:
            if j % a.every == 0 or j == top[0] or j == len(peaks) - 1:
                print(f"   chunk {j:4d}: peak +{pk:8.1f} MiB  active after +{act:8.1f} MiB", flush=True)
        del cache, out


if __name__ == "__main__":
    main()
