"""`rq bench`: decode and prefill speed, peak memory and KV bytes of one checkpoint, per context and KV mode.

Every measurement runs in this one process. At each context the KV modes decode in turns of 16 tokens
(decode_in_turns: the order rotating, and reversed every other repetition), so that drift of the host's speed, which
bounds a GPU's step at short context and moves within minutes, and other jobs reach every mode alike.
A mode's cell: a fresh cache from the model's own `make_cache`, filled to the context with random K/V appended through
each cache's own `attend` (rq_core.tools.profile.fill_caches: compressed caches hold real codes, sliding windows their
window), then `tokens` greedy tokens through rq's decode loop (rq_core.generate.prefill of one token, then
decode_steps). Prefill speed is a real prefill of `prefill_tokens` random ids through the model (long prompts would
take minutes; decode speed at a context does not depend on how the context was made).
"""

from __future__ import annotations

import gc
import statistics
import time
from dataclasses import replace
from typing import Any, Callable, Iterator, Optional

import mlx.core as mx
import mlx.nn as nn

from rq_core.errors import RQError
from rq_core.cache.kv_cache import KVSettings

Progress = Callable[[str, int, int], None]


def spread(xs: list[float]) -> dict[str, float]:
    """{median, min, max} of measurements."""
    return {"median": float(statistics.median(xs)), "min": float(min(xs)), "max": float(max(xs))}


def check_contexts(contexts: list[int], tokens: int, limit: Optional[int]) -> None:
    """RQError (one line) when a context plus the decoded tokens does not fit the model's positions."""
    for n in contexts:
        if n < 1:
            raise RQError(f"context must be at least 1 token (got {n})")
        if limit is not None and n + tokens > limit:
            raise RQError(f"context {n} + {tokens} decoded tokens is beyond the model's max_position_embeddings "
                          f"({limit}); choose contexts up to {max(1, limit - tokens)}")


def _free() -> None:
    gc.collect()
    mx.clear_cache()


TURN = 16  # tokens a KV mode decodes in each turn


def start_decode(model: nn.Module, kv: KVSettings, context: int, tokens: int, *, seed: int = 0,
                 vocab_size: Optional[int] = None) -> tuple[Iterator[int], dict[str, Any]]:
    """A fresh cache filled to `context` tokens (synthetic K/V, rq_core.tools.profile.fill_caches), one real token
    through rq's prefill, and rq's decode loop of `tokens` greedy tokens (rq_core.generate.decode_steps): (the loop,
    what to report of the cache; callables are read once the loop is done)."""
    from rq_core.attention.dispatch import attention_paths
    from rq_core.generate import cache_bytes, decode_steps, prefill
    from rq_core.tools.profile import fill_caches

    cache = model.make_cache(kv)
    fill_caches(model, cache, context, fill="synthetic", seed=seed, vocab_size=vocab_size)
    kv_bytes, kv_fp16 = cache_bytes(cache)
    y, read = prefill(model, [1], cache)  # no EOS: every run decodes `tokens` tokens
    return decode_steps(model, cache, y, read, tokens, temp=0.0, top_p=1.0), {
        "kv_bytes": kv_bytes, "kv_bytes_fp16": kv_fp16, "kv_bytes_end": lambda: cache_bytes(cache)[0],
        "attention_paths": lambda: attention_paths(cache)}


