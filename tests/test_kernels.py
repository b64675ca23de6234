"""CPU-side checks of the GPU kernel sources (rq_core.kernels, metal/).

The kernels themselves run only on a GPU (benchmarks/kernels_check.py checks them there against
float64 math). Here: the renderer, that the Metal and CUDA renderings differ only by the prelude,
and a compile-level syntax check of both renderings with a host C++ compiler against stub headers
for Metal's and CUDA's built-ins (tests/kernel_stubs/); skipped when no compiler is installed.
"""

from __future__ import annotations

import math
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import rq_core.kernels as K

STUBS = Path(__file__).resolve().parent / "kernel_stubs"
ROOT = Path(__file__).resolve().parent.parent

# one representative shape class per kernel: (template, input dtype overrides)
CASES = {
    "attn_split": [("D", 128), ("BITS", 3), ("R", 8), ("LQ", 1), ("TPT", 2), ("NTH", 128), ("ROT", 3)],
    "attn_mma": [("TQ", "f16"), ("D", 128), ("BITS", 3), ("R", 8), ("LQ", 1), ("HKV", 4), ("CAUSAL", 1),
                 ("ROT", 3), ("NTH", 128), ("TILE", 128)],
    "attn_mma2": [("TQ", "f32"), ("D", 256), ("BITS", 3), ("R", 4), ("LQ", 1), ("HKV", 2), ("CAUSAL", 0),
                  ("ROT", 1), ("NTH", 128), ("TILE", 128)],
    "attn_combine": [("D", 128), ("R", 8), ("ROT", 3), ("HKV", 4)],
    "attn_merge": [("D", 64), ("R", 8), ("ROT", 3), ("HKV", 4), ("NTC", 256), ("MAXS", 128)],
    "rotate_query": [("D", 128), ("R", 8), ("ROT", 3), ("INV", 0)],
    "rotate_inverse": [("D", 256), ("R", 1), ("ROT", 2), ("INV", 1)],
    "qk_dot": [("D", 64), ("BITS", 4), ("R", 4), ("LQ", 1), ("TPT", 4), ("NTH", 128), ("PAIR", 0)],
    "softmax": [("NTH", 256)],
    "value_dim": [("D", 128), ("BITS", 3), ("R", 8), ("NTH", 128), ("TILE", 128), ("PAIR", 0)],
    "value_reduce": [("D", 128), ("R", 8)],
    "value_word": [("D", 128), ("BITS", 2), ("R", 8), ("NSL", 32), ("PAIR", 0)],
    "attn_v4": [("TQ", "f16"), ("D", 128), ("BITS", 3), ("R", 8), ("LQ", 1), ("HKV", 4), ("CAUSAL", 0),
                ("ROT", 3), ("NTH", 128), ("TILE", 128)],
    "attn_v5": [("TQ", "f16"), ("D", 128), ("BITS", 3), ("KBITS", 3), ("PK", 0), ("PV", 0), ("R", 8), ("LQ", 1), ("HKV", 4), ("CAUSAL", 0),
                ("ROT", 3), ("NTH", 384), ("SACC", 2), ("PF", 2), ("VDEC", 1), ("STAGE", 0), ("MERGE", 0)],
    "attn_v4w": [("TQ", "f16"), ("D", 128), ("BITS", 3), ("R", 8), ("LQ", 2), ("HKV", 4), ("CAUSAL", 0),
                 ("ROT", 3), ("NTH", 128), ("TILE", 128), ("WCAUSAL", 1)],
    "attn_v5w": [("TQ", "bf16"), ("D", 128), ("BITS", 3), ("KBITS", 4), ("PK", 0), ("PV", 0), ("R", 8), ("LQ", 2), ("HKV", 4), ("CAUSAL", 0),
                 ("ROT", 4), ("NTH", 256), ("SACC", 2), ("PF", 1), ("VDEC", 2), ("STAGE", 2), ("MERGE", 1),
                 ("WCAUSAL", 1)],
    "kv_append": [("TK", "f16"), ("D", 128), ("BITS", 3), ("KBITS", 4), ("ROT", 3), ("NC", 0), ("PK", 0), ("PV", 0)],  # more in test_kv_append_kernel
    "kv_decode": [("D", 128), ("FB", 3), ("PAIR", 0), ("NTH", 128)],
}
# more shape classes of the single-launch kernel (bf16 queries, dense rotation, causal, no rotation)
EXTRA_CASES = {
    "kv_decode/pair": ("kv_decode", [("D", 128), ("FB", 7), ("PAIR", 1), ("NTH", 64)]),
    # the four kernels with pair codebooks (128, 32): 7-bit key fields, 5-bit value fields
    "qk_dot/pair": ("qk_dot", [("D", 128), ("BITS", 7), ("R", 8), ("LQ", 1), ("TPT", 2), ("NTH", 128), ("PAIR", 1)]),
    "value_dim/pair": ("value_dim", [("D", 128), ("BITS", 5), ("R", 8), ("NTH", 128), ("TILE", 128), ("PAIR", 1)]),
    "value_word/pair": ("value_word", [("D", 64), ("BITS", 5), ("R", 8), ("NSL", 16), ("PAIR", 1)]),
    "attn_v4/dense_bf16": ("attn_v4", [("TQ", "bf16"), ("D", 256), ("BITS", 3), ("R", 4), ("LQ", 1), ("HKV", 2),
                                       ("CAUSAL", 0), ("ROT", 4), ("NTH", 128), ("TILE", 128)]),
    "attn_v4/rwht_so4": ("attn_v4", [("TQ", "f16"), ("D", 128), ("BITS", 3), ("R", 8), ("LQ", 1), ("HKV", 4),
                                     ("CAUSAL", 0), ("ROT", 11), ("NTH", 128), ("TILE", 128)]),
    "rotate_query/rwht_so4": ("rotate_query", [("D", 128), ("R", 8), ("ROT", 11), ("INV", 0)]),
    "attn_v4/causal_f32": ("attn_v4", [("TQ", "f32"), ("D", 64), ("BITS", 4), ("R", 8), ("LQ", 2), ("HKV", 2),
                                       ("CAUSAL", 1), ("ROT", 0), ("NTH", 128), ("TILE", 128)]),
    "attn_v5/dense_bf16": ("attn_v5", [("TQ", "bf16"), ("D", 256), ("BITS", 3), ("KBITS", 3), ("PK", 0), ("PV", 0), ("R", 4), ("LQ", 1), ("HKV", 2),
                                       ("CAUSAL", 0), ("ROT", 4), ("NTH", 256), ("SACC", 2), ("PF", 1),
                                       ("VDEC", 0), ("STAGE", 2), ("MERGE", 1)]),
    "attn_v5/causal_f32": ("attn_v5", [("TQ", "f32"), ("D", 64), ("BITS", 4), ("KBITS", 4), ("PK", 0), ("PV", 0), ("R", 8), ("LQ", 2), ("HKV", 2),
                                       ("CAUSAL", 1), ("ROT", 0), ("NTH", 128), ("SACC", 2), ("PF", 2),
                                       ("VDEC", 1), ("STAGE", 0), ("MERGE", 0)]),
    # pair codebooks (kv.pair_points (128, 32)): 7- and 5-bit fields, the values' lane-replicated table
    "attn_v5/pair": ("attn_v5", [("TQ", "f16"), ("D", 128), ("BITS", 5), ("KBITS", 7), ("PK", 128), ("PV", 32), ("R", 8),
                                 ("LQ", 1), ("HKV", 4), ("CAUSAL", 0), ("ROT", 3), ("NTH", 256), ("SACC", 1), ("PF", 1),
                                 ("VDEC", 2), ("STAGE", 0), ("MERGE", 1)]),
}
# identifiers (and two phrases) that belong to one backend: the shared sources must not name them
BACKEND_IDS = {"__syncthreads", "__shfl_xor_sync", "threadgroup_barrier", "simd_sum", "simd_max", "simd_shuffle_xor",
               "threadIdx", "blockIdx", "blockDim", "gridDim", "thread_position_in_threadgroup",
               "threadgroup_position_in_grid", "threadgroups_per_grid", "__half", "__half2", "half", "half2",
               "simdgroup_matrix", "__device__", "__shared__", "__forceinline__", "device", "threadgroup", "thread",
               "mem_flags", "__funnelshift_r"}
