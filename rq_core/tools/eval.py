"""Quality measurements on a model: perplexity, needle retrieval, quality gates (`rq eval`).

Every measurement reads the KV cache the way decoding does: a window's first part is prefilled
(prompt tokens attend to each other in full precision, as `rq run` does), `end_prefill()` lets a
compressed cache compress it, and the rest of the window is fed in decode steps whose queries
attend to the compressed cache, their own keys/values compressed on append. Only tokens predicted
in those decode steps are scored, for every KV mode alike, so the compressed path is what is measured.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Sequence

import mlx.core as mx
import numpy as np

from rq_core.errors import RQError
from rq_core.cache.kv_cache import KVSettings
from rq_core.textio import read_utf8

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

ASSETS = Path(__file__).resolve().parents[1] / "assets"
HELDOUT_PATH = ASSETS / "heldout.txt"
GATES_PATH = ASSETS / "gates.toml"

# The needle: a secret number stated once in the haystack and asked for at the end. The training
# script mixes the same pieces into a share of its sequences (scripts/train_reference.py).
NEEDLE_PREFIX = "\nThe secret number is "
NEEDLE_SUFFIX = ".\n"
QUESTION = "\nWhat is the secret number? The secret number is "
N_DIGITS = 5

# Callbacks the CLI passes in: progress(stage, done, total) after each step of a long stage (its first call has
# done=0), note(text) with a partial result as soon as it is known. Either may be None.
Progress = Callable[[str, int, int], None]
Note = Callable[[str], None]


def _quiet(*_: Any) -> None:
    pass


# ----------------------------------------------------------------------------------------- inputs
def load_heldout_text(path: str | Path | None = None) -> str:
    """The held-out plays shipped with rq (never seen in training), or a given text file."""
    p = Path(path) if path else HELDOUT_PATH
    if not p.is_file():
        raise RQError(f"held-out text not found: {p}")
    return read_utf8(p)


def encode_ids(tokenizer: Any, text: str) -> np.ndarray:
    """Token ids (no special tokens) of `text` as int32; works for rq's and `tokenizers`' tokenizers."""
    e = tokenizer.encode(text, add_special_tokens=False)
    return np.asarray(getattr(e, "ids", e), dtype=np.int32)


def needle_token_pieces(tokenizer: Any) -> dict:
    """Token ids of the needle's pieces (digits must be one token each, as in the reference model)."""
    digits = [encode_ids(tokenizer, str(i)) for i in range(10)]
    if any(d.size != 1 for d in digits):
        raise RQError("the tokenizer does not encode each digit as one token; the needle test needs that")
    return {
        "needle_prefix": encode_ids(tokenizer, NEEDLE_PREFIX),
        "needle_suffix": encode_ids(tokenizer, NEEDLE_SUFFIX),
        "question": encode_ids(tokenizer, QUESTION),
        "digits": np.concatenate(digits),
        "n_digits": N_DIGITS,
    }


@dataclass
class EvalModel:
    model: Any
    tokenizer: Any
    config: dict
    path: Path
    context: int  # the model's trained context (max_position_embeddings), or 2048 if unstated


def load_eval_model(model: Optional[str] = None) -> EvalModel:
    """Load a checkpoint (default: the bundled model). On the CPU, activations run in float32:
    MLX's CPU quantized matmuls are far slower in float16/bfloat16 (measured ~50x for fp16)."""
    from rq_core.checkpoint import context_length, load

    ck = load(model)
    if ck.tokenizer is None:
        raise RQError(f"{ck.path} has no tokenizer.json; evaluation needs one")
    if mx.default_device() == mx.cpu:
        ck.model.set_dtype(mx.float32)
    return EvalModel(ck.model, ck.tokenizer, ck.config, Path(ck.path), context_length(ck.config) or 2048)


def kv_settings(mode: str, rotation: Optional[str] = None, **kw: Any) -> KVSettings:
    """KVSettings for a mode; `rotation` applies to isoquant3 only (turbo3 is the dense rotation)."""
    from rq_core.cache.kv_cache import KV_MODES

    if mode not in KV_MODES:
        raise RQError(f"unknown KV mode {mode!r} (choose from: {', '.join(KV_MODES)})")
    s = KVSettings(mode=mode, **kw)
    if rotation is not None:
        from rq_core.codec.rotation import check_variant

        s.rotation = check_variant(rotation)
    return s


