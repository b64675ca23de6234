"""GPU kernels for compressed-space attention, one source for Metal and CUDA (docs/KERNELS.md).

The kernel bodies in `metal/*.body` and the helpers in `metal/common.h` are written once; a small
prelude per backend (`metal/prelude_metal.h`, `metal/prelude_cuda.h`) maps thread ids, threadgroup
memory, barriers and SIMD/warp reductions. `render` glues prelude + helpers + body; the result is
compiled with `mx.fast.metal_kernel` on Apple GPUs or `mx.fast.cuda_kernel` on NVIDIA GPUs (once per
kernel; MLX caches the compiled module per template instantiation = shape class).

  fused_attention  attn_fused: a layer's whole decode attention over packed codes in one launch (query rotation,
                   scores, online softmax, values, the merge of the context splits, inverse rotation), the cache's
                   fp16 window included as one more split (attn_fused_window). The default path.
  kv_append_codes  kv_append: quantize + pack new K and V rows in one launch (the cache's append).
  decode_rows      kv_decode: packed rows back to rotated-space vectors (a long prompt's chunk over compressed tokens).
  the four-kernel pipeline `rq profile` times stage by stage:
    rotate_queries   q~ = R q per query head, with its kv head's R
    qk_dot           scores straight from packed keys, one decode per GQA group
    softmax          fp32, stable, masked
    value_accum      "word" (word-parallel) or "dim" (dimension-parallel) strategy
    rotate_inverse   o = R^T o~
Which one a cache's attention takes is decided in one place: rq_core.attention.dispatch.
"""

from __future__ import annotations

import functools
import math
import re
import weakref
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx

from rq_core.kernels import config as env
from rq_core.kernels import cache as kernel_cache

# metal/ at the repo root; an installed wheel carries it as rq_core/_metal (pyproject.toml).
_HERE = Path(__file__).resolve().parents[1]  # rq_core/
SRC_DIR = _HERE / "_metal" if (_HERE / "_metal" / "common.h").is_file() else _HERE.parent / "metal"
BACKENDS = ("metal", "cuda")
BODY_MARK = "//--- body ---"

# value_accum: below this many tokens the word-parallel strategy, at or above it dimension-parallel. Measured on the
# H200: word-parallel faster up to ~8K tokens, dimension-parallel 2x faster at 32K and 3.8x at 128K.
C_SWITCH = 8192
# value_accum's dimension-parallel strategy: aim for about this many (kv head, split) blocks so a big GPU is filled.
TARGET_BLOCKS = 528
THREADS = 128  # threads per block of qk_dot and value_accum's dimension-parallel kernel
SMEM_LIMIT = {"metal": 32768, "cuda": 49152}
ROT_WHT, ROT_SO4, ROT_DENSE = 1, 2, 4
ROT_SIGN = 8  # rwht_so4: random signs before the WHT; mats [Hkv, 5D] (each head's SO(4) blocks, then its signs)
MMA_TILE = 128  # tokens a split's matrix-unit steps are planned in; also the most fp16 window tokens a launch takes
MMA_ROWS = 8  # query rows per kv head one matrix-unit fragment holds

# attn_fused's launch: blocks of fused_threads(T) threads (each warp streams its own token steps), about one block an
# SM (a block past that would run in a second wave). Code rows go through a one-slot cp.async ring (STAGE 1, PF 1)
# where it fits threadgroup memory, else through registers (STAGE 0, PF 2: head_dim 256 at 3 bits); values and
# pair codebooks through the pair table by byte offsets (VDEC 2) where its padded table fits, else byte permutes.
FUSED_BLOCKS_DEFAULT = 132  # the H200's SMs, where the driver cannot be asked
FUSED_THREADS_LONG = 75_000  # from this many packed tokens, 384 threads on CUDA (a shorter loop, a longer merge)
FUSED_PF = 2  # steps each warp's loads run ahead (register sets; STAGE 0)
FUSED_VDEC = 2  # 2: pair table by byte offsets, 1: values by byte permutes
FUSED_STAGE = 1  # slots of each warp's copy ring (0: code rows through registers)
FUSED_SACC = 1  # score accumulators per warp step
FUSED_MERGE = 1  # the warps' merge: a slab a warp and one barrier where the arena holds them
MAX_SPLITS = 128  # splits per (batch, kv head) the last block merges (MAXNS in the body)


def fused_threads(T: int) -> int:
    """attn_fused's threads a block for T packed tokens: 384 from FUSED_THREADS_LONG tokens on CUDA (where 12 warps
    fit: one ring slot), else 256."""
    return 384 if T >= FUSED_THREADS_LONG and backend() == "cuda" else 256


@dataclass(frozen=True)
class Spec:
    body: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    contiguous: bool = True  # False: the kernel reads views (shape/strides) as they are
    small: tuple[str, ...] = ()  # inputs of fewer than METAL_CONSTANT_BELOW elements at every launch (constant on Metal)
    defines: str = ""  # preprocessor lines put before the body (one body, several kernels)


