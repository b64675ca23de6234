"""Lloyd-Max scalar codebooks for rotated KV coordinates (docs/FORMAT.md, "Codebook").

Levels are in units where a rotated coordinate has unit variance (coordinates of √d·R·u). Three
sources: N(0, 1); the exact marginal of one coordinate of a uniform unit vector in dimension d
(density ∝ (1 - x²)^((d-3)/2), rescaled by √d); or samples (1-D Lloyd iterations).
Integrals are done on a fine grid with cumulative sums: plain numpy, no scipy.
"""

from __future__ import annotations

import functools
import math
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import mlx.core as mx
import numpy as np

from rq_core.errors import RQError

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

DISTRIBUTIONS = ("sphere", "gaussian")


def check_bits(bits: int) -> int:
    if not isinstance(bits, (int, np.integer)) or not 1 <= bits <= 4:
        raise RQError(f"bits must be 1, 2, 3 or 4 (got {bits})")
    return int(bits)


@dataclass
class Codebook:
    bits: int
    levels: np.ndarray  # [2^bits] float64 ascending
    mse: float  # E[(z - level(z))²] in unit-variance units
    distribution: str = "gaussian"  # gaussian | sphere | samples
    dim: int | None = None
    meta: dict = field(default_factory=dict)

    @property
    def thresholds(self) -> np.ndarray:
        return (self.levels[1:] + self.levels[:-1]) / 2

    def encode(self, z: np.ndarray) -> np.ndarray:
        """Index = number of thresholds < z (FORMAT.md)."""
        return np.searchsorted(self.thresholds, z, side="left").astype(np.uint8)

    def to_dict(self) -> dict:
        d = {
            "bits": self.bits,
            "dim": self.dim,
            "distribution": self.distribution,
            "levels": [float(x) for x in self.levels],
            "thresholds": [float(x) for x in self.thresholds],
            "mse": float(self.mse),
        }
        d.update(self.meta)
        return d

    def save(self, path: str | os.PathLike) -> None:
        """Write TOML atomically (temp file in the same folder + os.replace)."""
        import tomli_w

        data = {k: v for k, v in self.to_dict().items() if v is not None}
        path = Path(path)
        if path.is_dir():
            raise RQError(f"--out {path} is a directory; give a file name such as {path / 'codebook.toml'}")
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                tomli_w.dump({"codebook": data}, f)
            os.chmod(tmp, 0o644)  # mkstemp makes it owner-only; a codebook is an ordinary output file
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Codebook":
        path = Path(path)
        if not path.is_file():
            raise RQError(f"codebook file not found: {path}")
        try:
            data = tomllib.loads(path.read_text())["codebook"]
            bits = check_bits(int(data["bits"]))
            levels = np.asarray(data["levels"], dtype=np.float64)
        except (tomllib.TOMLDecodeError, KeyError, TypeError, ValueError) as e:
            raise RQError(f"{path}: not a codebook TOML ({e})") from None
        if levels.shape != (2**bits,) or np.any(np.diff(levels) <= 0):
            raise RQError(f"{path}: a {bits}-bit codebook needs {2**bits} ascending levels")
        return cls(bits, levels, float(data.get("mse", float("nan"))), data.get("distribution", "file"),
                   data.get("dim"))


# ---------------------------------------------------------------------------------------------
# Lloyd-Max on a density given on a grid