def rotation_of(kv: KVSettings) -> Optional[str]:
    """The rotation a mode actually uses: None for fp16, dense for turbo3."""
    return None if kv.mode == "fp16" else "dense" if kv.mode == "turbo3" else kv.rotation


def label(kv: KVSettings) -> str:
    """A short name: fp16, turbo3, or isoquant3/<rotation>; "+w<N>" with an fp16 window of N tokens, "+p<K>x<V>"
    with pair codebooks, "+k<B>" with keys at B bits, "+e<N>" with N edge layers at each end (kv.edge_layers),
    "+nogain" without kv.value_gain."""
    name = f"isoquant3/{kv.rotation}" if kv.mode == "isoquant3" else kv.mode
    if kv.mode == "fp16":
        return name
    name = f"{name}+w{kv.fp16_window}" if kv.fp16_window else name
    if kv.pairs:
        name = f"{name}+p{kv.pairs[0]}x{kv.pairs[1]}"
    elif kv.key_bits not in (None, kv.bits):
        name = f"{name}+k{kv.key_bits}"
    if kv.edge_layers:
        name = f"{name}+e{kv.edge_layers}" if kv.edge_bits == 4 else f"{name}+e{kv.edge_layers}b{kv.edge_bits}"
    return name if kv.value_gain else f"{name}+nogain"


# -------------------------------------------------------------------------------------- windows
def _log_softmax(logits: mx.array) -> mx.array:
    x = logits.astype(mx.float32)
    return x - mx.logsumexp(x, axis=-1, keepdims=True)


def window_logprobs(model: Any, window: np.ndarray, kv: KVSettings, *, prefill: int, step: int = 32,
                    prefill_chunk: int = 512) -> mx.array:
    """Log-probabilities [N - prefill - 1, V] of the tokens window[prefill+1:], each predicted in a decode step.

    window[:prefill] is prefilled, the cache's `end_prefill()` runs, then window[prefill:-1] is fed in
    steps of `step` tokens (step 1 = token by token; a compressed cache compresses each step's keys and
    values before they are attended to, so larger steps read the cache exactly as decoding does).
    """
    n = len(window)
    if not 0 < prefill < n - 1:
        raise RQError(f"prefill {prefill} must leave tokens to score in a window of {n}")
    cache = model.make_cache(kv)
    x = mx.array(window[None].astype(np.int32))
    for i in range(0, prefill, prefill_chunk):
        mx.eval(model(x[:, i : min(prefill, i + prefill_chunk)], cache=cache))
    for c in cache:
        c.end_prefill()
    out = []
    for i in range(prefill, n - 1, step):
        j = min(n - 1, i + step)
        lp = _log_softmax(model(x[:, i:j], cache=cache)[0])
        mx.eval(lp)
        out.append(lp)
    return mx.concatenate(out, axis=0)


def windows(ids: np.ndarray, context: int, max_windows: Optional[int] = None) -> list[np.ndarray]:
    """Non-overlapping windows of context + 1 tokens (the last token is only a target)."""
    n = (len(ids) - 1) // context
    if max_windows is not None:
        n = min(n, max_windows)
    if n < 1:
        raise RQError(f"the text has {len(ids)} tokens, fewer than one window of {context + 1}")
    return [ids[i * context : i * context + context + 1] for i in range(n)]


