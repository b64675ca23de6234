"""Every GPU kernel the default path and `rq profile` use, and the compressed cache end to end, against float64.

    python3 tools/gpu_check.py [--quick] [--record]

Each case draws fresh random inputs and runs with every kernel output poisoned first (RQ_KERNEL_POISON: NaN, codes
0xB2D05E00), so an element a kernel forgot to write fails the case:
  attn_fused         against float64 attention over the same codes (tests/kernel_emu/attn_reference.py): every
                     context from 1 to 128K tokens, GQA groups, head dims, query dtypes, causal rows, each rotation,
                     4-bit and 2-bit codes, keys at their own width, pair codebooks, more query heads a kv head
                     than a block's 8 rows (row blocks), its launch configurations, and repeated launches (the split
                     counters must come back zeroed)
  four-kernel pipeline  rotate_queries, qk_dot, softmax, value_accum (both strategies), rotate_inverse
  kv_append          against quantize_kv and float64 (tests/kernel_emu/append_reference.py)
  kv_decode          against the MLX-op decode (rq_core.attention.reference.dequantize_rotated)
  the cache          IsoQuant and TurboQuant caches with and without an fp16 window, a prompt compressed while it is
                     prefilled, then decode steps through cache.attend, against float64 on the cache's own contents,
                     at the model families' shapes; each decode must take the fused kernel

--record writes the sources' hash with this run's result to tools/gpu_check.json when every case passed; the CPU test
tests/test_gpu_check.py fails when metal/ no longer matches the recorded hash. Exit status 1 if any case fails.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

RECORD = ROOT / "tools" / "gpu_check.json"
TOL_HALF = {"f32": 5e-5, "f16": 1e-3, "bf16": 8e-3}  # attn_fused against float64 with half-rounded levels
TOL_EXACT = {"f32": 2e-3, "f16": 4e-3, "bf16": 1.6e-2}  # ... or against the exact levels
TOL_FOUR = 1e-4  # the four-kernel pipeline (fp32 throughout)
TOL_CACHE = 3e-3  # the cache end to end (fp16 queries and output)


def sources_hash(src_dir: Path | None = None) -> str:
    """sha256 over the kernel sources (every file of metal/, names and contents, in name order)."""
    src_dir = src_dir or ROOT / "metal"
    h = hashlib.sha256()
    for f in sorted(p for p in src_dir.iterdir() if p.is_file()):
        h.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def attention_cases(quick: bool) -> list[dict]:
    base = dict(G=8, d=128, L=1, causal=False, rot=3, bits=3, path="fused")
    cases = [dict(base, T=T) for T in ((1, 513, 4096, 32768) if quick else (1, 7, 511, 512, 513, 4096, 32768, 131072))]
    cases += [dict(base, G=G, T=513) for G in (1, 4)]
    cases += [dict(base, d=256, T=4097), dict(base, d=64, T=2000, bits=4), dict(base, T=4099, qdtype="f16"),
              dict(base, T=4099, qdtype="bf16"), dict(base, G=4, T=700, L=2, causal=True), dict(base, T=3000, rot=0),
              dict(base, T=3000, rot=4), dict(base, T=3000, rot=11), dict(base, T=1500, bits=2)]
    # 4-bit keys and values (the edge layers' caches), keys at their own width (kv.key_bits)
    cases += [dict(base, T=T, bits=4) for T in (1, 513, 32768)] + [dict(base, G=4, T=700, L=2, causal=True, bits=4)]
    cases += [dict(base, T=T, key_bits=4) for T in (1, 513, 4096, 32768)]
    cases += [dict(base, T=1500, bits=2, key_bits=4), dict(base, G=4, T=700, L=2, causal=True, key_bits=4)]
    # pair codebooks (kv.pair_points (128, 32)): 7-bit key fields, 5-bit value fields
    pp = dict(base, bits=5, key_bits=7, pair=(128, 32))
    cases += [dict(pp, T=T) for T in ((1, 513, 32768) if quick else (1, 7, 513, 4096, 32768, 131072))]
    cases += [dict(pp, T=4099, qdtype="f16"), dict(pp, G=4, T=700, L=2, causal=True), dict(pp, d=64, T=2000),
              dict(pp, T=3000, rot=11)]
    # more query heads a kv head than a block's 8 rows (row blocks): Nemotron 3's 16 (pair codebooks, the edge
    # layers' 4-bit codes, causal rows), 32, and 28 (Qwen2-57B: blocks of 7)
    cases += [dict(pp, G=16, T=T) for T in ((513, 32768) if quick else (1, 513, 4096, 32768, 131072))]
    cases += [dict(base, G=16, T=T, bits=4) for T in (513, 32768)] + [dict(base, G=16, T=4099, qdtype="f16")]
    cases += [dict(pp, G=16, T=700, L=2, causal=True), dict(base, G=32, T=4096), dict(pp, G=28, T=4096)]
    # head dim 512 (Gemma 4's global layers: 16 / 2 heads, 8 rows a kv head): a block per value-dim half, the query's
    # fragments in threadgroup memory; pair codebooks, the edge layers' 4-bit codes, 4-bit keys, causal rows, rwht_so4
    g512 = dict(pp, d=512, qdtype="bf16")
    cases += [dict(g512, T=T) for T in ((1, 513, 32768) if quick else (1, 7, 513, 4096, 32768, 131072))]
    cases += [dict(g512, qdtype="f16", T=4099), dict(g512, qdtype="f32", T=4099), dict(g512, G=4, T=700, L=2, causal=True),
              dict(g512, T=3000, rot=11)]
    cases += [dict(base, d=512, T=T, bits=4, qdtype="bf16") for T in (513, 32768)]
    cases += [dict(base, d=512, T=4097), dict(base, d=512, T=4097, key_bits=4, qdtype="f16"),
              dict(base, d=512, G=4, T=700, L=2, causal=True, bits=4)]
    # launch configurations other than the default a shape can take: (threads, load-ahead, decode, ring slots)
    for nth, pf, vdec, stage in ((384, 1, 2, 1), (256, 2, 1, 0), (512, 1, 2, 1)):
        cases += [dict(base, T=T, cfg=dict(nth=nth, pf=pf, vdec=vdec, stage=stage)) for T in (513, 32768)]
    cases.append(dict(base, T=40000, repeat=3))  # the counters come back zeroed
    # the four-kernel pipeline (what `rq profile` times), both value strategies
    for strat in ("word", "dim"):
        four = dict(base, path="four", strategy=strat)
        cases += [dict(four, T=T) for T in (1, 513, 4096, 32768)]
        cases += [dict(four, G=4, T=700, L=3, causal=True), dict(four, d=64, T=1500, bits=4), dict(four, T=3000, rot=4),
                  dict(four, T=1500, key_bits=4), dict(four, T=4096, bits=5, key_bits=7, pair=(128, 32)),
                  dict(four, d=256, T=700, bits=5, key_bits=7, pair=(128, 32))]
    return cases


def run_attention(K, mx, rng, cs: dict) -> tuple[bool, str]:
    from kernel_emu import attn_reference as KC

    c = KC.make_case(rng, B=1, Hkv=2, G=cs["G"], L=cs["L"], d=cs["d"], T=cs["T"], bits=cs["bits"],
                     dense=bool(cs["rot"] & 4), signs=bool(cs["rot"] & 8), key_bits=cs.get("key_bits"),
                     pair_points=cs.get("pair"))
    err, err_h, nan = 0.0, 0.0, 0
    for _ in range(cs.get("repeat", 1)):
        e, n, h = KC.run_case(K, mx, c, T=cs["T"], bits=cs["bits"], path=cs["path"], strategy=cs.get("strategy"),
                              causal=cs["causal"], offset=cs["T"] - cs["L"], rot=cs["rot"],
                              qdtype=cs.get("qdtype", "f32"), key_bits=cs.get("key_bits"),
                              fused_config=cs.get("cfg"))
        err, nan, err_h = max(err, e), nan + n, max(err_h, h or 0.0)
    if cs["path"] == "four":
        return nan == 0 and err < TOL_FOUR, f"rel.err {err:.2e}  nan {nan}"
    qd = cs.get("qdtype", "f32")
    ok = nan == 0 and (err_h < TOL_HALF[qd] or err < TOL_EXACT[qd])
    return ok, f"rel.err {err:.2e} (half levels {err_h:.1e})  nan {nan}"


def label(cs: dict) -> str:
    s = f"{cs['path']}{'/' + cs['strategy'] if cs.get('strategy') else ''} G={cs['G']} d={cs['d']} T={cs['T']} " \
        f"L={cs['L']} bits={cs['bits']} rot={cs['rot']}"
    for k in ("key_bits", "pair", "qdtype", "cfg", "repeat"):
        if cs.get(k) is not None:
            s += f" {k}={cs[k]}"
    return s + (" causal" if cs["causal"] else "")


def run_decode(K, mx, rng, *, pair_points, d: int, dtype, tokens: int = 300) -> tuple[bool, str]:
    from rq_core.attention.reference import dequantize_rotated
    from rq_core.cache.kv_cache import IsoQuantCache

    c = IsoQuantCache(head_dim=d, n_kv_heads=2, layer=int(rng.integers(32)), pair_points=pair_points,
                      seed=int(rng.integers(1 << 20)))
    c.prefilling = False
    k = mx.array(rng.standard_normal((1, 2, tokens, d)).astype(np.float16))
    c._append_fp16(k, k * 0.5)
    c._spill(0)
    n = c.packed_len
    errs = []
    for codes, norms, book in ((c.k_codes, c.k_norms, c.k_book), (c.v_codes, c.v_norms, c.v_book)):
        lv, bits = book.table, book.field_bits
        got = K.decode_rows(codes, norms, lv, bits=bits, d=d, n=n, dtype=dtype)
        if got is None:
            return False, "decode_rows declined the shape"
        ref = dequantize_rotated(codes[:, :, :n], norms[:, :, :n], lv, bits, d)
        g, r = np.array(got.astype(mx.float32), dtype=np.float64), np.array(ref, dtype=np.float64)
        if np.isnan(g).any():
            return False, "NaN left from the poison"
        errs.append(float(np.abs(g - r).max() / np.abs(r).max()))
    tol = 1e-6 if dtype == mx.float32 else 4e-3
    return max(errs) < tol, f"max rel.err {max(errs):.1e}"


def cache_reference(cache, q: np.ndarray, scale: float, half: bool = False) -> np.ndarray:
    """float64 attention of q [1, Hq, L, D] over everything the cache holds (the packed tokens, then the fp16 segment);
    the queries are the last L tokens, causally. half: the codebook levels rounded to float16, as the matrix units
    use them."""
    import mlx.core as mx

    from rq_core.cache.kv_cache import dequantize_kv

    n, D = cache.packed_len, cache.head_dim
    lv, klv = cache.v_book.table, cache.k_book.table
    if half:
        lv, klv = (t.astype(mx.float16).astype(mx.float32) for t in (lv, klv))
    with mx.stream(mx.cpu):  # float32 dequantization on the CPU, then float64 math
        k = np.array(dequantize_kv(cache.k_codes[:, :, :n], cache.k_norms[:, :, :n], cache.rotation, klv,
                                   cache.k_book.field_bits, D), dtype=np.float64)
        v = np.array(dequantize_kv(cache.v_codes[:, :, :n], cache.v_norms[:, :, :n], cache.rotation, lv,
                                   cache.v_book.field_bits, D), dtype=np.float64)
    if cache.fp16_len:  # the fp16 segment after the packed tokens, exact
        fk, fv = cache.fp16_segment()
        k = np.concatenate([k, np.array(fk.astype(mx.float32), dtype=np.float64)], 2)
        v = np.concatenate([v, np.array(fv.astype(mx.float32), dtype=np.float64)], 2)
    G = q.shape[1] // cache.n_kv_heads
    k, v = np.repeat(k, G, axis=1), np.repeat(v, G, axis=1)
    s = np.einsum("bhld,bhtd->bhlt", q.astype(np.float64), k) * scale
    L, T = q.shape[2], k.shape[2]
    s = np.where(np.arange(T)[None, :] <= (T - L + np.arange(L))[:, None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("bhlt,bhtd->bhld", p, v)


def run_cache(mx, rng, *, mode: str, context: int, window: int, steps: int = 3, prefill_chunk: int = 0,
              hq: int = 32, hkv: int = 4, d: int = 128, **kw) -> list[tuple[bool, str]]:
    """A cache filled with a random prompt (in chunks of `prefill_chunk` causal rows, or whole), then decode steps
    through cache.attend, each against float64 on the cache's contents."""
    from rq_core.cache.kv_cache import KVSettings, make_kv_cache

    cache = make_kv_cache(KVSettings(mode=mode, fp16_window=window, prefill_fp16=4096 if prefill_chunk else None,
                                     **kw), layer=3, n_kv_heads=hkv, head_dim=d)
    scale = 1.0 / math.sqrt(d)
    kp = rng.standard_normal((1, hkv, context, d)).astype(np.float16)
    vp = rng.standard_normal((1, hkv, context, d)).astype(np.float16)
    out = []
    chunk = prefill_chunk or context
    for s0 in range(0, context, chunk):
        s1 = min(context, s0 + chunk)
        L = s1 - s0 if prefill_chunk else 1
        qc = mx.array(rng.standard_normal((1, hq, L, d)).astype(np.float16))
        o = cache.attend(qc, mx.array(kp[:, :, s0:s1]), mx.array(vp[:, :, s0:s1]), scale=scale, mask="causal")
    if prefill_chunk and cache.packed_len:  # the last chunk's last 16 rows, over packed and fp16 tokens
        rows = min(16, o.shape[2])
        qs = np.array(qc[:, :, -rows:].astype(mx.float32))
        got = np.array(o[:, :, -rows:].astype(mx.float32), dtype=np.float64)
        err = min(float(np.linalg.norm(got - r) / np.linalg.norm(r))
                  for r in (cache_reference(cache, qs, scale), cache_reference(cache, qs, scale, half=True)))
        out.append((bool(np.isfinite(got).all()) and err < TOL_CACHE,
                    f"prompt chunk over {cache.packed_len} compressed tokens: rel.err {err:.2e}"))
    cache.end_prefill()
    for i in range(steps):
        q = rng.standard_normal((1, hq, 1, d)).astype(np.float16)
        k = rng.standard_normal((1, hkv, 1, d)).astype(np.float16)
        v = rng.standard_normal((1, hkv, 1, d)).astype(np.float16)
        o = cache.attend(mx.array(q), mx.array(k), mx.array(v), scale=scale, mask="causal")
        got = np.array(o.astype(mx.float32), dtype=np.float64)
        err = min(float(np.linalg.norm(got - r) / np.linalg.norm(r))
                  for r in (cache_reference(cache, q, scale), cache_reference(cache, q, scale, half=True)))
        out.append((bool(np.isfinite(got).all()) and err < TOL_CACHE and o.dtype == mx.float16,
                    f"decode step {i}: rel.err {err:.2e}"))
    # a decode step takes the fused kernel on a GPU wherever the dispatcher's decision says it covers the shape
    # (rq_core.attention.dispatch records the path on the cache; tests/test_attention_coverage.py lists the gaps)
    from rq_core.attention import dispatch
    from rq_core.kernels import launch as K

    be = K.backend() if K.available() else None
    why = "no GPU" if be is None else dispatch.fused_declines(
        be, head_dim=d, q_heads=hq, kv_heads=hkv, bits=cache.bits, key_bits=cache.key_bits,
        pair_points=cache.pair_points)
    path = getattr(cache, "attention_path", None)
    out.append((path is not None and path[0] == ("fused" if why is None else "reference"),
                f"decode path {path}" + (f" (declined: {why})" if why else "")))
    # the same steps as a layer's traced decode graph takes them (rq_core.models.base.decode_layer): the cache's
    # decode_inputs, its traced_attend inside mx.compile (the new token's row written there), decode_commit
    traced = 0
    for i in range(steps if window > 1 else 0):
        prep = cache.decode_inputs()
        if prep is None:
            break
        launch, arrays = prep
        fn = mx.compile(lambda *a, launch=launch: type(cache).traced_attend(launch, list(a[3:]), *a[:3]))
        q = rng.standard_normal((1, hq, 1, d)).astype(np.float16)
        k = rng.standard_normal((1, hkv, 1, d)).astype(np.float16)
        v = rng.standard_normal((1, hkv, 1, d)).astype(np.float16)
        o, fk, fv = fn(mx.array(q), mx.array(k), mx.array(v), *arrays)
        cache.decode_commit(fk, fv)
        got = np.array(o.astype(mx.float32), dtype=np.float64)
        err = min(float(np.linalg.norm(got - r) / np.linalg.norm(r))
                  for r in (cache_reference(cache, q, scale), cache_reference(cache, q, scale, half=True)))
        out.append((bool(np.isfinite(got).all()) and err < TOL_CACHE, f"traced decode step {i}: rel.err {err:.2e}"))
        traced += 1
    if window > 1:
        out.append(((traced > 0) == (why is None), f"traced decode steps {traced}"))
    return out


