"""`rq run`: greedy output equals transformers', --json fields, and bad input → one line, non-zero exit."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

import rq_core.checkpoint as checkpoint
from rq_cli.main import app

GOLDEN = Path(__file__).parent / "golden"
FAMILIES = sorted(p.parent.name for p in GOLDEN.glob("*/golden.json"))
QWEN2 = GOLDEN / "qwen2_moe" / "model"
JSON_FIELDS = {"text", "tokens", "prompt_tokens", "generated_tokens", "prefill_tok_per_s", "decode_tok_per_s",
               "peak_memory_bytes", "kv_bytes", "kv_bytes_fp16", "kv_mode", "model_type", "first_step_s",
               "steady_decode_tok_per_s", "decode_steps"}


def _rq(*args: str):
    return CliRunner().invoke(app, ["run", *args])


def _error_line(result) -> str:
    assert result.exit_code != 0, result.output
    assert "Traceback" not in result.output
    lines = [ln for ln in result.output.splitlines() if ln.strip()]
    assert len(lines) == 1, result.output
    assert lines[0].startswith("error:")
    return lines[0]


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_json_matches_transformers(family: str) -> None:
    g = json.loads((GOLDEN / family / "golden.json").read_text())
    r = _rq(str(GOLDEN / family / "model"), "--raw", "--prompt", g["prompt_text"], "--temp", "0", "--kv", "fp16",
            "--max-tokens", str(len(g["greedy"])), "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert JSON_FIELDS <= set(out)
    assert out["prompt_tokens"] == len(g["prompt_ids"])
    assert out["tokens"] == g["greedy"]
    assert out["generated_tokens"] == len(out["tokens"])
    # every generated token but the prompt pass's is one decode step's (an EOS read is a step, not a token)
    assert out["decode_steps"] in (out["generated_tokens"] - 1, out["generated_tokens"])
    assert out["kv_mode"] == "fp16" and out["model_type"] == family
    assert out["prefill_tok_per_s"] > 0 and out["decode_tok_per_s"] > 0
    if out["generated_tokens"] > 2:  # the first decode step timed apart, the rate without it
        assert out["first_step_s"] > 0 and out["steady_decode_tok_per_s"] > 0
    assert out["peak_memory_bytes"] > 0 and out["kv_bytes"] > 0 and out["kv_bytes_fp16"] > 0


def test_isoquant_json_reports_smaller_kv() -> None:
    r = _rq(str(QWEN2), "--prompt", "The quick brown fox", "--max-tokens", "4", "--kv", "isoquant3", "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["kv_mode"] == "isoquant3" and out["generated_tokens"] == 4
    fp16 = json.loads(_rq(str(QWEN2), "--prompt", "The quick brown fox", "--max-tokens", "4", "--json")
                      .stdout.strip().splitlines()[-1])
    assert out["kv_bytes_fp16"] == fp16["kv_bytes_fp16"]
    assert out["kv_bytes"] < fp16["kv_bytes"]


def test_streams_text_and_stats_line() -> None:
    r = _rq(str(QWEN2), "--prompt", "Hello world", "--max-tokens", "5", "--temp", "0.8", "--top-p", "0.9",
            "--seed", "3")
    assert r.exit_code == 0, r.output
    assert "tok/s" in r.output and "peak mem" in r.output and "KV fp16" in r.output
    again = _rq(str(QWEN2), "--prompt", "Hello world", "--max-tokens", "5", "--temp", "0.8", "--top-p", "0.9",
                "--seed", "3")
    assert again.stdout == r.stdout  # same seed, same text
    js = json.loads(_rq(str(QWEN2), "--prompt", "Hello world", "--max-tokens", "5", "--temp", "0.8", "--top-p",
                        "0.9", "--seed", "3", "--json").stdout.splitlines()[-1])
    assert r.stdout == js["text"] + "\n"  # the streamed pieces add up to the decoded text


def test_chat_template_is_applied() -> None:
    """The chat template by default where the tokenizer has one (as mlx-lm); --raw sends the bare prompt."""
    def run(*flags: str) -> dict:
        r = _rq(str(QWEN2), "--prompt", "hi", "--max-tokens", "1", "--json", *flags)
        assert r.exit_code == 0, r.output
        return json.loads(r.stdout.splitlines()[-1])

    plain, default, chat = run("--raw"), run(), run("--chat")
    assert default["prompt_tokens"] > plain["prompt_tokens"]
    assert default["prompt_tokens"] == chat["prompt_tokens"] and default["tokens"] == chat["tokens"]
    assert (plain["chat_template"], default["chat_template"], chat["chat_template"]) == (False, True, True)


def test_bundled_model_without_a_template_gets_the_raw_prompt() -> None:
    """No chat template (the bundled model): the prompt stays raw by default; --chat opts into the plain
    transcript."""
    def run(*flags: str) -> dict:
        r = _rq("--prompt", "ROMEO:", "--max-tokens", "3", "--json", *flags)
        assert r.exit_code == 0, r.output
        return json.loads(r.stdout.splitlines()[-1])

    default, raw, chat = run(), run("--raw"), run("--chat")
    assert default["tokens"] == raw["tokens"] and default["prompt_tokens"] == raw["prompt_tokens"]
    assert chat["prompt_tokens"] > default["prompt_tokens"]  # "USER:\nROMEO:\n\nASSISTANT:\n"
    assert not any(d["chat_template"] for d in (default, raw, chat))


@pytest.mark.parametrize("flags", [("--system", "x"), ("--chat",)])
def test_raw_with_chat_or_system_is_one_line(flags: tuple) -> None:
    assert "--raw" in _error_line(_rq(str(QWEN2), "--prompt", "hi", "--raw", *flags))


def test_stops_at_eos(tmp_path: Path) -> None:
    g = json.loads((GOLDEN / "qwen2_moe" / "golden.json").read_text())
    model = tmp_path / "m"
    shutil.copytree(QWEN2, model)
    # Declare the 4th greedy token an EOS: generation must stop before it.
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, g["greedy"][3]]}))
    out = json.loads(_rq(str(model), "--raw", "--prompt", g["prompt_text"], "--max-tokens", "16", "--json")
                     .stdout.splitlines()[-1])
    assert out["tokens"] == g["greedy"][:3] and out["stop_reason"] == "eos"


def test_dir_without_config(tmp_path: Path) -> None:
    assert "config.json" in _error_line(_rq(str(tmp_path), "--prompt", "x"))


def test_unknown_model_type_names_supported(tmp_path: Path) -> None:
    model = tmp_path / "m"
    shutil.copytree(QWEN2, model)
    cfg = json.loads((model / "config.json").read_text())
    cfg["model_type"] = "llama_moe_9000"
    (model / "config.json").write_text(json.dumps(cfg))
    line = _error_line(_rq(str(model), "--prompt", "x"))
    assert "llama_moe_9000" in line and "qwen3_moe" in line and "qwen2_moe" in line and "gemma4" in line


def test_truncated_safetensors(tmp_path: Path) -> None:
    model = tmp_path / "m"
    shutil.copytree(QWEN2, model)
    f = model / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    assert "truncated" in _error_line(_rq(str(model), "--prompt", "x"))
    f.write_bytes(data[:5])
    assert "truncated" in _error_line(_rq(str(model), "--prompt", "x"))


def test_prompt_longer_than_context() -> None:
    line = _error_line(_rq(str(QWEN2), "--prompt", "hello " * 200))
    assert "context" in line and "128" in line


def test_bad_kv_mode() -> None:
    assert "isoquant3" in _error_line(_rq(str(QWEN2), "--prompt", "x", "--kv", "int2"))


def test_missing_default_model(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(checkpoint, "DEFAULT_MODEL", tmp_path / "nope")
    assert "default model" in _error_line(_rq("--prompt", "x"))


def test_hub_id_offline_not_cached(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    line = _error_line(_rq("no-such-owner/no-such-model", "--prompt", "x"))
    assert "HF_HUB_OFFLINE" in line and "no-such-owner/no-such-model" in line


def test_weights_not_matching_config(tmp_path: Path) -> None:
    model = tmp_path / "m"
    shutil.copytree(QWEN2, model)
    cfg = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**cfg, "hidden_size": 64}))
    assert "does not match" in _error_line(_rq(str(model), "--prompt", "x"))
    (model / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 4}))
    assert "layer_types" in _error_line(_rq(str(model), "--prompt", "x"))


def _with_recipe(tmp_path: Path, text: str) -> Path:
    d = tmp_path / "m"
    shutil.copytree(QWEN2, d)
    (d / "recipe.toml").write_text(text)
    return d


def test_kv_settings_come_from_the_recipe_unless_flagged(tmp_path: Path) -> None:
    d = _with_recipe(tmp_path, 'version = 1\nname = "t"\n[kv]\nmode = "isoquant3"\nfp16_window = 0\n')
    r = _rq(str(d), "--prompt", "hello", "--max-tokens", "3", "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    assert (out["kv_mode"], out["kv_window"], out["settings_from"]) == ("isoquant3", 0, "recipe.toml")
    assert out["kv_bytes"] < out["kv_bytes_fp16"]  # compressed: the recipe's mode is in effect
    r = _rq(str(d), "--prompt", "hello", "--max-tokens", "3", "--kv-config", "fp16_window=2", "--json")
    out = json.loads(r.output)
    assert (out["kv_mode"], out["kv_window"]) == ("isoquant3", 2)
    r = _rq(str(d), "--prompt", "hello", "--max-tokens", "3", "--kv-config", "kv.fp16_window=3", "--json")
    assert json.loads(r.output)["kv_window"] == 3
    r = _rq(str(d), "--prompt", "hello", "--max-tokens", "3", "--kv", "fp16", "--json")
    out = json.loads(r.output)
    assert out["kv_mode"] == "fp16" and out["kv_bytes"] >= out["kv_bytes_fp16"]
    r = _rq(str(QWEN2), "--prompt", "hello", "--max-tokens", "1", "--json")  # no recipe.toml: defaults
    out = json.loads(r.output)
    assert (out["kv_mode"], out["settings_from"]) == ("fp16", "defaults")
    r = _rq(str(QWEN2), "--prompt", "hello", "--max-tokens", "1", "--kv", "isoquant3", "--json")
    assert json.loads(r.output)["kv_window"] == 32  # a compressed cache keeps 32 tokens in fp16 by default
    d2 = _with_recipe(tmp_path / "b", 'version = 1\nname = "t"\n[kv]\nmode = "isoquant3"\n')
    assert json.loads(_rq(str(d2), "--prompt", "hi", "--max-tokens", "1", "--json").output)["kv_window"] == 32


def test_kv_config_rotation(tmp_path: Path) -> None:
    """--kv-config rotation=NAME picks the isoquant3 cache's rotation over the recipe's; JSON reports it; bad names
    fail with one line naming the key."""
    d = _with_recipe(tmp_path, 'version = 1\nname = "t"\n[kv]\nmode = "isoquant3"\nfp16_window = 0\n')
    outs = {}
    for rot in ("wht_so4", "rwht_so4"):
        r = _rq(str(d), "--prompt", "hello there", "--max-tokens", "4", "--kv-config", f"rotation={rot}", "--json")
        assert r.exit_code == 0, r.output
        outs[rot] = json.loads(r.output)
        assert outs[rot]["rotation"] == rot and outs[rot]["kv_bytes"] < outs[rot]["kv_bytes_fp16"]
    r = _rq(str(d), "--prompt", "hello", "--max-tokens", "1", "--kv", "fp16", "--json")
    assert json.loads(r.output)["rotation"] is None
    assert "--kv-config: kv.rotation = 'bogus'" in _error_line(_rq(str(d), "--prompt", "hello", "--kv-config",
                                                                  "rotation=bogus"))


def test_bad_recipe_in_checkpoint_is_one_line(tmp_path: Path) -> None:
    d = _with_recipe(tmp_path, 'version = 1\nname = "t"\n[kv]\nmode = "isoquant9"\n')
    assert "isoquant9" in _error_line(_rq(str(d), "--prompt", "hello"))


def test_edge_layers_kv_config_and_recipe(tmp_path: Path) -> None:
    """kv.edge_layers (default 1): the first and last compressed layers hold 4-bit codes, so more bytes than without;
    --kv-config edge_layers=N overrides the recipe's; JSON and the stats line say so; a negative count is one error line."""
    d = _with_recipe(tmp_path, 'version = 1\nname = "t"\n[kv]\nmode = "isoquant3"\nfp16_window = 0\n')
    runs = {}
    for extra in ((), ("--kv-config", "edge_layers=0")):
        r = _rq(str(d), "--prompt", "hello there", "--max-tokens", "4", "--json", *extra)
        assert r.exit_code == 0, r.output
        runs[extra] = json.loads(r.output)
    edges, none = runs[()], runs[("--kv-config", "edge_layers=0")]
    assert (edges["kv_edge_layers"], edges["kv_edge_bits"]) == (1, 4) and none["kv_edge_layers"] == 0
    assert edges["kv_bytes"] > none["kv_bytes"]
    d0 = _with_recipe(tmp_path / "z", 'version = 1\nname = "t"\n[kv]\nmode = "isoquant3"\nedge_layers = 0\n')
    assert json.loads(_rq(str(d0), "--prompt", "hi", "--max-tokens", "2", "--json").output)["kv_edge_layers"] == 0
    r = _rq(str(d), "--prompt", "hello there", "--max-tokens", "2")
    assert r.exit_code == 0 and "1 edge layer(s) at 4 bits" in r.output, r.output
    assert "kv.edge_layers must be >= 0" in _error_line(_rq(str(d), "--prompt", "hello", "--kv-config",
                                                            "edge_layers=-1"))


