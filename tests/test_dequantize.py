"""`rq dequantize`: a full-precision copy of a quantized checkpoint (the bundled model's: a source for `rq quantize`
offline) computes what the quantized model computes; bad sources and outputs are one error line."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import pytest
from typer.testing import CliRunner

from rq_cli.main import app
from rq_core.checkpoint import DEFAULT_MODEL, load


@pytest.fixture(scope="module")
def f16(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dq") / "f16"
    r = CliRunner().invoke(app, ["dequantize", "-o", str(out), "--json"])
    assert r.exit_code == 0, r.output
    res = json.loads(r.stdout)["dequantize"]
    assert res["dequantized"] > 0 and res["bytes_out"] > res["bytes_in"]
    return out


def test_the_copy_is_full_precision(f16: Path):
    cfg = json.loads((f16 / "config.json").read_text())
    assert "quantization" not in cfg and "quantization_config" not in cfg
    assert not (f16 / "recipe.toml").exists() and (f16 / "tokenizer.json").is_file()
    w = mx.load(str(f16 / "model.safetensors"))
    assert all(mx.issubdtype(a.dtype, mx.floating) for a in w.values())
    assert not any(k.endswith((".scales", ".biases")) for k in w)
    assert w["model.embed_tokens.weight"].shape == (4096, 256)


def test_the_copy_computes_what_the_quantized_model_does(f16: Path):
    ids = mx.array([[12, 345, 67, 890, 11, 2047]])
    a, b = load(None, cpu_float32=True).model(ids), load(str(f16), cpu_float32=True).model(ids)
    assert mx.abs(a - b).max().item() < 0.05 * mx.abs(a).max().item()
    assert (a.argmax(-1) == b.argmax(-1)).all().item()


def test_bad_sources_and_outputs(f16: Path, tmp_path: Path):
    again = CliRunner().invoke(app, ["dequantize", str(f16), "-o", str(tmp_path / "x")])
    assert again.exit_code == 2 and "is not quantized" in again.output and "Traceback" not in again.output
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("mine")
    r = CliRunner().invoke(app, ["dequantize", "-o", str(busy)])
    assert r.exit_code == 2 and "exists and is not empty" in r.output
    assert [p.name for p in busy.iterdir()] == ["keep.txt"]
    assert CliRunner().invoke(app, ["dequantize"]).exit_code == 2  # no -o
    # the quantized source is still refused by rq quantize: the float copy is the way
    q = CliRunner().invoke(app, ["quantize", str(DEFAULT_MODEL), "-r", "shakespeare-moe-rtn",
                                 "-o", str(tmp_path / "q")])
    assert q.exit_code == 2 and "already quantized" in q.output


def test_an_output_that_cannot_be_made_is_one_line(tmp_path: Path):
    """An output under a regular file: one error line naming the output, nothing written beside it."""
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    r = CliRunner().invoke(app, ["dequantize", "-o", str(blocker / "copy")])
    assert r.exit_code == 2 and "cannot write" in r.output and str(blocker / "copy") in r.output
    assert "Traceback" not in r.output and sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]
