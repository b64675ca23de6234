"""Token generation: chunked prefill, `end_prefill()` on every cache, then sampled decode with stats."""

from __future__ import annotations

import resource
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterable, Iterator, Optional

import mlx.core as mx
import mlx.nn as nn

from rq_core.errors import RQError
from rq_core.cache.kv_cache import KVSettings


@dataclass
class GenerationResult:
    tokens: list[int] = field(default_factory=list)  # generated ids (EOS excluded)
    prompt_tokens: int = 0
    generated_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    decode_steps: int = 0  # decode steps whose token was read (an EOS read counts; generated_tokens excludes it)
    prefill_tok_per_s: float = 0.0
    decode_tok_per_s: float = 0.0
    # the first decode step alone (on a GPU it carries the JIT compile of custom kernels: seconds, once a
    # process), and the decode rate without it
    first_step_s: float = 0.0
    steady_decode_tok_per_s: float = 0.0
    peak_memory_bytes: int = 0  # MLX's peak allocation (mx.get_peak_memory): the larger of the two phases'
    prefill_peak_memory_bytes: int = 0  # MLX's peak from the start to the first token (the prompt's pass)
    decode_peak_memory_bytes: int = 0  # MLX's peak from the first token on (what the decode steps hold)
    peak_rss_bytes: int = 0  # the process' peak resident set
    kv_bytes: int = 0  # bytes held by all caches at the end
    kv_bytes_fp16: int = 0  # what fp16 caches would hold for the same tokens
    # with an expert pager: its counters over the decode steps alone (the prompt's passes read most experts)
    pager_decode: Optional[dict] = None
    stop_reason: str = "length"  # "eos" | "length" | "context" | "stop" (on_token returned true)

    def as_dict(self) -> dict:
        return asdict(self)


def filter_logits(logits: mx.array, temp: float, top_p: float = 1.0, top_k: int = 0,
                  min_p: float = 0.0) -> mx.array:
    """Logits [B, V] divided by `temp` (> 0), with the tokens each filter drops set to -inf, in this order: top-k
    (the k most likely; 0 = off), top-p (the smallest set of the most likely whose mass reaches top_p among those
    left; 1 = off), min-p (tokens less likely than min_p times the most likely one; 0 = off). The most likely token
    always survives."""
    logits = logits.astype(mx.float32) / temp
    neg_inf = mx.array(-mx.inf, dtype=mx.float32)
    if 0 < top_k < logits.shape[-1]:
        drop_idx = mx.argpartition(-logits, kth=top_k - 1, axis=-1)[..., top_k:]
        logits = mx.put_along_axis(logits, drop_idx, neg_inf, axis=-1)
    if 0 < top_p < 1:
        probs = mx.softmax(logits, axis=-1)
        order = mx.argsort(-probs, axis=-1)
        sorted_p = mx.take_along_axis(probs, order, axis=-1)
        # Keep the smallest prefix whose mass reaches top_p (the top token always survives).
        drop_sorted = (mx.cumsum(sorted_p, axis=-1) - sorted_p) >= top_p
        drop = mx.put_along_axis(mx.zeros_like(drop_sorted), order, drop_sorted, axis=-1)
        logits = mx.where(drop, neg_inf, logits)
    if min_p > 0:
        probs = mx.softmax(logits, axis=-1)
        logits = mx.where(probs < min_p * probs.max(axis=-1, keepdims=True), neg_inf, logits)
    return logits


def sample(logits: mx.array, temp: float = 0.0, top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0,
           key: Optional[mx.array] = None) -> mx.array:
    """Next token ids [B] from logits [B, V]: greedy when temp == 0, else from the distribution filter_logits
    leaves (temperature, then top-k, top-p, min-p), drawn with `key` (default: the next of MLX's global keys)."""
    if temp <= 0:
        return mx.argmax(logits, axis=-1)
    return mx.random.categorical(filter_logits(logits, temp, top_p, top_k, min_p), axis=-1, key=key)


