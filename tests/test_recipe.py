"""Recipes: bundled ones load; every validation problem is one clear line; round trip."""

import pytest

from rq_core.quant import recipe
from rq_core.errors import RQError

BASE = 'version = 1\nname = "t"\n'


def test_bundled_recipes_load():
    names = recipe.bundled()
    for n in ["nemotron-32gb", "qwen3-16gb", "gemma4-16gb", "shakespeare-moe"]:
        assert n in names
        r = recipe.load(n)
        assert r.roles["routed_expert"].bits == 2
        assert r.roles["attention"].method == "gptq"


def test_resolved_round_trip():
    r = recipe.load("nemotron-32gb")
    r2 = recipe.loads(r.dumps())
    assert r2.to_dict() == r.to_dict()
    assert r2.roles["router"].bits is None and r2.promote.kurtosis_threshold == 5.0
    assert r2.kv.mode == "isoquant3" and r2.pager.memory_budget == "32GB"


@pytest.mark.parametrize("text,match", [
    (BASE + "[roles.attention]\nbitz = 4\n", "unknown key 'roles.attention.bitz'"),
    (BASE + "[roles.atention]\nbits = 4\n", "unknown key 'roles.atention'"),
    (BASE + "colour = 1\n", "unknown key 'colour'"),
    (BASE + "[roles.attention]\nbits = 7\n", r"roles.attention.bits = 7 is not one of 2, 3, 4, 5, 6, 8"),
    (BASE + "[roles.attention]\nbits = 1\n", "is not one of"),
    (BASE + "[roles.attention]\ngroup_size = 48\n", "group_size = 48"),
    (BASE + "[roles.routed_expert]\nmethod = \"gptq\"\n", "applies only to"),
    (BASE + "family = \"llama\"\n", "family 'llama'"),
    (BASE + "[kv]\nmode = \"int4\"\n", "kv.mode"),
    (BASE + "[kv]\nwindow = 3\n", "unknown key 'kv.window'"),
    (BASE + "[kv]\nkey_bits = 5\n", "kv.key_bits = 5 must be between 1 and 4"),
    (BASE + "[kv]\npair_points = [128, 33]\n", "kv.pair_points = \\[128, 33\\] must each be one of"),
    (BASE + "[kv]\npair_points = 128\n", "kv.pair_points must be two integers"),
    (BASE + "[kv]\npair_points = [128, 32]\nkey_bits = 4\n", "cannot both be set"),
    (BASE + "[kv]\nprefill_fp16 = -1\n", "kv.prefill_fp16 = -1 must be >= 0"),
    (BASE + "[kv]\nprefill_fp16 = \"most\"\n", "kv.prefill_fp16 must be a token count or 'all'"),
    (BASE + "[kv]\nprefill_fp16 = 1.5\n", "kv.prefill_fp16 must be a token count or 'all'"),
    (BASE + "[kv]\nedge_layers = -1\n", "kv.edge_layers must be >= 0"),
    (BASE + "[kv]\nedge_layers = true\n", "kv.edge_layers must be an integer"),
    (BASE + "[kv]\nedge_bits = 5\n", "kv.edge_bits must be 2, 3 or 4"),
    (BASE + "[kv]\nedge_bits = 1\n", "kv.edge_bits must be 2, 3 or 4"),
    (BASE + "[pager]\npolicy = \"fifo\"\n", "pager.policy"),
    (BASE + "[pager]\nmemory_budget = \"lots\"\n", "cannot read 'lots'"),
    ('version = 2\n', "'version' must be 1"),
    ('version = 1\n[roles\n', "not valid TOML"),
])
def test_validation_is_one_line(text, match):
    with pytest.raises(RQError, match=match) as e:
        recipe.loads(text, "x.toml")
    assert "\n" not in str(e.value) and str(e.value).startswith("x.toml")


def test_recipe_for_another_family_and_group_dims():
    r = recipe.load("qwen3-16gb")
    with pytest.raises(RQError, match="is for qwen3_moe models, this model is nemotron_h"):
        recipe.check_against(r, {"model_type": "nemotron_h"}, {})
    with pytest.raises(RQError, match="does not divide dimension 96"):
        recipe.check_against(r, {"model_type": "qwen3_moe"}, {"attention": [("q.weight", (64, 96))]})


