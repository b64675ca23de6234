"""rq_core/tools/synth.py: the layout rq quantize writes (names, shapes, dtypes, quantization config, recipe)
on tiny configs of every family, and a 2-layer checkpoint of each real config that loads and gives finite, spread
logits."""

import json
from pathlib import Path

import mlx.core as mx
import pytest

from _tiny_models import TINY, make_tiny
from rq_core.checkpoint import load, weight_files
from rq_core.quant import recipe
from rq_core.quant.quantize import quantize
from rq_core.tools import synth

ROOT = Path(__file__).resolve().parents[1]

RECIPE = ROOT / "tests" / "data" / "tiny-rtn.toml"
REAL = ["qwen3-30b-a3b", "gemma4-26b-a4b", "nemotron3-nano-30b-a3b", "nemotron3-super-120b-a12b"]


def _layout(d: Path) -> dict:
    out = {}
    for f in weight_files(d):
        for k, v in mx.load(str(f)).items():
            out[k] = (tuple(v.shape), str(v.dtype))
    return out


@pytest.mark.parametrize("family", list(TINY))
def test_layout_is_what_rq_quantize_writes(family, tmp_path):
    src = make_tiny(family, tmp_path / "src")
    quantize(src, recipe.load(RECIPE), tmp_path / "q")
    cfg = json.loads((src / "config.json").read_text())
    s = synth.write(cfg, str(RECIPE), tmp_path / "s")
    assert s["quantized"] > 0
    q, y = _layout(tmp_path / "q"), _layout(tmp_path / "s")
    assert y == q
    qc = json.loads((tmp_path / "q" / "config.json").read_text())
    sc = json.loads((tmp_path / "s" / "config.json").read_text())
    assert sc == qc
    assert (tmp_path / "s" / "recipe.toml").read_text() == (tmp_path / "q" / "recipe.toml").read_text()
    assert (tmp_path / "s" / "tokenizer.json").is_file()
    assert len(weight_files(tmp_path / "s")) == s["shards"] >= 2  # one shard a layer, one for the rest


def test_random_codes_dequantize_to_the_asked_spread():
    w, s, b = synth.quantized_arrays((256, 1024), 2, 64, mx.random.key(0), dtype=mx.float32)
    x = mx.dequantize(w, s, b, group_size=64, bits=2)
    assert abs(float(x.mean())) < 0.002
    assert abs(float(x.std()) * 1024 ** 0.5 - 1.0) < 0.1
    w, s, b = synth.quantized_arrays((64, 512), 8, 64, mx.random.key(1), dtype=mx.float32)
    x = mx.dequantize(w, s, b, group_size=64, bits=8)
    assert abs(float(x.std()) * 512 ** 0.5 - 1.0) < 0.1
    assert len(set(int(v) for v in (w & 0xFF).reshape(-1).tolist()[:4096])) > 200  # the low codes vary too


def test_truncated_patterns_keep_an_attention_layer():
    g = synth.truncate(synth.read_config("gemma4-26b-a4b"), 2)["text_config"]
    assert g["num_hidden_layers"] == 2 and "full_attention" in g["layer_types"] and len(g["layer_types"]) == 2
    n = synth.truncate(synth.read_config("nemotron3-nano-30b-a3b"), 2)
    assert n["num_hidden_layers"] == 2 and "*" in n["hybrid_override_pattern"] and "E" in n["hybrid_override_pattern"]
    n3 = synth.truncate(synth.read_config("nemotron3-nano-30b-a3b"), 3)["hybrid_override_pattern"]
    assert sorted(n3) == ["*", "E", "M"]


@pytest.mark.parametrize("name", REAL)
def test_two_layers_of_a_real_config_load_and_run(name, tmp_path):
    """Two layers of each real config at their real shapes; the vocabulary cut to 4,096 (the embeddings and head
    of 131K-262K tokens were most of the bytes written: 40 s a config; the benchmarks write them whole)."""
    cfg = synth.truncate(synth.read_config(name), 2)
    (cfg.get("text_config") or cfg)["vocab_size"] = 4096
    out = tmp_path / name
    synth.write(cfg, synth.default_recipe(cfg), out)
    ck = load(out, tokenizer=True)
    assert ck.tokenizer is not None
    logits = ck.model(mx.array([[1, 5, 100, 7]]), cache=ck.model.make_cache()).astype(mx.float32)
    mx.eval(logits)
    tc = cfg.get("text_config", cfg)
    assert logits.shape == (1, 4, tc["vocab_size"])
    assert bool(mx.isfinite(logits).all())
    assert 0.3 < float(logits.std()) < 10  # spread, not all equal
    top = logits[0].argmax(-1).tolist()
    assert top != [1, 5, 100, 7]  # the head does not just echo the input (tied embeddings)
    assert len(set(top)) > 1
    assert synth.ensure(cfg, synth.default_recipe(cfg), out) == (out, True)  # reused, not rewritten


# ----------------------------------------------------------------------------------- routing and packed writes
def test_routing_option_parses():
    assert synth.parse_routing("uniform") == ("uniform", 0.0)
    assert synth.parse_routing("zipf") == ("zipf", synth.ZIPF_S)
    assert synth.parse_routing("zipf:1.5") == ("zipf", 1.5)
    for bad in ("zipf:x", "zipf:0", "normal", "uniform:2"):
        with pytest.raises(Exception):
            synth.parse_routing(bad)