@dataclass
class PPLResult:
    ppl: float
    tokens: int
    kv_mode: str
    rotation: Optional[str]
    context: int
    windows: int
    prefill: int
    nll: float
    fp16_window: int = 0
    key_bits: Optional[int] = None  # keys at their own width (None: the mode's bits)
    pair_points: Optional[tuple[int, int]] = None  # pair codebooks' points, keys' and values' (None: scalar)
    prefill_fp16: Optional[int] = None  # kv.prefill_fp16 (None: the whole prefill in fp16)
    prefill_chunk: int = 512
    value_gain: Optional[bool] = None  # kv.value_gain (None for fp16)
    edge_layers: Optional[int] = None  # kv.edge_layers (None for fp16)
    edge_bits: Optional[int] = None  # kv.edge_bits where edge_layers > 0

    def as_dict(self) -> dict:
        return {"ppl": self.ppl, "tokens": self.tokens, "kv_mode": self.kv_mode, "rotation": self.rotation,
                "context": self.context, "windows": self.windows, "prefill": self.prefill, "nll": self.nll,
                "fp16_window": self.fp16_window, "key_bits": self.key_bits,
                "pair_points": list(self.pair_points) if self.pair_points else None,
                "prefill_fp16": self.prefill_fp16, "prefill_chunk": self.prefill_chunk, "value_gain": self.value_gain,
                "edge_layers": self.edge_layers, "edge_bits": self.edge_bits}


def check_context(context: int, em_context: int) -> int:
    if context < 16:
        raise RQError(f"--context must be at least 16 (got {context})")
    if context > em_context:
        raise RQError(f"--context {context} is longer than the model's trained context of {em_context}")
    return context


def perplexity(model: Any, ids: np.ndarray, kv: KVSettings, *, context: int, prefill: Optional[int] = None,
               step: int = 32, max_windows: Optional[int] = None, prefill_chunk: int = 512,
               progress: Optional[Progress] = None, note: Optional[Note] = None) -> PPLResult:
    """Perplexity of the decode-scored half (by default) of each window (its prefill in chunks of `prefill_chunk`)."""
    progress, note = progress or _quiet, note or _quiet
    prefill = context // 2 if prefill is None else prefill
    total, count = 0.0, 0
    wins = windows(ids, context, max_windows)
    stage = f"{label(kv)}: {len(wins)} window(s) of {context}"
    progress(stage, 0, len(wins))
    for i, w in enumerate(wins):
        lp = window_logprobs(model, w, kv, prefill=prefill, step=step, prefill_chunk=prefill_chunk)
        tgt = mx.array(w[prefill + 1 :].astype(np.int32))
        nll = float((-mx.take_along_axis(lp, tgt[:, None], axis=-1).sum()).item())
        total += nll
        count += int(tgt.size)
        progress(stage, i + 1, len(wins))
        note(f"window {i + 1}/{len(wins)}: ppl {math.exp(nll / tgt.size):.3f}, so far {math.exp(total / count):.3f}")
    nll = total / count
    return PPLResult(ppl=math.exp(nll), tokens=count, kv_mode=kv.mode, rotation=rotation_of(kv), context=context,
                     windows=len(wins), prefill=prefill, nll=nll,
                     fp16_window=kv.fp16_window if kv.mode != "fp16" else 0,
                     key_bits=kv.key_bits if kv.mode != "fp16" else None,
                     pair_points=kv.pairs, prefill_fp16=kv.prefill_fp16 if kv.mode != "fp16" else None,
                     prefill_chunk=prefill_chunk, value_gain=kv.value_gain if kv.mode != "fp16" else None,
                     edge_layers=kv.edge_layers if kv.mode != "fp16" else None,
                     edge_bits=kv.edge_bits if kv.mode != "fp16" and kv.edge_layers else None)


@dataclass
class Comparison:
    """A KV mode against the fp16 reference on the same windows and scored positions."""

    nll_ref: float
    nll: float
    tokens: int
    mean_kl: float
    p99_kl: float
    top1_agreement: float
    finite: bool

    @property
    def ppl_ref(self) -> float:
        return math.exp(self.nll_ref)

    @property
    def ppl(self) -> float:
        return math.exp(self.nll)

    @property
    def rel_delta_ppl(self) -> float:
        return self.ppl / self.ppl_ref - 1.0


def reference_logprobs(model: Any, ids: np.ndarray, *, context: int, prefill: Optional[int] = None, step: int = 32,
                       max_windows: Optional[int] = None, prefill_chunk: int = 512,
                       progress: Optional[Progress] = None) -> list[mx.array]:
    """fp16 log-probabilities of each window's scored tokens: `compare`'s reference (`ref`)."""
    progress = progress or _quiet
    prefill = context // 2 if prefill is None else prefill
    wins = windows(ids, context, max_windows)
    fp16, ref = KVSettings(mode="fp16"), []
    stage = f"fp16: {len(wins)} window(s) of {context}"
    progress(stage, 0, len(wins))
    for w in wins:
        ref.append(window_logprobs(model, w, fp16, prefill=prefill, step=step, prefill_chunk=prefill_chunk))
        progress(stage, len(ref), len(wins))
    return ref


