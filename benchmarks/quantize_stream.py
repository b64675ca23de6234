"""Streaming quantization: peak memory of `rq quantize` on a synthetic checkpoint several times larger
than that peak. Runs the quantizer in a fresh process and reports its peak RSS (ru_maxrss) and MLX's
peak allocation next to the checkpoint size.

    python3 benchmarks/quantize_stream.py [--layers 16] [--hidden 1024] [--experts 16]
    python3 benchmarks/quantize_stream.py --config qwen3-30b-a3b --layers 20   # a real config: ~25 GB of bf16

With --config (a name in tests/data/configs), the checkpoint has that config's shapes, cut to --layers, and the
table sets the peak beside one decoder layer's bf16 bytes: what streaming must stay within, whatever the model's size.

Writes benchmarks/results/quantize_stream.json.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

# The peak RSS is the child's own (Linux: VmHWM of its address space; ru_maxrss would carry the parent's high-water
# mark over the fork, and the parent has just written the checkpoint)
CHILD = r"""
import json, resource, sys
import mlx.core as mx
from rq_core.quant import recipe
from rq_core.quant.quantize import quantize

def peak_rss():
    try:
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # macOS: bytes

rec = recipe.load("qwen3-16gb")
for r in rec.roles.values():
    r.method = "rtn"
base = peak_rss()
res = quantize(sys.argv[1], rec, sys.argv[2], shard_bytes=64 * 10**6)
print(json.dumps({"peak_rss": peak_rss(), "rss_before": base,
                  "peak_mlx": res.peak_memory_bytes, "bytes_in": res.bytes_in, "bytes_out": res.bytes_out,
                  "shards": res.shards}))
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--config", default=None, help="a real config (name in tests/data/configs): its shapes, --layers of them")
    ap.add_argument("--dir", default=None, help="folder for the temporary checkpoints (default: the system's temp)")
    a = ap.parse_args()
    configs = ROOT / "tests/data/configs"
    if a.config and not (configs / f"{a.config}.json").is_file():
        ap.error(f"--config {a.config!r}: not one of {', '.join(sorted(f.stem for f in configs.glob('*.json')))}")
    import mlx.core as mx

    tmp = Path(tempfile.mkdtemp(prefix="rq-qstream-", dir=a.dir))
    try:
        if a.config:
            from rq_core.tools import synth

            cfg = synth.truncate(json.loads((ROOT / "tests/data/configs" / f"{a.config}.json").read_text()), a.layers)
            cfg["torch_dtype"] = "bfloat16"
        else:
            cfg = {"model_type": "qwen3_moe", "hidden_size": a.hidden, "intermediate_size": 2 * a.hidden,
                   "moe_intermediate_size": a.hidden // 2, "num_attention_heads": a.hidden // 128,
                   "num_key_value_heads": 2, "head_dim": 128, "num_hidden_layers": a.layers,
                   "num_experts": a.experts, "num_experts_per_tok": 2, "vocab_size": 8192, "rms_norm_eps": 1e-6,
                   "rope_theta": 1e6, "max_position_embeddings": 4096, "tie_word_embeddings": False,
                   "torch_dtype": "bfloat16"}
        src = tmp / "src"
        src.mkdir()
        (src / "config.json").write_text(json.dumps(cfg))
        # Write layer by layer (hub layout: one tensor per expert), so building the input stays small too.
        from mlx.utils import tree_flatten

        from rq_core.checkpoint import build_model

        model = build_model(cfg)
        names = [(k, v.shape) for k, v in tree_flatten(model.parameters())]
        del model
        groups: dict[str, dict] = {}
        for k, shp in names:
            key = k.split(".mlp.")[0] if ".layers." in k else "head"
            if ".switch_mlp." in k:
                pre, rest = k.split(".switch_mlp.")
                for e in range(shp[0]):
                    groups.setdefault(key, {})[f"{pre}.experts.{e}.{rest}"] = shp[1:]
            else:
                groups.setdefault(key, {})[k] = shp
        index = {}
        layer_bytes = sum(2 * math.prod(shp) for k, shp in names if k.startswith("model.layers.0."))  # bf16
        for i, (key, tensors) in enumerate(groups.items()):
            w = {k: (mx.random.normal(s) * 0.02).astype(mx.bfloat16) for k, s in tensors.items()}
            f = f"model-{i:05d}.safetensors"
            mx.save_safetensors(str(src / f), w)
            index.update({k: f for k in w})
            del w
        (src / "model.safetensors.index.json").write_text(json.dumps({"weight_map": index}))
        size = sum(p.stat().st_size for p in src.glob("*.safetensors"))
        out = subprocess.run([sys.executable, "-c", CHILD, str(src), str(tmp / "q")], capture_output=True,
                             text=True, cwd=ROOT, check=True)
        r = json.loads(out.stdout.strip().splitlines()[-1])
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    r.update({"checkpoint_bytes": size, "layer_bf16_bytes": layer_bytes, "config": cfg})
    shape = (f"{a.config}'s shapes, {a.layers} layers" if a.config else
             f"{a.layers} layers, hidden {a.hidden}, {a.experts} experts")
    body = "\n".join([
        f"Synthetic bf16 Qwen3-MoE-shaped checkpoint ({shape}, hub layout with one tensor per expert), quantized "
        "with qwen3-16gb (RTN) in a fresh process.",
        "",
        "| checkpoint | one layer (bf16) | output | peak MLX allocation | peak RSS (whole process) | RSS before "
        "quantizing | peak RSS / one layer |",
        "| --- | --- | --- | --- | --- | --- | --- |",
        f"| {size / 1e9:.2f} GB | {layer_bytes / 1e9:.2f} GB | {r['bytes_out'] / 1e9:.2f} GB in {r['shards']} shards | "
        f"{r['peak_mlx'] / 1e9:.2f} GB | {r['peak_rss'] / 1e9:.2f} GB | {r['rss_before'] / 1e9:.2f} GB | "
        f"{r['peak_rss'] / layer_bytes:.2f}x |",
    ])
    print(body)
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from _readme import save

    save("quantize_stream", r, body)


if __name__ == "__main__":
    main()
