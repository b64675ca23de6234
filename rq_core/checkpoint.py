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
from rq_core.models import get_model_module

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


def _read_json(path: Path) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            obj = json.load(f)
    except json.JSONDecodeError as e:
        raise RQError(f"{path} is not valid JSON: {e}")
    if not isinstance(obj, dict):
        raise RQError(f"{path} should hold a JSON object")
    return obj


def load_config(path: Path) -> dict:
    """config.json as a dict (PATH is a checkpoint directory or a config .json file); RQError when it is
    missing, not a JSON object, or of an unsupported model_type."""
    cfg = Path(path) if Path(path).is_file() and Path(path).suffix == ".json" else Path(path) / "config.json"
    if not cfg.is_file():
        raise RQError(f"{path} has no config.json (not a Hugging Face checkpoint directory)")
    config = _read_json(cfg)
    get_model_module(config.get("model_type"))  # unknown model_type → one line naming the supported ones
    return config


def text_config(config: dict) -> dict:
    """The language model's part of a config (multimodal releases nest it under text_config)."""
    tc = config.get("text_config")
    return {**config, **tc} if isinstance(tc, dict) else config


def context_length(config: dict) -> Optional[int]:
    """The model's context (max_position_embeddings), if the config states it."""
    n = text_config(config).get("max_position_embeddings")
    return int(n) if n else None


def _check_safetensors(path: Path) -> None:
    """Validate the header and the file length without reading tensor data (catches truncation)."""
    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise RQError(f"{path} is truncated or not a safetensors file ({size} bytes)")
            (n,) = struct.unpack("<Q", raw)
            if n > 100_000_000 or 8 + n > size:
                raise RQError(f"{path} is truncated or not a safetensors file (header of {n} bytes, file {size})")
            header = json.loads(f.read(n))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise RQError(f"{path} is not a valid safetensors file (bad header)")
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    if 8 + n + end > size:
        raise RQError(f"{path} is truncated: its header describes {8 + n + end} bytes but the file has {size}")


def weight_files(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint (from the shard index when there is one)."""
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        wm = _read_json(index).get("weight_map", {})
        files = [path / f for f in sorted(set(wm.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise RQError(f"{path}: shard(s) named in model.safetensors.index.json are missing: {', '.join(missing[:3])}")
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise RQError(f"{path} has no *.safetensors weights")
    return files


def load_weights(path: Path) -> dict[str, mx.array]:
    """All tensors by name, loaded lazily by mx.load (nothing is read until used) in the stored dtype."""
    weights: dict[str, mx.array] = {}
    for f in weight_files(path):
        _check_safetensors(f)
        try:
            weights.update(mx.load(str(f)))
        except Exception as e:  # mx.load raises plain exceptions for malformed files
            raise RQError(f"cannot read {f}: {_first_line(e)}")
    return weights


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


def build_model(config: dict, weights: Optional[dict[str, mx.array]] = None) -> nn.Module:
    """Instantiate the family's Model for `config`; with `weights`, sanitize, quantize as stored and load them."""
    module = get_model_module(config.get("model_type"))
    try:
        model = module.Model(module.ModelArgs.from_dict(config))
    except RQError:
        raise
    except (TypeError, ValueError, KeyError, IndexError, ZeroDivisionError, AssertionError) as e:
        # A config.json the family cannot be built from (missing/contradictory fields) is bad input.
        raise RQError(f"config.json cannot be used for {config.get('model_type')}: "
                      f"{type(e).__name__}: {_first_line(e)[:200]}")
    if weights is None:
        return model
    try:
        weights = model.sanitize(dict(weights))
    except (KeyError, ValueError, IndexError) as e:  # tensors the config promises are not in the files
        raise RQError(f"checkpoint does not match its config ({config.get('model_type')}): "
                      f"{type(e).__name__}: {_first_line(e)[:200]}")
    qcfg = config.get("quantization") or config.get("quantization_config")
    if isinstance(qcfg, dict) and "bits" in qcfg and any(k.endswith(".scales") for k in weights):
        nn.quantize(model, group_size=qcfg.get("group_size", 64), bits=qcfg["bits"],
                    mode=qcfg.get("mode", "affine"), class_predicate=_quant_predicate(qcfg, weights))
    try:
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as e:
        raise RQError(f"checkpoint does not match its config ({config.get('model_type')}): {_first_line(e)[:300]}")
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
        ids: set[int] = set()
        for src in (self.generation_config, text_config(self.config)):
            e = src.get("eos_token_id")
            ids.update([e] if isinstance(e, int) else (e or []))
        if self.tokenizer is not None:
            ids.update(self.tokenizer.eos_token_ids)
        return ids


# On the CPU, MLX's quantized matmuls run several times faster on float32 activations than on
# bf16/fp16 (measured 16.6 -> 94 tok/s decoding the bundled model), so small models are upcast there.
CPU_FLOAT32_MAX_BYTES = 4 << 30


def load(path_or_id: Optional[str | os.PathLike] = None, *, tokenizer: bool = True,
         cpu_float32: bool = False) -> Checkpoint:
    """Everything `rq run` needs from a checkpoint. `cpu_float32`: on the CPU, compute in float32
    when the weights are at most CPU_FLOAT32_MAX_BYTES (big models keep their stored dtype)."""
    path = resolve_model_path(path_or_id)
    config = load_config(path)
    model = build_model(config, load_weights(path))
    if cpu_float32 and mx.default_device() == mx.cpu:
        from mlx.utils import tree_flatten

        if sum(v.nbytes for _, v in tree_flatten(model.parameters())) <= CPU_FLOAT32_MAX_BYTES:
            model.set_dtype(mx.float32)
    gen = path / "generation_config.json"
    generation_config = _read_json(gen) if gen.is_file() else {}
    tok = None
    if tokenizer:
        from rq_core.tokenizer import load_tokenizer

        tok = load_tokenizer(path)
    return Checkpoint(path=path, config=config, model=model, tokenizer=tok, generation_config=generation_config)
