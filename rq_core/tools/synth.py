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

Routing (`routing="zipf[:S]"`): random router rows choose experts about uniformly, a harder case for the expert pager
than a trained model's skewed choice. With zipf, each router's rows are scaled per expert so that how often an expert
is among a token's top-k follows a Zipf law of exponent S over a random ranking of the layer's experts (see
zipf_row_scales). The default ("uniform") writes the same bytes as before the option existed.

Packed (`packed=True`): the checkpoint is written as `rq pack --move` leaves one, the routed experts once, in their
pages (CKPT/experts: one page file a MoE layer, index.json with CRC32s and fingerprints) and not in the shards, so
the disk holds the model once and no second copy is ever written (packing a written checkpoint needs the
checkpoint and all its pages at once: ~76 GB for Nemotron 3 Super).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import time
from pathlib import Path
from statistics import NormalDist
from typing import Callable, Optional

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from rq_core.checkpoint import DEFAULT_MODEL
from rq_core.errors import RQError
from rq_core.models.base import layers_as_written
from rq_core.paging.pack import write_page_file
from rq_core.quant import recipe as recipe_mod
from rq_core.quant.quantize import (QuantizeResult, _Job, _ShardWriter, _write_metadata, model_skeleton,
                                   quantizable_modules)
from rq_core.quant.roles import EMBEDDINGS, ROUTER

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


ROUTINGS = ("uniform", "zipf")
ZIPF_S = 1.0  # zipf's default exponent
# No expert is asked to be in more than this share of tokens' top-k: a zero-mean logit, whatever its spread, passes
# the (positive) top-k threshold less than half of the time, so scaling rows cannot make an expert's share reach 1/2.
ZIPF_P_MAX = 0.45



def parse_routing(text: Optional[str]) -> tuple[str, float]:
    """"uniform" -> ("uniform", 0.0); "zipf" -> ("zipf", ZIPF_S); "zipf:1.2" -> ("zipf", 1.2)."""
    kind, _, arg = str(text or "uniform").partition(":")
    if kind not in ROUTINGS or (kind == "uniform" and arg):
        raise RQError(f"routing {text!r}: choose uniform or zipf[:S] (e.g. zipf:1.2)")
    if kind == "uniform":
        return "uniform", 0.0
    try:
        exp = float(arg) if arg else ZIPF_S
    except ValueError:
        raise RQError(f"routing {text!r}: S must be a number (e.g. zipf:1.2)")
    if not (math.isfinite(exp) and exp > 0):
        raise RQError(f"routing {text!r}: S must be > 0")
    return "zipf", exp


def zipf_targets(E: int, k: int, exp: float) -> np.ndarray:
    """Per rank r (0 = most chosen), the share of tokens whose top-k holds that expert: k * (r+1)^-exp / sum, at most
    ZIPF_P_MAX (the excess spread over the rest in the same proportions). Sums to k."""
    w = (np.arange(E) + 1.0) ** -exp
    p = k * w / w.sum()
    cap = max(ZIPF_P_MAX, 1.01 * k / E)
    for _ in range(E):
        over = p > cap
        if not over.any():
            break
        free = ~over & (p < cap)
        p[over] = cap
        p[free] *= (k - p[~free].sum()) / p[free].sum()
    return p


_ZIPF_SCALES: dict[tuple[int, int, float], np.ndarray] = {}