def test_zipf_row_scales_give_the_asked_selection_frequencies():
    import numpy as np

    E, k = 128, 8
    c = synth.zipf_row_scales(E, k, 1.0)
    target = synth.zipf_targets(E, k, 1.0)
    g = np.random.default_rng(7).standard_normal((8192, E)) * c[None]  # fresh logits, not the fitted ones
    top = np.argpartition(-g, k - 1, axis=1)[:, :k]
    obs = np.bincount(top.ravel(), minlength=E) / 8192
    assert abs(synth.top_share(obs) - synth.top_share(target)) < 0.03
    assert synth.top_share(obs) > 0.35  # uniform: 0.10
    assert np.max(np.abs(obs[:20] - target[:20]) / target[:20]) < 0.25


@pytest.mark.parametrize("family", ["qwen3_moe", "gemma4"])
def test_zipf_scales_the_router_rows_and_nothing_else(family, tmp_path):
    import numpy as np

    src = make_tiny(family, tmp_path / "src")
    cfg = json.loads((src / "config.json").read_text())
    synth.write(cfg, str(RECIPE), tmp_path / "u")
    synth.write(cfg, str(RECIPE), tmp_path / "z", routing="zipf:1.2")
    u, z = {}, {}
    for d, acc in ((tmp_path / "u", u), (tmp_path / "z", z)):
        for f in weight_files(d):
            acc.update(mx.load(str(f)))
    assert set(u) == set(z)
    changed = [k for k in u if not mx.array_equal(u[k], z[k])]
    assert changed and all(("gate" in k or "router" in k) for k in changed), changed
    assert json.loads((tmp_path / "z" / synth.MARK).read_text())["routing"] == "zipf:1.2"
    assert "routing" not in json.loads((tmp_path / "u" / synth.MARK).read_text())


@pytest.mark.parametrize("family", ["qwen3_moe", "gemma4"])
def test_packed_write_is_what_rq_pack_move_leaves(family, tmp_path):
    from rq_core.paging.pack import pack

    src = make_tiny(family, tmp_path / "src")
    cfg = json.loads((src / "config.json").read_text())
    synth.write(cfg, str(RECIPE), tmp_path / "m")
    pack(tmp_path / "m", move=True)
    synth.write(cfg, str(RECIPE), tmp_path / "p", packed=True)
    im = json.loads((tmp_path / "m" / "experts" / "index.json").read_text())
    ip = json.loads((tmp_path / "p" / "experts" / "index.json").read_text())
    assert ip == im
    for meta in im["layers"].values():
        assert (tmp_path / "p" / "experts" / meta["file"]).read_bytes() == \
            (tmp_path / "m" / "experts" / meta["file"]).read_bytes()
    assert _layout(tmp_path / "p") == _layout(tmp_path / "m")
    from rq_core.paging.pages import moved_experts

    assert moved_experts(tmp_path / "p") == moved_experts(tmp_path / "m")
    a = load(tmp_path / "p").model(mx.array([[1, 5, 9]]))
    b = load(tmp_path / "m").model(mx.array([[1, 5, 9]]))
    assert mx.array_equal(a, b)
    assert synth.ensure(cfg, str(RECIPE), tmp_path / "p", packed=True) == (tmp_path / "p", True)
    assert synth.ensure(cfg, str(RECIPE), tmp_path / "p")[1] is False  # not packed: another checkpoint


def test_pages_from_a_checkpoint_of_another_routing_links_the_same_pages(tmp_path):
    """A packed zipf write next to a packed uniform one of the same config, recipe and seed: its files are those of a
    zipf write made from scratch, byte for byte, its page files hard links of the uniform one's; a base of another
    seed (or not packed) is refused in one line."""
    import os

    from rq_core.errors import RQError

    src = make_tiny("nemotron_h", tmp_path / "src")
    cfg = json.loads((src / "config.json").read_text())
    synth.write(cfg, str(RECIPE), tmp_path / "u", packed=True)
    synth.write(cfg, str(RECIPE), tmp_path / "z", packed=True, routing="zipf:1.2")
    assert synth.ensure(cfg, str(RECIPE), tmp_path / "l", packed=True, routing="zipf:1.2",
                        pages_from=tmp_path / "u") == (tmp_path / "l", False)
    files = sorted(str(p.relative_to(tmp_path / "z")) for p in (tmp_path / "z").rglob("*") if p.is_file())
    assert files == sorted(str(p.relative_to(tmp_path / "l")) for p in (tmp_path / "l").rglob("*") if p.is_file())
    assert all((tmp_path / "z" / f).read_bytes() == (tmp_path / "l" / f).read_bytes() for f in files)
    pages = [f for f in files if f.startswith("experts/") and f.endswith(".bin")]
    assert pages and all(os.stat(tmp_path / "l" / f).st_ino == os.stat(tmp_path / "u" / f).st_ino for f in pages)
    synth.write(cfg, str(RECIPE), tmp_path / "s1", packed=True, seed=1)
    for kw in ({"pages_from": tmp_path / "s1"}, {"pages_from": tmp_path / "u", "packed": False}):
        with pytest.raises(RQError, match="not a packed checkpoint of this config, recipe and seed"):
            synth.write(cfg, str(RECIPE), tmp_path / "bad", **{"packed": True, "routing": "zipf", **kw})
    assert not (tmp_path / "bad").exists()
