"""A quantized checkpoint of a real model config with random weights, written without the bf16 model.

    python3 tools/synth_checkpoint.py qwen3-30b-a3b --recipe qwen3-16gb -o /tmp/q3
    python3 tools/synth_checkpoint.py nemotron3-nano-30b-a3b --recipe nemotron-32gb -o /tmp/nano --layers 4

What the benchmarks measure rq on (benchmarks/decode_vs_mlxlm.py, benchmarks/pager.py) without a 60 GB download.

Each tensor gets the bits and group size `rq quantize` would give it (rq_core.quant.roles / rq_core.quant.recipe, through
rq_core.quant.quantize's own per-tensor decision and output names); packed codes (uint32), scales and biases are drawn at
the quantized shapes directly, so peak memory is one decoder layer's quantized tensors. The output is rq quantize's
format: one shard a decoder layer (and one for embeddings, final norm and head) named and indexed as rq quantize
names them, config.json with mlx-lm's `quantization` entries, the resolved recipe.toml, and a tokenizer.

Values: codes uniform over [0, 2^bits); each group's scale and bias make the weights zero-mean with standard
deviation ~1/sqrt(fan-in) (scales jittered ±20% between groups), so activations stay O(1) through every layer and
the logits are finite and spread (not all equal). Norms are ones, SSM parameters in their usual ranges; with tied
embeddings see TIED_GAIN.

Tokenizer: the bundled model's (its ids are all below every supported config's vocabulary), while the config keeps
its real vocab_size, so the embedding table and output head have their real sizes and cost (a decode step's head
matmul over 152K-262K rows is part of what is measured). Ids the tokenizer lacks only matter for printing text.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from pathlib import Path
from typing import Callable, Optional

import mlx.core as mx
from mlx.utils import tree_flatten

from rq_core.checkpoint import DEFAULT_MODEL
from rq_core.errors import RQError
from rq_core.quant import recipe as recipe_mod
from rq_core.quant.quantize import (QuantizeResult, _Job, _ShardWriter, _write_metadata, model_skeleton,
                                   quantizable_modules)
from rq_core.quant.roles import EMBEDDINGS

CONFIGS = Path(__file__).resolve().parents[2] / "tests" / "data" / "configs"  # the real configs, in a checkout
MARK = ".rq-synth.json"  # what made this folder (reuse it only for the same arguments)
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
# Tied embeddings: the head is the embedding table, so a token's own row would dominate its logits (greedy decode would
# repeat the prompt's last token). The table is drawn this many times smaller, under the layers' outputs in the residual
# stream, and the final norm's weight this many times larger, so the logits keep unit scale.
TIED_GAIN = 32.0


def read_config(path: str | Path) -> dict:
    """A config JSON (path, or the stem of a file in a checkout's tests/data/configs) without its `_` notes."""
    p = Path(path)
    if not p.is_file():
        p = CONFIGS / f"{path}.json"
    cfg = json.loads(p.read_text())
    return {k: v for k, v in cfg.items() if not k.startswith("_")}


def _pick(pattern: list, n: int, priority: list) -> list:
    """n layer types from a per-layer pattern: its first n, with the `priority` types (attention first) that the
    pattern has swapped in where missing, replacing the most repeated ones from the end."""
    out = list(pattern[:n])
    need = [t for t in priority if t in pattern][:n]
    for t in need:
        if t in out:
            continue
        for i in range(len(out) - 1, -1, -1):
            if out[i] not in need or out.count(out[i]) > 1:
                out[i] = t
                break
    return out


def truncate(cfg: dict, layers: int) -> dict:
    """The config with `layers` decoder layers, keeping at least one layer of each kind where it can."""
    cfg = json.loads(json.dumps(cfg))
    mt = cfg.get("model_type")
    tc = cfg["text_config"] if isinstance(cfg.get("text_config"), dict) else cfg
    if layers < 1:
        raise RQError(f"--layers must be >= 1 (got {layers})")
    if layers >= tc["num_hidden_layers"]:
        return cfg
    tc["num_hidden_layers"] = layers
    if mt == "qwen3_moe" or mt == "qwen2_moe":
        if "max_window_layers" in tc:
            tc["max_window_layers"] = min(tc["max_window_layers"], layers)
        if "layer_types" in tc:
            tc["layer_types"] = tc["layer_types"][:layers]
    elif mt == "nemotron_h":
        p = list(tc["hybrid_override_pattern"])
        tc["hybrid_override_pattern"] = "".join(_pick(p, layers, ["*", "E", "M", "-"]))
    elif mt in ("gemma4", "gemma4_text"):
        tc["layer_types"] = _pick(tc["layer_types"], layers, ["full_attention", "sliding_attention"])
        tc["num_kv_shared_layers"] = min(tc.get("num_kv_shared_layers", 0) or 0, max(0, layers - 2))
    return cfg


class _Spec:
    """rq quantize's per-tensor decision (rq_core.quant.quantize._Job.spec_for / out_name / validate) on a config
    alone: a _Job without a source checkpoint."""

    def __init__(self, config: dict, rec) -> None:
        job = object.__new__(_Job)
        job.config, job.recipe, job.progress = config, rec, (lambda *a: None)
        job.model = model_skeleton(config)  # lazy: shapes only, nothing is computed
        job.qmods = quantizable_modules(job.model)
        job.specs = dict(rec.roles)
        job.qconfig = {}
        job.res = QuantizeResult(out="")
        job.validate()  # the recipe's group sizes divide these dimensions, as rq quantize checks
        self.job = job


def _words(shape: tuple, key: mx.array) -> mx.array:
    """Uniform random uint32 words: two 16-bit halves (randint over 2^32 goes through float32 and would leave the
    low bits, the first codes of a word, constant)."""
    k1, k2 = mx.random.split(key)
    lo = mx.random.randint(0, 1 << 16, shape, key=k1).astype(mx.uint32)
    hi = mx.random.randint(0, 1 << 16, shape, key=k2).astype(mx.uint32)
    return (hi << 16) | lo


def quantized_arrays(shape: tuple, bits: int, group_size: int, key: mx.array, dtype=mx.bfloat16,
                     std: Optional[float] = None) -> tuple[mx.array, mx.array, mx.array]:
    """(weight uint32, scales, biases) of a random [..., out, in] matrix in mx.quantize's affine layout, dequantizing
    to zero-mean values of standard deviation `std` (default 1/sqrt(in))."""
    *lead, n_in = shape
    if n_in % group_size or (n_in * bits) % 32:
        raise ValueError(f"in-dimension {n_in} does not fit {bits} bits x group {group_size}")
    std = n_in ** -0.5 if std is None else std
    levels = 2 ** bits
    s0 = std / math.sqrt((levels * levels - 1) / 12.0)  # std of a uniform code times the scale
    kw, ks = mx.random.split(key)
    w = _words((*lead, n_in * bits // 32), kw)
    scales = (s0 * mx.random.uniform(0.8, 1.2, (*lead, n_in // group_size), key=ks)).astype(dtype)
    biases = (-scales.astype(mx.float32) * ((levels - 1) / 2.0)).astype(dtype)
    return w, scales, biases


def plain_array(name: str, shape: tuple, key: mx.array, dtype=mx.bfloat16) -> mx.array:
    """An unquantized tensor: norms and scale vectors ones, biases zeros, SSM parameters in their usual ranges,
    anything else (an unquantized matrix) zero-mean at 1/sqrt(fan-in)."""
    if name.endswith(".A_log"):
        return mx.log(mx.random.uniform(1.0, 16.0, shape, key=key)).astype(dtype)
    if name.endswith(".dt_bias"):  # softplus^-1 of dt in [1e-3, 1e-1]
        dt = mx.exp(mx.random.uniform(math.log(1e-3), math.log(1e-1), shape, key=key))
        return (dt + mx.log(-mx.expm1(-dt))).astype(dtype)
    if name.endswith(".bias") or name.endswith("e_score_correction_bias"):
        return mx.zeros(shape, dtype)
    if "conv1d" in name and name.endswith(".weight"):
        return (mx.random.normal(shape, key=key) * (shape[1] ** -0.5 if len(shape) > 1 else 1.0)).astype(dtype)
    if len(shape) <= 1 or name.endswith(".D"):
        return mx.ones(shape, dtype)
    return (mx.random.normal(shape, key=key) * shape[-1] ** -0.5).astype(dtype)


def _shard_of(name: str) -> tuple[int, str]:
    parts = name.split(".")
    for i, p in enumerate(parts[:-1]):
        if p == "layers" and parts[i + 1].isdigit():
            return int(parts[i + 1]), ".".join(parts[:i])
    return 1 << 30, ""  # embeddings, final norm, head: the last shard, as rq quantize orders them


def write(config: dict, recipe_name: str, out: str | Path, *, seed: int = 0, tokenizer_from: Optional[Path] = None,
          progress: Optional[Callable[[str, int, int], None]] = None) -> dict:
    """Write the checkpoint into `out` (a temp folder renamed onto it; an existing `out` is replaced). Returns a
    summary: bytes, tensors, shards, seconds."""
    t0 = time.perf_counter()
    rec = recipe_mod.load(recipe_name)
    spec = _Spec(config, rec)
    job = spec.job
    params = dict(tree_flatten(job.model.parameters()))
    tc = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    tied = bool(tc.get("tie_word_embeddings", config.get("tie_word_embeddings", False)))
    groups: dict[tuple[int, str], list[str]] = {}
    for k in params:
        groups.setdefault(_shard_of(k), []).append(k)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        writer = _ShardWriter(tmp, shard_bytes=1 << 62)  # flushed once a layer below
        key = mx.random.key(seed)
        n_t = n_q = 0
        order = sorted(groups)
        for gi, g in enumerate(order):
            for name in groups[g]:
                shape = tuple(params[name].shape)
                key, sub = mx.random.split(key)
                proxy = mx.zeros((1,) * len(shape))  # spec_for looks at the rank only
                role, s = job.spec_for(name, proxy)
                n_t += 1
                if s is None:
                    a = plain_array(name, shape, sub)
                    if tied and g[0] == 1 << 30 and len(shape) == 1 and "norm" in name:
                        a = a * TIED_GAIN  # the final norm: logits back at unit scale
                    mx.eval(a)
                    writer.add(job.out_name(name), a)
                    continue
                mod = name.rsplit(".", 1)[0]
                out_mod = job.out_name(mod + ".")[:-1]
                if out_mod != mod:
                    job.qconfig[out_mod] = job.qconfig[mod]
                std = shape[-1] ** -0.5 * (TIED_GAIN ** -1 if tied and role == EMBEDDINGS else 1.0)
                w, sc, b = quantized_arrays(shape, s.bits, s.group_size, sub, std=std)
                mx.eval(w, sc, b)
                n_q += 1
                for suffix, t in (("weight", w), ("scales", sc), ("biases", b)):
                    writer.add(f"{out_mod}.{suffix}", t)
                del w, sc, b
            writer.flush()
            if progress:
                progress("write", gi + 1, len(order))
        weight_map = writer.finish()
        src = Path(tmp / ".src")
        src.mkdir()
        (src / "config.json").write_text(json.dumps(config))
        _write_metadata(tmp, src, config, job, weight_map)
        shutil.rmtree(src)
        tok_dir = Path(tokenizer_from) if tokenizer_from else DEFAULT_MODEL
        for f in _TOKENIZER_FILES:
            if (tok_dir / f).is_file():
                shutil.copy2(tok_dir / f, tmp / f)
        summary = {"tensors": n_t, "quantized": n_q, "shards": len(set(weight_map.values())),
                   "bytes": writer.total, "recipe": rec.name, "seed": seed}
        (tmp / MARK).write_text(json.dumps({**summary, "config": config}))
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    summary["seconds"] = time.perf_counter() - t0
    return summary


def ensure(config: dict, recipe_name: str, out: str | Path, *, seed: int = 0,
           progress: Optional[Callable[[str, int, int], None]] = None) -> tuple[Path, bool]:
    """`out` holding this checkpoint: reused when an earlier write with the same config, recipe and seed made it,
    else written. (path, reused)."""
    out = Path(out)
    mark = out / MARK
    if mark.is_file():
        try:
            m = json.loads(mark.read_text())
        except ValueError:
            m = {}
        if m.get("config") == config and m.get("recipe") == recipe_name and m.get("seed") == seed \
                and (out / "config.json").is_file():
            return out, True
    write(config, recipe_name, out, seed=seed, progress=progress)
    return out, False


def default_recipe(config: dict) -> str:
    mt = config.get("model_type")
    return {"qwen3_moe": "qwen3-16gb", "gemma4": "gemma4-16gb", "gemma4_text": "gemma4-16gb",
            "nemotron_h": "nemotron-32gb"}.get(mt, "qwen3-16gb")
