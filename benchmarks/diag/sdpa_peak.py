"""Peak memory and time of one prompt chunk's fused attention on the GPU: which calls MLX runs fused (cuDNN) and which
it falls back to ops that hold the whole score matrix. Session 16's diagnosis of kv.prefill_fp16's peak."""
from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import mlx.core as mx  # noqa: E402

from rq_core.kv_cache import KVSettings, make_kv_cache  # noqa: E402


def measure(name, fn, *arrs):
    mx.eval(*arrs)
    mx.synchronize()
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    t0 = time.perf_counter()
    out = fn()
    mx.eval(out)
    mx.synchronize()
    dt = time.perf_counter() - t0
    t0 = time.perf_counter()
    out = fn()
    mx.eval(out)
    mx.synchronize()
    dt2 = time.perf_counter() - t0
    print(f"{name:60s} peak +{(mx.get_peak_memory() - base) / 2**20:9.1f} MiB  {dt * 1e3:8.2f} / {dt2 * 1e3:8.2f} ms",
          flush=True)


def main() -> None:
    L, Hq, Hkv, d = 512, 32, 4, 128
    only_cache = "--cache" in sys.argv
    for T in (8192, 32768):
        for dt in () if only_cache else (mx.bfloat16, mx.float32):
            q = mx.random.normal((1, Hq, L, d)).astype(dt)
            k = mx.random.normal((1, Hkv, T, d)).astype(dt)
            v = mx.random.normal((1, Hkv, T, d)).astype(dt)
            big_k = mx.random.normal((1, Hkv, T + 1024, d)).astype(dt)
            big_v = mx.random.normal((1, Hkv, T + 1024, d)).astype(dt)
            sdpa = mx.fast.scaled_dot_product_attention
            tag = f"T={T} {dt}"
            measure(f"{tag} contiguous causal", lambda: sdpa(q, k, v, scale=0.1, mask="causal"), q, k, v)
            measure(f"{tag} sliced buffer causal", lambda: sdpa(q, big_k[:, :, 100:100 + T], big_v[:, :, 100:100 + T],
                                                             scale=0.1, mask="causal"), q, big_k, big_v)
            measure(f"{tag} concat causal", lambda: sdpa(q, mx.concatenate([k[:, :, :T - 600], k[:, :, T - 600:]], 2),
                                                       mx.concatenate([v[:, :, :T - 600], v[:, :, T - 600:]], 2),
                                                       scale=0.1, mask="causal"), q, k, v)
            measure(f"{tag} no mask", lambda: sdpa(q, k, v, scale=0.1), q, k, v)
        for pp in ((128, 32), None):
            c = make_kv_cache(KVSettings(mode="isoquant3", fp16_window=32, prefill_fp16=4096, pair_points=pp),
                              layer=0, n_kv_heads=Hkv, head_dim=d)
            for i in range(0, T, 4096):
                kk = mx.random.normal((1, Hkv, 4096, d)).astype(mx.bfloat16)
                c.attend(mx.random.normal((1, Hq, 4096, d)).astype(mx.bfloat16), kk, kk, scale=0.1, mask="causal")
                mx.eval(c.k_codes if c.k_codes is not None else c._fk)
            q = mx.random.normal((1, Hq, L, d)).astype(mx.bfloat16)
            c._append_fp16(q[:, :Hkv], q[:, :Hkv])  # the chunk's own keys, as attend appends them
            measure(f"T={T} _attend_decoded pairs={pp} packed={c.packed_len} fp16={c.fp16_len}",
                    lambda: c._attend_decoded(q, scale=0.1, causal=True), q)


if __name__ == "__main__":
    main()
