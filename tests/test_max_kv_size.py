"""--max-kv-size N (as mlx-lm's): full-attention layers keep only their newest N tokens, in fp16."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from rq_cli.main import app

PROMPT = "ROMEO: what light"  # 6 tokens on the bundled model
GEN = 30


def _run(*flags: str) -> dict:
    r = CliRunner().invoke(app, ["run", "--prompt", PROMPT, "-n", str(GEN), "--temp", "0", "--json", *flags])
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout.splitlines()[-1])


def _error_line(args: list[str]) -> str:
    r = CliRunner().invoke(app, args)
    assert r.exit_code != 0, r.output
    assert "Traceback" not in r.output
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), r.output
    return lines[0]


def test_kv_bytes_stay_bounded_and_a_large_bound_changes_nothing() -> None:
    free, b8, b16, big = _run(), _run("--max-kv-size", "8"), _run("--max-kv-size", "16"), _run("--max-kv-size", "4096")
    assert b8["prompt_tokens"] + b8["generated_tokens"] > 16
    assert b8["generated_tokens"] == GEN and b8["kv_mode"] == "fp16" and b8["max_kv_size"] == 8
    assert "--max-kv-size" in b8["kv_auto_reason"]  # --kv auto: fp16, and why
    assert b16["kv_bytes"] == 2 * b8["kv_bytes"] < free["kv_bytes"]  # the newest N tokens a layer, no more
    assert big["tokens"] == free["tokens"] and big["kv_bytes"] == free["kv_bytes"]
    assert b8["tokens"] != free["tokens"]  # the bound reaches attention


def test_tokens_equal_attention_over_a_window_of_n() -> None:
    """The bounded cache gives what the uncached model gives with every layer masked to a window of N."""
    import mlx.core as mx

    from rq_core.checkpoint import load

    n = 8
    got = _run("--max-kv-size", str(n))["tokens"]
    ckpt = load(None, cpu_float32=True)
    for layer in ckpt.model.model.layers:
        layer.self_attn.window = n
    ids = ckpt.tokenizer.encode(PROMPT)
    want = []
    for _ in range(len(got)):
        logits = ckpt.model(mx.array(ids + want, dtype=mx.int32)[None])[0, -1]
        want.append(int(mx.argmax(logits).item()))
    assert got == want


@pytest.mark.parametrize("cmd", ["run", "serve", "chat"])
def test_compressed_kv_is_refused_in_one_line(cmd: str) -> None:
    extra = ["--prompt", "hi"] if cmd == "run" else []
    line = _error_line([cmd, *extra, "--kv", "isoquant3", "--max-kv-size", "8"])
    assert "--max-kv-size" in line and "isoquant3" in line


def test_bound_below_one_is_one_line() -> None:
    assert "--max-kv-size must be >= 1" in _error_line(["run", "--prompt", "hi", "--max-kv-size", "0"])


def test_a_compressed_cache_has_no_bounded_form() -> None:
    from rq_core.cache.kv_cache import KVSettings
    from rq_core.checkpoint import load
    from rq_core.errors import RQError
    from rq_core.models.base import SlidingWindowCache

    model = load(None, cpu_float32=True).model
    caches = model.make_cache(KVSettings(max_kv_size=5))
    assert all(isinstance(c, SlidingWindowCache) and c.window == 5 for c in caches)
    with pytest.raises(RQError, match="max_kv_size"):
        model.make_cache(KVSettings(mode="isoquant3", max_kv_size=5))
