"""Expert pager: decode tok/s and hit rate with 100%, 50% and 25% of experts resident (LRU),
on a scaled-down Qwen3-MoE-shaped checkpoint with random weights (CPU). Writes
benchmarks/results/pager.json (its rows and the `pager` section of benchmarks/README.md).

    python benchmarks/pager.py [--layers 8] [--hidden 512] [--experts 32] [--top-k 4] [--tokens 64]

What checking pages costs (`--verify-cost`): tok/s with and without the pager's CRC32 checks, in one
process, interleaved (a fresh model and pager each time, so every run pays its first reads again),
at 50% of experts resident, on a real-size Qwen3-30B-A3B-shaped checkpoint. `--synthetic DIR` writes
one there first (random codes of tests/data/configs/qwen3-30b-a3b.json, each tensor at the bits and
group size the qwen3-16gb recipe gives its role, one shard per layer, so the whole model is never held;
about 8 GB, reused when DIR has it) and packs it. Writes one JSON file (--out), overwritten by a rerun.

    python benchmarks/pager.py --verify-cost --synthetic /tmp/rq-q3-30b [--layers 48] [--tokens 32] [--repeats 3]
    python benchmarks/pager.py --verify-cost --ckpt DIR   # an existing quantized checkpoint

What paging costs (`--pager-cost`, same --synthetic / --ckpt): greedy decode all-resident, then LRU at
--fractions of the experts resident (a budget planned for those slots), with speculation off and "auto" (the default): tok/s, hit rate,
bytes read per token, host syncs per forward pass, decode steps speculated and missed, ms per MoE layer call waiting for the routing read and in the pager's host work,
measured peak (MLX's peak + the staging buffer) against the budget, tokens equal to all-resident.

    python benchmarks/pager.py --pager-cost --synthetic /tmp/rq-q3-30b [--tokens 48] [--fractions 0.5,0.25]
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


QWEN3_CONFIG = ROOT / "tests" / "data" / "configs" / "qwen3-30b-a3b.json"


def write_synthetic(out: Path, layers: int | None = None, recipe_name: str = "qwen3-16gb", seed: int = 0) -> dict:
    """A quantized Qwen3-30B-A3B-shaped checkpoint with random codes (rq_core/tools/synth.py), written
    shard by shard (one per decoder layer, one for embeddings, norm and head) so peak memory is one layer's tensors."""
    from rq_core.tools import synth as synth_checkpoint

    cfg = synth_checkpoint.read_config(QWEN3_CONFIG)
    if layers is not None:
        cfg = synth_checkpoint.truncate(cfg, layers)
    synth_checkpoint.write(cfg, recipe_name, out, seed=seed)
    return json.loads((Path(out) / "config.json").read_text())


