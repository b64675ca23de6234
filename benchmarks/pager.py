"""Expert pager: decode tok/s and hit rate with 100%, 50% and 25% of experts resident, LRU vs mmap,
on a scaled-down Qwen3-MoE-shaped checkpoint with random weights (CPU). Writes
benchmarks/results/pager-<date>.json and the `pager` section of benchmarks/README.md.

    python benchmarks/pager.py [--layers 8] [--hidden 512] [--experts 32] [--top-k 4] [--tokens 64]
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import os
import json
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import mlx.core as mx  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402


def make_checkpoint(out: Path, a: argparse.Namespace) -> dict:
    from rq_core.checkpoint import build_model

    cfg = {"model_type": "qwen3_moe", "hidden_size": a.hidden, "intermediate_size": 2 * a.hidden,
           "moe_intermediate_size": a.hidden // 2, "num_attention_heads": a.hidden // 128,
           "num_key_value_heads": max(1, a.hidden // 512), "head_dim": 128, "num_hidden_layers": a.layers,
           "num_experts": a.experts, "num_experts_per_tok": a.top_k, "norm_topk_prob": True, "vocab_size": 4096,
           "rms_norm_eps": 1e-6, "rope_theta": 1e6, "max_position_embeddings": 4096, "tie_word_embeddings": False,
           "decoder_sparse_step": 1, "mlp_only_layers": [], "torch_dtype": "float32"}
    mx.random.seed(0)
    model = build_model(cfg)
    # float32: MLX's CPU quantized kernels are several times faster with float32 scales/activations
    w = {k: v.astype(mx.float32) for k, v in tree_flatten(model.parameters())}
    for k in w:
        if k.endswith("mlp.gate.weight"):
            w[k] = mx.random.normal(w[k].shape) * 0.5
    out.mkdir(parents=True)
    mx.save_safetensors(str(out / "model.safetensors"), w)
    (out / "config.json").write_text(json.dumps(cfg))
    return cfg


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--temp", type=float, default=1.0, help="sampling temperature (seeded; varied tokens)")
    ap.add_argument("--no-readme", action="store_true")
    a = ap.parse_args()

    from rq_core import recipe
    from rq_core.checkpoint import load
    from rq_core.generate import generate
    from rq_core.pack import pack
    from rq_core.pager import ExpertPager
    from rq_core.quantize import quantize

    tmp = Path(tempfile.mkdtemp(prefix="rq-pager-"))
    try:
        cfg = make_checkpoint(tmp / "src", a)
        rec = recipe.load("qwen3-16gb")
        for role in rec.roles.values():
            role.method = "rtn"
        q = quantize(tmp / "src", rec, tmp / "q")
        pk = pack(tmp / "q")
        prompt = [int(x) for x in mx.random.randint(0, cfg["vocab_size"], (a.prompt,), key=mx.random.key(1))]
        rows = []

        def bench(label: str, frac: float | None, policy: str | None) -> None:
            model = load(tmp / "q", tokenizer=False).model
            pager = None
            if frac is not None:
                pager = ExpertPager(model, tmp / "q", slots=max(a.top_k, int(round(frac * a.experts))), policy=policy)
            generate(model, prompt[:4], max_tokens=2, temp=a.temp, seed=1)  # warm up (first page-ins)
            if pager:
                pager.stats.__init__(policy=policy, slots=pager.stats.slots, resident_bytes=pager.stats.resident_bytes)
            runs = []
            for _ in range(a.repeats):  # median decode speed over repeats (this machine is shared)
                if pager:
                    pager.stats.__init__(policy=policy, slots=pager.stats.slots,
                                         resident_bytes=pager.stats.resident_bytes)
                runs.append(generate(model, prompt, max_tokens=a.tokens, temp=a.temp, seed=0,
                                     cache=model.make_cache()))
            runs.sort(key=lambda r: r.decode_tok_per_s)
            res = runs[len(runs) // 2]
            res.peak_memory_bytes = max(r.peak_memory_bytes for r in runs)
            st = pager.report().as_dict() if pager else None
            rows.append({"setup": label, "policy": policy or "none", "resident_fraction": frac if frac else 1.0,
                         "decode_tok_per_s": res.decode_tok_per_s, "prefill_tok_per_s": res.prefill_tok_per_s,
                         "peak_memory_bytes": res.peak_memory_bytes, "tokens": res.tokens, "pager": st})
            if pager:
                pager.close()
            del model, pager
            gc.collect()  # the paged modules form reference cycles: free this model before the next run
            mx.clear_cache()

        bench("all resident (no pager)", None, None)
        for frac in (1.0, 0.5, 0.25):
            for policy in ("lru", "mmap"):
                bench(f"{int(frac * 100)}% slots", frac, policy)
        ref = rows[0]["tokens"]
        for r in rows:
            r["tokens_equal_all_resident"] = r.pop("tokens") == ref
        meta = {"date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                "machine": f"{platform.machine()} {platform.system()}, {platform.processor() or 'cpu'}, "
                           f"mlx {mx.__version__} ({mx.default_device()})",
                "model": {k: cfg[k] for k in ("num_hidden_layers", "hidden_size", "moe_intermediate_size",
                                               "num_experts", "num_experts_per_tok")},
                "recipe": "qwen3-16gb (RTN)", "temp": a.temp, "quantized_bytes": q.bytes_out, "page_bytes": pk.page_bytes,
                "prompt_tokens": a.prompt, "decode_tokens": a.tokens, "repeats": a.repeats,
                "load_average_1min": os.getloadavg()[0], "cpus": os.cpu_count()}
        out = ROOT / "benchmarks" / "results" / f"pager-{dt.date.today().isoformat()}.json"
        out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    m = meta["model"]
    lines = [
        "## Expert pager (`python benchmarks/pager.py`)",
        "",
        f"{meta['date']}, {meta['machine']}. Qwen3-MoE-shaped random checkpoint: {m['num_hidden_layers']} layers, "
        f"hidden {m['hidden_size']}, {m['num_experts']} experts top-{m['num_experts_per_tok']}, moe_intermediate "
        f"{m['moe_intermediate_size']}; recipe {meta['recipe']}, {meta['quantized_bytes'] / 1e6:.1f} MB quantized, "
        f"expert pages of {meta['page_bytes']} B, float32 scales (MLX's CPU quantized kernels are several times "
        f"faster in float32 than bf16). Prompt {a.prompt} tokens, {a.tokens} decoded at temperature {a.temp} "
        "with a fixed seed (same tokens in every row when paging is exact); median decode speed of "
        f"{a.repeats} runs (pager counters from the last run), peak over the runs. The machine ({meta['cpus']} "
        f"cores) was shared with other jobs (1-min load average {meta['load_average_1min']:.1f} at the end), so "
        "speeds are noisy.",
        "Routers are random, so which experts repeat is not a real model's pattern: the hit rates say how the",
        "pager behaves, not what a trained model would get. The page files sit in the OS page cache here,",
        "so 'reads' are memory copies, not SSD reads. mmap keeps no slots (hit rate is the OS's, not measured).",
        "",
        "| setup | policy | decode tok/s | prefill tok/s | hit rate | expert reads | MB read | evictions "
        "| peak MLX MB | tokens == all resident |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        p = r["pager"] or {}
        hr = f"{100 * p['hit_rate']:.1f}%" if p.get("hit_rate") is not None else "-"
        lines.append(f"| {r['setup']} | {r['policy']} | {r['decode_tok_per_s']:.1f} | {r['prefill_tok_per_s']:.1f} | "
                     f"{hr} | {p.get('misses', '-')} | {p.get('bytes_read', 0) / 1e6:.1f} | {p.get('evictions', '-')} | "
                     f"{r['peak_memory_bytes'] / 1e6:.1f} | {'yes' if r['tokens_equal_all_resident'] else 'NO'} |")
    body = "\n".join(lines)
    print(body)
    if not a.no_readme:
        from _readme import write_section

        write_section("pager", body)


if __name__ == "__main__":
    main()
