"""attn_v5 as MLX would compile it on CUDA, built here with nvcc (no GPU needed): registers, spills, shared bytes
and the main loop's SASS (instructions, matrix ops, shared loads, and the sum of the compiler's fixed stall counts).

    python benchmarks/diag/nvcc_v5.py --nth 384 [--minb 1] [--qdtype f16] [--stage 1] [--defs NSLADD] [--window]
        [--pair] [--sacc 4] [--sass out.sass]

Needs nvcc (CUDA 13: sm_90) and, for the loop, cuobjdump and nvdisasm (`pip install nvidia-cuda-cuobjdump
nvidia-cuda-nvdisasm`). The loop is the
backward branch's range holding the most HMMA instructions; stall counts are bits 105-108 of each instruction's
128-bit control word (KERNEL_NOTES, session 12).
"""
from __future__ import annotations

import argparse
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

# MLX's device utils header, as much of it as generated kernels name
UTILS = """#pragma once
#include <cuda/std/array>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
namespace mlx::core::cu {
using Shape = cuda::std::array<int32_t, 8>;
using Strides = cuda::std::array<int64_t, 8>;
}
"""


def source(nth: int, minb: int, qdtype: str, stage: int, window: bool, bits: int = 3, kbits: int = 3,
           pk: int = 0, pv: int = 0, sacc: int = 1) -> str:
    import rq_core.kernels as K

    name = "attn_v5w" if window else "attn_v5"
    tmpl = [("TQ", qdtype), ("D", 128), ("BITS", bits), ("KBITS", kbits), ("PK", pk), ("PV", pv), ("R", 8),
            ("LQ", 1), ("HKV", 4),
            ("CAUSAL", 0), ("ROT", 3), ("NTH", nth), ("SACC", sacc), ("PF", 1), ("VDEC", 2), ("MERGE", 1),
            ("STAGE", stage)] + ([("WCAUSAL", 0)] if window else [])
    types = {"q": qdtype, "out": qdtype} | ({"wk": qdtype, "wv": qdtype} if window else {})
    src = K.full_source(name, "cuda", tmpl, types)
    extra = K.v5_source_defines(nth, minb)
    src = src.replace("namespace mlx::core::cu {\n\n__global__ void",
                      "".join(f"#define {d} 1\n" for d in extra)
                      + "namespace mlx::core::cu {\n\n__global__ "
                      + (f"__launch_bounds__({nth}, {minb}) " if minb > 0 else "") + "void")
    assert "void custom_kernel" in src
    return '#include "mlx/backend/cuda/device/utils.cuh"\n#include <cooperative_groups.h>\n' \
           "#define inf cuda::std::numeric_limits<float>::infinity()\n" + src


def cuobjdump() -> str | None:
    found = shutil.which("cuobjdump") or glob.glob(
        os.path.join(sys.prefix, "lib", "python3*", "site-packages", "nvidia", "cu*", "bin", "cuobjdump"))
    return found if isinstance(found, str) else (found[0] if found else None)


def loop_stats(sass: str) -> dict:
    """The main loop: the backward branch's [target, branch] range with the most HMMA instructions."""
    ins = []  # (address, text, stall)
    lines = sass.splitlines()
    for i, ln in enumerate(lines):
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);\s*/\* (0x[0-9a-f]+) \*/", ln)
        if not m:
            continue
        hi = re.search(r"/\* (0x[0-9a-f]+) \*/", lines[i + 1]) if i + 1 < len(lines) else None
        word = int(m.group(3), 16) | (int(hi.group(1), 16) << 64 if hi else 0)
        ins.append((int(m.group(1), 16), m.group(2).strip(), (word >> 105) & 0xF))
    best = None
    for k, (addr, text, _) in enumerate(ins):
        b = re.search(r"\bBRA\b.*?0x([0-9a-f]+)", text)
        if not b or int(b.group(1), 16) >= addr:
            continue
        body = [x for x in ins if int(b.group(1), 16) <= x[0] <= addr]
        nh = sum("HMMA" in x[1] for x in body)
        if best is None or nh > best[0] or (nh == best[0] and len(body) < len(best[1])):
            best = (nh, body)
    if best is None:
        return {}
    body = best[1]
    return dict(loop_instructions=len(body), hmma=best[0], lds=sum(re.search(r"\bLDS", x[1]) is not None for x in body),
                stall_sum=sum(x[2] for x in body))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nth", type=int, default=256)
    ap.add_argument("--minb", type=int, default=-1, help="launch bound's blocks an SM (-1: kernels' default)")
    ap.add_argument("--qdtype", default="f16")
    ap.add_argument("--stage", type=int, default=1)
    ap.add_argument("--defs", default="", help="RQ_V5_DEFS, comma-separated")
    ap.add_argument("--window", action="store_true")
    ap.add_argument("--pair", action="store_true", help="pair codebooks (128, 32): 7- and 5-bit fields")
    ap.add_argument("--sacc", type=int, default=1, help="score accumulators (RQ_V5_SACC)")
    ap.add_argument("--sass", default="", help="write the SASS here")
    a = ap.parse_args()
    if a.defs:
        os.environ["RQ_V5_DEFS"] = a.defs
    import rq_core.kernels as K

    minb = K._v5_minb(a.nth, None if a.minb < 0 else a.minb)
    with tempfile.TemporaryDirectory() as d:
        inc = Path(d) / "mlx/backend/cuda/device"
        inc.mkdir(parents=True)
        (inc / "utils.cuh").write_text(UTILS)
        cu = Path(d) / "k.cu"
        cu.write_text(source(a.nth, minb, a.qdtype, a.stage, a.window, *((5, 7, 128, 32) if a.pair else (3, 3, 0, 0)),
                               sacc=a.sacc))
        p = subprocess.run(["nvcc", "-std=c++17", "-arch=sm_90", "-cubin", "-Xptxas", "-v", f"-I{d}", "-o",
                            str(Path(d) / "k.cubin"), str(cu)], capture_output=True, text=True)
        if p.returncode != 0:
            print(p.stderr[-3000:])
            return 1
        log = p.stderr
        regs = re.search(r"Used (\d+) registers", log)
        spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
        smem = re.search(r"(\d+) bytes smem", log)
        print(f"nth {a.nth} minb {minb} {a.qdtype} stage {a.stage} defs [{a.defs}]{' window' if a.window else ''}: "
              f"registers {regs.group(1) if regs else '?'}, spill stores/loads "
              f"{spill.group(1) + '/' + spill.group(2) if spill else '?'} B, smem {smem.group(1) if smem else '?'} B")
        tool = cuobjdump()
        if tool:
            env = dict(os.environ, PATH=os.environ.get("PATH", "") + os.pathsep + os.path.dirname(tool))  # nvdisasm
            sass = subprocess.run([tool, "-sass", str(Path(d) / "k.cubin")], capture_output=True, text=True,
                                  env=env).stdout
            if a.sass:
                Path(a.sass).write_text(sass)
            print("loop:", loop_stats(sass))
    return 0


if __name__ == "__main__":
    sys.exit(main())