def verify_cost(a: argparse.Namespace) -> None:
    """Decode tok/s with and without page checks, interleaved, at 50% of experts resident."""
    from rq_core.checkpoint import load, load_config
    from rq_core.generate import generate
    from rq_core.paging.pager import ExpertPager

    ck, write_s, pack_s = _checkpoint(a)
    cfg = load_config(ck)
    E, k = cfg["num_experts"], cfg["num_experts_per_tok"]
    slots = max(k, E // 2)
    prompt = [int(x) for x in mx.random.randint(0, cfg["vocab_size"], (a.prompt,), key=mx.random.key(1))]
    rows = []
    for r in range(a.repeats):
        for verify in ((True, False) if r % 2 == 0 else (False, True)):  # alternate who goes first
            model = load(ck, tokenizer=False).model
            t = time.perf_counter()
            pager = ExpertPager(model, ck, slots=slots, verify=verify)  # checks the index and fingerprints
            attach = time.perf_counter() - t
            t = time.perf_counter()
            res = generate(model, prompt, max_tokens=a.tokens, temp=a.temp, seed=0)
            wall = time.perf_counter() - t
            st = pager.report()
            rows.append({"verify": verify, "repeat": r, "decode_tok_per_s": res.decode_tok_per_s,
                         "prefill_tok_per_s": res.prefill_tok_per_s, "wall_s": wall, "pager_attach_s": attach,
                         "generated_tokens": res.generated_tokens, "misses": st.misses, "hits": st.hits,
                         "bytes_read": st.bytes_read,
                         "experts_checked": sum(sum(l.checked) for l in pager.layers.values()),
                         "peak_memory_bytes": res.peak_memory_bytes, "tokens": res.tokens})
            print(f"verify={verify!s:5} repeat {r}: decode {res.decode_tok_per_s:.2f} tok/s, prefill "
                  f"{res.prefill_tok_per_s:.1f} tok/s, {st.misses} reads, {st.bytes_read / 1e9:.2f} GB", flush=True)
            pager.close()
            del model, pager
            gc.collect()
            mx.clear_cache()

    def median(v: bool, key: str) -> float:
        xs = sorted(x[key] for x in rows if x["verify"] == v)
        return xs[len(xs) // 2]

    ref = rows[0]["tokens"]
    for x in rows:
        x["tokens_equal_first_run"] = x.pop("tokens") == ref
    summary = {"decode_tok_per_s_verify": median(True, "decode_tok_per_s"),
               "decode_tok_per_s_no_verify": median(False, "decode_tok_per_s"),
               "wall_s_verify": median(True, "wall_s"), "wall_s_no_verify": median(False, "wall_s")}
    summary["decode_verify_over_no_verify"] = summary["decode_tok_per_s_verify"] / max(
        summary["decode_tok_per_s_no_verify"], 1e-9)
    meta = {"date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "machine": f"{platform.machine()} {platform.system()}, {platform.processor() or 'cpu'}, "
                       f"mlx {mx.__version__} ({mx.default_device()})", "cpus": os.cpu_count(),
            "checkpoint": str(ck), "synthetic": bool(a.synthetic),
            "model": {k_: cfg[k_] for k_ in ("num_hidden_layers", "hidden_size", "moe_intermediate_size",
                                              "num_experts", "num_experts_per_tok")},
            "slots_per_layer": slots, "resident_fraction": slots / E, "prompt_tokens": a.prompt,
            "decode_tokens": a.tokens, "temp": a.temp, "repeats": a.repeats,
            "write_checkpoint_s": write_s, "pack_s": pack_s,
            "note": "each run loads a fresh model and pager: page checks (CRC32, once per expert per pager) are "
                    "paid again in every verify=True run; page files are in the OS page cache after the first run"}
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "summary": summary, "rows": rows}, indent=1))
    print(json.dumps(summary))
    print(f"wrote {out}")


def _checkpoint(a: argparse.Namespace) -> tuple[Path, float, float]:
    """--synthetic DIR (written when missing) or --ckpt DIR, packed (again when its pages are stale); with the
    seconds spent writing and packing."""
    from rq_core.checkpoint import load, load_config
    from rq_core.errors import RQError
    from rq_core.paging.pack import INDEX, find_pages, pack
    from rq_core.paging.pager import ExpertPager

    t0 = time.perf_counter()
    if a.synthetic:
        ck = Path(a.synthetic)
        if not (ck / "config.json").is_file():
            write_synthetic(ck, a.layers)
    else:
        ck = Path(a.ckpt)
    write_s = time.perf_counter() - t0
    cfg = load_config(ck)
    if a.layers is not None and cfg["num_hidden_layers"] != a.layers:
        raise SystemExit(f"{ck} has {cfg['num_hidden_layers']} layers, not --layers {a.layers} (use another DIR)")
    t0 = time.perf_counter()
    packed = (find_pages(ck) / INDEX).is_file()
    if packed:
        try:
            ExpertPager(load(ck, tokenizer=False).model, ck, slots=1).close()
        except RQError:  # stale or damaged: pack again
            packed = False
    if not packed:
        pack(ck)
    return ck, write_s, time.perf_counter() - t0