BACKEND_PHRASES = ("mma.sync", "asm(", "asm volatile")


def test_every_kernel_has_a_case_and_a_body():
    assert set(CASES) == set(K.SPECS)
    for spec in K.SPECS.values():
        assert (K.SRC_DIR / spec.body).is_file()


@pytest.mark.parametrize("name", sorted(K.SPECS))
def test_renderings_differ_only_by_prelude(name, monkeypatch):
    monkeypatch.setenv("RQ_KERNEL_MINIFY", "0")  # the sources as written; minify is checked below
    mh, ms = K.render(name, "metal")
    ch, cs = K.render(name, "cuda")
    m_head, m_start = K.prelude("metal")
    c_head, c_start = K.prelude("cuda")
    assert mh.startswith(m_head) and ch.startswith(c_head)
    assert mh[len(m_head):] == ch[len(c_head):]  # the shared helpers (common.h)
    assert ms.startswith(m_start) and cs.startswith(c_start)
    assert ms[len(m_start):] == cs[len(c_start):]  # the kernel body, written once
    assert ch.endswith("\n")  # cuda_kernel glues the next line onto a header without one


_TOKEN = re.compile(r'"(?:\\.|[^"\\])*"|\'(?:\\.|[^\'\\])*\'|\w+|<<=|>>=|->|\+\+|--|<<|>>|<=|>=|==|!=|&&|\|\||::|##'
                    r"|[-+*/%&|^]=|\\\n|\n|\S")


def _tokens_lines(src: str) -> list[tuple[str, ...]]:
    """(tokens of each logical line that holds any): directives and code alike, continuations joined."""
    src = re.sub(r"//[^\n]*|/\*.*?\*/", lambda m: "\n" * m.group(0).count("\n") or " ", src, flags=re.S)
    src = src.replace("\\\n", " ")
    lines = [tuple(_TOKEN.findall(ln)) for ln in src.split("\n")]
    return [ln for ln in lines if ln]


@pytest.mark.parametrize("be", K.BACKENDS)
def test_minified_sources_have_the_same_tokens(be, monkeypatch):
    """The minified rendering (what MLX gets) is the written one token for token; directives keep their
    lines, and #define NAME (value) keeps the space that makes it an object-like macro."""
    for name in K.SPECS:
        monkeypatch.setenv("RQ_KERNEL_MINIFY", "0")
        raw = K.render(name, be)
        monkeypatch.setenv("RQ_KERNEL_MINIFY", "1")
        small = K.render(name, be)
        for a, b in zip(raw, small):
            assert len(b) < 0.75 * len(a)
            ta = [t for ln in _tokens_lines(a) for t in ln]
            tb = [t for ln in _tokens_lines(b) for t in ln]
            assert ta == tb, name
            da = [ln for ln in _tokens_lines(a) if ln[0] == "#"]
            db = [ln for ln in _tokens_lines(b) if ln[0] == "#"]
            assert da == db, name  # directives line for line
    src = ('#define A (x)\n#define F(x) (x)\n#define N  -1\n#define E\nint a = b - -c; // it\'s\n/* x */ s = "a  // b";\n'
           "#define M(v) \\\n  int v; \\\n  float w\n\nx = a / *p + 'c';\n")
    out = K.minify(src)
    assert out == ('#define A (x)\n#define F(x)(x)\n#define N -1\n#define E\nint a=b- -c;\ns="a  // b";\n'
                   "#define M(v) \\\nint v; \\\nfloat w\nx=a/ *p+'c';\n")


def test_shared_sources_use_no_backend_spelling():
    shared = [K.SRC_DIR / "common.h"] + sorted(K.SRC_DIR.glob("*.body"))
    for path in shared:
        code = "\n".join(line.split("//")[0] for line in path.read_text().splitlines())
        used = set(re.findall(r"[A-Za-z_]\w*", code)) & BACKEND_IDS
        assert not used, f"{path.name} uses {sorted(used)}: they belong in a prelude"
        for phrase in BACKEND_PHRASES:
            assert phrase not in code, f"{path.name} uses {phrase!r}: it belongs in a prelude"


def test_prelude_body_part_names_ids_and_preludes_define_the_same_names():
    defined = {}
    for be in K.BACKENDS:
        head, start = K.prelude(be)
        for name in ("TID", "NT", "BX", "BY", "NBY"):
            assert re.search(rf"const uint {name} =", start), (be, name)
        names = set(re.findall(r"#define (\w+)", head)) | set(re.findall(r"INLINE \w+\s+(\w+)\(", head))
        names |= set(re.findall(r"typedef [\w<>, ]+ (\w+);", head)) | set(re.findall(r"struct (\w+) \{", head))
        defined[be] = names
    shared = "\n".join(p.read_text() for p in [K.SRC_DIR / "common.h"] + sorted(K.SRC_DIR.glob("*.body")))
    used = set(re.findall(r"[A-Za-z_]\w*", shared)) - {"uint"}  # uint: Metal's own, typedef'd for CUDA
    one_sided = {n for n in used if (n in defined["metal"]) != (n in defined["cuda"])}
    assert not one_sided, f"defined by one prelude only: {sorted(one_sided)}"
    assert len(used & defined["cuda"]) > 30