def zipf_row_scales(E: int, k: int, exp: float, samples: int = 4096, iters: int = 30) -> np.ndarray:
    """Per rank, the factor a router row is scaled by so that top-k selection follows zipf_targets.

    A random row w_e (independent of the hidden state x) gives a logit w_e.x that is, for any x, Gaussian with
    variance |w_e|^2 |x|^2 / d, independently across experts; scaling row e by c_e scales its logit's spread, and
    top-k picks the widely spread experts more often. So the frequencies depend on the c_e alone (not on the layers
    before, nor on the norm in front of the router): the c_e are fitted here on iid Gaussian logits (fixed-point
    iteration on log c), then normalised to RMS 1 so the logits keep the uniform router's scale. Softmax, sigmoid
    and per-expert scales after the logits are monotone per expert and leave the choice as it is."""
    key = (E, k, float(exp))
    if key in _ZIPF_SCALES:
        return _ZIPF_SCALES[key]
    target = zipf_targets(E, k, exp)
    # mean field: a token's top-k threshold taken as a constant tau = 1, expert e passes it with P(c_e g > 1)
    inv = NormalDist().inv_cdf
    logc = np.array([-math.log(inv(1.0 - float(p))) for p in target])
    # then the per-token threshold's spread, corrected on sampled logits (damped fixed-point steps on log c)
    g = np.random.default_rng(0).standard_normal((samples, E)).astype(np.float32)
    floor = 0.5 / samples
    for _ in range(iters):
        z = g * np.exp(logc).astype(np.float32)[None]
        top = np.argpartition(-z, k - 1, axis=1)[:, :k]
        obs = np.bincount(top.ravel(), minlength=E) / samples
        logc += 0.3 * (np.log(np.maximum(target, floor)) - np.log(np.maximum(obs, floor)))
    c = np.exp(logc)
    c /= math.sqrt(float((c * c).mean()))
    _ZIPF_SCALES[key] = c
    return c


def router_scales(config: dict, exp: float, seed: int, layer: int) -> np.ndarray:
    """Expert -> row scale of one layer's router: zipf_row_scales over a random ranking of the experts (seeded by
    the seed and the layer, so each layer favours its own experts)."""
    from rq_core.paging.planner import _moe_info

    _, E, k = _moe_info(config)
    c = zipf_row_scales(E, k, exp)
    rank = np.random.default_rng([seed, layer]).permutation(E)  # expert rank[r] has rank r
    out = np.empty(E)
    out[rank] = c
    return out


_ST_DTYPE = {"bfloat16": "BF16", "float16": "F16", "float32": "F32", "uint32": "U32", "uint8": "U8", "int32": "I32"}
_ST_BYTES = {"BF16": 2, "F16": 2, "F32": 4, "U32": 4, "U8": 1, "I32": 4}


def _np_of(a: mx.array) -> np.ndarray:
    return np.array(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a)


