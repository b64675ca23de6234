"""Pipeline-parallel `rq run` (mx.distributed, ring backend): the bundled model on 1 and 2 ranks on this machine
(localhost TCP), decode tok/s and each rank's peak memory, tokens equal; then, computed on paper, what each rank of
Nemotron 3 Super 120B at the nemotron-32gb recipe holds over 2 x 16 GB and 4 x 8 GB (the planner on
tests/data/configs/nemotron3-super-120b-a12b.json, the same split `rq run` makes) and the bytes each hop carries.

    python3 benchmarks/distributed.py [--tokens 64]

Writes benchmarks/results/distributed.json (overwritten by a rerun).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
import subprocess

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

PROMPT = "Once upon a time, in a kingdom by the sea, there lived"
NEMOTRON = ROOT / "tests" / "data" / "configs" / "nemotron3-super-120b-a12b.json"
LAYOUTS = [(2, 16e9), (4, 8e9)]  # (ranks, bytes a machine has)


def worker(out: str, tokens: int) -> None:
    """One rank (or the only process): greedy decode of the bundled model; writes this rank's numbers."""
    from rq_core import distributed as dist
    from rq_core.cache.kv_cache import KVSettings
    from rq_core.checkpoint import DEFAULT_MODEL, load
    from rq_core.generate import generate

    rank = dist.start() if dist.launched() else None
    ckpt = load(DEFAULT_MODEL, cpu_float32=True)
    layers = [0, len(ckpt.model.layers)]
    if rank is not None:
        ckpt = dist.shard_checkpoint(ckpt, rank)
        pipe = dist.pipeline_of(ckpt.model)
        layers = [pipe.start, pipe.end]
    ids = ckpt.tokenizer.encode(PROMPT)
    kv = KVSettings(mode="isoquant3", fp16_window=32)
    run = dist.guard(rank, generate)
    run(ckpt.model, ids, max_tokens=4, kv=kv, cache=ckpt.model.make_cache(kv))  # warm-up
    res = run(ckpt.model, ids, max_tokens=tokens, kv=kv, cache=ckpt.model.make_cache(kv))
    r = rank.rank if rank is not None else 0
    Path(f"{out}.{r}").write_text(json.dumps({
        "rank": r, "layers": layers, "tokens": res.tokens, "prefill_tok_per_s": res.prefill_tok_per_s,
        "decode_tok_per_s": res.steady_decode_tok_per_s, "peak_memory_bytes": res.peak_memory_bytes,
        "peak_rss_bytes": res.peak_rss_bytes, "kv_bytes": res.kv_bytes}))


def measure(ranks: int, tokens: int) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rank")
        me = [sys.executable, str(Path(__file__).resolve()), "--worker", out, "--tokens", str(tokens)]
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        if ranks == 1:
            cmd = me
        else:  # MLX's own launcher, as a user runs it
            cmd = [sys.executable, "-c", "from mlx._distributed_utils.launch import main; main()",
                   "--backend", "ring", "-n", str(ranks), "--", *me]
        subprocess.run(cmd, env=env, check=True, timeout=600)
        return [json.loads(Path(f"{out}.{r}").read_text()) for r in range(ranks)]


def layer_bytes_on_paper(cfg: dict, rec) -> tuple[list[int], list[int], int]:
    """(bytes of each layer as the recipe quantizes it, routed-expert bytes of each layer, bytes outside the layers)."""
    import re

    from rq_core.paging.planner import dtype_bytes, param_shapes, quantizable, tensor_bytes
    from rq_core.quant.roles import ROUTED_EXPERT, role_of

    n = cfg["num_hidden_layers"]
    total, routed, shared = [0] * n, [0] * n, 0
    db = dtype_bytes(cfg)
    for name, shape in param_shapes(cfg).items():
        name = name.rstrip("!")
        role = role_of(name, cfg)
        b = tensor_bytes(shape, rec.roles.get(role) if quantizable(name, shape, role) else None, db)
        m = re.search(r"\.layers\.(\d+)\.", name)
        if m is None:
            shared += b
            continue
        i = int(m.group(1))
        total[i] += b
        routed[i] += b if role == ROUTED_EXPERT else 0
    return total, routed, shared