def test_full_source_signature_matches_spec():
    src = K.full_source("attn_mma", "metal", CASES["attn_mma"], {"q": "f16"})
    assert "const device float16_t* q [[buffer(0)]]" in src
    assert "const constant int* k_norms_shape" in src and "k_norms_strides" in src
    assert "uint3 threadgroups_per_grid [[threadgroups_per_grid]]" in src
    src = K.full_source("attn_mma", "cuda", CASES["attn_mma"], {"q": "f16"})
    assert "const __half* q," in src and "using TQ = __half;" in src and "constexpr int D = 128;" in src


def _compiler():
    for cc in ("g++", "clang++"):
        if shutil.which(cc):
            return cc
    return None


@pytest.mark.parametrize("be", ["metal", "cuda"])
def test_syntax_check(be, tmp_path):
    cc = _compiler()
    if cc is None:
        pytest.skip("no C++ compiler")
    if be == "metal":
        prefix = '#include "metal_stub.h"\n'
        inc = STUBS
    else:  # MLX's default CUDA kernel header, with stubs behind its includes
        prefix = ('#include "mlx/backend/cuda/device/utils.cuh"\n#include <cooperative_groups.h>\n'
                  "#define inf cuda::std::numeric_limits<float>::infinity()\n")
        inc = STUBS / "cuda"
    procs = []
    cases = [(n, n, t) for n, t in CASES.items()] + [(k, n, t) for k, (n, t) in EXTRA_CASES.items()]
    for label, name, template in cases:
        tq = dict(template).get("TQ", "f32")
        types = ({"out": "bf16"} if label == "kv_decode/pair"
                 else {"q": tq, "out": tq, "wk": tq, "wv": tq} if name in ("attn_v4w", "attn_v5w")
                 else {"q": tq, "out": tq} if name in ("attn_v4", "attn_v5") else {"q": tq} if name.startswith("attn_mma")
                 else None)
        f = tmp_path / f"{label.replace('/', '_')}.cpp"
        f.write_text(prefix + K.full_source(name, be, template, types))
        cmd = [cc, "-std=c++17", "-fsyntax-only", "-Wno-attributes", "-Wno-unknown-pragmas", f"-I{inc}",
               "-I" + str(STUBS / "cuda"), str(f)]
        procs.append((label, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)))
    errors = []
    for name, p in procs:
        out, _ = p.communicate(timeout=120)
        if p.returncode != 0:
            errors.append(f"{name}:\n{out[:3000]}")
    assert not errors, "\n".join(errors)


def test_split_plan_covers_context():
    for T in (1, 7, 511, 512, 513, 4096, 32768, 131072):
        for groups in (1, 4, 32):
            ns, ch = K.split_plan(T, groups, 256)
            assert ch % 256 == 0 and ns * ch >= T and (ns - 1) * ch < T
            assert groups * ns <= K.TARGET_BLOCKS + groups


def test_mma_shapes():
    assert K.mma_ok(128, 3, 8) and K.mma_ok(256, 3, 8) and K.mma_ok(64, 4, 8)
    assert not K.mma_ok(64, 3, 8) and not K.mma_ok(128, 3, 16)


def test_cpu_has_no_gpu_path():
    import mlx.core as mx

    if K.backend() is not None:
        pytest.skip("a GPU backend is present")
    assert not K.available()
    q = mx.zeros((1, 8, 1, 128))
    assert not K.can_dispatch(q, mx.zeros((1, 2, 4, 12), mx.uint32), 3, None)


def test_reference_matches_project_oracle():
    """benchmarks/kernels_check.py's float64 reference (written from FORMAT.md) agrees with
    rq_core.attention's oracle, so the GPU checks compare against the same function."""
    import mlx.core as mx

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import kernels_check as KC

    from rq_core.attention import dequantized_attention

    rng = np.random.default_rng(0)
    c = KC.make_case(rng, B=1, Hkv=2, G=4, L=3, d=64, T=50, bits=3)
    hk = np.arange(8) // 4
    qt = KC.rotate64(c["q"].astype(np.float64), c["mats"], hk, 3, False)
    args = dict(scale=1 / math.sqrt(64), offset=47, causal=True)
    ours = KC.reference(qt, c["mats"], c["kidx"], c["knorm"], c["vidx"], c["vnorm"], c["levels"], T=50, rot=0, **args)
    theirs = dequantized_attention(mx.array(qt.astype(np.float32)), mx.array(KC.pack64(c["kidx"], 3)),
                                   mx.array(c["knorm"]), mx.array(KC.pack64(c["vidx"], 3)), mx.array(c["vnorm"]),
                                   mx.array(c["levels"]), bits=3, valid_len=50, **args)
    assert np.linalg.norm(np.array(theirs) - ours) / np.linalg.norm(ours) < 1e-5
    # forward then inverse rotation is the identity
    back = KC.rotate64(KC.rotate64(c["q"], c["mats"], hk, 3, False), c["mats"], hk, 3, True)
    assert np.abs(back - c["q"]).max() < 1e-5


def _kc():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import kernels_check as KC

    return KC


