"""GPU kernels for compressed-space attention, one source for Metal and CUDA.

The kernel bodies in `metal/*.body` and the helpers in `metal/common.h` are written once; a small
prelude per backend (`metal/prelude_metal.h`, `metal/prelude_cuda.h`) maps thread ids, threadgroup
memory, barriers and SIMD/warp reductions. `render` glues prelude + helpers + body; the result is
compiled with `mx.fast.metal_kernel` on Apple GPUs or `mx.fast.cuda_kernel` on NVIDIA GPUs (once per
kernel; MLX caches the compiled module per template instantiation = shape class).

Pipeline (docs/FORMAT.md, "Compressed KV cache layout"), each stage callable on its own for
`rq profile`:
  rotate_queries   q~ = R q (WHT + SO(4)) per query head, with its kv head's R
  qk_dot           Kernel A: scores straight from packed keys, one decode per GQA group
  softmax          Kernel B: fp32, stable, masked
  value_accum      Kernel C: "word" (word-parallel) or "dim" (dimension-parallel) strategy
  rotate_inverse   Kernel D: o = R^T o~
and the v3 fused path: `attn_mma2` (rotation + A + online softmax + C over one context split
on the matrix units) then `attn_merge` (merge the splits + D). v4 (`attn_v4`: `variant="v4"` or
RQ_ATTN=v4, the default for IsoQuant rotations) does all of it in one launch: the last block of each
(batch, kv head) merges the splits and rotates back (docs/KERNEL_NOTES.md, "v4"); v5 (`attn_v5`, `variant="v5"` or
RQ_ATTN=v5, opt-in) keeps v4's contract with each warp streaming its own token steps ("v5").
`packed_attention` follows the contract of
`rq_core.attention.packed_attention` (queries already rotated; returns (o~, lse)).
"""

from __future__ import annotations

import functools
import math
import os
import re
import weakref
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx

from rq_core import env, kernel_cache

# metal/ at the repo root; an installed wheel carries it as rq_core/_metal (pyproject.toml).
_HERE = Path(__file__).resolve().parent
SRC_DIR = _HERE / "_metal" if (_HERE / "_metal" / "common.h").is_file() else _HERE.parent / "metal"
BACKENDS = ("metal", "cuda")
BODY_MARK = "//--- body ---"

# Kernel C: below this many tokens the word-parallel strategy, at or above it dimension-parallel.
# The paper used 512 on Apple GPUs. Measured on the H200 (docs/KERNEL_NOTES.md): word-parallel faster at
# 128-1024 and 4096 tokens, dimension-parallel at 64 and 2048, a tie at 8192, dimension-parallel 2x faster
# at 32K and 3.8x at 128K; single runs, launch costs dominate below 8K. Re-measure on other GPUs.
C_SWITCH = int(os.environ.get("RQ_C_SWITCH", "8192"))
# Fused path: aim for about this many (kv head, split) blocks so a big GPU is filled.
TARGET_BLOCKS = int(os.environ.get("RQ_TARGET_BLOCKS", "528"))
NTH = 128  # threads per block of the split/tile kernels
# Checks set this: every output is filled with NaN before its kernel runs, so an element a kernel
# forgot to write shows up (MLX would otherwise hand back whatever its allocator had there).
POISON = False
SMEM_LIMIT = {"metal": 32768, "cuda": 49152}
ROT_WHT, ROT_SO4, ROT_DENSE = 1, 2, 4
ROT_SIGN = 8  # rwht_so4: random signs before the WHT; mats [Hkv, 5D] (each head's SO(4) blocks, then its signs)
# v4: aim for about this many (kv head, split) blocks; the last block of each kv head merges all its
# splits, so fewer splits make a shorter tail (2 per SM on the H200's 132 SMs). RQ_V4_BLOCKS tunes it.
V4_BLOCKS = int(os.environ.get("RQ_V4_BLOCKS", "264"))
# v5: blocks of v5_nth(T) threads (each warp streams its own steps), about V5_BLOCKS blocks in all.
# Default: 256 threads, code rows through a 1-slot cp.async ring (STAGE 1, PF 1), pair decode (VDEC 2), one block
# an SM at every context (v5_blocks: 132 on the H200; docs/KERNEL_NOTES.md, "Session 11"). Shapes whose
# ring does not fit threadgroup memory (head_dim 256 at 3 bits) take STAGE 0 (rows through registers, PF 2).
# 384 threads x ~165 registers did not launch at head_dim 256; 512 threads with PF 1 did not launch at all.
V5_BLOCKS = int(os.environ.get("RQ_V5_BLOCKS", "0"))  # 0: one block an SM (v5_blocks)
# one block an SM at every context, its registers uncapped by the launch bound (V5_MINB): at 128K that beat two
# blocks an SM at 128 registers (H200, ncu kernel alone, 2026-11-30: 44.0 against 47.5 us at 132 blocks and ~46.7
# at 264); RQ_V5_BLOCKS=264 with RQ_V5_MINB=2 is the earlier default for contexts from 64K
V5_BLOCKS_DEFAULT = 132
V5_NTH = int(os.environ.get("RQ_V5_NTH", "0"))  # 0: by context (v5_nth)
# from this many packed tokens, 384 threads (12 warps, 168 registers, one ring slot) instead of 256: their loop is ~18%
# shorter but their warps' merge longer (H200, 2026-11-30, ncu kernel alone with the merge's first round summed in
# registers: 34.4 against 35.7 us at 128K, 17.7 against 16.7 at 32K; the crossover interpolated)
V5_NTH_LONG = 75_000


def v5_nth(T: int) -> int:
    """attn_v5's threads a block for T packed tokens: RQ_V5_NTH where set, else 384 from V5_NTH_LONG tokens on CUDA
    (where 12 warps fit: one ring slot), else 256."""
    if V5_NTH > 0:
        return V5_NTH
    return 384 if T >= V5_NTH_LONG and backend() == "cuda" else 256
V5_PF = int(os.environ.get("RQ_V5_PF", "2"))  # steps each warp's loads run ahead (register sets; STAGE 0)
V5_VDEC = int(os.environ.get("RQ_V5_VDEC", "2"))  # 2: pair table by byte offsets, 1: values by byte permutes, 0: table
# 0: code rows through registers; n > 0: an n-slot per-warp ring in threadgroup memory filled by cp.async
# (PF 1; correct on the H200 since its ring is 16-byte aligned, 2026-11-30). One slot (the copy for a warp's next
# step issued as it reads this one) beat two at every context on the H200 (2026-11-30, session 12, ncu kernel alone:
# 10.9 / 17.7 / 39.6 us against 11.0 / 18.6 / 42.1 at 4K / 32K / 128K)
V5_STAGE = int(os.environ.get("RQ_V5_STAGE", "1"))
# score accumulators per warp step: 2 splits the hi / lo halves of the query into two dependent chains
# (measured on the H200, 2026-11-30: no faster than 1, 68.9 against 69.2 us at 128K kernel-only); 4 also splits even
# and odd k-steps (chains of 4 matrix ops instead of 16; CPU executor only, not yet timed)
V5_SACC = int(os.environ.get("RQ_V5_SACC", "1"))
# the warps' merge at the end of a block: 0, four rounds into two slabs; 1 (default), a slab a warp and one barrier
# where the block's threadgroup memory holds them (H200, 2026-11-30: correct, 1.5 us faster at every context)
V5_MERGE = int(os.environ.get("RQ_V5_MERGE", "1"))
# diagnostics: attn_v5 variants under test, RQ_V5_DEFS="A,B" defines RQ_V5_A and RQ_V5_B in its source (the kernel's
# name carries them, so MLX caches each variant apart)
V5_DEFS = tuple(d for d in os.environ.get("RQ_V5_DEFS", "").split(",") if d)
# keys at their own width (kv.key_bits) through the GPU kernels (kv_append and attn_v5 with KBITS); on by default since
# the H200 run of 2026-11-30 (kernels_check's 4-bit-key cases, K4V3 needles through the cache). RQ_SPLIT_KERNELS=0:
# such a cache appends with MLX ops and attends by the reference path
SPLIT_KERNELS = os.environ.get("RQ_SPLIT_KERNELS", "1") == "1"


@dataclass(frozen=True)
class Spec:
    body: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    contiguous: bool = True  # False: the kernel reads views (shape/strides) as they are
    defines: str = ""  # preprocessor lines put before the body (one body, several kernels)


SPECS: dict[str, Spec] = {
    "attn_split": Spec("attn_split.body",
                       ("q", "mats", "levels", "k_codes", "k_norms", "v_codes", "v_norms", "prm", "fprm"),
                       ("o_part", "ml_part")),
    "attn_mma": Spec("attn_mma.body",
                     ("q", "mats", "consts", "k_codes", "k_norms", "v_codes", "v_norms"), ("o_part", "ml_part"),
                     contiguous=False),
    "attn_mma2": Spec("attn_mma2.body",
                      ("q", "mats", "consts", "k_codes", "k_norms", "v_codes", "v_norms"), ("o_part", "ml_part"),
                      contiguous=False),
    # v4: one launch; o_part / ml_part are scratch, counter a kernel-owned zeroed buffer (see _counter)
    "attn_v4": Spec("attn_v4.body",
                    ("q", "mats", "consts", "k_codes", "k_norms", "v_codes", "v_norms", "counter"),
                    ("out", "lse", "o_part", "ml_part"), contiguous=False),
    # v4 plus the cache's fp16 window (wk / wv: its newest tokens, read through strides), merged in-kernel
    "attn_v4w": Spec("attn_v4.body",
                     ("q", "mats", "consts", "k_codes", "k_norms", "v_codes", "v_norms", "counter", "wk", "wv"),
                     ("out", "lse", "o_part", "ml_part"), contiguous=False, defines="#define RQ_WINDOW 1\n"),
    # v5: v4's contract, warp-level streaming (docs/KERNEL_NOTES.md, "v5"); its scratch is one output
    # (v5_scratch_size: o_part, ml_part, then lse), each more output costing MLX host time a launch
    # tlen: any array of valid_len elements (its shape carries T: a view shared by every layer of a step,
    # where slicing k_norms to T was one more graph node a layer)
    "attn_v5": Spec("attn_v5.body",
                    ("q", "mats", "consts", "k_codes", "k_norms", "v_codes", "v_norms", "counter", "tlen"),
                    ("out", "scratch"), contiguous=False),
    # v5 plus the fp16 window as one more split (common.h, window_split)
    "attn_v5w": Spec("attn_v5.body",
                     ("q", "mats", "consts", "k_codes", "k_norms", "v_codes", "v_norms", "counter", "tlen", "wk", "wv"),
                     ("out", "scratch"), contiguous=False, defines="#define RQ_WINDOW 1\n"),
    "attn_combine": Spec("attn_combine.body", ("o_part", "ml_part", "mats"), ("out", "lse")),
    "attn_merge": Spec("attn_merge.body", ("o_part", "ml_part", "mats"), ("out", "lse")),
    "rotate_query": Spec("rotate.body", ("inp", "mats", "prm"), ("out",)),
    "rotate_inverse": Spec("rotate.body", ("inp", "mats", "prm"), ("out",)),
    "qk_dot": Spec("qk_dot.body", ("q_rot", "levels", "k_codes", "k_norms", "prm", "fprm"), ("scores",)),
    "softmax": Spec("softmax.body", ("scores", "prm"), ("probs",)),
    "value_dim": Spec("value_dim.body", ("probs", "levels", "v_codes", "v_norms", "prm"), ("part",)),
    "value_reduce": Spec("value_reduce.body", ("part", "prm"), ("out",)),
    "value_word": Spec("value_word.body", ("probs", "levels", "v_codes", "v_norms", "prm"), ("out",)),
    # quantize + pack new K and V rows in one launch (IsoQuantCache's append); keys/values read through strides
    "kv_append": Spec("kv_append.body", ("keys", "values", "mats", "consts"),
                      ("k_codes", "k_norms", "v_codes", "v_norms"), contiguous=False),
    # packed rows back to rotated-space vectors (a prompt chunk's attention over compressed tokens, kv.prefill_fp16)
    "kv_decode": Spec("kv_decode.body", ("codes", "norms", "levels", "prm"), ("out",)),
}


