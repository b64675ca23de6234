"""Run a kernel's CUDA or Metal rendering on the CPU (tests/kernel_emu/{cuda,metal}_emu.h) and check it against float64.

The kernel source is compiled unchanged as host C++ (g++, C++20): one cooperative context per GPU thread
(emu_core.h), blocks run one after another in a shuffled order. CUDA: __syncthreads, warp shuffles and votes
emulated across the 32 lanes, and every inline PTX statement rewritten into a call of the executor's PTX
interpreter with its operands bound as the statement lists them (mma.sync / movmatrix with the PTX ISA's fragment
layouts, written independently of metal/prelude_cuda.h; cp.async as deferred copies with commit / wait_group;
ex2.approx; atom; ld.shared). Metal: the SIMD-group functions across the 32 lanes of a SIMD group,
threadgroup_barrier / simdgroup_barrier, simdgroup_matrix 8x8 with Apple's per-lane layout (written independently
of metal/prelude_metal.h). It executes the kernel's logic (indexing, tiles, splits, online softmax, the last
block's merge and counter reset) without a GPU; it says nothing about speed or about memory ordering between
blocks.

Memory checks (CUDA rendering), as the hardware faults ("misaligned address"): threadgroup arrays are laid out as
the compiler places static __shared__ arrays (declaration order, each aligned only to its type; layout="worst":
each at an odd multiple of its alignment), device buffers start 256-byte aligned (optionally offset, as a view's
data pointer can be); every cp.async copy needs 16-byte aligned global source and threadgroup destination inside
their buffers, and every vector reinterpretation in the prelude (uint4 / float4 loads, half2 <-> uint) the
alignment of its type (tests/kernel_emu/emu_core.h: emu::check). Distinct faults are listed once each.

    python3 tests/kernel_emu/emulate.py [cuda|metal]

Exit status 1 if any case fails.
"""

from __future__ import annotations

import functools
import hashlib
import math
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from kernel_emu import attn_reference as KC  # noqa: E402

import rq_core.kernels.launch as K  # noqa: E402
from rq_core.kernels import config as env  # noqa: E402

EMU = Path(__file__).resolve().parent
CTYPE = {"f32": "float", "u32": "uint32_t", "i32": "int32_t", "f16": "__half", "bf16": "__nv_bfloat16"}
CTYPE_METAL = {"f32": "float", "u32": "uint32_t", "i32": "int32_t", "f16": "half", "bf16": "bfloat16_t"}
NPTYPE = {"f32": np.float32, "u32": np.uint32, "i32": np.int32, "f16": np.float16}


def _dt(a: np.ndarray) -> str:
    return {np.dtype(np.float32): "f32", np.dtype(np.uint32): "u32", np.dtype(np.int32): "i32",
            np.dtype(np.float16): "f16"}[a.dtype]


CXX = ["g++", "-std=c++20", "-O1", "-w"]


def binary_cache_dir() -> Path:
    """Where compiled executor programs are kept: one per program source hash, shared by every test process."""
    return Path(tempfile.gettempdir()) / "rq_kernel_emu"


@functools.lru_cache(maxsize=None)
def _headers_digest() -> str:
    h = hashlib.sha256(" ".join(CXX).encode())
    for f in sorted(EMU.rglob("*.h")):
        h.update(f.name.encode() + f.read_bytes())
    return h.hexdigest()


# the executor's headers, as a program's first line includes them, and the standard headers its main() uses
_PCH_HEADERS = ('#include "metal_emu.h"', '#include "mlx/backend/cuda/device/utils.cuh"')
_PCH_STD = "#include <algorithm>\n#include <random>\n#include <string>\n"


def _pch(first_line: str) -> Path | None:
    """A precompiled header of the executor's headers (`first_line`) and the standard ones, built once per header
    digest (parsing them is a second of every compile); None when g++ cannot build one."""
    d = binary_cache_dir() / f"pch-{_headers_digest()[:24]}"
    h = d / ("emu_metal.h" if "metal" in first_line else "emu_cuda.h")
    gch = Path(str(h) + ".gch")
    if gch.is_file():
        return h
    d.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="rq_emu_pch_", dir=d) as t:
        th = Path(t) / h.name
        th.write_text(first_line + "\n" + _PCH_STD)
        r = subprocess.run([*CXX, f"-I{EMU}", "-x", "c++-header", str(th), "-o", f"{th}.gch"], capture_output=True)
        if r.returncode:
            return None
        os.replace(th, h)  # the header before its .gch: a process that finds the .gch finds the header
        os.replace(f"{th}.gch", gch)
    return h