def decode_in_turns(starts: dict[str, Callable[[], tuple]], order: list[str], tokens: int, chunk: int = TURN,
                    streams: tuple = ()) -> dict[str, dict]:
    """Every runner's `tokens` greedy tokens, `chunk` at a time in turns (order `order`; `starts[name]()` gives a
    runner's loop and what to report, as start_decode does), so that drift of the host's or the device's speed
    within the cell reaches every runner alike: a step bound by the host's work moves by tens of percent within
    minutes. Each turn starts with the device idle (nothing of another runner's in flight) and is timed from its
    first token to its last: tok/s = the turns' intervals over their seconds (a turn's first token, queued in the
    runner's previous turn, is not counted). All runners' caches are held at once; a runner's peak is MLX's peak in
    its own fill and turns less the bytes the other runners' caches held then (so it reads as if it ran alone), but
    the process holds them all: the cell needs the sum of the runners' caches in memory.
    `streams`: the runners' own streams, waited for with the default one at each turn's start."""
    gens, info, held, out = {}, {}, {}, {}

    def idle() -> None:
        mx.synchronize()
        for s in streams:
            mx.synchronize(s)

    for r in order:
        idle()
        before = mx.get_active_memory()
        mx.reset_peak_memory()
        t0 = time.perf_counter()
        gens[r], info[r] = starts[r]()
        idle()
        fill_s = time.perf_counter() - t0
        first = int(next(gens[r]))  # the prompt token's step: not timed, as in each runner's own tok/s
        idle()
        out[r] = {"fill_s": fill_s, "tokens": [first], "intervals": 0, "seconds": 0.0,
                  "peak_memory_bytes": int(mx.get_peak_memory()) - sum(held.values())}
        held[r] = mx.get_active_memory() - before
    for _ in range(0, tokens - 1, chunk):
        for r in order:
            n = min(chunk, tokens - len(out[r]["tokens"]))
            if n <= 0:
                continue
            idle()
            before = mx.get_active_memory()
            mx.reset_peak_memory()
            stamps = []
            for _ in range(n):
                out[r]["tokens"].append(int(next(gens[r])))
                stamps.append(time.perf_counter())
            idle()
            others = sum(v for k, v in held.items() if k != r)
            out[r]["peak_memory_bytes"] = max(out[r]["peak_memory_bytes"], int(mx.get_peak_memory()) - others)
            held[r] += mx.get_active_memory() - before
            out[r]["intervals"] += n - 1
            out[r]["seconds"] += stamps[-1] - stamps[0]
    for r in order:
        x = out[r]
        x["decode_tok_per_s"] = x["intervals"] / x["seconds"] if x["seconds"] > 0 else 0.0
        x["generated_tokens"] = len(x["tokens"])
        x.update({k: v() if callable(v) else v for k, v in info[r].items()})
    del gens, info
    _free()
    return out


def prefill_cell(model: nn.Module, kv: KVSettings, n_tokens: int, vocab_size: int, *, seed: int = 0) -> dict:
    """A real prefill of `n_tokens` random ids (one generated token)."""
    from rq_core.generate import generate

    ids = [int(x) for x in mx.random.randint(0, vocab_size, (n_tokens,), key=mx.random.key(seed)).tolist()]
    res = generate(model, ids, max_tokens=1, temp=0.0, kv=kv)
    out = {"prefill_tok_per_s": res.prefill_tok_per_s, "prefill_s": res.prefill_s,
           "peak_memory_bytes": res.peak_memory_bytes}
    del res
    _free()
    return out