def cache_bytes(cache: Iterable) -> tuple[int, int]:
    """(bytes held, fp16-equivalent bytes) summed over caches that report them."""
    held = fp16 = 0
    for c in cache:
        held += int(getattr(c, "nbytes", 0) or 0)
        fp16 += int(getattr(c, "fp16_nbytes", 0) or 0)
    return held, fp16


def cache_arrays(cache: list) -> list[mx.array]:
    """The arrays the caches hold (each cache's `state`)."""
    return [a for c in cache for a in c.state]


def _peak_rss() -> int:
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(r if sys.platform == "darwin" else r * 1024)  # bytes on macOS, KiB on Linux


def _read_array(y: mx.array, logits: mx.array) -> mx.array:
    """[sampled id, 1 if every logit is finite]: what a step reads, in one transfer."""
    return mx.stack([y[0].astype(mx.int32), mx.isfinite(logits).all().astype(mx.int32)])


def _queue_step(model: nn.Module, cache: list, y: mx.array, temp: float, top_p: float, top_k: int = 0,
                min_p: float = 0.0, key: Optional[mx.array] = None,
                before_eval: Optional[Callable[[], None]] = None) -> tuple[mx.array, mx.array]:
    """Build the step after token `y` and queue it (mx.async_eval): (its sampled id [1], its read array).
    `before_eval`: called once the step is built, before it is queued (an expert pager's last layer settles there)."""
    logits = model(y.reshape(1, 1).astype(mx.int32), cache=cache)[:, -1, :]
    nxt = sample(logits, temp, top_p, top_k, min_p, key)
    read = _read_array(nxt, logits)
    if before_eval is not None:
        before_eval()
    mx.async_eval(read)
    return nxt, read


def decode_steps(model: nn.Module, cache: list, y: mx.array, read: mx.array, max_tokens: int, *, temp: float,
                 top_p: float, top_k: int = 0, min_p: float = 0.0, pipeline: bool = True,
                 pager: Any = None) -> Iterator[int]:
    """The id of `y` (its read array `read`, queued or evaluated), then the ids of the decode steps after it,
    `max_tokens` in all. With `pipeline`, step t+1 is built and queued before token t is read, so the device
    does not wait while the host builds a graph; without it, step t+1 is built after token t is read. With an
    expert `pager` (never pipelined) each step runs through `pager.decode_step`. RQError when a step's logits
    are not finite."""
    if pager is not None:
        pipeline = False
    for n in range(max_tokens):
        more = n + 1 < max_tokens
        queued = _queue_step(model, cache, y, temp, top_p, top_k, min_p) if pipeline and more else None
        tok, finite = read.tolist()  # the one host sync of a step
        if not finite:
            raise RQError(f"the model's logits are not finite (NaN or Inf) at generated token {n + 1}: its "
                          "weights are broken, or overflow in this dtype")
        yield tok
        if more and queued is not None:
            y, read = queued
        elif more and pager is not None:
            y, read = pager.decode_step(
                lambda key, y=y: _queue_step(model, cache, y, temp, top_p, top_k, min_p, key, pager.settle), cache,
                draws=temp > 0)
        elif more:
            y, read = _queue_step(model, cache, y, temp, top_p, top_k, min_p)


def prefill(model: nn.Module, prompt: list[int], cache: list, *, temp: float = 0.0, top_p: float = 1.0,
            top_k: int = 0, min_p: float = 0.0, chunk: int = 512) -> tuple[mx.array, mx.array]:
    """Run `prompt` into `cache` in chunks of `chunk` tokens, end every cache's prefill (compressed caches compress
    the prompt's K/V there) and sample the first token: (its id [1], its read array, evaluated), what
    `decode_steps` takes."""
    if not prompt:
        raise RQError("the prompt is empty (it encodes to zero tokens)")
    x = mx.array(prompt, dtype=mx.int32)[None]
    chunk = max(1, int(chunk))
    for i in range(0, len(prompt), chunk):
        final = i + chunk >= len(prompt)
        # the last chunk's logits at its last position alone: a chunk x vocabulary head (Gemma 4's 262,144 a token: 0.27
        # GB at 512 tokens in bfloat16) is neither computed nor held as the prompt ends
        out = model(x[:, i:i + chunk], cache=cache, last=final)
        if not final:
            # a chunk before the last is evaluated for its caches alone (one graph a chunk bounds memory), so its
            # output head (chunk x vocabulary logits) is never computed
            mx.eval(cache_arrays(cache))
        else:
            logits = out[:, -1, :]
            mx.eval(logits)
    for c in cache:
        c.end_prefill()
    y = sample(logits, temp, top_p, top_k, min_p)
    read = _read_array(y, logits)
    mx.eval(read)
    return y, read


