"""Role-aware streaming quantization: `rq quantize MODEL --recipe R -o OUT`.

Tensors are read lazily (mx.load), one layer at a time; each is sanitized by the family's model,
quantized by its role's spec (mx.quantize affine RTN, or GPTQ for linear roles with calibration
text), evaluated, and appended to the current shard; shards are written as they fill. Peak memory
stays near one layer's worth. Everything is written into a temporary directory `.OUT.tmp-PID` that is
renamed onto OUT at the end only if OUT does not exist by then (see `publish_dir`), so an interrupted run
leaves nothing that loads and a folder that appears at OUT meanwhile is never replaced. The temp folder
of a killed run is removed by the next run into the same OUT.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import math
import os
import sys
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_map

from rq_core.errors import RQError
from rq_core.models.base import layers_as_written
from rq_core.quant.recipe import Recipe, RoleSpec, check_against
from rq_core.quant.roles import NEVER, ROLES, role_of
from rq_core.textio import dumps_strict, read_utf8

Progress = Callable[[str, int, int], None]  # (stage, done, total)
CALIB_DEFAULT = Path(__file__).resolve().parents[1] / "assets" / "calibration.txt"
_LAYER_KEY = re.compile(r"^(.*?layers)\.(\d+)\.")
# Our parameter names -> the names mlx-lm uses for the same tensor (so the output loads there too;
# our models' sanitize maps them back).
_MLX_LM_NAMES = {"nemotron_h": ((".switch_mlp.up_proj.", ".switch_mlp.fc1."),
                                (".switch_mlp.down_proj.", ".switch_mlp.fc2."))}
_COPY_SUFFIXES = (".json", ".jinja", ".model", ".txt", ".tiktoken", ".py")
_SKIP_FILES = {"config.json", "model.safetensors.index.json", "recipe.toml"}


@dataclass
class QuantizeResult:
    out: str
    tensors: int = 0
    quantized: int = 0
    shards: int = 0
    bytes_in: int = 0  # bytes of the source tensors
    bytes_out: int = 0  # bytes written (all shards)
    role_bytes: dict[str, int] = field(default_factory=dict)
    kurtosis: dict[str, float] = field(default_factory=dict)  # --analyze: role -> mean excess kurtosis
    promoted: list[str] = field(default_factory=list)
    gptq_layers: int = 0
    peak_memory_bytes: int = 0  # MLX peak while quantizing, less what the caller already held

    def as_dict(self) -> dict:
        from dataclasses import asdict

        return asdict(self)


# ------------------------------------------------------------------------------------------ helpers
def _group_key(name: str) -> tuple[str, int]:
    m = _LAYER_KEY.match(name)
    return (m.group(1), int(m.group(2))) if m else ("", -1)


def model_skeleton(config: dict) -> nn.Module:
    """The family's model with lazy (never evaluated) random parameters: names, shapes, modules."""
    from rq_core.models import get_model_module

    module = get_model_module(config.get("model_type"))
    return module.Model(module.ModelArgs.from_dict(config))


def quantizable_modules(model: nn.Module) -> set[str]:
    return {p for p, m in model.named_modules() if p and hasattr(m, "to_quantized")}


def _bytes(a: mx.array) -> int:
    return a.size * a.itemsize


def _kurtosis_lazy(x: mx.array) -> mx.array:
    x = x.astype(mx.float32).reshape(-1)
    d = x - mx.mean(x)
    var = mx.mean(d * d)
    return mx.mean(d ** 4) / (var * var + 1e-30) - 3.0


def kurtosis(x: mx.array) -> float:
    """Excess kurtosis of all values of x (0 for a Gaussian)."""
    return float(_kurtosis_lazy(x).item())


