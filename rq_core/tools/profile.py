"""Where a decode step's time goes, and whether compressing the KV cache pays.

The verdict compares two measured decode steps at each context, the compressed cache's and fp16's: "go" where the
compressed step is not slower than fp16's (within a tolerance, STEP_TOLERANCE) or where fp16 K/V does not fit the
memory budget (compression is forced); KV attention's share of the step (the paper's rule of thumb: compression can
pay only above ~20%) is reported beside it as `share_verdict`.
`profile_model` fills every layer's cache with N tokens, then

1. times whole decode steps (one evaluation each: what `rq run` does per token), and fp16's step on caches of the
   same context in the same rounds;
2. records one step's calls to the components (full-attention `cache.attend`, sliding-window
   attention, routed experts `SwitchGLU` including any pager I/O, Mamba mixers) with their inputs,
   and re-runs each kind for all layers in one evaluation: its time without per-call syncs;
3. for compressed caches, times the attention pipeline's stages one by one (query rotation,
   A `fused_qk_dot`, B `softmax`, C `fused_value_accum`, D `rotate_inverse`) on the same caches.

Every timing: warm-up runs, then the median of repeats, each ended by `mx.eval` + `mx.synchronize`;
the measurements of one context are taken in turns (one of each per round), so a busy machine slows
them alike. `kernels_to_attention` = (stages + appending the new token) / the `attend` time: ~1 when
the breakdown accounts for the attention it attributes.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional

import mlx.core as mx
import mlx.nn as nn

from rq_core.attention.dispatch import attention_paths
from rq_core.errors import RQError
from rq_core.models.base import layers_as_written

STAGES = ("rotation", "A_fused_qk_dot", "B_softmax", "C_fused_value_accum", "D_rotate_inverse")
DEFAULT_THRESHOLD = 0.20  # the paper's break-even share of decode time for KV attention
# the compressed step counts as not slower than fp16's up to this fraction slower: the spread of repeated step
# timings on a shared machine
STEP_TOLERANCE = 0.05


# ------------------------------------------------------------------------------------------- timing
def sync(*arrays: Any) -> None:
    """Finish all pending work (evaluate, then wait for the device stream)."""
    if arrays:
        mx.eval(*arrays)
    mx.synchronize()


@dataclass
class Timing:
    """Seconds per call: median of the repeats, plus the spread."""

    median: float
    p10: float
    p90: float
    repeats: int
    samples: list[float] = field(default_factory=list, repr=False)

    @property
    def ms(self) -> float:
        return self.median * 1e3

    def as_dict(self) -> dict[str, float]:
        return {"median_ms": self.median * 1e3, "p10_ms": self.p10 * 1e3, "p90_ms": self.p90 * 1e3,
                "repeats": self.repeats}


def _quantile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    i = q * (len(s) - 1)
    lo, hi = int(i), min(int(i) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (i - lo)


def time_fn(fn: Callable[[], Any], *, warmup: int = 2, repeats: int = 7,
            after: Optional[Callable[[], None]] = None) -> Timing:
    """Time `fn()` (which must evaluate what it computes); `after()` runs untimed after each call."""
    if repeats < 1:
        raise RQError("repeats must be at least 1")
    for _ in range(warmup):
        sync(*_arrays(fn()))
        if after:
            after()
    samples = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        sync(*_arrays(fn()))
        samples.append(time.perf_counter() - t0)
        if after:
            after()
    return Timing(statistics.median(samples), _quantile(samples, 0.1), _quantile(samples, 0.9), repeats, samples)


def _arrays(out: Any) -> list:
    """The mx.arrays in a (nested) result, to evaluate them."""
    if isinstance(out, mx.array):
        return [out]
    if isinstance(out, (list, tuple)):
        return [a for o in out for a in _arrays(o)]
    if isinstance(out, dict):
        return [a for o in out.values() for a in _arrays(o)]
    return []


def backend() -> str:
    """'cuda', 'metal' or 'cpu': where the default device runs."""
    if mx.default_device() == mx.cpu:
        return "cpu"
    if mx.metal.is_available():
        return "metal"
    return "cuda"


# ------------------------------------------------------------------------------- recording components
KINDS = ("kv_attention", "sliding_attention", "experts", "ssm")


@dataclass
class Call:
    kind: str
    obj: Any
    method: str
    args: tuple
    kwargs: dict

    def replay(self) -> Any:
        return getattr(self.obj, self.method)(*self.args, **self.kwargs)


class Recorder:
    """Swap components' classes for recording subclasses (no edits to model code), restore on exit.

    Caches are recorded at `attend`, modules at `__call__`: Python looks special methods up on the
    type, so the instance's `__class__` is swapped rather than its attribute.
    """

    def __init__(self, targets: list[tuple[str, Any, str]]) -> None:
        self.targets = targets
        self.calls: list[Call] = []
        self.active = False
        self._orig: list[tuple[Any, type]] = []
        self._subclasses: dict[tuple[type, str, str], type] = {}

    def _subclass(self, cls: type, kind: str, method: str) -> type:
        key = (cls, kind, method)
        if key not in self._subclasses:
            rec = self
            base_fn = getattr(cls, method)

            def wrapped(obj, *args, **kwargs):
                out = base_fn(obj, *args, **kwargs)
                if rec.active:
                    rec.calls.append(Call(kind, obj, method, args, kwargs))
                return out

            self._subclasses[key] = type(f"Recorded{cls.__name__}", (cls,), {method: wrapped})
        return self._subclasses[key]

    def __enter__(self) -> "Recorder":
        for kind, obj, method in self.targets:
            self._orig.append((obj, obj.__class__))
            obj.__class__ = self._subclass(obj.__class__, kind, method)
        self.active = True
        return self

    def __exit__(self, *exc: Any) -> None:
        self.active = False
        for obj, cls in reversed(self._orig):
            obj.__class__ = cls
        self._orig.clear()

    def inputs(self) -> list:
        return [a for c in self.calls for a in _arrays(list(c.args) + list(c.kwargs.values()))]


def _is_sliding(cache: Any) -> bool:
    return "sliding" in type(cache).__name__.lower() or "rotating" in type(cache).__name__.lower()


def find_components(model: nn.Module, caches: list) -> list[tuple[str, Any, str]]:
    """(kind, object, method) for every timed component of one decode step."""
    from rq_core.models.base import SwitchGLU

    targets: list[tuple[str, Any, str]] = []
    for c in caches:
        if hasattr(c, "attend"):
            targets.append(("sliding_attention" if _is_sliding(c) else "kv_attention", c, "attend"))
    seen_ssm: list[str] = []
    for name, m in sorted(model.named_modules(), key=lambda nm: nm[0].count(".")):
        if isinstance(m, SwitchGLU):
            targets.append(("experts", m, "__call__"))
        elif "mamba" in type(m).__name__.lower() and not any(name.startswith(p + ".") for p in seen_ssm):
            seen_ssm.append(name)  # the outermost Mamba module (the mixer), not its parts
            targets.append(("ssm", m, "mix"))  # states in, states out: a replay leaves the cache as it is
    return targets


def _four_kernel_replay(calls: list) -> list:
    """The recorded attention calls again, through the four-kernel pipeline (RQ_ATTN=four) instead of attn_fused."""
    from rq_core.kernels import config as env

    with env.override(attention="four"):
        return [c.replay() for c in calls]


def _trim(caches: Iterable, n: int = 1) -> None:
    for c in caches:
        if hasattr(c, "trim"):
            c.trim(n)


# ------------------------------------------------------------------------------------ filling a cache
def _synthetic_kv(shape: tuple, dtype: Any, key: mx.array, outliers: bool) -> mx.array:
    """Random K or V [B, H, T, d]; keys get a few channels 10-30× larger, as real keys have."""
    x = mx.random.normal(shape, key=key)
    if outliers:
        d = shape[-1]
        boost = mx.ones((d,)).at[mx.array([1, d // 3, d // 2 + 1])].multiply(mx.array([10.0, 20.0, 30.0]))
        x = x * boost
    return x.astype(dtype)


def fill_caches(model: nn.Module, caches: list, n_tokens: int, *, fill: str = "synthetic",
                vocab_size: Optional[int] = None, seed: int = 0, chunk: int = 512) -> None:
    """Put `n_tokens` tokens of context into `caches`, then end the prefill (compressing caches compress).

    `prefill`: a real prefill of random token ids through the model, in chunks.
    `synthetic`: one real token through the model (it shows each cache the shapes and dtype of its
    K/V and sets up state caches), then random K/V for the other n-1 tokens appended to each
    attention cache directly — fast at long context, and attention cost does not depend on values.
    """
    if n_tokens < 1:
        raise RQError(f"context must be at least 1 token (got {n_tokens})")
    key = mx.random.key(seed)
    if fill == "prefill":
        if vocab_size is None:
            raise RQError("a prefill fill needs the vocabulary size")
        ids = mx.random.randint(0, vocab_size, (1, n_tokens), key=key)
        for s in range(0, n_tokens, chunk):
            sync(model(ids[:, s : s + chunk], cache=caches))
    elif fill == "synthetic":
        targets = [t for t in find_components(model, caches) if t[0].endswith("attention")]
        with Recorder(targets) as rec:
            sync(model(mx.array([[1]], mx.int32), cache=caches))
        first = {id(c.obj): c for c in rec.calls}
        n = n_tokens - 1
        for i, (_, cache, _) in enumerate(targets):
            call = first.get(id(cache))
            if call is None or n == 0:
                continue
            q, k, v = call.args[:3]
            B, Hkv, _, d = k.shape
            kk, kv_ = mx.random.split(mx.random.key(seed * 1000 + i))
            window = getattr(cache, "window", None)
            m = min(n, window) if window else n  # a sliding cache keeps only its window
            if getattr(cache, "prefill_fp16", None) is not None:  # the fill stays fp16 until end_prefill compresses it
                cache.prefill_fp16 = max(cache.prefill_fp16, n_tokens)
            for s in range(0, m, 8192):  # appended in pieces to bound the temporary fp16 K/V
                L = min(8192, m - s)
                kc = _synthetic_kv((B, Hkv, L, d), k.dtype, mx.random.split(kk, s // 8192 + 1)[-1], True)
                vc = _synthetic_kv((B, Hkv, L, v.shape[-1]), v.dtype, mx.random.split(kv_, s // 8192 + 1)[-1], False)
                # One query over all new keys (cheap); a sliding cache builds its own window mask,
                # so it gets queries as long as the keys (its window bounds that cost).
                Lq, mask = (L, "causal") if window else (1, None)
                qc = mx.zeros((B, q.shape[1], Lq, d), q.dtype)
                sync(cache.attend(qc, kc, vc, scale=call.kwargs.get("scale", d ** -0.5), mask=mask))
            if m < n and hasattr(cache, "offset"):
                cache.offset += n - m  # positions of the tokens that slid out of the window
    else:
        raise RQError(f"unknown fill {fill!r} (choose from: synthetic, prefill)")
    for c in caches:
        if hasattr(c, "end_prefill"):
            c.end_prefill()
    sync(*[a for c in caches for a in c.state])


# ------------------------------------------------------------------------------- attention stages
def attention_stages(cache: Any, queries: mx.array, scale: float) -> Optional[dict[str, Any]]:
    """The compressed cache's decode attention split into its five stages, or None for an uncompressed cache.

    Returns {"stages": {name: fn}, "strategy": str, "path": "kernels" | "reference"}; each fn runs one
    stage on the (already evaluated) output of the stage before it. On a GPU these are the kernels of
    `rq_core.kernels.launch`; on CPU the reference math (`rq_core.attention.reference`) done stage by stage.
    On a GPU shape the four-kernel pipeline does not cover (e.g. head_dim 512), "stages" is None and "unstaged" says
    why; the path decode took is the step's attention_paths.
    """
    if not hasattr(cache, "k_codes") or cache.k_codes is None:
        return None
    if backend() != "cpu":
        from rq_core.kernels import launch as kernels

        if kernels.available():
            return _kernel_stages(cache, queries, scale)
    return _reference_stages(cache, queries, scale)


def _kernel_stages(cache: Any, q: mx.array, scale: float) -> dict[str, Any]:
    """The GPU pipeline stage by stage: `rq_core.kernels.launch` rotate_queries, qk_dot (A), softmax (B),
    value_accum (C, with the strategy it picks for this context) and rotate_inverse (D)."""
    from rq_core.kernels import launch as K

    T, bits, Hkv = cache.packed_len, cache.v_book.field_bits, cache.k_codes.shape[1]
    levels = cache.v_book.table
    kbits, klevels = cache.k_book.field_bits, cache.k_book.table  # keys at their own width and codebook, or the values'
    flags, mats = K.rotation_args(cache.rotation)  # the kernels' in-kernel rotation (WHT/SO(4)/dense)
    fwd = lambda: K.rotate_queries(q, mats, Hkv, rot=flags)  # noqa: E731
    inv = lambda o: K.rotate_inverse(o, mats, Hkv, rot=flags)  # noqa: E731
    strategy = "word" if T < K.C_SWITCH else "dim"
    st: dict[str, Any] = {}

    def rotation() -> mx.array:
        st["q_rot"] = fwd()
        return st["q_rot"]

    def qk_dot() -> mx.array:
        st["scores"] = K.qk_dot(st["q_rot"], cache.k_codes, cache.k_norms, klevels, bits=kbits, scale=scale,
                                valid_len=T)
        return st["scores"]

    def softmax() -> mx.array:
        st["p"] = K.softmax(st["scores"])
        return st["p"]

    def value_accum(strategy: str = strategy) -> mx.array:
        st["o_rot"] = K.value_accum(st["p"], cache.v_codes, cache.v_norms, levels, bits=bits, strategy=strategy)
        return st["o_rot"]

    def rotate_inverse() -> mx.array:
        return inv(st["o_rot"])

    fns = [rotation, qk_dot, softmax, value_accum, rotate_inverse]
    try:
        for f in fns:
            sync(f())
    except K.KernelUnsupported as e:  # e.g. head_dim 512: only the fused kernel covers it
        return {"stages": None, "strategy": None, "path": "kernels", "unstaged": str(e)}
    other = "dim" if strategy == "word" else "word"
    alt = {}
    try:  # the strategy not chosen, for comparison (the switch point is a measured choice)
        sync(value_accum(other))
        alt[other] = lambda: value_accum(other)
    except K.KernelUnsupported:
        pass
    return {"stages": dict(zip(STAGES, fns)), "strategy": strategy, "path": "kernels", "alternatives": alt,
            "switch_tokens": K.C_SWITCH}


def _reference_stages(cache: Any, q: mx.array, scale: float, chunk: Optional[int] = None) -> dict[str, Any]:
    """The CPU reference path stage by stage: like `attention.packed_attention` but with the scores
    written out whole ([.., T] floats, what kernels A/B/C exchange) instead of an online softmax."""
    from rq_core.attention import reference as attention

    chunk = chunk or attention.CHUNK
    T, d, bits = cache.packed_len, q.shape[-1], cache.v_book.field_bits
    B, Hq = q.shape[:2]
    Hkv = cache.k_codes.shape[1]
    G = Hq // Hkv
    inv = 1.0 / d ** 0.5
    levels = cache.v_book.table.astype(mx.float32)
    kbits, klevels = cache.k_book.field_bits, cache.k_book.table.astype(mx.float32)
    st: dict[str, Any] = {}

    def rotation() -> mx.array:
        st["q_rot"] = cache.rotation.forward_queries(q).reshape(B, Hkv, G, -1, d)
        return st["q_rot"]

    def qk_dot() -> mx.array:
        parts = []
        for k0 in range(0, T, chunk):
            k1 = min(T, k0 + chunk)
            keys = attention.decode(cache.k_codes[:, :, k0:k1], klevels, kbits, d)
            ks = cache.k_norms[:, :, k0:k1].astype(mx.float32) * (inv * scale)
            parts.append((st["q_rot"] @ keys[:, :, None].swapaxes(-1, -2)) * ks[:, :, None, None, :])
        st["scores"] = mx.concatenate(parts, axis=-1)
        return st["scores"]

    def softmax() -> mx.array:
        st["p"] = mx.softmax(st["scores"], axis=-1)
        return st["p"]

    def value_accum() -> mx.array:
        acc = None
        for k0 in range(0, T, chunk):
            k1 = min(T, k0 + chunk)
            vals = attention.decode(cache.v_codes[:, :, k0:k1], levels, bits, d)
            vs = cache.v_norms[:, :, k0:k1].astype(mx.float32) * inv
            part = (st["p"][..., k0:k1] * vs[:, :, None, None, :]) @ vals[:, :, None]
            acc = part if acc is None else acc + part
        st["o_rot"] = acc.reshape(B, Hq, -1, d)
        return st["o_rot"]

    def rotate_inverse() -> mx.array:
        return cache.rotation.inverse_queries(st["o_rot"])

    fns = [rotation, qk_dot, softmax, value_accum, rotate_inverse]
    for f in fns:  # run once so every stage has its input ready and evaluated
        sync(f())
    return {"stages": dict(zip(STAGES, fns)), "strategy": "chunked", "path": "reference"}


# ------------------------------------------------------------------------------------------ profiling
def verdict(share: float, threshold: float) -> str:
    """The share rule (`share_verdict`): 'go' when KV attention's share of a decode step is above the threshold."""
    return "go" if share > threshold else "no-go"


