"""CPU-side checks of the GPU kernel sources (rq_core.kernels.launch, metal/).

The kernels themselves run only on a GPU (tools/gpu_check.py checks them there against float64 math).
Here: the renderer, that the Metal and CUDA renderings differ only by the prelude, a compile-level syntax
check of both renderings with a host C++ compiler against stub headers for Metal's and CUDA's built-ins
(tests/kernel_stubs/), and both renderings of attn_fused (and the Metal renderings of the four-kernel pipeline)
executed on the CPU (tests/kernel_emu/emulate.py) against float64; the compiler tests are skipped when no compiler
is installed.
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

import rq_core.kernels.launch as K
from rq_core.kernels import config as env

STUBS = Path(__file__).resolve().parent / "kernel_stubs"
ROOT = Path(__file__).resolve().parent.parent

# one representative shape class per kernel: (template, input dtype overrides)
CASES = {
    "rotate_query": [("D", 128), ("R", 8), ("ROT", 3), ("INV", 0)],
    "rotate_inverse": [("D", 256), ("R", 1), ("ROT", 2), ("INV", 1)],
    "qk_dot": [("D", 64), ("BITS", 4), ("R", 4), ("LQ", 1), ("TPT", 4), ("THREADS", 128), ("PAIR", 0)],
    "softmax": [("THREADS", 256)],
    "value_dim": [("D", 128), ("BITS", 3), ("R", 8), ("THREADS", 128), ("TILE", 128), ("PAIR", 0)],
    "value_reduce": [("D", 128), ("R", 8)],
    "value_word": [("D", 128), ("BITS", 2), ("R", 8), ("NSL", 32), ("PAIR", 0)],
    "attn_fused": [("TQ", "f16"), ("D", 128), ("BITS", 3), ("KBITS", 3), ("PK", 0), ("PV", 0), ("R", 8), ("LQ", 1),
                   ("HKV", 4), ("NRG", 1), ("CAUSAL", 0), ("ROT", 3), ("THREADS", 384), ("SACC", 2), ("PF", 2), ("VDEC", 1),
                   ("STAGE", 0), ("MERGE", 0)],
    "attn_fused_window": [("TQ", "bf16"), ("D", 128), ("BITS", 3), ("KBITS", 4), ("PK", 0), ("PV", 0), ("R", 8),
                          ("LQ", 2), ("HKV", 4), ("NRG", 1), ("CAUSAL", 0), ("ROT", 4), ("THREADS", 256), ("SACC", 2), ("PF", 1),
                          ("VDEC", 2), ("STAGE", 2), ("MERGE", 1), ("WCAUSAL", 1)],
    "kv_append": [("TK", "f16"), ("D", 128), ("BITS", 3), ("KBITS", 4), ("ROT", 3), ("NC", 0), ("PK", 0), ("PV", 0)],  # more in test_kv_append_kernel
    "kv_decode": [("D", 128), ("FB", 3), ("PAIR", 0), ("THREADS", 128)],
}
# more shape classes (bf16 queries, dense rotation, causal, no rotation, pair codebooks)
EXTRA_CASES = {
    "kv_decode/pair": ("kv_decode", [("D", 128), ("FB", 7), ("PAIR", 1), ("THREADS", 64)]),
    # the four kernels with pair codebooks (128, 32): 7-bit key fields, 5-bit value fields
    "qk_dot/pair": ("qk_dot", [("D", 128), ("BITS", 7), ("R", 8), ("LQ", 1), ("TPT", 2), ("THREADS", 128),
                               ("PAIR", 1)]),
    "value_dim/pair": ("value_dim", [("D", 128), ("BITS", 5), ("R", 8), ("THREADS", 128), ("TILE", 128),
                                     ("PAIR", 1)]),
    "value_word/pair": ("value_word", [("D", 64), ("BITS", 5), ("R", 8), ("NSL", 16), ("PAIR", 1)]),
    "rotate_query/rwht_so4": ("rotate_query", [("D", 128), ("R", 8), ("ROT", 11), ("INV", 0)]),
    "rotate_inverse/dense": ("rotate_inverse", [("D", 128), ("R", 8), ("ROT", 4), ("INV", 1)]),
    "attn_fused/dense_bf16": ("attn_fused", [("TQ", "bf16"), ("D", 256), ("BITS", 3), ("KBITS", 3), ("PK", 0),
                                             ("PV", 0), ("R", 4), ("LQ", 1), ("HKV", 2), ("NRG", 1), ("CAUSAL", 0), ("ROT", 4),
                                             ("THREADS", 256), ("SACC", 2), ("PF", 1), ("VDEC", 0), ("STAGE", 2),
                                             ("MERGE", 1)]),
    "attn_fused/causal_f32": ("attn_fused", [("TQ", "f32"), ("D", 64), ("BITS", 4), ("KBITS", 4), ("PK", 0),
                                             ("PV", 0), ("R", 8), ("LQ", 2), ("HKV", 2), ("NRG", 1), ("CAUSAL", 1), ("ROT", 0),
                                             ("THREADS", 128), ("SACC", 2), ("PF", 2), ("VDEC", 1), ("STAGE", 0),
                                             ("MERGE", 0)]),
    "attn_fused/rwht_so4": ("attn_fused", [("TQ", "f16"), ("D", 128), ("BITS", 3), ("KBITS", 3), ("PK", 0),
                                           ("PV", 0), ("R", 8), ("LQ", 1), ("HKV", 4), ("NRG", 1), ("CAUSAL", 0), ("ROT", 11),
                                           ("THREADS", 256), ("SACC", 1), ("PF", 1), ("VDEC", 2), ("STAGE", 1),
                                           ("MERGE", 1)]),
    # pair codebooks (kv.pair_points (128, 32)): 7- and 5-bit fields, the values' lane-replicated table
    "attn_fused/pair": ("attn_fused", [("TQ", "f16"), ("D", 128), ("BITS", 5), ("KBITS", 7), ("PK", 128), ("PV", 32),
                                       ("R", 8), ("LQ", 1), ("HKV", 4), ("NRG", 1), ("CAUSAL", 0), ("ROT", 3), ("THREADS", 256),
                                       ("SACC", 1), ("PF", 1), ("VDEC", 2), ("STAGE", 0), ("MERGE", 1)]),
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
    monkeypatch.setattr(env, "_CONFIG", env.KernelConfig(minify=False))  # as written; minify is checked below
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
        monkeypatch.setattr(env, "_CONFIG", env.KernelConfig(minify=False))
        raw = K.render(name, be)
        monkeypatch.setattr(env, "_CONFIG", env.KernelConfig(minify=True))
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
    src = K.full_source("attn_fused", "metal", CASES["attn_fused"], {"q": "f16"})
    assert "const device float16_t* q [[buffer(0)]]" in src
    assert "const constant int32_t* meta" in src and "k_codes_strides" in src  # 2 elements: constant, as MLX has it
    assert "uint3 threadgroups_per_grid [[threadgroups_per_grid]]" in src
    src = K.full_source("attn_fused", "cuda", CASES["attn_fused"], {"q": "f16"})
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
                 else {"q": tq, "out": tq, "wk": tq, "wv": tq} if name == "attn_fused_window"
                 else {"q": tq, "out": tq} if name == "attn_fused" else None)
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
    codes, norms = mx.zeros((1, 2, 4, 12), mx.uint32), mx.zeros((1, 2, 4), mx.float16)
    with pytest.raises(K.KernelUnsupported, match="no GPU backend"):
        K.fused_attention(q, None, codes, norms, codes, norms, mx.zeros((8,)), bits=3, scale=0.1, valid_len=4)


def test_reference_matches_project_oracle():
    """tests/kernel_emu/attn_reference.py's float64 reference (written from FORMAT.md) agrees with
    rq_core.attention.reference's oracle, so the GPU checks compare against the same function."""
    import mlx.core as mx

    from kernel_emu import attn_reference as KC

    from rq_core.attention.reference import dequantized_attention

    rng = np.random.default_rng(0)
    c = KC.make_case(rng, B=1, Hkv=2, G=4, L=3, d=64, T=50, bits=3)
    hk = np.arange(8) // 4
    qt = KC.rotate64(c["q"].astype(np.float64), c["mats"], hk, 3, False)
    args = dict(scale=1 / math.sqrt(64), offset=47, causal=True)
    ours = KC.reference(qt, c["mats"], c["kidx"], c["knorm"], c["vidx"], c["vnorm"], c["levels"], T=50, rot=0, **args)
    theirs = dequantized_attention(mx.array(qt.astype(np.float32)), mx.array(KC.pack64(c["kidx"], 3)),
                                   mx.array(c["knorm"]), mx.array(KC.pack64(c["vidx"], 3)), mx.array(c["vnorm"]),
                                   mx.array(c["levels"]), bits=3, valid_len=50, **args)
    # float32 MLX against float64: measured <= 2.5e-7 over 10 seeds; 4x margin
    assert np.linalg.norm(np.array(theirs) - ours) / np.linalg.norm(ours) < 1e-6
    # forward then inverse rotation is the identity (float64 throughout, |q| < 8: measured <= 2.7e-15; 3.7x)
    back = KC.rotate64(KC.rotate64(c["q"], c["mats"], hk, 3, False), c["mats"], hk, 3, True)
    assert np.abs(back - c["q"]).max() < 1e-14