def cache_cases(quick: bool) -> list[dict]:
    cases = [dict(mode="isoquant3", context=5000, window=0), dict(mode="isoquant3", context=5000, window=32),
             dict(mode="turbo3", context=5000, window=32), dict(mode="isoquant3", context=5000, window=32, bits=4,
                                                                 pair_points=()),
             dict(mode="isoquant3", context=5000, window=32, key_bits=4, pair_points=()),
             dict(mode="isoquant3", context=9000, window=32, prefill_chunk=2048),
             # the families' shapes: Nemotron 3 (32 / 2 heads), Gemma 4's global layers (head_dim 512, 16 / 2), pair
             # codebooks and the edge layers' 4-bit codes
             dict(mode="isoquant3", context=5000, window=32, hq=32, hkv=2),
             dict(mode="isoquant3", context=5000, window=32, hq=32, hkv=2, bits=4, pair_points=()),
             dict(mode="isoquant3", context=9000, window=32, hq=32, hkv=2, prefill_chunk=2048),
             dict(mode="isoquant3", context=5000, window=32, hq=16, hkv=2, d=512),
             dict(mode="isoquant3", context=5000, window=32, hq=16, hkv=2, d=512, bits=4, pair_points=()),
             # short contexts: the caches' launches are planned for the most splits, most of them short or empty
             dict(mode="isoquant3", context=40, window=8), dict(mode="isoquant3", context=300, window=32, hq=32, hkv=2),
             dict(mode="isoquant3", context=200, window=32, hq=16, hkv=2, d=512)]
    if not quick:
        cases += [dict(mode="isoquant3", context=40000, window=32), dict(mode="isoquant3", context=5000, window=32,
                                                                          rotation="rwht_so4")]
    return cases