def compare(model: Any, ids: np.ndarray, kv: KVSettings, *, context: int, prefill: Optional[int] = None,
            step: int = 32, max_windows: Optional[int] = None,
            ref: Optional[list[mx.array]] = None, prefill_chunk: int = 512,
            progress: Optional[Progress] = None) -> tuple[Comparison, list[mx.array]]:
    """Compare `kv` with fp16 window by window (KL(fp16 ‖ kv) per scored token, top-1 agreement, ΔPPL).

    `ref` (fp16 log-probabilities per window, as returned) avoids recomputing the reference."""
    progress = progress or _quiet
    prefill = context // 2 if prefill is None else prefill
    wins = windows(ids, context, max_windows)
    if ref is None:
        ref = reference_logprobs(model, ids, context=context, prefill=prefill, step=step, max_windows=max_windows,
                                 prefill_chunk=prefill_chunk, progress=progress)
    nll_r = nll_m = 0.0
    kls, agree, count, finite = [], 0, 0, True
    stage = f"{label(kv)}: {len(wins)} window(s) of {context}"
    progress(stage, 0, len(wins))
    for i, (w, lr) in enumerate(zip(wins, ref)):
        lm = window_logprobs(model, w, kv, prefill=prefill, step=step, prefill_chunk=prefill_chunk)
        finite &= bool(mx.all(mx.isfinite(lm)).item())
        tgt = mx.array(w[prefill + 1 :].astype(np.int32))[:, None]
        nll_r += float(-mx.take_along_axis(lr, tgt, axis=-1).sum().item())
        nll_m += float(-mx.take_along_axis(lm, tgt, axis=-1).sum().item())
        kl = (mx.exp(lr) * (lr - lm)).sum(axis=-1)
        kls.append(np.array(kl))
        agree += int((mx.argmax(lr, axis=-1) == mx.argmax(lm, axis=-1)).sum().item())
        count += int(tgt.size)
        progress(stage, i + 1, len(wins))
    kl_all = np.concatenate(kls)
    finite &= bool(np.isfinite(kl_all).all())
    return Comparison(nll_ref=nll_r / count, nll=nll_m / count, tokens=count,
                      mean_kl=float(np.nanmean(kl_all)) if kl_all.size else 0.0,
                      p99_kl=float(np.nanpercentile(kl_all, 99)) if kl_all.size else 0.0,
                      top1_agreement=agree / count, finite=finite), ref


# ----------------------------------------------------------------------------------------- needle
@dataclass
class NeedleTrial:
    prompt: np.ndarray  # haystack with the needle, then the question (ends right before the answer)
    question_len: int
    answer: np.ndarray


def needle_trials(ids: np.ndarray, pieces: dict, *, length: int, depth: float, trials: int,
                  seed: int = 0) -> list[NeedleTrial]:
    """`trials` prompts of `length` tokens: held-out haystack, the needle at `depth` (0..1), the question."""
    q = pieces["question"]
    rng = np.random.default_rng([seed, length, int(round(depth * 1000))])
    hay_len = length - len(q)
    out = []
    for _ in range(trials):
        digits = rng.integers(0, 10, size=pieces["n_digits"])
        ans = pieces["digits"][digits]
        needle = np.concatenate([pieces["needle_prefix"], ans, pieces["needle_suffix"]])
        if hay_len <= len(needle):
            raise RQError(f"needle length {length} is too short for the needle and question")
        start = int(rng.integers(0, len(ids) - hay_len))
        hay = ids[start : start + hay_len].astype(np.int32).copy()
        pos = int(round(depth * (hay_len - len(needle))))
        hay[pos : pos + len(needle)] = needle
        out.append(NeedleTrial(np.concatenate([hay, q]).astype(np.int32), len(q), ans))
    return out