def compiled(program: str, name: str) -> Path:
    """The executable of `program` (a whole C++ translation unit), compiled once per source hash: the same kernel
    class is run by many tests and cases, and g++ takes most of a run's time. A program that starts by including
    the executor's header is compiled against a precompiled one (_pch)."""
    key = hashlib.sha256((_headers_digest() + "\0" + program).encode()).hexdigest()[:32]
    out = binary_cache_dir() / f"{name}-{key}.exe"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    first, _, rest = program.partition("\n")
    pch = _pch(first) if first in _PCH_HEADERS else None
    with tempfile.TemporaryDirectory(prefix="rq_emu_build_", dir=out.parent) as d:
        cpp = Path(d) / f"{name}.cpp"
        cpp.write_text(rest if pch else program)
        exe = Path(d) / f"{name}.exe"
        pre = ["-include", str(pch)] if pch else []
        r = subprocess.run([*CXX, f"-I{EMU}", *pre, str(cpp), "-o", str(exe)], capture_output=True, text=True)
        if r.returncode:
            raise RuntimeError(f"compile failed:\n{r.stderr[:4000]}")
        os.replace(exe, out)  # atomic: a concurrent test process sees the whole binary or none
    return out


def _emu_source(name: str, template: list, types: dict, backend: str = "cuda") -> str:
    """The backend's source with the executor's substitutions, minified as MLX gets it (the substitutions
    match the source as written, so it is rendered unminified first)."""
    minify = env.config().minify
    with env.override(minify=False):
        src = K.full_source(name, backend, template, types)
        src = _emu_substitute(src) if backend == "cuda" else _shared_decls(src, "const uint TID = "
                                                                            "thread_position_in_threadgroup.x;")
    return K.minify(src) if minify else src


def _split_top(s: str, sep: str) -> list[str]:
    """s split at each `sep` outside parentheses, brackets and string literals."""
    parts, depth, cur, i = [], 0, [], 0
    while i < len(s):
        c = s[i]
        if c == '"':
            j = i + 1
            while s[j] != '"':
                j += 2 if s[j] == "\\" else 1
            cur.append(s[i:j + 1])
            i = j + 1
            continue
        depth += c in "([{"
        depth -= c in ")]}"
        if c == sep and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(c)
        i += 1
    parts.append("".join(cur))
    return parts


_ASM = re.compile(r"\basm\s*(?:volatile\s*)?\(")


def _asm_to_emu(src: str) -> tuple[str, int]:
    """Every `asm [volatile] ("template" : outputs : inputs : clobbers);` as a call of the executor's PTX
    interpreter (cuda_emu.h: emu::Ptx) with its operands bound in the statement's order, %0 first: outputs by
    reference ("=" / "+"), inputs by value, "n" immediates as numbers."""
    out, pos, count = [], 0, 0
    while (m := _ASM.search(src, pos)) is not None:
        i, depth = m.end(), 1
        while depth:
            c = src[i]
            if c == '"':
                i += 1
                while src[i] != '"':
                    i += 2 if src[i] == "\\" else 1
            depth += (c == "(") - (c == ")")
            i += 1
        end = src.index(";", i) + 1
        assert src[i:end].strip() == ";", src[m.start():end]
        sections = _split_top(src[m.end():i - 1], ":") + ["", "", ""]
        template, outs, ins = sections[0].strip(), sections[1], sections[2]
        ops = []
        for sec, is_out in ((outs, True), (ins, False)):
            for o in _split_top(sec, ","):
                o = o.strip()
                if not o:
                    continue
                cm = re.fullmatch(r'"([=+&]*)(\w)"\s*\((.*)\)', o, re.S)
                assert cm, f"asm operand {o!r}"
                mod, kind, expr = cm.groups()
                if is_out:
                    assert mod.strip("&") in ("=", "+"), o
                    ops.append(f"emu::ptx_out({expr}, '{kind}')")
                elif kind == "n":
                    ops.append(f"emu::ptx_in((long long)({expr}), 'n')")
                else:
                    ops.append(f"emu::ptx_in({expr}, '{kind}')")
        call = (f"emu::PtxArg rq_ptx_ops[] = {{{', '.join(ops)}}}; rq_ptx.run(rq_ptx_ops, {len(ops)});" if ops
                else "rq_ptx.run(nullptr, 0);")
        out.append(src[pos:m.start()] + f"{{ static const emu::Ptx rq_ptx({template}); {call} }}")
        pos = end
        count += 1
    out.append(src[pos:])
    return "".join(out), count


