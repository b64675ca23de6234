"""kv_decode on the GPU against float64 math on fresh random inputs, outputs poisoned (NaN) before each run: random code
words and norms, scalar 3-bit and pair (128, 32) codebooks, head dims 64 / 128 / 256, f32 / f16 / bf16 outputs, rows
1 .. 4096 of a larger buffer. Prints one line a case and the worst relative error; exit 1 on any failure, 2 without a
GPU backend.

    python3 tools/decode_check.py
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

import rq_core.kernels as K  # noqa: E402
from rq_core.codebook import get_codebook, pair_codebook  # noqa: E402
from rq_core.packing import unpack_np  # noqa: E402


def main() -> int:
    if not K.available():
        print("decode_check: needs MLX's Metal or CUDA backend (kv_decode runs on a GPU)", file=sys.stderr)
        return 2
    K.POISON = True
    rng = np.random.default_rng(int.from_bytes(np.random.bytes(4), "little"))  # fresh inputs every run
    fails, worst = 0, 0.0
    for d in (64, 128, 256):
        for kind, bits, levels in (("scalar3", 3, get_codebook("sphere", 3, d).levels.astype(np.float64)),
                                   ("pair7", 7, pair_codebook(128, d, "keys").astype(np.float64)),
                                   ("pair5", 5, pair_codebook(32, d, "values").astype(np.float64))):
            nf = d // 2 if levels.ndim == 2 else d
            W = (nf * bits + 31) // 32
            for n in (1, 7, 513, 4096):
                B, H, Tcap = 1, 4, n + 64
                words = rng.integers(0, 2**32, (B, H, Tcap, W), dtype=np.uint64).astype(np.uint32)
                if levels.shape[0] != 1 << bits:
                    raise SystemExit("codebook size")
                norms = (rng.random((B, H, Tcap)) * 20).astype(np.float16)
                idx = unpack_np(words[:, :, :n], bits, nf)
                ref = levels[idx].reshape(B, H, n, d) * (norms[:, :, :n].astype(np.float64)[..., None] / np.sqrt(d))
                for dt, tol in ((mx.float32, 1e-6), (mx.float16, 1e-3), (mx.bfloat16, 8e-3)):
                    out = K.decode_rows(mx.array(words), mx.array(norms), mx.array(levels.astype(np.float32)),
                                        bits=bits, d=d, n=n, dtype=dt, rows=n + 3)  # room after: left poisoned
                    room_nan = bool(np.isnan(np.array(out[:, :, n:].astype(mx.float32))).all())
                    out = out[:, :, :n]
                    got = np.array(out.astype(mx.float32)).astype(np.float64)
                    nan = int(np.isnan(got).sum())
                    err = float(np.abs(got - ref).max() / max(np.abs(ref).max(), 1e-30))
                    ok = room_nan and nan == 0 and err <= tol and out.dtype == dt and out.shape == (B, H, n, d)
                    worst = max(worst, err) if dt == mx.float32 else worst
                    fails += not ok
                    if not ok or n == 4096:
                        print(f"{'ok  ' if ok else 'FAIL'} d={d} {kind} n={n} {dt}: rel err {err:.2e} nan {nan}",
                              flush=True)
    print(f"kv_decode: {'all passed' if not fails else f'{fails} FAILED'}; worst f32 rel err {worst:.2e}")
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
