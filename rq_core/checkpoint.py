"""Load Hugging Face checkpoints: config, sharded safetensors (lazily, in their stored dtype),
tokenizer + chat template, generation config. MODEL is a local directory or a hub id.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import mlx.core as mx
import mlx.nn as nn

from rq_core.errors import RQError
from rq_core.models import get_model_module, text_config
from rq_core.paging.pages import moved_placeholders, serve_moved_banks
from rq_core.shards import read_json, short, weight_files  # noqa: F401  (weight_files: also the loaders' API)

# The bundled small model (made by the default-model issue); used when MODEL is omitted.
DEFAULT_MODEL = Path(__file__).parent / "assets" / "default_model"

_HUB_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "tokenizer*", "*.model", "*.txt"]


def resolve_model_path(model: Optional[str | os.PathLike] = None) -> Path:
    """A local directory holding the checkpoint: MODEL itself, a hub snapshot, or the bundled default."""
    if model is None or str(model) == "":
        if not (DEFAULT_MODEL / "config.json").is_file():
            raise RQError(f"no MODEL given and the bundled default model is not installed ({DEFAULT_MODEL}); "
                          "pass a checkpoint directory or a Hugging Face hub id")
        return DEFAULT_MODEL
    p = Path(model).expanduser()
    if p.exists():
        if not p.is_dir():
            raise RQError(f"{p} is not a directory (MODEL is a checkpoint directory or a hub id)")
        return p
    s = str(model)
    if s.count("/") != 1 or s.startswith((".", "/", "~")) or s.endswith("/"):
        raise RQError(f"model {s!r} not found: no such directory, and not a hub id of the form owner/name")
    return _snapshot(s)


def _snapshot(repo_id: str) -> Path:
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.utils import (GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError,
                                           RepositoryNotFoundError)
    except ImportError as e:  # pragma: no cover - a declared dependency
        raise RQError(f"huggingface_hub is needed to fetch {repo_id!r}: {e}")
    offline = os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")
    try:
        return Path(snapshot_download(repo_id, allow_patterns=_HUB_PATTERNS, local_files_only=offline))
    except (LocalEntryNotFoundError, FileNotFoundError) as e:
        if offline:
            raise RQError(f"model {repo_id!r} is not in the local Hugging Face cache and HF_HUB_OFFLINE is set "
                          "(unset it to download, or pass a local directory)")
        raise RQError(f"could not download {repo_id!r} (no network?): {_first_line(e)}")
    except GatedRepoError:
        raise RQError(f"model {repo_id!r} is gated: accept its license on huggingface.co and log in "
                      "(`hf auth login`), or pass a local directory")
    except RepositoryNotFoundError:
        raise RQError(f"model {repo_id!r} not found: no such directory and no such Hugging Face repository")
    except (HfHubHTTPError, OSError, ValueError) as e:
        raise RQError(f"could not download {repo_id!r}: {_first_line(e)}")


def _first_line(e: BaseException) -> str:
    s = str(e).strip()
    return s.splitlines()[0] if s else type(e).__name__


def load_config(path: Path) -> dict:
    """config.json as a dict (PATH is a checkpoint directory or a config .json file); RQError when it is
    missing, not a JSON object, or of an unsupported model_type."""
    cfg = Path(path) if Path(path).is_file() and Path(path).suffix == ".json" else Path(path) / "config.json"
    if not cfg.is_file():
        raise RQError(f"{path} has no config.json (not a Hugging Face checkpoint directory)")
    config = read_json(cfg)
    get_model_module(config.get("model_type"))  # unknown model_type → one line naming the supported ones
    return config


def context_length(config: dict) -> Optional[int]:
    """The model's context (max_position_embeddings), if the config states it."""
    n = text_config(config).get("max_position_embeddings")
    if n is None:
        return None
    if not _is_int(n) or n < 1:
        raise RQError(f"config.json: max_position_embeddings must be a positive integer (got {short(n)})")
    return n


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


# safetensors dtype names mx.load reads, and their element sizes
_ST_DTYPES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "U16": 2, "I16": 2, "F16": 2, "BF16": 2, "U32": 4,
              "I32": 4, "F32": 4, "U64": 8, "I64": 8, "C64": 8}
_MAX_HEADER_BYTES = 100_000_000


def _unique_keys(pairs: list) -> dict:
    d = dict(pairs)
    if len(d) != len(pairs):
        raise ValueError("duplicate key")
    return d