def answer_needle(model: Any, trial: NeedleTrial, kv: KVSettings, prefill_chunk: int = 512) -> np.ndarray:
    """Greedy answer digits: the haystack is prefilled, the question fed as a decode step after
    `end_prefill()`, then one token at a time (so the compressed cache is what is searched)."""
    cache = model.make_cache(kv)
    hay = mx.array(trial.prompt[None, : -trial.question_len])
    for i in range(0, hay.shape[1], prefill_chunk):
        mx.eval(model(hay[:, i : i + prefill_chunk], cache=cache))
    for c in cache:
        c.end_prefill()
    logits = model(mx.array(trial.prompt[None, -trial.question_len :]), cache=cache)[:, -1]
    out = []
    for _ in range(len(trial.answer)):
        y = mx.argmax(logits, axis=-1)
        out.append(int(y.item()))
        if len(out) < len(trial.answer):
            logits = model(y.reshape(1, 1).astype(mx.int32), cache=cache)[:, -1]
    return np.asarray(out)


def niah(model: Any, ids: np.ndarray, pieces: dict, kvs: Sequence[KVSettings], *, lengths: Sequence[int],
         depths: Sequence[float], trials: int, seed: int = 0, progress: Optional[Progress] = None,
         note: Optional[Note] = None) -> dict:
    """Accuracy (exact match of all digits) per (length, depth) cell for each KV mode, same needles for all.

    Each cell also lists its needles' outcomes (`hits`, 1 = retrieved, in the same order for every mode), and
    every mode after the first gets `paired` against the first (fp16 in `rq eval niah`): needles only the
    reference retrieved (`lost`), only this mode retrieved (`gained`), and McNemar's exact two-sided p."""
    progress, note = progress or _quiet, note or _quiet
    result: dict[str, Any] = {"lengths": list(lengths), "depths": list(depths), "trials": trials, "modes": {}}
    ref_hits: list[int] | None = None
    n = len(lengths) * len(depths) * trials
    for kv in kvs:
        cells, hits_all = [], []
        stage = f"{label(kv)}: {n} needle(s)"
        progress(stage, 0, n)
        for L in lengths:
            for d in depths:
                hits = []
                for t in needle_trials(ids, pieces, length=L, depth=d, trials=trials, seed=seed):
                    hits.append(int(np.array_equal(answer_needle(model, t, kv), t.answer)))
                    progress(stage, len(hits_all) + len(hits), n)
                cells.append({"length": L, "depth": d, "accuracy": sum(hits) / trials, "hits": hits})
                hits_all += hits
                note(f"{label(kv)} {L}@{d:g}: {sum(hits)}/{trials} retrieved")
        acc = float(np.mean([c["accuracy"] for c in cells])) if cells else 0.0
        entry: dict[str, Any] = {"cells": cells, "accuracy": acc}
        if ref_hits is None:
            ref_hits = hits_all
        else:
            lost = sum(r and not h for r, h in zip(ref_hits, hits_all))
            gained = sum(h and not r for r, h in zip(ref_hits, hits_all))
            entry["paired"] = {"lost": lost, "gained": gained, "mcnemar_p": mcnemar_p(lost, gained)}
        result["modes"][label(kv)] = entry
    return result


def mcnemar_p(b: int, c: int) -> float:
    """Exact two-sided McNemar p-value for b and c discordant pairs (binomial, p = 1/2)."""
    n = b + c
    if n == 0:
        return 1.0
    k = min(b, c)
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2.0**n
    return min(1.0, 2.0 * tail)


# ------------------------------------------------------------------------------------------ gates
GATES = (
    "ppl_rel_delta",           # relative ΔPPL at the gate context
    "ppl_rel_delta_full",      # relative ΔPPL at the model's full trained context
    "mean_kl",                 # mean KL(fp16 ‖ mode) of next-token distributions
    "p99_kl",                  # 99th percentile of that KL (tail errors)
    "top1_agreement",          # next-token argmax equal to fp16's
    "greedy_agreement",        # along fp16's greedy continuations, the mode's greedy token agrees
    "needle_retention",        # needle accuracy not below fp16's
    "finite",                  # no NaN/Inf in any logit
    "no_degenerate_repetition",  # repeated 4-grams of greedy text not above fp16's by more than a margin
    "eos_honoured",            # generation stops at the first EOS
    "deterministic",           # same seed → same sampled tokens
    "kv_bytes_ratio",          # bytes held / fp16 bytes for the same tokens
)