def _emu_substitute(src: str) -> str:
    # inline PTX: executed by the interpreter (every asm statement of the source, none left to the compiler)
    src, n = _asm_to_emu(src)
    assert n > 0 and not _ASM.search(src), "inline PTX left in the CUDA source"
    # every reinterpret_cast of the prelude (vector loads uint4 / float4, half2 <-> uint) checks the
    # alignment of the access it is made for (emu::checked_cast)
    src = re.sub(r"reinterpret_cast<([^<>]*?\*)>\(", r"emu::checked_cast<\1>(__func__, ", src)
    return _shared_decls(src, "const uint TID = threadIdx.x;")


def _shared_decls(src: str, body_mark: str) -> str:
    # threadgroup arrays: laid out by the executor as the compiler would (emu::shared_alloc), so their
    # placement, and the alignment of accesses into them, are what the GPU sees
    head, mark, body = src.partition(body_mark)
    assert mark, body_mark
    decl = re.compile(r"^(\s*)SHARED\s+(\w+)\s+(\w+)((?:\s*\[[^\]\n]*\])*)\s*;", re.M)
    want = len(re.findall(r"^\s*SHARED\s", body, re.M))

    def alloc(m):
        dims = "".join(f"[({d})]" for d in re.findall(r"\[([^\]]*)\]", m.group(4)))
        ty, name = m.group(2), m.group(3)
        return f'{m.group(1)}static auto& {name} = emu::shared_alloc<{ty}{dims}>(alignof({ty}), "{name}");'

    body, n = decl.subn(alloc, body)
    assert n == want, f"{n} of {want} threadgroup declarations rewritten"
    return head + mark + body