def _check_safetensors(path: Path) -> None:
    """Validate the header (JSON object, dtype names, shapes, in-file non-overlapping offsets) and the file
    length without reading tensor data. Messages never quote the file's bytes: it may be any file."""
    size = path.stat().st_size
    bad = f"{path} is not a valid safetensors file"
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise RQError(f"{path} is truncated or not a safetensors file ({size} bytes)")
        (n,) = struct.unpack("<Q", raw)
        if n < 2 or n > _MAX_HEADER_BYTES or 8 + n > size:
            raise RQError(f"{path} is truncated or not a safetensors file (its header length is out of range)")
        text = f.read(n)
    try:
        header = json.loads(text.decode("utf-8"), object_pairs_hook=_unique_keys)
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise RQError(f"{bad} (its header is not a JSON object)")
    if not isinstance(header, dict):
        raise RQError(f"{bad} (its header is not a JSON object)")
    data_size = size - 8 - n
    spans = []
    for name, v in header.items():
        if name == "__metadata__":
            if v is not None and not isinstance(v, dict):  # some writers store null
                raise RQError(f"{bad} (__metadata__ is not an object)")
            continue
        what = f"{bad}: tensor {short(name)}"
        if not isinstance(v, dict) or set(v) - {"dtype", "shape", "data_offsets"}:
            raise RQError(f"{what} is not an object of dtype, shape and data_offsets")
        dtype, shape, offsets = v.get("dtype"), v.get("shape"), v.get("data_offsets")
        if not isinstance(dtype, str) or dtype not in _ST_DTYPES:
            raise RQError(f"{what} has dtype {short(dtype)} (readable: {', '.join(_ST_DTYPES)})")
        if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
            raise RQError(f"{what} has no valid shape (a list of sizes)")
        if (not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_int(o) for o in offsets)
                or not 0 <= offsets[0] <= offsets[1]):
            raise RQError(f"{what} has no valid data_offsets (begin and end byte)")
        numel = 1
        for d in shape:
            numel *= d
        if offsets[1] - offsets[0] != numel * _ST_DTYPES[dtype]:
            raise RQError(f"{what}: its data_offsets span {offsets[1] - offsets[0]} bytes, its shape and dtype "
                          f"need {numel * _ST_DTYPES[dtype]}")
        if offsets[1] > data_size:
            raise RQError(f"{path} is truncated: its header describes {8 + n + offsets[1]} bytes but the file "
                          f"has {size}")
        spans.append((offsets[0], offsets[1], name))
    spans.sort()
    for (_, end, a), (begin, _, b) in zip(spans, spans[1:]):
        if begin < end:
            raise RQError(f"{bad}: tensors {short(a)} and {short(b)} overlap")


def load_weights(path: Path) -> dict[str, mx.array]:
    """All tensors by name, loaded lazily by mx.load (nothing is read until used) in the stored dtype."""
    weights: dict[str, mx.array] = _Weights()
    for f in weight_files(path):
        _check_safetensors(f)
        try:
            weights.update(mx.load(str(f)))
        except Exception as e:  # mx.load raises plain exceptions for malformed files
            raise RQError(f"cannot read {f}: {_first_line(e)}")
    # banks `rq pack --move` left only in the pages: placeholders, filled by serve_moved_banks (build_model)
    weights.moved, weights.path = moved_placeholders(path, weights), Path(path)
    return weights


class _Weights(dict):
    """load_weights' tensors, and the banks that live only in the checkpoint's pages (`moved`)."""

    moved: dict = {}
    path: Optional[Path] = None


def _quant_predicate(qcfg: dict, weights: dict) -> Any:
    def predicate(p: str, m: nn.Module) -> Any:
        if not hasattr(m, "to_quantized"):
            return False
        if p in qcfg:  # per-path override: a dict of params, or false to keep it unquantized
            spec = qcfg[p]
            if spec is False:
                return False
            if isinstance(spec, dict):
                return {"group_size": spec.get("group_size", qcfg.get("group_size", 64)),
                        "bits": spec.get("bits", qcfg.get("bits", 4)),
                        "mode": spec.get("mode", qcfg.get("mode", "affine"))}
        return f"{p}.scales" in weights

    return predicate


_FLOATS = (mx.float16, mx.bfloat16, mx.float32)


def _dtype(d: mx.Dtype) -> str:
    return str(d).removeprefix("mlx.core.")


