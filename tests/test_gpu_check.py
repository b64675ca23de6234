"""tools/gpu_check.py: the recorded GPU check still covers the kernel sources as they are, and the check itself
runs (its kernel paths on the CPU executor, its cache path on the reference path)."""

from __future__ import annotations

import json
import shutil
import sys
import warnings
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from kernel_emu import configure

import rq_core.kernels.launch as K

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

import gpu_check as G  # noqa: E402

needs_emu = pytest.mark.skipif(shutil.which("g++") is None or not sys.platform.startswith("linux"),
                               reason="needs g++ and ucontext (Linux)")
COMMAND = "python3 tools/gpu_check.py --record"


def test_recorded_gpu_check_covers_the_kernel_sources():
    """The hash of metal/ equals the one tools/gpu_check.json records: a kernel source changed since then fails here
    until the check is run again on a GPU (`python3 tools/gpu_check.py --record`). A recorded hash without a passing
    run (sources changed on a machine without a GPU) is reported as a warning."""
    rec = json.loads(G.RECORD.read_text())
    assert rec["sources_sha256"] == G.sources_hash(), (
        f"metal/ changed since the last GPU check: run `{COMMAND}` on a GPU (or record the new hash as "
        f"not checked)")
    if rec.get("status") != "passed":
        warnings.warn(f"the kernel sources ({rec['sources_sha256'][:16]}) have not passed tools/gpu_check.py on a GPU "
                      f"yet ({rec.get('status')!r}): run `{COMMAND}` there", UserWarning, stacklevel=1)


def test_sources_hash_follows_every_byte(tmp_path):
    src = tmp_path / "metal"
    shutil.copytree(K.SRC_DIR, src)
    h = G.sources_hash(src)
    assert h == G.sources_hash(K.SRC_DIR)
    body = src / "attn_fused.body"
    body.write_text(body.read_text() + " ")
    assert G.sources_hash(src) != h


def _executor(monkeypatch) -> dict:
    from kernel_emu import emulate as EK

    stand: dict = {}

    def kernel(name: str):
        return stand.setdefault(name, EK.MLXStandIn(name))

    configure(monkeypatch, disk_cache=False, poison=True)
    monkeypatch.setattr(K, "backend", lambda: "cuda")
    monkeypatch.setattr(K, "available", lambda: True)
    monkeypatch.setattr(K, "_kernel", lambda name, be: kernel(name))
    monkeypatch.setattr(K, "_fused_kernel", lambda be, nth, minb, window=False, minified=True:
                        kernel("attn_fused_window" if window else "attn_fused"))
    return stand


@needs_emu
@pytest.mark.parametrize("cs", [
    dict(G=2, d=128, L=1, causal=False, rot=3, bits=3, path="fused", T=300, qdtype="f16", repeat=2,
         cfg=dict(nth=128, pf=1, vdec=2, stage=1)),
    dict(G=4, d=64, L=2, causal=True, rot=4, bits=3, path="four", strategy="dim", T=200),
])
def test_attention_cases_run_through_the_executor(cs, monkeypatch):
    """gpu_check's attention path (case building, launch arguments, poison, comparison) with the CPU executor
    standing in for the GPU: the fused kernel with a launch configuration, the four-kernel pipeline."""
    stand = _executor(monkeypatch)
    ok, msg = G.run_attention(K, mx, np.random.default_rng(3), cs)
    assert ok, msg
    names = set(stand)
    assert names == ({"attn_fused"} if cs["path"] == "fused" else
                     {"rotate_query", "qk_dot", "softmax", "value_dim", "value_reduce", "rotate_inverse"})
    if cs["path"] == "fused":
        calls = stand["attn_fused"].calls
        assert len(calls) == 2 and all(c["init_value"] != c["init_value"] for c in calls)  # NaN: poisoned
        assert dict(calls[0]["template"])["THREADS"] == 128


def test_cache_check_runs_and_can_fail(monkeypatch):
    """gpu_check's cache path on the reference path (no GPU here): decode steps and a prompt compressed while
    prefilled agree with its float64 reference; a cache whose attention is wrong fails it."""
    from rq_core.attention import dispatch

    rng = np.random.default_rng(5)
    kw = dict(hq=8, hkv=2, d=64, steps=2)
    res = G.run_cache(mx, rng, mode="isoquant3", context=300, window=8, **kw)
    res += G.run_cache(mx, rng, mode="turbo3", context=300, window=0, **kw)
    res += G.run_cache(mx, rng, mode="isoquant3", context=5000, window=8, prefill_chunk=2048, **kw)
    # 7 numbers, each cache's decode path, and (no GPU: none) its traced steps where it has a window
    assert len(res) == 12 and all(ok for ok, _ in res), res
    real = dispatch.attend
    monkeypatch.setattr(dispatch, "attend", lambda store, q, **k: real(store, q, **k) * 1.01)
    assert not any(ok for ok, m in G.run_cache(mx, rng, mode="isoquant3", context=300, window=8, **kw) if "rel.err" in m)


def test_cache_check_runs_the_traced_steps(monkeypatch):
    """gpu_check's traced decode steps (decode_inputs, traced_attend inside mx.compile, decode_commit), the launch
    stood in for by MLX ops: they agree with the float64 reference, and fail for a cache whose step writes the new
    token one row off."""
    from _ref_launch import RefLaunch

    from rq_core.attention import dispatch
    from rq_core.cache.kv_cache import IsoQuantCache

    monkeypatch.setattr(dispatch, "decode_launch", lambda store, qshape, qdtype, scale: RefLaunch(store))
    kw = dict(hq=8, hkv=2, d=64, steps=3, pair_points=())
    res = G.run_cache(mx, np.random.default_rng(6), mode="isoquant3", context=300, window=8, **kw)
    traced = [m for ok, m in res if m.startswith("traced decode step ")]
    assert len(traced) == 3 and all(ok for ok, m in res if m.startswith("traced decode step ")), res
    real = IsoQuantCache.decode_commit
    monkeypatch.setattr(IsoQuantCache, "decode_commit", lambda self, fk, fv: (real(self, fk, fv),
                                                                               setattr(self, "_f0", self._f0 + 1)))
    res = G.run_cache(mx, np.random.default_rng(6), mode="isoquant3", context=300, window=8, **kw)
    assert not all(ok for ok, m in res if m.startswith("traced decode step "))


@needs_emu
@pytest.mark.parametrize("pair_points,d,dtype", [(None, 64, mx.float32), ((128, 32), 128, mx.bfloat16)])
def test_decode_case_runs_through_the_executor(pair_points, d, dtype, monkeypatch):
    """gpu_check's kv_decode case (kv_append and kv_decode on the CPU executor, outputs poisoned) passes, and
    fails for a kernel whose decode is wrong."""
    stand = _executor(monkeypatch)
    ok, msg = G.run_decode(K, mx, np.random.default_rng(8), pair_points=pair_points, d=d, dtype=dtype, tokens=20)
    assert ok, msg
    assert {"kv_append", "kv_decode"} <= set(stand)
    real = K.decode_rows
    monkeypatch.setattr(K, "decode_rows", lambda *a, **k: real(*a, **k) * 1.01)
    assert not G.run_decode(K, mx, np.random.default_rng(8), pair_points=pair_points, d=d, dtype=dtype, tokens=20)[0]