def step_verdict(step_ms: float, fp16_step_ms: Optional[float], *, tolerance: float = STEP_TOLERANCE,
                 fp16_fits: bool = True, compressed: bool = True) -> tuple[str, str]:
    """(verdict, reason) from the two measured steps: 'go' where the compressed step is at most `tolerance` slower
    than fp16's, or where fp16 K/V does not fit the memory budget (no fp16 step to compare: compression is forced)."""
    if not compressed:
        return "no-go", "the profiled cache is fp16: nothing compressed to compare"
    if not fp16_fits:
        return "go", "fp16 K/V does not fit the memory budget: compression is forced"
    if fp16_step_ms is None or fp16_step_ms <= 0:
        raise RQError("no fp16 step to compare with")
    ratio = step_ms / fp16_step_ms
    if ratio <= 1 + tolerance:
        return "go", f"the compressed step takes {ratio:.2f}x fp16's: not slower (tolerance {tolerance:.0%})"
    return "no-go", f"the compressed step takes {ratio:.2f}x fp16's: slower (tolerance {tolerance:.0%})"


def time_round_robin(measures: dict[str, tuple[Callable[[], Any], Optional[Callable[[], None]]]], *,
                     warmup: int = 2, repeats: int = 7) -> dict[str, Timing]:
    """Time several (fn, after) pairs in turns, one call of each per round, so that a busy machine
    slows them alike; the result per name is the median over rounds."""
    if repeats < 1:
        raise RQError("repeats must be at least 1")
    samples: dict[str, list[float]] = {k: [] for k in measures}
    for r in range(warmup + repeats):
        for name, (fn, after) in measures.items():
            sync()
            t0 = time.perf_counter()
            sync(*_arrays(fn()))
            dt = time.perf_counter() - t0
            if after:
                after()
            if r >= warmup:
                samples[name].append(dt)
    return {k: Timing(statistics.median(v), _quantile(v, 0.1), _quantile(v, 0.9), repeats, v)
            for k, v in samples.items()}


