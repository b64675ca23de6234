"""Model families by config.json `model_type`: `MODEL_TYPES[model_type]` → module (imported lazily)."""

from __future__ import annotations

import importlib
from types import ModuleType

from rq_core.errors import RQError

# model_type → module name under rq_core.models. Aliases share a module (the multimodal Gemma 4
# release says `gemma4` with a nested text_config; a text-only export says `gemma4_text`).
_MODULES = {
    "qwen3_moe": "qwen3_moe",
    "qwen2_moe": "qwen2_moe",
    "nemotron_h": "nemotron_h",
    "gemma4": "gemma4",
    "gemma4_text": "gemma4",
}


class _Registry(dict):
    """A dict model_type → module that imports each module on first access."""

    def __getitem__(self, model_type: str) -> ModuleType:
        if model_type not in _MODULES:
            raise RQError(f"unsupported model_type {model_type!r} (supported: {', '.join(_MODULES)})")
        return importlib.import_module(f"rq_core.models.{_MODULES[model_type]}")

    def __contains__(self, model_type: object) -> bool:
        return model_type in _MODULES

    def __iter__(self):
        return iter(_MODULES)

    def __len__(self) -> int:
        return len(_MODULES)

    def keys(self):
        return _MODULES.keys()

    def items(self):
        return [(k, self[k]) for k in _MODULES]

    def values(self):
        return [self[k] for k in _MODULES]

    def get(self, model_type, default=None):
        return self[model_type] if model_type in _MODULES else default


MODEL_TYPES = _Registry()


def text_config(config: dict) -> dict:
    """The language model's config. Multimodal releases nest it under `text_config`; its keys win over the
    outer ones, which still hold what concerns the whole checkpoint (tie_word_embeddings, eos_token_id)."""
    tc = config.get("text_config")
    return {**config, **tc} if isinstance(tc, dict) else config


def get_model_module(model_type: str | None) -> ModuleType:
    """The module for a model_type; RQError naming the supported ones when unknown."""
    if not model_type:
        raise RQError(f"config.json has no model_type (supported: {', '.join(_MODULES)})")
    return MODEL_TYPES[model_type]