def _lloyd_density(x: np.ndarray, p: np.ndarray, bits: int, iters: int = 20000, tol: float = 1e-12):
    """Lloyd-Max for a symmetric density p sampled on the uniform grid x; returns (levels, mse)."""
    dx = x[1] - x[0]
    p = p / (p.sum() * dx)
    # Cumulative moments at the grid points (trapezoid), interpolated at the thresholds.
    def cum(f):
        c = np.concatenate([[0.0], np.cumsum((f[1:] + f[:-1]) * dx / 2)])
        return c

    F0, F1, F2 = cum(p), cum(x * p), cum(x * x * p)
    n = 2**bits
    sd = math.sqrt(F2[-1])
    levels = sd * np.linspace(-2.0, 2.0, n) if n > 1 else np.zeros(1)
    for _ in range(iters):
        t = np.concatenate([[x[0]], (levels[1:] + levels[:-1]) / 2, [x[-1]]])
        m0, m1 = np.diff(np.interp(t, x, F0)), np.diff(np.interp(t, x, F1))
        new = np.where(m0 > 0, m1 / np.maximum(m0, 1e-300), levels)
        done = np.max(np.abs(new - levels)) < tol
        levels = new
        if done:
            break
    t = np.concatenate([[x[0]], (levels[1:] + levels[:-1]) / 2, [x[-1]]])
    m0, m1, m2 = (np.diff(np.interp(t, x, F)) for F in (F0, F1, F2))
    mse = float(np.sum(m2 - 2 * levels * m1 + levels**2 * m0))
    return levels, mse


@functools.lru_cache(maxsize=64)
def _gaussian(bits: int) -> tuple[tuple[float, ...], float]:
    x = np.linspace(-12, 12, 400_001)
    levels, mse = _lloyd_density(x, np.exp(-x * x / 2), bits)
    return tuple(levels), mse


@functools.lru_cache(maxsize=64)
def _sphere(bits: int, d: int) -> tuple[tuple[float, ...], float]:
    # z = √d·x with x a coordinate of a uniform unit vector in R^d: density ∝ (1 - z²/d)^((d-3)/2).
    L = min(math.sqrt(d), 12.0)
    z = np.linspace(-L, L, 400_001)
    with np.errstate(divide="ignore", invalid="ignore"):
        p = np.exp((d - 3) / 2 * np.log1p(-np.minimum(z * z / d, 1.0)))
    p = np.nan_to_num(p, nan=0.0, posinf=0.0)
    levels, mse = _lloyd_density(z, p, bits)
    return tuple(levels), mse


def gaussian_codebook(bits: int) -> Codebook:
    """Lloyd-Max for N(0, 1)."""
    levels, mse = _gaussian(check_bits(bits))
    return Codebook(bits, np.array(levels), mse, "gaussian", None)


def sphere_codebook(bits: int, d: int) -> Codebook:
    """Lloyd-Max for √d × one coordinate of a uniform unit vector in R^d."""
    from rq_core.codec.rotation import check_dim

    levels, mse = _sphere(check_bits(bits), check_dim(d))
    return Codebook(bits, np.array(levels), mse, "sphere", d)


def fit_codebook(samples: np.ndarray, bits: int, *, iters: int = 200, dim: int | None = None) -> Codebook:
    """1-D Lloyd (k-means) on samples of rotated coordinates (already in unit-variance units)."""
    bits = check_bits(bits)
    z = np.sort(np.asarray(samples, dtype=np.float64).ravel())
    z = z[np.isfinite(z)]
    n = 2**bits
    if z.size < n:
        raise RQError(f"need at least {n} finite samples to fit a {bits}-bit codebook (got {z.size})")
    # Start from quantile midpoints: every cell begins non-empty.
    levels = np.quantile(z, (np.arange(n) + 0.5) / n)
    csum = np.concatenate([[0.0], np.cumsum(z)])
    for _ in range(iters):
        cuts = np.searchsorted(z, (levels[1:] + levels[:-1]) / 2, side="right")
        edges = np.concatenate([[0], cuts, [z.size]])
        counts = np.diff(edges)
        sums = csum[edges[1:]] - csum[edges[:-1]]
        new = np.where(counts > 0, sums / np.maximum(counts, 1), levels)
        new = np.maximum.accumulate(new)  # keep ascending if a cell emptied
        done = np.max(np.abs(new - levels)) < 1e-10
        levels = new
        if done:
            break
    levels = _strictly_ascending(levels)
    idx = np.searchsorted((levels[1:] + levels[:-1]) / 2, z, side="left")
    mse = float(np.mean((z - levels[idx]) ** 2))
    return Codebook(bits, levels, mse, "samples", dim, {"n_samples": int(z.size)})