def _kc():
    from kernel_emu import attn_reference as KC

    return KC


def test_counter_pool(monkeypatch):
    """attn_fused's split counters: zeroed views of one pool, successive launches get disjoint slots, the ring wraps."""
    monkeypatch.setattr(K, "_POOL", {"arr": None, "pos": 0, "views": {}})
    monkeypatch.setattr(K, "COUNTER_POOL", 32)
    a, b, c = K._counter(4), K._counter(4), K._counter(12)  # slots of at least 8: 8, 8, 12
    assert a.dtype == K.mx.uint32 and a.shape == (8,) and c.shape == (12,) and int(a.sum()) == 0
    assert K._POOL["pos"] == 28 and K._counter(4) is a  # wrapped: the first slot again, cached view
    assert K._POOL["pos"] == 8


def test_rotation_args():
    from rq_core.codec.rotation import Rotation

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
        # float32 forward against float64 of the same parameters: measured <= 9.5e-7 (dense, 2 float32 ulps at
        # |y| ~ 4) over 8 seeds; 2.6x margin
        assert np.abs(ours - theirs).max() < 2.5e-6, variant


# attn_fused shape classes on the executor: (case, which renderings run it). The Metal rendering runs a subset that
# covers each configuration axis (SACC, ring STAGE, VDEC, MERGE, 384 threads, query dtypes, pair codebooks,
# head dim 64, head dim 512), as compiling a program per class is most of the suite's time
FUSED_CASES = [dict(G=8, d=128, T=300, nth=128), dict(G=8, d=128, T=300, nth=128, sacc=1),
               dict(G=4, d=128, T=300, nth=256, pf=1, stage=2, rot=11),
               dict(G=2, d=128, T=300, L=2, causal=True, rot=4, B=2, qdtype="bf16", nth=256, pf=1,
                    stage=2),
               dict(G=8, d=128, T=1000, nth=256, pf=1, stage=2, vdec=2),
               dict(G=8, d=128, T=700, nth=256, pf=1, stage=2, vdec=2, merge=1),
               dict(G=8, d=128, T=700, nth=256, pf=1, stage=2, vdec=2, merge=1, sacc=4),
               dict(G=4, d=128, T=300, bits=2, L=2, causal=True, qdtype="bf16", nth=128, pf=2,
                    stage=0, vdec=2),
               # the default: one ring slot, half queries -> single fp16 operands
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
               # head dim 64: rows of 7 and 5 words
               dict(G=8, d=64, T=2000, nth=256, pf=1, stage=1, vdec=2, merge=1, sacc=1, blocks=12,
                    bits=5, key_bits=7, pair_points=(128, 32)),
               # more query heads a kv head than a fragment's 8 rows: blocks of 8 rows (NRG of them a kv head).
               # Nemotron 3's 16 (pair codebooks, the default configuration), 32 with 4-bit scalar codes (edge layers),
               # and 16 heads of 2 causal rows in 4 blocks of 4 heads (keys at 4 bits, values at 3)
               dict(G=16, d=128, T=300, nth=256, pf=1, stage=1, vdec=2, merge=1, sacc=1, blocks=12,
                    qdtype="f16", bits=5, key_bits=7, pair_points=(128, 32)),
               dict(G=32, d=128, T=300, nth=256, pf=1, stage=1, vdec=2, merge=1, sacc=1, blocks=24, Hkv=1,
                    qdtype="f16", bits=4),
               dict(G=16, d=128, T=300, L=2, causal=True, nth=256, pf=1, stage=1, vdec=2, merge=1, sacc=1,
                    blocks=24, key_bits=4),
               # head dim 512 (Gemma 4's global layers: R = 8 over 2 kv heads): a block per value-dim half, the query's
               # fragments in threadgroup memory, rows through registers. Pair codebooks (the default), 4-bit scalar codes
               # with f32 queries (hi and lo fragments), causal rows with 4-bit keys, the warps' merge in rounds of two
               # slabs with byte-permute values
               dict(G=8, d=512, T=300, nth=256, pf=1, stage=0, vdec=2, merge=1, sacc=1, blocks=12,
                    qdtype="f16", bits=5, key_bits=7, pair_points=(128, 32)),
               dict(G=8, d=512, T=300, nth=256, pf=2, stage=0, vdec=2, merge=1, sacc=2, blocks=12, bits=4),
               dict(G=4, d=512, T=301, L=2, causal=True, nth=256, pf=1, stage=0, vdec=2, merge=1, sacc=1,
                    blocks=12, key_bits=4, qdtype="bf16"),
               dict(G=8, d=512, T=300, nth=128, pf=1, stage=0, vdec=1, merge=0, sacc=2, blocks=12, rot=11,
                    qdtype="f16")]