def pager_cost(a: argparse.Namespace) -> None:
    """Greedy decode with all experts resident, then paged (LRU) at each --fractions, with speculation off and
    "auto" (ExpertPager(speculate=...)): tok/s, hit rate, bytes read
    per token, host syncs per forward pass, time waiting for routing reads and in the pager's own host work per
    MoE layer call, peak memory against a budget planned for those slots, and whether the tokens equal the
    all-resident ones."""
    from rq_core.checkpoint import load, load_config
    from rq_core.generate import generate
    from rq_core.paging.pack import expert_banks, load_index
    from rq_core.paging.pager import READ_THREADS, ExpertPager, slots_for_budget

    ck, write_s, pack_s = _checkpoint(a)
    setup_s = write_s + pack_s
    cfg = load_config(ck)
    E, k = cfg["num_experts"], cfg["num_experts_per_tok"]
    prompt = [int(x) for x in mx.random.randint(0, cfg["vocab_size"], (a.prompt,), key=mx.random.key(1))]
    ctx = a.prompt + a.tokens
    rows = []
    ref = None
    runs = [(None, "off")] + [(float(f), spec) for f in a.fractions.split(",") for spec in ("off", "auto")]
    for frac, speculate in runs:
        gc.collect()
        mx.clear_cache()
        model = load(ck, tokenizer=False).model
        row: dict = {"resident_fraction": 1.0 if frac is None else frac, "policy": "none" if frac is None else "lru"}
        pager = None
        baseline = mx.get_active_memory()
        if frac is not None:
            slots = max(k, int(round(frac * E)))
            index = load_index(ck, banks=expert_banks(model))
            probe = slots_for_budget(model, cfg, 1 << 62, context=ctx, prefill_chunk=a.prompt, index=index)
            budget = (probe["resident_bytes"] + probe["kv_bytes"] + probe["activation_bytes"]
                      + slots * probe["moe_layers"] * probe["bytes_per_expert"]
                      + min(slots, READ_THREADS, probe["top_k"]) * probe["staging_bytes_per_expert"])
            plan = slots_for_budget(model, cfg, budget, context=ctx, prefill_chunk=a.prompt, index=index)
            pager = ExpertPager(model, ck, slots=plan["slots_per_layer"], speculate=speculate)
            row.update(speculate=speculate, slots=plan["slots_per_layer"], budget_bytes=budget, planned_peak_bytes=plan["planned_peak_bytes"])
        res = generate(model, prompt, max_tokens=a.tokens, temp=0.0, seed=0, prefill_chunk=a.prompt)
        if ref is None:
            ref = res.tokens
        row.update(decode_tok_per_s=res.decode_tok_per_s, steady_decode_tok_per_s=res.steady_decode_tok_per_s,
                   prefill_tok_per_s=res.prefill_tok_per_s, generated_tokens=res.generated_tokens,
                   peak_memory_bytes=res.peak_memory_bytes - baseline, tokens_equal_all_resident=res.tokens == ref)
        if pager is not None:
            st = pager.report()
            passes = 1 + max(res.generated_tokens - 1, 0)  # one prefill chunk, then a forward pass per decode step
            calls = max(st.host_syncs, 1)
            measured = res.peak_memory_bytes - baseline + st.staging_bytes
            row.update(pager=st.as_dict(), bytes_read_per_token=st.bytes_read / max(res.generated_tokens, 1),
                       host_syncs_per_pass=st.host_syncs / passes, sync_ms_per_call=1e3 * st.sync_s / calls,
                       host_ms_per_call=1e3 * st.host_s / calls, measured_peak_bytes=measured,
                       peak_within_budget=measured <= row["budget_bytes"],
                       plan_error=(row["planned_peak_bytes"] - measured) / measured)
            pager.close()
        print(json.dumps({k_: v for k_, v in row.items() if k_ != "pager"}), flush=True)
        rows.append(row)
        del model, pager
    meta = {"date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "machine": f"{platform.machine()} {platform.system()}, {platform.processor() or 'cpu'}, "
                       f"mlx {mx.__version__} ({mx.default_device()})", "cpus": os.cpu_count(),
            "checkpoint": str(ck), "synthetic": bool(a.synthetic), "setup_s": setup_s,
            "model": {k_: cfg[k_] for k_ in ("num_hidden_layers", "hidden_size", "moe_intermediate_size",
                                              "num_experts", "num_experts_per_tok")},
            "prompt_tokens": a.prompt, "decode_tokens": a.tokens, "temp": 0.0}
    from _readme import save

    save("pager-cost", {"meta": meta, "rows": rows}, cost_table(rows), path=Path(a.out))