def load_gates(path: str | Path | None = None) -> dict:
    p = Path(path) if path else GATES_PATH
    if not p.is_file():
        raise RQError(f"gates file not found: {p}")
    try:
        cfg = tomllib.loads(read_utf8(p))
    except tomllib.TOMLDecodeError as e:
        raise RQError(f"{p} is not valid TOML: {e}")
    gates = cfg.get("gates", {})
    missing = [g for g in GATES if g not in gates]
    if missing:
        raise RQError(f"{p}: thresholds missing for gate(s): {', '.join(missing)}")
    return cfg


def _repeat_fraction(tokens: Sequence[int], n: int = 4) -> float:
    grams = [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]
    return 1.0 - len(set(grams)) / len(grams) if grams else 0.0


def _greedy(model: Any, prompt: np.ndarray, kv: KVSettings, n: int) -> list[int]:
    from rq_core.generate import generate

    return generate(model, prompt.tolist(), max_tokens=n, kv=kv).tokens


def _forced_agreement(model: Any, prompt: np.ndarray, cont: list[int], kv: KVSettings) -> tuple[int, int]:
    """Feed prompt (prefill) then `cont` one token at a time; count steps whose argmax equals cont."""
    cache = model.make_cache(kv)
    logits = model(mx.array(prompt[None]), cache=cache)[:, -1]
    for c in cache:
        c.end_prefill()
    agree = 0
    for i, t in enumerate(cont):
        agree += int(int(mx.argmax(logits, axis=-1).item()) == t)
        if i + 1 < len(cont):
            logits = model(mx.array([[t]], dtype=mx.int32), cache=cache)[:, -1]
    return agree, len(cont)


def gate_verdicts(v: dict, th: dict) -> list[dict]:
    """The twelve gates (GATES order) from measured values `v` and thresholds `th` (gates.toml's [gates]).

    `v`: the GATES' names for measured values, except needle_retention (from needle_accuracy and
    needle_accuracy_fp16) and no_degenerate_repetition (from repeat and repeat_fp16, repeated-4-gram shares);
    finite, eos_honoured and deterministic are booleans."""
    out: list[dict] = []

    def gate(name: str, value: float, passed: bool, rule: str) -> None:
        out.append({"name": name, "value": value, "threshold": rule, "passed": bool(passed)})

    for name in ("ppl_rel_delta", "ppl_rel_delta_full", "mean_kl", "p99_kl"):
        gate(name, v[name], v[name] <= th[name], f"<= {th[name]}")
    for name in ("top1_agreement", "greedy_agreement"):
        gate(name, v[name], v[name] >= th[name], f">= {th[name]}")
    acc, acc_ref = v["needle_accuracy"], v["needle_accuracy_fp16"]
    gate("needle_retention", acc - acc_ref, acc >= acc_ref - th["needle_retention"],
         f"accuracy >= fp16's ({acc_ref:.2f}) - {th['needle_retention']}")
    gate("finite", float(bool(v["finite"])), v["finite"], "no NaN/Inf")
    d = v["repeat"] - v["repeat_fp16"]
    gate("no_degenerate_repetition", d, d <= th["no_degenerate_repetition"],
         f"repeated-4-gram share - fp16's <= {th['no_degenerate_repetition']}")
    gate("eos_honoured", float(bool(v["eos_honoured"])), v["eos_honoured"], "stops at the first EOS, EOS not emitted")
    gate("deterministic", float(bool(v["deterministic"])), v["deterministic"], "same seed, same sampled tokens")
    gate("kv_bytes_ratio", v["kv_bytes_ratio"], v["kv_bytes_ratio"] <= th["kv_bytes_ratio"],
         f"<= {th['kv_bytes_ratio']}")
    return out


@dataclass
class GateReport:
    label: str
    gates: list[dict] = field(default_factory=list)
    details: dict = field(default_factory=dict)  # ppl, ppl_ref, tokens, needle accuracies

    @property
    def passed(self) -> int:
        return sum(g["passed"] for g in self.gates)

    def as_dict(self) -> dict:
        return {"kv": self.label, "passed": self.passed, "total": len(self.gates), "gates": self.gates,
                "details": self.details}