def _check_raw_dtypes(weights: dict[str, mx.array]) -> None:
    """Before sanitize (which stacks experts, so promotes dtypes): floats, or packed quantized codes and
    uint8 scales (mxfp/nvfp modes), and only a quantized layer's `weight` (it has `scales`) may be packed."""
    for k, v in weights.items():
        packed = k.endswith(".weight") and f"{k[:-len('weight')]}scales" in weights
        if v.dtype not in _FLOATS and not (packed and v.dtype == mx.uint32) and not (
                k.endswith(".scales") and v.dtype == mx.uint8):
            raise RQError(f"tensor {k} has dtype {_dtype(v.dtype)} (float16, bfloat16 or float32 expected"
                          f"{'; a quantized weight is uint32' if packed else ''})")


def _check_tensors(model: nn.Module, weights: dict[str, mx.array], model_type: str) -> None:
    """Each tensor has the shape and dtype kind of the parameter it loads into: a float parameter takes
    float16/bfloat16/float32, anything else (uint32 codes, uint8 scales) exactly its own dtype."""
    from mlx.utils import tree_flatten

    for k, p in tree_flatten(model.parameters()):
        w = weights.get(k)
        if w is None:
            continue  # load_weights(strict=True) names what is missing
        if w.shape != p.shape:
            raise RQError(f"checkpoint does not match its config ({model_type}): {k} has shape {tuple(w.shape)}, "
                          f"the config implies {tuple(p.shape)}")
        ok = w.dtype in _FLOATS if mx.issubdtype(p.dtype, mx.floating) else w.dtype == p.dtype
        if not ok:
            want = "float16, bfloat16 or float32" if mx.issubdtype(p.dtype, mx.floating) else _dtype(p.dtype)
            raise RQError(f"tensor {k} has dtype {_dtype(w.dtype)} ({want} expected)")


def _check_quantization(qcfg: Any) -> None:
    if qcfg is None:
        return
    if not isinstance(qcfg, dict):
        raise RQError("config.json: quantization should be an object (group_size, bits, mode, per-layer overrides)")
    for where, spec in [("", qcfg)] + [(f" of {k}", v) for k, v in qcfg.items() if isinstance(v, dict)]:
        for key in ("group_size", "bits"):
            if key in spec and (not _is_int(spec[key]) or spec[key] < 1):
                raise RQError(f"config.json: quantization {key}{where} must be a positive integer "
                              f"(got {short(spec[key])})")
        if "mode" in spec and not isinstance(spec["mode"], str):
            raise RQError(f"config.json: quantization mode{where} must be a string (got {short(spec['mode'])})")


def build_model(config: dict, weights: Optional[dict[str, mx.array]] = None) -> nn.Module:
    """Instantiate the family's Model for `config`; with `weights`, sanitize, quantize as stored and load them.
    Config values (ModelArgs.from_dict) and tensor dtypes and shapes are validated: RQError when bad."""
    model_type = config.get("model_type")
    module = get_model_module(model_type)
    try:
        model = module.Model(module.ModelArgs.from_dict(config))
    except RQError:
        raise
    except (TypeError, ValueError, KeyError, IndexError, ZeroDivisionError, AssertionError, AttributeError,
            OverflowError) as e:
        # A config.json the family cannot be built from (missing/contradictory fields) is bad input.
        raise RQError(f"config.json cannot be used for {model_type}: "
                      f"{type(e).__name__}: {_first_line(e)[:200]}")
    if weights is None:
        return model
    moved, src = getattr(weights, "moved", None), getattr(weights, "path", None)
    _check_raw_dtypes(weights)
    try:
        weights = model.sanitize(dict(weights))
    except (KeyError, ValueError, IndexError) as e:  # tensors the config promises are not in the files
        raise RQError(f"checkpoint does not match its config ({model_type}): "
                      f"{type(e).__name__}: {_first_line(e)[:200]}")
    qcfg = config.get("quantization") or config.get("quantization_config")
    _check_quantization(qcfg)
    if isinstance(qcfg, dict) and "bits" in qcfg and any(k.endswith(".scales") for k in weights):
        try:
            nn.quantize(model, group_size=qcfg.get("group_size", 64), bits=qcfg["bits"],
                        mode=qcfg.get("mode", "affine"), class_predicate=_quant_predicate(qcfg, weights))
        except (ValueError, TypeError) as e:  # bits / group size / mode MLX does not support
            raise RQError(f"config.json: quantization cannot be used: {_first_line(e)[:200]}")
    _check_tensors(model, weights, model_type)
    try:
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as e:
        raise RQError(f"checkpoint does not match its config ({model_type}): {_first_line(e)[:300]}")
    if moved:
        serve_moved_banks(model, src, moved)
    return model