def _strictly_ascending(levels: np.ndarray) -> np.ndarray:
    out = levels.copy()
    for i in range(1, out.size):
        if out[i] <= out[i - 1]:
            out[i] = np.nextafter(out[i - 1], np.inf) + 1e-9
    return out


def get_codebook(spec: str, bits: int, d: int) -> Codebook:
    """`sphere` (for this d), `gaussian`, or a path to a codebook TOML (its bits must match)."""
    if spec == "sphere":
        return sphere_codebook(bits, d)
    if spec == "gaussian":
        return gaussian_codebook(bits)
    cb = Codebook.load(spec)
    if cb.bits != bits:
        raise RQError(f"codebook {spec} has {cb.bits} bits, but {bits} bits were asked for")
    return cb


# ---------------------------------------------------------------------------------------------
# 2-D codebooks: one index for a pair of rotated coordinates (docs/FORMAT.md, "Pair codebooks")

PAIR_POINTS = (16, 32, 64, 128, 256)  # 2 to 4 bits a coordinate, in half bits
PAIR_SEEDS = {"keys": 1, "values": 2}  # the study's seeds (benchmarks/README.md, "Needles and bits")
_PAIR_ASSET = Path(__file__).resolve().parents[1] / "assets" / "pair_codebooks.json"


def check_pair_points(points) -> tuple[int, int]:
    """(keys' points, values' points), each one of PAIR_POINTS."""
    try:
        pk, pv = (int(p) for p in points)
    except (TypeError, ValueError):
        raise RQError(f"pair points must be two numbers, keys' and values' (got {points!r})") from None
    for p in (pk, pv):
        if p not in PAIR_POINTS:
            raise RQError(f"pair codebooks have {', '.join(map(str, PAIR_POINTS))} points (got {p})")
    return pk, pv


def _pair_lloyd(n: int, d: int, seed: int, iters: int = 40) -> np.ndarray:
    """Lloyd's algorithm (k-means) on the 4,096 · d / 2 coordinate pairs of 4,096 vectors √d·u, u uniform on the
    sphere in R^d, started from n of those pairs."""
    rng = np.random.default_rng(seed)
    u = rng.standard_normal((4096, d))
    z = (u / np.linalg.norm(u, axis=1, keepdims=True) * math.sqrt(d)).reshape(-1, 2)
    c = z[rng.choice(len(z), n, replace=False)].copy()
    zz = (z**2).sum(1)
    a = np.empty(len(z), np.int64)
    for _ in range(iters):
        for s in range(0, len(z), 65536):  # nearest point, in slabs (no [pairs, n] temporary of the whole set)
            a[s : s + 65536] = (zz[s : s + 65536, None] - 2 * z[s : s + 65536] @ c.T + (c**2).sum(1)).argmin(1)
        cnt = np.bincount(a, minlength=n)
        ok = cnt > 0
        for j in range(2):
            c[ok, j] = np.bincount(a, z[:, j], minlength=n)[ok] / cnt[ok]
    return c.astype(np.float32)


@functools.lru_cache(maxsize=32)
def pair_codebook(n: int, d: int, role: str) -> np.ndarray:
    """The n-point codebook [n, 2] float32 for pairs (z_2i, z_2i+1) of rotated coordinates in units of unit
    variance, role "keys" or "values" (their own seeds). Shipped for head dims 64, 128 and 256, and isoquant3's
    default (128 keys' points, 32 values') at 512 (Gemma 4's global layers; assets/pair_codebooks.json); others are
    fitted here (seconds at 128, about a minute at 512)."""
    if n not in PAIR_POINTS:
        raise RQError(f"pair codebooks have {', '.join(map(str, PAIR_POINTS))} points (got {n})")
    seed = PAIR_SEEDS[role]
    key = f"d{d}_n{n}_s{seed}"
    if _PAIR_ASSET.is_file():
        import json

        pts = json.loads(_PAIR_ASSET.read_text()).get(key)
        if pts is not None:
            return np.asarray(pts, np.float32).reshape(n, 2)
    return _pair_lloyd(n, d, seed)


