"""benchmarks/paper_table.py --tiny end to end on the CPU (a 2-layer Qwen3-30B-A3B slice, written packed, run through
`rq run` in a subprocess under a budget that pages experts): the results file's fields."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_tiny_table_end_to_end(tmp_path):
    out = tmp_path / "paper_table.json"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "paper_table.py"), "--tiny", "--models", "qwen3_moe",
                        "--contexts", "16", "--kv", "isoquant3", "--tokens", "2", "--no-min-budget", "--timeout", "300",
                        "--dir", str(tmp_path / "d"), "--out", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    d = json.loads(out.read_text())
    assert {"date", "machine", "mlx", "command", "routing", "tokens", "tiny", "contexts", "kv", "models",
            "table"} <= set(d)
    (m,) = d["models"]
    assert "error" not in m, m.get("error")
    assert m["checkpoint"]["disk_bytes"] > 0 and (tmp_path / "d").is_dir()
    (c,) = m["cells"]
    assert "error" not in c["run"], c["run"]["error"]
    assert c["kv"] == "isoquant3" and c["run"]["kv_mode"] == "isoquant3"
    run, plan = c["run"], c["plan"]
    assert run["prompt_tokens"] == c["prompt_file_tokens"] and 8 <= run["prompt_tokens"] <= 16
    assert run["generated_tokens"] >= 1 and run["steady_decode_tok_per_s"] > 0 and run["prefill_s"] > 0
    assert 0 < run["peak_memory_bytes"] and run["peak_rss_bytes"] > 0 and run["child_peak_rss_bytes"] > 0
    assert run["kv_bytes"] > 0
    assert plan["fits"] and plan["slots_per_layer"] < plan["experts_per_layer"]  # the budget pages experts
    assert run["pager"]["misses"] > 0 and run["pager"]["hit_rate"] is not None
    assert run["peak_memory_bytes"] == max(run["prefill_peak_memory_bytes"], run["decode_peak_memory_bytes"])
    dec = run["pager_decode"]  # the decode steps' own counters: the breakdown table's
    assert dec["host_syncs"] > 0 and dec["sync_s"] >= 0 and dec["host_s"] >= dec["read_s"] >= 0
    assert 0.5 < c["measured_over_planned"] < 1.5
    assert "| qwen3-30b-a3b |" in d["table"] and "| decode ms | read pages |" in d["table"]
    assert d["host"]["cpu_cores"] >= 1 and d["host"]["accelerator"]
    assert m["checkpoint"]["disk_over_planned"] > 0 and "experts_stored_once" in m["checkpoint"]
    # a warm-up run before the cells (a GPU's first run compiles MLX's kernels), its times in the notes
    assert m["warmup"]["error"] is None and m["warmup"]["prefill_s"] > 0 and m["warmup"]["first_step_s"] >= 0
    assert "after a warm-up `rq run`" in d["table"]


def test_soak_cell_runs_rq_soak_at_the_budget(tmp_path):
    """The table's soak row: `rq soak` at a model's budget in its own process (here the bundled model, packed: the
    real-size slice of the end-to-end test would take half a minute more)."""
    import shutil

    from rq_core.checkpoint import DEFAULT_MODEL
    from rq_core.paging.pack import pack

    ck = tmp_path / "m"
    shutil.copytree(DEFAULT_MODEL, ck)
    pack(ck)
    k = _module().soak_cell(ck, "27MB", "isoquant3", 0.05, tmp_path / "soak.json", 120, max_prompt=8, max_tokens=2)
    assert "error" not in k, k["error"]
    assert k["budget"] == "27MB" and k["samples"] >= 1 and "memory_cv" in k and "throughput_drift" in k
    assert k["rc"] == 0 and k["status"] is not None


def _module():
    from _scripts import load_script

    return load_script("benchmarks/paper_table.py")


def test_budget_overrides_parse_and_refuse_bad_input():
    import pytest

    pt = _module()
    assert pt.parse_budgets(["nemotron_h=19GB", "qwen3_moe=12GB,gemma4=10GiB"]) == {
        "nemotron_h": "19GB", "qwen3_moe": "12GB", "gemma4": "10GiB"}
    assert pt.parse_budgets([]) == {}
    for bad in ("nemotron_h", "llama=16GB", "gemma4=lots"):
        with pytest.raises(SystemExit):
            pt.parse_budgets([bad])


def test_table_names_the_machine_the_budgets_and_the_disk():
    """A CPU run's table says the machine, that its tok/s are not the paper's, which budget each model ran at (and
    that the paper's exceeds the machine), the checkpoint's bytes on disk against the planner's, and the soak."""
    pt = _module()
    plan = {"planned_peak_bytes": 18_000_000_000, "slots_per_layer": 190, "experts_per_layer": 512,
            "min_budget_bytes": 8_000_000_000}
    run = {"prompt_tokens": 64, "peak_memory_bytes": 17_000_000_000, "peak_rss_bytes": 18_500_000_000,
           "steady_decode_tok_per_s": 0.5, "prefill_s": 30.0, "kv_bytes": 1_000_000,
           "pager": {"hit_rate": 0.4}}
    soak = {"budget": "19GB", "kv": "isoquant3", "elapsed_s": 300, "tokens_generated": 40,
            "decode_tok_per_s_mean": 0.4, "memory_cv": 0.01, "memory_growth_bytes_per_hour": 2 ** 20,
            "rss_growth_bytes_per_hour": None, "throughput_drift": -0.05, "peak_memory_bytes": 17e9,
            "peak_rss_bytes": 18e9, "passed": True}
    res = {"routing": "uniform", "tokens": 4,
           "host": {"accelerator": "CPU", "cpu_cores": 2, "memory_bytes": 24 * 2 ** 30},
           "models": [{"config": "nemotron3-super-120b-a12b", "budget": "19GB", "paper_budget": "32GB",
                       "budget_source": "--budget", "paper": {"peak_gb": 17.2, "tok_s": 14.85},
                       "checkpoint": {"planned_bytes": 40.94e9, "disk_bytes": 41.0e9, "write_s": 500.0},
                       "command": "python3 benchmarks/paper_table.py --contexts 64 --kv isoquant3,fp16",
                       "cells": [{"kv": "isoquant3", "context": 64, "plan": plan, "run": run}], "soak": soak},
                      {"config": "qwen3-30b-a3b", "budget": "16GB", "paper_budget": "16GB",
                       "budget_source": "paper", "paper": {"peak_gb": 6.8, "tok_s": 15.6}, "cells": []}]}
    t = pt.table(res)
    assert ("| nemotron3-super-120b-a12b | 19GB | isoquant3 | 64 | 190 / 512 | 18.00 | 17.00 | 18.50 | 0.94, 1.03 "
            "| 0.500 |") in t
    # the cell its command asked for that the run did not reach
    assert "| nemotron3-super-120b-a12b | 19GB | fp16 | 64 | - | - | not measured: the run stopped before" in t
    assert "Measured on the CPU (2 cores, 24 GiB of memory)" in t and "not comparable" in t
    assert "nemotron3-super-120b-a12b 19GB (set by --budget: the paper's 32GB is more than this machine's 24 GiB)" in t
    assert "qwen3-30b-a3b 16GB (the paper's)" in t
    assert "| nemotron3-super-120b-a12b | 40.94 | 41.00 | 1.001 | 500.0 |" in t
    assert "| nemotron3-super-120b-a12b | 19GB | isoquant3 | 5.0 | 40 | 0.40 | 1.00% | +1.0 | - | -5.0% |" in t


def test_step_table_counts_steps_exactly():
    """A paged run's steps come from decode_steps, else rate x time rounded: (1/49) * 49 is 0.9999999999999999 in
    floats, and a one-step run (--tokens 2) must still get its row."""
    pt = _module()
    pd = {"misses": 10, "read_s": 0.5, "sync_s": 1.0, "host_s": 2.0, "bytes_read": 4e6}
    run = {"prompt_tokens": 16, "decode_tok_per_s": 1 / 49, "decode_s": 49.0, "pager_decode": pd}
    assert (1 / 49) * 49 < 1
    res = {"models": [{"config": "qwen3-30b-a3b", "budget": "1GB", "cells": [{"kv": "fp16", "run": run}]}]}
    (row,) = [x for x in pt.step_table(res) if x.startswith("| qwen3")]
    assert row == "| qwen3-30b-a3b | 1GB | fp16 | 16 | 49000.0 | 500.0 | 1000.0 | 1500.0 | 46000.0 | 10.0 | 4.0 | - |"
    # steps queued whole, those that fell back, whether the pager stopped queuing them
    pd.update(queued=3, queue_fallbacks=3, queue_stopped=True)
    (row,) = [x for x in pt.step_table(res) if x.startswith("| qwen3")]
    assert row.endswith("| 10.0 | 4.0 | 3 (3, then by stretch) |")
    pd.update(queued=20, queue_fallbacks=0, queue_stopped=False)
    (row,) = [x for x in pt.step_table(res) if x.startswith("| qwen3")]
    assert row.endswith("| 4.0 | 20 (0) |")
    run["decode_steps"] = 7  # recorded: taken as is
    (row,) = [x for x in pt.step_table(res) if x.startswith("| qwen3")]
    assert row.startswith("| qwen3-30b-a3b | 1GB | fp16 | 16 | 7000.0 | 71.4 |")
    # a cell with a slot for every expert pages nothing once the prompt has read them: no row
    res["models"][0]["cells"][0]["plan"] = {"slots_per_layer": 128, "experts_per_layer": 128}
    assert pt.step_table(res) == []
    res["models"][0]["cells"][0]["plan"] = {"slots_per_layer": 8, "experts_per_layer": 128}
    assert len([x for x in pt.step_table(res) if x.startswith("| qwen3")]) == 1


def test_rows_merged_from_two_machines_each_name_their_own():
    """A GPU row merged beside rows from a CPU run: the table names each model's machine (not the newest run's for
    all), and still says that the CPU's speeds are not the paper's."""
    pt = _module()
    gpu = {"accelerator": "NVIDIA H200", "cpu_cores": 16, "memory_bytes": 126 * 2 ** 30}
    cpu = {"accelerator": "CPU", "cpu_cores": 2, "memory_bytes": 24 * 2 ** 30}
    model = {"budget": "16GB", "paper_budget": "16GB", "budget_source": "paper", "paper": None, "cells": []}
    res = {"routing": "uniform", "tokens": 4, "host": gpu,
           "models": [{**model, "config": "nemotron3-super-120b-a12b", "host": gpu},
                      {**model, "config": "qwen3-30b-a3b", "host": cpu}]}
    t = pt.table(res)
    assert ("Measured on: nemotron3-super-120b-a12b NVIDIA H200 (16 cores, 126 GiB of memory); qwen3-30b-a3b the "
            "CPU (2 cores, 24 GiB of memory).") in t
    assert "not comparable" in t
    res["models"][1]["host"] = gpu
    t = pt.table(res)
    assert "Measured on NVIDIA H200 (16 cores, 126 GiB of memory)." in t and "not comparable" not in t


def test_render_rewrites_the_table_and_keeps_the_runs_metadata(tmp_path):
    f = tmp_path / "pt.json"
    f.write_text(json.dumps({"date": "2000-01-01 00:00 UTC", "machine": "m", "mlx": "0", "command": "cmd",
                             "routing": "uniform", "tokens": 4, "models": [], "table": "stale"}))
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "paper_table.py"), "--render", "--out", str(f)],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    d = json.loads(f.read_text())
    assert d["table"] != "stale" and "| model | budget |" in d["table"]
    assert (d["date"], d["command"]) == ("2000-01-01 00:00 UTC", "cmd")