def load_model(path_or_id: Optional[str | os.PathLike] = None) -> nn.Module:
    """The model of a checkpoint directory or hub id (weights lazy, stored dtype)."""
    return load(path_or_id, tokenizer=False).model


@dataclass
class Checkpoint:
    path: Path
    config: dict
    model: nn.Module
    tokenizer: Any = None  # rq_core.tokenizer.Tokenizer, or None when the checkpoint has none
    generation_config: dict = field(default_factory=dict)

    @property
    def model_type(self) -> str:
        return self.config["model_type"]

    @property
    def eos_token_ids(self) -> set[int]:
        ids = config_eos_token_ids(self.config, self.generation_config)
        if self.tokenizer is not None:
            ids.update(self.tokenizer.eos_token_ids)
        return ids


def config_eos_token_ids(config: dict, generation_config: dict) -> set[int]:
    """The eos_token_id of generation_config.json and config.json: a token id or a list of them."""
    ids: set[int] = set()
    for name, src in (("generation_config.json", generation_config), ("config.json", text_config(config))):
        e = src.get("eos_token_id")
        es = [] if e is None else e if isinstance(e, list) else [e]
        if not all(_is_int(t) and t >= 0 for t in es):
            raise RQError(f"{name}: eos_token_id must be a token id or a list of token ids (got {short(e)})")
        ids.update(es)
    return ids


# On the CPU, MLX's quantized matmuls run several times faster on float32 activations than on
# bf16/fp16 (measured 16.6 -> 94 tok/s decoding the bundled model; the 2-bit expert gather_qmm of Nemotron 3
# Super's shapes, one token x top-22: 0.80 against 0.08 GMAC/s), so models are upcast there when it costs little
# memory: upcasting doubles the floating-point arrays only (a quantized weight's codes stay uint32, its scales and
# biases double), so a model is upcast when those arrays hold at most CPU_FLOAT32_MAX_BYTES or at most
# CPU_FLOAT32_MAX_SHARE of its bytes (a quantized model of any size: ~10-20% at 2-8 bits; an unquantized model
# only when small). An expert pager casts pages to the model's dtype and plans its slots in it.
CPU_FLOAT32_MAX_BYTES = 4 << 30
CPU_FLOAT32_MAX_SHARE = 0.25


def cpu_float32_pays(model: Any) -> bool:
    """Whether upcasting `model` to float32 costs at most CPU_FLOAT32_MAX_BYTES, or CPU_FLOAT32_MAX_SHARE of its
    bytes, of added memory (its floating-point arrays, not already float32, doubled)."""
    from mlx.utils import tree_flatten

    total = added = 0
    for _, v in tree_flatten(model.parameters()):
        total += v.nbytes
        if mx.issubdtype(v.dtype, mx.floating) and v.dtype != mx.float32:
            added += v.nbytes * (4 // v.dtype.size - 1)
    return added <= max(CPU_FLOAT32_MAX_BYTES, CPU_FLOAT32_MAX_SHARE * total)


def load(path_or_id: Optional[str | os.PathLike] = None, *, tokenizer: bool = True,
         cpu_float32: bool = False) -> Checkpoint:
    """Everything `rq run` needs from a checkpoint. `cpu_float32`: on the CPU, compute in float32 where that costs
    little memory (cpu_float32_pays: small models, and quantized models of any size); others keep their stored
    dtype."""
    path = resolve_model_path(path_or_id)
    config = load_config(path)
    model = build_model(config, load_weights(path))
    if cpu_float32 and mx.default_device() == mx.cpu and cpu_float32_pays(model):
        model.set_dtype(mx.float32)
    gen = path / "generation_config.json"
    generation_config = read_json(gen) if gen.is_file() else {}
    config_eos_token_ids(config, generation_config)  # a malformed eos_token_id fails here, in one line
    tok = None
    if tokenizer:
        from rq_core.tokenizer import load_tokenizer

        tok = load_tokenizer(path)
    return Checkpoint(path=path, config=config, model=model, tokenizer=tok, generation_config=generation_config)