@functools.lru_cache(maxsize=64)
def _gain(levels_bytes: bytes, shape: tuple[int, ...], d: int) -> float:
    levels = np.frombuffer(levels_bytes, np.float64).reshape(shape)
    rng = np.random.default_rng(0)
    u = rng.standard_normal((2048, d))
    z = u / np.linalg.norm(u, axis=1, keepdims=True) * math.sqrt(d)
    if levels.ndim == 1:  # scalar: the nearest level (thresholds at midpoints, as quantize_kv)
        z = z.ravel()
        zh = levels[np.searchsorted((levels[1:] + levels[:-1]) / 2, z, side="left")]
    else:  # pairs: the nearest point
        z = z.reshape(-1, 2)
        c2 = (levels**2).sum(1)
        zh = np.concatenate([levels[(c2 - 2 * z[s : s + 65536] @ levels.T).argmin(1)]
                             for s in range(0, len(z), 65536)])
    return float((z * z).sum() / (z * zh).sum())


def reconstruction_gain(levels: np.ndarray, d: int) -> float:
    """E|z|² / E<ẑ, z> for rotated coordinates z of uniform unit vectors in R^d (√d units) and their codebook
    reconstructions ẑ (levels [n] or pair points [n, 2]). A Lloyd codebook's reconstruction is shrunk: E<ẑ, z> = E|ẑ|²
    = (1 - D) E|z|² at distortion D, so this is 1 / (1 - D). Scaling the values' stored norms by it makes a weighted
    sum of many reconstructed values unbiased (attention's output), at a little more error per single vector."""
    lv = np.ascontiguousarray(np.asarray(levels, np.float64))
    return _gain(lv.tobytes(), lv.shape, int(d))


# ---------------------------------------------------------------------------------------------
# What a cache's packed rows decode with


@dataclass(frozen=True, eq=False)
class KVCodebook:
    """The codebook of one packed field of a K or V row, as the kernels take it (their `levels` and `bits`).

    kind "scalar": a field is one rotated coordinate, `table` the levels [2^field_bits] (a `Codebook`'s);
    kind "pair": a field is a pair of coordinates (z_2i, z_2i+1), `table` the points [n, 2], field_bits = log2 n.
    """

    kind: Literal["scalar", "pair"]
    table: mx.array  # float32, unit-variance units
    field_bits: int

    # one object per codebook, shared by every layer's cache (its table is never written)
    @classmethod
    @functools.lru_cache(maxsize=64)
    def scalar(cls, spec: str, bits: int, d: int) -> "KVCodebook":
        """The scalar codebook `spec` (get_codebook) at `bits` bits a coordinate."""
        return cls("scalar", mx.array(get_codebook(spec, bits, d).levels.astype(np.float32)), check_bits(bits))

    @classmethod
    @functools.lru_cache(maxsize=64)
    def pair(cls, points: int, d: int, role: str) -> "KVCodebook":
        """The `points`-point pair codebook of `role` ("keys" or "values") at head dim d (pair_codebook)."""
        return cls("pair", mx.array(pair_codebook(points, d, role)), points.bit_length() - 1)

    @property
    def coords_per_field(self) -> int:
        return 2 if self.kind == "pair" else 1

    @property
    def bits_per_coord(self) -> float:
        return self.field_bits / self.coords_per_field

    def row_words(self, d: int) -> int:
        """uint32 words of one packed row of d coordinates."""
        return (d // self.coords_per_field * self.field_bits + 31) // 32