def generate(model: nn.Module, prompt: list[int], *, max_tokens: int = 256, temp: float = 0.0,
             top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0, seed: Optional[int] = None,
             kv: Optional[KVSettings] = None,
             eos_token_ids: Iterable[int] = (), prefill_chunk: int = 512,
             context_length: Optional[int] = None,
             on_token: Optional[Callable[[int], None]] = None, cache: Optional[list] = None) -> GenerationResult:
    """Generate up to `max_tokens` tokens after `prompt`; `on_token(id)` is called as each is produced.

    The prompt runs through `prefill` in chunks of `prefill_chunk` tokens, then decoding proceeds one token at a
    time (`decode_steps`).
    RQError when the logits are not finite (broken weights), instead of whatever token NaN logits sample.
    """
    if context_length is not None and len(prompt) > context_length:
        raise RQError(f"the prompt is {len(prompt)} tokens, longer than the model's context of {context_length}")
    if context_length is not None:
        max_tokens = min(max_tokens, context_length - len(prompt))
    eos = set(int(e) for e in eos_token_ids)
    if seed is not None:
        mx.random.seed(seed)
    if cache is None:
        cache = model.make_cache(kv or KVSettings())
    mx.reset_peak_memory()
    res = GenerationResult(prompt_tokens=len(prompt))

    t0 = time.perf_counter()
    y, read = prefill(model, prompt, cache, temp=temp, top_p=top_p, top_k=top_k, min_p=min_p, chunk=prefill_chunk)
    res.prefill_s = time.perf_counter() - t0
    res.prefill_peak_memory_bytes = int(mx.get_peak_memory())
    mx.reset_peak_memory()

    # With an expert pager a step is not queued ahead (decode_steps): the next step's misses are written into the
    # slot banks in place, and a step still in flight would read them.
    pager = getattr(model, "expert_pager", None)
    pager_before = pager.report().as_dict() if pager is not None else None
    t1 = time.perf_counter()
    steps = 0  # decode steps whose token was read
    for steps, tok in enumerate(decode_steps(model, cache, y, read, max_tokens, temp=temp, top_p=top_p,
                                             top_k=top_k, min_p=min_p, pager=pager)):
        if steps == 1:
            res.first_step_s = time.perf_counter() - t1
        if tok in eos:
            res.stop_reason = "eos"
            break
        res.tokens.append(tok)
        if on_token is not None and on_token(tok):  # a true return stops here (a stop string, a closed client)
            res.stop_reason = "stop"
            break
    else:
        if res.tokens:
            res.stop_reason = "context" if context_length and len(prompt) + len(res.tokens) >= context_length \
                else "length"
    res.decode_s = time.perf_counter() - t1 if steps else 0.0
    res.decode_steps = steps

    res.generated_tokens = len(res.tokens)
    res.prefill_tok_per_s = len(prompt) / res.prefill_s if res.prefill_s > 0 else 0.0
    res.decode_tok_per_s = steps / res.decode_s if res.decode_s > 0 else 0.0
    rest = res.decode_s - res.first_step_s
    res.steady_decode_tok_per_s = (steps - 1) / rest if steps > 1 and rest > 0 else res.decode_tok_per_s
    res.decode_peak_memory_bytes = int(mx.get_peak_memory())
    res.peak_memory_bytes = max(res.prefill_peak_memory_bytes, res.decode_peak_memory_bytes)
    if pager is not None:
        res.pager_decode = pager.report().since(pager_before)
    res.peak_rss_bytes = _peak_rss()
    res.kv_bytes, res.kv_bytes_fp16 = cache_bytes(cache)
    return res