METAL_FUSED = {1, 2, 3, 5, 8, 9, 11, 13, 14, 15, 16, 17, 19}


@pytest.mark.parametrize("backend,case", [pytest.param(be, c, id=f"{be}-case{i}") for be in ("cuda", "metal")
                                          for i, c in enumerate(FUSED_CASES) if be == "cuda" or i in METAL_FUSED])
def test_fused_source_runs_on_cpu_executor(backend, case):
    """attn_fused's CUDA rendering (tests/kernel_emu/cuda_emu.h: inline PTX executed by its semantics, mma.sync with
    the PTX ISA's fragment layouts) and its Metal rendering (metal_emu.h: SIMD-group functions across the 32 lanes,
    simdgroup_matrix with Apple's lane layout) executed as host C++, threads as cooperative contexts, blocks in
    shuffled order: warps streaming their own steps, per-warp softmax state, the in-block merge, the last block's
    merge; correct against float64, every output written, counters left zeroed. Cases with STAGE > 0 take the code
    rows through the copy ring (CUDA: cp.async copies that land at issue or only at their wait_group, at random)."""
    if shutil.which("g++") is None or not sys.platform.startswith("linux"):
        pytest.skip("needs g++ and ucontext (Linux)")
    from kernel_emu import emulate as EK

    r = EK.run_fused(np.random.default_rng(13), seed=5, backend=backend, **case)
    assert r["ns"] >= 3 and r["nan"] == 0 and r["counters"] == 0
    # Measured over 8 seeds, every case and backend. f32 queries: fp32 accumulation, <= 5.9e-7 (3.4x margin); dropping
    # one of SACC 4's chains gives 2e-5. f16 / bf16: the output's own rounding, at most 2^-11 / 2^-8 of its norm (4.9e-4 /
    # 3.9e-3; measured <= 3.0e-4 / 1.7e-3, the same with the hi / lo split).
    # lse against the half-rounded key levels: f32 <= 1.0e-6; half queries (the rotated query rounded to half for the
    # matrix units) <= 1.4e-4; 3x margin. Against the exact levels it is the levels' rounding (up to 3.1e-4) instead.
    half = case.get("qdtype", "f32") != "f32"
    tol = {"bf16": 4e-3, "f16": 5e-4}.get(case.get("qdtype", "f32"), 2e-6)
    assert r["err_half"] < tol and r["lse_err_half"] < (4e-4 if half else 3e-6)
    if case["d"] == 512:  # the launch plan's threadgroup bytes are the body's arena
        R = case["G"] // K.row_blocks(case["G"], case.get("L", 1)) * case.get("L", 1)
        assert r["smem_bytes"] == K._fused_smem(512, case.get("bits", 3), R, case["nth"], backend, case["stage"],
                                                case["vdec"], case.get("key_bits"), case.get("pair_points"),
                                                case.get("qdtype", "f32") != "f32")