def profile_context(model: nn.Module, caches: list, n_tokens: int, *, fill: str = "synthetic",
                    vocab_size: Optional[int] = None, warmup: int = 2, repeats: int = 7,
                    threshold: float = DEFAULT_THRESHOLD, layer_scale: float = 1.0,
                    seed: int = 0, fp16_caches: Optional[list] = None, fp16_fits: bool = True,
                    tolerance: float = STEP_TOLERANCE) -> dict[str, Any]:
    """Profile one decode step at `n_tokens` of context (caches fresh from `model.make_cache`).

    `layer_scale` multiplies every per-layer component (for a model built with fewer layers than the
    real one: all layers are alike, so their times scale; embedding and lm_head do not).
    `fp16_caches` (fresh fp16 caches; None where fp16 is profiled or does not fit, `fp16_fits` False): filled to the
    same context, their step is timed in the same rounds for the verdict (step_verdict, on the measured steps).
    Times are milliseconds per decode step.
    """
    fill_caches(model, caches, n_tokens, fill=fill, vocab_size=vocab_size, seed=seed)
    if fp16_caches is not None:
        fill_caches(model, fp16_caches, n_tokens, fill=fill, vocab_size=vocab_size, seed=seed)
    tok = mx.array([[7]], mx.int32)

    def step() -> mx.array:
        return model(tok, cache=caches)

    def undo() -> None:
        _trim(caches)

    # Record one step's component calls and their inputs, then put the caches back at n_tokens.
    targets = find_components(model, caches)
    if layer_scale != 1:  # whole decoder layers too: what is per-layer in "rest" must scale as well
        targets += [("layer", layer, "__call__") for layer in model.layers]
    with layers_as_written(model), Recorder(targets) as rec:  # traced graphs would hide the calls inside them
        out = step()
        sync(out, *rec.inputs())
    undo()
    paths = attention_paths(caches)  # the step's own: the timed replays below include the four-kernel pipeline's

    def as_written(fn: Callable[[], Any]) -> Callable[[], Any]:
        def run() -> Any:
            with layers_as_written(model):
                return fn()
        return run

    # The step as decode runs it (traced graphs: the verdict's) and op by op, as the parts below are timed (the
    # attribution's: parts timed alone are op by op, so a traced whole would leave them more than all of it)
    measures: dict[str, tuple[Callable[[], Any], Optional[Callable[[], None]]]] = {
        "step": (step, undo), "step_as_written": (as_written(step), undo)}
    if fp16_caches is not None:
        measures["fp16_step"] = (lambda: model(tok, cache=fp16_caches), lambda: _trim(fp16_caches))
    counts: dict[str, int] = {}
    for kind in KINDS:
        calls = [c for c in rec.calls if c.kind == kind]
        counts[kind] = len(calls)
        if calls:
            objs = [c.obj for c in calls]
            after = (lambda objs=objs: _trim(objs)) if kind.endswith("attention") else None
            measures[kind] = (lambda calls=calls: [c.replay() for c in calls], after)

    # The compressed pipeline's stages, on the same caches and the recorded queries.
    kv_calls = [c for c in rec.calls if c.kind == "kv_attention"]
    staged = [attention_stages(c.obj, c.args[0], c.kwargs.get("scale", c.args[0].shape[-1] ** -0.5))
              for c in kv_calls]
    have_stages = bool(kv_calls) and all(x is not None and x["stages"] is not None for x in staged)
    unstaged = next((x["unstaged"] for x in staged if x is not None and x.get("unstaged")), None)
    if have_stages:
        for name in STAGES:
            fns = [x["stages"][name] for x in staged]
            measures[name] = (lambda fns=fns: [f() for f in fns], None)
        for alt in staged[0].get("alternatives", {}):
            fns = [x["alternatives"][alt] for x in staged]
            measures[f"C_{alt}"] = (lambda fns=fns: [f() for f in fns], None)
        if all(hasattr(c.obj, "compress") for c in kv_calls):
            # Appending the new token: quantize + pack its K and V (inside `attend`, outside the stages).
            # compress_kv: one kv_append launch for K and V on a GPU (RQ_APPEND=ops: quantize_kv's ops)
            measures["append"] = (lambda: [c.obj.compress_kv(c.args[1], c.args[2]) if hasattr(c.obj, "compress_kv")
                                           else (c.obj.compress(c.args[1]), c.obj.compress(c.args[2]))
                                           for c in kv_calls], None)
        if staged[0]["path"] == "kernels":
            # The GPU default may be a fused single-pass kernel; the stages add up to the four-kernel path.
            objs = [c.obj for c in kv_calls]
            measures["kv_attention_four"] = (lambda: _four_kernel_replay(kv_calls), lambda objs=objs: _trim(objs))

    layer_calls = [c for c in rec.calls if c.kind == "layer"]
    if layer_calls:
        measures["layers"] = (as_written(lambda: [c.replay() for c in layer_calls]), undo)

    t = time_round_robin(measures, warmup=warmup, repeats=repeats)

    # Per-layer parts scale with the layer count; the rest is what is left of the whole step (op by op).
    full_ms = t["step"].ms
    written_ms = t["step_as_written"].ms
    parts = {k: (t[k].ms if k in t else 0.0) for k in KINDS}
    rest_raw = written_ms - sum(parts.values())
    scaled = {k: v * layer_scale for k, v in parts.items()}
    rest = max(rest_raw, 0.0)
    if "layers" in t:  # rest = outside the layers (embedding, head) + layer_scale × the layers' own rest
        rest = max(written_ms - t["layers"].ms, 0.0) + layer_scale * max(t["layers"].ms - sum(parts.values()), 0.0)
    step_ms = sum(scaled.values()) + rest
    attribution = {**scaled, "rest": rest}
    share = attribution["kv_attention"] / step_ms if step_ms > 0 else 0.0
    fp16 = t.get("fp16_step")
    from rq_core.cache.kv_cache import IsoQuantCache

    compressed = any(isinstance(c, IsoQuantCache) for c in caches)
    go, why = step_verdict(full_ms, fp16.ms if fp16 else None, tolerance=tolerance, fp16_fits=fp16_fits,
                           compressed=compressed)
    result: dict[str, Any] = {
        "context": n_tokens,
        "fill": fill,
        "decode_step_ms": step_ms,
        "decode_tok_per_s": 1e3 / step_ms if step_ms > 0 else None,
        "measured_step_ms": full_ms,
        "measured_step_p10_ms": t["step"].p10 * 1e3,
        "measured_step_p90_ms": t["step"].p90 * 1e3,
        "measured_step_as_written_ms": written_ms,  # op by op, no traced graphs: what the attribution divides
        "measured_parts_ms": parts,  # per component, before layer_scale
        "measured_layers_ms": t["layers"].ms if "layers" in t else None,  # all decoder layers, replayed
        "rest_raw_ms": rest_raw,  # negative when the parts timed alone exceed the whole step (noise)
        "attribution": attribution,
        "attribution_share": {k: (v / step_ms if step_ms > 0 else 0.0) for k, v in attribution.items()},
        "layers": counts,
        "kernels": None,
        "strategy": staged[0]["strategy"] if have_stages else None,
        "attention_path": (next(x["path"] for x in staged if x is not None) if have_stages or unstaged
                           else ("sdpa" if kv_calls else None)),
        "stages_unavailable": unstaged,  # why no stage breakdown (the four-kernel pipeline lacks the shape), or None
        # the path each compressed layer's decode attention took (rq_core.attention.dispatch), e.g. {"fused": 48}
        "attention_paths": paths,
        "kv_attention_share": share,
        "threshold": threshold,
        # fp16's measured step at this context (None: fp16 profiled, or its K/V does not fit the budget)
        "fp16_step_ms": fp16.ms if fp16 else None,
        "fp16_step_p10_ms": fp16.p10 * 1e3 if fp16 else None,
        "fp16_step_p90_ms": fp16.p90 * 1e3 if fp16 else None,
        "step_vs_fp16": full_ms / fp16.ms if fp16 and fp16.ms > 0 else None,  # measured steps, compressed / fp16
        "fp16_fits": fp16_fits,
        "tolerance": tolerance,
        "share_verdict": verdict(share, threshold),
        "verdict": go,
        "verdict_reason": why,
    }
    if have_stages:
        kern = {k: t[k].ms * layer_scale for k in STAGES}
        total = sum(kern.values())
        append = t["append"].ms * layer_scale if "append" in t else 0.0
        result["kernels"] = kern
        result["kernels_total_ms"] = total
        result["append_ms"] = append if "append" in t else None
        result["kernels_per_layer_us"] = {k: t[k].ms * 1e3 / len(kv_calls) for k in STAGES}
        result["C_strategies_ms"] = {result["strategy"]: kern["C_fused_value_accum"],
                                     **{k[2:]: t[k].ms * layer_scale for k in t if k.startswith("C_") and
                                        k != "C_fused_value_accum"}}
        if "switch_tokens" in staged[0]:
            result["C_switch_tokens"] = staged[0]["switch_tokens"]
        kv = attribution["kv_attention"]
        if "kv_attention_four" in t:
            kv = t["kv_attention_four"].ms * layer_scale
            result["kv_attention_four_kernel_ms"] = kv
        # Stages + append account for `attend`; this ratio is ~1 when the breakdown is complete.
        result["kernels_to_attention"] = (total + append) / kv if kv > 0 else None
    return result