def test_merge_keeps_one_models_uniform_and_zipf_rows_side_by_side():
    """A --routing zipf run of a model merged into a file with its uniform rows (an older file: the routing only at
    its top) keeps both, uniform first; every table names each row's routing. A rerun at one routing replaces only
    that routing's rows, and a file of one routing renders its rows without it."""
    pt = _module()
    cpu = {"accelerator": "CPU", "cpu_cores": 2, "memory_bytes": 24 * 2 ** 30}
    pd = {"misses": 10, "read_s": 0.5, "sync_s": 1.0, "host_s": 2.0, "bytes_read": 4e6}

    def entry(hit_rate: float, **kw) -> dict:
        run = {"prompt_tokens": 16, "peak_memory_bytes": 5e9, "peak_rss_bytes": 6e9, "steady_decode_tok_per_s": 2.0,
               "prefill_s": 1.0, "kv_bytes": 1e6, "decode_tok_per_s": 2.0, "decode_s": 4.0, "decode_steps": 8,
               "pager": {"hit_rate": hit_rate}, "pager_decode": {**pd, "hit_rate": hit_rate}}
        soak = {"budget": "16GB", "kv": "isoquant3", "elapsed_s": 60, "tokens_generated": 8,
                "decode_tok_per_s_mean": 2.0, "memory_cv": 0.01, "memory_growth_bytes_per_hour": 0,
                "rss_growth_bytes_per_hour": 0, "throughput_drift": 0.0, "peak_memory_bytes": 5e9,
                "peak_rss_bytes": 6e9, "passed": True}
        return {"model": "qwen3_moe", "config": "qwen3-30b-a3b", "budget": "16GB", "paper_budget": "16GB",
                "budget_source": "paper", "paper": None, "host": cpu, "contexts": [16], "kv": ["isoquant3"],
                "checkpoint": {"planned_bytes": 10e9, "disk_bytes": 10e9, "write_s": 5.0}, "soak": soak,
                "cells": [{"kv": "isoquant3", "context": 16, "plan": {}, "run": run}], **kw}

    old = {"routing": "uniform", "tiny": False, "tokens": 4, "host": cpu, "models": [entry(0.4)]}
    # one routing: the rows as before, no routing in the model cells
    assert "| qwen3-30b-a3b | 16GB | isoquant3 | 16 |" in pt.table(old) and "(uniform)" not in pt.table(old)
    assert "routing uniform)" in pt.table(old)

    zipf = {"routing": "zipf:1.1", "tiny": False, "tokens": 4, "host": cpu,
            "models": [entry(0.8, routing="zipf:1.1")]}
    kept = pt.kept_rows(old, False, ["qwen3_moe"], "zipf:1.1")
    assert [m["routing"] for m in kept] == ["uniform"]  # the old file's top-level routing, not this run's
    res = {**zipf, "models": pt.in_order(zipf["models"] + kept)}
    assert [m["routing"] for m in res["models"]] == ["uniform", "zipf:1.1"]
    t = pt.table(res)
    for cell in ("qwen3-30b-a3b (uniform)", "qwen3-30b-a3b (zipf:1.1)"):
        assert f"| {cell} | 16GB | isoquant3 | 16 |" in t  # the main table
        assert f"| {cell} | 16GB | isoquant3 | 16 | 500.0 |" in t  # the step breakdown
        assert f"| {cell} | 10.00 | 10.00 |" in t  # the checkpoint
        assert f"| {cell} | 16GB | isoquant3 | 1.0 | 8 |" in t  # the soak
    assert "40.0%" in t and "80.0%" in t
    assert "routing uniform or zipf:1.1" in t and "routing uniform)" not in t

    # a uniform rerun replaces the uniform rows and keeps the zipf ones; "zipf" is zipf:1 ("zipf:1.0" too)
    assert [m["routing"] for m in pt.kept_rows(res, False, ["qwen3_moe"], "uniform")] == ["zipf:1.1"]
    assert pt.kept_rows(res, False, ["gemma4"], "uniform") == pt.kept_rows(res, False, [], "uniform")
    assert len(pt.kept_rows(res, False, ["gemma4"], "uniform")) == 2
    assert pt.canonical_routing("zipf") == pt.canonical_routing("zipf:1.0") == "zipf:1"
    assert pt.kept_rows(res, True, [], "uniform") == []  # a --tiny run does not mix with real-size rows


def test_the_notes_give_each_models_token_count_where_merged_runs_differ():
    """Rows merged from runs that decoded different numbers of tokens: the notes name each model's, not the newest
    run's for all; one number where they agree."""
    pt = _module()

    def model(config: str, n: int) -> dict:
        return {"config": config, "cells": [{"run": {"generated_tokens": n}}, {"run": {"generated_tokens": n - 1}}]}

    res = {"tokens": 4, "models": [model("nemotron3-super-120b-a12b", 24), model("qwen3-30b-a3b", 4)]}
    assert pt.greedy_tokens(res) == "greedy tokens (nemotron3-super-120b-a12b 24; qwen3-30b-a3b 4)"
    res["models"][0] = model("nemotron3-super-120b-a12b", 4)
    assert pt.greedy_tokens(res) == "4 greedy tokens"