def test_pair_decode_table_alignment():
    """VDEC 2 addresses its table by OR-ing lane and entry bits onto an 8 KB aligned base: the padded layout is
    the one the host budgets, and a layout that breaks the alignment makes the kernel write NaN, never a
    wrong number."""
    if shutil.which("g++") is None or not sys.platform.startswith("linux"):
        pytest.skip("needs g++ and ucontext (Linux)")
    from kernel_emu import emulate as EK

    r = EK.run_fused(np.random.default_rng(23), G=8, d=128, T=200, nth=256, pf=1, stage=2, vdec=2)
    assert r["nan"] == 0 and r["err_half"] < 2e-6  # f32 queries: measured <= 4.8e-7 over 8 seeds; 4x margin
    assert r["smem_bytes"] == K._fused_smem(128, 3, 8, 256, "cuda", 2, vdec=2) == 48136
    r = EK.run_fused(np.random.default_rng(23), G=8, d=128, T=200, nth=256, pf=1, stage=2, vdec=2, layout="worst")
    assert r["nan"] == 2 * 8 * 128  # every output element: 2 kv heads x 8 rows x d


@pytest.mark.parametrize("layout", ["decl", "worst"])
def test_copy_ring_is_16_byte_aligned(layout):
    """The cp.async ring configuration that faulted on the H200 ("misaligned address": 128 threads, 4 stages,
    G = 8, d = 128, 3-bit), on the executor that checks every copy's 16-byte alignment (global source and
    threadgroup destination) against threadgroup arrays laid out as the compiler places them (declaration
    order, each aligned to its type) and at their worst legal alignment; the layout's size is what the host
    budgets (kernels._fused_smem, 45,384 B)."""
    if shutil.which("g++") is None or not sys.platform.startswith("linux"):
        pytest.skip("needs g++ and ucontext (Linux)")
    from kernel_emu import emulate as EK

    r = EK.run_fused(np.random.default_rng(17), G=8, d=128, T=200, nth=128, pf=1, stage=4, layout=layout)
    # f32 queries: measured <= 4.8e-7 over 8 seeds (both layouts); 4x margin
    assert r["nan"] == 0 and r["counters"] == 0 and r["err_half"] < 2e-6
    if layout == "decl":
        assert r["smem_bytes"] == K._fused_smem(128, 3, 8, 128, "cuda", 4) == 45384


@pytest.mark.parametrize("stage,offsets,fault", [(2, {"k_codes": 2}, "cp.async source (global)")])
def test_emulator_faults_on_misaligned_access(stage, offsets, fault):
    """The executor's memory checks can fail: code rows starting 8 bytes off a 16-byte boundary fault in the
    cp.async copies, as on a GPU."""
    if shutil.which("g++") is None or not sys.platform.startswith("linux"):
        pytest.skip("needs g++ and ucontext (Linux)")
    from kernel_emu import emulate as EK

    kw = dict(nth=128, pf=1, stage=2) if stage else dict(nth=128, pf=2, stage=0)
    with pytest.raises(RuntimeError, match=f"misaligned address: {re.escape(fault)}"):
        EK.run_fused(np.random.default_rng(19), G=8, d=128, T=40, offsets=offsets, **kw)


