"""The memory budget is a ceiling on the bundled model: with room for 3 experts a layer (and 2, and all 8),
measured peak (MLX's peak over the run and the pager's staging buffer, host memory), with and without speculation,
stays within the budget, with no slack, the plan predicts it within 8%, and the tokens equal an all-resident run's."""

import gc

import mlx.core as mx
import pytest

from rq_core.checkpoint import DEFAULT_MODEL, load
from rq_core.generate import generate
from rq_core.paging.pack import expert_banks, load_index, pack
from rq_core.paging.pager import ExpertPager, budget_for_slots, slots_for_budget

PROMPT = list(range(3, 43))
N = 24


@pytest.fixture(scope="module")
def pages(tmp_path_factory):
    out = tmp_path_factory.mktemp("ceiling") / "pages"
    pack(DEFAULT_MODEL, out=out)
    ref = generate(load(None, tokenizer=False, cpu_float32=True).model, PROMPT, max_tokens=N, prefill_chunk=16)
    return out, ref.tokens


@pytest.mark.parametrize("speculate", ["off", "always"])
@pytest.mark.parametrize("slots", [3, 2, 8])
def test_measured_peak_is_within_the_budget(pages, slots, speculate):
    out, ref = pages
    ck = load(None, tokenizer=False, cpu_float32=True)  # as `rq run` loads it: float32 on the CPU
    index = load_index(DEFAULT_MODEL, pages=out, banks=expert_banks(ck.model))
    ctx = len(PROMPT) + N
    probe = slots_for_budget(ck.model, ck.config, 1 << 40, context=ctx, prefill_chunk=16, index=index)
    budget = budget_for_slots(probe, slots)
    plan = slots_for_budget(ck.model, ck.config, budget, context=ctx, prefill_chunk=16, index=index)
    assert plan["slots_per_layer"] == slots and plan["planned_peak_bytes"] <= budget
    gc.collect()
    mx.clear_cache()
    baseline = mx.get_active_memory()  # what other tests' fixtures still hold
    pager = ExpertPager(ck.model, DEFAULT_MODEL, slots=slots, pages=out, speculate=speculate)
    res = generate(ck.model, PROMPT, max_tokens=N, prefill_chunk=16)
    st = pager.report()
    pager.close()
    measured = res.peak_memory_bytes - baseline + st.staging_bytes
    assert res.tokens == ref
    assert st.misses > 0 and st.staging_bytes > 0
    # the run's peak is its larger phase's; the decode counters are the run's less the prompt's passes
    assert res.peak_memory_bytes == max(res.prefill_peak_memory_bytes, res.decode_peak_memory_bytes)
    assert 0 < res.decode_peak_memory_bytes and 0 < res.prefill_peak_memory_bytes
    dec = res.pager_decode
    assert 0 <= dec["misses"] <= st.misses and 0 < dec["hits"] <= st.hits and dec["bytes_read"] <= st.bytes_read
    assert dec["hit_rate"] == dec["hits"] / (dec["hits"] + dec["misses"])
    if speculate == "off":  # one routing read a MoE layer a step, each naming top-k distinct experts
        moe_layers, top_k = len(pager.layers), pager.top_k
        assert dec["host_syncs"] == moe_layers * (N - 1)
        assert dec["hits"] + dec["misses"] == moe_layers * top_k * (N - 1)
    assert measured <= budget, (measured, budget)
    # the plan against the measured peak: 3.1% to 4.5% above it over these six cases run alone, three times (the cast
    # batch the plan counts is float32 here, the pages' staging besides), 5.3% and 5.6% in two full-suite runs (a
    # prompt's peak moves by ~1% between identical runs, and other tests' leftovers sit in the baseline); 8% is 1.4x the
    # worst
    assert abs(plan["planned_peak_bytes"] - measured) <= 0.08 * measured, (plan["planned_peak_bytes"], measured)


def test_rq_run_with_room_for_3_experts_stays_within_the_budget(pages):
    import json

    from typer.testing import CliRunner

    from rq_cli.main import app

    out, _ = pages
    runner = CliRunner()
    base = ["run", "-p", "to be or not to be, that is the question", "-n", "24", "--temp", "0", "--json"]
    full = json.loads(runner.invoke(app, base).stdout)
    plan = json.loads(runner.invoke(app, base + ["--pages", str(out), "--memory-budget", "1GB", "--plan"]).stdout)["plan"]
    budget = budget_for_slots(plan, 3)
    gc.collect()
    mx.clear_cache()
    baseline = mx.get_active_memory()
    r = runner.invoke(app, base + ["--pages", str(out), "--memory-budget", str(budget)])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert d["pager"]["slots"] == 3 and d["tokens"] == full["tokens"]
    measured = d["peak_memory_bytes"] - baseline + d["pager"]["staging_bytes"]
    assert measured <= budget, (measured, budget)