def test_kv_settings_and_sizes():
    r = recipe.loads(BASE + '[kv]\nmode = "isoquant3"\nrotation = "so3"\nseed = 7\n')
    from rq_core.cache.kv_cache import KVSettings

    assert isinstance(r.kv, KVSettings) and r.kv.rotation == "so3" and r.kv.seed == 7
    assert r.kv.key_bits is None and "key_bits" not in r.dumps()  # TOML has no null: left out when unset
    r4 = recipe.loads(BASE + '[kv]\nmode = "isoquant3"\nkey_bits = 4\n')
    assert r4.kv.key_bits == 4 and recipe.loads(r4.dumps()).kv.key_bits == 4
    rp = recipe.loads(BASE + '[kv]\nmode = "isoquant3"\npair_points = [128, 32]\n')
    assert rp.kv.pair_points == (128, 32) and recipe.loads(rp.dumps()).kv.pair_points == (128, 32)
    # kv.prefill_fp16: the default bound, a count, or "all" (the whole prompt; written back as "all", since a key left
    # out would read back as the default)
    from rq_core.cache.kv_cache import DEFAULT_PREFILL_FP16

    assert r.kv.prefill_fp16 == DEFAULT_PREFILL_FP16 == recipe.loads(r.dumps()).kv.prefill_fp16
    ra = recipe.loads(BASE + '[kv]\nmode = "isoquant3"\nprefill_fp16 = "all"\n')
    assert ra.kv.prefill_fp16 is None and recipe.loads(ra.dumps()).kv.prefill_fp16 is None
    assert recipe.loads(BASE + '[kv]\nprefill_fp16 = 0\n').kv.prefill_fp16 == 0
    # kv.edge_layers: the default where a recipe leaves it out, written back and read again
    from rq_core.cache.kv_cache import DEFAULT_EDGE_LAYERS

    assert r.kv.edge_layers == DEFAULT_EDGE_LAYERS == 1 and r.kv.edge_bits == 4
    r0 = recipe.loads(BASE + '[kv]\nedge_layers = 0\n')
    assert r0.kv.edge_layers == 0 and recipe.loads(r0.dumps()).kv.edge_layers == 0
    assert recipe.parse_size("16GB") == 16 * 10**9
    assert recipe.parse_size("512MiB") == 512 * 2**20
    assert recipe.parse_size("1.5G") == 1.5e9


def test_unknown_recipe_name():
    with pytest.raises(RQError, match="no recipe 'nope'.*qwen3-16gb"):
        recipe.load("nope")


def test_kv_config_sets_recipe_keys_with_the_recipes_checks():
    """--kv-config KEY=VALUE: any [kv] key, parsed as the recipe's TOML value and checked by the same code."""
    base = recipe.load("qwen3-16gb").kv
    kv = recipe.apply_kv_config(base, ["pair_points=off", "kv.edge_layers=0", "rotation=so3", "prefill_fp16=all",
                                       "value_gain=off", "fp16-window=8"])
    assert kv.pair_points == () and kv.edge_layers == 0 and kv.rotation == "so3" and kv.prefill_fp16 is None
    assert kv.value_gain is False and kv.fp16_window == 8 and kv.mode == base.mode
    assert recipe.apply_kv_config(base, ["pair_points=64,64"]).pair_points == (64, 64)
    assert recipe.apply_kv_config(base, ["prefill_fp16=48"]).prefill_fp16 == 48
    # later settings win; `default` unsets pair_points so key_bits can be set
    assert recipe.apply_kv_config(base, ["fp16_window=8", "fp16_window=2"]).fp16_window == 2
    kb = recipe.apply_kv_config(recipe.apply_kv_config(base, ["pair_points=128,32"]),
                                ["pair_points=default", "key_bits=4"])
    assert kb.key_bits == 4 and kb.pair_points is None
    assert recipe.apply_kv_config(base, []) is base


@pytest.mark.parametrize("items, match", [
    (["pair_points=128,33"], r"kv.pair_points = \[128, 33\] must each be one of"),
    (["pair_points=lots"], "kv.pair_points must be two integers"),
    (["window=3"], "unknown key 'kv.window'"),
    (["edge_layers=-1"], "kv.edge_layers must be >= 0"),
    (["fp16_window=abc"], "'kv.fp16_window' must be an integer"),
    (["key_bits=5"], "kv.key_bits = 5 must be between 1 and 4"),
    (["prefill_fp16=most"], "kv.prefill_fp16 must be a token count or 'all'"),
    (["value_gain=maybe"], "kv.value_gain must be on or off"),
    (["rotation=bogus"], "kv.rotation = 'bogus' is not one of"),
    (["pair_points=128,32", "key_bits=4"], "cannot both be set"),
    (["mode=fp16"], "set with --kv"),
    (["edge_layers"], "takes KEY=VALUE"),
])
def test_kv_config_errors_are_one_line(items, match):
    with pytest.raises(RQError, match=match) as e:
        recipe.apply_kv_config(recipe.load("qwen3-16gb").kv, items)
    assert "\n" not in str(e.value) and str(e.value).startswith("--kv-config")