def pack_codes(codes: np.ndarray, bits: int) -> np.ndarray:
    """Integer codes [..., n] -> mx.quantize's uint32 words: a little-endian bit stream per row."""
    *lead, n = codes.shape
    b = ((codes[..., None].astype(np.uint32) >> np.arange(bits, dtype=np.uint32)) & 1).astype(np.uint8)
    packed = np.packbits(b.reshape(*lead, n * bits), axis=-1, bitorder="little")
    return packed.view(np.uint32).reshape(*lead, n * bits // 32)


def gptq_quantize(w: mx.array, H: np.ndarray, *, bits: int, group_size: int, damp: float = 0.01,
                  block: int = 128) -> tuple[mx.array, mx.array, mx.array]:
    """GPTQ (Frantar et al. 2022) with mx.quantize's affine group format: returns (weight, scales, biases)
    such that mx.dequantize gives the GPTQ weights. H = Σ x xᵀ over calibration inputs [in, in]."""
    dtype = w.dtype
    W = np.array(w.astype(mx.float32), dtype=np.float64)
    out_f, in_f = W.shape
    H = H.astype(np.float64).copy()
    dead = np.diag(H) == 0
    H[dead, dead] = 1.0
    W[:, dead] = 0.0
    H[np.diag_indices(in_f)] += damp * np.mean(np.diag(H))
    try:
        U = np.linalg.cholesky(np.linalg.inv(H)).T  # upper Cholesky factor of H^-1
    except np.linalg.LinAlgError:
        H[np.diag_indices(in_f)] += np.mean(np.diag(H))
        U = np.linalg.cholesky(np.linalg.inv(H)).T
    maxq = 2 ** bits - 1
    codes = np.zeros((out_f, in_f), np.uint32)
    n_groups = in_f // group_size
    scales = np.zeros((out_f, n_groups), np.float64)
    biases = np.zeros((out_f, n_groups), np.float64)
    s_mx: list[mx.array] = []
    b_mx: list[mx.array] = []
    block = max(group_size, block - block % group_size)
    for i1 in range(0, in_f, block):
        i2 = min(i1 + block, in_f)
        W1 = W[:, i1:i2].copy()
        E1 = np.zeros_like(W1)
        U1 = U[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = i1 + i
            if col % group_size == 0:  # group parameters from the (error-updated) weights, as mx.quantize would
                g = mx.array(W1[:, i:i + group_size].astype(np.float32)).astype(dtype)
                _, s, b = mx.quantize(g, group_size=group_size, bits=bits)
                s_mx.append(s)
                b_mx.append(b)
                gi = col // group_size
                scales[:, gi] = np.array(s.astype(mx.float32))[:, 0]
                biases[:, gi] = np.array(b.astype(mx.float32))[:, 0]
            gi = col // group_size
            s, b = scales[:, gi], biases[:, gi]
            q = np.clip(np.round((W1[:, i] - b) / np.where(s == 0, 1, s)), 0, maxq)
            wq = q * s + b
            codes[:, col] = q
            err = (W1[:, i] - wq) / U1[i, i]
            W1[:, i:] -= np.outer(err, U1[i, i:])
            E1[:, i] = err
        W[:, i2:] -= E1 @ U[i1:i2, i2:]
    return (mx.array(pack_codes(codes, bits)), mx.concatenate(s_mx, axis=1), mx.concatenate(b_mx, axis=1))


def calibration_tokens(tokenizer: Any, text_path: Optional[str], n_tokens: int, seq_len: int) -> mx.array:
    """[batch, seq_len] token ids from the calibration text (bundled default or a file)."""
    p = CALIB_DEFAULT if text_path in (None, "", "default") else Path(text_path)
    if not p.is_file():
        raise RQError(f"calibration text not found: {p}")
    ids = tokenizer.encode(read_utf8(p, f"calibration text {p}"))
    seq_len = max(8, min(seq_len, len(ids)))
    n = max(1, min(n_tokens, len(ids)) // seq_len)
    if len(ids) < seq_len:
        raise RQError(f"calibration text {p} is too short ({len(ids)} tokens)")
    return mx.array(np.array(ids[: n * seq_len], dtype=np.int32).reshape(n, seq_len))


# ------------------------------------------------------------------------------------ shard writer
class _ShardWriter:
    def __init__(self, tmp: Path, shard_bytes: int) -> None:
        self.tmp, self.shard_bytes = tmp, shard_bytes
        self.cur: dict[str, mx.array] = {}
        self.cur_bytes = 0
        self.files: list[tuple[Path, list[str]]] = []
        self.total = 0

    def add(self, name: str, a: mx.array) -> None:
        self.cur[name] = a
        self.cur_bytes += _bytes(a)
        self.total += _bytes(a)
        if self.cur_bytes >= self.shard_bytes:
            self.flush()

    def flush(self) -> None:
        if not self.cur:
            return
        f = self.tmp / f"part-{len(self.files):05d}.safetensors"
        # Through a Python file: given a path, mx.save_safetensors ignores write errors (a full disk
        # leaves a truncated shard without a word); a file object's write raises OSError(ENOSPC).
        with open(f, "wb") as fh:
            mx.save_safetensors(fh, self.cur, metadata={"format": "mlx"})
            fh.flush()
            os.fsync(fh.fileno())
        self.files.append((f, list(self.cur)))
        self.cur, self.cur_bytes = {}, 0
        mx.clear_cache()

    def finish(self) -> dict[str, str]:
        self.flush()
        n = len(self.files)
        weight_map: dict[str, str] = {}
        for i, (f, names) in enumerate(self.files):
            final = "model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.replace(f, self.tmp / final)
            for k in names:
                weight_map[k] = final
        return weight_map


# ------------------------------------------------------------------------------------------ the job
class _Job:
    def __init__(self, src: Path, config: dict, recipe: Recipe, progress: Optional[Progress]) -> None:
        from rq_core.checkpoint import load_weights, weight_files

        self.src, self.config, self.recipe = src, config, recipe
        if config.get("quantization") or config.get("quantization_config"):
            raise RQError(f"{src} is already quantized (its config.json has a quantization section); "
                          "quantize from the full-precision checkpoint")
        self.progress = progress or (lambda *a: None)
        # name -> file. Arrays are re-opened lazily per group (an evaluated array would keep its data
        # alive as long as anything references it).
        load_weights(src)  # validates the files
        self.files: dict[str, str] = {}
        for f in weight_files(src):
            for k in mx.load(str(f)):
                self.files[k] = str(f)
        self.raw = self.files
        self.model = model_skeleton(config)
        self.qmods = quantizable_modules(self.model)
        groups: dict[tuple[str, int], list[str]] = {}
        for k in self.raw:
            groups.setdefault(_group_key(k), []).append(k)
        self.groups = dict(sorted(groups.items(), key=lambda kv: (kv[0][1], kv[0][0])))
        self.specs: dict[str, RoleSpec] = dict(recipe.roles)
        self.qconfig: dict[str, Any] = {}
        self.res = QuantizeResult(out="")
        self.layer_paths = self._layer_paths()

    def _layer_paths(self) -> list[str]:
        ids = {id(m): p for p, m in self.model.named_modules()}
        return [ids[id(l)] for l in self.model.layers]

    def sanitized(self, key: tuple[str, int]) -> dict[str, mx.array]:
        part: dict[str, mx.array] = {}
        for f in sorted({self.files[k] for k in self.groups[key]}):
            loaded = mx.load(f)
            part.update({k: loaded[k] for k in self.groups[key] if self.files[k] == f})
            del loaded
        return self.model.sanitize(part)

    def validate(self) -> None:
        from rq_core.paging.planner import quantizable

        dims: dict[str, list] = {}
        for k, v in tree_flatten(self.model.parameters()):
            role = role_of(k, self.config)
            if quantizable(k, tuple(v.shape), role) and k.rsplit(".", 1)[0] in self.qmods:
                dims.setdefault(role, []).append((k, tuple(v.shape)))
        check_against(self.recipe, self.config, dims)

    def out_name(self, name: str) -> str:
        for a, b in _MLX_LM_NAMES.get(self.config.get("model_type"), ()):
            name = name.replace(a, b)
        return name

    def spec_for(self, name: str, a: mx.array) -> tuple[str, Optional[RoleSpec]]:
        """(role, spec) — spec None: store as is."""
        role = role_of(name, self.config)
        mod = name.rsplit(".", 1)[0]
        if role == NEVER or not name.endswith(".weight") or mod not in self.qmods or a.ndim not in (2, 3):
            return role, None
        spec = self.specs[role]
        self.qconfig[mod] = spec.as_quant()
        return role, (spec if spec.bits is not None else None)

    def emit(self, writer: _ShardWriter, name: str, a: mx.array,
             gptq_H: Optional[dict[str, np.ndarray]] = None) -> None:
        role, spec = self.spec_for(name, a)
        self.res.tensors += 1
        self.res.bytes_in += _bytes(a)
        if spec is None:
            mx.eval(a)
            writer.add(self.out_name(name), a)
            self.res.role_bytes[role] = self.res.role_bytes.get(role, 0) + _bytes(a)
            return
        mod = name.rsplit(".", 1)[0]
        out_mod = self.out_name(mod + ".")[:-1]
        if out_mod != mod:
            self.qconfig[out_mod] = self.qconfig[mod]
        if spec.method == "gptq" and gptq_H is not None and mod in gptq_H and a.ndim == 2:
            q, s, b = gptq_quantize(a, gptq_H[mod], bits=spec.bits, group_size=spec.group_size,
                                    damp=self.recipe.calibration.damp)
        else:
            q, s, b = mx.quantize(a, group_size=spec.group_size, bits=spec.bits)
        mx.eval(q, s, b)
        self.res.quantized += 1
        for suffix, t in (("weight", q), ("scales", s), ("biases", b)):
            writer.add(f"{out_mod}.{suffix}", t)
            self.res.role_bytes[role] = self.res.role_bytes.get(role, 0) + _bytes(t)


def _f32(a: mx.array) -> mx.array:
    # On CPU the calibration forward runs in float32 (MLX's CPU gather_mm supports only float32);
    # on a GPU the stored dtype is kept (half the memory for a layer's experts).
    if mx.default_device() == mx.cpu and mx.issubdtype(a.dtype, mx.floating):
        return a.astype(mx.float32)
    return a


class _StopForward(Exception):
    pass


def _hook_inputs(module: nn.Module, record: Callable[[mx.array], None]) -> type:
    """Swap `module`'s class for a subclass whose __call__ records its first input; returns the old class."""
    old = type(module)

    def __call__(self, x, *a, **kw):  # noqa: N807
        record(x)
        return old.__call__(self, x, *a, **kw)

    module.__class__ = type(f"Recording{old.__name__}", (old,), {"__call__": __call__})
    return old


def _calibrated_pass(job: _Job, tokens: mx.array, *, on_layer: Callable[[int, str, dict, dict], None],
                     stats: str) -> None:
    """Run the model on calibration tokens one layer at a time (weights loaded per layer, then dropped).
    For each layer, record per-module inputs (`stats`: 'kurtosis' and/or 'hessian') and call
    on_layer(i, layer_path, sanitized_layer_weights, recorded)."""
    model = job.model
    layer_keys = {}
    for key in job.groups:
        if key[1] >= 0:
            layer_keys.setdefault(key[1], []).append(key)
    head: dict[str, mx.array] = {}
    for key in job.groups:
        if key[1] < 0:
            head.update(job.sanitized(key))
    model.load_weights([(k, _f32(v)) for k, v in head.items()], strict=False)
    n_layers = len(job.layer_paths)
    want_h = "hessian" in stats
    gptq_roles = {r for r, s in job.specs.items() if s.method == "gptq" and s.bits is not None}

    for i, layer in enumerate(model.layers):
        path = job.layer_paths[i]
        old_cls = type(layer)

        def call(self, *a, _i=i, _path=path, _old=old_cls, **kw):
            w: dict[str, mx.array] = {}
            for key in layer_keys.get(_i, []):
                w.update(job.sanitized(key))
            own = {k[len(_path) + 1:]: v for k, v in w.items() if k.startswith(_path + ".")}
            self.load_weights([(k, _f32(v)) for k, v in own.items()], strict=False)
            recorded: dict[str, dict] = {}
            restore = []
            for sub, m in self.named_modules():
                if not sub or not hasattr(m, "to_quantized"):
                    continue
                full = f"{_path}.{sub}"
                role = role_of(full + ".weight", job.config)
                if role == NEVER:
                    continue
                entry = recorded.setdefault(full, {"role": role, "k": [], "H": None, "n": 0})
                hess = want_h and role in gptq_roles and isinstance(m, nn.Linear)

                def rec(x, _e=entry, _h=hess):
                    if "kurtosis" in stats:
                        _e["k"].append(_kurtosis_lazy(x))
                    if _h:
                        x2 = x.reshape(-1, x.shape[-1]).astype(mx.float32)
                        h = x2.T @ x2
                        _e["H"] = h if _e["H"] is None else _e["H"] + h
                        _e["n"] += x2.shape[0]

                restore.append((m, _hook_inputs(m, rec)))
            out = _old.__call__(self, *a, **kw)
            mx.eval(out, [e["H"] for e in recorded.values() if e["H"] is not None],
                    [e["k"] for e in recorded.values()])
            for m, cls in restore:
                m.__class__ = cls
            on_layer(_i, _path, w, recorded)
            # drop this layer's weights: lazy zeros are never evaluated, so they cost nothing
            self.update(tree_map(lambda p: mx.zeros(p.shape, p.dtype), self.parameters()))
            mx.clear_cache()
            if _i == n_layers - 1:
                raise _StopForward
            return out

        layer.__class__ = type(f"Streamed{old_cls.__name__}", (old_cls,), {"__call__": call})
    try:
        with layers_as_written(model):  # each layer's weights are loaded as it runs: never a traced graph
            model(tokens)
    except _StopForward:
        pass
    finally:
        for layer in model.layers:
            layer.__class__ = layer.__class__.__mro__[1]


# ------------------------------------------------------------------------------------------ public
def analyze(model_path: str | os.PathLike, recipe: Recipe, *, calib: Optional[str] = None,
            progress: Optional[Progress] = None) -> dict[str, Any]:
    """Per-role activation kurtosis (excess, mean over the role's modules) on the calibration text."""
    from rq_core.checkpoint import load_config, resolve_model_path

    src = resolve_model_path(model_path)
    job = _Job(src, load_config(src), recipe, progress)
    return _analyze(job, calib)


def _analyze(job: _Job, calib: Optional[str]) -> dict[str, Any]:
    tokens = calibration_tokens(_tokenizer(job.src), calib or job.recipe.calibration.text,
                                job.recipe.calibration.tokens, job.recipe.calibration.seq_len)
    per_role: dict[str, list[float]] = {}
    per_module: dict[str, float] = {}
    n = len(job.layer_paths)

    def on_layer(i, path, w, recorded):
        for mod, e in recorded.items():
            if e["k"]:
                k = float(np.mean([float(v.item()) for v in e["k"]]))
                per_module[mod] = k
                per_role.setdefault(e["role"], []).append(k)
        job.progress("analyze", i + 1, n)

    _calibrated_pass(job, tokens, on_layer=on_layer, stats="kurtosis")
    roles = {r: float(np.mean(v)) for r, v in per_role.items()}
    return {"kurtosis": roles, "modules": per_module, "calibration_tokens": int(tokens.size)}


def _tokenizer(src: Path) -> Any:
    from rq_core.tokenizer import load_tokenizer

    tok = load_tokenizer(src)
    if tok is None:
        raise RQError(f"{src} has no tokenizer: calibration (gptq, --analyze, promotion) needs one")
    return tok


def quantize(model_path: str | os.PathLike, recipe: Recipe, out: str | os.PathLike, *,
             calib: Optional[str] = None, analyze_roles: bool = False, shard_bytes: int = 2 * 10**9,
             progress: Optional[Progress] = None) -> QuantizeResult:
    """Quantize MODEL (directory or hub id) by `recipe` into the directory `out` (atomically; an
    existing non-empty `out` is an error, never replaced)."""
    from rq_core.checkpoint import load_config, resolve_model_path

    src = resolve_model_path(model_path)
    config = load_config(src)
    out = Path(out)
    out_was_empty_dir = _check_out(out, src)
    job = _Job(src, config, recipe, progress)
    job.validate()
    mx.reset_peak_memory()
    held = mx.get_active_memory()  # the caller's arrays, not this job's

    need_calib = analyze_roles or recipe.promote.kurtosis_threshold is not None
    if need_calib:
        a = _analyze(job, calib)
        job.res.kurtosis = a["kurtosis"]
        thr = recipe.promote.kurtosis_threshold
        if thr is not None:
            for role, k in a["kurtosis"].items():
                spec = job.specs[role]
                if k > thr and spec.bits is not None and spec.bits < recipe.promote.bits:
                    job.specs[role] = RoleSpec(recipe.promote.bits, recipe.promote.group_size, spec.method)
                    job.res.promoted.append(role)
            job.validate()  # promoted group sizes must divide the dimensions too
        job.model = model_skeleton(config)  # fresh lazy parameters after the analysis pass
        job.layer_paths = job._layer_paths()

    with _staged(out, out_was_empty_dir, "the quantized model", "quantizing") as tmp:
        writer = _ShardWriter(tmp, shard_bytes)
        total = len(job.groups)
        done = 0
        if recipe.calibrated:
            tokens = calibration_tokens(_tokenizer(src), calib or recipe.calibration.text,
                                        recipe.calibration.tokens, recipe.calibration.seq_len)
            emitted: set[tuple[str, int]] = set()

            def on_layer(i, path, w, recorded):
                nonlocal done
                H = {m: np.array(e["H"]) for m, e in recorded.items() if e["H"] is not None}
                for name, a in w.items():
                    job.emit(writer, name, a, H)
                job.res.gptq_layers += 1
                done += 1
                job.progress("quantize", done, total)

            _calibrated_pass(job, tokens, on_layer=on_layer, stats="hessian")
            n_layers = len(job.layer_paths)
            for key in job.groups:  # the rest: embeddings, final norm, head (layers were done above)
                if 0 <= key[1] < n_layers:
                    continue
                for name, a in job.sanitized(key).items():
                    job.emit(writer, name, a)
                done += 1
                job.progress("quantize", done, total)
        else:
            for key in job.groups:
                for name, a in job.sanitized(key).items():
                    job.emit(writer, name, a)
                mx.clear_cache()
                done += 1
                job.progress("quantize", done, total)
        weight_map = writer.finish()
        job.res.shards = len(set(weight_map.values()))
        job.res.bytes_out = writer.total
        _write_metadata(tmp, src, config, job, weight_map)
    job.res.out = str(out)
    job.res.peak_memory_bytes = int(mx.get_peak_memory() - held)
    return job.res


# ------------------------------------------------------------------------------------ dequantizing
@dataclass
class DequantizeResult:
    out: str
    tensors: int = 0  # tensors written
    dequantized: int = 0  # of them, weights brought back from codes, scales and biases
    bytes_in: int = 0
    bytes_out: int = 0

    def as_dict(self) -> dict:
        from dataclasses import asdict

        return asdict(self)


def dequantize(model_path: str | os.PathLike, out: str | os.PathLike, *, shard_bytes: int = 2 * 10**9,
               progress: Optional[Progress] = None) -> DequantizeResult:
    """A full-precision copy of a quantized checkpoint in the directory `out` (written as `quantize` writes): each
    quantized weight (mlx-lm's affine convention: packed codes, scales and biases, with config.json's bits and group
    size for its path) back to floats in its scales' dtype, the other tensors as stored, config.json without its
    quantization section, the tokenizer and small files copied, and no recipe.toml. The copy holds exactly what the
    quantized weights hold, no more: a source for `rq quantize` where the original float weights are not at hand."""
    from rq_core.checkpoint import load_config, load_weights, resolve_model_path

    src = resolve_model_path(model_path)
    config = load_config(src)
    q = config.get("quantization") or config.get("quantization_config")
    if not isinstance(q, dict):
        raise RQError(f"{src} is not quantized (its config.json has no quantization section); it is its own "
                      "full-precision copy")
    if q.get("mode", "affine") != "affine":
        raise RQError(f"{src}: quantization mode {q.get('mode')!r} cannot be dequantized here (affine only)")
    out = Path(out)
    out_was_empty_dir = _check_out(out, src)
    w = load_weights(src)
    if getattr(w, "moved", None):
        raise RQError(f"{src}: its experts were moved into expert pages (`rq pack --move`); dequantize a "
                      "checkpoint that holds them")
    res = DequantizeResult(out="")
    names = sorted(k for k in w if not (k.endswith((".scales", ".biases")) and k.rsplit(".", 1)[0] + ".scales" in w))
    with _staged(out, out_was_empty_dir, "the float copy", "dequantizing") as tmp:
        writer = _ShardWriter(tmp, shard_bytes)
        for i, k in enumerate(names):
            a, base = w[k], k.rsplit(".", 1)[0]
            res.bytes_in += _bytes(a)
            if k.endswith(".weight") and base + ".scales" in w:
                a = _dequantized(src, base, a, w[base + ".scales"], w.get(base + ".biases"), q)
                res.bytes_in += _bytes(w[base + ".scales"]) + (_bytes(w[base + ".biases"]) if base + ".biases" in w
                                                               else 0)
                res.dequantized += 1
            writer.add(k, a)
            res.tensors += 1
            if progress:
                progress("dequantize", i + 1, len(names))
        weight_map = writer.finish()
        res.bytes_out = writer.total
        cfg = {k: v for k, v in config.items() if k not in ("quantization", "quantization_config")}
        (tmp / "config.json").write_text(dumps_strict(cfg, indent=2))
        if len(set(weight_map.values())) > 1:
            total = sum(os.path.getsize(tmp / f) for f in set(weight_map.values()))
            (tmp / "model.safetensors.index.json").write_text(dumps_strict(
                {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, indent=2))
        _copy_side_files(src, tmp)
    res.out = str(out)
    return res


def _dequantized(src: Path, path: str, codes: mx.array, scales: mx.array, biases: Optional[mx.array],
                 q: dict) -> mx.array:
    """One weight from its codes, scales and biases (bits and group size: config.json's entry for its path, else
    the checkpoint's)."""
    spec = q.get(path)
    spec = spec if isinstance(spec, dict) else q
    bits, gs = spec.get("bits"), spec.get("group_size")
    if biases is None:
        raise RQError(f"{src}: {path} has scales but no biases (affine quantization stores both)")
    try:
        return mx.dequantize(codes, scales, biases, group_size=gs, bits=bits).astype(scales.dtype)
    except (ValueError, TypeError) as e:
        raise RQError(f"{src}: cannot dequantize {path} at {bits} bits, group size {gs}: {e}") from None


# ------------------------------------------------------------------------------------ publishing
def _check_out(out: Path, src: Path) -> bool:
    """Refuse an output that is not new or empty, or is the source; True when it is an empty folder. Temp folders of
    killed runs into `out` are removed first."""
    remove_stale_tmp(out)
    if out.is_symlink() or (out.exists() and (not out.is_dir() or any(out.iterdir()))):
        raise RQError(f"output {out} exists and is not empty (choose another -o or remove it)")
    if out.resolve() == src.resolve():
        raise RQError("the output directory must differ from the model directory")
    return out.is_dir()


@contextlib.contextmanager
def _staged(out: Path, out_was_empty_dir: bool, what: str, doing: str) -> Iterator[Path]:
    """A marked temp folder `.OUT.tmp-PID` to write into, published as `out` when the block ends (only if nothing
    appeared at `out` meanwhile) and removed if anything fails; `what` names the output and `doing` the work in the
    error lines."""
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        if tmp.exists() and not _remove_if_ours(tmp):  # a killed run whose PID this process got again
            raise RQError(f"{tmp} is in the way and was not made by rq (move it)")
        tmp.mkdir()
    except OSError as e:  # the output's folder: read-only, not a folder, a pseudo file system
        raise RQError(f"cannot write {what} to {out}: {e.strerror or e}") from None
    try:
        (tmp / TMP_MARK).touch()
        yield tmp
        _fsync_dir(tmp)
        if out_was_empty_dir:
            try:  # the empty folder the user named; rmdir cannot remove one that got files meanwhile
                os.rmdir(out)
            except FileNotFoundError:
                pass
            except OSError:
                raise RQError(f"output {out} got files while {doing}; it was left as it is and {what} was not "
                              "written (choose another -o)") from None
        if not publish_dir(tmp, out):
            raise RQError(f"output {out} appeared while {doing}; it was left as it is and {what} was not "
                          "written (choose another -o)")
        (out / TMP_MARK).unlink(missing_ok=True)  # after the rename: a run killed before it leaves a marked, removable folder
        _fsync_dir(out.parent)
    except OSError as e:  # disk full, permission denied: one line, and nothing half-written stays
        shutil.rmtree(tmp, ignore_errors=True)
        where = f" ({e.filename})" if e.filename else ""
        raise RQError(f"writing {out} failed: {e.strerror or e}{where}; the partial output was removed") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


TMP_MARK = ".rq-quantize-partial"  # marks a temp folder as this tool's until it is published
_RENAME_NOREPLACE = 1  # linux/fs.h
_RENAME_EXCL = 0x4  # macOS sys/stdio.h, renamex_np


def _libc() -> Optional[ctypes.CDLL]:
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
    except OSError:  # pragma: no cover
        return None


def _rename_exclusive(src: Path, dst: Path) -> Optional[bool]:
    """Rename that fails if dst exists, via the kernel's own primitive: True done, False dst exists,
    None when this system or file system has no such call."""
    libc = _libc()
    a, b = os.fsencode(src), os.fsencode(dst)
    if sys.platform.startswith("linux") and libc is not None and hasattr(libc, "renameat2"):
        at_fdcwd = -100
        rc = libc.renameat2(at_fdcwd, a, at_fdcwd, b, ctypes.c_uint(_RENAME_NOREPLACE))
    elif sys.platform == "darwin" and libc is not None and hasattr(libc, "renamex_np"):
        rc = libc.renamex_np(a, b, ctypes.c_uint(_RENAME_EXCL))
    else:
        return None
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err == errno.EEXIST:
        return False
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, getattr(errno, "EOPNOTSUPP", errno.ENOTSUP)):
        return None
    raise OSError(err, os.strerror(err), str(dst))


def publish_dir(tmp: Path, out: Path) -> bool:
    """Move the finished directory `tmp` to `out` only if nothing is at `out`; False if something is.

    renameat2(RENAME_NOREPLACE) on Linux and renamex_np(RENAME_EXCL) on macOS check and rename in one
    step. Where neither exists, plain rename(2) of a directory is still safe: POSIX makes it fail on a
    non-empty directory (EEXIST/ENOTEMPTY) and on a file or symlink (ENOTDIR); at worst it replaces an
    empty directory, which holds nothing to lose."""
    done = _rename_exclusive(tmp, out)
    if done is not None:
        return done
    try:
        os.rename(tmp, out)
    except OSError as e:
        if e.errno in (errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR, errno.EISDIR):
            return False
        raise
    return True


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - some file systems do not open directories
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def remove_stale_tmp(out: str | os.PathLike) -> list[Path]:
    """Remove temp folders of earlier runs into `out` whose process is gone (a killed run): only folders
    named `.OUT.tmp-PID` that still carry TMP_MARK, or are empty (killed before the mark was written)."""
    out = Path(out)
    pat = re.compile(rf"^\.{re.escape(out.name)}\.tmp-(\d+)$")
    removed: list[Path] = []
    try:
        entries = list(out.parent.iterdir())
    except OSError:
        return removed
    for p in entries:
        m = pat.match(p.name)
        if not m:
            continue
        pid = int(m.group(1))
        if pid != os.getpid() and not _pid_alive(pid) and _remove_if_ours(p):
            removed.append(p)
    return removed


def _remove_if_ours(p: Path) -> bool:
    """Remove a temp folder if it carries TMP_MARK or is empty; anything else is not provably ours."""
    if p.is_symlink() or not p.is_dir():
        return False
    if (p / TMP_MARK).is_file():
        shutil.rmtree(p, ignore_errors=True)
        return not p.exists()
    try:
        os.rmdir(p)
    except OSError:
        return False
    return True


def _write_metadata(tmp: Path, src: Path, config: dict, job: _Job, weight_map: dict[str, str]) -> None:
    from rq_core.quant.recipe import Recipe as _R

    cfg = {k: v for k, v in config.items() if k not in ("quantization", "quantization_config")}
    first = next((s for s in job.specs.values() if s.bits is not None), RoleSpec(4, 64))
    q: dict[str, Any] = {"group_size": first.group_size, "bits": first.bits, "mode": "affine"}
    q.update(dict(sorted(job.qconfig.items())))
    cfg["quantization"] = q
    cfg["quantization_config"] = q
    try:
        text = dumps_strict(cfg, indent=2)
    except ValueError:
        raise RQError(f"{src / 'config.json'} has a NaN or infinite number; the output config would not be JSON") from None
    (tmp / "config.json").write_text(text)
    if len(set(weight_map.values())) > 1:
        total = sum(os.path.getsize(tmp / f) for f in set(weight_map.values()))
        (tmp / "model.safetensors.index.json").write_text(
            dumps_strict({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, indent=2))
    resolved = _R(**{**job.recipe.__dict__, "roles": dict(job.specs)})
    (tmp / "recipe.toml").write_text(resolved.dumps())
    _copy_side_files(src, tmp)


def _copy_side_files(src: Path, tmp: Path) -> None:
    """The tokenizer, chat template and other small files of the source (not its weights, config or recipe)."""
    for f in src.iterdir():
        if f.is_file() and f.name not in _SKIP_FILES and f.name.endswith(_COPY_SUFFIXES) \
                and not f.name.endswith(".safetensors"):
            shutil.copy2(f, tmp / f.name)