def record(cases: int, backend: str, mlx_version: str, quick: bool) -> None:
    RECORD.write_text(json.dumps(dict(sources_sha256=sources_hash(), status="passed", backend=backend,
                                      mlx=mlx_version, cases=cases, quick=quick), indent=1) + "\n")
    print(f"gpu_check: recorded in {RECORD.relative_to(ROOT)}")


def run_jobs(a: argparse.Namespace) -> int:
    """The cases shared by `a.jobs` processes (kernel compiles dominate a fresh machine's run), their lines
    printed as each finishes; recorded when every case of every process passed."""
    import re
    import subprocess

    cmd = [sys.executable, __file__] + (["--quick"] if a.quick else [])
    procs = [subprocess.Popen(cmd + ["--shard", f"{k}/{a.jobs}"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for k in range(a.jobs)]
    passed = total = 0
    backend = mlx_version = "?"
    ok = True
    for p in procs:
        out, _ = p.communicate()
        sys.stdout.write(out)
        m = re.search(r"gpu_check: (\d+)/(\d+) passed", out)
        h = re.search(r"backend (\S+), MLX (\S+),", out)
        if p.returncode != 0 or m is None or m.group(1) != m.group(2):
            ok = False
        if m:
            passed, total = passed + int(m.group(1)), total + int(m.group(2))
        if h:
            backend, mlx_version = h.group(1), h.group(2)
    print(f"gpu_check: {passed}/{total} passed in {a.jobs} processes")
    if a.record and ok:
        record(total, backend, mlx_version, a.quick)
    return 0 if ok else 1


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer contexts")
    ap.add_argument("--record", action="store_true", help="write the sources' hash to tools/gpu_check.json if all pass")
    ap.add_argument("--jobs", type=int, default=1, help="processes that share the cases (each compiles its kernels)")
    ap.add_argument("--shard", default="0/1", help=argparse.SUPPRESS)  # K/N: every N-th case from the K-th
    a = ap.parse_args()
    if a.jobs > 1:
        return run_jobs(a)
    shard, n_shards = (int(v) for v in a.shard.split("/"))
    import mlx.core as mx

    import rq_core.kernels.launch as K
    from rq_core.kernels import config as env
    from kernel_emu import append_reference as AC

    if not K.available():
        print(f"gpu_check: no GPU backend here (MLX device {mx.default_device()}): nothing checked")
        return 1
    env.set_config(replace(env.config(), poison=True))
    # the split counters: a tiny ring, so slots are reused many times in this run and must come back zeroed
    K.COUNTER_POOL = 8
    seed = int(time.time()) + shard
    rng = np.random.default_rng(seed)
    print(f"gpu_check: backend {K.backend()}, MLX {mx.__version__}, seed {seed}, sources {sources_hash()[:16]}")
    results = []
    index = iter(range(1 << 30))

    def report(name: str, fn) -> None:
        if next(index) % n_shards != shard:
            return
        t0 = time.time()
        try:
            outcome = fn()
        except Exception as e:  # a compile or launch error is a failure, reported, not a crash
            outcome = [(False, f"{type(e).__name__}: {str(e)[:300]}")]
        for ok, msg in outcome if isinstance(outcome, list) else [outcome]:
            results.append(ok)
            print(f"{'ok  ' if ok else 'FAIL'} {name}: {msg}  {time.time() - t0:.1f}s", flush=True)

    for cs in attention_cases(a.quick):
        report(label(cs), lambda cs=cs: run_attention(K, mx, rng, cs))
    for c in AC.case_list(full=not a.quick, gpu=True):
        def append_case(c=c):
            s = AC.summarize(AC.check_case(rng, c, "gpu"))
            return s["ok"], (f"boundary {s['ops_boundary']}/{s['f64_boundary']}  far {s['ops_far']}/{s['f64_far']}  "
                             f"norm ulp {s['norm_ulp_max']:.2f}")
        report(f"kv_append {AC.label(c)}", append_case)
    for pp in (None, (128, 32)):
        for d in (64, 128, 256, 512):
            for dt in (mx.float16, mx.bfloat16, mx.float32):
                report(f"kv_decode d={d} pairs={pp} {dt}", lambda pp=pp, d=d, dt=dt: run_decode(K, mx, rng,
                                                                                              pair_points=pp, d=d,
                                                                                              dtype=dt))
    for c in cache_cases(a.quick):
        report(f"cache {c}", lambda c=c: run_cache(mx, rng, **c))
    fails = results.count(False)
    print(f"gpu_check: {len(results) - fails}/{len(results)} passed")
    if a.record and not fails:
        record(len(results), K.backend(), mx.__version__, a.quick)
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
