"""Shrink a training checkpoint to travel to the device machine as a warm start, and expand it there.

The device call's working tree is capped (64 MiB with MLX's CUDA build and the token ids), so a 28 MB bf16
checkpoint does not fit beside them. `pack` stores every 2-D weight as mx.quantize(bits, group 64) codes +
scales + biases (5 bits: ~0.7 bytes a parameter) and the rest as is; `unpack` writes the dequantized
weights as one bf16 safetensors file with the config, a directory `train_reference.py train --init` reads.
A warm start only: the rounding (~1-2% of a weight's spread at 5 bits) is trained away by the next steps.

    python scripts/ckpt_transfer.py pack .train/ckpt_tp1 .train/xfer --bits 5
    python scripts/ckpt_transfer.py unpack .train/xfer /tmp/init
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import mlx.core as mx

from rq_core.checkpoint import load_weights

GROUP = 64


def pack(src: Path, dst: Path, bits: int) -> None:
    weights = load_weights(src)
    out = {}
    for name, w in weights.items():
        if w.ndim == 2 and w.shape[-1] % GROUP == 0:
            q, s, b = mx.quantize(w.astype(mx.float32), group_size=GROUP, bits=bits)
            out[name + ".__q"], out[name + ".__s"], out[name + ".__b"] = q, s.astype(mx.float16), b.astype(mx.float16)
        else:
            out[name] = w
    dst.mkdir(parents=True, exist_ok=True)
    tmp = dst / "weights.tmp.safetensors"
    mx.save_safetensors(str(tmp), out, metadata={"bits": str(bits), "group_size": str(GROUP)})
    tmp.replace(dst / "weights.safetensors")
    shutil.copy(src / "config.json", dst / "config.json")


def unpack(src: Path, dst: Path) -> None:
    packed, meta = mx.load(str(src / "weights.safetensors"), return_metadata=True)
    bits = int(meta["bits"])
    out = {}
    for name, w in packed.items():
        if name.endswith(".__q"):
            base = name[:-4]
            out[base] = mx.dequantize(w, packed[base + ".__s"].astype(mx.float32), packed[base + ".__b"].astype(mx.float32),
                                      group_size=GROUP, bits=bits).astype(mx.bfloat16)
        elif not name.endswith((".__s", ".__b")):
            out[name] = w
    dst.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(dst / "model.safetensors"), out)
    shutil.copy(src / "config.json", dst / "config.json")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("cmd", choices=["pack", "unpack"])
    ap.add_argument("src", type=Path)
    ap.add_argument("dst", type=Path)
    ap.add_argument("--bits", type=int, default=5)
    a = ap.parse_args()
    pack(a.src, a.dst, a.bits) if a.cmd == "pack" else unpack(a.src, a.dst)
    print(json.dumps({"cmd": a.cmd, "dst": str(a.dst), "bytes": sum(f.stat().st_size for f in a.dst.iterdir())}))


if __name__ == "__main__":
    main()
