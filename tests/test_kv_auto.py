"""`--kv auto`: the decision (rq_core.cache.auto) on constructed inputs and on the bundled model, and what `rq run`
reports of it; a named mode (--kv, a recipe's kv.mode) wins over auto."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from rq_cli.main import app
from rq_core.cache import auto
from rq_core.cache.kv_cache import DEFAULT_EDGE_LAYERS, DEFAULT_FP16_WINDOW, KVSettings
from rq_core.checkpoint import DEFAULT_MODEL, load
from rq_core.quant import recipe

LONG = auto.LONG_CONTEXT
SETTINGS = KVSettings(mode=auto.AUTO, fp16_window=DEFAULT_FP16_WINDOW, edge_layers=DEFAULT_EDGE_LAYERS)


NO_FP16 = auto.Fit(fp16=False, compressed=True, fp16_need=30, compressed_need=20)


@pytest.mark.parametrize("backend,context,fit,declined,mode,why", [
    (None, 1024, auto.Fit(), (), "fp16", "CPU"),  # no kernels: the compressed cache is slower
    (None, 4 * LONG, auto.Fit(), (), "fp16", "CPU"),  # at any context
    (None, 1024, NO_FP16, (), "isoquant3", "does not fit"),  # unless the budget forces it
    ("metal", LONG, auto.Fit(), (), "isoquant3", f"from {LONG}"),  # a long context, every shape covered
    ("metal", 4 * LONG, auto.Fit(), (), "isoquant3", "metal"),
    ("metal", LONG - 1, auto.Fit(), (), "fp16", f"below {LONG}"),  # shorter: fp16 decodes faster
    ("cuda", LONG, auto.Fit(), (), "isoquant3", f"from {LONG}"),  # as on Metal
    ("cuda", LONG - 1, auto.Fit(), (), "fp16", f"below {LONG}"),
    ("cuda", 1024, NO_FP16, (), "isoquant3", "does not fit"),  # ... unless the budget forces compression
    ("cuda", 4 * LONG, auto.Fit(), ("head_dim 512: not covered",), "fp16", "declines"),  # a declined shape: never
    ("cuda", 1024, NO_FP16, ("head_dim 512: not covered",), "isoquant3", "does not fit"),  # ... unless forced
    # neither fits: the one that needs less (the run then fails naming the least budget)
    (None, 1024, auto.Fit(False, False, 30, 20), (), "isoquant3", "isoquant3 needs less"),
    ("cuda", LONG, auto.Fit(False, False, 20, 30), (), "fp16", "fp16 needs less"),
])
def test_choose(backend, context, fit, declined, mode, why):
    got, reason = auto.choose(backend=backend, context=context, fit=fit, declined=declined)
    assert got == mode and why in reason, reason


@pytest.fixture(scope="module")
def bundled():
    return load(None, cpu_float32=True)


def test_shapes_and_declines(bundled):
    shapes = auto.attention_shapes(bundled.model)
    assert shapes == [(128, 4, 2)]  # head_dim 128, 4 query heads over 2 kv heads
    for be in ("cuda", "metal"):
        assert auto.declined_shapes(be, shapes, SETTINGS) == []
    # 6 query heads over 4 kv heads is no grouped-query layout the kernel takes: one line for the shape
    why = auto.declined_shapes("cuda", [(128, 6, 4), (128, 4, 2)], SETTINGS)
    assert len(why) == 1 and why[0].startswith("head_dim 128, 6/4 heads:")


def test_budget_fit(bundled):
    m, cfg = bundled.model, bundled.config
    assert auto.budget_fit(m, cfg, None, SETTINGS, context=2048) == auto.Fit()  # no budget: both fit
    assert auto.budget_fit(m, cfg, 10**9, SETTINGS, context=1504).fp16
    # fp16 K/V of 1,504 tokens (float32 on the CPU: 12 KiB a token) does not fit 27 MB beside the weights; the
    # compressed cache's (512 prompt tokens held in fp16 while prefilling, in chunks of 64) does
    fit = auto.budget_fit(m, cfg, 27 * 10**6, dataclasses.replace(SETTINGS, prefill_fp16=512), context=1504,
                          prefill_chunk=64)
    assert (fit.fp16, fit.compressed) == (False, True) and fit.compressed_need < 27 * 10**6 < fit.fp16_need
    assert auto.budget_fit(m, cfg, 27 * 10**6, SETTINGS, context=64).fp16


def test_decide_on_the_bundled_model(bundled, monkeypatch):
    m, cfg = bundled.model, bundled.config
    assert auto.decide(m, cfg, SETTINGS, context=64).mode == "fp16"  # this machine's CPU
    forced = auto.decide(m, cfg, dataclasses.replace(SETTINGS, prefill_fp16=512), context=1504, budget=27 * 10**6,
                         prefill_chunk=64)
    assert (forced.mode, forced.reason) == ("isoquant3", "fp16 KV for 1504 tokens does not fit the memory budget")
    # the whole prompt held in fp16 while prefilling (prefill_fp16 4096): the compressed cache needs more; fp16 stays
    kept = auto.decide(m, cfg, SETTINGS, context=1504, budget=27 * 10**6, prefill_chunk=64)
    assert kept.mode == "fp16" and "fp16 needs less" in kept.reason
    for be in ("cuda", "metal"):  # the kernel takes this model's shape
        monkeypatch.setattr(auto, "kernel_backend", lambda be=be: be)
        assert auto.decide(m, cfg, SETTINGS, context=LONG).mode == "isoquant3"
        assert auto.decide(m, cfg, SETTINGS, context=LONG - 1).mode == "fp16"
    monkeypatch.setattr(auto, "attention_shapes", lambda model: [(128, 6, 4)])  # a shape it declines
    c = auto.decide(m, cfg, SETTINGS, context=LONG)
    assert c.mode == "fp16" and "declines" in c.reason


def _run(*args: str) -> dict:
    r = CliRunner().invoke(app, ["run", *args, "--prompt", "ROMEO:", "-n", "2", "--json"])
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def test_run_reports_autos_choice():
    out = _run()  # the bundled model's recipe.toml: kv.mode = "auto"
    assert out["kv_mode"] == "fp16" and out["settings_from"] == "recipe.toml"
    # the rule's reason for this machine at the planned context (the prompt and the two tokens)
    assert out["kv_auto_reason"] == auto.choose(backend=auto.kernel_backend(), context=out["prompt_tokens"] + 2)[1]
    named = _run("--kv", "isoquant3")  # a named mode wins, with no reason
    assert (named["kv_mode"], named["kv_auto_reason"]) == ("isoquant3", None)
    assert _run("--kv", "auto")["kv_mode"] == out["kv_mode"]


def test_stats_line_says_why():
    r = CliRunner().invoke(app, ["run", "--prompt", "ROMEO:", "-n", "2"])
    assert r.exit_code == 0, r.output
    assert "KV auto: fp16, " in r.stderr


def test_a_recipes_mode_wins(tmp_path: Path):
    ck = tmp_path / "ck"
    shutil.copytree(DEFAULT_MODEL, ck)
    text = (ck / "recipe.toml").read_text()
    assert 'mode = "auto"' in text
    (ck / "recipe.toml").write_text(text.replace('mode = "auto"', 'mode = "turbo3"'))
    out = _run(str(ck))
    assert (out["kv_mode"], out["kv_auto_reason"]) == ("turbo3", None)
    assert _run(str(ck), "--kv", "auto")["kv_auto_reason"]  # --kv auto over the recipe's mode


def test_recipe_mode_auto():
    base = 'version = 1\nname = "t"\n'
    assert recipe.loads(base).kv.mode == "auto"  # no kv.mode: auto
    assert recipe.loads(base + '[kv]\nfp16_window = 8\n').kv.mode == "auto"
    r = recipe.loads(base + '[kv]\nmode = "auto"\n')
    assert recipe.loads(r.dumps()).kv.mode == "auto"  # written and read back
    assert recipe.loads(base + '[kv]\nmode = "fp16"\n').kv.mode == "fp16"
    with pytest.raises(Exception, match="kv.mode = 'fast' is not one of fp16, isoquant3, turbo3, auto"):
        recipe.loads(base + '[kv]\nmode = "fast"\n')


@pytest.mark.parametrize("cmd", [["bench", "--kv", "auto", "--context", "64"], ["eval", "ppl", "--kv", "auto"]])
def test_auto_is_refused_where_a_command_compares_modes(cmd):
    r = CliRunner().invoke(app, cmd)
    assert r.exit_code == 2 and "--kv auto picks one cache for a run" in r.output
    assert "Traceback" not in r.output