def _spec_name(v: object) -> str:
    return {True: "on", False: "off"}.get(v, str(v)) if isinstance(v, bool) else str(v)


def cost_table(rows: list[dict]) -> str:
    """Markdown: one row a run of pager_cost, tok/s also as a share of the all-resident run's."""
    full = next(r["decode_tok_per_s"] for r in rows if r["policy"] == "none")
    out = ["| experts resident | speculation | decode tok/s | of all resident | read MB/token | host syncs/pass "
           "| steps speculated / missed | measured peak GB | budget GB | same tokens |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        paged = r["policy"] != "none"
        out.append("| " + " | ".join([
            f"{r['resident_fraction']:.0%}", _spec_name(r["speculate"]) if paged else "—",
            f"{r['decode_tok_per_s']:.1f}", f"{r['decode_tok_per_s'] / full:.0%}",
            f"{r['bytes_read_per_token'] / 1e6:.1f}" if paged else "—",
            f"{r['host_syncs_per_pass']:.1f}" if paged else "—",
            f"{r['pager'].get('speculated', 0)} / {r['pager'].get('respun', 0)}" if paged else "—",
            f"{(r['measured_peak_bytes'] if paged else r['peak_memory_bytes']) / 1e9:.3f}",
            f"{r['budget_bytes'] / 1e9:.3f}" if paged else "—", "yes" if r["tokens_equal_all_resident"] else "NO"]) + " |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default 8; --verify-cost: the config's)")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--temp", type=float, default=1.0, help="sampling temperature (seeded; varied tokens)")
    ap.add_argument("--no-readme", action="store_true")
    ap.add_argument("--verify-cost", action="store_true", help="tok/s with and without page checks (see above)")
    ap.add_argument("--synthetic", metavar="DIR",
                    help="--verify-cost: write (or reuse) a real-size synthetic Qwen3-30B-A3B here")
    ap.add_argument("--ckpt", metavar="DIR", help="--verify-cost: a quantized checkpoint to page instead")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "pager-verify.json"),
                    help="--verify-cost: the results file (overwritten)")
    ap.add_argument("--pager-cost", action="store_true", help="all resident vs paged at --fractions (see pager_cost)")
    ap.add_argument("--fractions", default="0.5,0.25", help="--pager-cost: fractions of experts resident")
    a = ap.parse_args()
    if a.pager_cost:
        if bool(a.synthetic) == bool(a.ckpt):
            ap.error("--pager-cost needs one of --synthetic DIR or --ckpt DIR")
        if a.out == str(ROOT / "benchmarks" / "results" / "pager-verify.json"):
            a.out = str(ROOT / "benchmarks" / "results" / "pager-cost.json")
        pager_cost(a)
        return
    if a.verify_cost:
        if bool(a.synthetic) == bool(a.ckpt):
            ap.error("--verify-cost needs one of --synthetic DIR or --ckpt DIR")
        verify_cost(a)
        return
    a.layers = 8 if a.layers is None else a.layers

    from rq_core.quant import recipe
    from rq_core.checkpoint import load
    from rq_core.generate import generate
    from rq_core.paging.pack import pack
    from rq_core.paging.pager import ExpertPager
    from rq_core.quant.quantize import quantize

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
            bench(f"{int(frac * 100)}% slots", frac, "lru")
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
        "so 'reads' are memory copies, not SSD reads.",
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
        from _readme import save

        save("pager", {"meta": meta, "rows": rows}, body)  # one file, overwritten by a rerun


if __name__ == "__main__":
    main()