SPECS: dict[str, Spec] = {
    # one launch; its scratch is one output (fused_scratch_size: o_part, ml_part, then lse), each more output costing
    # MLX host time a launch. counter: a kernel-owned zeroed buffer (_counter). meta: int32 [valid_len, the window's
    # first row << 8 | its rows] (fused_meta: one array a step, shared by every layer; lengths as values, not shapes, so
    # a step makes no view and a launch's arguments keep their shapes from step to step)
    "attn_fused": Spec("attn_fused.body",
                       ("q", "mats", "consts", "k_codes", "k_norms", "v_codes", "v_norms", "counter", "meta"),
                       ("out", "scratch"), contiguous=False, small=("meta",)),
    # plus the cache's fp16 window (wk / wv: its whole buffers, the rows meta names read through strides) as one more
    # split
    "attn_fused_window": Spec("attn_fused.body",
                              ("q", "mats", "consts", "k_codes", "k_norms", "v_codes", "v_norms", "counter", "meta",
                               "wk", "wv"),
                              ("out", "scratch"), contiguous=False, small=("meta",),
                              defines="#define RQ_WINDOW 1\n"),
    "rotate_query": Spec("rotate.body", ("inp", "mats", "iparams"), ("out",)),
    "rotate_inverse": Spec("rotate.body", ("inp", "mats", "iparams"), ("out",)),
    "qk_dot": Spec("qk_dot.body", ("q_rot", "levels", "k_codes", "k_norms", "iparams", "fparams"), ("scores",)),
    "softmax": Spec("softmax.body", ("scores", "iparams"), ("probs",)),
    "value_dim": Spec("value_dim.body", ("probs", "levels", "v_codes", "v_norms", "iparams"), ("part",)),
    "value_reduce": Spec("value_reduce.body", ("part", "iparams"), ("out",)),
    "value_word": Spec("value_word.body", ("probs", "levels", "v_codes", "v_norms", "iparams"), ("out",)),
    # quantize + pack new K and V rows in one launch (IsoQuantCache's append); keys/values read through strides
    "kv_append": Spec("kv_append.body", ("keys", "values", "mats", "consts"),
                      ("k_codes", "k_norms", "v_codes", "v_norms"), contiguous=False),
    # packed rows back to rotated-space vectors (a prompt chunk's attention over compressed tokens, kv.prefill_fp16)
    "kv_decode": Spec("kv_decode.body", ("codes", "norms", "levels", "iparams"), ("out",)),
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
    builds the string anew for every call: ~8 µs a launch at attn_fused's 44 KB on one Xeon core. String and
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


def render(name: str, backend: str) -> tuple[str, str]:
    """(header, source) of kernel `name` for `backend`, as passed to mx.fast.{metal,cuda}_kernel
    (minified unless RQ_KERNEL_MINIFY=0)."""
    head, start = prelude(backend)
    header = head + "\n" + _read("common.h")
    if not header.endswith("\n"):
        header += "\n"  # cuda_kernel glues the next line to a header without a final newline
    spec = SPECS[name]
    source = start + "\n" + spec.defines + _read(spec.body)
    if env.config().minify:
        return minify(header), minify(source)
    return header, source


# ---------------------------------------------------------------------------------------------
# Backend detection and compilation


_BACKEND: list = [None, None]  # [the settings it was found under, the backend]: a decode step asks in every layer


def backend() -> str | None:
    """'metal' or 'cuda' when MLX has that GPU backend and a device; None on CPU-only installs or with
    RQ_KERNELS=0. Asked of MLX once per settings object (env.set_config / override ask again)."""
    cfg = env.config()
    if _BACKEND[0] is not cfg:
        _BACKEND[:] = [cfg, _find_backend(cfg)]
    return _BACKEND[1]


def _find_backend(cfg: env.KernelConfig) -> str | None:
    if not cfg.kernels:
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
    cache for later processes (rq_core.kernels.cache; RQ_KERNEL_CACHE=0 turns it off)."""
    if not env.config().disk_cache or backend() != "cuda":
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
                   init_value=float("nan") if env.config().poison else None)


# ---------------------------------------------------------------------------------------------
# Shape classes


def _check(D: int, bits: int, R: int) -> None:
    if D not in (64, 128, 256):
        raise KernelUnsupported(f"head_dim {D} (kernels cover 64, 128, 256)")
    if bits not in (2, 3, 4):
        raise KernelUnsupported(f"{bits}-bit codes (kernels cover 2, 3, 4)")
    if R < 1 or R * (D // 32) > 64:
        raise KernelUnsupported(f"{R} query rows per kv head at head_dim {D}")


def _keys_per_thread(D: int, bits: int, R: int, be: str, words: int | None = None, table: int | None = None) -> int:
    """Keys per thread of qk_dot: amortise query loads, fit registers and smem. words / table:
    a row's words and the table's floats where they are not D * bits / 32 and 2^bits (pair codebooks)."""
    W = D * bits // 32 if words is None else words
    table = 1 << bits if table is None else table
    for tpt in (4, 2, 1):
        if tpt * R > 32 or tpt * W > 48:
            continue
        tile = THREADS * tpt
        smem = 4 * (2 * D * R + R * tile + tile * W + 1 + tile + table + 3 * R)
        if smem <= SMEM_LIMIT[be]:
            return tpt
    raise KernelUnsupported(f"threadgroup memory for R={R}, head_dim {D}")


def split_plan(T: int, n_groups: int, tile: int, target: int | None = None) -> tuple[int, int]:
    """(n_splits, split_len) of value_accum's dimension-parallel kernel: about `target` (TARGET_BLOCKS) blocks, whole tiles per split."""
    tiles = -(-T // tile)
    target = TARGET_BLOCKS if target is None else target
    ns = max(1, min(tiles, -(-target // max(1, n_groups))))
    per = -(-tiles // ns)
    ch = per * tile
    return -(-T // ch), ch


def row_blocks(heads: int, L: int) -> int:
    """attn_fused's row blocks a kv head (NRG): the fewest that split its `heads` query heads of L rows each into
    blocks of whole heads, at most MMA_ROWS rows a block (one matrix-unit fragment); 0 where none does (L > MMA_ROWS)."""
    for n in range(1, heads + 1):
        if heads % n == 0 and heads // n * L <= MMA_ROWS:
            return n
    return 0


FUSED_DIMS = (64, 128, 256, 512)  # attn_fused's head dims


def mma_ok(D: int, bits: int, R: int) -> bool:
    """Shapes the matrix-unit steps cover: R ≤ 8 rows, and each thread's D/4 key codes whole words."""
    return R <= MMA_ROWS and (D // 4) * bits % 32 == 0 and D in FUSED_DIMS


def fused_vhalves(D: int) -> int:
    """attn_fused's blocks a (batch, kv head, row block) group and split (the body's VH): 2 at head dim 512, each
    accumulating half of the value dims (scores computed by both), else 1."""
    return 2 if D > 256 else 1


def _fused_check(D: int, bits: int, R: int) -> None:
    if D not in FUSED_DIMS:
        raise KernelUnsupported(f"head_dim {D} (attn_fused covers {', '.join(map(str, FUSED_DIMS))})")
    if bits not in (2, 3, 4):
        raise KernelUnsupported(f"{bits}-bit codes (kernels cover 2, 3, 4)")
    if not 1 <= R <= MMA_ROWS:
        raise KernelUnsupported(f"{R} query rows per kv head at head_dim {D}")


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


# MLX's Metal kernels take an input of fewer than this many elements in constant memory (`const constant T*`), which a
# kernel can neither write (attn_fused's counters are atomics) nor pass where a device pointer is expected: the
# counters' slots and the rotation's placeholder are never smaller
METAL_CONSTANT_BELOW = 8
_NO_MATS: list = []


def _mats(mats: mx.array | None) -> mx.array:
    if mats is None:  # the kernels never read it then; one evaluated placeholder, not an op per call
        if not _NO_MATS:
            _NO_MATS.append(mx.zeros((METAL_CONSTANT_BELOW,), mx.float32))
            mx.eval(_NO_MATS[0])
        return _NO_MATS[0]
    return mats.astype(mx.float32)


def _params(T: int, Tcap: int, causal: bool, ns: int, ch: int, Hkv: int, offset: int) -> mx.array:
    """The pipeline kernels' integer parameters (iparams in their bodies)."""
    return mx.array([T, Tcap, int(causal), ns, ch, Hkv, offset, 0], dtype=mx.int32)


# ---------------------------------------------------------------------------------------------
# The four-kernel pipeline (each stage callable on its own: `rq profile` times them)


def rotate_queries(q: mx.array, mats: mx.array | None, n_kv_heads: int, *, rot: int = ROT_WHT | ROT_SO4,
                   inverse: bool = False) -> mx.array:
    """q [B, Hq, L, D] → R q (or Rᵀ q with inverse=True) in float32, per query head with its kv head's R."""
    B, Hq, L, D = q.shape
    R = (Hq // n_kv_heads) * L
    prm = _params(0, 0, False, 0, 0, n_kv_heads, 0)
    (out,) = _run("rotate_inverse" if inverse else "rotate_query",
                  [q.astype(mx.float32), _mats(mats), prm],
                  [("D", D), ("R", R), ("ROT", rot), ("INV", int(inverse))], (B * Hq * L, 1), D,
                  [(B, Hq, L, D)], [mx.float32])
    return out


def rotate_inverse(o_rot: mx.array, mats: mx.array | None, n_kv_heads: int, *,
                   rot: int = ROT_WHT | ROT_SO4) -> mx.array:
    """o = Rᵀ õ (float32)."""
    return rotate_queries(o_rot, mats, n_kv_heads, rot=rot, inverse=True)


def _pair_shape(levels: mx.array, D: int, bits: int, R: int, W: int) -> int:
    """PAIR of the pipeline kernels' templates: 1 for a pair codebook (levels [2^bits, 2]; rows of D / 2 fields of
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
    """Scores [B, Hq, L, T] (float32, natural units; masked entries -1e30). levels [2^bits]: a scalar
    codebook; [2^bits, 2]: a pair codebook (one `bits`-bit field a pair of coordinates)."""
    B, Hq, L, D = q_rot.shape
    Hkv, Tcap = k_codes.shape[1], k_codes.shape[2]
    R = (Hq // Hkv) * L
    pair = _pair_shape(levels, D, bits, R, k_codes.shape[3])
    be = backend() or "cuda"
    tpt = _keys_per_thread(D, bits, R, be, k_codes.shape[3], 2 << bits) if pair else _keys_per_thread(D, bits, R, be)
    T = valid_len
    tiles = -(-T // (THREADS * tpt))
    (s,) = _run("qk_dot",
                [q_rot.astype(mx.float32), levels.astype(mx.float32).reshape(-1), k_codes, k_norms,
                 _params(T, Tcap, causal, 0, 0, Hkv, offset), mx.array([scale], dtype=mx.float32)],
                [("D", D), ("BITS", bits), ("R", R), ("LQ", L), ("TPT", tpt), ("THREADS", THREADS), ("PAIR", pair)],
                (B * Hkv, tiles), THREADS, [(B, Hq, L, T)], [mx.float32])
    return s


def softmax(scores: mx.array) -> mx.array:
    """Softmax over the last axis in float32 (entries ≤ -5e29 are masked)."""
    T = scores.shape[-1]
    rows = scores.size // T
    nth = 1024 if T >= 8192 else 256
    (p,) = _run("softmax", [scores, _params(T, 0, False, 0, 0, 1, 0)], [("THREADS", nth)], (rows, 1), nth,
                [scores.shape], [mx.float32])
    return p


def value_accum(probs: mx.array, v_codes: mx.array, v_norms: mx.array, levels: mx.array, *, bits: int,
                strategy: str = "auto") -> mx.array:
    """Values: õ = Σ_j α_j m'_j levels[vidx_j] / √d → [B, Hq, L, D] float32 (rotated space); levels as
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
        (o,) = _run("value_word", [probs, lv, v_codes, v_norms, _params(T, Tcap, False, 0, 0, Hkv, 0)],
                    [("D", D), ("BITS", bits), ("R", R), ("NSL", nsl), ("PAIR", pair)], (B * Hkv, 1), R * nc * nsl,
                    [(B, Hq, L, D)], [mx.float32])
        return o
    if strategy != "dim":
        raise ValueError(f"unknown Kernel C strategy {strategy!r} (word, dim, auto)")
    tile = THREADS
    ns, ch = split_plan(T, B * Hkv, tile)
    prm = _params(T, Tcap, False, ns, ch, Hkv, 0)
    (part,) = _run("value_dim", [probs, lv, v_codes, v_norms, prm],
                   [("D", D), ("BITS", bits), ("R", R), ("THREADS", THREADS), ("TILE", tile), ("PAIR", pair)], (B * Hkv, ns),
                   THREADS,
                   [(B * Hkv, ns, R, D)], [mx.float32])
    (o,) = _run("value_reduce", [part, prm], [("D", D), ("R", R)], (B * Hq * L, 1), D,
                [(B, Hq, L, D)], [mx.float32])
    return o


def attention_four(q: mx.array, mats: mx.array | None, k_codes: mx.array, k_norms: mx.array,
                   v_codes: mx.array, v_norms: mx.array, levels: mx.array, *, bits: int, scale: float,
                   valid_len: int, offset: int = 0, causal: bool = False, rot: int = ROT_WHT | ROT_SO4,
                   strategy: str = "auto", key_bits: int | None = None,
                   key_levels: mx.array | None = None) -> mx.array:
    """The four-kernel pipeline (query rotation, scores, softmax, values, inverse rotation); returns out [B, Hq, L, D] float32. key_bits /
    key_levels: the keys' own width and codebook (kv.key_bits, or pair codebooks: both tables [n, 2])."""
    Hkv = k_codes.shape[1]
    kl, kb = (levels, bits) if key_levels is None else (key_levels, key_bits or bits)
    q_rot = rotate_queries(q, mats, Hkv, rot=rot) if rot else q.astype(mx.float32)
    s = qk_dot(q_rot, k_codes, k_norms, kl, bits=kb, scale=scale, valid_len=valid_len, offset=offset, causal=causal)
    p = softmax(s)
    o = value_accum(p, v_codes, v_norms, levels, bits=bits, strategy=strategy)
    return rotate_inverse(o, mats, Hkv, rot=rot) if rot else o



# ---------------------------------------------------------------------------------------------
# attn_fused: one launch per layer and decode step

COUNTER_POOL = 1 << 14
_POOL: dict = {"arr": None, "pos": 0, "views": {}}


def _counter(n: int) -> mx.array:
    """A zeroed slot of n uint32 counters for one attn_fused launch: a cached view into one persistent pool.

    The last block of each (batch, kv head) sets its counter back to 0, so the pool stays zeroed (no fill
    op per call; MLX's init_value would fill every output, the partials too, with extra launches).
    Successive launches take successive slots (a ring): MLX may run launches that share no output
    concurrently (branches of one CUDA graph, Metal's concurrent dispatch), so one shared slot would race.
    A slot comes back after COUNTER_POOL // n launches, far more than one graph holds.
    """
    if n > 1024:
        raise KernelUnsupported(f"{n} (batch, kv head) pairs in one attn_fused launch")
    n = max(n, METAL_CONSTANT_BELOW)  # a slot of at least 8 (the kernel uses the first n): device memory on Metal
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


_META: dict = {}
WINDOW_FIRST_MAX = 1 << 23  # the window's first row goes in meta's second word above its 8 bits of rows
assert MMA_TILE < 256, "meta holds the window's rows (at most MMA_TILE) in 8 bits"


def fused_meta(T: int, first: int = 0, rows: int = 0) -> mx.array:
    """attn_fused's int32 meta [T, first << 8 | rows], cached for the last few values: every layer of a decode step
    (one length, one window position) shares one array, made on the host (8 bytes: MLX's scalar pool, which the GPU
    reads in place)."""
    key = (T, (first << 8) | rows)
    hit = _META.get(key)
    if hit is None:
        if len(_META) >= 8:
            _META.pop(next(iter(_META)))
        hit = _META[key] = mx.array(key, dtype=mx.int32)
    return hit


def _one_launch_args(name: str, q: mx.array, Hkv: int, rot: int, valid_len: int, offset: int,
                     causal: bool) -> tuple[int, bool, mx.array, int]:
    """attn_fused's checks: (T, causal, queries in a kernel dtype, B * Hkv)."""
    if rot not in (0, ROT_WHT, ROT_SO4, ROT_WHT | ROT_SO4, ROT_WHT | ROT_SO4 | ROT_SIGN, ROT_DENSE):
        raise ValueError(f"rot={rot}: the dense rotation does not combine with the WHT or SO(4) blocks")
    T, L = valid_len, q.shape[2]
    if causal and offset + 1 >= T:
        causal = False  # every query sees every valid key
    if causal and offset != T - L:
        raise KernelUnsupported(f"{name}: causal offset other than valid_len - L")
    qd = q if q.dtype in (mx.float16, mx.bfloat16, mx.float32) else q.astype(mx.float32)
    return T, causal, qd, q.shape[0] * Hkv


# CUDA: blocks of attn_fused resident per SM that the compiler must allow for (register cap through
# __launch_bounds__): 1 from 256 threads (one block an SM: at 256 nvcc gives 186 registers, 254 to the window variant,
# and a shorter warp step than at 2, whose 128-register cap two blocks an SM need), else none. At 1 with up to 384
# threads the partials' merge loads up to 33 splits in one round (RQ_MERGE_WIDE in the body), which a 128-register
# cap could not hold.
def _min_blocks(nth: int) -> int:
    return 1 if nth >= 256 else 0


def fused_source_defines(nth: int, minb: int) -> tuple[str, ...]:
    """Defines attn_fused's CUDA source takes from its launch bound: RQ_MERGE_WIDE (one round of 33 partial loads in
    the merge) where one block of at most 384 threads an SM leaves the registers for it."""
    return ("RQ_MERGE_WIDE",) if minb == 1 and nth <= 384 else ()


@functools.lru_cache(maxsize=None)
def _fused_kernel(be: str, nth: int, minb: int, window: bool = False, minified: bool = True):
    """attn_fused compiled with an optional launch bound. MLX builds `header` + `__global__ void name(...)`,
    so on CUDA a header that redefines __global__ (as CUDA's host_defines.h spells it, with
    __launch_bounds__ added) bounds this kernel only; the name carries the bound (MLX caches modules by
    name and template). minified: part of the cache key only (render reads the setting)."""
    kname = "attn_fused_window" if window else "attn_fused"
    header, source = render(kname, be)
    name = "rq_" + kname
    if be == "cuda" and minb > 0:
        header += f"#undef __global__\n#define __global__ __location__(global) __launch_bounds__({nth}, {minb})\n"
        name += f"_lb{minb}"
        source = "".join(f"#define {d} 1\n" for d in fused_source_defines(nth, minb)) + source
    spec = SPECS[kname]
    make = mx.fast.metal_kernel if be == "metal" else mx.fast.cuda_kernel
    return make(name=name, input_names=list(spec.inputs), output_names=list(spec.outputs), source=source,
                header=header, ensure_row_contiguous=False)


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


def fused_blocks() -> int:
    """attn_fused's target block count: one block an SM on CUDA (the launch bound allows one: a second wave would
    double the time), else FUSED_BLOCKS_DEFAULT."""
    if backend() == "cuda":
        return cuda_sm_count() or FUSED_BLOCKS_DEFAULT
    return FUSED_BLOCKS_DEFAULT


def fused_splits(T: int, n_groups: int, blocks: int | None = None) -> int:
    """Split count of attn_fused: at most `blocks` (fused_blocks()) blocks in all (rounded down: at one block an SM, a
    block past the target would run in a second wave), at least 128 tokens a split."""
    target = fused_blocks() if blocks is None else blocks
    return max(1, min(-(-T // 128), target // max(1, n_groups), MAX_SPLITS))


def fused_launch_splits(T: int, blocks_a_split: int, target: int, window: bool) -> int:
    """attn_fused's splits (grid y) for `blocks_a_split` blocks a split (groups times value-dim halves); with a window,
    its split first, its blocks taken from the target (so they add no wave: at 264 blocks, 2 waves of one per SM on
    the H200, 4 more made a third, +35 us at 128K)."""
    if not window:
        return fused_splits(T, blocks_a_split, target)
    return min(fused_splits(T, blocks_a_split, max(blocks_a_split, target - blocks_a_split)), MAX_SPLITS - 1) + 1


def _fused_smem(D: int, bits: int, R: int, nth: int, be: str, stage: int = 0, vdec: int = 1,
                kbits: int | None = None, pair: tuple[int, int] | None = None, half: bool = False) -> int:
    """Threadgroup bytes of attn_fused (the body's arena: the (m, l) arrays, pool, the keys' own table where kbits
    differs, the pair table, the ring; then two words). vdec 2 on CUDA pads the pair table to the next 8 KB boundary of
    the shared window (above the block's 1 KB reserved), as the body's LUTPAD does. Head dim 512 (QSM): the query's
    score fragments (hi and lo halves unless `half` queries) before the tables, the pool over all of it."""
    kbits = bits if kbits is None else kbits
    step = 16 if be == "cuda" else 8
    nwarp = nth // 32
    np_ = pair[1] if pair else 1 << (2 * bits)
    luts = 32 if np_ * 32 * 4 <= 8192 else 1
    qsm = fused_vhalves(D) > 1
    pool = (1 if qsm else 2) * R * D + R * MAX_SPLITS
    qfn = (1 if half else 2) * 4 * D if qsm else 0  # NKS * FRAG_B_PAIRS * 32 words a half: 4 D on both backends
    toff = qfn if qsm else pool
    nf = D // 2 if pair else D
    ring = nwarp * stage * step * (nf * bits // 32 + nf * kbits // 32) if stage > 0 else 4
    klut = pair[0] if pair else (1 << (2 * kbits)) if kbits != bits else 0
    small = 2 * nwarp * MMA_ROWS + 2 * MMA_ROWS  # the warps' (m, l) and the rows' (m, l), first in the arena
    pad = 0
    if vdec == 2 and luts == 32 and be == "cuda":
        pad = (8192 - (1024 + 4 * small + 4 * toff + 4 * klut) % 8192) % 8192
    arena = max(4 * (toff + klut + np_ * luts + ring) + pad, 4 * pool, 4 * (qfn + R * D))
    return 4 * small + arena + 4 * 2


def fused_ok(D: int, bits: int, R: int, be: str, nth: int | None = None, stage: int | None = None,
             vdec: int = 1, kbits: int | None = None, pair: tuple[int, int] | None = None,
             half: bool = False) -> bool:
    """Shapes attn_fused covers: those of the matrix-unit steps (keys and values each; pair codebooks: up to 8 rows at
    head dim 64 to 512, their lane chunks funnel-shifted where they start mid-word), within the threadgroup
    memory limit (half: f16 / bf16 queries). Head dim 512 takes its rows through registers (no ring)."""
    nth = 256 if nth is None else nth
    stage = FUSED_STAGE if stage is None else stage
    kb = bits if kbits is None else kbits
    shapes = (R <= MMA_ROWS and D in FUSED_DIMS) if pair else mma_ok(D, bits, R) and mma_ok(D, kb, R)
    return (shapes and nth % 64 == 0 and stage >= 0 and (stage == 0 or fused_vhalves(D) == 1)
            and _fused_smem(D, bits, R, nth, be, stage, vdec, kb, pair, half) <= SMEM_LIMIT[be])


@functools.lru_cache(maxsize=256)
def _fused_config(D: int, bits: int, R: int, be: str, nth: int, stage: int | None, pf: int | None,
                  vdec: int = 1, kbits: int | None = None,
                  pair: tuple[int, int] | None = None, half: bool = False) -> tuple[int, int, int, int]:
    """(threads, ring stages, load-ahead, decode) of attn_fused for a shape class, checked once (a decode calls
    this for every layer of every step). Decode 2 falls back to 1 where its padded table does not fit. Head dim 512
    loads one step ahead by default (its key rows are twice as long)."""
    if stage is None:  # the default ring where it fits, else rows through registers
        stage = FUSED_STAGE if fused_ok(D, bits, R, be, nth, FUSED_STAGE, kbits=kbits, pair=pair, half=half) else 0
    pf = 1 if stage > 0 else pf if pf is not None else 1 if fused_vhalves(D) > 1 else FUSED_PF
    if not fused_ok(D, bits, R, be, nth, stage, kbits=kbits, pair=pair, half=half):
        raise KernelUnsupported(f"attn_fused: R={R}, head_dim {D}, {bits}-bit codes ({kbits}-bit keys), {nth} "
                                f"threads, {stage} stages: over the threadgroup memory")
    if vdec == 2 and not fused_ok(D, bits, R, be, nth, stage, 2, kbits, pair, half):
        vdec = 1
    return nth, stage, pf, vdec


class FusedLaunch:
    """attn_fused for one class of calls (shapes, dtypes, settings, the context's splits and thread count), its codebook,
    rotation and launch arguments prepared: a decode step launches it for every layer, and a call builds the launch
    and nothing else (checks, plans and the kernel-cache bookkeeping ran when it was made: fused_launch).

    `plan` names the class without the arrays: launches of equal plans differ only in `static` (the rotation and
    codebook arrays), so a traced decode graph made around one serves the others with their arrays as its inputs."""

    # Not traced (mx.compile) alone for replay: measured once on the H200, a replayed launch cost more host time a layer
    # than a built one (48 layers, 2K context, the cache's whole attend: 97 against 82 us); a layer's whole decode
    # graph takes it (rq_core.models.base.decode_layer)
    __slots__ = ("kernel", "static", "template", "grid", "threadgroup", "out_shapes", "out_dtypes", "groups",
                 "init_value", "cast", "config", "sources", "plan", "_launched")

    def __init__(self, kernel, static: list, template: list, grid: tuple, nth: int, out_shapes: list, out_dtypes: list,
                 groups: int, cast: bool, config: env.KernelConfig, plan: tuple = ()) -> None:
        self.kernel, self.static, self.template, self.grid = kernel, static, template, grid
        self.threadgroup = (nth, 1, 1)
        self.out_shapes, self.out_dtypes, self.groups, self.cast = out_shapes, out_dtypes, groups, cast
        self.init_value = float("nan") if config.poison else None
        self.config = config  # the settings it was made under (a changed config makes a new one)
        self.sources: tuple = ()  # the arrays it was made from (mats, levels, key levels): kept alive with it
        self.plan = plan
        self._launched = False

    def __call__(self, q: mx.array, k_codes: mx.array, k_norms: mx.array, v_codes: mx.array, v_norms: mx.array,
                 valid_len: int, window: tuple | None = None) -> list[mx.array]:
        """[out, scratch] of one launch. window: (keys, values, first, rows), checked (check_window): the rows
        first .. first + rows of the fp16 buffers [B, Hkv, cap, D]; given exactly when the launch was made for one."""
        meta = fused_meta(valid_len, window[2], window[3]) if window is not None else fused_meta(valid_len)
        return self.launch(q, self.static, k_codes, k_norms, v_codes, v_norms, self.counter(), meta,
                           None if window is None else window[:2])

    def counter(self) -> mx.array:
        """The counter slot a launch takes (successive launches, successive slots: _counter)."""
        return _counter(self.groups)

    def launch(self, q: mx.array, static: list, k_codes: mx.array, k_norms: mx.array, v_codes: mx.array,
               v_norms: mx.array, counter: mx.array, meta: mx.array, window: tuple | None = None) -> list[mx.array]:
        """[out, scratch] with every array given: `static` as this launch's, `meta` as fused_meta makes it, window (keys,
        values) the fp16 buffers the meta's rows are read from (traced graphs pass their inputs)."""
        inputs = [q.astype(mx.float32) if self.cast else q, *static, k_codes, k_norms, v_codes, v_norms, counter, meta]
        if window is not None:
            inputs += window
        kw = dict(inputs=inputs, template=self.template, grid=self.grid, threadgroup=self.threadgroup,
                  output_shapes=self.out_shapes, output_dtypes=self.out_dtypes, init_value=self.init_value)
        if self._launched:
            return self.kernel(**kw)
        self._launched = True  # the first launch leaves the compiled kernel in MLX's PTX cache (_launch)
        return _launch(self.kernel, **kw)


def fused_launch(qshape: tuple, qdtype, mats: mx.array | None, kshape: tuple, vshape: tuple, levels: mx.array, *,
                 bits: int, scale: float, valid_len: int, offset: int = 0, causal: bool = False,
                 rot: int = ROT_WHT | ROT_SO4, blocks: int | None = None, nth: int | None = None, pf: int | None = None,
                 vdec: int | None = None, stage: int | None = None, window: bool = False,
                 key_bits: int | None = None, key_levels: mx.array | None = None,
                 plan_len: int | None = None) -> FusedLaunch:
    """The prepared launch fused_attention makes for these shapes and settings (KernelUnsupported where the kernel
    declines them). Its splits and threads are planned for `plan_len` packed tokens (default valid_len): it serves
    every call whose plan_len has the same splits (ceil(plan_len / 128), at most MAX_SPLITS) and thread count
    (fused_threads), and whose offset relative to valid_len is the same; the kernel divides the valid rows it is
    given among the splits."""
    plan_len = valid_len if plan_len is None else plan_len
    be = backend()
    if be is None:
        raise KernelUnsupported("no GPU backend")
    cast = qdtype not in (mx.float16, mx.bfloat16, mx.float32)
    qd = mx.float32 if cast else qdtype
    plan = _fused_launch_plan(be, tuple(qshape), qd, tuple(kshape), tuple(vshape), tuple(levels.shape),
                              None if key_levels is None else tuple(key_levels.shape), bits, key_bits, scale,
                              min(-(-plan_len // 128), MAX_SPLITS), 0 if window else offset - valid_len, causal, rot,
                              blocks, fused_threads(plan_len) if nth is None else nth, pf, vdec, stage, window,
                              _device_facts(be))
    nth, minb, kb_own, groups, template, grid, out_shapes, out_dtypes = plan
    cfg = env.config()
    k = _fused_kernel(be, nth, minb, window, cfg.minify)
    static = [_mats(mats), _consts(levels, scale, key_levels if kb_own else None)]
    launch = FusedLaunch(k, static, template, grid, nth, out_shapes, out_dtypes, groups, cast, cfg,
                         plan=(be, nth, minb, window, tuple(map(tuple, template)), grid, tuple(map(tuple, out_shapes)),
                               tuple(out_dtypes), groups, cast, cfg, tuple(s.shape for s in static),
                               tuple(s.dtype for s in static)))
    launch.sources = (mats, levels, key_levels)
    return launch


def fused_attention(q: mx.array, mats: mx.array | None, k_codes: mx.array, k_norms: mx.array, v_codes: mx.array,
                    v_norms: mx.array, levels: mx.array, *, bits: int, scale: float, valid_len: int, offset: int = 0,
                    causal: bool = False, rot: int = ROT_WHT | ROT_SO4, blocks: int | None = None,
                    nth: int | None = None, pf: int | None = None, vdec: int | None = None,
                    stage: int | None = None, window: tuple | None = None,
                    key_bits: int | None = None, key_levels: mx.array | None = None,
                    want_lse: bool = True, launches: dict | None = None,
                    plan_len: int | None = None) -> tuple[mx.array, mx.array | None]:
    """Attention over packed codes in one launch (metal/attn_fused.body): rotation + scores + online softmax + values
    per context split, the last block of each (batch, kv head) merging the splits and rotating back.

    q [B, Hq, L, D] (any strides; float16, bfloat16 or float32, else cast to float32) un-rotated;
    rot: 0 (q already rotated, the output stays in the rotated space), ROT_WHT, ROT_SO4, both, ROT_SIGN with both
    (mats [Hkv, 5D]), or ROT_DENSE (mats [Hkv, D, D] with y = P u: TurboQuant). mats [Hkv, D/4, 4, 4] for ROT_SO4.
    k_codes / v_codes [B, Hkv, T_cap, W] and k_norms / v_norms [B, Hkv, T_cap] are whole cache buffers read through
    their strides (no copy op); only the first valid_len rows count. Code rows must start 16-byte aligned: buffers of
    more than 8 bytes do, and so does every row of them, since the shapes taken have rows of 4k words.
    window: the cache's fp16 segment after the packed tokens, attended exactly by one more split of the same launch
    (attn_fused_window): (keys, values) [B, Hkv, NW, D], or (keys, values, first, NW): rows first .. first + NW of
    whole buffers [B, Hkv, cap, D] (no view made); 1 <= NW <= MMA_TILE, any strides, last dim dense. The queries are
    its last L tokens, so the packed part is seen whole and `causal` masks the window.
    key_bits / key_levels: keys at their own width and codebook (kv.key_bits; k_codes rows of D * key_bits / 32
    words), else the values' `bits` and `levels`; levels [n, 2] (both): pair codebooks.
    blocks / nth / pf / vdec / stage: the grid's target block count, threads per block, the load-ahead depth, the value
    decode and the copy ring (default fused_blocks(), fused_threads(valid_len), FUSED_PF, FUSED_VDEC, FUSED_STAGE;
    stage > 0 forces pf = 1): checks try other configurations. want_lse=False: lse comes back None (no slice of the
    scratch made: a graph node a layer that the caches do not read).
    launches: a dict the caller keeps (a cache's): the FusedLaunch made for a class of calls (every argument but the
    arrays' contents and the context within its 128-token split) is kept there, so a decode step's call skips the
    checks and the plan (its host time a layer).
    plan_len: the packed tokens the splits and threads are planned for (default valid_len; >= valid_len). A cache
    passes at least its capacity (rq_core.attention.dispatch._plan_len), so that its launch stays one class as its
    context grows (fused_launch).
    Returns (out [B, Hq, L, D] in q's dtype, lse [B, Hq, L] float32, natural log)."""
    L = q.shape[2]
    if window is not None:
        window = check_window(window, L)
    launch = kept_launch(launches, tuple(q.shape), q.dtype, mats, k_codes.shape, v_codes.shape, levels, bits=bits,
                         scale=scale, valid_len=valid_len, offset=offset, causal=causal, rot=rot, blocks=blocks, nth=nth,
                         pf=pf, vdec=vdec, stage=stage, window=window is not None, key_bits=key_bits,
                         key_levels=key_levels, plan_len=plan_len)
    res = launch(q, k_codes, k_norms, v_codes, v_norms, valid_len, window)
    B, Hq = q.shape[0], q.shape[1]
    lse = res[1][-B * Hq * L:].reshape(B, Hq, L) if want_lse else None
    return res[0], lse


def kept_launch(launches: dict | None, qshape: tuple, qdtype, mats: mx.array | None, kshape: tuple, vshape: tuple,
                levels: mx.array, *, bits: int, scale: float, valid_len: int, offset: int = 0, causal: bool = False,
                rot: int = ROT_WHT | ROT_SO4, blocks: int | None = None, nth: int | None = None, pf: int | None = None,
                vdec: int | None = None, stage: int | None = None, window: bool = False, key_bits: int | None = None,
                key_levels: mx.array | None = None, plan_len: int | None = None) -> FusedLaunch:
    """fused_launch's launch for these arguments, kept in `launches` (a cache's dict; None: made anew) for the calls of
    its class: every argument but the arrays' contents and a context planned alike (fused_launch)."""
    plan_len = valid_len if plan_len is None else max(plan_len, valid_len)
    key = None
    if launches is not None:
        # everything the launch depends on; arrays by identity (a kept launch holds them, so no id is reused meanwhile)
        key = (qshape, qdtype, tuple(kshape), tuple(vshape), min(-(-plan_len // 128), MAX_SPLITS),
               fused_threads(plan_len) if nth is None else nth, 0 if window else offset - valid_len, causal, window,
               env.config(), id(mats), id(levels), id(key_levels), bits, key_bits, scale, rot, blocks, pf, vdec, stage)
        launch = launches.get(key)
        if launch is not None:
            return launch
    launch = fused_launch(qshape, qdtype, mats, kshape, vshape, levels, bits=bits, scale=scale, valid_len=valid_len,
                          offset=offset, causal=causal, rot=rot, blocks=blocks, nth=nth, pf=pf, vdec=vdec, stage=stage,
                          window=window, key_bits=key_bits, key_levels=key_levels, plan_len=plan_len)
    if launches is not None:
        if len(launches) >= 8:  # the classes of a context that has grown past them
            launches.pop(next(iter(launches)))
        launches[key] = launch
    return launch


def check_window(window: tuple, L: int) -> tuple:
    """A window argument as (keys, values, first, rows), checked (KernelUnsupported where the kernel cannot take it)."""
    wk, wv, *pos = window
    first, nw = pos if pos else (0, wk.shape[2])
    if not 1 <= nw <= MMA_TILE or nw < L or wk.dtype not in (mx.float16, mx.bfloat16, mx.float32):
        raise KernelUnsupported(f"attn_fused: window of {nw} tokens ({wk.dtype}) for {L} queries")
    if not 0 <= first < WINDOW_FIRST_MAX or first + nw > min(wk.shape[2], wv.shape[2]):
        raise KernelUnsupported(f"attn_fused: window rows {first}..{first + nw} of buffers of {wk.shape[2]}")
    return wk, wv, first, nw


def fused_plan_declines(be: str, qshape: tuple, qdtype, kshape: tuple, vshape: tuple, lvshape: tuple,
                        klvshape: tuple | None, bits: int, key_bits: int | None, *, causal: bool = False,
                        window: bool = True, rot: int = ROT_WHT | ROT_SO4) -> str | None:
    """Why fused_attention would decline these shapes on backend `be` (its launch plan's KernelUnsupported, for every
    thread count fused_threads picks there), or None where it takes them: shapes alone, no GPU needed."""
    D, L = qshape[3], qshape[2]
    for nth in (256, 384) if be == "cuda" else (256,):
        try:
            _fused_launch_plan(be, qshape, qdtype, kshape, vshape, lvshape, klvshape, bits, key_bits,
                               1.0 / math.sqrt(D), MAX_SPLITS, 0 if window else -L, causal, rot, None, nth, None,
                               None, None, window, (SMEM_LIMIT[be], None))
        except KernelUnsupported as e:
            return str(e)
    return None


def _device_facts(be: str) -> tuple:
    """What attn_fused's launch plan reads of the device (a cache key of the plan)."""
    return (SMEM_LIMIT[be], cuda_sm_count() if be == "cuda" else None)


@functools.lru_cache(maxsize=512)
def _fused_launch_plan(be: str, qshape: tuple, qdtype, kshape: tuple, vshape: tuple, lvshape: tuple,
                       klvshape: tuple | None, bits: int, key_bits: int | None, scale: float, tiles: int,
                       off_rel: int, causal: bool, rot: int, blocks: int | None, nth: int, pf: int | None,
                       vdec: int | None, stage: int | None, window: bool, device: tuple) -> tuple:
    """fused_attention's checks and launch arguments for one class of calls: (threads, launch bound, whether the keys
    have their own table, groups, template, grid, output shapes, output dtypes). Raises KernelUnsupported.
    tiles: ceil(valid_len / 128) capped at MAX_SPLITS; off_rel: the queries' offset less valid_len (0 with a window)."""
    valid_len = 128 * tiles  # stands for the context: the same splits, and the same offset relative to it
    offset = valid_len + off_rel
    B, Hq, L, D = qshape
    Hkv = kshape[1]
    nrg = row_blocks(Hq // Hkv, L) if Hq % Hkv == 0 else 0
    if nrg == 0:
        raise KernelUnsupported(f"attn_fused: {Hq} query heads over {Hkv} kv heads, {L} rows each (blocks of whole "
                                f"heads, at most {MMA_ROWS} rows)")
    R = (Hq // Hkv) // nrg * L  # a block's rows
    pair = None  # pair codebooks: (keys' points, values' points); bits / key_bits are their fields' widths
    if len(lvshape) == 2:
        if klvshape is None or len(klvshape) != 2 or lvshape[0] != 1 << bits \
                or key_bits is None or klvshape[0] != 1 << key_bits:
            raise KernelUnsupported("attn_fused: pair codebooks need both tables, of 2^bits and 2^key_bits points")
        pair = (klvshape[0], lvshape[0])
        _fused_check(D, 3, R)  # the shape checks of the 3-bit codes (head dim, rows)
        if not 16 <= pair[1] <= 64 or not 16 <= pair[0] <= 256:
            raise KernelUnsupported(f"attn_fused: pair codebooks of {pair} points (values' table lane-replicated: "
                                    "<= 64)")
        if kshape[3] * 64 != D * key_bits or vshape[3] * 64 != D * bits:
            raise KernelUnsupported(f"attn_fused: pair rows of {kshape[3]} / {vshape[3]} words")
        if (kshape[2] * kshape[3]) % 4 or (vshape[2] * vshape[3]) % 4:
            # rows of 14 / 10 words: a head's rows start 16-byte aligned (the copy ring's cp.async) only if the
            # capacity makes them (the cache's is a multiple of 256 tokens)
            raise KernelUnsupported(f"attn_fused: pair codes of capacity {kshape[2]} leave heads unaligned")
        vdec = 2  # the values' lane-replicated table by byte offsets
    else:
        _fused_check(D, bits, R)
    kb = bits if key_bits is None or klvshape is None else key_bits
    if kb != bits and pair is None:
        _fused_check(D, kb, R)
        if kshape[3] * 32 != D * kb:
            raise KernelUnsupported(f"attn_fused: key rows of {kshape[3]} words for {kb}-bit keys")
    vh = fused_vhalves(D)
    if vh > 1 and rot & ROT_DENSE:
        raise KernelUnsupported(f"attn_fused: the dense rotation at head_dim {D} (value-dim halves rotate by warps)")
    nth, stage, pf, vdec = _fused_config(D, bits, R, be, nth, stage, pf, FUSED_VDEC if vdec is None else vdec, kb, pair,
                                         qdtype in (mx.float16, mx.bfloat16))
    if pair is not None and vdec != 2:
        raise KernelUnsupported("attn_fused: pair codebooks need the pair-table decode (its table did not fit)")
    wt = []
    if window:
        wt = [("WCAUSAL", int(causal and L > 1))]
        causal, offset = False, valid_len  # every packed token precedes every query
    T, causal, _, groups = _one_launch_args("attn_fused", _Shaped(qshape, qdtype), Hkv, rot, valid_len, offset, causal)
    groups *= nrg
    if groups > 1024:
        raise KernelUnsupported(f"attn_fused: {groups} (batch, kv head, row block) groups in one launch")
    target = fused_blocks() if blocks is None else blocks
    ns = fused_launch_splits(T, groups * vh, target, window)
    template = [("TQ", qdtype), ("D", D), ("BITS", bits), ("KBITS", kb), ("PK", pair[0] if pair else 0),
                ("PV", pair[1] if pair else 0), ("R", R), ("LQ", L), ("HKV", Hkv), ("NRG", nrg),
                ("CAUSAL", int(causal)), ("ROT", rot), ("THREADS", nth), ("SACC", FUSED_SACC), ("PF", pf),
                ("VDEC", vdec), ("STAGE", stage), ("MERGE", FUSED_MERGE)] + wt
    out_shapes = [(B, Hq, L, D), (fused_scratch_size(groups, ns, R, D),)]
    out_dtypes = [qdtype, mx.float32]
    return (nth, _min_blocks(nth), kb != bits or pair is not None, groups, template, (groups * vh * nth, ns, 1),
            out_shapes, out_dtypes)


class _Shaped:
    """Stands in for the queries in _one_launch_args when only their shape and dtype are known."""

    def __init__(self, shape: tuple, dtype) -> None:
        self.shape, self.dtype = shape, dtype

    def astype(self, dtype) -> "_Shaped":
        return _Shaped(self.shape, dtype)


def fused_scratch_size(groups: int, ns: int, R: int, D: int) -> int:
    """Floats of attn_fused's scratch output: partials [groups, VH, ns, MMA_ROWS, D / VH] (fused_vhalves), (m, l)
    [groups, ns, R, 2], lse [groups, R]."""
    return groups * ns * MMA_ROWS * D + groups * ns * R * 2 + groups * R


_ROT_ARGS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def rotation_args(rotation) -> tuple[int, mx.array | None]:
    """(ROT bits, matrices) for the kernels' in-kernel rotation of an rq_core.codec.rotation.Rotation, cached."""
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


# ---------------------------------------------------------------------------------------------
# kv_append: the compressed cache's append (quantize + pack K and V) in one launch

APPEND_DIMS = (32, 64, 128, 256, 512)
# Poisoned (RQ_KERNEL_POISON), the outputs start as 3e9 (codes 0xB2D05E00, norms inf): NaN has no uint32 value.
APPEND_POISON = 3.0e9
_APPEND_CONSTS: dict = {}


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
                   init_value=APPEND_POISON if env.config().poison else None))


def append_codes(keys: mx.array, values: mx.array, rotation, levels: mx.array, bits: int, *,
                 norm_correction: bool = False, key_bits: int | None = None,
                 key_levels: mx.array | None = None) -> tuple[mx.array, mx.array, mx.array, mx.array] | None:
    """IsoQuantCache's append on a GPU: kv_append_codes, or None (the caller runs quantize_kv) on CPU,
    with RQ_APPEND=ops, or for shapes the kernel does not cover."""
    if env.config().append == "ops" or not available():
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
    (`rq_core.attention.reference.dequantize_rotated` is the reference). levels [2^bits] (a scalar codebook) or [2^bits, 2]
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
                  [("D", d), ("FB", bits), ("PAIR", int(pair)), ("THREADS", nth)], (B * H * n, 1), nth,
                  [(B, H, rows, d)], [dtype])
    return out


# ---------------------------------------------------------------------------------------------
# Whole translation units, as MLX builds them (for compile checks off the GPU and resource reports)

# input dtype per input name (everything else is float32); outputs are float32
INPUT_TYPES = {"k_codes": "u32", "v_codes": "u32", "k_norms": "f16", "v_norms": "f16", "iparams": "i32", "counter": "u32",
               "meta": "i32", "codes": "u32", "norms": "f16"}
_TYPE_NAMES = {"metal": {"f32": "float", "u32": "uint32_t", "f16": "float16_t", "i32": "int32_t", "bf16": "bfloat16_t"},
               "cuda": {"f32": "float", "u32": "uint32_t", "f16": "__half", "i32": "int32_t", "bf16": "__nv_bfloat16"}}
# Metal attributes MLX adds to the signature when the body names them (the prelude uses these three)
_METAL_ATTRS = (("thread_position_in_threadgroup", "uint3"), ("threadgroup_position_in_grid", "uint3"),
                ("threadgroups_per_grid", "uint3"),
                ("threads_per_threadgroup", "uint3"))


def full_source(name: str, be: str, template: list[tuple[str, object]],
                input_types: dict[str, str] | None = None) -> str:
    """The complete kernel source MLX would compile for `name` (MLX's own includes left to the caller).

    template: (name, int) pairs, or (name, "f16" | "bf16" | "f32") for a dtype; input_types overrides an
    input's or output's dtype code (e.g. {"q": "f16", "out": "f16"}; outputs default to float32).
    Shape/strides parameters are added where the body uses them.
    """
    header, source = render(name, be)
    spec = SPECS[name]
    outputs = list(spec.outputs)
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
        else:  # MLX's rule: fewer than METAL_CONSTANT_BELOW elements go in constant memory (meta's 2 always do)
            args.append(f"  const {'constant' if n in spec.small else 'device'} {t}* {n} [[buffer({slot})]]")
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