class KernelUnsupported(ValueError):
    """These shapes are outside what the kernels handle; callers fall back to the reference path."""


# ---------------------------------------------------------------------------------------------
# Rendering


@functools.lru_cache(maxsize=None)
def _read(name: str) -> str:
    return (SRC_DIR / name).read_text()


def prelude(backend: str) -> tuple[str, str]:
    """(header part, body-start part) of a backend's prelude."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}")
    head, body = _read(f"prelude_{backend}.h").split(BODY_MARK + "\n")
    return head, body


_IDENT = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_")
_OPS = frozenset("+-*/%<>=!&|^~?:.#")
_OBJECT_MACRO = re.compile(r"^([ \t]*#[ \t]*define[ \t]+\w+)[ \t]+(?=\S)", re.M)


@functools.lru_cache(maxsize=None)
def minify(src: str) -> str:
    """C++ / Metal source without comments, blank lines and the spaces no token needs.

    Why: MLX hashes a custom kernel's whole source on every launch (CustomKernel::eval_gpu on CUDA) and
    builds the string anew for every call: ~8 µs a launch at v5's 44 KB on one Xeon core. String and
    character literals (inline PTX) stay as written; lines stay lines (preprocessor structure, macro
    continuations); an object-like macro keeps the space after its name (C requires it; `#define A (x)` would
    otherwise become a function-like macro). A space stays only between two identifier
    characters or two operator characters (`a - -b`, `> >`). RQ_KERNEL_MINIFY=0 renders the source as
    written (compiler messages with its line numbers).
    """
    src = _OBJECT_MACRO.sub("\\1\x01", src)  # \x01: a space that must stay
    out: list[str] = []
    space = False
    i, n = 0, len(src)

    def emit(text: str) -> None:
        nonlocal space
        if space and out:
            a, b = out[-1][-1], text[0]
            if (a in _IDENT and b in _IDENT) or (a in _OPS and b in _OPS):
                out.append(" ")
        space = False
        out.append(text)

    while i < n:
        c = src[i]
        if c in "\"'":  # a literal, verbatim
            j = i + 1
            while j < n and src[j] != c:
                j += 2 if src[j] == "\\" else 1
            emit(src[i:j + 1])
            i = j + 1
        elif src.startswith("//", i):
            j = src.find("\n", i)
            i = n if j < 0 else j
        elif src.startswith("/*", i):
            j = src.find("*/", i + 2)
            i = n if j < 0 else j + 2
            space = True
        elif c == "\\" and src.startswith("\\\n", i):  # continuation: keep a separating space before it
            out.append(" \\\n")
            space = False
            i += 2
        elif c == "\n":
            if out and not out[-1].endswith("\n"):
                out.append("\n")
            elif out and out[-1].endswith("\\\n"):  # a blank line ends a continued macro
                out.append("\n")
            space = False
            i += 1
        elif c in " \t\r\f\v":
            space = True
            i += 1
        else:
            j = i + 1
            while j < n and src[j] not in " \t\r\f\v\n\"'\\/":
                j += 1
            emit(src[i:j])
            i = j
    text = "".join(out).replace("\x01", " ")
    return text if text.endswith("\n") else text + "\n"


def _minify_on() -> bool:
    return env.get("RQ_KERNEL_MINIFY", "1") != "0"


def render(name: str, backend: str) -> tuple[str, str]:
    """(header, source) of kernel `name` for `backend`, as passed to mx.fast.{metal,cuda}_kernel
    (minified unless RQ_KERNEL_MINIFY=0)."""
    head, start = prelude(backend)
    header = head + "\n" + _read("common.h")
    if not header.endswith("\n"):
        header += "\n"  # cuda_kernel glues the next line to a header without a final newline
    spec = SPECS[name]
    source = start + "\n" + spec.defines + _read(spec.body)
    if _minify_on():
        return minify(header), minify(source)
    return header, source


# ---------------------------------------------------------------------------------------------
# Backend detection and compilation


def backend() -> str | None:
    """'metal' or 'cuda' when MLX has that GPU backend and a device; None on CPU-only installs."""
    if env.get("RQ_KERNELS", "1") == "0":
        return None
    try:
        if mx.metal.is_available():
            return "metal"
    except Exception:
        pass
    cuda = getattr(mx, "cuda", None)
    try:
        if cuda is not None and cuda.is_available():
            return "cuda"
    except Exception:
        pass
    return None


def available() -> bool:
    """True when the GPU kernels can run here (and the default device is the GPU)."""
    return backend() is not None and mx.default_device() == mx.gpu


@functools.lru_cache(maxsize=None)
def _kernel(name: str, be: str):
    header, source = render(name, be)
    spec = SPECS[name]
    make = mx.fast.metal_kernel if be == "metal" else mx.fast.cuda_kernel
    return make(name=f"rq_{name}", input_names=list(spec.inputs), output_names=list(spec.outputs),
                source=source, header=header, ensure_row_contiguous=spec.contiguous)


def _launch(k, **kw):
    """k(**kw). On CUDA the first launch of each kernel class also leaves its compiled form in MLX's PTX
    cache for later processes (rq_core.kernel_cache; RQ_KERNEL_CACHE=0 turns it off)."""
    if not kernel_cache.enabled() or backend() != "cuda":
        return k(**kw)
    key = (id(k), tuple(kw.get("template") or ()), tuple((x.dtype, x.ndim) for x in kw["inputs"]),
           tuple(kw["output_dtypes"]))
    return kernel_cache.launch(k, key, **kw)


def _run(name: str, inputs: list, template: list, grid: tuple, threads: int, out_shapes: list,
         out_dtypes: list) -> list:
    be = backend()
    if be is None:
        raise KernelUnsupported("no GPU backend")
    k = _kernel(name, be)
    return _launch(k, inputs=inputs, template=template, grid=(grid[0] * threads, grid[1], 1),
             threadgroup=(threads, 1, 1), output_shapes=out_shapes, output_dtypes=out_dtypes,
             init_value=float("nan") if POISON else None)


# ---------------------------------------------------------------------------------------------
# Shape classes


def _check(D: int, bits: int, R: int) -> None:
    if D not in (64, 128, 256):
        raise KernelUnsupported(f"head_dim {D} (kernels cover 64, 128, 256)")
    if bits not in (2, 3, 4):
        raise KernelUnsupported(f"{bits}-bit codes (kernels cover 2, 3, 4)")
    if R < 1 or R * (D // 32) > 64:
        raise KernelUnsupported(f"{R} query rows per kv head at head_dim {D}")


def _tpt(D: int, bits: int, R: int, be: str, words: int | None = None, table: int | None = None) -> int:
    """Keys per thread in Kernel A / the split kernel: amortise query loads, fit registers and smem. words / table:
    a row's words and the table's floats where they are not D * bits / 32 and 2^bits (pair codebooks)."""
    W = D * bits // 32 if words is None else words
    table = 1 << bits if table is None else table
    for tpt in (4, 2, 1):
        if tpt * R > 32 or tpt * W > 48:
            continue
        tile = NTH * tpt
        smem = 4 * (2 * D * R + R * tile + tile * W + 1 + tile + table + 3 * R)
        if smem <= SMEM_LIMIT[be]:
            return tpt
    raise KernelUnsupported(f"threadgroup memory for R={R}, head_dim {D}")


def split_plan(T: int, n_groups: int, tile: int, target: int | None = None) -> tuple[int, int]:
    """(n_splits, split_len) for the fused path: about `target` (TARGET_BLOCKS) blocks, whole tiles per split."""
    tiles = -(-T // tile)
    target = TARGET_BLOCKS if target is None else target
    ns = max(1, min(tiles, -(-target // max(1, n_groups))))
    per = -(-tiles // ns)
    ch = per * tile
    return -(-T // ch), ch


MMA_TILE = 128  # tokens per tile of attn_mma
MMA_N = 8  # query rows per kv head an mma tile holds


def mma_ok(D: int, bits: int, R: int) -> bool:
    """Shapes the matrix-unit kernel covers: R ≤ 8 rows, and each thread's D/4 key codes whole words."""
    return R <= MMA_N and (D // 4) * bits % 32 == 0 and D in (64, 128, 256)


def _mma_smem(D: int, bits: int, R: int, staged: bool) -> int:
    """Threadgroup bytes of attn_mma (staged=False) / attn_mma2 (staged=True)."""
    W = D * bits // 32
    n = 4 * (2 * R * D + R * MMA_TILE + MMA_TILE + 3 * R) + 4 * (1 << (2 * bits))
    if staged:
        n += 4 * (MMA_TILE + 2 * MMA_TILE * W + 1)
    return n


_CONSTS: dict = {}


def _consts(levels: mx.array, scale: float, key_levels: mx.array | None = None) -> mx.array:
    """[levels..., scale(, the keys' own levels...)] on the device, built once per (codebook arrays, scale):
    no per-call host data."""
    key = (id(levels), float(scale), id(key_levels))
    hit = _CONSTS.get(key)
    if hit is None or hit[0] is not levels or hit[1] is not key_levels:
        parts = [levels.astype(mx.float32).reshape(-1), mx.array([scale], dtype=mx.float32)]
        if key_levels is not None:
            parts.append(key_levels.astype(mx.float32).reshape(-1))
        arr = mx.concatenate(parts)
        mx.eval(arr)
        if len(_CONSTS) > 64:
            _CONSTS.clear()
        hit = _CONSTS[key] = (levels, key_levels, arr)
    return hit[2]


_NO_MATS: list = []


def _mats(mats: mx.array | None) -> mx.array:
    if mats is None:  # the kernels never read it then; one evaluated placeholder, not an op per call
        if not _NO_MATS:
            _NO_MATS.append(mx.zeros((1,), mx.float32))
            mx.eval(_NO_MATS[0])
        return _NO_MATS[0]
    return mats.astype(mx.float32)


def _prm(T: int, Tcap: int, causal: bool, ns: int, ch: int, Hkv: int, offset: int) -> mx.array:
    return mx.array([T, Tcap, int(causal), ns, ch, Hkv, offset, 0], dtype=mx.int32)


# ---------------------------------------------------------------------------------------------
# Stages (each callable on its own: `rq profile` times them)


def rotate_queries(q: mx.array, mats: mx.array | None, n_kv_heads: int, *, rot: int = ROT_WHT | ROT_SO4,
                   inverse: bool = False) -> mx.array:
    """q [B, Hq, L, D] → R q (or Rᵀ q with inverse=True) in float32, per query head with its kv head's R."""
    B, Hq, L, D = q.shape
    R = (Hq // n_kv_heads) * L
    prm = _prm(0, 0, False, 0, 0, n_kv_heads, 0)
    (out,) = _run("rotate_inverse" if inverse else "rotate_query",
                  [q.astype(mx.float32), _mats(mats), prm],
                  [("D", D), ("R", R), ("ROT", rot), ("INV", int(inverse))], (B * Hq * L, 1), D,
                  [(B, Hq, L, D)], [mx.float32])
    return out


def rotate_inverse(o_rot: mx.array, mats: mx.array | None, n_kv_heads: int, *,
                   rot: int = ROT_WHT | ROT_SO4) -> mx.array:
    """Kernel D: o = Rᵀ õ (float32)."""
    return rotate_queries(o_rot, mats, n_kv_heads, rot=rot, inverse=True)


def _pair_shape(levels: mx.array, D: int, bits: int, R: int, W: int) -> int:
    """PAIR of the four kernels' templates: 1 for a pair codebook (levels [2^bits, 2]; rows of D / 2 fields of
    `bits` bits), 0 for a scalar one (rows of D `bits`-bit codes); checks the shape either way."""
    if levels.ndim == 2:
        _check(D, 3, R)  # the head dims and rows of the 3-bit codes
        if levels.shape != (1 << bits, 2) or W * 32 != D // 2 * bits:
            raise KernelUnsupported(f"pair codebook of {levels.shape[0]} points in rows of {W} words "
                                    f"({bits}-bit fields)")
        return 1
    _check(D, bits, R)
    if W * 32 != D * bits:
        raise KernelUnsupported(f"rows of {W} words for {bits}-bit codes at head dim {D}")
    return 0


def qk_dot(q_rot: mx.array, k_codes: mx.array, k_norms: mx.array, levels: mx.array, *, bits: int,
           scale: float, valid_len: int, offset: int = 0, causal: bool = False) -> mx.array:
    """Kernel A: scores [B, Hq, L, T] (float32, natural units; masked entries -1e30). levels [2^bits]: a scalar
    codebook; [2^bits, 2]: a pair codebook (one `bits`-bit field a pair of coordinates)."""
    B, Hq, L, D = q_rot.shape
    Hkv, Tcap = k_codes.shape[1], k_codes.shape[2]
    R = (Hq // Hkv) * L
    pair = _pair_shape(levels, D, bits, R, k_codes.shape[3])
    be = backend() or "cuda"
    tpt = _tpt(D, bits, R, be, k_codes.shape[3], 2 << bits) if pair else _tpt(D, bits, R, be)
    T = valid_len
    tiles = -(-T // (NTH * tpt))
    (s,) = _run("qk_dot",
                [q_rot.astype(mx.float32), levels.astype(mx.float32).reshape(-1), k_codes, k_norms,
                 _prm(T, Tcap, causal, 0, 0, Hkv, offset), mx.array([scale], dtype=mx.float32)],
                [("D", D), ("BITS", bits), ("R", R), ("LQ", L), ("TPT", tpt), ("NTH", NTH), ("PAIR", pair)],
                (B * Hkv, tiles), NTH, [(B, Hq, L, T)], [mx.float32])
    return s


def softmax(scores: mx.array) -> mx.array:
    """Kernel B: softmax over the last axis in float32 (entries ≤ -5e29 are masked)."""
    T = scores.shape[-1]
    rows = scores.size // T
    nth = 1024 if T >= 8192 else 256
    (p,) = _run("softmax", [scores, _prm(T, 0, False, 0, 0, 1, 0)], [("NTH", nth)], (rows, 1), nth,
                [scores.shape], [mx.float32])
    return p


def value_accum(probs: mx.array, v_codes: mx.array, v_norms: mx.array, levels: mx.array, *, bits: int,
                strategy: str = "auto") -> mx.array:
    """Kernel C: õ = Σ_j α_j m'_j levels[vidx_j] / √d → [B, Hq, L, D] float32 (rotated space); levels as
    qk_dot's."""
    B, Hq, L, T = probs.shape
    Hkv, Tcap, W = v_codes.shape[1], v_codes.shape[2], v_codes.shape[3]
    D = W * 32 // bits * (2 if levels.ndim == 2 else 1)
    R = (Hq // Hkv) * L
    pair = _pair_shape(levels, D, bits, R, W)
    if strategy == "auto":
        strategy = "word" if T < C_SWITCH else "dim"
    lv = levels.astype(mx.float32).reshape(-1)
    if strategy == "word":
        nc = D // 32
        if R * nc > 1024:
            raise KernelUnsupported("too many rows for the word-parallel strategy")
        nsl = 32
        while R * nc * nsl > 1024:
            nsl //= 2
        (o,) = _run("value_word", [probs, lv, v_codes, v_norms, _prm(T, Tcap, False, 0, 0, Hkv, 0)],
                    [("D", D), ("BITS", bits), ("R", R), ("NSL", nsl), ("PAIR", pair)], (B * Hkv, 1), R * nc * nsl,
                    [(B, Hq, L, D)], [mx.float32])
        return o
    if strategy != "dim":
        raise ValueError(f"unknown Kernel C strategy {strategy!r} (word, dim, auto)")
    tile = NTH
    ns, ch = split_plan(T, B * Hkv, tile)
    prm = _prm(T, Tcap, False, ns, ch, Hkv, 0)
    (part,) = _run("value_dim", [probs, lv, v_codes, v_norms, prm],
                   [("D", D), ("BITS", bits), ("R", R), ("NTH", NTH), ("TILE", tile), ("PAIR", pair)], (B * Hkv, ns),
                   NTH,
                   [(B * Hkv, ns, R, D)], [mx.float32])
    (o,) = _run("value_reduce", [part, prm], [("D", D), ("R", R)], (B * Hq * L, 1), D,
                [(B, Hq, L, D)], [mx.float32])
    return o


def attention_split(q: mx.array, mats: mx.array | None, k_codes: mx.array, k_norms: mx.array,
                    v_codes: mx.array, v_norms: mx.array, levels: mx.array, *, bits: int, scale: float,
                    valid_len: int, offset: int = 0, causal: bool = False,
                    rot: int = ROT_WHT | ROT_SO4, mma: bool | None = None,
                    variant: str | None = None) -> tuple[mx.array, mx.array]:
    """Fused path: (rotation) + A + online softmax + C per context split, then merge + D.

    q [B, Hq, L, D] un-rotated (rot selects which rotation the kernels apply; rot=0: q is already in
    the rotated space and the output stays there). k_codes/v_codes [B, Hkv, T_cap, W] and
    k_norms/v_norms [B, Hkv, T_cap] are whole cache buffers; only the first valid_len rows count.
    mma: use the matrix-unit kernel where the shapes allow (default; RQ_ATTN_MMA=0 turns it off).
    variant: "mma2" (matrix units, rows double-buffered through registers; the default), "mma"
    (matrix units, direct loads), "fp32" (CUDA-core fp32, any shape); env RQ_ATTN_VARIANT.
    Returns (out [B, Hq, L, D] float32, lse [B, Hq, L]).
    """
    B, Hq, L, D = q.shape
    Hkv = k_codes.shape[1]
    R = (Hq // Hkv) * L
    _check(D, bits, R)
    be = backend() or "cuda"
    T = valid_len
    m = _mats(mats)
    if mma is None:
        mma = os.environ.get("RQ_ATTN_MMA", "1") != "0"
    variant = variant or os.environ.get("RQ_ATTN_VARIANT", "mma2")
    if variant in ("v4", "v5"):  # one launch; out comes back in q's dtype (float32 for float32 queries)
        fn = attention_v4 if variant == "v4" else attention_v5
        return fn(q, mats, k_codes, k_norms, v_codes, v_norms, levels, bits=bits, scale=scale,
                  valid_len=valid_len, offset=offset, causal=causal, rot=rot)
    if rot & ROT_SIGN:  # the split kernels rotate without signs: rotate around them (rotate.body has them)
        out, lse = attention_split(rotate_queries(q, mats, Hkv, rot=rot), None, k_codes, k_norms, v_codes, v_norms,
                                   levels, bits=bits, scale=scale, valid_len=valid_len, offset=offset,
                                   causal=causal, rot=0, mma=mma, variant=variant)
        return rotate_inverse(out, mats, Hkv, rot=rot), lse
    if not mma:
        variant = "fp32"
    if variant == "mma2" and _mma_smem(D, bits, R, True) > SMEM_LIMIT[be]:
        variant = "mma"  # Metal's 32 KB of threadgroup memory: no room to stage the tile's rows
    if variant != "fp32" and mma_ok(D, bits, R) and (not causal or offset == T - L):
        ns, _ = split_plan(T, B * Hkv, MMA_TILE)
        qd = q if q.dtype in (mx.float16, mx.float32) else q.astype(mx.float32)
        o_part, ml_part = _run(
            "attn_mma2" if variant == "mma2" else "attn_mma",
            [mx.contiguous(qd), m, _consts(levels, scale), mx.contiguous(k_codes), k_norms[:, :, :T],
             mx.contiguous(v_codes), v_norms[:, :, :T]],
            [("TQ", qd.dtype), ("D", D), ("BITS", bits), ("R", R), ("LQ", L), ("HKV", Hkv), ("CAUSAL", int(causal)),
             ("ROT", rot), ("NTH", NTH), ("TILE", MMA_TILE)],
            (B * Hkv, ns), NTH, [(B * Hkv, ns, R, D), (B * Hkv, ns, R, 2)], [mx.float32, mx.float32])
    else:
        o_part, ml_part = _split_fp32(q, m, k_codes, k_norms, v_codes, v_norms, levels, bits=bits, scale=scale,
                                      T=T, offset=offset, causal=causal, rot=rot, be=be)
    if os.environ.get("RQ_MERGE", "v2") == "v1":
        return _run("attn_combine", [o_part, ml_part, m], [("D", D), ("R", R), ("ROT", rot), ("HKV", Hkv)],
                    (B * Hq * L, 1), D, [(B, Hq, L, D), (B, Hq, L)], [mx.float32, mx.float32])
    ntc = max(D, 256)
    maxs = max(64, 1 << (o_part.shape[1] - 1).bit_length())
    out, lse = _run("attn_merge", [o_part, ml_part, m],
                    [("D", D), ("R", R), ("ROT", rot), ("HKV", Hkv), ("NTC", ntc), ("MAXS", maxs)],
                    (B * Hq * L, 1), ntc, [(B, Hq, L, D), (B, Hq, L)], [mx.float32, mx.float32])
    return out, lse


# ---------------------------------------------------------------------------------------------
# v4: one launch per layer and decode step. NOT YET RUN ON A GPU (written without device time; checked:
# its syntax and renderings, a float64 emulation of its algorithm, and its CUDA source executed on the
# CPU by benchmarks/emulate_kernel.py; tests/test_kernels.py runs all three).

COUNTER_POOL = 1 << 14
_POOL: dict = {"arr": None, "pos": 0, "views": {}}


def _counter(n: int) -> mx.array:
    """A zeroed slot of n uint32 counters for one attn_v4 launch: a cached view into one persistent pool.

    The last block of each (batch, kv head) sets its counter back to 0, so the pool stays zeroed (no fill
    op per call; MLX's init_value would fill every output, the partials too, with extra launches).
    Successive launches take successive slots (a ring): MLX may run launches that share no output
    concurrently (branches of one CUDA graph, Metal's concurrent dispatch), so one shared slot would race.
    A slot comes back after COUNTER_POOL // n launches, far more than one graph holds.
    """
    if n > 1024:
        raise KernelUnsupported(f"{n} (batch, kv head) pairs in one v4 launch")
    if _POOL["arr"] is None:
        arr = mx.zeros((COUNTER_POOL,), mx.uint32)
        mx.eval(arr)
        _POOL["arr"] = arr
    pos = _POOL["pos"]
    if pos + n > COUNTER_POOL:
        pos = 0
    _POOL["pos"] = pos + n
    view = _POOL["views"].get((pos, n))
    if view is None:  # every slot of this size at once: one evaluation (a sync point) for the whole ring,
        # not one in each of the first COUNTER_POOL // n launches (it stalled queued decode steps)
        arr = _POOL["arr"]
        fresh = {(p, n): arr[p:p + n] for p in range(0, COUNTER_POOL - n + 1, n) if (p, n) not in _POOL["views"]}
        fresh.setdefault((pos, n), arr[pos:pos + n])
        mx.eval(list(fresh.values()))
        _POOL["views"].update(fresh)
        view = _POOL["views"][(pos, n)]
    return view


_TLEN: dict = {"buf": None, "views": {}}


def _length_view(T: int) -> mx.array:
    """A uint32 array of T elements whose shape tells attn_v5 the valid length: a view of one zeroed buffer,
    cached for the last few lengths, so every layer of a decode step shares one graph node."""
    hit = _TLEN["views"].get(T)
    if hit is None:
        buf = _TLEN["buf"]
        if buf is None or buf.shape[0] < T:
            buf = _TLEN["buf"] = mx.zeros((max(T, 1 << 16) if buf is None else max(T, 2 * buf.shape[0]),), mx.uint32)
            mx.eval(buf)
            _TLEN["views"].clear()
        if len(_TLEN["views"]) >= 8:
            _TLEN["views"].pop(next(iter(_TLEN["views"])))
        hit = _TLEN["views"][T] = buf[:T]
    return hit


def v4_plan(T: int, n_groups: int, blocks: int | None = None) -> int:
    """Split count of attn_v4: about `blocks` (default V4_BLOCKS) blocks in all, at most MMA_TILE splits
    (merge weights in smem)."""
    ns, _ = split_plan(T, n_groups, MMA_TILE, target=min(blocks or V4_BLOCKS, n_groups * MMA_TILE))
    return ns


def v4_ok(D: int, bits: int, R: int, be: str) -> bool:
    """Shapes attn_v4 covers: those of attn_mma2, with its staged tile in threadgroup memory."""
    return mma_ok(D, bits, R) and _mma_smem(D, bits, R, True) + 4 <= SMEM_LIMIT[be]


def _one_launch_args(name: str, q: mx.array, Hkv: int, rot: int, valid_len: int, offset: int,
                     causal: bool) -> tuple[int, bool, mx.array, int]:
    """Checks shared by the single-launch kernels: (T, causal, queries in a kernel dtype, B * Hkv)."""
    if rot not in (0, ROT_WHT, ROT_SO4, ROT_WHT | ROT_SO4, ROT_WHT | ROT_SO4 | ROT_SIGN, ROT_DENSE):
        raise ValueError(f"rot={rot}: the dense rotation does not combine with the WHT or SO(4) blocks")
    T, L = valid_len, q.shape[2]
    if causal and offset + 1 >= T:
        causal = False  # every query sees every valid key
    if causal and offset != T - L:
        raise KernelUnsupported(f"{name}: causal offset other than valid_len - L")
    qd = q if q.dtype in (mx.float16, mx.bfloat16, mx.float32) else q.astype(mx.float32)
    return T, causal, qd, q.shape[0] * Hkv


def attention_v4(q: mx.array, mats: mx.array | None, k_codes: mx.array, k_norms: mx.array, v_codes: mx.array,
                 v_norms: mx.array, levels: mx.array, *, bits: int, scale: float, valid_len: int, offset: int = 0,
                 causal: bool = False, rot: int = ROT_WHT | ROT_SO4,
                 window: tuple[mx.array, mx.array] | None = None) -> tuple[mx.array, mx.array]:
    """Single-launch attention (v4): rotation + A + online softmax + C + merge + D in one kernel.

    q [B, Hq, L, D] (any strides; float16, bfloat16 or float32, else cast to float32) un-rotated;
    rot: 0 (q already rotated, the output stays in the rotated space), ROT_WHT, ROT_SO4, both, or
    ROT_DENSE (mats [Hkv, D, D] with y = P u: TurboQuant). mats [Hkv, D/4, 4, 4] for ROT_SO4.
    k_codes / v_codes [B, Hkv, T_cap, W] and v_norms [B, Hkv, T_cap] are read through their strides (no
    copy op), so their last dims must be dense, as cache buffers and their slices along T are.
    window: (keys, values) [B, Hkv, NW, D], 1 <= NW <= MMA_TILE, the cache's fp16 segment after the packed
    tokens (any strides, last dim dense), attended exactly by one more block of the same launch (attn_v4w);
    the queries are its last L tokens, so the packed part is seen whole and `causal` masks the window.
    Returns (out [B, Hq, L, D] in q's dtype, lse [B, Hq, L] float32, natural log).
    """
    B, Hq, L, D = q.shape
    Hkv = k_codes.shape[1]
    R = (Hq // Hkv) * L
    _check(D, bits, R)
    be = backend() or "cuda"
    if not v4_ok(D, bits, R, be):
        raise KernelUnsupported(f"v4: R={R}, head_dim {D}, {bits}-bit codes")
    name, extra, tmpl = "attn_v4", [], []
    if window is not None:
        wk, wv = window
        nw = wk.shape[2]
        if not 1 <= nw <= MMA_TILE or nw < L or wk.dtype not in (mx.float16, mx.bfloat16, mx.float32):
            raise KernelUnsupported(f"v4 window of {nw} tokens ({wk.dtype}) for {L} queries")
        name, extra, tmpl = "attn_v4w", [wk, wv], [("WCAUSAL", int(causal and L > 1))]
        causal = False  # every packed token precedes every query
        offset = valid_len
    T, causal, qd, groups = _one_launch_args("v4", q, Hkv, rot, valid_len, offset, causal)
    if window is None:
        ns = v4_plan(T, groups)
    else:  # the window's split first, its blocks taken from the plan's target; the merge takes <= MMA_TILE
        ns = min(v4_plan(T, groups, max(groups, V4_BLOCKS - groups)), MMA_TILE - 1) + 1
    out, lse, _, _ = _run(
        name,
        [qd, _mats(mats), _consts(levels, scale), k_codes, k_norms[:, :, :T], v_codes, v_norms, _counter(groups)]
        + extra,
        [("TQ", qd.dtype), ("D", D), ("BITS", bits), ("R", R), ("LQ", L), ("HKV", Hkv), ("CAUSAL", int(causal)),
         ("ROT", rot), ("NTH", NTH), ("TILE", MMA_TILE)] + tmpl,
        (groups, ns), NTH, [(B, Hq, L, D), (B, Hq, L), (groups, ns, R, D), (groups, ns, R, 2)],
        [qd.dtype, mx.float32, mx.float32, mx.float32])
    return out, lse


V5_MAXNS = 128  # splits per (batch, kv head) attn_v5's last block merges (MAXNS in the body)


# CUDA: blocks of attn_v5 resident per SM that the compiler must allow for (register cap through
# __launch_bounds__); -1 (default): 1 from 256 threads (one block an SM: at 256 nvcc gives 186 registers, 254 to the
# window variant, and a shorter warp step than at 2, whose 128-register cap two blocks an SM need; 448 and 512 threads
# must fit 128), else none; 0: no bound. At 1 with up to 384 threads the partials' merge loads up to 33 splits in one
# round (NC33 in the body, v5_source_defines), which a 128-register cap could not hold.
V5_MINB = int(os.environ.get("RQ_V5_MINB", "-1"))


def _v5_minb(nth: int, minb: int | None) -> int:
    minb = V5_MINB if minb is None else minb
    return (1 if nth >= 256 else 0) if minb < 0 else minb


def v5_source_defines(nth: int, minb: int) -> tuple[str, ...]:
    """Defines attn_v5's CUDA source takes from its launch bound: RQ_V5_NC33 (one round of 33 partial loads in the
    merge) where one block of at most 384 threads an SM leaves the registers for it."""
    return ("RQ_V5_NC33",) if minb == 1 and nth <= 384 else ()


@functools.lru_cache(maxsize=None)
def _kernel_v5(be: str, nth: int, minb: int, window: bool = False, minified: bool = True, trace: bool = False):
    """attn_v5 compiled with an optional launch bound. MLX builds `header` + `__global__ void name(...)`,
    so on CUDA a header that redefines __global__ (as CUDA's host_defines.h spells it, with
    __launch_bounds__ added) bounds this kernel only; the name carries the bound (MLX caches modules by
    name and template)."""
    kname = "attn_v5w" if window else "attn_v5"
    header, source = render(kname, be)
    name = "rq_" + kname
    if be == "cuda" and minb > 0:
        header += f"#undef __global__\n#define __global__ __location__(global) __launch_bounds__({nth}, {minb})\n"
        name += f"_lb{minb}"
        source = "".join(f"#define {d} 1\n" for d in v5_source_defines(nth, minb)) + source
    spec = SPECS[kname]
    outputs = list(spec.outputs)
    if trace:  # diagnostics: phase timestamps a block (V5_TRACE_PHASES) in one more output
        source, name, outputs = "#define RQ_TRACE 1\n" + source, name + "_trace", outputs + ["trace"]
    for d in V5_DEFS:
        source, name = f"#define RQ_V5_{d} 1\n" + source, name + "_" + d.lower()
    make = mx.fast.metal_kernel if be == "metal" else mx.fast.cuda_kernel
    return make(name=name, input_names=list(spec.inputs), output_names=outputs, source=source,
                header=header, ensure_row_contiguous=False)


# attn_v5's trace (attention_v5(trace=True), CUDA): a block's thread 0 stamps these phase ends (device ns timer and SM
# cycles, uint32 pairs, 16 slots a block; slot 15's first word: the SM id). Slots 8-13 only in the last block of a head
V5_TRACE_PHASES = ("start", "table+q loaded", "q rotated", "q fragments", "warp 0 loop end", "all warps' loops end",
                   "partials written", "counted", "splits' weights", "numerators", "inverse rotation", "stored",
                   "warp 0's (m, l) in", "warp 0's weights", "warps' slabs merged")
# the stamps' order in a launch (14 falls inside the partials phase, 6; 12 and 13 inside the weights phase, 8)
V5_TRACE_ORDER = (0, 1, 2, 3, 4, 5, 14, 6, 7, 12, 13, 8, 9, 10, 11)
V5_TRACE_LAST = (8, 9, 10, 11, 12, 13)  # the stamps only the last block of a head writes


@functools.lru_cache(maxsize=None)
def cuda_sm_count() -> int | None:
    """Streaming multiprocessors of CUDA device 0, from the driver (MLX's device_info does not report them);
    None where the driver cannot be asked."""
    import ctypes

    try:
        cu = ctypes.CDLL("libcuda.so.1")
        dev, n = ctypes.c_int(), ctypes.c_int()
        if cu.cuInit(0) != 0 or cu.cuDeviceGet(ctypes.byref(dev), 0) != 0:
            return None
        # CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT = 16
        if cu.cuDeviceGetAttribute(ctypes.byref(n), 16, dev) != 0 or n.value <= 0:
            return None
        return n.value
    except (OSError, AttributeError):
        return None


def v5_blocks(T: int) -> int:
    """attn_v5's target block count (T: packed tokens; the same at every context now): RQ_V5_BLOCKS where set,
    else one block an SM on CUDA (the default launch bound allows one: a second wave would double the time), else
    V5_BLOCKS_DEFAULT (the H200's 132 SMs)."""
    if V5_BLOCKS > 0:
        return V5_BLOCKS
    if backend() == "cuda":
        return cuda_sm_count() or V5_BLOCKS_DEFAULT
    return V5_BLOCKS_DEFAULT


def v5_plan(T: int, n_groups: int, blocks: int | None = None) -> int:
    """Split count of attn_v5: at most `blocks` (v5_blocks(T)) blocks in all (rounded down: at one block an SM, a
    block past the target would run in a second wave), at least 128 tokens a split."""
    target = v5_blocks(T) if blocks is None else blocks
    return max(1, min(-(-T // 128), target // max(1, n_groups), V5_MAXNS))


def _v5_smem(D: int, bits: int, R: int, nth: int, be: str, stage: int = 0, vdec: int = 1,
             kbits: int | None = None, pair: tuple[int, int] | None = None) -> int:
    """Threadgroup bytes of attn_v5 (the body's arena: the (m, l) arrays, pool, the keys' own table where kbits
    differs, the pair table, the ring; then two words). vdec 2 on CUDA pads the pair table to the next 8 KB boundary of the
    shared window (above the block's 1 KB reserved), as the body's LUTPAD does."""
    kbits = bits if kbits is None else kbits
    step = 16 if be == "cuda" else 8
    nwarp = nth // 32
    np_ = pair[1] if pair else 1 << (2 * bits)
    luts = 32 if np_ * 32 * 4 <= 8192 else 1
    pool = 2 * R * D + R * V5_MAXNS
    nf = D // 2 if pair else D
    ring = nwarp * stage * step * (nf * bits // 32 + nf * kbits // 32) if stage > 0 else 4
    klut = pair[0] if pair else (1 << (2 * kbits)) if kbits != bits else 0
    small = 2 * nwarp * MMA_N + 2 * MMA_N  # the warps' (m, l) and the rows' (m, l), first in the arena
    pad = 0
    if vdec == 2 and luts == 32 and be == "cuda":
        pad = (8192 - (1024 + 4 * small + 4 * pool + 4 * klut) % 8192) % 8192
    return 4 * small + 4 * ring + 4 * pool + 4 * klut + 4 * np_ * luts + pad + 4 * 2


def v5_ok(D: int, bits: int, R: int, be: str, nth: int | None = None, stage: int | None = None,
          vdec: int = 1, kbits: int | None = None, pair: tuple[int, int] | None = None) -> bool:
    """Shapes attn_v5 covers: those of the matrix-unit kernels (keys and values each; pair codebooks: up to 8 rows at
    head dim 64, 128 or 256, their lane chunks funnel-shifted where they start mid-word), within the threadgroup
    memory limit."""
    nth = v5_nth(0) if nth is None else nth
    stage = V5_STAGE if stage is None else stage
    kb = bits if kbits is None else kbits
    shapes = (R <= MMA_N and D in (64, 128, 256)) if pair else mma_ok(D, bits, R) and mma_ok(D, kb, R)
    return (shapes and nth % 64 == 0 and stage >= 0
            and _v5_smem(D, bits, R, nth, be, stage, vdec, kb, pair) <= SMEM_LIMIT[be])


@functools.lru_cache(maxsize=256)
def _v5_config(D: int, bits: int, R: int, be: str, nth: int, stage: int | None, pf: int | None, default_stage: int,
               default_pf: int, vdec: int = 1, kbits: int | None = None,
               pair: tuple[int, int] | None = None) -> tuple[int, int, int, int]:
    """(threads, ring stages, load-ahead, decode) of attn_v5 for a shape class, checked once (a decode calls
    this for every layer of every step). Decode 2 falls back to 1 where its padded table does not fit."""
    if stage is None:  # the default ring where it fits, else rows through registers
        stage = default_stage if v5_ok(D, bits, R, be, nth, default_stage, kbits=kbits, pair=pair) else 0
    pf = 1 if stage > 0 else (default_pf if pf is None else pf)
    if not v5_ok(D, bits, R, be, nth, stage, kbits=kbits, pair=pair):
        raise KernelUnsupported(f"v5: R={R}, head_dim {D}, {bits}-bit codes ({kbits}-bit keys), {nth} threads, "
                                f"{stage} stages")
    if vdec == 2 and not v5_ok(D, bits, R, be, nth, stage, 2, kbits, pair):
        vdec = 1
    return nth, stage, pf, vdec


def attention_v5(q: mx.array, mats: mx.array | None, k_codes: mx.array, k_norms: mx.array, v_codes: mx.array,
                 v_norms: mx.array, levels: mx.array, *, bits: int, scale: float, valid_len: int, offset: int = 0,
                 causal: bool = False, rot: int = ROT_WHT | ROT_SO4, blocks: int | None = None,
                 nth: int | None = None, minb: int | None = None, pf: int | None = None,
                 vdec: int | None = None, stage: int | None = None,
                 window: tuple[mx.array, mx.array] | None = None, key_bits: int | None = None,
                 key_levels: mx.array | None = None, trace: bool = False,
                 want_lse: bool = True) -> tuple[mx.array, ...]:
    """Single-launch attention, v5: attention_v4's contract (arguments, outputs, counter pool), a kernel
    whose warps stream their own token steps (metal/attn_v5.body). blocks / nth / minb / pf / vdec / stage:
    the grid's target block count, threads per block, the launch bound, the load-ahead depth, the value
    decode and the copy ring (default v5_blocks(T), v5_nth(valid_len), V5_MINB, V5_PF, V5_VDEC, V5_STAGE; stage > 0
    forces pf = 1). Code rows must start 16-byte aligned (v4's uint4 loads need it too): buffers of more
    than 8 bytes do, and so does every row of them, since the shapes taken have rows of 4k words.
    window: the cache's fp16 segment after the packed tokens, as attention_v4's (attn_v5w: one more split).
    key_bits / key_levels: keys at their own width and codebook (kv.key_bits; k_codes rows of D * key_bits / 32
    words), else the values' `bits` and `levels`. trace: also return the phase stamps, uint32 [groups, ns, 16, 2]
    (V5_TRACE_PHASES; CUDA only). want_lse=False: lse comes back None (no slice of the scratch made: a graph node
    a layer that the caches do not read)."""
    be = backend()
    if be is None:
        raise KernelUnsupported("no GPU backend")
    L = q.shape[2]
    if window is not None:
        wk, wv = window
        nw = wk.shape[2]
        if not 1 <= nw <= MMA_TILE or nw < L or wk.dtype not in (mx.float16, mx.bfloat16, mx.float32):
            raise KernelUnsupported(f"v5 window of {nw} tokens ({wk.dtype}) for {L} queries")
    qd = q if q.dtype in (mx.float16, mx.bfloat16, mx.float32) else q.astype(mx.float32)
    # everything else follows from shapes, dtypes and settings: planned once per class (a decode step asks for every
    # layer, and the checks and plans took most of this function's ~20 us of host time a call)
    # the context enters the plan only through the thread count, the splits (ceil(T / 128), at most V5_MAXNS) and the
    # queries' offset relative to it, so a decode step (one more token each) finds the plan made for the step before
    plan = _v5_launch_plan(be, tuple(q.shape), qd.dtype, tuple(k_codes.shape), tuple(v_codes.shape),
                           tuple(levels.shape), None if key_levels is None else tuple(key_levels.shape), bits,
                           key_bits, scale, min(-(-valid_len // 128), V5_MAXNS),
                           0 if window is not None else offset - valid_len, causal, rot, blocks,
                           v5_nth(valid_len) if nth is None else nth, minb, pf, vdec, stage, window is not None, trace,
                           _v5_settings(be))
    nth, minb_eff, kb_own, groups, template, grid, out_shapes, out_dtypes = plan
    k = _kernel_v5(be, nth, minb_eff, window is not None, _minify_on(), trace)
    res = _launch(
        k, inputs=[qd, _mats(mats), _consts(levels, scale, key_levels if kb_own else None), k_codes, k_norms,
                v_codes, v_norms, _counter(groups), _length_view(valid_len)] + (list(window) if window else []),
        template=template, grid=grid, threadgroup=(nth, 1, 1), output_shapes=out_shapes, output_dtypes=out_dtypes,
        init_value=0 if trace else float("nan") if POISON else None)
    B, Hq = q.shape[0], q.shape[1]
    R = (Hq // k_codes.shape[1]) * L
    lse = res[1][-groups * R:].reshape(B, Hq, L) if want_lse else None
    return (res[0], lse, res[2]) if trace else (res[0], lse)


def _v5_settings(be: str) -> tuple:
    """The module settings and device facts attn_v5's launch plan reads (tests and diagnostics change some at run
    time)."""
    return (V5_SACC, V5_MERGE, V5_STAGE, V5_PF, V5_VDEC, V5_NTH, V5_NTH_LONG, V5_BLOCKS, V5_MAXNS, V5_MINB, MMA_TILE,
            V5_DEFS, SMEM_LIMIT[be], cuda_sm_count() if be == "cuda" else None)


@functools.lru_cache(maxsize=512)
def _v5_launch_plan(be: str, qshape: tuple, qdtype, kshape: tuple, vshape: tuple, lvshape: tuple,
                    klvshape: tuple | None, bits: int, key_bits: int | None, scale: float, tiles: int, off_rel: int,
                    causal: bool, rot: int, blocks: int | None, nth: int, minb: int | None, pf: int | None,
                    vdec: int | None, stage: int | None, window: bool, trace: bool, settings: tuple) -> tuple:
    """attention_v5's checks and launch arguments for one class of calls: (threads, launch bound, whether the keys
    have their own table, groups, template, grid, output shapes, output dtypes). Raises KernelUnsupported.
    tiles: ceil(valid_len / 128) capped at V5_MAXNS; off_rel: the queries' offset less valid_len (0 with a window)."""
    valid_len = 128 * tiles  # stands for the context: the same splits, and the same offset relative to it
    offset = valid_len + off_rel
    B, Hq, L, D = qshape
    Hkv = kshape[1]
    R = (Hq // Hkv) * L
    pair = None  # pair codebooks: (keys' points, values' points); bits / key_bits are their fields' widths
    if len(lvshape) == 2:
        if klvshape is None or len(klvshape) != 2 or lvshape[0] != 1 << bits \
                or key_bits is None or klvshape[0] != 1 << key_bits:
            raise KernelUnsupported("v5: pair codebooks need both tables, of 2^bits and 2^key_bits points")
        pair = (klvshape[0], lvshape[0])
        _check(D, 3, R)  # the shape checks of the 3-bit codes (head dim, rows)
        if not 16 <= pair[1] <= 64 or not 16 <= pair[0] <= 256:
            raise KernelUnsupported(f"v5: pair codebooks of {pair} points (values' table lane-replicated: <= 64)")
        if kshape[3] * 64 != D * key_bits or vshape[3] * 64 != D * bits:
            raise KernelUnsupported(f"v5: pair rows of {kshape[3]} / {vshape[3]} words")
        if (kshape[2] * kshape[3]) % 4 or (vshape[2] * vshape[3]) % 4:
            # rows of 14 / 10 words: a head's rows start 16-byte aligned (the copy ring's cp.async) only if the
            # capacity makes them (the cache's is a multiple of 256 tokens)
            raise KernelUnsupported(f"v5: pair codes of capacity {kshape[2]} leave heads unaligned")
        vdec = 2  # the values' lane-replicated table by byte offsets
    else:
        _check(D, bits, R)
    kb = bits if key_bits is None or klvshape is None else key_bits
    if kb != bits and pair is None:
        _check(D, kb, R)
        if kshape[3] * 32 != D * kb:
            raise KernelUnsupported(f"v5: key rows of {kshape[3]} words for {kb}-bit keys")
    nth, stage, pf, vdec = _v5_config(D, bits, R, be, nth, stage, pf, V5_STAGE, V5_PF, V5_VDEC if vdec is None else vdec,
                                      kb, pair)
    if pair is not None and vdec != 2:
        raise KernelUnsupported("v5: pair codebooks need the pair-table decode (its table did not fit)")
    wt = []
    if window:
        wt = [("WCAUSAL", int(causal and L > 1))]
        causal, offset = False, valid_len  # every packed token precedes every query
    T, causal, _, groups = _one_launch_args("v5", _Shaped(qshape, qdtype), Hkv, rot, valid_len, offset, causal)
    target = v5_blocks(T) if blocks is None else blocks
    if not window:
        ns = v5_plan(T, groups, target)
    else:  # the window's split first, its blocks taken from the target (so they add no wave: at 264 blocks, 2 waves
        # of one per SM on the H200, 4 more made a third, +35 us at 128K on 2026-11-30)
        ns = min(v5_plan(T, groups, max(groups, target - groups)), V5_MAXNS - 1) + 1
    template = [("TQ", qdtype), ("D", D), ("BITS", bits), ("KBITS", kb), ("PK", pair[0] if pair else 0),
                ("PV", pair[1] if pair else 0), ("R", R), ("LQ", L), ("HKV", Hkv),
                ("CAUSAL", int(causal)), ("ROT", rot), ("NTH", nth), ("SACC", V5_SACC), ("PF", pf),
                ("VDEC", vdec), ("STAGE", stage), ("MERGE", V5_MERGE)] + wt
    out_shapes = [(B, Hq, L, D), (v5_scratch_size(groups, ns, R, D),)] + [(groups, ns, 16, 2)] * trace
    out_dtypes = [qdtype, mx.float32] + [mx.uint32] * trace
    return (nth, _v5_minb(nth, minb), kb != bits or pair is not None, groups, template, (groups * nth, ns, 1),
            out_shapes, out_dtypes)


class _Shaped:
    """Stands in for the queries in _one_launch_args when only their shape and dtype are known."""

    def __init__(self, shape: tuple, dtype) -> None:
        self.shape, self.dtype = shape, dtype

    def astype(self, dtype) -> "_Shaped":
        return _Shaped(self.shape, dtype)


def v5_scratch_size(groups: int, ns: int, R: int, D: int) -> int:
    """Floats of attn_v5's scratch output: partials [groups, ns, MMA_N, D], (m, l) [groups, ns, R, 2], lse [groups, R]."""
    return groups * ns * MMA_N * D + groups * ns * R * 2 + groups * R


_ROT_ARGS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def rotation_args(rotation) -> tuple[int, mx.array | None]:
    """(ROT bits, matrices) for the kernels' in-kernel rotation of an rq_core.rotation.Rotation, cached."""
    hit = _ROT_ARGS.get(rotation)
    if hit is None:
        v = rotation.variant
        if v == "dense":
            hit = (ROT_DENSE, rotation.dense_matrices().astype(mx.float32))
        elif v == "wht":
            hit = (ROT_WHT, None)
        elif v == "rwht_so4":  # each head's SO(4) blocks, then its signs: [Hkv, 5D]
            H = rotation.n_heads
            hit = (ROT_WHT | ROT_SO4 | ROT_SIGN,
                   mx.concatenate([rotation.block_matrices().reshape(H, -1), rotation.sign_vectors()], axis=1)
                   .astype(mx.float32))
        else:
            hit = ((ROT_WHT if rotation.use_wht else 0) | ROT_SO4, rotation.block_matrices().astype(mx.float32))
        if hit[1] is not None:
            mx.eval(hit[1])
        _ROT_ARGS[rotation] = hit
    return hit


def attn_version() -> str:
    """Which GPU attention IsoQuantCache uses (env RQ_ATTN): "v5" (default: one launch, warp-level
    streaming; shapes it does not cover take v4), "v4" (one launch, block-level tiles), "v3" (MLX-op query
    rotation, v3 split kernel + merge, MLX-op inverse rotation) or "v3r" (the same two v3 kernels rotating
    in-kernel). Measurements behind the default: docs/KERNEL_NOTES.md."""
    v = env.get("RQ_ATTN", "v5")
    if v not in ("v3", "v3r", "v4", "v5"):
        from rq_core.errors import RQError

        raise RQError(f"RQ_ATTN={v!r} is not a kernel version (choose v3, v3r, v4 or v5)")
    return v


def fused_attend(queries: mx.array, rotation, k_codes: mx.array, k_norms: mx.array, v_codes: mx.array,
                 v_norms: mx.array, levels: mx.array, *, bits: int, scale: float, offset: int, causal: bool,
                 valid_len: int, window: tuple[mx.array, mx.array] | None = None, key_bits: int | None = None,
                 key_levels: mx.array | None = None) -> mx.array | None:
    """IsoQuantCache's whole attention over packed codes with the rotation done in-kernel, or None.
    Keys at their own width (key_bits, key_levels): v5 only (None elsewhere: the caller's reference path).

    RQ_ATTN=v5 (default) or v4: one launch. RQ_ATTN=v3r: attn_mma2 + attn_merge with ROT (2 launches; not for the
    dense rotation). None (the caller takes its usual path) for v3, without a GPU backend, or for
    shapes the kernels do not cover. The output is final, in the queries' dtype: an fp16 segment after
    the packed tokens is passed as `window` (v4 and v5: one more split of the launch; None from v3r).
    """
    version = attn_version()
    if version == "v3" or valid_len < 1 or not available() or (window is not None and version == "v3r"):
        return None
    pair = levels.ndim == 2  # pair codebooks (kv.pair_points): v5 only, else the caller's reference path
    if pair and (version != "v5" or key_levels is None or key_levels.ndim != 2 or not SPLIT_KERNELS):
        return None
    B, Hq, L, D = queries.shape
    Hkv = k_codes.shape[1]
    split = key_bits is not None and (key_bits != bits or pair)
    nf = D // 2 if pair else D
    if Hq % Hkv or k_codes.shape[3] * 32 != nf * (key_bits if split else bits) or v_codes.shape[3] * 32 != nf * bits:
        return None
    if split and (version != "v5" or key_levels is None or not SPLIT_KERNELS):
        return None
    try:
        rot, mats = rotation_args(rotation)
        args = dict(bits=bits, scale=scale, valid_len=valid_len, offset=offset, causal=causal, rot=rot)
        if version in ("v4", "v5"):
            if rot & ROT_DENSE and not env.has("RQ_ATTN"):
                return None  # TurboQuant: v3 + the rotation as matmuls measured faster than in-kernel dense
            if version == "v5":
                try:
                    return attention_v5(queries, mats, k_codes, k_norms, v_codes, v_norms, levels, window=window,
                                        key_bits=key_bits if split else None,
                                        key_levels=key_levels if split else None, want_lse=False, **args)[0]
                except KernelUnsupported:
                    if split:  # v4 takes one width
                        return None
                    # v4 covers more shapes (threadgroup memory)
            return attention_v4(queries, mats, k_codes, k_norms, v_codes, v_norms, levels, window=window,
                                **args)[0]
        R = (Hq // Hkv) * L
        if rot & (ROT_DENSE | ROT_SIGN) or not mma_ok(D, bits, R) or (causal and offset + 1 < valid_len
                                                        and offset != valid_len - L):
            return None
        out, _ = attention_split(queries, mats, k_codes, k_norms, v_codes, v_norms, levels, **args)
        return out.astype(queries.dtype)
    except KernelUnsupported:
        return None


def _split_fp32(q, m, k_codes, k_norms, v_codes, v_norms, levels, *, bits, scale, T, offset, causal, rot, be):
    """The fp32 CUDA-core split kernel (any R, head_dim 64-256): partials for attn_combine."""
    B, Hq, L, D = q.shape
    Hkv, Tcap = k_codes.shape[1], k_codes.shape[2]
    R = (Hq // Hkv) * L
    tpt = _tpt(D, bits, R, be)
    ns, ch = split_plan(T, B * Hkv, NTH * tpt)
    prm = _prm(T, Tcap, causal, ns, ch, Hkv, offset)
    o_part, ml_part = _run(
        "attn_split",
        [q.astype(mx.float32), m, levels.astype(mx.float32), k_codes, k_norms, v_codes, v_norms, prm,
         mx.array([scale], dtype=mx.float32)],
        [("D", D), ("BITS", bits), ("R", R), ("LQ", L), ("TPT", tpt), ("NTH", NTH), ("ROT", rot)],
        (B * Hkv, ns), NTH, [(B * Hkv, ns, R, D), (B * Hkv, ns, R, 2)], [mx.float32, mx.float32])
    return o_part, ml_part


def attention_four(q: mx.array, mats: mx.array | None, k_codes: mx.array, k_norms: mx.array,
                   v_codes: mx.array, v_norms: mx.array, levels: mx.array, *, bits: int, scale: float,
                   valid_len: int, offset: int = 0, causal: bool = False, rot: int = ROT_WHT | ROT_SO4,
                   strategy: str = "auto", key_bits: int | None = None,
                   key_levels: mx.array | None = None) -> mx.array:
    """The four-kernel pipeline (query rotation, A, B, C, D); returns out [B, Hq, L, D] float32. key_bits /
    key_levels: the keys' own width and codebook (kv.key_bits, or pair codebooks: both tables [n, 2])."""
    Hkv = k_codes.shape[1]
    kl, kb = (levels, bits) if key_levels is None else (key_levels, key_bits or bits)
    q_rot = rotate_queries(q, mats, Hkv, rot=rot) if rot else q.astype(mx.float32)
    s = qk_dot(q_rot, k_codes, k_norms, kl, bits=kb, scale=scale, valid_len=valid_len, offset=offset, causal=causal)
    p = softmax(s)
    o = value_accum(p, v_codes, v_norms, levels, bits=bits, strategy=strategy)
    return rotate_inverse(o, mats, Hkv, rot=rot) if rot else o


def packed_attention(q_rot: mx.array, k_codes: mx.array, k_norms: mx.array, v_codes: mx.array,
                     v_norms: mx.array, levels: mx.array, *, bits: int, scale: float, offset: int,
                     causal: bool, valid_len: int, path: str | None = None) -> tuple[mx.array, mx.array]:
    """GPU version of rq_core.attention.packed_attention (same contract, no extra mask): (õ, lse)."""
    path = path or os.environ.get("RQ_ATTN_PATH", "fused")
    if valid_len < 1:
        raise KernelUnsupported("empty context")
    if causal and offset + 1 >= valid_len:
        causal = False  # every query sees every valid key
    if causal and offset != valid_len - q_rot.shape[2]:
        raise KernelUnsupported("causal offset other than valid_len - L")
    if path == "fused":
        R = (q_rot.shape[1] // k_codes.shape[1]) * q_rot.shape[2]
        # the caller rotates (dense rotation or an fp16 segment to merge): v3 unless RQ_ATTN=v4 says so
        v4 = os.environ.get("RQ_ATTN") == "v4" and v4_ok(q_rot.shape[3], bits, R, backend() or "cuda")
        o, lse = attention_split(q_rot, None, k_codes, k_norms, v_codes, v_norms, levels, bits=bits, scale=scale,
                                 valid_len=valid_len, offset=offset, causal=causal, rot=0,
                                 variant="v4" if v4 else None)
        return (o if o.dtype == mx.float32 else o.astype(mx.float32)), lse
    s = qk_dot(q_rot, k_codes, k_norms, levels, bits=bits, scale=scale, valid_len=valid_len, offset=offset,
               causal=causal)
    lse = mx.logsumexp(s, axis=-1)
    lse = mx.where(lse < -1e29, -mx.inf, lse)
    o = value_accum(softmax(s), v_codes, v_norms, levels, bits=bits)
    return o, lse


def can_dispatch(q_rot: mx.array, k_codes: mx.array, bits: int, mask, *, offset: int = 0, causal: bool = False,
                 valid_len: int = 1) -> bool:
    """Whether rq_core.attention.packed_attention may hand these arguments to `packed_attention` here."""
    if mask is not None or valid_len < 1 or not available():
        return False
    B, Hq, L, D = q_rot.shape
    Hkv = k_codes.shape[1]
    if Hq % Hkv or k_codes.shape[3] * 32 != D * bits:
        return False
    if causal and offset + 1 < valid_len and offset != valid_len - L:
        return False  # a causal window the kernels do not express (they take offset = valid_len - L)
    try:
        _check(D, bits, (Hq // Hkv) * L)
        _tpt(D, bits, (Hq // Hkv) * L, backend() or "cuda")
    except KernelUnsupported:
        return False
    return True


# ---------------------------------------------------------------------------------------------
# kv_append: the compressed cache's append (quantize + pack K and V) in one launch

APPEND_DIMS = (32, 64, 128, 256, 512)
# With POISON the outputs start as 3e9 (codes 0xB2D05E00, norms inf): NaN has no uint32 value.
APPEND_POISON = 3.0e9
_APPEND_CONSTS: dict = {}


def append_mode() -> str:
    """How IsoQuantCache quantizes appended tokens on a GPU (env RQ_APPEND): "kernel" (default: one
    kv_append launch for K and V) or "ops" (quantize_kv's MLX ops, the reference). CPU always uses the ops."""
    v = env.get("RQ_APPEND", "kernel")
    if v not in ("kernel", "ops"):
        from rq_core.errors import RQError

        raise RQError(f"RQ_APPEND={v!r} is not an append path (choose kernel or ops)")
    return v


def _append_consts(levels: mx.array, d: int, key_levels: mx.array | None = None) -> mx.array:
    """[levels, thresholds, 1/sqrt(d), sqrt(d)(, key levels, key thresholds)] float32 on the device, once per
    (codebook arrays, d). The thresholds and both scalars are rounded exactly as quantize_kv /
    Rotation.forward round them."""
    key = (id(levels), d, id(key_levels))
    hit = _APPEND_CONSTS.get(key)
    if hit is None or hit[0] is not levels or hit[1] is not key_levels:
        parts = []
        for lvs in (levels,) if key_levels is None else (levels, key_levels):
            lv = lvs.astype(mx.float32)
            if lv.ndim == 2:  # pair codebook: the points, then |p|^2 as quantize_kv's nearest_pair computes it
                parts += [lv.reshape(-1), (lv**2).sum(-1)]
            else:
                parts += [lv, (lv[1:] + lv[:-1]) / 2]
            if len(parts) == 2:
                parts.append(mx.array([1.0 / math.sqrt(d), math.sqrt(d)], dtype=mx.float32))
        arr = mx.concatenate(parts)
        mx.eval(arr)
        if len(_APPEND_CONSTS) > 4096:  # one entry per cache layer's codebook array: keep every layer's
            _APPEND_CONSTS.clear()
        hit = _APPEND_CONSTS[key] = (levels, key_levels, arr)
    return hit[2]


def kv_append_codes(keys: mx.array, values: mx.array, rotation, levels: mx.array, bits: int, *,
                    norm_correction: bool = False, key_bits: int | None = None,
                    key_levels: mx.array | None = None) -> tuple[mx.array, mx.array, mx.array, mx.array]:
    """quantize_kv of keys and of values [B, Hkv, T, d] in ONE kernel launch (metal/kv_append.body).

    Returns (k_codes uint32 [B, Hkv, T, W], k_norms float16 [B, Hkv, T], v_codes, v_norms), equal to
    quantize_kv's except for coordinates within float32 rounding of a codebook boundary. keys/values may
    be any strided views (a slice of a cache buffer: no copy op). Every rotation variant is done in-kernel
    (WHT, SO(4) blocks, dense). key_bits / key_levels: keys at their own width and codebook (k_codes rows of
    ceil(D * key_bits / 32) words). Raises KernelUnsupported for shapes it does not cover.
    """
    pair = levels.ndim == 2  # pair codebooks (kv.pair_points): points [n, 2], `bits` = log2 n a field
    split = key_bits is not None and key_levels is not None and (key_bits != bits or pair)
    kb = key_bits if split else bits
    if keys.ndim != 4 or values.shape != keys.shape:
        raise KernelUnsupported(f"keys {tuple(keys.shape)} / values {tuple(values.shape)}")
    B, H, T, D = keys.shape
    if D not in APPEND_DIMS:
        raise KernelUnsupported(f"kv_append: head_dim {D}")
    if pair:
        if not split or key_levels.ndim != 2 or levels.shape != (1 << bits, 2) or key_levels.shape != (1 << kb, 2):
            raise KernelUnsupported(f"kv_append: pair codebooks {tuple(levels.shape)} / keys' "
                                    f"{None if key_levels is None else tuple(key_levels.shape)}")
    elif not 1 <= bits <= 4 or levels.size != 1 << bits or not 1 <= kb <= 4 or (split and key_levels.size != 1 << kb):
        raise KernelUnsupported(f"kv_append: {bits}-bit codes with {levels.size} levels ({kb}-bit keys)")
    if rotation.d != D or rotation.n_heads != H:
        raise KernelUnsupported(f"kv_append: rotation for d={rotation.d}, {rotation.n_heads} heads")
    rows = B * H * T
    if rows == 0 or rows * D >= 1 << 31:
        raise KernelUnsupported(f"kv_append: {rows} rows")
    be = backend()
    if be is None:
        raise KernelUnsupported("no GPU backend")
    if keys.dtype != values.dtype or keys.dtype not in (mx.float16, mx.bfloat16, mx.float32):
        keys, values = keys.astype(mx.float32), values.astype(mx.float32)
    rot, mats = rotation_args(rotation)
    nf = D // 2 if pair else D  # fields a row
    W = (nf * bits + 31) // 32
    KW = (nf * kb + 31) // 32
    k = _kernel("kv_append", be)
    return tuple(_launch(k, inputs=[keys, values, _mats(mats), _append_consts(levels, D, key_levels if split else None)],
                   template=[("TK", keys.dtype), ("D", D), ("BITS", bits), ("KBITS", kb), ("ROT", rot),
                             ("NC", int(norm_correction)), ("PK", 1 << kb if pair else 0),
                             ("PV", 1 << bits if pair else 0)],
                   grid=(rows * D, 2, 1), threadgroup=(D, 1, 1),
                   output_shapes=[(B, H, T, KW), (B, H, T), (B, H, T, W), (B, H, T)],
                   output_dtypes=[mx.uint32, mx.float16, mx.uint32, mx.float16],
                   init_value=APPEND_POISON if POISON else None))


def append_codes(keys: mx.array, values: mx.array, rotation, levels: mx.array, bits: int, *,
                 norm_correction: bool = False, key_bits: int | None = None,
                 key_levels: mx.array | None = None) -> tuple[mx.array, mx.array, mx.array, mx.array] | None:
    """IsoQuantCache's append on a GPU: kv_append_codes, or None (the caller runs quantize_kv) on CPU,
    with RQ_APPEND=ops, for shapes the kernel does not cover, or for keys at their own width with
    RQ_SPLIT_KERNELS=0."""
    if append_mode() == "ops" or not available():
        return None
    if key_bits is not None and key_bits != bits and not SPLIT_KERNELS:
        return None
    try:
        return kv_append_codes(keys, values, rotation, levels, bits, norm_correction=norm_correction,
                               key_bits=key_bits, key_levels=key_levels)
    except KernelUnsupported:
        return None


def decode_rows(codes: mx.array, norms: mx.array, levels: mx.array, *, bits: int, d: int, n: int,
                dtype: mx.Dtype, rows: int | None = None) -> mx.array | None:
    """Rows 0 .. n-1 of packed codes [B, H, Tcap, W] and norms [B, H, Tcap] as rotated-space vectors m · levels[c] / √d
    [B, H, rows, d] in `dtype` (rows ≥ n, default n; rows n .. are left for the caller to fill), one kv_decode launch
    (`rq_core.attention.dequantize_rotated` is the reference). levels [2^bits] (a scalar codebook) or [2^bits, 2]
    (pair codebook; `bits` a field of two coordinates). None on CPU or for shapes the kernel does not take: the
    caller decodes with MLX ops."""
    rows = n if rows is None else rows
    if not available() or n <= 0 or rows < n:
        return None
    B, H, Tcap, W = codes.shape
    pair = levels.ndim == 2
    nf = d // 2 if pair else d
    if d % 64 or W != (nf * bits + 31) // 32 or levels.shape[0] != 1 << bits or n > Tcap:
        return None
    nth = min(128, nf)
    (out,) = _run("kv_decode", [codes, norms, levels.astype(mx.float32).reshape(-1),
                                mx.array([n, Tcap, rows], dtype=mx.int32)],
                  [("D", d), ("FB", bits), ("PAIR", int(pair)), ("NTH", nth)], (B * H * n, 1), nth,
                  [(B, H, rows, d)], [dtype])
    return out


# ---------------------------------------------------------------------------------------------
# Whole translation units, as MLX builds them (for compile checks off the GPU and resource reports)

# input dtype per input name (everything else is float32); outputs are float32
INPUT_TYPES = {"k_codes": "u32", "v_codes": "u32", "k_norms": "f16", "v_norms": "f16", "prm": "i32", "counter": "u32",
               "tlen": "u32", "codes": "u32", "norms": "f16"}
_TYPE_NAMES = {"metal": {"f32": "float", "u32": "uint32_t", "f16": "float16_t", "i32": "int32_t", "bf16": "bfloat16_t"},
               "cuda": {"f32": "float", "u32": "uint32_t", "f16": "__half", "i32": "int32_t", "bf16": "__nv_bfloat16"}}
# Metal attributes MLX adds to the signature when the body names them (the prelude uses these three)
_METAL_ATTRS = (("thread_position_in_threadgroup", "uint3"), ("threadgroup_position_in_grid", "uint3"),
                ("threadgroups_per_grid", "uint3"),
                ("threads_per_threadgroup", "uint3"))


def full_source(name: str, be: str, template: list[tuple[str, object]],
                input_types: dict[str, str] | None = None, trace: bool = False) -> str:
    """The complete kernel source MLX would compile for `name` (MLX's own includes left to the caller).

    template: (name, int) pairs, or (name, "f16" | "bf16" | "f32") for a dtype; input_types overrides an
    input's or output's dtype code (e.g. {"q": "f16", "out": "f16"}; outputs default to float32).
    Shape/strides parameters are added where the body uses them. trace: attn_v5's traced rendering (RQ_TRACE and
    a uint32 output `trace`, as attention_v5(trace=True) compiles it).
    """
    header, source = render(name, be)
    spec = SPECS[name]
    outputs = list(spec.outputs)
    if trace:
        source, outputs = "#define RQ_TRACE 1\n" + source, outputs + ["trace"]
    if name.startswith("attn_v5"):
        source = "".join(f"#define RQ_V5_{d} 1\n" for d in V5_DEFS) + source
        input_types = dict(input_types or {}, trace="u32")
    types = _TYPE_NAMES[be]
    itypes = dict(INPUT_TYPES, **(input_types or {}))
    kname = f"custom_kernel_rq_{name}"
    args = []
    slot = 0
    for n in spec.inputs:
        t = types[itypes.get(n, "f32")]
        if be == "cuda":
            args.append(f"    const {t}* {n}")
            if f"{n}_shape" in source:
                args.append(f"    const __grid_constant__ Shape {n}_shape")
            if f"{n}_strides" in source:
                args.append(f"    const __grid_constant__ Strides {n}_strides")
        else:
            args.append(f"  const device {t}* {n} [[buffer({slot})]]")
            slot += 1
            if f"{n}_shape" in source:
                args.append(f"  const constant int* {n}_shape [[buffer({slot})]]")
                slot += 1
            if f"{n}_strides" in source:
                args.append(f"  const constant int64_t* {n}_strides [[buffer({slot})]]")
                slot += 1
    if be == "cuda":
        args += [f"    {types[itypes.get(n, 'f32')]}* {n}" for n in outputs]
        consts = "".join(f"  using {k} = {types[v]};\n" if isinstance(v, str) else f"  constexpr int {k} = {v};\n"
                         for k, v in template)
        return (header + "namespace mlx::core::cu {\n\n__global__ void " + kname + "(\n" + ",\n".join(args)
                + ") {\n" + consts + source + "\n}\n\n} // namespace mlx::core::cu\n")
    for n in outputs:
        args.append(f"  device {types[itypes.get(n, 'f32')]}* {n} [[buffer({slot})]]")
        slot += 1
    args += [f"  {t} {a} [[{a}]]" for a, t in _METAL_ATTRS if a in source]
    tparams = ", ".join(f"typename {k}" if isinstance(v, str) else f"int {k}" for k, v in template)
    targs = ", ".join(types[v] if isinstance(v, str) else str(v) for k, v in template)
    sig = ",\n".join(args)
    return (header + f"template <{tparams}>\n[[kernel]] void {kname}(\n{sig}) {{\n{source}\n}}\n\n"
            + f"template [[kernel]] void {kname}<{targs}>(\n"
            + ",\n".join(a.split(" [[")[0] for a in args) + ");\n")
