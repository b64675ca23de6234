"""The paper's headline table measured on our checkpoints, through the real CLI: real-size synthetic checkpoints of
Nemotron 3 Super 120B-A12B (nemotron-32gb, 32 GB), Qwen3-30B-A3B (qwen3-16gb, 16 GB) and Gemma 4 26B-A4B
(gemma4-16gb, 16 GB), each `rq run CKPT --memory-budget B --kv MODE --prompt-file F --json` in its own process.

    python3 benchmarks/paper_table.py --dir /data/rq-paper                      # GPU, see benchmarks/README.md
    python3 benchmarks/paper_table.py --tiny --dir /tmp/rq-paper-tiny           # 2-layer slices, CPU check
    python3 benchmarks/paper_table.py --dir /tmp/rq-paper --delete-after \
        --budget nemotron_h=19GB --contexts 64 --tokens 4 --timeout 3600        # real size on a CPU machine

Per model: the checkpoint (rq_core.tools.synth: random codes at the recipe's bits in rq quantize's layout, written
packed: the routed experts once, in CKPT/experts, as `rq pack --move` leaves them), reused from --dir when complete;
its bytes on disk against the planner's weight bytes (at most DISK_MARGIN times: each expert stored once).
Per context and KV mode: `rq run --plan --json` (the planner's peak, expert slots a layer and smallest budget), then
the run: MLX peak and peak RSS (the JSON's, and the child's from wait4), steady decode tok/s, time to first token
(the prefill), pager hit rate, KV bytes; measured / planned peak. Then one run at the smallest budget the plan
names. With --soak-minutes, `rq soak` at the model's budget (memory CV, growth slope, throughput drift). A cell that
fails or passes --timeout is recorded with its error; the others' results are kept. Writes
benchmarks/results/paper_table.json (or --out) after every cell.

Budgets: the paper's (the recipe's: 32 GB for Nemotron, 16 GB for the others) unless `--budget FAMILY=SIZE` sets
one; a budget larger than this machine's memory cannot be honoured (a machine of 24 GiB runs the 120B at ~19 GB:
fewer experts a layer stay resident, the plan says how many). The results file and its table name the machine
(accelerator, CPU cores, memory) and each model's budget and where it came from; decode speeds measured on a CPU are
not comparable with the paper's Apple M4 Max numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import _readme  # noqa: E402

MODELS = {  # family -> (config in tests/data/configs, recipe, budget, the paper's (peak GB, tok/s) on an M4 Max)
    "nemotron_h": ("nemotron3-super-120b-a12b", "nemotron-32gb", "32GB", (17.2, 14.85)),
    "qwen3_moe": ("qwen3-30b-a3b", "qwen3-16gb", "16GB", (6.8, 15.60)),
    "gemma4": ("gemma4-26b-a4b", "gemma4-16gb", "16GB", (5.4, 12.85)),
}
TEXTS = [ROOT / "rq_core" / "assets" / "heldout.txt", ROOT / "rq_core" / "assets" / "calibration.txt"]
DISK_MARGIN = 1.05  # pages' alignment padding and metadata over the planner's weight bytes


def rq_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "rq_cli.main", *args]


def run_child(cmd: list[str], timeout: float) -> dict:
    """Run `cmd` (its own process group) for at most `timeout` s: rc, stdout, stderr tail, wall s and the child's peak
    RSS from wait4 (bytes), measured even when it fails."""
    import tempfile

    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    t0 = time.perf_counter()
    with tempfile.TemporaryFile() as fo, tempfile.TemporaryFile() as fe, open(os.devnull, "rb") as devnull:
        p = subprocess.Popen(cmd, stdin=devnull, stdout=fo, stderr=fe, cwd=ROOT, env=env, preexec_fn=os.setsid)
        timed_out = False
        while True:
            pid, status, ru = os.wait4(p.pid, os.WNOHANG)
            if pid:
                break
            if time.perf_counter() - t0 > timeout:
                timed_out = True
                os.killpg(p.pid, signal.SIGKILL)
                pid, status, ru = os.wait4(p.pid, 0)
                break
            time.sleep(0.1)
        p.returncode = os.waitstatus_to_exitcode(status)
        fo.seek(0)
        fe.seek(0)
        out, err = fo.read(), fe.read()
    rss = int(ru.ru_maxrss if sys.platform == "darwin" else ru.ru_maxrss * 1024)
    return {"rc": None if timed_out else p.returncode, "timed_out": timed_out, "stdout": out.decode(errors="replace"),
            "stderr": err.decode(errors="replace")[-2000:], "wall_s": round(time.perf_counter() - t0, 2),
            "child_peak_rss_bytes": rss}


def parse_json(text: str) -> dict | None:
    i = text.find("{")
    if i < 0:
        return None
    try:
        return json.JSONDecoder().raw_decode(text[i:])[0]
    except ValueError:
        return None


def error_line(r: dict) -> str:
    if r["timed_out"]:
        return f"timed out after {r['wall_s']:.0f} s"
    lines = [ln for ln in r["stderr"].strip().splitlines() if ln.strip()]
    return f"exit {r['rc']}: {lines[-1][:300] if lines else '(no message)'}"


def prompt_file(d: Path, n: int) -> tuple[Path, int]:
    """A text file of about `n` tokens of the bundled tokenizer (the checkpoints' tokenizer): the package's held-out
    and calibration text, repeated, cut at n tokens. Returns (path, its token count)."""
    from rq_core.checkpoint import DEFAULT_MODEL
    from rq_core.tokenizer import load_tokenizer

    f = d / f"prompt-{n}.txt"
    meta = d / f"prompt-{n}.json"
    if f.is_file() and meta.is_file():
        return f, json.loads(meta.read_text())["tokens"]
    tok = load_tokenizer(DEFAULT_MODEL)
    base = "\n\n".join(t.read_text() for t in TEXTS if t.is_file())
    ids = tok.encode(base)
    reps = -(-n // max(1, len(ids))) + 1
    ids = tok.encode("\n\n".join([base] * reps))[:n]
    text = tok.decode(ids)
    for _ in range(8):  # a cut between two merges can re-encode longer: trim until it fits
        m = len(tok.encode(text))
        if m <= n:
            break
        ids = ids[:-(m - n)]
        text = tok.decode(ids)
    d.mkdir(parents=True, exist_ok=True)
    f.write_text(text)
    meta.write_text(json.dumps({"tokens": len(tok.encode(text))}))
    return f, json.loads(meta.read_text())["tokens"]


def disk_bytes(p: Path) -> int:
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())


RUN_KEYS = ("prompt_tokens", "generated_tokens", "stop_reason", "prefill_s", "prefill_tok_per_s", "decode_tok_per_s",
            "steady_decode_tok_per_s", "first_step_s", "decode_s", "peak_memory_bytes", "prefill_peak_memory_bytes",
            "decode_peak_memory_bytes", "peak_rss_bytes", "kv_bytes", "kv_bytes_fp16", "kv_mode")
WARMUP_TOKENS = 4  # tokens of each model's warm-up run (its first KV mode, before the cells)
WARMUP_PROMPT = 512  # the warm-up's prompt tokens at most: one whole prefill chunk
PAGER_KEYS = ("hit_rate", "hits", "misses", "bytes_read", "evictions", "slots")
# the pager's counters over the decode steps alone: a step's time apart (reading pages, waiting for the routing)
PAGER_DECODE_KEYS = PAGER_KEYS + ("host_syncs", "sync_s", "host_s", "read_s", "speculated", "respun", "reruns",
                                  "queued", "queue_fallbacks", "queue_stopped")
PLAN_KEYS = ("planned_peak_bytes", "min_budget_bytes", "slots_per_layer", "experts_per_layer", "top_k", "fits",
             "resident_bytes", "kv_bytes", "budget_bytes")


def plan_cell(ckpt: Path, budget: str, kv: str, pf: Path, tokens: int, timeout: float) -> dict:
    r = run_child(rq_cmd("run", str(ckpt), "--raw", "--memory-budget", budget, "--kv", kv, "--prompt-file", str(pf),
                         "--max-tokens", str(tokens), "--plan", "--json"), timeout)
    d = parse_json(r["stdout"])
    if d is None or "plan" not in d:
        return {"error": error_line(r)}
    return {k: d["plan"].get(k) for k in PLAN_KEYS}


def run_cell(ckpt: Path, budget: str, kv: str, pf: Path, tokens: int, timeout: float) -> dict:
    r = run_child(rq_cmd("run", str(ckpt), "--raw", "--memory-budget", budget, "--kv", kv, "--prompt-file", str(pf),
                         "--max-tokens", str(tokens), "--temp", "0", "--json"), timeout)
    d = parse_json(r["stdout"]) if r["rc"] == 0 else None
    if d is None or "peak_memory_bytes" not in d:
        return {"error": error_line(r), "wall_s": r["wall_s"], "child_peak_rss_bytes": r["child_peak_rss_bytes"]}
    out = {k: d.get(k) for k in RUN_KEYS}
    out["pager"] = {k: (d.get("pager") or {}).get(k) for k in PAGER_KEYS}
    if d.get("pager_decode"):
        out["pager_decode"] = {k: d["pager_decode"].get(k) for k in PAGER_DECODE_KEYS}
    out["wall_s"] = r["wall_s"]
    out["child_peak_rss_bytes"] = r["child_peak_rss_bytes"]
    return out


SOAK_KEYS = ("samples", "generations", "tokens_generated", "peak_rss_bytes", "peak_memory_bytes", "memory_cv",
             "memory_growth_bytes_per_hour", "decode_tok_per_s_mean", "throughput_drift", "passed", "failures")


def soak_cell(ckpt: Path, budget: str, kv: str, minutes: float, report: Path, timeout: float, *,
              max_prompt: int = 256, max_tokens: int = 64) -> dict:
    """`rq soak CKPT --minutes M --memory-budget B --kv KV --json` in its own process: the summary's memory CV,
    growth slope (MLX active memory, bytes an hour), throughput drift (start to end) and peaks."""
    r = run_child(rq_cmd("soak", str(ckpt), "--minutes", f"{minutes:g}", "--memory-budget", budget, "--kv", kv,
                         "--max-prompt", str(max_prompt), "--max-tokens", str(max_tokens),
                         "--report", str(report), "--json"), timeout)
    d = parse_json(r["stdout"])
    if d is None or "summary" not in d:
        return {"error": error_line(r), "wall_s": r["wall_s"], "child_peak_rss_bytes": r["child_peak_rss_bytes"]}
    sm = d["summary"]
    out = {k: sm.get(k) for k in SOAK_KEYS}
    out.update(rss_growth_bytes_per_hour=(sm.get("rss_growth") or {}).get("slope_bytes_per_hour"),
               status=d.get("status"), elapsed_s=d.get("elapsed_s"), rc=r["rc"], wall_s=r["wall_s"],
               child_peak_rss_bytes=r["child_peak_rss_bytes"], kv=kv, budget=budget, minutes=minutes,
               max_prompt=max_prompt, max_tokens=max_tokens)
    return out


def parse_budgets(items: list[str]) -> dict[str, str]:
    """['nemotron_h=19GB', 'qwen3_moe=12GB,gemma4=12GB'] -> {family: size}; an unknown family or an unreadable
    size fails before any work."""
    from rq_core.quant.recipe import parse_size

    out: dict[str, str] = {}
    for item in items:
        for part in filter(None, (x.strip() for x in item.split(","))):
            fam, eq, size = part.partition("=")
            if not eq or fam not in MODELS:
                raise SystemExit(f"error: --budget {part!r}: give FAMILY=SIZE with FAMILY one of {', '.join(MODELS)} "
                                 "(e.g. nemotron_h=19GB)")
            try:
                parse_size(size, "--budget")
            except Exception as e:
                raise SystemExit(f"error: --budget {part!r}: {e}")
            out[fam] = size
    return out


def host() -> dict:
    """What the cells ran on: the accelerator MLX uses (a GPU's name, else "CPU"), CPU cores, physical memory."""
    import mlx.core as mx

    acc = "CPU"
    if mx.default_device().type == mx.DeviceType.gpu:
        acc = str(mx.device_info().get("device_name", "GPU"))
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        mem = None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"accelerator": acc, "cpu_cores": cores, "memory_bytes": mem}


def gb(n) -> str:
    return "-" if n is None else f"{n / 1e9:.2f}"


def routing_of(m: dict, res: dict) -> str:
    """A model entry's routing; an older file's entries have none: its top-level one (one routing a file then)."""
    return m.get("routing") or res.get("routing") or "uniform"


def routings(res: dict) -> list[str]:
    """The routings of the table's rows, uniform first."""
    return sorted({routing_of(m, res) for m in res["models"]}, key=lambda r: (r != "uniform", r))


def model_cell(m: dict, res: dict) -> str:
    """A row's model cell: its config, and its routing where the rows have more than one (one model's uniform and
    zipf rows side by side)."""
    return f"{m['config']} ({routing_of(m, res)})" if len(routings(res)) > 1 else m["config"]


def canonical_routing(text: str) -> str:
    """--routing as one spelling ("zipf" and "zipf:1" are one routing): what --merge matches rows by."""
    from rq_core.tools import synth

    kind, exp = synth.parse_routing(text)
    return kind if kind == "uniform" else f"{kind}:{exp:g}"


def table(res: dict) -> str:
    lines = ["| model | budget | KV | context | expert slots / layer | planned peak GB | MLX peak GB (prefill, decode) "
             "| RSS GB | measured/planned (MLX, RSS) | decode tok/s | TTFT s | hit rate (decode) | KV MB "
             "| paper: peak GB, tok/s |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for m in res["models"]:
        paper = f"{m['paper']['peak_gb']}, {m['paper']['tok_s']}" if m["paper"] else "-"
        rows = [(m["budget"], c) for c in m["cells"]]
        done = {(c.get("context"), c.get("kv")) for c in m["cells"]}
        rows += [(m["budget"], {"context": ctx, "kv": kv, "run": {"skipped": "not measured: the run stopped "
                                                                             "before this cell"}})
                 for ctx, kv in planned_cells(m) if (ctx, kv) not in done and not m.get("error")]
        if m.get("min_budget"):
            rows.append((f"min {gb(m['min_budget'].get('budget_bytes'))} GB", m["min_budget"]))
        if m.get("error"):
            lines.append(f"| {model_cell(m, res)} | {m['budget']} | - | - | - | error: {m['error']} | | | | | | | | "
                         f"{paper} |")
        for budget, c in rows:
            r, p = c.get("run") or {}, c.get("plan") or {}
            if r.get("skipped"):
                lines.append(f"| {model_cell(m, res)} | {budget} | {c.get('kv')} | {c.get('context')} | - | - | "
                             f"{r['skipped']} | | | | | | | {paper} |")
                continue
            if "error" in r or "error" in p or not r:
                err = r.get("error") or p.get("error") or "not run"
                lines.append(f"| {model_cell(m, res)} | {budget} | {c.get('kv')} | {c.get('context')} | {slots(p)} | "
                             f"{gb(p.get('planned_peak_bytes'))} | error: {err} | | | | | | | {paper} |")
                continue
            pd = r.get("pager_decode")
            hr = (pd or r["pager"]).get("hit_rate")
            hr = "-" if hr is None else f"{100 * hr:.1f}%" + ("" if pd else " (whole run)")
            pk = p.get("planned_peak_bytes")
            phases = (f" ({gb(r['prefill_peak_memory_bytes'])}, {gb(r['decode_peak_memory_bytes'])})"
                      if r.get("decode_peak_memory_bytes") else "")
            ratio = "-" if not pk else f"{r['peak_memory_bytes'] / pk:.2f}, {r['peak_rss_bytes'] / pk:.2f}"
            lines.append(
                f"| {model_cell(m, res)} | {budget} | {c['kv']} | {r['prompt_tokens']:,} | {slots(p)} | {gb(pk)} | "
                f"{gb(r['peak_memory_bytes'])}{phases} | {gb(r['peak_rss_bytes'])} | "
                f"{ratio} | {rate(r['steady_decode_tok_per_s'])} | "
                f"{r['prefill_s']:.2f} | {hr} | {r['kv_bytes'] / 1e6:.1f} | {paper} |")
    # the notes as one paragraph (the README shows this table)
    rs = routings(res)
    routing = rs[0] if len(rs) == 1 else " or ".join(rs) + ", each row's in brackets after its model"
    notes = [f"Synthetic checkpoints (random weights at the recipe's bits, routing {routing}), "
             f"{greedy_tokens(res)} after a prompt of the context's length; every cell one `rq run` "
             "process. Decode tok/s: steady (first step apart). TTFT: the prefill. The paper's numbers: Apple M4 Max, "
             "its own checkpoints."]
    if any(r != "uniform" for r in rs):
        notes.append("Uniform routers spread the tokens evenly over the experts, a harder case for the pager than a "
                     "trained model's routing; zipf:S skews each router's choices by a Zipf law of exponent S (a few "
                     "experts chosen most).")
    warm = [m for m in res["models"] if (m.get("warmup") or {}).get("prefill_s") is not None]
    if warm:
        notes.append(f"Each model's cells ran after a warm-up `rq run` ({WARMUP_TOKENS} tokens after a prompt of up to "
                     f"{WARMUP_PROMPT}), whose kernels MLX compiled into its disk cache where an earlier run had "
                     "not (the warm-up's TTFT, first decode step): "
                     + "; ".join(f"{model_cell(m, res)} {m['warmup']['prefill_s']:.1f} s, "
                                 f"{m['warmup']['first_step_s']:.1f} s" for m in warm) + ".")
    cmds = {m.get("command") for m in res["models"] if m.get("command")}
    if len(cmds) > 1:  # rows of several runs (--merge)
        notes.append("Rows from several runs (`--merge`): each model's command and date are in the results file.")
    h = res.get("host")
    hosts = [m.get("host") or h for m in res["models"]]
    if any(hosts):
        if all(x == hosts[0] for x in hosts):
            notes.append(f"Measured on {where(hosts[0])}.")
        else:  # rows merged from runs on different machines: each model's
            notes.append("Measured on: " + "; ".join(f"{model_cell(m, res)} {where(x)}"
                                                    for m, x in zip(res["models"], hosts) if x) + ".")
        if any(x and x["accelerator"] == "CPU" for x in hosts):
            notes.append("Decode tok/s and TTFT measured on a CPU are not comparable with the paper's Apple M4 Max "
                         "numbers.")
    budgets = [f"{model_cell(m, res)} {m['budget']}" + budget_note(m, m.get("host") or h) for m in res["models"]
               if m.get("budget_source") != "tiny"]
    if budgets:
        notes.append("Budgets: " + "; ".join(budgets) + ".")
    lines += ["", " ".join(notes)]
    lines += step_table(res)
    ck = [m for m in res["models"] if (m.get("checkpoint") or {}).get("disk_bytes")]
    if ck:
        lines += ["", "| model | weights GB (planner) | checkpoint GB on disk | disk / weights | written in s |",
                  "| --- | --- | --- | --- | --- |"]
        for m in ck:
            c = m["checkpoint"]
            lines.append(f"| {model_cell(m, res)} | {gb(c['planned_bytes'])} | {gb(c['disk_bytes'])} | "
                         f"{c['disk_bytes'] / c['planned_bytes']:.3f} | "
                         f"{'reused' if c.get('reused') else c.get('write_s')} |")
    so = [m for m in res["models"] if m.get("soak")]
    if so:
        lines += ["", "| `rq soak` | budget | KV | minutes | tokens | decode tok/s mean | memory CV | "
                  "MLX growth MB/h | RSS growth MB/h | throughput drift | MLX peak GB | RSS GB | passed |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for m in so:
            k = m["soak"]
            if "error" in k:
                lines.append(f"| {model_cell(m, res)} | {m['budget']} | - | - | error: {k['error']} | | | | | | | | |")
                continue

            def f(x, spec, scale=1.0):
                return "-" if x is None else format(x * scale, spec)
            lines.append(
                f"| {model_cell(m, res)} | {k['budget']} | {k['kv']} | {f(k.get('elapsed_s'), '.1f', 1 / 60)} | "
                f"{k['tokens_generated']} | {f(k['decode_tok_per_s_mean'], '.2f')} | {f(k['memory_cv'], '.2%')} | "
                f"{f(k['memory_growth_bytes_per_hour'], '+.1f', 2 ** -20)} | "
                f"{f(k['rss_growth_bytes_per_hour'], '+.1f', 2 ** -20)} | {f(k['throughput_drift'], '+.1%')} | "
                f"{gb(k['peak_memory_bytes'])} | {gb(k['peak_rss_bytes'])} | "
                f"{k['passed'] if k['tokens_generated'] else 'not judged: no token in the time'} |")
    return "\n".join(lines) + "\n"


def queued(pd: dict) -> str:
    """A cell's decode steps queued whole and those the device gave up waiting in (each run again layer by layer),
    and whether the pager stopped queuing them; '-' in older files."""
    if pd.get("queued") is None:
        return "-"
    return f"{pd['queued']} ({pd['queue_fallbacks']}" + (", then by stretch)" if pd.get("queue_stopped") else ")")


def greedy_tokens(res: dict) -> str:
    """"N greedy tokens", or each model's N where merged runs decoded different numbers."""
    per = {}
    for m in res["models"]:
        n = max([(c.get("run") or {}).get("generated_tokens") or 0 for c in m["cells"]], default=0)
        if n:
            per[model_cell(m, res)] = n
    if len(set(per.values())) <= 1:
        return f"{next(iter(per.values()), res['tokens'])} greedy tokens"
    return "greedy tokens (" + "; ".join(f"{k} {v}" for k, v in per.items()) + ")"


def step_table(res: dict) -> list[str]:
    """Where a paged decode step's time goes, per token over the decode steps (the first, with its kernel compile,
    included): reading pages, waiting for each MoE layer's routing (the device computing the layers before it), the
    pager's other host work, and the rest (building the step's graphs, the device's work after the last read)."""
    out = []
    for m in res["models"]:
        for c in m["cells"] + ([m["min_budget"]] if m.get("min_budget") else []):
            r = c.get("run") or {}
            # decode_steps, else (older files) rate x time, rounded: 1/x*x is not always 1.0 in floats
            pd = r.get("pager_decode")
            n = r.get("decode_steps") or round((r.get("decode_tok_per_s") or 0) * (r.get("decode_s") or 0))
            plan = c.get("plan") or {}
            slots = plan.get("slots_per_layer")
            every = slots is not None and slots == plan.get("experts_per_layer")  # nothing paged after the prompt
            if not pd or n < 1 or pd.get("misses") is None or every:
                continue
            ms = lambda s: f"{1e3 * s / n:.1f}"  # noqa: E731
            rest = r["decode_s"] - pd["sync_s"] - pd["host_s"]
            budget = f"min {gb(c['budget_bytes'])} GB" if c.get("budget_bytes") else m["budget"]
            out.append(f"| {model_cell(m, res)} | {budget} | {c.get('kv')} | {r['prompt_tokens']:,} "
                       f"| {ms(r['decode_s'])} | {ms(pd['read_s'])} | {ms(pd['sync_s'])} | "
                       f"{ms(pd['host_s'] - pd['read_s'])} | {ms(rest)} | {pd['misses'] / n:.1f} | "
                       f"{pd['bytes_read'] / n / 1e6:.1f} | {queued(pd)} |")
    if not out:
        return []
    return ["", "A decode step's time (ms a token, over all decode steps): reading pages, waiting for each MoE layer's "
                "routing (the device runs the layers before it meanwhile), the pager's other host work, and the rest "
                "(building the graphs, the device's work after the last routing read, the first step's kernel compile).",
            "", "| model | budget | KV | context | decode ms | read pages | wait for routing | pager host, besides reads "
                "| rest | misses / token | MB read / token | steps queued whole (fell back) |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"] + out


def rate(x: float) -> str:
    """tok/s: two decimals, three below 1 (a CPU's 0.020 is not 0.02's 0.015-0.025)."""
    return f"{x:.2f}" if x >= 1 else f"{x:.3f}"


def planned_cells(m: dict) -> list[tuple[int, str]]:
    """(context, KV mode) of each cell the model's run was asked for (its recorded lists, else its command's)."""
    import shlex

    ctxs, kvs = m.get("contexts"), m.get("kv")
    if (ctxs is None or kvs is None) and m.get("command"):
        argv = shlex.split(m["command"])
        opt = {a: argv[i + 1] for i, a in enumerate(argv[:-1]) if a in ("--contexts", "--kv")}
        ctxs = ctxs or [int(x) for x in opt.get("--contexts", "2048,32768").split(",")]
        kvs = kvs or opt.get("--kv", "isoquant3,fp16").split(",")
    return [(c, k) for c in ctxs or [] for k in kvs or []]


def where(h: dict) -> str:
    """A host() in words: 'NVIDIA H200 (16 cores, 126 GiB of memory)', 'the CPU (2 cores, ...)'."""
    mem = f", {h['memory_bytes'] / 2 ** 30:.0f} GiB of memory" if h.get("memory_bytes") else ""
    return f"{'the CPU' if h['accelerator'] == 'CPU' else h['accelerator']} ({h['cpu_cores']} cores{mem})"


def budget_note(m: dict, h: dict | None) -> str:
    """' (set by --budget; ...)' for a budget other than the paper's, saying when the paper's exceeds the machine's
    memory; '' for the paper's own."""
    if m.get("budget_source") != "--budget":
        return " (the paper's)"
    from rq_core.quant.recipe import parse_size

    mem = (h or {}).get("memory_bytes")
    if mem and parse_size(m["paper_budget"]) > mem:
        return (f" (set by --budget: the paper's {m['paper_budget']} is more than this machine's "
                f"{mem / 2 ** 30:.0f} GiB)")
    return f" (set by --budget; the paper's: {m['paper_budget']})"


def slots(p: dict) -> str:
    n, e = p.get("slots_per_layer"), p.get("experts_per_layer")
    return "-" if n is None or e is None else f"{n} / {e}"


def kept_rows(old: dict, tiny: bool, names: list[str], routing: str) -> list[dict]:
    """--merge: the results file's rows that this run does not measure, i.e. other models, and this run's models at
    another routing (one model's uniform and zipf rows side by side). Each keeps its machine and its routing (an
    older file's top-level one, which this run's would otherwise stand in for)."""
    if bool(old.get("tiny")) != tiny:
        return []
    rows = [{"host": old.get("host"), **m, "routing": canonical_routing(routing_of(m, old))}
            for m in old.get("models", []) if m.get("model") in MODELS]
    return [m for m in rows if m["model"] not in names or m["routing"] != routing]


def in_order(models: list[dict]) -> list[dict]:
    """MODELS' order; a model's uniform rows before its other routings'."""
    return sorted(models, key=lambda m: (list(MODELS).index(m["model"]), m["routing"] != "uniform", m["routing"]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="nemotron_h,qwen3_moe,gemma4")
    ap.add_argument("--contexts", default=None, help="prompt lengths in tokens (default 2048,32768; --tiny 64,256)")
    ap.add_argument("--tokens", type=int, default=32, help="greedy decode tokens a run")
    ap.add_argument("--kv", default="isoquant3,fp16")
    ap.add_argument("--routing", default="uniform", help="uniform | zipf[:S] (the synthetic routers, see synth.py)")
    ap.add_argument("--dir", help="where the checkpoints and prompts live (reused when complete); required but "
                                  "with --render")
    ap.add_argument("--timeout", type=float, default=1200, help="seconds a subprocess may run")
    ap.add_argument("--no-min-budget", action="store_true", help="skip the run at the plan's smallest budget")
    ap.add_argument("--delete-after", action="store_true", help="remove each checkpoint after its cells (disk)")
    ap.add_argument("--tiny", action="store_true", help="2-layer slices, budgets between the smallest and all "
                                                        "resident, contexts 64,256: a CPU check of the pipeline")
    ap.add_argument("--budget", action="append", default=[], metavar="FAMILY=SIZE",
                    help="a model's memory budget instead of the paper's (e.g. nemotron_h=19GB on a 24 GiB machine); "
                         "repeatable or comma-separated")
    ap.add_argument("--soak-minutes", type=float, default=0, metavar="M",
                    help="then `rq soak` each model for M minutes at its budget (first KV mode)")
    ap.add_argument("--soak-models", default=None, help="the families to soak (default: all of --models)")
    ap.add_argument("--soak-prompt", type=int, default=256, metavar="N", help="rq soak's --max-prompt")
    ap.add_argument("--soak-tokens", type=int, default=64, metavar="N", help="rq soak's --max-tokens")
    ap.add_argument("--render", action="store_true", help="rewrite the results file's table from its data and exit "
                                                          "(no runs; its date and command stay)")
    ap.add_argument("--merge", action="store_true", help="keep the results file's models, or routings of a model, "
                                                         "that this run does not measure (one model a run, rows of "
                                                         "the others kept; uniform and zipf rows side by side)")
    ap.add_argument("--no-warmup", action="store_true", help="skip each model's warm-up run (a GPU's first run "
                                                              "compiles MLX's kernels into its disk cache)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", help="results JSON (default benchmarks/results/paper_table.json)")
    a = ap.parse_args()

    from rq_core.paging.planner import plan
    from rq_core.quant import recipe as recipe_mod
    from rq_core.tools import synth

    if a.render:
        path = Path(a.out) if a.out else _readme.RESULTS / "paper_table.json"
        data = {k: v for k, v in json.loads(path.read_text()).items() if k != "table"}
        _readme.save("paper_table", data, table(data), path)
        print(table(data))
        return
    if not a.dir:
        ap.error("--dir is required")
    routing = a.routing
    label = canonical_routing(routing)  # a bad value fails before any work
    budgets = parse_budgets(a.budget)
    contexts = [int(x) for x in (a.contexts or ("64,256" if a.tiny else "2048,32768")).split(",")]
    kvs = a.kv.split(",")
    names = a.models.split(",")
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        sys.exit(f"error: unknown model {unknown[0]!r} (choose from {', '.join(MODELS)})")
    d = Path(a.dir).expanduser().resolve()
    d.mkdir(parents=True, exist_ok=True)
    soak_models = set((a.soak_models or a.models).split(",")) if a.soak_minutes > 0 else set()
    res = {"routing": label, "tokens": a.tokens, "tiny": a.tiny, "contexts": contexts, "kv": kvs, "host": host(),
           "models": []}
    out_path = Path(a.out) if a.out else None

    kept = []
    if a.merge:
        old_path = out_path or _readme.RESULTS / "paper_table.json"
        if old_path.is_file():
            kept = kept_rows(json.loads(old_path.read_text()), a.tiny, names, label)

    def merged() -> dict:
        return {**res, "models": in_order(kept + res["models"])}

    def save() -> None:
        full = merged()
        _readme.save("paper_table", full, table(full), out_path)

    def say(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    prompts = {n: prompt_file(d / "prompts", n) for n in contexts}
    for fam in names:
        cfg_name, rec_name, paper_budget, paper = MODELS[fam]
        budget = budgets.get(fam, paper_budget)
        cfg = synth.read_config(cfg_name)
        if a.tiny:
            cfg = synth.truncate(cfg, 2)
        m = {"model": fam, "config": cfg_name, "recipe": rec_name, "routing": label, "budget": budget,
             "paper_budget": paper_budget,
             "measured": _readme.meta()["date"], "command": _readme.meta()["command"], "host": res["host"],
             "contexts": contexts,
             "kv": kvs,
             "budget_source": "--budget" if fam in budgets else "tiny" if a.tiny else "paper", "cells": [],
             "paper": None if a.tiny else {"peak_gb": paper[0], "tok_s": paper[1], "budget": paper_budget,
                                           "machine": "Apple M4 Max"}}
        res["models"].append(m)
        ckpt = d / f"{cfg_name}{'-2layers' if a.tiny else ''}-{rec_name}-{routing.replace(':', '_')}"
        try:
            expect = plan(cfg, recipe_mod.load(rec_name)).total_bytes
            # a checkpoint of another routing beside it holds the same expert pages: hard-linked, not drawn again,
            # and taking no more disk
            base = next((o for o in sorted(d.glob(f"{ckpt.name.rsplit('-', 1)[0]}-*"))
                         if o != ckpt and synth.same_pages(o, cfg, rec_name, a.seed)), None)
            need = expect - (disk_bytes(base / "experts") if base is not None else 0)
            free = shutil.disk_usage(d).free + (disk_bytes(ckpt) if ckpt.exists() else 0)
            m["checkpoint"] = {"path": str(ckpt), "planned_bytes": expect}
            if need * DISK_MARGIN > free and not (ckpt / synth.MARK).is_file():
                raise RuntimeError(f"{ckpt} needs about {need * DISK_MARGIN / 1e9:.1f} GB, {free / 1e9:.1f} GB free")
            say(f"[{fam}] checkpoint {ckpt} ({expect / 1e9:.1f} GB planned"
                + (f", expert pages linked from {base.name}" if base is not None else "") + ") ...")
            t0 = time.perf_counter()
            _, reused = synth.ensure(cfg, rec_name, ckpt, seed=a.seed, routing=routing, packed=True, pages_from=base)
            m["checkpoint"]["pages_linked_from"] = str(base) if base is not None and not reused else None
            m["checkpoint"].update(reused=reused, write_s=round(time.perf_counter() - t0, 1),
                                   disk_bytes=disk_bytes(ckpt))
            m["checkpoint"]["disk_over_planned"] = round(m["checkpoint"]["disk_bytes"] / expect, 4)
            m["checkpoint"]["experts_stored_once"] = m["checkpoint"]["disk_bytes"] <= expect * DISK_MARGIN
            say(f"[{fam}] checkpoint {'reused' if reused else 'written'}: {m['checkpoint']['disk_bytes'] / 1e9:.2f} GB "
                f"on disk, {m['checkpoint']['write_s']} s")
        except Exception as e:  # this model's cells are lost, the others' are not
            m["error"] = f"{type(e).__name__}: {e}"
            say(f"[{fam}] error: {m['error']}")
            save()
            continue
        if a.tiny and fam not in budgets:  # halfway between the smallest budget and all resident: the pager at work
            lo = plan_cell(ckpt, "1TB", kvs[0], prompts[contexts[0]][0], a.tokens, a.timeout)
            if "error" in lo:
                m["error"] = f"plan: {lo['error']}"
                save()
                continue
            budget = str((lo["min_budget_bytes"] + lo["planned_peak_bytes"]) // 2)
            m["budget"] = budget
        if not a.no_warmup:  # kernels compiled once, as a user's first run on the machine does: not in the cells' times
            w = run_cell(ckpt, budget, kvs[0], prompt_file(d, min(contexts[0], WARMUP_PROMPT))[0], WARMUP_TOKENS,
                         a.timeout)
            m["warmup"] = {k: w.get(k) for k in ("prefill_s", "first_step_s", "steady_decode_tok_per_s", "wall_s",
                                                 "error")}
            say(f"[{fam}] warm-up: " + (f"error {w['error']}" if "error" in w else
                                        f"TTFT {w['prefill_s']:.1f} s, first step {w['first_step_s']:.1f} s, "
                                        f"wall {w['wall_s']} s"))
        for ctx in contexts:
            pf, n_tok = prompts[ctx]
            for kv in kvs:
                c = {"context": ctx, "prompt_file_tokens": n_tok, "kv": kv}
                c["plan"] = plan_cell(ckpt, budget, kv, pf, a.tokens, a.timeout)
                c["run"] = run_cell(ckpt, budget, kv, pf, a.tokens, a.timeout)
                pk, r = c["plan"].get("planned_peak_bytes"), c["run"]
                if pk and "peak_memory_bytes" in r:
                    c["measured_over_planned"] = round(r["peak_memory_bytes"] / pk, 3)
                m["cells"].append(c)
                save()
                if "error" in r:
                    say(f"[{fam}] {kv} {ctx}: error {r['error']}")
                else:
                    say(f"[{fam}] {kv} {ctx}: peak {gb(r['peak_memory_bytes'])} GB (planned {gb(pk)}), "
                        f"{r['steady_decode_tok_per_s']:.2f} tok/s, TTFT {r['prefill_s']:.2f} s, "
                        f"hit rate {(r.get('pager_decode') or r['pager'])['hit_rate']}, wall {r['wall_s']} s")
        first = next((c for c in m["cells"] if c["plan"].get("min_budget_bytes")), None)
        if first and not a.no_min_budget:
            mb = int(first["plan"]["min_budget_bytes"])
            pf = prompts[first["context"]][0]
            c = {"context": first["context"], "kv": first["kv"], "budget_bytes": mb}
            c["plan"] = plan_cell(ckpt, str(mb), first["kv"], pf, a.tokens, a.timeout)
            c["run"] = run_cell(ckpt, str(mb), first["kv"], pf, a.tokens, a.timeout)
            r = c["run"]
            if "error" not in r:
                c["at_least_1_tok_per_s"] = r["steady_decode_tok_per_s"] >= 1.0
            m["min_budget"] = c
            save()
            say(f"[{fam}] smallest budget {gb(mb)} GB: " + (f"error {r['error']}" if "error" in r else
                f"peak {gb(r['peak_memory_bytes'])} GB, {r['steady_decode_tok_per_s']:.2f} tok/s"))
        if fam in soak_models:
            say(f"[{fam}] rq soak {a.soak_minutes:g} min at {budget} ...")
            m["soak"] = soak_cell(ckpt, budget, kvs[0], a.soak_minutes, d / f"soak-{fam}.json",
                                  max(a.timeout, a.soak_minutes * 60 * 3), max_prompt=a.soak_prompt,
                                  max_tokens=a.soak_tokens)
            save()
            k = m["soak"]
            say(f"[{fam}] soak: " + (f"error {k['error']}" if "error" in k else
                f"memory CV {k['memory_cv']}, growth {k['memory_growth_bytes_per_hour']} B/h, "
                f"drift {k['throughput_drift']}, {k['decode_tok_per_s_mean']} tok/s"))
        if a.delete_after:
            shutil.rmtree(ckpt, ignore_errors=True)
            say(f"[{fam}] removed {ckpt}")
    save()
    print(table(merged()))


if __name__ == "__main__":
    main()