class GateRunner:
    """Runs the twelve gates for KV modes against fp16; fp16 references are computed once and reused.

    Sample sizes are gates.toml's [settings]; `full=True` scores every window of the held-out text at both contexts
    for the perplexity/KL gates and takes the rest of the sample from its [full] table where it sets them."""

    def __init__(self, em: EvalModel, cfg: dict, ids: np.ndarray, *, full: bool = False,
                 progress: Optional[Progress] = None, note: Optional[Note] = None):
        self.em, self.cfg, self.ids = em, cfg, ids
        self.progress, self.note = progress or _quiet, note or _quiet
        s = {**cfg.get("settings", {}), **(cfg.get("full", {}) if full else {})}
        self.context = min(int(s.get("context", 1024)), em.context)
        self.full_context = em.context if s.get("full_context", "model") == "model" else int(s["full_context"])
        self.full_context = min(self.full_context, em.context)
        self.windows: Optional[int] = None if full else int(s.get("windows", 4))
        self.full_windows: Optional[int] = None if full else int(s.get("full_windows", 2))
        self.step = int(s.get("step", 32))
        self.prompts = int(s.get("prompts", 4))
        self.prompt_len = int(s.get("prompt_len", 256))
        self.gen_tokens = int(s.get("gen_tokens", 64))
        self.niah_lengths = [min(int(x), em.context) for x in s.get("niah_lengths", [1024, 2048])]
        self.niah_depths = [float(x) for x in s.get("niah_depths", [0.25, 0.75])]
        self.niah_trials = int(s.get("niah_trials", 2))
        self.seed = int(s.get("seed", 0))
        self._ref: dict[str, Any] = {}

    def window_counts(self) -> tuple[int, int]:
        """Windows the perplexity/KL gates score at `context` and at `full_context`."""
        return (len(windows(self.ids, self.context, self.windows)),
                len(windows(self.ids, self.full_context, self.full_windows)))

    def _prompt_set(self) -> list[np.ndarray]:
        rng = np.random.default_rng(self.seed)
        starts = rng.integers(0, len(self.ids) - self.prompt_len, size=self.prompts)
        return [self.ids[s : s + self.prompt_len].astype(np.int32) for s in starts]

    def _greedy_all(self, kv: KVSettings, prompts: list[np.ndarray]) -> list[list[int]]:
        stage, out = f"{label(kv)}: {len(prompts)} greedy continuation(s) of {self.gen_tokens}", []
        self.progress(stage, 0, len(prompts))
        for p in prompts:
            out.append(_greedy(self.em.model, p, kv, self.gen_tokens))
            self.progress(stage, len(out), len(prompts))
        return out

    def reference(self) -> dict:
        if self._ref:
            return self._ref
        m, fp16 = self.em.model, KVSettings(mode="fp16")
        r: dict[str, Any] = {}
        r["win"] = reference_logprobs(m, self.ids, context=self.context, step=self.step, max_windows=self.windows,
                                      progress=self.progress)
        r["full"] = reference_logprobs(m, self.ids, context=self.full_context, step=self.step,
                                       max_windows=self.full_windows, progress=self.progress)
        r["greedy"] = self._greedy_all(fp16, self._prompt_set())
        r["niah"] = self._niah(fp16)
        self._ref = r
        return r

    def _niah(self, kv: KVSettings) -> float:
        pieces = needle_token_pieces(self.em.tokenizer)
        res = niah(self.em.model, self.ids, pieces, [kv], lengths=self.niah_lengths, depths=self.niah_depths,
                   trials=self.niah_trials, seed=self.seed, progress=self.progress)
        acc = res["modes"][label(kv)]["accuracy"]
        self.note(f"{label(kv)}: needle accuracy {acc:.2f}")
        return acc

    def run(self, kv: KVSettings) -> GateReport:
        m, ref = self.em.model, self.reference()
        rep = GateReport(label(kv))
        c, _ = compare(m, self.ids, kv, context=self.context, step=self.step, max_windows=self.windows,
                       ref=ref["win"], progress=self.progress)
        self.note(f"{label(kv)} at {self.context}: ΔPPL {c.rel_delta_ppl:+.2%}, mean KL {c.mean_kl:.4f}, "
                  f"p99 KL {c.p99_kl:.4f}, top-1 agreement {c.top1_agreement:.3f}")
        cf, _ = compare(m, self.ids, kv, context=self.full_context, step=self.step,
                        max_windows=self.full_windows, ref=ref["full"], progress=self.progress)
        self.note(f"{label(kv)} at {self.full_context}: ΔPPL {cf.rel_delta_ppl:+.2%}")

        prompts = self._prompt_set()
        agree = total = 0
        stage = f"{label(kv)}: agreement along {len(prompts)} fp16 continuation(s)"
        self.progress(stage, 0, len(prompts))
        for i, (p, cont) in enumerate(zip(prompts, ref["greedy"])):
            a, n = _forced_agreement(m, p, cont, kv)
            agree += a
            total += n
            self.progress(stage, i + 1, len(prompts))
        self.note(f"{label(kv)}: greedy agreement {agree / max(total, 1):.3f}")

        acc = self._niah(kv)
        rep.details.update({
            "context": self.context, "tokens": c.tokens, "ppl": c.ppl, "ppl_fp16": c.ppl_ref,
            "full_context": self.full_context, "full_tokens": cf.tokens, "ppl_full": cf.ppl,
            "ppl_full_fp16": cf.ppl_ref, "needle_accuracy": acc, "needle_accuracy_fp16": ref["niah"],
            "needle_trials": len(self.niah_lengths) * len(self.niah_depths) * self.niah_trials})
        own = self._greedy_all(kv, prompts)
        # bytes at the scored context (prompt + 16 decoded tokens), where a fixed fp16 window is a share a user sees
        ratio = self._kv_ratio(kv, self.ids[: max(1, self.context - 16)].astype(np.int32))
        rep.gates = gate_verdicts({
            "ppl_rel_delta": c.rel_delta_ppl, "ppl_rel_delta_full": cf.rel_delta_ppl, "mean_kl": c.mean_kl,
            "p99_kl": c.p99_kl, "top1_agreement": c.top1_agreement, "greedy_agreement": agree / max(total, 1),
            "needle_accuracy": acc, "needle_accuracy_fp16": ref["niah"], "finite": c.finite and cf.finite,
            "repeat": float(np.mean([_repeat_fraction(t) for t in own])),
            "repeat_fp16": float(np.mean([_repeat_fraction(t) for t in ref["greedy"]])),
            "eos_honoured": self._eos(kv, prompts[0], own[0])[1],
            "deterministic": self._determinism(kv, prompts[0])[1], "kv_bytes_ratio": ratio}, self.cfg["gates"])
        return rep

    def _eos(self, kv: KVSettings, prompt: np.ndarray, own: list[int]) -> tuple[float, bool]:
        from rq_core.generate import generate

        if len(own) < 2:
            return 0.0, False
        k = len(own) // 2
        eos = own[k]
        first = own.index(eos)  # greedy is deterministic: the run stops at eos' first occurrence
        r = generate(self.em.model, prompt.tolist(), max_tokens=len(own), kv=kv, eos_token_ids=[eos])
        ok = r.stop_reason == "eos" and r.tokens == own[:first] and eos not in r.tokens
        return float(ok), ok

    def _determinism(self, kv: KVSettings, prompt: np.ndarray) -> tuple[float, bool]:
        from rq_core.generate import generate

        a = generate(self.em.model, prompt.tolist(), max_tokens=16, temp=0.8, seed=1234, kv=kv).tokens
        b = generate(self.em.model, prompt.tolist(), max_tokens=16, temp=0.8, seed=1234, kv=kv).tokens
        return float(a == b), a == b

    def _kv_ratio(self, kv: KVSettings, prompt: np.ndarray) -> float:
        from rq_core.generate import generate

        r = generate(self.em.model, prompt.tolist(), max_tokens=16, kv=kv)
        return r.kv_bytes / r.kv_bytes_fp16 if r.kv_bytes_fp16 else 1.0