def bench(model: nn.Module, config: dict, contexts: list[int], kvs: list[KVSettings], *, tokens: int = 128,
          repeats: int = 3, prefill_tokens: int = 512, warmup: bool = True, seed: int = 0,
          progress: Optional[Progress] = None) -> dict[str, Any]:
    """The report `rq bench --json` prints: `decode` rows per (context, kv), `prefill` rows per kv."""
    from rq_core.checkpoint import context_length, text_config

    if tokens < 3 or repeats < 1:  # a decode rate needs a turn of two tokens after the prompt's
        raise RQError(f"--tokens must be at least 3 and --repeats at least 1 (got {tokens} and {repeats})")
    limit = context_length(config)
    check_contexts(contexts, tokens, limit)
    vocab = int(text_config(config)["vocab_size"])
    prefill_tokens = min(prefill_tokens, limit) if limit else prefill_tokens
    names = [k.mode for k in kvs]
    if len(set(names)) != len(names):
        raise RQError(f"each KV mode once (got {', '.join(names)})")
    progress = progress or (lambda *a: None)
    total = repeats * (len(contexts) * len(kvs) + (len(kvs) if prefill_tokens > 0 else 0))
    done = 0
    def cell(c: int, n: int, order: list[KVSettings]) -> dict[str, dict]:
        return decode_in_turns({k.mode: (lambda k=k: start_decode(model, k, c, n, seed=seed, vocab_size=vocab))
                                for k in order}, [k.mode for k in order], n)

    if warmup:  # kernels compiled and caches of every shape seen once, untimed
        cell(min(contexts), min(tokens, 4), kvs)
        for kv in kvs:
            if prefill_tokens > 0:
                prefill_cell(model, kv, min(prefill_tokens, 64), vocab, seed=seed)
            progress("warm-up", kvs.index(kv) + 1, len(kvs))
    runs: dict[tuple[int, str], list[dict]] = {(c, k.mode): [] for c in contexts for k in kvs}
    pre: dict[str, list[dict]] = {k.mode: [] for k in kvs}
    for r in range(repeats):
        # who goes first rotates, and every other repetition the turns run backwards: each mode follows each other
        order = (kvs[r % len(kvs):] + kvs[:r % len(kvs)])[::-1 if r % 2 else 1]
        for c in contexts:
            for mode, x in cell(c, tokens, order).items():
                runs[(c, mode)].append(x)
                done += 1
                progress("measure", done, total)
        if prefill_tokens > 0:
            for kv in order:
                pre[kv.mode].append(prefill_cell(model, kv, prefill_tokens, vocab, seed=seed + r))
                done += 1
                progress("measure", done, total)
    decode = []
    for c in contexts:
        for kv in kvs:
            rs = runs[(c, kv.mode)]
            decode.append({
                "context": c, "kv": kv.mode,
                "decode_tok_per_s": spread([x["decode_tok_per_s"] for x in rs]),
                # the same figures: a turn's first token is never counted (kept for the field's readers)
                "steady_decode_tok_per_s": spread([x["decode_tok_per_s"] for x in rs]),
                "decode_tok_per_s_runs": [x["decode_tok_per_s"] for x in rs],
                "peak_memory_bytes": max(x["peak_memory_bytes"] for x in rs),
                "kv_bytes": rs[-1]["kv_bytes"], "kv_bytes_fp16": rs[-1]["kv_bytes_fp16"],
                "kv_bytes_end": rs[-1]["kv_bytes_end"],
                "fill_s": spread([x["fill_s"] for x in rs]),
                "generated_tokens": rs[-1]["generated_tokens"],
                # {path: compressed layers} of the last run's decode (rq_core.attention.dispatch)
                "attention_paths": rs[-1]["attention_paths"],
                # the same fill every repetition: greedy decoding gives the same tokens unless something is off
                "tokens_same_every_run": all(x["tokens"] == rs[0]["tokens"] for x in rs[1:]),
            })
    prefill = [{"kv": k.mode, "tokens": prefill_tokens,
                "prefill_tok_per_s": spread([x["prefill_tok_per_s"] for x in pre[k.mode]]),
                "peak_memory_bytes": max(x["peak_memory_bytes"] for x in pre[k.mode])}
               for k in kvs if pre[k.mode]]
    return {"contexts": contexts, "kv_modes": names, "tokens": tokens, "repeats": repeats,
            "prefill_tokens": prefill_tokens, "fill": "synthetic", "max_position_embeddings": limit,
            "kv_settings": {k.mode: {"fp16_window": k.fp16_window, "edge_layers": k.edge_layers,
                                     "bits": k.bits, "rotation": k.rotation} for k in kvs},
            "decode": decode, "prefill": prefill}


def kv_settings(modes: list[str], *, fp16_window: int, edge_layers: int) -> list[KVSettings]:
    """The caches `rq run` makes for each mode (fp16: the plain cache)."""
    from rq_core.cache.kv_cache import KV_MODES

    out = []
    for m in modes:
        if m not in KV_MODES:
            raise RQError(f"unknown KV mode {m!r} (choose from: {', '.join(KV_MODES)})")
        base = KVSettings(mode=m)
        out.append(base if m == "fp16" else replace(base, fp16_window=fp16_window, edge_layers=edge_layers))
    return out
