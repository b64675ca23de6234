"""Decode speed of rq (fp16 and IsoQuant-3 KV) against mlx-lm on the same weight arrays, per context (GPU).

    python3 benchmarks/decode_vs_mlxlm.py --family qwen3_moe  --dir /tmp/rq-synth
    python3 benchmarks/decode_vs_mlxlm.py --family gemma4     --dir /tmp/rq-synth
    python3 benchmarks/decode_vs_mlxlm.py --family nemotron_h --dir /tmp/rq-synth

For each family a synthetic checkpoint of its real config (rq_core/tools/synth.py: random codes at the
shipped recipe's bits, rq quantize's layout, which mlx-lm loads as it is) is written under --dir (reused when there).
It is loaded once: rq's loader and mlx-lm's `load_model` read the same lazily loaded arrays (mx.load is shared while
both load), so the two models hold one copy of the weights (`shared_weights` says how many bytes the second model
added). Then, in one process, for every context (2K, 32K, 128K that fit the config's max_position_embeddings):
rq with fp16 KV, rq with IsoQuant-3 KV (as `rq run` makes it: fp16 window 32, 4-bit edge layers) and mlx-lm (its
fp16 KVCache / RotatingKVCache) each get a fresh cache filled to the context with random K/V through the cache's own
append (rq: rq_core.tools.profile.fill_caches; mlx-lm: update_and_fetch), then --tokens greedy tokens through the
runner's own loop (rq_core.generate.decode_steps; mlx_lm.generate.generate_step), the three taking turns of --chunk
tokens as `rq bench`'s KV modes do (rq_core.tools.bench.decode_in_turns; the order rotating each repetition, reversed
every other one), so that the host's speed, which bounds a step at short context and drifts within minutes, reaches
all three alike. tok/s: each turn's tokens after its first over the time from its first to its last.
Before timing, the two models' logits on a short prompt are compared (max abs difference).
With --prefill N,...: each runner also prefills the same N random token ids into a fresh cache through its own path
(rq_core.generate.generate, prompt chunks of 512 and the KV mode's prefill; mlx-lm's generate_step, chunks of 2048)
up to its first token, one runner after another (the order rotating each repetition): prompt tok/s (N over the
time to the first token) and the prefill's peak memory.

Results: benchmarks/results/decode_vs_mlxlm.json; a run replaces its families' rows and keeps the others'.
CPU check at tiny scale: --config PATH (any config JSON) --layers 2 --contexts 64,256 --tokens 8 --repeats 2.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for p in (str(ROOT), str(ROOT / "benchmarks")):
    if p not in sys.path:
        sys.path.insert(0, p)

import mlx.core as mx  # noqa: E402

from rq_core.tools import synth  # noqa: E402

FAMILIES = {"qwen3_moe": "qwen3-30b-a3b", "gemma4": "gemma4-26b-a4b", "nemotron_h": "nemotron3-nano-30b-a3b"}
RESULTS = "decode_vs_mlxlm"
RUNNERS = ("rq fp16", "rq isoquant3", "mlx-lm fp16")


@contextlib.contextmanager
def shared_mx_load():
    """While open, mx.load of the same file returns the same arrays (a fresh dict each call), so two loaders share
    one lazily loaded copy of the weights."""
    orig = mx.load
    seen: dict[str, dict] = {}

    def load(path, *a, **kw):
        if not isinstance(path, (str, os.PathLike)) or a or kw:
            return orig(path, *a, **kw)
        key = os.path.realpath(path)
        if key not in seen:
            seen[key] = orig(str(path))
        return dict(seen[key])

    mx.load = load
    try:
        yield
    finally:
        mx.load = orig


def load_both(ck: Path):
    """(rq checkpoint, mlx-lm model, bytes the mlx-lm model added beyond rq's) on one copy of the weights."""
    from mlx.utils import tree_flatten
    from mlx_lm.utils import load_model

    from rq_core.checkpoint import load

    with shared_mx_load():
        rq = load(ck, tokenizer=False)  # stored dtype: a float32 cast on the CPU would copy
        mx.eval(rq.model.parameters())
        before = mx.get_active_memory()
        theirs, _ = load_model(ck)  # evaluates its parameters: the arrays rq's model already holds
        mx.eval(theirs.parameters())
        added = mx.get_active_memory() - before
    ours = {id(v) for _, v in tree_flatten(rq.model.parameters())}
    n_theirs = [v for _, v in tree_flatten(theirs.parameters())]
    same = sum(1 for v in n_theirs if id(v) in ours)
    return rq, theirs, {"added_bytes": int(added), "arrays": len(n_theirs), "same_objects": same}


def logits_pair(rq_model, mlx_model, vocab: int, n: int = 16, seed: int = 0) -> tuple[mx.array, mx.array]:
    """Both models' logits (float32) on the same `n` random token ids, fresh caches."""
    from mlx_lm.models.cache import make_prompt_cache

    ids = mx.random.randint(0, vocab, (1, n), key=mx.random.key(seed))
    a = rq_model(ids, cache=rq_model.make_cache()).astype(mx.float32)
    b = mlx_model(ids, cache=make_prompt_cache(mlx_model)).astype(mx.float32)
    mx.eval(a, b)
    return a, b


def compare(a: mx.array, b: mx.array) -> dict:
    """Max abs difference of two logit arrays, b's spread, and top-1 agreement."""
    return {"prompt_tokens": a.shape[1], "max_abs_diff": float(mx.abs(a - b).max()), "logit_std": float(b.std()),
            "top1_agree": float((a.argmax(-1) == b.argmax(-1)).astype(mx.float32).mean())}


def align_dt_clamp(rq_model, mlx_model) -> bool:
    """Give mlx-lm's Mamba mixers rq's dt clamp, so the check compares one function. rq clamps dt to
    [time_step_min, inf) in every step (transformers' Nemotron-H does in its chunked prefill scan, not in its
    one-token update); mlx-lm's nemotron_h clamps to [0, inf). Random routers and projections put some dt below
    0.001, where the two differ (2-layer Nemotron 3 Nano, 16 tokens, float32: 0.016 apart, 0 once aligned). The
    clip runs either way: the timing is not changed. True where a mixer was aligned."""
    ours = [m for m in rq_model.modules() if hasattr(m, "dt_min") and hasattr(m, "dt_max")]
    theirs = [m for m in mlx_model.modules() if hasattr(m, "time_step_limit")]
    if not ours or len(ours) != len(theirs):
        return False
    for o, t in zip(ours, theirs):
        t.time_step_limit = (o.dt_min, o.dt_max)
    return True


def mlx_fill(model, cache: list, n_tokens: int, seed: int = 0, chunk: int = 8192) -> None:
    """mlx-lm's caches holding `n_tokens` of context: one real token through the model (shapes, dtypes, state
    caches), then random K/V for the rest through each KV cache's update_and_fetch."""
    from mlx_lm.models.cache import KVCache, RotatingKVCache

    mx.eval(model(mx.array([[1]], mx.int32), cache=cache))
    n = n_tokens - 1
    rand: dict[tuple, tuple] = {}
    key = mx.random.key(seed)
    for c in cache:
        if not isinstance(c, (KVCache, RotatingKVCache)) or n <= 0 or c.keys is None:
            continue
        B, H, _, D = c.keys.shape
        Dv = c.values.shape[3]
        for s in range(0, n, chunk):
            L = min(chunk, n - s)
            shp = (B, H, L, D, Dv, c.keys.dtype)
            if shp not in rand:  # one random chunk a shape: values do not change the time
                k1, k2, key = mx.random.split(key, 3)
                rand[shp] = (mx.random.normal((B, H, L, D), key=k1).astype(c.keys.dtype),
                             mx.random.normal((B, H, L, Dv), key=k2).astype(c.values.dtype))
            k, v = rand[shp]
            c.update_and_fetch(k, v)
            mx.eval(c.state)
    del rand


def mlx_start(model, context: int, tokens: int, seed: int = 0):
    """mlx-lm's fresh cache filled to `context`, and its loop (mlx_lm.generate.generate_step) after one real token."""
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    mlx_fill(model, cache, context, seed=seed)
    steps = generate_step(mx.array([1], mx.int32), model, max_tokens=tokens, prompt_cache=cache)
    return (int(tok) for tok, _ in steps), {}


def prompt_ids(vocab: int, n: int, seed: int = 0) -> list[int]:
    """The same n random token ids for every runner's prefill."""
    return mx.random.randint(0, vocab, (n,), key=mx.random.key(seed + 1)).tolist()


def rq_prefill(model, kv, ids: list[int]) -> dict:
    """rq's prefill of `ids` (rq_core.generate.generate) up to its first token: prompt tok/s and the phase's peak."""
    from rq_core.generate import generate

    res = generate(model, ids, max_tokens=1, temp=0.0, kv=kv)
    out = {"prefill_tok_per_s": res.prefill_tok_per_s, "prefill_s": res.prefill_s,
           "peak_memory_bytes": res.prefill_peak_memory_bytes}
    del res
    gc.collect()
    mx.clear_cache()
    return out


def mlx_prefill(model, ids: list[int]) -> dict:
    """mlx-lm's prefill of `ids` (its generate_step) up to its first token."""
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    mx.reset_peak_memory()
    t0 = time.perf_counter()
    tok, _ = next(generate_step(mx.array(ids, mx.int32), model, max_tokens=1, prompt_cache=cache))
    int(tok)
    secs = time.perf_counter() - t0
    out = {"prefill_tok_per_s": len(ids) / secs, "prefill_s": secs, "peak_memory_bytes": int(mx.get_peak_memory())}
    del cache
    gc.collect()
    mx.clear_cache()
    return out


def build_rows(runs: dict, contexts: list[int], cfg: dict, label: str) -> list[dict]:
    from rq_core.tools.bench import spread

    rows = []
    for c in contexts:
        if not runs[(c, "mlx-lm fp16")]:
            continue
        ref = spread([x["decode_tok_per_s"] for x in runs[(c, "mlx-lm fp16")]])["median"]
        for r in RUNNERS:
            xs = runs[(c, r)]
            if not xs:
                continue
            s = spread([x["decode_tok_per_s"] for x in xs])
            rows.append({"family": cfg["model_type"], "config": label, "context": c, "runner": r,
                         "decode_tok_per_s": s, "decode_tok_per_s_runs": [x["decode_tok_per_s"] for x in xs],
                         "ratio_to_mlx_lm_fp16": s["median"] / ref if ref > 0 else None,
                         "peak_memory_bytes": max(x["peak_memory_bytes"] for x in xs),
                         "kv_bytes": xs[-1].get("kv_bytes"), "generated_tokens": xs[-1]["generated_tokens"],
                         "fill_s": spread([x["fill_s"] for x in xs]),
                         # which attention path the compressed layers took (rq's caches; mlx-lm's record none)
                         "attention_paths": xs[-1].get("attention_paths")})
    return rows


def build_prefill_rows(runs: dict, lengths: list[int], label: str, layers: int) -> list[dict]:
    from rq_core.tools.bench import spread

    rows = []
    for n in lengths:
        if not runs.get((n, "mlx-lm fp16")):
            continue
        ref = spread([x["prefill_tok_per_s"] for x in runs[(n, "mlx-lm fp16")]])["median"]
        ref_peak = max(x["peak_memory_bytes"] for x in runs[(n, "mlx-lm fp16")])
        for r in RUNNERS:
            xs = runs.get((n, r))
            if not xs:
                continue
            s = spread([x["prefill_tok_per_s"] for x in xs])
            peak = max(x["peak_memory_bytes"] for x in xs)
            rows.append({"config": label, "layers": layers, "prompt_tokens": n, "runner": r, "prefill_tok_per_s": s,
                         "prefill_tok_per_s_runs": [x["prefill_tok_per_s"] for x in xs],
                         "ratio_to_mlx_lm_fp16": s["median"] / ref if ref > 0 else None,
                         "peak_memory_bytes": peak, "peak_ratio_to_mlx_lm_fp16": peak / ref_peak if ref_peak else None})
    return rows


def run_family(cfg: dict, ck_root: Path, a: argparse.Namespace, label: str, on_partial=None) -> dict:
    from rq_core.tools.bench import decode_in_turns, kv_settings, start_decode
    from rq_core.checkpoint import text_config
    from rq_core.cache.kv_cache import DEFAULT_EDGE_LAYERS, DEFAULT_FP16_WINDOW

    if a.layers is not None:
        cfg = synth.truncate(cfg, a.layers)
        if cfg["model_type"] == "nemotron_h" and "M" not in cfg["hybrid_override_pattern"]:
            raise SystemExit(f"mlx-lm's nemotron_h needs a Mamba layer; --layers {a.layers} keeps "
                             f"{cfg['hybrid_override_pattern']!r}: use --layers 3 or more")
    tc = text_config(cfg)
    limit = tc.get("max_position_embeddings")
    contexts = [c for c in a.contexts if not limit or c + a.tokens <= limit]
    skipped = [c for c in a.contexts if c not in contexts]
    recipe_name = a.recipe or synth.default_recipe(cfg)
    t0 = time.perf_counter()
    ck, reused = synth.ensure(cfg, recipe_name, ck_root / label, seed=a.seed,
                              progress=lambda s, d, t: print(f"\r  {label}: writing shard {d}/{t}", end="" if d < t
                                                             else "\n", file=sys.stderr, flush=True))
    write_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    rq, theirs, shared = load_both(ck)
    load_s = time.perf_counter() - t0
    vocab = int(tc["vocab_size"])
    aligned = align_dt_clamp(rq.model, theirs)
    stored = logits_pair(rq.model, theirs, vocab, seed=a.seed)
    check = compare(*stored)
    print(f"  {label}: logits max |rq - mlx-lm| {check['max_abs_diff']:.3g} (logit std {check['logit_std']:.3g}, "
          f"top-1 agreement {check['top1_agree']:.0%}); mlx-lm model added {shared['added_bytes'] / 2**20:.0f} MiB",
          file=sys.stderr, flush=True)
    fp16, iso = kv_settings(["fp16", "isoquant3"], fp16_window=DEFAULT_FP16_WINDOW, edge_layers=DEFAULT_EDGE_LAYERS)
    starts = {"rq fp16": lambda c, n: start_decode(rq.model, fp16, c, n, seed=a.seed),
              "rq isoquant3": lambda c, n: start_decode(rq.model, iso, c, n, seed=a.seed),
              "mlx-lm fp16": lambda c, n: mlx_start(theirs, c, n, a.seed)}

    from mlx_lm.generate import generation_stream

    def cell(c: int, n: int, order: list[str]) -> dict[str, dict]:
        return decode_in_turns({r: (lambda r=r: starts[r](c, n)) for r in order}, order, n, a.chunk,
                               streams=(generation_stream,))

    info = {"config": label, "layers": tc["num_hidden_layers"], "recipe": recipe_name, "contexts": contexts,
            "contexts_skipped_beyond_max_position_embeddings": skipped, "checkpoint": str(ck),
            "checkpoint_reused": reused, "checkpoint_bytes": sum(f.stat().st_size for f in ck.glob("*.safetensors")),
            "write_s": write_s, "load_s": load_s, "logits_check": check, "shared_weights": shared,
            "mamba_dt_clamp_aligned": aligned,
            "tokens": a.tokens, "repeats": a.repeats, "chunk": a.chunk}
    cell(min(contexts), min(a.tokens, 2 * a.chunk), list(RUNNERS))  # warm-up: kernels compiled, untimed
    runs: dict[tuple[int, str], list[dict]] = {(c, r): [] for c in contexts for r in RUNNERS}
    for rep in range(a.repeats):
        # who goes first rotates, and every other repetition the turns run backwards: each runner follows each other
        order = list(RUNNERS[rep % 3:] + RUNNERS[:rep % 3])[::-1 if rep % 2 else 1]
        for c in contexts:
            for r, x in cell(c, a.tokens, order).items():
                runs[(c, r)].append(x)
                print(f"  {label} repeat {rep} context {c} {r}: {x['decode_tok_per_s']:.2f} tok/s, "
                      f"peak {x['peak_memory_bytes'] / 2**30:.2f} GiB", file=sys.stderr, flush=True)
        if on_partial is not None:  # saved after each repetition: a run cut short keeps what it measured
            on_partial({**info, "repeats_done": rep + 1}, build_rows(runs, contexts, cfg, label), [])
    rows = build_rows(runs, contexts, cfg, label)
    lengths = [n for n in a.prefill if not limit or n + 1 <= limit]
    info["prefill_skipped_beyond_max_position_embeddings"] = [n for n in a.prefill if n not in lengths]
    prefill_runs: dict[tuple[int, str], list[dict]] = {}
    pcells = {"rq fp16": lambda ids: rq_prefill(rq.model, fp16, ids),
              "rq isoquant3": lambda ids: rq_prefill(rq.model, iso, ids),
              "mlx-lm fp16": lambda ids: mlx_prefill(theirs, ids)}
    if lengths:
        # warm-up, untimed: the shortest length whole, so every chunk shape's kernels are compiled before timing (a few
        # tokens would leave the full chunks' kernels to the first timed prefill)
        for fn in pcells.values():
            fn(prompt_ids(vocab, min(lengths), a.seed))
    for rep in range(a.prefill_repeats if lengths else 0):
        order = list(RUNNERS[rep % 3:] + RUNNERS[:rep % 3])
        for n in lengths:
            ids = prompt_ids(vocab, n, a.seed)
            for r in order:
                x = pcells[r](ids)
                prefill_runs.setdefault((n, r), []).append(x)
                print(f"  {label} prefill repeat {rep} {n} tokens {r}: {x['prefill_tok_per_s']:.1f} tok/s, "
                      f"peak {x['peak_memory_bytes'] / 2**30:.2f} GiB", file=sys.stderr, flush=True)
        if on_partial is not None:
            on_partial({**info, "prefill_repeats_done": rep + 1}, rows,
                       build_prefill_rows(prefill_runs, lengths, label, tc["num_hidden_layers"]))
    prefill_rows = build_prefill_rows(prefill_runs, lengths, label, tc["num_hidden_layers"])
    # the same check in float32, after timing (casting copies the scales, biases and norms): rounding apart, the two
    # models should compute the same function. On the CPU: its float32 is exact, where a GPU's float32 matmuls may
    # round their inputs to TF32, enough for a random router's near-tied experts to swap and the two to part
    from rq_core.models.base import set_decode_graphs

    set_decode_graphs(rq.model, True)  # drops the traced graphs, which hold the stored-dtype weights
    rq.model.set_dtype(mx.float32)
    theirs.set_dtype(mx.float32)
    with mx.stream(mx.cpu):
        ref = logits_pair(rq.model, theirs, vocab, seed=a.seed)
    info["logits_check_float32"] = compare(*ref)
    info["logits_check_float32_device"] = "cpu"
    # in the stored dtype, random weights amplify rounding layer by layer for both models alike: each one's distance
    # from its own float32 logits says whether rq's rounding is worse than mlx-lm's
    info["stored_dtype_vs_float32"] = {"rq": compare(stored[0], ref[0]), "mlx_lm": compare(stored[1], ref[1])}
    del stored, ref
    del rq, theirs
    gc.collect()
    mx.clear_cache()
    if not a.keep and not reused:
        shutil.rmtree(ck, ignore_errors=True)
    return {"info": info, "rows": rows, "prefill": prefill_rows}


def side_by_side(rows: list[dict], infos: dict, along: str, metric: str, digits: int) -> list[str]:
    """A table row per (model, `along` value): each runner's `metric` median (min-max), rq's over mlx-lm's, peaks."""
    lines = [f"| model | {along.replace('_', ' ')} | rq fp16 tok/s | rq isoquant3 tok/s | mlx-lm fp16 tok/s | "
             "rq fp16 / mlx-lm | rq isoquant3 / mlx-lm | peak GiB (rq fp16, rq isoquant3, mlx-lm) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    cells: dict = {}
    for r in rows:
        cells.setdefault((r["config"], r[along]), {})[r["runner"]] = r
    for (config, at), by in cells.items():
        inf = infos[config]
        row = next(iter(by.values()))  # rows kept from an earlier run (prefill) carry that run's layers
        layers = row.get("layers", inf["layers"])
        done = inf.get("repeats_done", inf["repeats"])
        part = ((f", {done} of {inf['repeats']} repetitions" if done < inf["repeats"] else ", float32 check not reached")
                if inf.get("partial") and row.get("run") in (None, inf.get("run")) else "")

        def rate(runner: str) -> str:
            d = by.get(runner, {}).get(metric)
            return "-" if d is None else f"{d['median']:.{digits}f} ({d['min']:.{digits}f}-{d['max']:.{digits}f})"

        def ratio(runner: str) -> str:
            x = by.get(runner, {}).get("ratio_to_mlx_lm_fp16")
            return "-" if x is None else f"{x:.2f}x"

        peaks = ", ".join("-" if r not in by else f"{by[r]['peak_memory_bytes'] / 2**30:.2f}" for r in RUNNERS)
        lines.append(f"| {config} ({layers} layers{part}) | {at} | {rate('rq fp16')} | {rate('rq isoquant3')} | "
                     f"{rate('mlx-lm fp16')} | {ratio('rq fp16')} | {ratio('rq isoquant3')} | {peaks} |")
    return lines


def table(rows: list[dict], infos: dict, prefill: list[dict] | None = None) -> str:
    """The decode table (a row per model and context), the prefill table where there are prefill rows, the notes."""
    lines = side_by_side(rows, infos, "context", "decode_tok_per_s", 1)
    if prefill:
        apart = {r["config"]: r["run"] for r in prefill
                 if r.get("run") and r["run"] != infos.get(r["config"], {}).get("run")}
        lines += ["", "Prefill: the same random prompt through each runner's own prefill, up to its first token"
                  + ("" if not apart else " (rows from a run of their own: " + "; ".join(
                      f"{k} {v['date']}, `{v['command']}`" for k, v in apart.items()) + ")") + ".", ""]
        lines += side_by_side(prefill, infos, "prompt_tokens", "prefill_tok_per_s", 0)
    lines.append("")

    def f32(v: dict, key: str, spec: str) -> str:
        c = v.get("logits_check_float32")
        return "-" if c is None else format(c[key], spec)

    def own(v: dict, who: str) -> str:
        c = v.get("stored_dtype_vs_float32")
        return "-" if c is None else f"{c[who]['max_abs_diff']:.3g}"

    def where(v: dict) -> str:  # rows without the field: float32 on the GPU (TF32 matmuls)
        if v.get("logits_check_float32") is None or v.get("logits_check_float32_device", "gpu") == "cpu":
            return ""
        return " on the GPU"

    clamped = [k for k, v in infos.items() if v.get("mamba_dt_clamp_aligned")]
    lines.append("Logits of rq's and mlx-lm's models on one 16-token prompt, max abs difference in the stored dtype / in "
                 "float32 on the CPU (where marked, on the GPU, whose float32 matmuls may round to TF32)"
                 + (f" (mlx-lm's Mamba dt clamped as rq's: {', '.join(clamped)})" if clamped else "") + ": "
                 + "; ".join(
                     f"{k} {v['logits_check']['max_abs_diff']:.3g} / {f32(v, 'max_abs_diff', '.3g')}{where(v)} "
                     f"(logit std {v['logits_check']['logit_std']:.2f}, top-1 agreement "
                     f"{v['logits_check']['top1_agree']:.0%} / {f32(v, 'top1_agree', '.0%')}; stored dtype from "
                     f"float32: rq {own(v, 'rq')}, mlx-lm {own(v, 'mlx_lm')})"
                     for k, v in infos.items()) + ". The models share one copy of the weights: " + "; ".join(
                     f"{k} {v['shared_weights']['same_objects']}/{v['shared_weights']['arrays']} arrays the same "
                     f"objects, {v['shared_weights']['added_bytes'] / 2**20:.0f} MiB added by the second model"
                     for k, v in infos.items()) + ".")
    by_chunk: dict = {}
    for k, v in infos.items():
        by_chunk.setdefault(v.get("chunk"), []).append(k)
    method = "" if len(by_chunk) < 2 else " Decode rows " + "; ".join(  # rows of both methods: which is which
        (f"in turns of {c} tokens, the three runners alternating: " if c else
         "in whole cells of --tokens tokens, one runner after another: ") + ", ".join(ks)
        for c, ks in by_chunk.items()) + "."
    runs = {k: v["run"] for k, v in infos.items() if v.get("run")}
    if len({r["command"] for r in runs.values()}) > 1:  # rows merged from several runs: each model's own
        lines.append("")
        lines.append("Rows from several runs, each model's in one process: " + "; ".join(
            f"{k} {r['date']}" for k, r in runs.items()) + " (each model's command is in the results file)." + method)
    elif method:
        lines += ["", method.strip()]
    return "\n".join(lines)


def parse_contexts(text: str) -> list[int]:
    out = []
    for p in text.split(","):
        p = p.strip().lower()
        if p:
            out.append(int(p[:-1]) * 1024 if p.endswith("k") else int(p))
    return out


def main() -> None:
    import _readme

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", action="append", choices=list(FAMILIES),
                    help="model family (repeatable; default all three)")
    ap.add_argument("--config", action="append", help="a config JSON instead of a family's real config (repeatable)")
    ap.add_argument("--recipe", help="recipe (default: the family's shipped recipe)")
    ap.add_argument("--layers", type=int, help="decoder layers (default: the config's)")
    ap.add_argument("--contexts", type=parse_contexts, default=parse_contexts("2K,32K,128K"))
    ap.add_argument("--prefill", type=parse_contexts, default=[],
                    help="prompt lengths to time each runner's prefill at (e.g. 8K,32K; default none)")
    ap.add_argument("--prefill-repeats", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--chunk", type=int, default=16, help="tokens a runner decodes in each turn (default 16)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dir", default="/tmp/rq-synth", help="where the synthetic checkpoints are written (reused)")
    ap.add_argument("--keep", action="store_true", help="keep checkpoints written by this run")
    ap.add_argument("--out", help="results file (default benchmarks/results/decode_vs_mlxlm.json)")
    a = ap.parse_args()
    if a.tokens < 2 or a.chunk < 2 or a.repeats < 1 or a.prefill_repeats < 1 or any(n < 2 for n in a.prefill):
        ap.error("--tokens and --chunk must be at least 2, --repeats and --prefill-repeats at least 1, --prefill "
                 "lengths at least 2")
    jobs = [(synth.read_config(c), Path(c).stem) for c in a.config or []]
    if not jobs or a.family:
        jobs += [(synth.read_config(FAMILIES[f]), FAMILIES[f]) for f in (a.family or list(FAMILIES))]
    out = Path(a.out) if a.out else _readme.RESULTS / f"{RESULTS}.json"
    old = json.loads(out.read_text()) if out.is_file() else {}
    meta = _readme.meta()
    infos = {k: v for k, v in old.get("models", {}).items()}
    rows = [r for r in old.get("rows", []) if r["config"] not in {lab for _, lab in jobs}]
    # prefill rows name their run: a run without --prefill keeps its families' earlier prefill rows
    prefill = [{**r, "run": r.get("run") or infos.get(r["config"], {}).get("run"),
                "layers": r.get("layers") or infos.get(r["config"], {}).get("layers")} for r in old.get("prefill", [])
               if not a.prefill or r["config"] not in {lab for _, lab in jobs}]
    for cfg, label in jobs:
        def partial(info, part, pre_part, label=label):
            infos[label] = {**info, "run": meta, "partial": True}
            cur = [r for r in rows if r["config"] != label] + part
            pre = [r for r in prefill if r["config"] != label or not pre_part] + [{**r, "run": meta} for r in pre_part]
            _readme.save(RESULTS, {"models": infos, "rows": cur, "prefill": pre}, table(cur, infos, pre), path=out)

        res = run_family(cfg, Path(a.dir), a, label, on_partial=partial)
        infos[label] = {**res["info"], "run": meta}
        rows = [r for r in rows if r["config"] != label] + res["rows"]
        if res["prefill"]:
            prefill = [r for r in prefill if r["config"] != label] + [{**r, "run": meta} for r in res["prefill"]]
        infos = {k: infos[k] for k in infos if any(r["config"] == k for r in rows)}
        body = table(rows, infos, prefill)
        # after each family: partial runs count
        _readme.save(RESULTS, {"models": infos, "rows": rows, "prefill": prefill}, body, path=out)
    print(body)


if __name__ == "__main__":
    main()