def test_pair_points_kv_config_and_recipe(tmp_path: Path) -> None:
    """isoquant3 takes pair codebooks (128, 32) by default at head dim 128; --kv-config pair_points= (or the recipe's
    kv.pair_points) sets them, 'off' (or []) gives scalar codebooks at the same bytes; JSON reports what the caches
    took; bad values and a recipe with kv.key_bits fail with one line. (No edge layers: the tiny model's two layers
    would both be edges.)"""
    d = _with_recipe(tmp_path, 'version = 1\nname = "t"\n[kv]\nmode = "isoquant3"\nfp16_window = 0\nedge_layers = 0\n')
    r = _rq(str(d), "--prompt", "hello there", "--max-tokens", "4", "--kv-config", "pair_points=64,64", "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    assert out["kv_pair_points"] == [64, 64] and out["kv_bytes"] < out["kv_bytes_fp16"]
    r = _rq(str(d), "--prompt", "hello there", "--max-tokens", "4", "--json")
    default = json.loads(r.output)
    assert default["kv_pair_points"] == [128, 32]
    r = _rq(str(d), "--prompt", "hello there", "--max-tokens", "4", "--kv-config", "pair_points=off", "--json")
    scalar = json.loads(r.output)
    assert scalar["kv_pair_points"] is None and scalar["kv_bytes"] == default["kv_bytes"]
    r = _rq(str(d), "--prompt", "hello there", "--max-tokens", "2")
    assert r.exit_code == 0 and "KV isoquant3 (pair codebooks 128/32)" in r.output, r.output
    d0 = _with_recipe(tmp_path / "s", 'version = 1\nname = "t"\n[kv]\nmode = "isoquant3"\npair_points = []\nedge_layers = 0\n')
    assert json.loads(_rq(str(d0), "--prompt", "hi", "--max-tokens", "2", "--json").output)["kv_pair_points"] is None
    assert "pair" in _error_line(_rq(str(d), "--prompt", "hello", "--kv-config", "pair_points=128,33"))
    d2 = _with_recipe(tmp_path / "b", 'version = 1\nname = "t"\n[kv]\nmode = "isoquant3"\npair_points = [64, 64]\nedge_layers = 0\n')
    r = _rq(str(d2), "--prompt", "hello there", "--max-tokens", "4", "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["kv_pair_points"] == [64, 64]
    d3 = _with_recipe(tmp_path / "c", 'version = 1\nname = "t"\n[kv]\nmode = "isoquant3"\nkey_bits = 4\n')
    assert "key_bits" in _error_line(_rq(str(d3), "--prompt", "hello", "--kv-config", "pair_points=128,32"))


def test_prefill_fp16_kv_config() -> None:
    """--kv-config prefill_fp16=N: a prompt longer than N is compressed while it prefills (its later chunks attend to the
    compressed tokens); the run generates and reports the bound; a negative bound is one error line."""
    prompt = " ".join(["ROMEO: But soft, what light through yonder window breaks?"] * 12)
    r = _rq("--prompt", prompt, "--kv", "isoquant3", "--kv-config", "prefill_fp16=48", "--prefill-chunk", "32",
            "--max-tokens", "4", "--json")
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert d["kv_prefill_fp16"] == 48 and d["prompt_tokens"] > 96 and d["generated_tokens"] == 4
    assert d["kv_bytes"] < d["kv_bytes_fp16"]
    d0 = json.loads(_rq("--prompt", "ROMEO:", "--kv", "isoquant3", "--max-tokens", "1", "--json").stdout)
    assert d0["kv_prefill_fp16"] == 4096  # the default bound
    da = json.loads(_rq("--prompt", "ROMEO:", "--kv", "isoquant3", "--kv-config", "prefill_fp16=all", "--max-tokens", "1",
                        "--json").stdout)
    assert da["kv_prefill_fp16"] is None  # the whole prompt in fp16
    assert "kv.prefill_fp16 = -1 must be >= 0" in _error_line(_rq("--prompt", "x", "--kv-config", "prefill_fp16=-1"))
    assert "token count or 'all'" in _error_line(_rq("--prompt", "x", "--kv-config", "prefill_fp16=lots"))


def _np_filtered(logits, temp, top_p=1.0, top_k=0, min_p=0.0):
    """The distribution the sampler should draw from, computed in numpy: softmax(logits / temp), then top-k,
    top-p (of what is left, renormalised) and min-p (against the most likely), renormalised."""
    import numpy as np

    z = np.asarray(logits, np.float64) / temp
    p = np.exp(z - z.max())
    p /= p.sum()
    keep = np.ones_like(p, bool)
    order = np.argsort(-p, kind="stable")
    if 0 < top_k < len(p):
        keep[order[top_k:]] = False
    if top_p < 1:
        q = np.where(keep, p, 0) / np.where(keep, p, 0).sum()
        before = np.cumsum(q[order]) - q[order]  # mass of the more likely tokens
        keep[order[before >= top_p]] = False
    if min_p > 0:
        keep &= p >= min_p * p.max()
    out = np.where(keep, p, 0)
    return out / out.sum()


@pytest.mark.parametrize("temp, top_p, top_k, min_p", [
    (1.0, 1.0, 3, 0.0), (0.7, 1.0, 0, 0.1), (1.3, 0.8, 5, 0.0), (1.0, 0.9, 4, 0.2), (2.0, 1.0, 0, 0.0),
    (1.0, 1.0, 1, 0.0), (1.0, 1.0, 0, 1.0),
])
def test_sampler_filters_match_numpy(temp, top_p, top_k, min_p) -> None:
    """filter_logits leaves the numpy distribution, and sample() draws from it (frequencies over many rows)."""
    import mlx.core as mx
    import numpy as np

    from rq_core.generate import filter_logits, sample

    rng = np.random.default_rng(0)
    logits = rng.normal(0, 1.5, size=12).astype(np.float32)
    want = _np_filtered(logits, temp, top_p, top_k, min_p)
    got = np.array(mx.softmax(filter_logits(mx.array(logits[None]), temp, top_p, top_k, min_p), axis=-1))[0]
    np.testing.assert_allclose(got, want, atol=2.5e-7)  # measured 5.2e-8 (probabilities; 2 float32 ulps at 1)
    assert (want == 0).sum() > 0 or (top_k == 0 and min_p == 0 and top_p == 1)  # a filter that drops nothing tests nothing
    mx.random.seed(1)
    n = 40000
    draws = np.array(sample(mx.array(np.tile(logits, (n, 1))), temp, top_p, top_k, min_p))
    freq = np.bincount(draws, minlength=len(logits)) / n
    assert np.all(freq[want == 0] == 0)
    tol = 5 * np.sqrt(want * (1 - want) / n) + 1e-9  # five standard errors a token
    assert np.all(np.abs(freq - want) <= tol), (freq, want)


def test_system_message_goes_through_the_chat_template() -> None:
    """--system: a system message before the prompt in the chat template (so it implies --chat)."""
    from rq_core.checkpoint import load

    tok = load(str(QWEN2)).tokenizer
    want = tok.encode("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
                      "<|im_start|>assistant\n", add_special_tokens=False)
    r = _rq(str(QWEN2), "--prompt", "hi", "--system", "Be brief.", "--max-tokens", "1", "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["prompt_tokens"] == len(want)
    chat = json.loads(_rq(str(QWEN2), "--prompt", "hi", "--chat", "--max-tokens", "1", "--json").stdout)
    assert chat["prompt_tokens"] < len(want)


def test_top_k_and_min_p_reach_the_sampler() -> None:
    """--top-k 1 or --min-p 1 leave only the most likely token: sampling at a high temperature is then greedy."""
    args = ("--prompt", "ROMEO:", "--max-tokens", "12", "--json")
    greedy = json.loads(_rq(str(QWEN2), *args).stdout)["tokens"]
    hot = ("--temp", "5", "--seed", "1")
    assert json.loads(_rq(str(QWEN2), *args, *hot).stdout)["tokens"] != greedy  # a hot sample differs
    assert json.loads(_rq(str(QWEN2), *args, *hot, "--top-k", "1").stdout)["tokens"] == greedy
    assert json.loads(_rq(str(QWEN2), *args, *hot, "--min-p", "1").stdout)["tokens"] == greedy
    assert "--top-k must be >= 0" in _error_line(_rq("--prompt", "x", "--top-k", "-1"))
    assert "--min-p must be in [0, 1]" in _error_line(_rq("--prompt", "x", "--min-p", "1.5"))


def test_model_option_is_the_positional_argument() -> None:
    """--model (mlx-lm's spelling) is MODEL; both at once must agree."""
    args = ("--prompt", "hello", "--max-tokens", "3", "--json")
    pos = json.loads(_rq(str(QWEN2), *args).stdout)
    opt = json.loads(_rq("--model", str(QWEN2), *args).stdout)
    assert pos["tokens"] == opt["tokens"] and opt["model"] == pos["model"] and opt["model_type"] == "qwen2_moe"
    assert json.loads(_rq(str(QWEN2), "-m", str(QWEN2), *args).stdout)["tokens"] == pos["tokens"]
    assert "two models given" in _error_line(_rq(str(QWEN2), "--model", str(GOLDEN / "qwen3_moe" / "model"), *args))


def test_kv_config_is_repeatable_and_checked_before_loading(tmp_path: Path) -> None:
    d = _with_recipe(tmp_path, 'version = 1\nname = "t"\n[kv]\nmode = "isoquant3"\n')
    out = json.loads(_rq(str(d), "--prompt", "hi", "--max-tokens", "1", "--json", "--kv-config", "fp16_window=5",
                         "--kv-config", "edge_layers=0", "--kv-config", "fp16_window=7").stdout)
    assert (out["kv_window"], out["kv_edge_layers"]) == (7, 0)
    line = _error_line(_rq(str(tmp_path / "nothing"), "--prompt", "hi", "--kv-config", "windw=3"))
    assert "--kv-config: unknown key 'kv.windw'" in line  # before the (missing) model is looked for
    assert "KEY=VALUE" in _error_line(_rq("--prompt", "hi", "--kv-config", "edge_layers"))


@pytest.mark.parametrize("flag", ["--pair-points", "--prefill-fp16", "--edge-layers", "--rotation", "--kv-window",
                                  "--fp16-window", "--key-bits"])
def test_research_flags_live_in_the_recipe(flag: str) -> None:
    assert "No such option" in _error_line(_rq("--prompt", "hi", flag, "1"))


def test_plan_prints_the_quantize_table_and_fails_below_the_smallest_budget() -> None:
    """--plan renders the planner's table (rq quantize --plan's), exits 1 when the budget does not fit and names
    the smallest budget that does; --json keeps the plan's field names and the exit status."""
    from rq_core.checkpoint import DEFAULT_MODEL

    args = ["--prompt", "hi", "--plan", "--memory-budget"]
    d = json.loads(_rq(*args, "1GB", "--json").stdout)["plan"]
    assert {"resident_bytes", "kv_bytes", "slots_per_layer", "fits", "min_budget_bytes", "planned_peak_bytes"} <= set(d)
    need = d["min_budget_bytes"]
    table = _rq(*args, str(need))
    assert table.exit_code == 0, table.output
    quantize = CliRunner().invoke(app, ["quantize", str(DEFAULT_MODEL), "-r", str(DEFAULT_MODEL / "recipe.toml"),
                                        "--plan"])
    rows = [ln.split("│")[1].strip() for ln in quantize.output.splitlines() if ln.count("│") == 4]
    assert len(rows) > 8 and all(r in table.output for r in rows if not r.startswith("KV at"))
    short = _rq(*args, str(need - 1))
    assert short.exit_code == 1 and "Traceback" not in short.output
    assert f"smallest budget that runs is {need:,} bytes" in short.output and "fits" in short.output
    short_json = _rq(*args, str(need - 1), "--json")
    assert short_json.exit_code == 1 and json.loads(short_json.stdout.splitlines()[0])["plan"]["fits"] is False