@pytest.mark.parametrize("G,L,d,T,rot,causal,bits", [
    (8, 1, 128, 1, 3, False, 3),
    (8, 1, 128, 300, 3, False, 3),  # 3 tiles: fewer tiles than splits asked for
    (4, 1, 64, 1100, 3, False, 4),  # several tiles per split, a partial last tile
    (4, 2, 64, 700, 3, True, 3),  # causal, two query positions
    (1, 1, 64, 513, 1, False, 2),  # WHT only
    (8, 1, 64, 900, 0, False, 3),  # queries already rotated
    (2, 1, 64, 640, 4, False, 3),  # dense rotation (TurboQuant)
])
def test_v4_emulation_matches_reference(G, L, d, T, rot, causal, bits, monkeypatch):
    """attn_v4's algorithm (splits, partials, merge, rotation order), emulated in float64, equals the
    float64 reference math; with the levels rounded to half (as the matrix units see them) it stays
    within the GPU check's tolerance for the matrix-unit path."""
    KC = _kc()
    rng = np.random.default_rng(T * 10 + rot)
    c = KC.make_case(rng, B=2, Hkv=2, G=G, L=L, d=d, T=T, bits=bits, dense=bool(rot & 4))
    scale = 1 / math.sqrt(d)
    monkeypatch.setattr(K, "V4_BLOCKS", 24)  # several splits at these small contexts
    ns = K.v4_plan(T, 4)
    assert 1 <= ns <= K.MMA_TILE
    per = -(-(-(-T // K.MMA_TILE)) // ns) * K.MMA_TILE
    assert (ns - 1) * per < T <= ns * per  # every split non-empty, all of T covered
    ref = KC.reference(c["q"], c["mats"], c["kidx"], c["knorm"], c["vidx"], c["vnorm"], c["levels"], scale=scale,
                       offset=T - L, causal=causal, T=T, rot=rot)
    args = dict(scale=scale, T=T, rot=rot, ns=ns, causal=causal)
    out, lse, parts = KC.emulate_v4(c["q"], c["mats"], c["kidx"], c["knorm"], c["vidx"], c["vnorm"], c["levels"],
                                    **args)
    assert np.linalg.norm(out - ref) / np.linalg.norm(ref) < 1e-12
    # lse (natural log) of the scores in the rotated space
    hk = np.arange(G * 2) // G
    qt = KC.rotate64(c["q"].astype(np.float64), c["mats"], hk, rot, False)
    Kd = c["levels"].astype(np.float64)[c["kidx"][:, :, :T]] * c["knorm"][:, :, :T, None] / math.sqrt(d)
    s = np.einsum("bhld,bhtd->bhlt", qt, Kd[:, hk]) * scale
    if causal:
        s = np.where(np.arange(T)[None, :] <= (T - L + np.arange(L))[:, None], s, -np.inf)
    top = s.max(-1)
    ref_lse = top + np.log(np.exp(s - top[..., None]).sum(-1))
    assert np.abs(lse - ref_lse).max() < 1e-9
    assert parts["o"].shape == (4, ns, G * L, d)
    half, _, _ = KC.emulate_v4(c["q"], c["mats"], c["kidx"], c["knorm"], c["vidx"], c["vnorm"], c["levels"],
                               half_levels=True, **args)
    assert np.linalg.norm(half - ref) / np.linalg.norm(ref) < 2e-3


def test_v4_split_plan_and_counter_pool(monkeypatch):
    for T in (1, 7, 511, 512, 513, 4096, 32768, 131072):
        for groups in (1, 4, 32, 64):
            ns = K.v4_plan(T, groups)
            assert 1 <= ns <= K.MMA_TILE and groups * ns <= max(K.V4_BLOCKS, groups) + groups
    assert K.v4_plan(131072, 4) == 64 and K.v4_plan(32768, 4) == 64 and K.v4_plan(4096, 4) == 32
    assert K.v4_ok(128, 3, 8, "cuda") and K.v4_ok(128, 3, 8, "metal")
    assert K.v4_ok(256, 3, 8, "cuda") and not K.v4_ok(256, 3, 8, "metal")  # Metal: 32 KB threadgroup memory
    assert not K.v4_ok(128, 3, 16, "cuda")
    # counter slots: zeroed views of one pool, successive launches get disjoint slots, the ring wraps
    monkeypatch.setattr(K, "_POOL", {"arr": None, "pos": 0, "views": {}})
    monkeypatch.setattr(K, "COUNTER_POOL", 16)
    a, b, c = K._counter(4), K._counter(4), K._counter(8)
    assert a.dtype == K.mx.uint32 and a.shape == (4,) and int(a.sum()) == 0
    assert K._POOL["pos"] == 16 and K._counter(4) is a  # wrapped: the first slot again, cached view


def test_v5_is_the_default_and_v3_selectable(monkeypatch):
    monkeypatch.delenv("RQ_ATTN", raising=False)
    assert K.attn_version() == "v5"
    monkeypatch.setenv("RQ_ATTN", "v3")
    assert K.attn_version() == "v3"
    if K.backend() is None:  # on CPU the caches keep the reference path whatever RQ_ATTN says
        q = K.mx.zeros((1, 4, 1, 64))
        from rq_core.rotation import Rotation

        assert K.fused_attend(q, Rotation(64, 2), K.mx.zeros((1, 2, 8, 6), K.mx.uint32), K.mx.zeros((1, 2, 8)),
                              K.mx.zeros((1, 2, 8, 6), K.mx.uint32), K.mx.zeros((1, 2, 8)), K.mx.zeros((8,)), bits=3,
                              scale=0.125, offset=7, causal=False, valid_len=8) is None
    monkeypatch.setenv("RQ_ATTN", "v5")
    assert K.attn_version() == "v5"
    monkeypatch.setenv("RQ_ATTN", "v6")
    from rq_core.errors import RQError

    with pytest.raises(RQError):
        K.attn_version()


def test_fused_attend_dispatch(monkeypatch):
    """Which single-launch kernel fused_attend calls (kernels stubbed: no GPU here): v5 by default, with the
    cache's window; v4 when v5 does not take the shape; v4 when asked; TurboQuant's dense rotation to the
    caller's path unless RQ_ATTN is set; v3r never takes a window."""
    from rq_core.rotation import Rotation

    calls = []

    def fake(name, fail=False):
        def f(q, mats, *a, window=None, **kw):
            calls.append((name, window is not None))
            if fail:
                raise K.KernelUnsupported("stub")
            return (K.mx.full(q.shape, 1.0 if name == "v5" else 2.0), None)
        return f

    monkeypatch.setattr(K, "available", lambda: True)
    monkeypatch.setattr(K, "attention_v4", fake("v4"))
    monkeypatch.setattr(K, "attention_v5", fake("v5"))
    monkeypatch.delenv("RQ_ATTN", raising=False)
    q = K.mx.zeros((1, 4, 1, 64))
    codes, norms = K.mx.zeros((1, 2, 8, 6), K.mx.uint32), K.mx.zeros((1, 2, 8))
    win = (K.mx.zeros((1, 2, 4, 64)), K.mx.zeros((1, 2, 4, 64)))

    def attend(rot, window=None):
        return K.fused_attend(q, rot, codes, norms, codes, norms, K.mx.zeros((8,)), bits=3, scale=0.125, offset=11,
                              causal=False, valid_len=8, window=window)

    iso = Rotation(64, 2, variant="wht_so4")
    assert float(attend(iso, win)[0, 0, 0, 0]) == 1.0 and calls == [("v5", True)]
    calls.clear()
    monkeypatch.setattr(K, "attention_v5", fake("v5", fail=True))
    assert float(attend(iso, win)[0, 0, 0, 0]) == 2.0 and calls == [("v5", True), ("v4", True)]
    calls.clear()
    monkeypatch.setenv("RQ_ATTN", "v4")
    assert float(attend(iso)[0, 0, 0, 0]) == 2.0 and calls == [("v4", False)]
    calls.clear()
    monkeypatch.delenv("RQ_ATTN")
    assert attend(Rotation(64, 2, variant="dense")) is None and calls == []
    monkeypatch.setenv("RQ_ATTN", "v3r")
    assert attend(iso, win) is None and calls == []


def test_rotation_args():
    from rq_core.rotation import Rotation

    r = Rotation(64, 2, variant="wht_so4")
    rot, m = K.rotation_args(r)
    assert rot == K.ROT_WHT | K.ROT_SO4 and m.shape == (2, 16, 4, 4) and K.rotation_args(r)[1] is m
    assert K.rotation_args(Rotation(64, 2, variant="wht")) == (K.ROT_WHT, None)
    assert K.rotation_args(Rotation(64, 2, variant="so3"))[0] == K.ROT_SO4
    rot, m = K.rotation_args(Rotation(64, 2, variant="dense"))
    assert rot == K.ROT_DENSE and m.shape == (2, 64, 64)
    # the kernels' convention (y = R x per head, FORMAT.md) against the library's forward rotation
    KC = _kc()
    for variant in ("wht_so4", "dense", "so4", "rwht_so4"):
        r = Rotation(64, 2, variant=variant)
        rot, m = K.rotation_args(r)
        x = np.random.default_rng(1).standard_normal((1, 2, 3, 64)).astype(np.float32)
        ours = KC.rotate64(x, np.array(m), np.arange(2), rot, False)
        theirs = np.array(r.forward(K.mx.array(x)))
        assert np.abs(ours - theirs).max() < 1e-5, variant


def test_v4_epilogue_order():
    """The single-launch protocol, in source order: partials written, fence, count, last block only,
    fence, counter reset, merge reads through ld_dev (L2), inverse rotation, typed store."""
    body = (K.SRC_DIR / "attn_v4.body").read_text()
    code = "\n".join(line.split("//")[0] for line in body.splitlines())
    marks = ["o_part[pbase * D + e] = qt[e]", "DEVICE_FENCE();", "atomic_inc_dev(counter + bh)",
             "if (last_s == 0u) return;", "DEVICE_FENCE();", "atomic_zero_dev(counter + bh)", "ld_dev(ml_part",
             "ld_dev4(o_part", "so4_elem<true>", "wht_rows_lean<D>(qs", "store_f(out"]
    pos = 0
    for m in marks:
        i = code.find(m, pos)
        assert i >= 0, f"{m!r} missing or out of order"
        pos = i + len(m)
    assert "o_part[" not in code[code.index("atomic_inc_dev"):].replace("ld_dev4(o_part", "")


@pytest.mark.parametrize("rot,qdtype,causal,L", [(3, "f32", False, 1), (4, "bf16", False, 1), (3, "f16", True, 2),
                                                 (0, "f32", False, 1)])
def test_kernels_check_v4_plumbing(rot, qdtype, causal, L, monkeypatch):
    """The GPU check's v4 path (argument passing, dense matrices, query dtypes, comparison) run with the
    float64 emulation standing in for the kernel: what the next session runs on the H200."""
    import mlx.core as mx

    from rq_core.packing import unpack

    KC = _kc()

    def fake_v4(q, mats, k_codes, k_norms, v_codes, v_norms, levels, *, bits, scale, valid_len, offset, causal, rot):
        d = q.shape[-1]
        ns = K.v4_plan(valid_len, k_codes.shape[0] * k_codes.shape[1])
        kidx, vidx = np.array(unpack(k_codes, bits, d)), np.array(unpack(v_codes, bits, d))
        out, lse, _ = KC.emulate_v4(np.array(q.astype(mx.float32)), None if mats is None else np.array(mats), kidx,
                                    np.array(k_norms), vidx, np.array(v_norms), np.array(levels), scale=scale,
                                    T=valid_len, rot=rot, ns=ns, causal=causal, half_levels=True)
        return mx.array(out.astype(np.float32)).astype(q.dtype), mx.array(lse.astype(np.float32))

    monkeypatch.setattr(K, "attention_v4", fake_v4)
    rng = np.random.default_rng(5)
    T = 300
    c = KC.make_case(rng, B=1, Hkv=2, G=4, L=L, d=64, T=T, bits=3, dense=bool(rot & 4))
    err, nan, err_h = KC.run_case(K, mx, c, T=T, bits=3, path="v4", strategy=None, causal=causal, offset=T - L,
                                  rot=rot, mma=True, qdtype=qdtype, variant="v4")
    assert nan == 0 and err < (2e-3 if qdtype == "f32" else 4e-3 if qdtype == "f16" else 1.6e-2)
    assert err_h < (5e-5 if qdtype == "f32" else 1e-3 if qdtype == "f16" else 8e-3)  # kernels_check's pass test


@pytest.mark.parametrize("case", [dict(G=8, d=128, T=300), dict(G=2, d=128, T=300, rot=4, B=2, qdtype="bf16"),
                                  dict(G=4, d=128, T=300, rot=11)])
def test_v4_cuda_source_runs_on_cpu_executor(case):
    """The CUDA rendering of attn_v4 itself, executed as host C++ by tests/kernel_emu/cuda_emu.h
    (threads as cooperative contexts, mma.sync emulated from the PTX layouts, blocks in shuffled order):
    correct against float64, every output written, counters left zeroed."""
    if shutil.which("g++") is None or not sys.platform.startswith("linux"):
        pytest.skip("needs g++ and ucontext (Linux)")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import emulate_kernel as EK

    r = EK.run_v4(np.random.default_rng(11), seed=3, **case)
    assert r["ns"] >= 3 and r["nan"] == 0 and r["counters"] == 0
    assert r["err_half"] < (8e-3 if case.get("qdtype") == "bf16" else 5e-5) and r["lse_err"] < 1e-3


@pytest.mark.parametrize("case", [dict(G=8, d=128, T=300, nth=128), dict(G=8, d=128, T=300, nth=128, sacc=1),
                                  dict(G=4, d=128, T=300, nth=256, pf=1, stage=2, rot=11),
                                  dict(G=2, d=128, T=300, L=2, causal=True, rot=4, B=2, qdtype="bf16", nth=256, pf=1,
                                       stage=2),
                                  dict(G=8, d=128, T=1000, nth=256, pf=1, stage=2, vdec=2),
                                  dict(G=8, d=128, T=700, nth=256, pf=1, stage=2, vdec=2, merge=1),
                                  dict(G=8, d=128, T=700, nth=256, pf=1, stage=2, vdec=2, merge=1, sacc=4),
                                  dict(G=4, d=128, T=300, bits=2, L=2, causal=True, qdtype="bf16", nth=128, pf=2,
                                       stage=0, vdec=2),
                                  # the default since session 12: one ring slot, half queries -> single fp16 operands
                                  dict(G=8, d=128, T=1000, nth=256, pf=1, stage=1, vdec=2, merge=1, sacc=1,
                                       qdtype="f16"),
                                  # 384 threads: the warps' merge shares slabs (NSL = 6), round 1 summed in registers
                                  dict(G=8, d=128, T=3000, nth=384, pf=1, stage=1, vdec=2, merge=1, sacc=1, blocks=12),
                                  # 512 threads (128 registers; the (m, l) arrays in the table's padding), f16 queries
                                  dict(G=8, d=128, T=3000, nth=512, pf=1, stage=1, vdec=2, merge=1, sacc=1, blocks=12,
                                       qdtype="f16"),
                                  # pair codebooks (128, 32): 7-bit key fields (lane chunks start mid-word), 5-bit
                                  # values; the ring (T + 5 even: 16-byte aligned heads) and rows through registers
                                  dict(G=8, d=128, T=1001, nth=256, pf=1, stage=1, vdec=2, merge=1, sacc=1, blocks=12,
                                       qdtype="f16", bits=5, key_bits=7, pair_points=(128, 32)),
                                  dict(G=4, d=128, T=301, L=2, causal=True, nth=256, pf=2, stage=0, vdec=2, merge=1,
                                       bits=5, key_bits=7, pair_points=(128, 32)),
                                  # head dim 64: rows of 7 and 5 words (the GPU run refused its unaligned capacity)
                                  dict(G=8, d=64, T=2000, nth=256, pf=1, stage=1, vdec=2, merge=1, sacc=1, blocks=12,
                                       bits=5, key_bits=7, pair_points=(128, 32))])
def test_v5_cuda_source_runs_on_cpu_executor(case):
    """attn_v5's CUDA rendering executed as host C++ (as the v4 test above): warps streaming their own steps,
    per-warp softmax state, the in-block merge, the last block's merge; counters left zeroed. The second
    case takes the code rows through the cp.async ring (STAGE 2; copies done at once by the executor)."""
    if shutil.which("g++") is None or not sys.platform.startswith("linux"):
        pytest.skip("needs g++ and ucontext (Linux)")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import emulate_kernel as EK

    r = EK.run_v5(np.random.default_rng(13), seed=5, **case)
    assert r["ns"] >= 3 and r["nan"] == 0 and r["counters"] == 0
    # f32 queries: fp32 accumulation level (~2e-7 here); dropping one of SACC 4's chains gives 2e-5. f16: the output's
    # own rounding (~2e-4, the same with the hi / lo split); bf16 likewise (~1.6e-3)
    tol = {"bf16": 8e-3, "f16": 5e-4}.get(case.get("qdtype", "f32"), 2e-6)
    assert r["err_half"] < tol and r["lse_err"] < 1e-3


def test_v5_shared_slabs_added_in_place_on_cpu_executor(monkeypatch):
    """RQ_V5_NSLADD (384 threads' merge with warps 0-5 adding into the slabs in place, session 12's default; the
    default now sums round 1 in registers, the 384-thread case above): correct against float64 on the CPU executor,
    f32 and f16 queries."""
    if shutil.which("g++") is None or not sys.platform.startswith("linux"):
        pytest.skip("needs g++ and ucontext (Linux)")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import emulate_kernel as EK

    monkeypatch.setattr(K, "V5_DEFS", ("NSLADD",))
    for qd, tol in (("f32", 2e-6), ("f16", 5e-4)):
        r = EK.run_v5(np.random.default_rng(17), seed=7, G=8, d=128, T=3000, nth=384, pf=1, stage=1, vdec=2, merge=1,
                      sacc=1, blocks=12, qdtype=qd)
        assert r["ns"] >= 3 and r["nan"] == 0 and r["counters"] == 0
        assert r["err_half"] < tol and r["lse_err"] < 1e-3


def test_v5_pair_decode_table_alignment():
    """VDEC 2 addresses its table by OR-ing lane and entry bits onto an 8 KB aligned base: the padded layout is
    the one the host budgets, and a layout that breaks the alignment makes the kernel write NaN, never a
    wrong number."""
    if shutil.which("g++") is None or not sys.platform.startswith("linux"):
        pytest.skip("needs g++ and ucontext (Linux)")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import emulate_kernel as EK

    r = EK.run_v5(np.random.default_rng(23), G=8, d=128, T=200, nth=256, pf=1, stage=2, vdec=2)
    assert r["nan"] == 0 and r["err_half"] < 5e-5
    assert r["smem_bytes"] == K._v5_smem(128, 3, 8, 256, "cuda", 2, vdec=2) == 48136
    r = EK.run_v5(np.random.default_rng(23), G=8, d=128, T=200, nth=256, pf=1, stage=2, vdec=2, layout="worst")
    assert r["nan"] == 2 * 8 * 128  # every output element: 2 kv heads x 8 rows x d


@pytest.mark.parametrize("layout", ["decl", "worst"])
def test_v5_copy_ring_is_16_byte_aligned(layout):
    """The cp.async ring configuration that faulted on the H200 ("misaligned address": 128 threads, 4 stages,
    G = 8, d = 128, 3-bit), on the executor that checks every copy's 16-byte alignment (global source and
    threadgroup destination) against threadgroup arrays laid out as the compiler places them (declaration
    order, each aligned to its type) and at their worst legal alignment; the layout's size is what the host
    budgets (kernels._v5_smem, 45,384 B)."""
    if shutil.which("g++") is None or not sys.platform.startswith("linux"):
        pytest.skip("needs g++ and ucontext (Linux)")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import emulate_kernel as EK

    r = EK.run_v5(np.random.default_rng(17), G=8, d=128, T=200, nth=128, pf=1, stage=4, layout=layout)
    assert r["nan"] == 0 and r["counters"] == 0 and r["err_half"] < 5e-5
    if layout == "decl":
        assert r["smem_bytes"] == K._v5_smem(128, 3, 8, 128, "cuda", 4) == 45384


@pytest.mark.parametrize("kernel,offsets,fault", [("attn_v5", {"k_codes": 2}, "cp.async source (global)"),
                                                  ("attn_v4", {"v_codes": 1}, "load_u4")])
def test_emulator_faults_on_misaligned_access(kernel, offsets, fault):
    """The executor's memory checks can fail: code rows starting 8 (4) bytes off a 16-byte boundary fault in
    v5's cp.async copies (v4's uint4 loads), as on a GPU."""
    if shutil.which("g++") is None or not sys.platform.startswith("linux"):
        pytest.skip("needs g++ and ucontext (Linux)")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import emulate_kernel as EK

    kw = dict(nth=128, pf=1, stage=2) if kernel == "attn_v5" else {}
    with pytest.raises(RuntimeError, match=f"misaligned address: {re.escape(fault)}"):
        EK.run_v4(np.random.default_rng(19), G=8, d=128, T=40, kernel=kernel, offsets=offsets, **kw)


def test_code_rows_16_byte_aligned_for_every_kernel_shape():
    """v4's uint4 row loads and v5's 16-byte row copies need each code row 16-byte aligned: true for every
    shape the matrix-unit kernels take (W, the words of a row, a multiple of 4), given a buffer that starts
    aligned (MLX's allocations above 8 bytes do). A shape with W % 4 != 0 would need a host-side check."""
    for D in (32, 64, 96, 128, 256):
        for bits in (1, 2, 3, 4):
            if K.mma_ok(D, bits, 8):
                assert (D * bits // 32) % 4 == 0, (D, bits)


def test_v5_plan_and_shapes():
    for T in (1, 7, 511, 512, 513, 4096, 32768, 131072):
        for groups in (1, 4, 32):
            ns = K.v5_plan(T, groups)
            assert 1 <= ns <= K.V5_MAXNS and (ns - 1) * 128 < T
    assert K.v5_plan(131072, 4, 132) == 33 and K.v5_plan(131072, 4, 264) == 66 and K.v5_plan(4096, 4, 132) == 32
    if K.V5_BLOCKS == 0:  # one block an SM of the H200 at every context
        assert K.v5_plan(32768, 4) == 33 and K.v5_plan(131072, 4) == 33 and K.v5_plan(65535, 4) == 33
    for be in ("cuda", "metal"):  # every head dim the kernels cover fits threadgroup memory at 512 threads
        assert K.v5_ok(128, 3, 8, be, 512, 0) and K.v5_ok(256, 3, 8, be, 512, 0) and K.v5_ok(64, 4, 8, be, 512, 0)
    assert not K.v5_ok(128, 3, 16, "cuda") and not K.v5_ok(128, 3, 8, "cuda", 96)
    # the default (256 threads, 1-slot ring) fits CUDA at head_dim 128; head_dim 256 and Metal take STAGE 0
    assert K.v5_ok(128, 3, 8, "cuda", K.v5_nth(4096), K.V5_STAGE) or "RQ_V5_NTH" in __import__("os").environ
    # 384 threads (long contexts on CUDA) fit with the default ring only
    assert not K.v5_ok(256, 3, 8, "cuda", 256, 2) and K.v5_ok(256, 3, 8, "cuda", 256, 0)
    # the copy ring: 2 slots of 8 warps fit CUDA's 48 KB, 3 do not; Metal: no. With the pair decode's padded table
    # the bytes are nvcc's reports (sm_90, benchmarks/diag/nvcc_v5.py, 2026-11-30): 35,848 (1 slot), 48,136 (2), 41,992
    # (384 threads, 1 slot), 45,064 (448), 48,136 (512: fits since the (m, l) arrays sit in the table's padding)
    assert K._v5_smem(128, 3, 8, 256, "cuda", 2) == 45640
    assert [K._v5_smem(128, 3, 8, n, "cuda", st, 2) for n, st in ((256, 1), (256, 2), (384, 1), (448, 1), (512, 1))] \
        == [35848, 48136, 41992, 45064, 48136]
    assert K.v5_ok(128, 3, 8, "cuda", 512, 1, 2)
    # pair codebooks (128, 32): 31,752 B with the keys' own table (256 threads, one slot: nvcc's report and the
    # executor's layout); 384 threads fit the ring; head dim 64 too (lane chunks funnel-shifted, its 3-bit codes not)
    pair = dict(vdec=2, kbits=7, pair=(128, 32))
    assert K._v5_smem(128, 5, 8, 256, "cuda", 1, **pair) == 31752 and K.v5_ok(128, 5, 8, "cuda", 384, 1, **pair)
    assert K.v5_ok(64, 5, 8, "cuda", 256, 1, **pair) and not K.v5_ok(64, 3, 8, "cuda", 256, 1)
    assert K.v5_ok(128, 3, 8, "cuda", 256, 2) and not K.v5_ok(128, 3, 8, "cuda", 256, 3)
    assert not K.v5_ok(128, 3, 8, "metal", 256, 2)


def test_kernels_check_v5_plumbing(monkeypatch):
    """kernels_check's v5 path (configuration passing, query dtype, comparison) with the float64 emulation
    of the algorithm standing in for the kernel."""
    import mlx.core as mx

    from rq_core.packing import unpack

    KC = _kc()
    seen = []

    def fake_v5(q, mats, k_codes, k_norms, v_codes, v_norms, levels, *, bits, scale, valid_len, offset, causal, rot,
                nth=None, minb=None, pf=None, vdec=None, stage=None):
        seen.append((nth, minb, pf))
        d = q.shape[-1]
        kidx, vidx = np.array(unpack(k_codes, bits, d)), np.array(unpack(v_codes, bits, d))
        out, lse, _ = KC.emulate_v4(np.array(q.astype(mx.float32)), None if mats is None else np.array(mats), kidx,
                                    np.array(k_norms), vidx, np.array(v_norms), np.array(levels), scale=scale,
                                    T=valid_len, rot=rot, ns=K.v5_plan(valid_len, 2), causal=causal, half_levels=True)
        return mx.array(out.astype(np.float32)).astype(q.dtype), mx.array(lse.astype(np.float32))

    monkeypatch.setattr(K, "attention_v5", fake_v5)
    c = KC.make_case(np.random.default_rng(6), B=1, Hkv=2, G=4, L=1, d=64, T=300, bits=3)
    err, nan, err_h = KC.run_case(K, mx, c, T=300, bits=3, path="v5", strategy=None, causal=False, offset=299,
                                  rot=3, mma=True, qdtype="f16", variant="v5", v5cfg=(512, 0, 1))
    assert seen == [(512, 0, 1)] and nan == 0 and err_h < 1e-3


def test_v5_blocks_one_an_sm(monkeypatch):
    """attn_v5's grid: one block an SM of the CUDA device (its launch bound allows one), the H200's 132 where the
    driver cannot be asked or on other backends, RQ_V5_BLOCKS over both."""
    monkeypatch.setattr(K, "V5_BLOCKS", 0)
    monkeypatch.setattr(K, "backend", lambda: "cuda")
    monkeypatch.setattr(K, "cuda_sm_count", lambda: 108)
    assert K.v5_blocks(4096) == 108 and K.v5_plan(131072, 4) == 27
    monkeypatch.setattr(K, "cuda_sm_count", lambda: None)
    assert K.v5_blocks(131072) == K.V5_BLOCKS_DEFAULT == 132
    monkeypatch.setattr(K, "backend", lambda: "metal")
    assert K.v5_blocks(32768) == 132
    monkeypatch.setattr(K, "V5_BLOCKS", 264)
    assert K.v5_blocks(32768) == 264
    # a group count that does not divide the grid rounds the splits down: no block past one an SM
    monkeypatch.setattr(K, "V5_BLOCKS", 0)
    monkeypatch.setattr(K, "backend", lambda: "cuda")
    monkeypatch.setattr(K, "cuda_sm_count", lambda: 132)
    assert K.v5_plan(131072, 8) == 16 and K.v5_plan(131072, 5) == 26 and K.v5_plan(131072, 200) == 1


def test_v5_threads_by_context(monkeypatch):
    """attn_v5's threads a block: 256, and 384 (one ring slot, launch bound (384, 1)) from V5_NTH_LONG packed tokens
    on CUDA; RQ_V5_NTH over both."""
    monkeypatch.setattr(K, "V5_NTH", 0)
    monkeypatch.setattr(K, "backend", lambda: "cuda")
    assert K.v5_nth(32768) == 256 and K.v5_nth(K.V5_NTH_LONG - 1) == 256
    assert K.v5_nth(K.V5_NTH_LONG) == 384 and K.v5_nth(131072) == 384
    assert K._v5_minb(384, None) == 1 and K._v5_minb(256, None) == 1 and K._v5_minb(512, None) == 1
    assert K._v5_minb(128, None) == 0
    assert K.v5_ok(128, 3, 8, "cuda", 384, K.V5_STAGE) and not K.v5_ok(128, 3, 8, "cuda", 384, 2)
    monkeypatch.setattr(K, "backend", lambda: "metal")
    assert K.v5_nth(131072) == 256
    monkeypatch.setattr(K, "V5_NTH", 128)
    assert K.v5_nth(131072) == 128


def test_v5_launch_bound_and_merge_round(monkeypatch):
    """The default CUDA build of attn_v5: launch bound (256, 1) (one block an SM, registers uncapped) with the
    merge's 33 partial loads in one round (RQ_V5_NC33); at (256, 2) the 128-register cap keeps rounds of 17."""
    import mlx.core as mx

    seen = {}

    def fake(**kw):
        seen[kw["name"]] = kw
        return kw

    monkeypatch.setattr(mx.fast, "cuda_kernel", fake)
    K._kernel_v5.cache_clear()
    try:
        assert K._v5_minb(256, None) == (1 if K.V5_MINB < 0 else K.V5_MINB)
        one = K._kernel_v5("cuda", 256, 1)
        two = K._kernel_v5("cuda", 256, 2)
        big = K._kernel_v5("cuda", 512, 1)
    finally:
        K._kernel_v5.cache_clear()
    assert "__launch_bounds__(256, 1)" in one["header"] and "#define RQ_V5_NC33 1" in one["source"]
    assert "__launch_bounds__(256, 2)" in two["header"] and "#define RQ_V5_NC33" not in two["source"]
    # 512 threads: one block an SM caps registers at 128 anyway, so rounds of 17
    assert "__launch_bounds__(512, 1)" in big["header"] and "#define RQ_V5_NC33" not in big["source"]
    assert one["name"] != two["name"]  # MLX caches modules by name


def test_v5_launch_plan_follows_settings_and_shapes(monkeypatch):
    """attention_v5 plans a class of calls once (_v5_launch_plan): a changed module setting, context or window gives
    a new plan, an identical call the same launch arguments as the first."""
    import mlx.core as mx

    calls = []

    class Recorder:
        def __call__(self, *, inputs, template, grid, threadgroup, output_shapes, output_dtypes, init_value=None, **_):
            calls.append((tuple(template), grid, threadgroup, tuple(map(tuple, output_shapes))))
            return [mx.zeros(s, d) for s, d in zip(output_shapes, output_dtypes)]

    monkeypatch.setenv("RQ_KERNEL_CACHE", "0")
    monkeypatch.setattr(K, "backend", lambda: "cuda")
    monkeypatch.setattr(K, "cuda_sm_count", lambda: 132)
    monkeypatch.setattr(K, "_kernel_v5", lambda *a, **k: Recorder())
    G, Hkv, D, cap = 8, 4, 128, 4096
    q = mx.zeros((1, G * Hkv, 1, D), mx.float16)
    codes = mx.zeros((1, Hkv, cap, 12), mx.uint32)
    norms = mx.zeros((1, Hkv, cap), mx.float16)
    lv = mx.zeros((8,), mx.float32)

    def launch(T, window=None):
        K.attention_v5(q, None, codes, norms, codes, norms, lv, bits=3, scale=0.1, valid_len=T, offset=T, rot=0,
                       window=window, want_lse=False)
        return calls[-1]

    first = launch(1000)
    assert launch(1000) == first
    assert launch(3000)[1] != first[1]  # more splits
    long = launch(20000)
    monkeypatch.setattr(K, "V5_SACC", 2)
    assert dict(launch(1000)[0])["SACC"] == 2 and dict(first[0])["SACC"] == 1
    monkeypatch.setattr(K, "cuda_sm_count", lambda: 66)
    assert launch(20000)[1][1] < long[1][1]  # half the SMs: fewer splits
    w = mx.zeros((1, Hkv, 40, D), mx.float16)
    assert dict(launch(1000, (w, w))[0])["WCAUSAL"] == 0
