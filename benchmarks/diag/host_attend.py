"""Host time of a compressed cache's GPU attention wrappers (kernels.fused_attend, attention_v5) with the kernel launch
stubbed (outputs made by mx.zeros), so it runs on any machine: this checkout's rq_core.kernels against another
version of the file (--old PATH, e.g. `git show REV:rq_core/kernels.py > /tmp/kernels_old.py`), in turns; min and
median of 15 rounds of 300 calls. Qwen3-30B-A3B attention shape, pair codebooks, a 32-token fp16 window, 2K tokens.

    python benchmarks/diag/host_attend.py --old /tmp/kernels_old.py
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
os.environ["RQ_KERNEL_CACHE"] = "0"

import mlx.core as mx  # noqa: E402

import rq_core.kernels as KN  # noqa: E402
from rq_core.kv_cache import KVSettings, make_kv_cache  # noqa: E402


class StubKernel:
    """Stands in for a compiled kernel: outputs of the asked shapes, no work."""

    def __call__(self, *, inputs, template, grid, threadgroup, output_shapes, output_dtypes, init_value=None, **_):
        return [mx.zeros(s, d) for s, d in zip(output_shapes, output_dtypes)]


def load_old(path: str):
    spec = importlib.util.spec_from_file_location("kernels_old", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["kernels_old"] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", required=True, help="another version of rq_core/kernels.py")
    a = ap.parse_args()
    KO = load_old(a.old)
    stub = StubKernel()
    def append_codes(keys, values, rotation, levels, bits, **kw):  # kv_append stubbed too: codes of the right shapes
        B, H, L, _ = keys.shape
        return (mx.zeros((B, H, L, 14), mx.uint32), mx.zeros((B, H, L), mx.float16),
                mx.zeros((B, H, L, 10), mx.uint32), mx.zeros((B, H, L), mx.float16))

    for K in (KN, KO):
        K.backend = lambda: "cuda"
        K.available = lambda: True
        K._kernel = lambda name, be: stub
        K._kernel_v5 = lambda be, nth, minb, window=False, minified=True, trace=False: stub
        K.cuda_sm_count = lambda: 132
        K.append_codes = append_codes
    Hq, Hkv, d = 32, 4, 128
    c = make_kv_cache(KVSettings(mode="isoquant3", fp16_window=32, pair_points=(128, 32)), layer=0, n_kv_heads=Hkv,
                      head_dim=d)
    k = mx.random.normal((1, Hkv, 2048, d)).astype(mx.bfloat16)
    c.attend(mx.zeros((1, Hq, 16, d), mx.bfloat16), k, k, scale=0.1, mask="causal")
    c.end_prefill()
    q1 = mx.zeros((1, Hq, 1, d), mx.bfloat16)
    win = c._fp16()
    rot, mats = KN.rotation_args(c.rotation)

    def v5(K):
        return K.attention_v5(q1, mats, c.k_codes, c.k_norms, c.v_codes, c.v_norms, c.levels, bits=c.bits, scale=0.1,
                              valid_len=c.packed_len, offset=c.packed_len, rot=rot, window=win, key_bits=c.key_bits,
                              key_levels=c.k_levels, want_lse=False)

    def fused(K):
        return K.fused_attend(q1, c.rotation, c.k_codes, c.k_norms, c.v_codes, c.v_norms, c.levels, bits=c.bits,
                              scale=0.1, offset=c.packed_len, causal=False, valid_len=c.packed_len, window=win,
                              key_bits=c.key_bits, key_levels=c.k_levels)

    import rq_core

    k1 = mx.zeros((1, Hkv, 1, d), mx.bfloat16)
    steps = {KN: make_kv_cache(KVSettings(mode="isoquant3", fp16_window=32, pair_points=(128, 32)), layer=0,
                               n_kv_heads=Hkv, head_dim=d) for _ in (0,)}
    steps[KO] = make_kv_cache(KVSettings(mode="isoquant3", fp16_window=32, pair_points=(128, 32)), layer=0,
                              n_kv_heads=Hkv, head_dim=d)
    for cache in steps.values():
        cache.attend(mx.zeros((1, Hq, 16, d), mx.bfloat16), k, k, scale=0.1, mask="causal")
        cache.end_prefill()

    def step(K):
        """One decode step's attend (the context grows a token, the window spills as rq run decodes)."""
        rq_core.kernels = K  # the cache imports `kernels` from the package at call time
        try:
            o = steps[K].attend(q1, k1, k1, scale=0.1)
            if steps[K].offset % 64 == 0:
                mx.eval(o, steps[K]._fk, steps[K]._fv, steps[K].k_codes)
        finally:
            rq_core.kernels = KN

    cases = {"attend a decode step, this checkout": lambda: step(KN), "attend a decode step, --old": lambda: step(KO),
             "attention_v5, this checkout": lambda: v5(KN), "attention_v5, --old": lambda: v5(KO),
             "fused_attend, this checkout": lambda: fused(KN), "fused_attend, --old": lambda: fused(KO),
             "the stub launch alone": lambda: stub(inputs=[], template=[], grid=(1, 1, 1), threadgroup=(1, 1, 1),
                                                    output_shapes=[(1, Hq, 1, d), (1000,)],
                                                    output_dtypes=[mx.bfloat16, mx.float32])}
    times: dict[str, list[float]] = {n: [] for n in cases}
    for _ in range(15):
        for name, fn in cases.items():
            t = time.perf_counter()
            for _ in range(300):
                fn()
            times[name].append((time.perf_counter() - t) / 300 * 1e6)
    for name, v in times.items():
        v.sort()
        print(f"{name:36s} min {v[0]:6.2f} us  median {v[len(v) // 2]:6.2f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