def emulate(name: str, template: list, inputs: dict, outputs: dict, grid: tuple[int, int], nth: int,
            views: dict | None = None, types: dict | None = None, seed: int = 0, workdir: Path | None = None,
            offsets: dict | None = None, layout: str = "decl", backend: str = "cuda") -> dict:
    """Run kernel `name` on the CPU. inputs: name -> numpy array (a bf16 input: (uint16 array, "bf16"));
    views: name -> (shape, strides) passed as that input's _shape/_strides (else the array's own);
    outputs: name -> (shape, dtype code), filled with NaN first. Returns name -> numpy array, plus
    "smem_bytes": the threadgroup memory the executor laid out.

    Buffers start 256-byte aligned (as MLX's CUDA allocations of more than 8 bytes do); offsets: name ->
    elements to start that input after (a view whose data pointer is offset into its buffer). layout:
    "decl" places threadgroup arrays in declaration order, each aligned to its type; "worst" at an odd
    multiple of that alignment. A misaligned vector access or cp.async copy, or one outside its buffer,
    raises RuntimeError("... misaligned address ...") after the run (every distinct fault listed once).
    backend: "cuda" (cuda_emu.h) or "metal" (metal_emu.h): which rendering runs; the same inputs, outputs and
    grid for both."""
    if workdir is None:
        with tempfile.TemporaryDirectory(prefix="rq_emu_") as d:
            return emulate(name, template, inputs, outputs, grid, nth, views, types, seed, Path(d), offsets, layout,
                           backend)
    offsets = offsets or {}
    spec = K.SPECS[name]
    types = dict(types or {})
    views = views or {}
    tmp = Path(workdir)
    metal = backend == "metal"
    src = _emu_source(name, template, types, backend)
    body = K.render(name, backend)[1]
    ctype = CTYPE_METAL if metal else CTYPE
    # The program depends on the kernel source, the argument list and the dtypes only; sizes, views, offsets,
    # the grid, the seed and the layout are read at run time from params.txt, so one binary serves every call
    # of a kernel class (compiled once, kept in binary_cache_dir() by the hash of its source).
    lines = ['#include "metal_emu.h"' if metal else '#include "mlx/backend/cuda/device/utils.cuh"',
             "#include <algorithm>", "#include <random>",
             "#include <string>", src,
             "// a device buffer: 256-byte aligned allocation, the array `off` elements in, registered for the checks",
             "template <class T> struct Buf {",
             "  T* p; size_t n;",
             "  Buf(size_t n_, size_t off, const char* name) : n(n_) {",
             "    char* raw = static_cast<char*>(std::aligned_alloc(256, ((n + off) * sizeof(T) + 255) / 256 * 256));",
             "    p = reinterpret_cast<T*>(raw) + off;",
             "    emu::regions.push_back({reinterpret_cast<const char*>(p), n * sizeof(T), name, false}); }",
             "  T* data() { return p; } };",
             "static std::string dir;",
             "static FILE* params;",
             "static long long arg() { long long v; if (std::fscanf(params, \"%lld\", &v) != 1) std::abort(); return v; }",
             "template <class T> Buf<T> load(const char* name) {",
             "  size_t n = arg(), off = arg(); Buf<T> v(n, off, name);",
             "  FILE* f = std::fopen((dir + \"/\" + name + \".bin\").c_str(), \"rb\"); if (!f) std::abort();",
             "  if (std::fread(v.p, sizeof(T), n, f) != n) std::abort(); std::fclose(f); return v; }",
             "template <class T> Buf<T> filled(T x, const char* name) {",
             "  Buf<T> v(arg(), 0, name); std::fill(v.p, v.p + v.n, x); return v; }",
             "template <class A> void fill_dims(A& a) { int n = arg(); for (int i = 0; i < n; ++i) a[i] = arg(); }",
             "template <class T> void save(const char* name, const Buf<T>& v) {",
             "  FILE* f = std::fopen((dir + \"/\" + name + \".out\").c_str(), \"wb\"); std::fwrite(v.p, sizeof(T), v.n, f);",
             "  std::fclose(f); }",
             "int main(int argc, char** argv) {", "" if metal else "  using namespace mlx::core::cu;",
             "  if (argc != 2) return 4;",
             "  dir = argv[1]; params = std::fopen((dir + \"/params.txt\").c_str(), \"r\"); if (!params) return 4;",
             "  emu::worst_layout = arg() != 0;"]
    params = [int(layout == "worst")]
    args = []
    for n in spec.inputs:
        a = inputs[n]
        code = a[1] if isinstance(a, tuple) else _dt(a)
        arr = a[0] if isinstance(a, tuple) else a
        types.setdefault(n, code)
        (tmp / f"{n}.bin").write_bytes(np.ascontiguousarray(arr).tobytes())
        ct = ctype[code]
        lines.append(f'  auto in_{n} = load<{ct}>("{n}");')
        params += [arr.size, int(offsets.get(n, 0))]
        args.append(f"in_{n}.data()")
        shape, strides = views.get(n, (arr.shape, tuple(s // arr.itemsize for s in arr.strides)))
        if f"{n}_shape" in body:  # CUDA: MLX's Shape by value; Metal: a constant int buffer
            lines.append(f"  {'std::array<int, 8>' if metal else 'Shape'} sh_{n}{{}}; fill_dims(sh_{n});")
            params += [len(shape), *shape]
            args.append(f"sh_{n}.data()" if metal else f"sh_{n}")
        if f"{n}_strides" in body:
            lines.append(f"  {'std::array<int64_t, 8>' if metal else 'Strides'} st_{n}{{}}; fill_dims(st_{n});")
            params += [len(strides), *strides]
            args.append(f"st_{n}.data()" if metal else f"st_{n}")
    for n in spec.outputs:
        shape, code = outputs[n]
        ct = ctype[code]
        nan = ({"f32": "NAN", "f16": "half(NAN)", "bf16": "emu::bf16_bits(0x7fc0)", "u32": "0xB2D05E00u"} if metal
               else {"f32": "NAN", "f16": "__float2half_rn(NAN)", "bf16": "__nv_bfloat16{0x7fc0}",
                     "u32": "0xB2D05E00u"})[code]  # u32: kernels.APPEND_POISON's value
        lines.append(f'  auto out_{n} = filled<{ct}>({nan}, "{n}");')
        params.append(int(np.prod(shape)))
        args.append(f"out_{n}.data()")
    kname = f"custom_kernel_rq_{name}"
    if metal:  # the template's arguments, and the thread / threadgroup ids MLX adds to the signature
        tn = K._TYPE_NAMES["metal"]
        kname += "<" + ", ".join(tn[v] if isinstance(v, str) else str(int(v)) for _, v in template) + ">"
        ids = {"thread_position_in_threadgroup": "emu::tid", "threadgroup_position_in_grid": "emu::bid",
               "threadgroups_per_grid": "emu::gdim", "threads_per_threadgroup": "emu::bdim"}
        args += [f"uint3{{{ids[a]}.x, {ids[a]}.y, {ids[a]}.z}}" for a, _ in K._METAL_ATTRS if a in body]
    params += [grid[0], grid[1], nth, seed]
    lines += [
        "  unsigned gx = arg(), gy = arg(), nth = arg(); unsigned seed = arg(); emu::seed = seed; emu::rng.seed(seed);",
        "  std::vector<std::pair<unsigned, unsigned>> blocks;",
        "  for (unsigned y = 0; y < gy; ++y)",
        "    for (unsigned x = 0; x < gx; ++x) blocks.push_back({x, y});",
        "  std::mt19937 rng(seed); std::shuffle(blocks.begin(), blocks.end(), rng);",
        "  emu::bdim = {nth, 1u, 1u}; emu::gdim = {gx, gy, 1u};",
        f"  emu::body = [&]() {{ {kname}({', '.join(args)}); }};",
        "  for (auto [x, y] : blocks) { emu::bid = {x, y, 0u}; if (!emu::run_block(nth)) return 2; }",
    ]
    for n in spec.outputs:
        lines.append(f'  save("{n}", out_{n});')
    if "counter" in spec.inputs:  # the split counters must come back zeroed: read them back
        lines.append('  save("counter", in_counter);')
    lines += ['  { FILE* f = std::fopen((dir + "/smem.txt").c_str(), "w"); std::fprintf(f, "%zu\\n", emu::smem_top); '
              "std::fclose(f); }",
              "  return emu::report() ? 0 : 3;", "}"]
    (tmp / "params.txt").write_text(" ".join(str(int(v)) for v in params) + "\n")
    exe = compiled("\n".join(lines) + "\n", f"{name}-{backend}")
    r = subprocess.run([str(exe), str(tmp)], capture_output=True, text=True, timeout=600)
    if r.returncode == 3:
        raise RuntimeError(f"memory faults (a GPU stops at the first):\n{r.stderr[:4000]}")
    if r.returncode:
        raise RuntimeError(f"run failed ({r.returncode}): {r.stderr[:2000]}")
    res = {"smem_bytes": int((tmp / "smem.txt").read_text())}
    for n in spec.outputs:
        shape, code = outputs[n]
        raw = (tmp / f"{n}.out").read_bytes()
        if code == "bf16":
            u = np.frombuffer(raw, np.uint16).astype(np.uint32) << 16
            res[n] = u.view(np.float32).reshape(shape)
        else:
            res[n] = np.frombuffer(raw, NPTYPE[code]).reshape(shape)
    if "counter" in spec.inputs:
        res["counter_after"] = np.frombuffer((tmp / "counter.out").read_bytes(), np.uint32)
    return res


def _case_inputs(c, T: int, bits: int, scale: float, qdtype: str, key_bits: int | None = None):
    """The kernel inputs of an attn_reference case: q, consts, packed codes, norms (k_norms as the [:, :, :T] view)."""
    q = c["q"]
    if qdtype == "f16":
        qin = q.astype(np.float16)
        q64 = qin.astype(np.float64)
    elif qdtype == "bf16":
        u = (q.astype(np.float32).view(np.uint32) + 0x7FFF + ((q.astype(np.float32).view(np.uint32) >> 16) & 1)) >> 16
        qin = (u.astype(np.uint16), "bf16")
        q64 = (u.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    else:
        qin, q64 = q.astype(np.float32), q.astype(np.float64)
    if "kpidx" in c:  # pair codebooks: the fields are the pair indices
        kc, vc = KC.pack64(c["kpidx"], key_bits), KC.pack64(c["vpidx"], bits)
    else:
        kc, vc = KC.pack64(c["kidx"], key_bits or bits), KC.pack64(c["vidx"], bits)
    consts = np.concatenate([c["levels"].astype(np.float32), np.array([scale], np.float32)]
                            + ([c["klevels"].astype(np.float32)] if key_bits else []))
    kn = c["knorm"]
    views = {"k_norms": ((kn.shape[0], kn.shape[1], T), (kn.shape[1] * kn.shape[2], kn.shape[2], 1))}
    return qin, q64, kc, vc, consts, views


def fused_outputs(out_shape: tuple, tq: str, groups: int, ns: int, R: int) -> dict:
    """attn_fused's outputs for emulate(): out and one scratch."""
    d = out_shape[-1]
    return dict(out=(out_shape, tq), scratch=((K.fused_scratch_size(groups, ns, R, d),), "f32"))


def split_scratch(outs: dict, groups: int, R: int) -> None:
    """lse as fused_attention reads it from the end of the scratch output."""
    outs["lse"] = outs["scratch"][-groups * R:].reshape(outs["out"].shape[:3])


def run_fused(rng, *, G, d, T, L=1, bits=3, rot=3, causal=False, qdtype="f32", B=1, Hkv=2, blocks=16, seed=0,
              nth=None, pf=2, vdec=1, stage=0, offsets=None, layout="decl", sacc=2, merge=None,
              key_bits=None, pair_points=None, backend="cuda"):
    """attn_fused's CUDA rendering on the executor, against float64 (an attn_reference case): relative errors against
    the exact and the half-rounded levels, lse errors (likewise: lse_err, lse_err_half), NaN left from the poison, counters left set, splits, threadgroup
    bytes. nth / pf / vdec / stage / sacc / merge: the template's; blocks: the grid's block target.
    offsets / layout: emulate's (inputs placed off their buffers' aligned start; threadgroup layout).
    pair_points (PK, PV): pair codebooks (bits / key_bits their fields' widths, log2 PV / log2 PK).
    backend: which rendering runs ("cuda" or "metal"), on the same inputs against the same references."""
    c = KC.make_case(rng, B=B, Hkv=Hkv, G=G, L=L, d=d, T=T, bits=bits, dense=bool(rot & 4), signs=bool(rot & 8),
                     key_bits=key_bits, pair_points=pair_points)
    scale = 1.0 / math.sqrt(d)
    qin, q64, kc, vc, consts, views = _case_inputs(c, T, bits, scale, qdtype, key_bits)
    nrg = K.row_blocks(G, L)  # a kv head's rows in blocks of whole heads, <= MMA_ROWS rows each
    R = G // nrg * L
    groups = B * Hkv * nrg
    merge = K.FUSED_MERGE if merge is None else merge
    vh = K.fused_vhalves(d)  # blocks a group and split (value-dim halves)
    ns = K.fused_splits(T, groups * vh, blocks)
    nth = nth or K.fused_threads(T)
    mats = c["mats"].astype(np.float32) if rot & 6 else np.zeros(1, np.float32)
    counter = np.zeros(groups, np.uint32)
    views.pop("k_norms")  # T comes from meta: the buffers go in whole (capacity past T), as the cache's do
    tq = qdtype
    pk, pv = pair_points or (0, 0)
    template = [("TQ", tq), ("D", d), ("BITS", bits), ("KBITS", key_bits or bits), ("PK", pk), ("PV", pv),
                ("R", R), ("LQ", L), ("HKV", Hkv), ("NRG", nrg), ("CAUSAL", int(causal)), ("ROT", rot), ("THREADS", nth),
                ("SACC", sacc), ("PF", pf), ("VDEC", vdec), ("STAGE", stage), ("MERGE", merge)]
    outs = emulate("attn_fused", template,
                   dict(q=qin, mats=mats, consts=consts, k_codes=kc, k_norms=c["knorm"], v_codes=vc,
                        v_norms=c["vnorm"], counter=counter, meta=np.array([T, 0], np.int32)),
                   fused_outputs((B, G * Hkv, L, d), tq, groups, ns, R),
                   (groups * vh, ns), nth, views=views, types={"q": tq, "out": tq}, seed=seed, offsets=offsets,
                   layout=layout, backend=backend)
    split_scratch(outs, groups, R)
    ref = KC.reference(q64, c["mats"], c["kidx"], c["knorm"], c["vidx"], c["vnorm"], c["levels"], scale=scale,
                       offset=T - L, causal=causal, T=T, rot=rot, key_levels=c["klevels"])
    got = outs["out"].astype(np.float64)
    err = float(np.linalg.norm(np.nan_to_num(got, nan=1e9) - ref) / np.linalg.norm(ref))
    # against the same math with the codebook levels rounded to half, as the matrix units see them
    ref_h = KC.reference(q64, c["mats"], c["kidx"], c["knorm"], c["vidx"], c["vnorm"], KC.half_levels(c["levels"]),
                         scale=scale, offset=T - L, causal=causal, T=T, rot=rot,
                         key_levels=KC.half_levels(c["klevels"]))
    err_half = float(np.linalg.norm(np.nan_to_num(got, nan=1e9) - ref_h) / np.linalg.norm(ref_h))
    # lse against float64
    hk = np.arange(G * Hkv) // G
    qt = KC.rotate64(q64, c["mats"], hk, rot, False)
    Kd = c["klevels"].astype(np.float64)[c["kidx"][:, :, :T]] * c["knorm"][:, :, :T, None] / math.sqrt(d)
    s = np.einsum("bhld,bhtd->bhlt", qt, Kd[:, hk]) * scale
    if causal:
        s = np.where(np.arange(T)[None, :] <= (T - L + np.arange(L))[:, None], s, -np.inf)
    top = s.max(-1)
    ref_lse = top + np.log(np.exp(s - top[..., None]).sum(-1))
    lse_err = float(np.abs(outs["lse"] - ref_lse).max())
    # and against the same math with the keys' levels rounded to half (the scores the matrix units form): the
    # kernel's own error, without the levels' rounding that dominates lse_err
    Kh = KC.half_levels(c["klevels"]).astype(np.float64)[c["kidx"][:, :, :T]] * c["knorm"][:, :, :T, None] / math.sqrt(d)
    s = np.einsum("bhld,bhtd->bhlt", qt, Kh[:, hk]) * scale
    if causal:
        s = np.where(np.arange(T)[None, :] <= (T - L + np.arange(L))[:, None], s, -np.inf)
    top = s.max(-1)
    lse_err_half = float(np.abs(outs["lse"] - (top + np.log(np.exp(s - top[..., None]).sum(-1)))).max())
    # every output written (no NaN left from the poison), and the counters left zeroed for the next launch
    return dict(err=err, err_half=err_half, lse_err=lse_err, lse_err_half=lse_err_half, nan=int(np.isnan(got).sum()), ns=ns,
                counters=int(outs["counter_after"].sum()), smem_bytes=outs["smem_bytes"])


def run_kv_append(keys, values, mats: np.ndarray, consts: np.ndarray, *, shape: tuple[int, int, int, int], bits: int,
                  rot: int, nc: bool = False, tk: str = "f32", views: dict | None = None, seed: int = 0,
                  key_bits: int | None = None, pair_points: tuple[int, int] | None = None,
                  backend: str = "cuda") -> dict:
    """Execute the CUDA (or Metal: backend) rendering of metal/kv_append.body: quantize + pack keys and values [B, H, T, D].

    keys/values: numpy arrays in the input dtype (f32 or f16; bf16 as (uint16 array, "bf16")), or flat
    buffers starting at a view's first element with views = {"keys": (shape, strides), ...}; consts as
    kernels._append_consts builds it. Returns k_codes, k_norms, v_codes, v_norms (outputs start poisoned).
    """
    B, H, T, D = shape
    nf = D // 2 if pair_points else D  # pair codebooks: bits / key_bits are the fields' widths
    W = (nf * bits + 31) // 32
    KW = (nf * (key_bits or bits) + 31) // 32
    pk, pv = pair_points or (0, 0)
    template = [("TK", tk), ("D", D), ("BITS", bits), ("KBITS", key_bits or bits), ("ROT", rot), ("NC", int(nc)),
                ("PK", pk), ("PV", pv)]
    return emulate("kv_append", template,
                   dict(keys=keys, values=values, mats=mats.astype(np.float32), consts=consts.astype(np.float32)),
                   dict(k_codes=((B, H, T, KW), "u32"), k_norms=((B, H, T), "f16"), v_codes=((B, H, T, W), "u32"),
                        v_norms=((B, H, T), "f16")),
                   (B * H * T, 2), D, views=views, types={"keys": tk, "values": tk}, seed=seed, backend=backend)


class MLXStandIn:
    """Stands in for the object `mx.fast.cuda_kernel` returns, running the CUDA rendering on this executor:
    `rq_core.kernels.launch._kernel` can be patched with it so a kernel's Python wrapper (inputs, template, grid,
    output shapes and dtypes, init_value) runs end to end without a GPU. Inputs arrive as contiguous copies
    (their own strides). Records each call's template, grid, threadgroup and init_value in `calls`."""

    def __init__(self, name: str, backend: str = "cuda"):
        self.name = name
        self.backend = backend
        self.calls: list[dict] = []

    def __call__(self, *, inputs, template, grid, threadgroup, output_shapes, output_dtypes, init_value=None,
                 **_):
        import mlx.core as mx

        code = {mx.float32: "f32", mx.float16: "f16", mx.bfloat16: "bf16", mx.uint32: "u32", mx.int32: "i32"}
        tmpl = [(k, code[v] if isinstance(v, mx.Dtype) else int(v)) for k, v in template]
        self.calls.append(dict(template=tmpl, grid=grid, threadgroup=threadgroup, init_value=init_value))
        spec = K.SPECS[self.name]
        ins, types = {}, {}
        for n, a in zip(spec.inputs, inputs):
            if a.dtype == mx.bfloat16:
                ins[n] = (np.ascontiguousarray((np.array(a.astype(mx.float32)).view(np.uint32) >> 16)
                                               .astype(np.uint16)), "bf16")
            else:
                ins[n] = np.ascontiguousarray(np.array(a))  # np.array keeps a view's strides
            types[n] = code[a.dtype]
        outs = {n: (tuple(sh), code[dt]) for n, sh, dt in zip(spec.outputs, output_shapes, output_dtypes)}
        types.update({n: code[dt] for n, dt in zip(spec.outputs, output_dtypes)})  # (an fp16 `out` is __half*)
        res = emulate(self.name, tmpl, ins, outs, (grid[0] // threadgroup[0], grid[1]), threadgroup[0], types=types,
                      backend=self.backend)
        return [mx.array(res[n]).astype(dt) for n, dt in zip(spec.outputs, output_dtypes)]  # bf16 comes back as f32


def main() -> int:
    backend = sys.argv[1] if len(sys.argv) > 1 else "cuda"
    rng = np.random.default_rng(7)
    fused = functools.partial(run_fused, backend=backend)
    fails = 0
    cases = [
        ("G=8 d=128 T=300 f32 384 thr", lambda: fused(rng, G=8, d=128, T=300, nth=384)),
        ("G=8 d=128 T=1 f16", lambda: fused(rng, G=8, d=128, T=1, qdtype="f16")),
        ("G=4 d=128 T=700 L=2 causal bf16", lambda: fused(rng, G=4, d=128, T=700, L=2, causal=True,
                                                          qdtype="bf16", nth=256)),
        ("G=8 d=64 4-bit T=530 rot=0 pf=1", lambda: fused(rng, G=8, d=64, T=530, bits=4, rot=0, pf=1, nth=128)),
        ("G=2 d=128 T=400 dense B=2", lambda: fused(rng, G=2, d=128, T=400, rot=4, B=2, nth=256)),
        ("G=8 d=256 T=300 512 thr", lambda: fused(rng, G=8, d=256, T=300, nth=512)),
        ("G=8 d=128 T=1000 ring 2, rounds' merge", lambda: fused(rng, G=8, d=128, T=1000, nth=256, pf=1, stage=2,
                                                                 merge=0)),
        # copy-ring configurations and other row widths W (4, 8, 12, 32 words), threadgroup arrays also at their
        # worst legal alignment
        ("G=8 d=128 T=4100 ring 4 128 thr", lambda: fused(rng, G=8, d=128, T=4100, nth=128, pf=1, stage=4)),
        ("G=8 d=128 T=700 ring 2 worst layout", lambda: fused(rng, G=8, d=128, T=700, nth=256, pf=1, stage=2,
                                                              layout="worst")),
        ("G=8 d=64 2-bit T=530 ring 2 worst", lambda: fused(rng, G=8, d=64, T=530, bits=2, nth=256, pf=1,
                                                            stage=2, layout="worst")),
        ("G=8 d=128 2-bit T=300 ring 3", lambda: fused(rng, G=8, d=128, T=300, bits=2, nth=128, pf=1, stage=3)),
        ("G=4 d=256 4-bit T=400 ring 2 f16", lambda: fused(rng, G=4, d=256, T=400, bits=4, nth=64, pf=1,
                                                           stage=2, qdtype="f16", layout="worst")),
        ("pair decode ring 2", lambda: fused(rng, G=8, d=128, T=1000, nth=256, pf=1, stage=2, vdec=2)),
        ("pair decode d=256 rows in registers", lambda: fused(rng, G=8, d=256, T=300, nth=256, pf=2, vdec=2)),
        ("pair decode + one-barrier merge", lambda: fused(rng, G=8, d=128, T=700, nth=256, pf=1, stage=2, vdec=2,
                                                          merge=1)),
        ("4-bit keys 3-bit values", lambda: fused(rng, G=8, d=128, T=700, nth=256, pf=2, vdec=2, key_bits=4)),
        ("4-bit keys 2-bit values ring 1", lambda: fused(rng, G=8, d=128, T=600, bits=2, nth=256, pf=1, stage=1,
                                                         vdec=2, key_bits=4)),
        ("20 splits (two load rounds)", lambda: fused(rng, G=8, d=128, T=2600, nth=256, pf=1, stage=2, vdec=2,
                                                      merge=1, blocks=40)),
        ("f16 33 splits", lambda: fused(rng, G=8, d=128, T=4300, nth=256, pf=1, stage=2, vdec=2, merge=1,
                                        blocks=66, qdtype="f16")),
        ("384 thr ring 1 shared slabs", lambda: fused(rng, G=8, d=128, T=3000, nth=384, pf=1, stage=1, vdec=2,
                                                      merge=1, blocks=12)),
        ("bf16 rounds' merge", lambda: fused(rng, G=4, d=128, T=1000, nth=256, pf=1, stage=2, vdec=2, merge=0,
                                             qdtype="bf16")),
    ]
    for label, fn in cases:
        try:
            r = fn()
        except RuntimeError as e:  # a memory fault (misaligned or out-of-bounds access), a deadlock, a crash
            fails += 1
            print(f"FAIL {label}: {e}", flush=True)
            continue
        # the pass test of tools/gpu_check.py: against float64 math with the levels rounded to half
        tol = 8e-3 if "bf16" in label else 1e-3 if "f16" in label else 5e-5
        ok = r["nan"] == 0 and r.get("err_half", r["err"]) < tol and r.get("lse_err", 0.0) < 1e-3 \
            and r.get("counters", 0) == 0
        fails += not ok
        print(f"{'ok  ' if ok else 'FAIL'} {label:40s} splits {r['ns']:2d}  rel.err {r['err']:.2e}  "
              f"vs half levels {r.get('err_half', float('nan')):.1e}  "
              f"lse err {r.get('lse_err', float('nan')):.1e}  nan {r['nan']}  counters left {r.get('counters', '-')}",
              flush=True)
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