def test_code_rows_16_byte_aligned_for_every_kernel_shape():
    """attn_fused's uint4 row loads and 16-byte row copies need each code row 16-byte aligned: true for every
    shape the matrix-unit steps take (W, the words of a row, a multiple of 4), given a buffer that starts
    aligned (MLX's allocations above 8 bytes do). A shape with W % 4 != 0 would need a host-side check."""
    for D in (32, 64, 96, 128, 256):
        for bits in (1, 2, 3, 4):
            if K.mma_ok(D, bits, 8):
                assert (D * bits // 32) % 4 == 0, (D, bits)


def test_fused_plan_and_shapes():
    for T in (1, 7, 511, 512, 513, 4096, 32768, 131072):
        for groups in (1, 4, 32):
            ns = K.fused_splits(T, groups)
            assert 1 <= ns <= K.MAX_SPLITS and (ns - 1) * 128 < T
    assert K.fused_splits(131072, 4, 132) == 33 and K.fused_splits(131072, 4, 264) == 66
    assert K.fused_splits(4096, 4, 132) == 32
    # one block an SM of the H200 at every context (no GPU here: the default target)
    assert K.fused_splits(32768, 4) == 33 and K.fused_splits(131072, 4) == 33 and K.fused_splits(65535, 4) == 33
    for be in ("cuda", "metal"):  # every head dim the kernels cover fits threadgroup memory at 512 threads
        assert K.fused_ok(128, 3, 8, be, 512, 0) and K.fused_ok(256, 3, 8, be, 512, 0)
        assert K.fused_ok(64, 4, 8, be, 512, 0)
    assert not K.fused_ok(128, 3, 16, "cuda") and not K.fused_ok(128, 3, 8, "cuda", 96)
    # head dim 512: rows through registers (no ring); f16 / bf16 queries fit both backends, f32 queries' hi and lo
    # fragments CUDA only
    assert K.fused_ok(512, 3, 8, "metal", 256, 0, half=True) and not K.fused_ok(512, 3, 8, "metal", 256, 0)
    assert K.fused_ok(512, 3, 8, "cuda", 256, 0, 2) and not K.fused_ok(512, 3, 8, "cuda", 256, 1, half=True)
    assert K.fused_ok(512, 5, 8, "metal", 256, 0, 2, 7, (128, 32), half=True)
    # the default (256 threads, 1-slot ring) fits CUDA at head_dim 128; head_dim 256 and Metal take STAGE 0
    assert K.fused_ok(128, 3, 8, "cuda", K.fused_threads(4096), K.FUSED_STAGE)
    assert not K.fused_ok(256, 3, 8, "cuda", 256, 2) and K.fused_ok(256, 3, 8, "cuda", 256, 0)
    # the copy ring: 2 slots of 8 warps fit CUDA's 48 KB, 3 do not; Metal: no. With the pair decode's padded table
    # the bytes are nvcc's reports (sm_90): 35,848 (1 slot), 48,136 (2), 41,992 (384 threads, 1 slot), 45,064 (448),
    # 48,136 (512: fits since the (m, l) arrays sit in the table's padding)
    assert K._fused_smem(128, 3, 8, 256, "cuda", 2) == 45640
    assert [K._fused_smem(128, 3, 8, n, "cuda", st, 2) for n, st in ((256, 1), (256, 2), (384, 1), (448, 1),
                                                                    (512, 1))] == [35848, 48136, 41992, 45064, 48136]
    assert K.fused_ok(128, 3, 8, "cuda", 512, 1, 2)
    # pair codebooks (128, 32): 31,752 B with the keys' own table (256 threads, one slot: nvcc's report and the
    # executor's layout); 384 threads fit the ring; head dim 64 too (lane chunks funnel-shifted, its 3-bit codes not)
    pair = dict(vdec=2, kbits=7, pair=(128, 32))
    assert K._fused_smem(128, 5, 8, 256, "cuda", 1, **pair) == 31752
    assert K.fused_ok(128, 5, 8, "cuda", 384, 1, **pair)
    assert K.fused_ok(64, 5, 8, "cuda", 256, 1, **pair) and not K.fused_ok(64, 3, 8, "cuda", 256, 1)
    assert K.fused_ok(128, 3, 8, "cuda", 256, 2) and not K.fused_ok(128, 3, 8, "cuda", 256, 3)
    assert not K.fused_ok(128, 3, 8, "metal", 256, 2)


def test_fused_blocks_one_an_sm(monkeypatch):
    """attn_fused's grid: one block an SM of the CUDA device (its launch bound allows one), the H200's 132 where the
    driver cannot be asked or on other backends."""
    monkeypatch.setattr(K, "backend", lambda: "cuda")
    monkeypatch.setattr(K, "cuda_sm_count", lambda: 108)
    assert K.fused_blocks() == 108 and K.fused_splits(131072, 4) == 27
    monkeypatch.setattr(K, "cuda_sm_count", lambda: None)
    assert K.fused_blocks() == K.FUSED_BLOCKS_DEFAULT == 132
    monkeypatch.setattr(K, "backend", lambda: "metal")
    assert K.fused_blocks() == 132
    # a group count that does not divide the grid rounds the splits down: no block past one an SM
    monkeypatch.setattr(K, "backend", lambda: "cuda")
    monkeypatch.setattr(K, "cuda_sm_count", lambda: 132)
    assert K.fused_splits(131072, 8) == 16 and K.fused_splits(131072, 5) == 26 and K.fused_splits(131072, 200) == 1


def test_fused_threads_by_context(monkeypatch):
    """attn_fused's threads a block: 256, and 384 (one ring slot, launch bound (384, 1)) from FUSED_THREADS_LONG
    packed tokens on CUDA."""
    monkeypatch.setattr(K, "backend", lambda: "cuda")
    assert K.fused_threads(32768) == 256 and K.fused_threads(K.FUSED_THREADS_LONG - 1) == 256
    assert K.fused_threads(K.FUSED_THREADS_LONG) == 384 and K.fused_threads(131072) == 384
    assert K._min_blocks(384) == 1 and K._min_blocks(256) == 1 and K._min_blocks(512) == 1
    assert K._min_blocks(128) == 0
    assert K.fused_ok(128, 3, 8, "cuda", 384, K.FUSED_STAGE) and not K.fused_ok(128, 3, 8, "cuda", 384, 2)
    monkeypatch.setattr(K, "backend", lambda: "metal")
    assert K.fused_threads(131072) == 256


def test_fused_launch_bound_and_merge_round(monkeypatch):
    """The default CUDA build of attn_fused: launch bound (256, 1) (one block an SM, registers uncapped) with the
    merge's 33 partial loads in one round (RQ_MERGE_WIDE); at (256, 2) the 128-register cap keeps rounds of 17."""
    import mlx.core as mx

    seen = {}

    def fake(**kw):
        seen[kw["name"]] = kw
        return kw

    monkeypatch.setattr(mx.fast, "cuda_kernel", fake)
    K._fused_kernel.cache_clear()
    try:
        one = K._fused_kernel("cuda", 256, 1)
        two = K._fused_kernel("cuda", 256, 2)
        big = K._fused_kernel("cuda", 512, 1)
    finally:
        K._fused_kernel.cache_clear()
    assert "__launch_bounds__(256, 1)" in one["header"] and "#define RQ_MERGE_WIDE 1" in one["source"]
    assert "__launch_bounds__(256, 2)" in two["header"] and "#define RQ_MERGE_WIDE" not in two["source"]
    # 512 threads: one block an SM caps registers at 128 anyway, so rounds of 17
    assert "__launch_bounds__(512, 1)" in big["header"] and "#define RQ_MERGE_WIDE" not in big["source"]
    assert one["name"] != two["name"]  # MLX caches modules by name


def test_fused_launch_plan_follows_shapes(monkeypatch):
    """fused_attention plans a class of calls once (_fused_launch_plan): a changed context, device or window gives
    a new plan, an identical call the same launch arguments as the first."""
    import mlx.core as mx

    from rq_core.kernels import config as env

    calls = []

    class Recorder:
        def __call__(self, *, inputs, template, grid, threadgroup, output_shapes, output_dtypes, init_value=None, **_):
            calls.append((tuple(template), grid, threadgroup, tuple(map(tuple, output_shapes))))
            return [mx.zeros(s, d) for s, d in zip(output_shapes, output_dtypes)]

    monkeypatch.setattr(env, "_CONFIG", env.KernelConfig(disk_cache=False))
    monkeypatch.setattr(K, "backend", lambda: "cuda")
    monkeypatch.setattr(K, "cuda_sm_count", lambda: 132)
    monkeypatch.setattr(K, "_fused_kernel", lambda *a, **k: Recorder())
    G, Hkv, D, cap = 8, 4, 128, 4096
    q = mx.zeros((1, G * Hkv, 1, D), mx.float16)
    codes = mx.zeros((1, Hkv, cap, 12), mx.uint32)
    norms = mx.zeros((1, Hkv, cap), mx.float16)
    lv = mx.zeros((8,), mx.float32)

    def launch(T, window=None):
        K.fused_attention(q, None, codes, norms, codes, norms, lv, bits=3, scale=0.1, valid_len=T, offset=T, rot=0,
                          window=window, want_lse=False)
        return calls[-1]

    first = launch(1000)
    assert launch(1000) == first
    assert launch(3000)[1] != first[1]  # more splits
    long = launch(20000)
    assert dict(first[0])["SACC"] == K.FUSED_SACC and dict(first[0])["THREADS"] == 256
    monkeypatch.setattr(K, "cuda_sm_count", lambda: 66)
    assert launch(20000)[1][1] < long[1][1]  # half the SMs: fewer splits
    w = mx.zeros((1, Hkv, 40, D), mx.float16)
    assert dict(launch(1000, (w, w))[0])["WCAUSAL"] == 0


def test_kept_launches_serve_a_class_and_pass_lengths_as_values(monkeypatch):
    """With `launches` (a cache's dict), a call of a class already seen reuses its FusedLaunch; the valid length and
    the window's rows go to the kernel as meta's values (the window as its whole buffers); a longer context past a split
    boundary, a grown buffer or changed settings make a new launch; the kernel itself is the same as without a dict."""
    import mlx.core as mx

    from rq_core.kernels import config as env

    seen = []

    class Recorder:
        def __call__(self, *, inputs, template, grid, threadgroup, output_shapes, output_dtypes, init_value=None, **_):
            seen.append(dict(inputs=inputs, grid=grid, template=tuple(template), init=init_value))
            return [mx.zeros(s, d) for s, d in zip(output_shapes, output_dtypes)]

    monkeypatch.setattr(env, "_CONFIG", env.KernelConfig(disk_cache=False))
    monkeypatch.setattr(K, "backend", lambda: "cuda")
    monkeypatch.setattr(K, "cuda_sm_count", lambda: 132)
    monkeypatch.setattr(K, "_fused_kernel", lambda *a, **k: Recorder())
    G, Hkv, D = 8, 4, 128
    q = mx.zeros((1, G * Hkv, 1, D), mx.float16)
    lv = mx.zeros((8,), mx.float32)
    fk = mx.zeros((1, Hkv, 512, D), mx.float16)
    kept: dict = {}

    def call(T, cap=4096, first=37, rows=32, launches=kept):
        codes, norms = mx.zeros((1, Hkv, cap, 12), mx.uint32), mx.zeros((1, Hkv, cap), mx.float16)
        K.fused_attention(q, None, codes, norms, codes, norms, lv, bits=3, scale=0.1, valid_len=T, offset=T, rot=0,
                          window=(fk, fk, first, rows), want_lse=False, launches=launches)
        return seen[-1]

    a = call(1000)
    assert len(kept) == 1 and a["inputs"][8].tolist() == [1000, (37 << 8) | 32]
    assert a["inputs"][9] is fk and a["inputs"][10] is fk  # the buffers, no view
    b = call(1001, first=38)
    assert len(kept) == 1 and b["inputs"][8].tolist() == [1001, (38 << 8) | 32] and b["grid"] == a["grid"]
    assert b["inputs"][8] is call(1001, first=38)["inputs"][8]  # one meta array for every layer of a step
    call(1200)  # past a 128-token split boundary: another class
    assert len(kept) == 2
    call(1200, cap=4352)  # the buffers grew
    assert len(kept) == 3
    # any other argument too: a scale, a codebook array, a tuning argument (one dict serving calls that differ)
    codes, norms = mx.zeros((1, Hkv, 4096, 12), mx.uint32), mx.zeros((1, Hkv, 4096), mx.float16)
    for kw in (dict(scale=0.2), dict(stage=0)):
        K.fused_attention(q, None, codes, norms, codes, norms, lv, bits=3, valid_len=1200, offset=1200, rot=0,
                          window=(fk, fk, 37, 32), want_lse=False, launches=kept, **{"scale": 0.1, **kw})
    assert len(kept) == 5 and float(seen[-2]["inputs"][2][-1]) == pytest.approx(0.2)  # consts end with the scale
    lv2 = mx.zeros((8,), mx.float32)
    K.fused_attention(q, None, codes, norms, codes, norms, lv2, bits=3, scale=0.1, valid_len=1200, offset=1200, rot=0,
                      window=(fk, fk, 37, 32), want_lse=False, launches=kept)
    assert len(kept) == 6 and all(launch.sources[1] is not None for launch in kept.values())
    with env.override(poison=True):  # changed settings: a launch made under them
        poisoned = call(1200)
    assert poisoned["init"] is not None and math.isnan(poisoned["init"]) and len(kept) == 7
    # the same call without a dict: the same kernel arguments
    fresh = call(1001, first=38, launches=None)
    assert fresh["grid"] == b["grid"] and fresh["template"] == b["template"]
    with pytest.raises(K.KernelUnsupported, match="window rows"):
        call(1000, first=500, rows=32)  # past the buffer
    with pytest.raises(K.KernelUnsupported, match="window of 200"):
        call(1000, rows=200)


def test_inputs_a_kernel_writes_or_passes_on_are_never_metal_constants():
    """MLX's Metal kernels take an input of fewer than 8 elements as `const constant T*`: attn_fused's counters (atomics,
    written) and the rotation's placeholder (passed where a device pointer is expected) must never be that small, for
    any count of (batch, kv head) groups; meta (read in place) is declared constant in the rendering, as MLX does."""
    import mlx.core as mx

    for n in (1, 2, 4, 7, 8, 9, 64):
        views = [K._counter(n) for _ in range(3)]
        assert all(v.size >= max(n, K.METAL_CONSTANT_BELOW) and v.dtype == mx.uint32 for v in views)
        assert all(int(v.sum()) == 0 for v in views)
    assert K._mats(None).size >= K.METAL_CONSTANT_BELOW
    for name, spec in K.SPECS.items():
        src = K.full_source(name, "metal", CASES[name]) if name in CASES else None
        for inp in spec.small:
            assert src is None or f"const constant int32_t* {inp}" in src


def test_executor_programs_compiled_once_per_source(tmp_path, monkeypatch):
    """The executor keeps a compiled program per hash of its source: the same program is not compiled again, a
    changed one is."""
    if shutil.which("g++") is None:
        pytest.skip("needs g++")
    from kernel_emu import emulate as EK

    monkeypatch.setattr(EK, "binary_cache_dir", lambda: tmp_path)
    runs = []
    real = subprocess.run
    monkeypatch.setattr(EK.subprocess, "run", lambda cmd, **kw: runs.append(cmd) or real(cmd, **kw))
    prog = "int main() { return 0; }\n"
    a = EK.compiled(prog, "probe")
    assert EK.compiled(prog, "probe") == a and a.is_file() and len(runs) == 1
    b = EK.compiled(prog.replace("0", "1"), "probe")
    assert b != a and len(runs) == 2 and real([str(b)]).returncode == 1


@pytest.mark.parametrize("strategy,case", [("word", dict(d=128, T=200, bits=3, key_bits=4, pair=None)),
                                           ("dim", dict(d=64, T=130, bits=5, key_bits=7, pair=(128, 32)))])
def test_four_kernels_metal_rendering_on_cpu_executor(strategy, case, monkeypatch):
    """The four-kernel pipeline's Metal renderings (rotate_query, qk_dot, softmax, value_word / value_dim,
    value_reduce, rotate_inverse) on the executor (metal_emu.h) standing in for mx.fast.metal_kernel, through the
    wrappers' Metal launch arguments, against float64 (the CUDA renderings: tests/test_split_kernels.py)."""
    if shutil.which("g++") is None or not sys.platform.startswith("linux"):
        pytest.skip("needs g++ and ucontext (Linux)")
    import mlx.core as mx

    from kernel_emu import attn_reference as KC
    from kernel_emu import configure
    from kernel_emu import emulate as EK

    stand: dict = {}
    configure(monkeypatch, disk_cache=False, poison=True)
    monkeypatch.setattr(K, "backend", lambda: "metal")
    monkeypatch.setattr(K, "available", lambda: True)
    monkeypatch.setattr(K, "_kernel", lambda name, be: stand.setdefault(name, EK.MLXStandIn(name, be)))
    rng = np.random.default_rng(11)
    L = 2
    c = KC.make_case(rng, B=1, Hkv=2, G=4, L=L, d=case["d"], T=case["T"], bits=case["bits"],
                     key_bits=case["key_bits"], pair_points=case["pair"])
    err, nan, _ = KC.run_case(K, mx, c, T=case["T"], bits=case["bits"], path="four", strategy=strategy, causal=True,
                              offset=case["T"] - L, rot=3, key_bits=case["key_bits"])
    assert nan == 0 and err < 6e-7, err  # fp32 throughout: measured <= 2.1e-7 over 8 seeds; 3x margin
    assert {"rotate_query", "qk_dot", "softmax", "rotate_inverse", f"value_{strategy}"} <= set(stand)
    assert all(s.backend == "metal" and s.calls for s in stand.values())


@pytest.mark.parametrize("backend,file,old,new", [
    # the lane -> element layout of a simdgroup_matrix fragment (Apple's: row bit 2 is lane bit 4)
    ("metal", "prelude_metal.h", "return ((lane >> 2) & 4) + ((lane >> 1) & 3);",
     "return ((lane >> 2) & 2) + ((lane >> 1) & 3);"),
    # mma.sync's B registers in the asm operand list
    ("cuda", "prelude_cuda.h", '"r"(b.x[0]), "r"(b.x[1])', '"r"(b.x[1]), "r"(b.x[0])'),
], ids=["metal-fragment-row", "cuda-mma-b-swapped"])
def test_executor_catches_planted_bugs(backend, file, old, new, tmp_path, monkeypatch):
    """The executor's lane-level semantics can fail a kernel: the Metal fragments' layout and the mma operands as the
    asm statement binds them each matter (the unmodified sources pass the same case in
    test_fused_source_runs_on_cpu_executor; tests/README.md lists more planted bugs and the tests that catch them)."""
    if shutil.which("g++") is None or not sys.platform.startswith("linux"):
        pytest.skip("needs g++ and ucontext (Linux)")
    from kernel_emu import emulate as EK

    src = tmp_path / "metal"
    shutil.copytree(K.SRC_DIR, src)
    text = (src / file).read_text()
    assert text.count(old) == 1
    (src / file).write_text(text.replace(old, new))
    monkeypatch.setattr(K, "SRC_DIR", src)
    K._read.cache_clear()
    try:
        r = EK.run_fused(np.random.default_rng(13), seed=5, backend=backend, **FUSED_CASES[5])
    finally:
        K._read.cache_clear()
    # not a tolerance: the planted bugs measured 0.064-0.24 (mma B swapped) and > 100 (fragment rows) over 4 seeds, the
    # real code <= 5.9e-7; 1e-3 says the kernel is far off, not just past the passing bound
    assert r["nan"] > 0 or not r["err_half"] < 1e-3


def test_mailbox_kernels_syntax_check(tmp_path):
    """The expert pager's mailbox kernels (CUDA only), as mx.fast.cuda_kernel wraps them: signature from the inputs'
    and outputs' dtypes, the template's constants, MLX's default header (stubbed)."""
    from rq_core.paging import mailbox

    cc = _compiler()
    if cc is None:
        pytest.skip("no C++ compiler")
    prefix = '#include "mlx/backend/cuda/device/utils.cuh"\n#include <cooperative_groups.h>\n'
    errors = []
    for name, sig, body in (("post", "const uint32_t* ids, const uint64_t* box, int32_t* posted", mailbox._POST),
                            ("wait", "const int32_t* posted, const uint64_t* box, int32_t* slots, int64_t* plan",
                             mailbox._WAIT),
                            ("load", "const int32_t* slots, const int64_t* plan, int32_t* out", mailbox._LOAD)):
        f = tmp_path / f"mailbox_{name}.cpp"
        f.write_text(prefix + mailbox._HEADER + "namespace mlx::core::cu {\n__global__ void k(" + sig
                     + ") {\n  constexpr int N = 22;\n  constexpr int DESC = 50;\n  constexpr int C = 132;\n" + body
                     + "}\n}\n")
        p = subprocess.run([cc, "-std=c++17", "-fsyntax-only", "-Wno-attributes", "-Wno-unknown-pragmas",
                            "-I" + str(STUBS / "cuda"), str(f)], capture_output=True, text=True, timeout=120)
        if p.returncode != 0:
            errors.append(f"{name}:\n{p.stderr[:3000]}")
    assert not errors, "\n".join(errors)