def on_paper(hop_s: float) -> dict:
    from rq_core import distributed as dist
    from rq_core.paging.planner import (DTYPE_BYTES, _moe_info, activation_bytes, cache_tokens, kv_bytes,
                                        prefill_fp16_bytes)
    from rq_core.quant import recipe

    cfg = json.loads(NEMOTRON.read_text())
    rec = recipe.load("nemotron-32gb")
    sizes, routed, shared = layer_bytes_on_paper(cfg, rec)
    ctx, chunk = rec.pager.context, 512
    H = cfg["hidden_size"]
    out = {"model": NEMOTRON.stem, "recipe": rec.name, "context": ctx, "weights_bytes": sum(sizes) + shared,
           "shared_bytes": shared, "layouts": []}
    for ranks, machine in LAYOUTS:
        rows = []
        for r, (a, b) in enumerate(dist.split(sizes, ranks)):
            sc = dist.slice_config(cfg, None, a, b)
            per_tok, fixed = kv_bytes(sc, rec.kv.mode, rec.kv.bits, rec.kv.edge_layers, rec.kv.edge_bits)
            kvb = per_tok * cache_tokens(ctx, rec.kv.mode) + fixed
            pre = prefill_fp16_bytes(sc, rec.kv.mode, ctx, rec.kv.prefill_fp16, chunk)
            act = activation_bytes(sc, chunk)
            n_moe, E, k = _moe_info(sc)
            resident = shared + sum(sizes[a:b]) - sum(routed[a:b])
            per_expert = sum(routed[a:b]) // max(n_moe * E, 1)
            free = machine - resident - kvb - pre - act
            slots = int(min(E, max(0, free // max(n_moe * per_expert, 1)))) if n_moe else 0
            rows.append({"rank": r, "layers": [a, b], "pattern": sc["hybrid_override_pattern"],
                         "layer_bytes": sum(sizes[a:b]), "resident_bytes": resident,
                         "routed_bytes": sum(routed[a:b]), "kv_bytes": kvb, "prefill_fp16_bytes": pre,
                         "activation_bytes": act, "moe_layers": n_moe, "slots_per_layer": slots,
                         "experts_per_layer": E, "fits": (slots >= k) if n_moe else free >= 0,
                         "all_experts_resident": slots >= E})
        hop_decode = H * DTYPE_BYTES  # one token's hidden state, bf16
        out["layouts"].append({
            "ranks": ranks, "machine_bytes": machine, "ranks_detail": rows,
            "hop_bytes_decode_token": hop_decode, "hop_bytes_prefill_chunk": hop_decode * chunk,
            # the pipeline's per-token cost on top of one machine's step: ranks - 1 hops and the final all_gather,
            # at the measured localhost cost of a hop (computed, not measured on this model)
            "added_s_per_token_computed": ranks * hop_s})
    return out


def gb(n: float) -> str:
    return f"{n / 1e9:.2f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        return worker(a.worker, a.tokens)
    from _readme import save

    one, two = measure(1, a.tokens), measure(2, a.tokens)
    same = one[0]["tokens"] == two[0]["tokens"] == two[1]["tokens"]
    for r in one + two:  # the comparison is the result; the ids themselves are not kept
        r["generated_tokens"] = len(r.pop("tokens"))
    # what a token costs on top of the one-process step, per hop (two hops a token on 2 ranks: send + all_gather)
    hop_s = max(0.0, (1 / two[0]["decode_tok_per_s"] - 1 / one[0]["decode_tok_per_s"]) / 2)
    paper = on_paper(hop_s)
    lines = ["| bundled model (measured) | ranks | layers | decode tok/s | prefill tok/s | peak MLX MB | peak RSS MB |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for label, rs in (("1 process", one), ("2 ranks, localhost", two)):
        for r in rs:
            lines.append(f"| {label} | rank {r['rank']} | {r['layers'][0]}-{r['layers'][1] - 1} | "
                         f"{r['decode_tok_per_s']:.1f} | {r['prefill_tok_per_s']:.1f} | "
                         f"{r['peak_memory_bytes'] / 1e6:.1f} | {r['peak_rss_bytes'] / 1e6:.0f} |")
    lines += ["", f"Greedy tokens identical on 1 and 2 ranks: {same}. Measured cost of a hop on localhost: "
              f"{hop_s * 1e3:.2f} ms.", "",
              "| Nemotron 3 Super 120B, nemotron-32gb (computed) | rank | layers | resident GB | routed GB "
              "| KV GB | expert slots / layer | fits |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for lay in paper["layouts"]:
        for r in lay["ranks_detail"]:
            lines.append(f"| {lay['ranks']} x {gb(lay['machine_bytes'])} GB | {r['rank']} | {r['layers'][0]}-"
                         f"{r['layers'][1] - 1} | {gb(r['resident_bytes'])} | {gb(r['routed_bytes'])} | "
                         f"{gb(r['kv_bytes'])} | {r['slots_per_layer']} / {r['experts_per_layer']} | {r['fits']} |")
    lay0 = paper["layouts"][0]
    lines += ["", f"Computed, not measured: the planner's bytes for each rank's slice (the split `rq run` makes) at "
              f"{paper['context']:,} tokens of context; every rank also holds the embeddings and head "
              f"({gb(paper['shared_bytes'])} GB). A hop carries {lay0['hop_bytes_decode_token']:,} bytes a decoded "
              f"token ({lay0['hop_bytes_prefill_chunk'] / 1e6:.1f} MB a 512-token prefill chunk); at the hop cost "
              f"measured above, the pipeline adds about {lay0['added_s_per_token_computed'] * 1e3:.1f} ms (2 ranks) "
              f"and {paper['layouts'][1]['added_s_per_token_computed'] * 1e3:.1f} ms (4 ranks) to one machine's "
              "step per token, plus link time."]
    save("distributed", {"tokens_identical": same, "one_process": one, "two_ranks": two, "hop_s_measured": hop_s,
                         "nemotron_on_paper": paper}, "\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
