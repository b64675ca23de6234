"""`rq calibrate-codebook`: Lloyd-Max levels for the KV cache, from a distribution or from real K/V samples."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Optional

import typer

from rq_cli.common import POSITIVE, SEED, handle_errors, print_json
from rq_core.errors import RQError


def _samples(path: Path, tensor: Optional[str], dim: Optional[int], rotation: str, seed: int):
    """Raw K or V vectors [..., d] → coordinates of √d·R·u (normalised, rotated with head 0's rotation)."""
    import mlx.core as mx
    import numpy as np

    from rq_core.codec.rotation import Rotation, check_dim

    if not path.is_file():
        raise RQError(f"samples file not found: {path}")
    try:
        tensors = mx.load(str(path))
    except Exception as e:  # mx.load raises plain exceptions for malformed files
        raise RQError(f"{path}: cannot read safetensors ({e})") from None
    if not isinstance(tensors, dict) or not tensors:
        raise RQError(f"{path}: no tensors in file")
    if tensor is None:
        if len(tensors) != 1:
            raise RQError(f"{path} has {len(tensors)} tensors; pick one with --tensor ({', '.join(sorted(tensors)[:8])})")
        tensor = next(iter(tensors))
    if tensor not in tensors:
        raise RQError(f"{path} has no tensor {tensor!r} (has: {', '.join(sorted(tensors)[:8])})")
    x = tensors[tensor]
    d = check_dim(x.shape[-1]) if x.ndim >= 1 else check_dim(0)
    if dim is not None and dim != d:
        raise RQError(f"tensor {tensor!r} has vectors of length {d}, but --dim {dim} was given")
    x = np.array(x.reshape(-1, d).astype(mx.float32))
    n = np.linalg.norm(x, axis=-1, keepdims=True)
    keep = (n[:, 0] > 0) & np.all(np.isfinite(x), axis=-1)
    if not keep.any():
        raise RQError(f"tensor {tensor!r} has no non-zero finite vectors")
    u = mx.array(x[keep] / n[keep])
    z = Rotation(d, 1, variant=rotation, seed=seed).forward(u[None, None])[0, 0] * math.sqrt(d)
    return np.array(z), d, tensor


@handle_errors(bits=POSITIVE, dim=POSITIVE, seed=SEED)
def calibrate_codebook(
    bits: int = typer.Option(3, "--bits", help="Bits per coordinate (1-4)."),
    dim: Optional[int] = typer.Option(None, "--dim", help="Head dim d (power of two, 16-1024); needed for sphere."),
    distribution: str = typer.Option("sphere", "--distribution", help="sphere (exact marginal of a random unit vector) or gaussian."),
    from_samples: Optional[Path] = typer.Option(None, "--from-samples", help="Fit to raw K or V vectors [N, d] in a .safetensors file."),
    tensor: Optional[str] = typer.Option(None, "--tensor", help="Tensor name in --from-samples (default: the only one)."),
    rotation: str = typer.Option("wht_so4", "--rotation", help="Rotation applied to samples before fitting."),
    seed: int = typer.Option(0, "--seed", help="Rotation seed for samples."),
    out: Optional[Path] = typer.Option(None, "--out", help="Write the codebook as TOML (atomic)."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Compute a Lloyd-Max codebook; levels are in units where a rotated coordinate has unit variance."""
    from rq_core.codec.codebook import check_bits, fit_codebook, gaussian_codebook, sphere_codebook
    from rq_core.codec.rotation import check_dim, check_variant

    check_bits(bits)
    if dim is not None:
        check_dim(dim)
    if from_samples is not None:
        check_variant(rotation)
        z, d, name = _samples(from_samples, tensor, dim, rotation, seed)
        cb = fit_codebook(z, bits, dim=d)
        cb.meta.update({"source": str(from_samples), "tensor": name, "rotation": rotation})
    elif distribution == "gaussian":
        cb = gaussian_codebook(bits)
        cb.dim = dim
    elif distribution == "sphere":
        if dim is None:
            raise RQError("--distribution sphere needs --dim (the head dim)")
        cb = sphere_codebook(bits, dim)
    else:
        raise RQError(f"unknown distribution {distribution!r} (choose from: sphere, gaussian)")
    if out is not None:
        cb.save(out)
    info = cb.to_dict()
    if json_out:
        print_json(info | {"out": str(out) if out else None})
        return
    from rich.console import Console

    con = Console(soft_wrap=True)
    src = cb.meta.get("source", cb.distribution)
    con.print(f"{cb.bits}-bit Lloyd-Max codebook ({src}, d={cb.dim}): MSE {cb.mse:.5f} per unit-variance coordinate")
    con.print("levels:     " + " ".join(f"{x:+.4f}" for x in cb.levels))
    con.print("thresholds: " + " ".join(f"{x:+.4f}" for x in cb.thresholds))
    if out is not None:
        con.print(f"wrote {out}")