def profile_model(model: nn.Module, contexts: list[int], *, kv: Any = None, fill: str = "synthetic",
                  vocab_size: Optional[int] = None, warmup: int = 2, repeats: int = 7,
                  threshold: float = DEFAULT_THRESHOLD, layer_scale: float = 1.0,
                  on_context: Optional[Callable[[dict], None]] = None, tolerance: float = STEP_TOLERANCE,
                  fp16_fits: Optional[Callable[[int], bool]] = None) -> dict[str, Any]:
    """`profile_context` for each context length (fresh caches each, fp16's beside a compressed cache's), plus an
    overall verdict. fp16_fits(context): whether fp16 K/V of that context fits the memory budget (None: it does)."""
    from rq_core.cache.kv_cache import KVSettings

    kv = kv or KVSettings(mode="isoquant3")
    if not contexts:
        raise RQError("give at least one context length")
    if not 0 < threshold < 1:
        raise RQError(f"threshold must be a fraction between 0 and 1 (got {threshold})")
    if not 0 <= tolerance <= 1:
        raise RQError(f"tolerance must be a fraction between 0 and 1 (got {tolerance})")
    results = []
    for n in contexts:
        caches = model.make_cache(kv)
        fits = fp16_fits(n) if fp16_fits is not None else True
        fp16_caches = model.make_cache(KVSettings(mode="fp16")) if kv.mode != "fp16" and fits else None
        r = profile_context(model, caches, n, fill=fill, vocab_size=vocab_size, warmup=warmup, repeats=repeats,
                            threshold=threshold, layer_scale=layer_scale, fp16_caches=fp16_caches, fp16_fits=fits,
                            tolerance=tolerance)
        del caches, fp16_caches
        results.append(r)
        if on_context:
            on_context(r)
    be = backend()
    paths = sorted({r["attention_path"] for r in results if r["attention_path"]})
    go = [r["context"] for r in results if r["verdict"] == "go"]
    share_go = [r["context"] for r in results if r["share_verdict"] == "go"]
    return {
        "backend": be,
        # True when the reference path (MLX ops, as on CPU) was timed rather than GPU kernels
        "reference_path": be == "cpu" or "reference" in paths,
        "kv_mode": kv.mode,
        "rotation": getattr(kv, "rotation", None),
        "key_bits": getattr(kv, "key_bits", None) if kv.mode != "fp16" else None,
        "pair_points": list(kv.pairs) if kv.pairs else None,
        "fp16_window": getattr(kv, "fp16_window", 0) if kv.mode != "fp16" else None,
        "edge_layers": kv.edge_layers if kv.mode != "fp16" else None,
        "attention_path": paths[0] if len(paths) == 1 else (paths or None),
        "attention_paths": results[-1]["attention_paths"],  # at the last context
        "threshold": threshold,
        "tolerance": tolerance,
        "warmup": warmup,
        "repeats": repeats,
        "layer_scale": layer_scale,
        "results": results,
        "verdict": "go" if go else "no-go",
        "go_from_context": min(go) if go else None,
        "share_verdict": "go" if share_go else "no-go",  # the share rule alone (KV attention above the threshold)
        "share_go_from_context": min(share_go) if share_go else None,
    }