def _fingerprint(path: str, tensors: list[tuple[str, np.ndarray, str]]) -> str:
    """What rq_core.paging.pages.source_fingerprints computes for a bank stored in the shards under these names."""
    from rq_core.paging.pages import _SAMPLE, _SAMPLES

    h = hashlib.sha256()
    for n, a, dt in tensors:
        h.update(json.dumps([f"{path}.{n}", _ST_DTYPE[dt], [int(s) for s in a.shape]]).encode())
        raw = memoryview(np.ascontiguousarray(a)).cast("B")
        size = len(raw)
        w = min(_SAMPLE, size)
        for pos in sorted({(size - w) * i // (_SAMPLES - 1) for i in range(_SAMPLES)}):
            h.update(raw[pos:pos + w])
    return "tensors:" + h.hexdigest()


class _MovedShardWriter(_ShardWriter):
    """A _ShardWriter whose next shard records, in its metadata, the banks moved out of it (`rq pack --move`'s
    MOVED_KEY entry)."""

    def __init__(self, tmp: Path, shard_bytes: int) -> None:
        super().__init__(tmp, shard_bytes)
        self.moved: dict[str, dict] = {}

    def flush(self) -> None:
        from rq_core.paging.pages import MOVED_KEY

        if not self.cur:
            return
        f = self.tmp / f"part-{len(self.files):05d}.safetensors"
        meta = {"format": "mlx"}
        if self.moved:
            meta[MOVED_KEY] = json.dumps(self.moved, sort_keys=True)
        with open(f, "wb") as fh:  # a file object: a full disk raises (see _ShardWriter.flush)
            mx.save_safetensors(fh, self.cur, metadata=meta)
            fh.flush()
            os.fsync(fh.fileno())
        self.files.append((f, list(self.cur)))
        self.cur, self.cur_bytes, self.moved = {}, 0, {}
        mx.clear_cache()


def _shard_of(name: str) -> tuple[int, str]:
    parts = name.split(".")
    for i, p in enumerate(parts[:-1]):
        if p == "layers" and parts[i + 1].isdigit():
            return int(parts[i + 1]), ".".join(parts[:i])
    return 1 << 30, ""  # embeddings, final norm, head: the last shard, as rq quantize orders them


def write(config: dict, recipe_name: str, out: str | Path, *, seed: int = 0, tokenizer_from: Optional[Path] = None,
          progress: Optional[Callable[[str, int, int], None]] = None, routing: str = "uniform",
          packed: bool = False, pages_from: Optional[Path] = None) -> dict:
    """Write the checkpoint into `out` (a temp folder renamed onto it; an existing `out` is replaced). Returns a
    summary: bytes, tensors, shards, seconds. `routing`: "uniform" (random routers) or "zipf[:S]" (skewed expert
    choice, see zipf_row_scales). `packed`: the routed experts in CKPT/experts only, as `rq pack --move` leaves
    them (the same values as an unpacked write with the same seed). `pages_from`: a packed checkpoint this function
    wrote with the same config, recipe and seed (any routing: routing scales the routers alone), whose page files
    are hard-linked (copied where a link fails) instead of drawn again: the same files, a fraction of the time and,
    linked, no more disk."""
    from rq_core.paging.pack import ALIGN
    from rq_core.paging.pages import INDEX, PACK_DIR, VERSION, _PARTS, _PROJS, expert_banks, load_index, moved_experts

    t0 = time.perf_counter()
    route, exp = parse_routing(routing)
    base_index, base_moved = None, None
    if pages_from is not None:
        pages_from = Path(pages_from)
        if not packed or not same_pages(pages_from, config, recipe_name, seed):
            raise RQError(f"pages_from {pages_from}: not a packed checkpoint of this config, recipe and seed")
        base_index = load_index(pages_from)  # checked field by field: page names inside the pack, sizes
        base_moved = moved_experts(pages_from)
    rec = recipe_mod.load(recipe_name)
    spec = _Spec(config, rec)
    job = spec.job
    params = dict(tree_flatten(job.model.parameters()))
    tc = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    tied = bool(tc.get("tie_word_embeddings", config.get("tie_word_embeddings", False)))
    n_experts = 0
    if route != "uniform":
        from rq_core.paging.planner import _moe_info

        n_experts = _moe_info(config)[1]
        if not n_experts:
            raise RQError(f"routing {routing!r}: this model has no routed experts")
    bank_of: dict[str, tuple[str, str]] = {}  # skeleton module of a bank projection -> (bank path, projection)
    if packed:
        for bp, m in expert_banks(job.model).items():
            for proj in _PROJS:
                if proj in m:
                    bank_of[f"{bp}.{proj}"] = (bp, proj)
        if not bank_of:
            raise RQError("packed: this model has no routed experts to page")
    groups: dict[tuple[int, str], list[str]] = {}
    for k in params:
        groups.setdefault(_shard_of(k), []).append(k)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        # flushed once a layer below
        writer = (_MovedShardWriter if packed else _ShardWriter)(tmp, shard_bytes=1 << 62)
        index: dict = {"version": VERSION, "alignment": ALIGN, "model_type": config.get("model_type"),
                       "layers": {}}
        pages_total = 0
        if packed:
            (tmp / PACK_DIR).mkdir()
        key = mx.random.key(seed)
        n_t = n_q = 0
        order = sorted(groups)
        for gi, g in enumerate(order):
            pending: dict[str, dict[str, tuple[str, mx.array]]] = {}  # bank path -> part -> (stored name, array)
            linked: set[str] = set()  # banks whose page file comes from pages_from
            for name in groups[g]:
                shape = tuple(params[name].shape)
                key, sub = mx.random.split(key)  # split for every tensor: the tensors after a linked bank as drawn
                proxy = mx.zeros((1,) * len(shape))  # spec_for looks at the rank only
                role, s = job.spec_for(name, proxy)
                n_t += 1
                mod = name.rsplit(".", 1)[0]
                if base_index is not None and mod in bank_of:
                    if s is not None:
                        out_mod = job.out_name(mod + ".")[:-1]
                        if out_mod != mod:
                            job.qconfig[out_mod] = job.qconfig[mod]
                        n_q += 1
                    linked.add(bank_of[mod][0])
                    continue
                scale = None  # per-row factors of a router's weight (zipf routing)
                if (n_experts and role == ROUTER and name.endswith(".weight") and len(shape) == 2
                        and shape[0] == n_experts):
                    scale = mx.array(router_scales(config, exp, seed, g[0]).astype(np.float32))[:, None]
                if s is None:
                    a = plain_array(name, shape, sub)
                    if tied and g[0] == 1 << 30 and len(shape) == 1 and "norm" in name:
                        a = a * TIED_GAIN  # the final norm: logits back at unit scale
                    if scale is not None:
                        a = (a.astype(mx.float32) * scale).astype(a.dtype)
                    mx.eval(a)
                    if mod in bank_of:
                        bp, proj = bank_of[mod]
                        pending.setdefault(bp, {})[f"{proj}.{name.rsplit('.', 1)[1]}"] = (job.out_name(name), a)
                        continue
                    writer.add(job.out_name(name), a)
                    continue
                out_mod = job.out_name(mod + ".")[:-1]
                if out_mod != mod:
                    job.qconfig[out_mod] = job.qconfig[mod]
                std = shape[-1] ** -0.5 * (TIED_GAIN ** -1 if tied and role == EMBEDDINGS else 1.0)
                w, sc, b = quantized_arrays(shape, s.bits, s.group_size, sub, std=std)
                if scale is not None:
                    sc = (sc.astype(mx.float32) * scale).astype(sc.dtype)
                    b = (b.astype(mx.float32) * scale).astype(b.dtype)
                mx.eval(w, sc, b)
                n_q += 1
                for suffix, t in (("weight", w), ("scales", sc), ("biases", b)):
                    if mod in bank_of:
                        bp, proj = bank_of[mod]
                        pending.setdefault(bp, {})[f"{proj}.{suffix}"] = (f"{out_mod}.{suffix}", t)
                    else:
                        writer.add(f"{out_mod}.{suffix}", t)
                del w, sc, b
            for bp, parts in pending.items():  # this layer's banks: a page file, recorded as moved in its shard
                names = [f"{proj}.{part}" for proj in _PROJS for part in _PARTS if f"{proj}.{part}" in parts]
                tensors = [(n, _np_of(parts[n][1]), str(parts[n][1].dtype).split(".")[-1]) for n in names]
                fp = _fingerprint(bp, tensors)
                meta = write_page_file(tmp / PACK_DIR, bp, tensors, fp)
                index["layers"][bp] = meta
                pages_total += meta["page_bytes"] * meta["num_experts"]
                writer.moved[bp] = {"fingerprint": fp, "tensors": {
                    parts[n][0]: {"shape": [int(x) for x in parts[n][1].shape], "dtype": _ST_DTYPE[dt]}
                    for n, _, dt in tensors}}
                writer.total += sum(a.nbytes for _, a, _ in tensors)
                del tensors
            pending.clear()
            for bp in sorted(linked):
                meta = base_index["layers"][bp]
                src_f, dst_f = pages_from / PACK_DIR / meta["file"], tmp / PACK_DIR / meta["file"]
                try:
                    os.link(src_f, dst_f)
                except OSError:  # another file system, or links not allowed
                    shutil.copy2(src_f, dst_f)
                index["layers"][bp] = meta
                pages_total += meta["page_bytes"] * meta["num_experts"]
                writer.moved[bp] = base_moved[bp]
                writer.total += sum(math.prod(t["shape"]) * _ST_BYTES[t["dtype"]]
                                    for t in base_moved[bp]["tensors"].values())
            writer.flush()
            if progress:
                progress("write", gi + 1, len(order))
        weight_map = writer.finish()
        if packed:
            with open(tmp / PACK_DIR / INDEX, "w") as f:  # written last, as rq pack does
                f.write(json.dumps(index))
                f.flush()
                os.fsync(f.fileno())
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
        if route != "uniform":  # (a uniform write's files are what they were before the option)
            summary["routing"] = f"{route}:{exp:g}"
        if packed:
            summary["packed"] = True
            summary["page_bytes"] = pages_total
        (tmp / MARK).write_text(json.dumps({**summary, "config": config}))
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    summary["seconds"] = time.perf_counter() - t0
    return summary


def _mark_matches(m: dict, config: dict, recipe_name: str, seed: int, routing: str, packed: bool) -> bool:
    route, exp = parse_routing(routing)
    want = f"{route}:{exp:g}" if route != "uniform" else None
    same_recipe = m.get("recipe") == recipe_name or m.get("recipe") == recipe_mod.load(recipe_name).name
    return (m.get("config") == config and same_recipe and m.get("seed") == seed
            and m.get("routing") == want and bool(m.get("packed")) == bool(packed))


def same_pages(ckpt: Path, config: dict, recipe_name: str, seed: int) -> bool:
    """Whether CKPT is a complete packed checkpoint written here with this config, recipe and seed (of any routing):
    its expert pages are those a packed write of them draws (write's `pages_from`)."""
    from rq_core.paging.pages import INDEX, PACK_DIR

    try:
        m = json.loads((Path(ckpt) / MARK).read_text())
    except (OSError, ValueError):
        return False
    return (isinstance(m, dict) and (Path(ckpt) / PACK_DIR / INDEX).is_file()
            and _mark_matches(m, config, recipe_name, seed, m.get("routing") or "uniform", True))


def ensure(config: dict, recipe_name: str, out: str | Path, *, seed: int = 0,
           progress: Optional[Callable[[str, int, int], None]] = None, routing: str = "uniform",
           packed: bool = False, pages_from: Optional[Path] = None) -> tuple[Path, bool]:
    """`out` holding this checkpoint: reused when an earlier write with the same config, recipe, seed, routing and
    layout made it, else written (`pages_from`: see write). (path, reused)."""
    out = Path(out)
    mark = out / MARK
    if mark.is_file():
        try:
            m = json.loads(mark.read_text())
        except ValueError:
            m = {}
        if _mark_matches(m, config, recipe_name, seed, routing, packed) and (out / "config.json").is_file() \
                and (not packed or (out / "experts" / "index.json").is_file()):
            return out, True
    write(config, recipe_name, out, seed=seed, progress=progress, routing=routing, packed=packed, pages_from=pages_from)
    return out, False


def expert_selections(model, ids: list[int], chunk: int = 128) -> dict[str, np.ndarray]:
    """Bank path -> how many times each expert was selected while `model` ran the prompt `ids` (a forward pass, in
    chunks, through fresh caches): the routing a checkpoint's routers produce, read at the expert banks' inputs."""
    from rq_core.paging.pages import expert_banks

    banks = expert_banks(model)
    counts = {p: np.zeros(int(next(iter(m.up_proj.parameters().values())).shape[0]), np.int64)
              for p, m in banks.items()}
    cls = {}
    for p, m in banks.items():
        base = type(m)

        def __call__(self, x, indices, _p=p, _base=base):  # noqa: N807
            counts[_p] += np.bincount(np.array(indices.astype(mx.int32)).reshape(-1), minlength=len(counts[_p]))
            return _base.__call__(self, x, indices)

        cls[p] = base
        m.__class__ = type(base.__name__, (base,), {"__call__": __call__})
    try:
        cache = model.make_cache()
        x = mx.array(ids, dtype=mx.int32)[None]
        with layers_as_written(model):  # the hook reads the routing: a one-token chunk must not run traced
            for i in range(0, len(ids), chunk):
                mx.eval(model(x[:, i:i + chunk], cache=cache))
    finally:
        for p, m in banks.items():
            m.__class__ = cls[p]
    return counts


def top_share(counts: np.ndarray, frac: float = 0.1) -> float:
    """The share of all selections that went to the most selected `frac` of the experts (uniform: about frac)."""
    c = np.sort(np.asarray(counts))[::-1]
    return float(c[:max(1, int(round(frac * len(c))))].sum() / max(1, c.sum()))


def default_recipe(config: dict) -> str:
    mt = config.get("model_type")
    return {"qwen3_moe": "qwen3-16gb", "gemma4": "gemma4-16gb", "gemma4_text": "gemma4-16gb",
            "nemotron_h": "nemotron-32gb"}.get(mt, "qwen3-16gb")
