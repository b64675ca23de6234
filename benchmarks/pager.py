"""Expert pager: what `--memory-budget` costs. Decode (seeded sampling; `--temp 0`: greedy) with every expert resident
(no pager), then with the expert pager (LRU) holding `--fractions` of each MoE layer's experts, a fresh model and
pager every run:

- decode tok/s and steady decode tok/s (without the first step; rq_core.generate.GenerationResult), as a share of
  the all-resident run's;
- hit rate, misses, evictions, bytes read per token and read GB/s (PagerStats.bytes_read / PagerStats.read_s:
  reading and checking pages);
- host syncs per forward pass, and per MoE layer and forward pass the ms spent waiting for the routing read
  (PagerStats.sync_s) and in the pager's host work (PagerStats.host_s);
- measured peak (MLX's peak over the run less what MLX held before the model loaded, plus the pager's staging buffer,
  host memory) against the budget slots_for_budget plans those slots for, and its planned peak;
- whether the tokens equal the all-resident run's.

Each share of experts runs with ExpertPager(speculate=) "off" (layer by layer) and "auto" (rq's default), or the
values `--speculate` lists ("always" too). Options add rows: `--cold` (each row again
with the page files dropped from the OS page cache before every run: os.posix_fadvise(POSIX_FADV_DONTNEED) on every
file of the pack folder, without root, so best-effort; the share of the pack still cached after the drop is
measured with mincore and printed), `--verify-cost` (a row at 50% of experts without the pages' CRC32 checks,
verify=False, beside the verify=True one), `--by-stretch` (rows at 50% with each step queued whole, queue="always",
the device waiting for each MoE layer's slots and copying its pages in, and a stretch between two MoE layers at a
time, queue="off", beside the default row, queue="auto", which times both and runs the faster; on CUDA only do they
differ: rq_core/paging/mailbox.py). Warm rows read the pack folder once before each run (mincore checks that
it is cached). Every cell runs
`--repeats` times, interleaved, the cells' order rotating each repetition; the table gives medians (min-max).
Writes benchmarks/results/pager.json (overwritten by a rerun; the README's `pager` table).

Default: a scaled-down Qwen3-MoE-shaped checkpoint with random weights, quantized (qwen3-16gb, round-to-nearest)
and packed in a temporary folder; a few minutes on a CPU (more with --cold --verify-cost):

    python3 benchmarks/pager.py [--layers 8] [--hidden 512] [--experts 32] [--top-k 4] [--tokens 64] [--cold]

Real size: `--synthetic DIR` writes a Qwen3-30B-A3B-shaped checkpoint there (rq_core/tools/synth.py: random codes
of tests/data/configs/qwen3-30b-a3b.json at the bits and group sizes of the qwen3-16gb recipe, one shard a layer,
so the whole model is never held; reused when DIR has it) and packs it (the pages are a second copy of the routed
experts on disk); `--ckpt DIR` pages an existing quantized checkpoint:

    python3 benchmarks/pager.py --synthetic /tmp/rq-q3-30b --speculate off,auto --cold --verify-cost
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import mlx.core as mx  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402

QWEN3_CONFIG = ROOT / "tests" / "data" / "configs" / "qwen3-30b-a3b.json"
MODEL_KEYS = ("num_hidden_layers", "hidden_size", "moe_intermediate_size", "num_experts", "num_experts_per_tok")


def make_checkpoint(out: Path, a: argparse.Namespace) -> dict:
    """A random Qwen3-MoE of the scaled-down shape (float32: MLX's CPU quantized kernels are several times faster
    with float32 scales and activations)."""
    from rq_core.checkpoint import build_model

    cfg = {"model_type": "qwen3_moe", "hidden_size": a.hidden, "intermediate_size": 2 * a.hidden,
           "moe_intermediate_size": a.hidden // 2, "num_attention_heads": a.hidden // 128,
           "num_key_value_heads": max(1, a.hidden // 512), "head_dim": 128, "num_hidden_layers": a.layers,
           "num_experts": a.experts, "num_experts_per_tok": a.top_k, "norm_topk_prob": True, "vocab_size": 4096,
           "rms_norm_eps": 1e-6, "rope_theta": 1e6, "max_position_embeddings": 4096, "tie_word_embeddings": False,
           "decoder_sparse_step": 1, "mlp_only_layers": [], "torch_dtype": "float32"}
    mx.random.seed(0)
    model = build_model(cfg)
    w = {k: v.astype(mx.float32) for k, v in tree_flatten(model.parameters())}
    for k in w:
        if k.endswith("mlp.gate.weight"):  # spread routers: top-k picks vary from token to token
            w[k] = mx.random.normal(w[k].shape) * 0.5
    out.mkdir(parents=True)
    mx.save_safetensors(str(out / "model.safetensors"), w)
    (out / "config.json").write_text(json.dumps(cfg))
    return cfg


def write_synthetic(out: Path, layers: int | None = None, recipe_name: str = "qwen3-16gb", seed: int = 0) -> dict:
    """A quantized Qwen3-30B-A3B-shaped checkpoint with random codes (rq_core/tools/synth.py), written shard by
    shard (one per decoder layer, one for embeddings, norm and head) so peak memory is one layer's tensors."""
    from rq_core.tools import synth as synth_checkpoint

    cfg = synth_checkpoint.read_config(QWEN3_CONFIG)
    if layers is not None:
        cfg = synth_checkpoint.truncate(cfg, layers)
    synth_checkpoint.write(cfg, recipe_name, out, seed=seed)
    return json.loads((Path(out) / "config.json").read_text())


def scaled_down(tmp: Path, a: argparse.Namespace) -> tuple[Path, dict]:
    """The default checkpoint, quantized with round-to-nearest and packed, in `tmp`."""
    from rq_core.paging.pack import pack
    from rq_core.quant import recipe
    from rq_core.quant.quantize import quantize

    make_checkpoint(tmp / "src", a)
    rec = recipe.load("qwen3-16gb")
    for role in rec.roles.values():
        role.method = "rtn"
    q = quantize(tmp / "src", rec, tmp / "q")
    pk = pack(tmp / "q")
    return tmp / "q", {"recipe": "qwen3-16gb (RTN)", "quantized_bytes": q.bytes_out, "page_bytes": pk.page_bytes}


def existing(a: argparse.Namespace) -> tuple[Path, dict]:
    """--synthetic DIR (written when missing) or --ckpt DIR, packed (again when its pages are stale)."""
    from rq_core.checkpoint import load, load_config
    from rq_core.errors import RQError
    from rq_core.paging.pack import INDEX, find_pages, pack
    from rq_core.paging.pager import ExpertPager

    t0 = time.perf_counter()
    ck = Path(a.synthetic or a.ckpt)
    if a.synthetic and not (ck / "config.json").is_file():
        write_synthetic(ck, a.layers)
    write_s = time.perf_counter() - t0
    cfg = load_config(ck)
    if a.layers is not None and cfg["num_hidden_layers"] != a.layers:
        raise SystemExit(f"{ck} has {cfg['num_hidden_layers']} layers, not --layers {a.layers} (use another DIR)")
    t0 = time.perf_counter()
    packed = (find_pages(ck) / INDEX).is_file()
    if packed:
        try:
            ExpertPager(load(ck, tokenizer=False).model, ck, slots=1).close()
        except RQError:  # stale or damaged: pack again
            packed = False
    if not packed:
        pack(ck)
    gc.collect()
    mx.clear_cache()
    return ck, {"synthetic": bool(a.synthetic), "write_checkpoint_s": write_s, "pack_s": time.perf_counter() - t0}


def pack_files(ck: Path) -> list[Path]:
    from rq_core.paging.pack import find_pages

    return sorted(p for p in find_pages(ck).iterdir() if p.is_file())


def warm_page_cache(files: list[Path]) -> None:
    """Read every file once, so its pages are in the OS page cache."""
    for p in files:
        with open(p, "rb", buffering=0) as f:
            while f.read(1 << 24):
                pass


def drop_page_cache(files: list[Path]) -> None:
    """Ask the OS to drop these files' pages from its page cache (POSIX_FADV_DONTNEED, no root). Best-effort: the
    kernel keeps pages that are dirty or that another process maps, and may ignore the advice."""
    for p in files:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def cached_share(files: list[Path]) -> float | None:
    """The share of these files' pages in the OS page cache (mincore on a read-only mapping; Linux), None where
    that cannot be asked."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                              ctypes.c_long]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        page = os.sysconf("SC_PAGE_SIZE")
        held = total = 0
        for p in files:
            size = p.stat().st_size
            if not size:
                continue
            fd = os.open(p, os.O_RDONLY)
            try:
                addr = libc.mmap(None, size, 1, 1, fd, 0)  # PROT_READ, MAP_SHARED
                if addr in (None, ctypes.c_void_p(-1).value):
                    return None
                try:
                    n = (size + page - 1) // page
                    vec = (ctypes.c_ubyte * n)()
                    if libc.mincore(ctypes.c_void_p(addr), size, vec) != 0:
                        return None
                    held += sum(b & 1 for b in vec)
                    total += n
                finally:
                    libc.munmap(ctypes.c_void_p(addr), size)
            finally:
                os.close(fd)
        return held / total if total else None
    except (OSError, AttributeError):
        return None


def cells(a: argparse.Namespace) -> list[dict]:
    """The rows: all resident, then per fraction below 1, speculation and page cache state; the verify=False row."""
    fracs = sorted({float(f) for f in a.fractions.split(",") if f.strip()}, reverse=True)
    specs = [s.strip() for s in a.speculate.split(",") if s.strip()]
    caches = ["warm", "cold"] if a.cold else ["warm"]
    out = [{"fraction": 1.0, "speculate": None, "cache": None, "verify": None, "queue": None}]
    alt = {"verify": [False], "queue": ["always", "off"]}  # the rows a flag adds beside the default one
    for f in fracs:
        if f >= 1.0:
            continue
        out += [{"fraction": f, "speculate": s, "cache": c, "verify": True, "queue": "auto"} for s in specs
                for c in caches]
    for flag, key in ((a.verify_cost, "verify"), (a.by_stretch, "queue")):
        if flag:
            for c in caches:
                base = {"fraction": 0.5, "speculate": "off", "cache": c, "verify": True, "queue": "auto"}
                if base not in out:
                    out.append(base)
                for i, v in enumerate(alt[key]):
                    out.insert(out.index(base) + 1 + i, {**base, key: v})
    return out


def label(c: dict) -> str:
    if c["speculate"] is None:
        return "all resident"
    return (f"{c['fraction']:.0%} {c['speculate']} {c['cache']}" + ("" if c["verify"] else " no-verify")
            + ("" if c["queue"] in (None, "auto") else f" queue-{c['queue']}"))


def run_one(ck: Path, cfg: dict, c: dict, prompt: list[int], a: argparse.Namespace, files: list[Path]) -> dict:
    """One fresh model (and pager), one generate(); what the table needs from it."""
    from rq_core.checkpoint import load
    from rq_core.generate import generate
    from rq_core.paging.pack import expert_banks, load_index
    from rq_core.paging.pager import ExpertPager, budget_for_slots, slots_for_budget

    gc.collect()  # the paged modules form reference cycles: the last run's model goes first
    mx.clear_cache()
    run: dict = {}
    if c["cache"] == "cold":
        drop_page_cache(files)
        run["cached_after_drop"] = cached_share(files)
    elif c["cache"] == "warm":
        warm_page_cache(files)
        run["cached_after_warm"] = cached_share(files)
    baseline = mx.get_active_memory()
    mx.reset_peak_memory()
    model = load(ck, tokenizer=False).model
    pager = None
    if c["speculate"] is not None:
        E, k = cfg["num_experts"], cfg["num_experts_per_tok"]
        slots = max(k, int(round(c["fraction"] * E)))
        index = load_index(ck, banks=expert_banks(model))
        ctx = a.prompt + a.tokens
        probe = slots_for_budget(model, cfg, 1 << 62, context=ctx, prefill_chunk=a.prompt, index=index)
        budget = budget_for_slots(probe, slots)
        plan = slots_for_budget(model, cfg, budget, context=ctx, prefill_chunk=a.prompt, index=index)
        if plan["slots_per_layer"] != slots:
            print(f"  the plan for {slots} slots' budget gives {plan['slots_per_layer']} slots", flush=True)
        pager = ExpertPager(model, ck, slots=plan["slots_per_layer"], speculate=c["speculate"], verify=c["verify"],
                            queue=c["queue"], memory_limit=plan["memory_limit_bytes"])
        run.update(slots=plan["slots_per_layer"], budget_bytes=budget, planned_peak_bytes=plan["planned_peak_bytes"],
                   moe_layers=plan["moe_layers"])
    t = time.perf_counter()
    res = generate(model, prompt, max_tokens=a.tokens, temp=a.temp, seed=0, prefill_chunk=a.prompt)
    run.update(wall_s=time.perf_counter() - t, decode_tok_per_s=res.decode_tok_per_s,
               steady_decode_tok_per_s=res.steady_decode_tok_per_s, prefill_tok_per_s=res.prefill_tok_per_s,
               generated_tokens=res.generated_tokens, mlx_peak_bytes=res.peak_memory_bytes - baseline,
               tokens=res.tokens)
    if pager is not None:
        st = pager.report()
        passes = 1 + max(res.generated_tokens - 1, 0)  # one prefill chunk, then a forward pass per decode step
        calls = max(run["moe_layers"] * passes, 1)  # MoE layer calls: one a MoE layer and forward pass
        read_s = getattr(st, "read_s", None)
        run.update(pager=st.as_dict(), bytes_read_per_token=st.bytes_read / max(res.generated_tokens, 1),
                   read_gb_per_s=(st.bytes_read / read_s / 1e9) if read_s and st.bytes_read else None,
                   host_syncs_per_pass=st.host_syncs / passes, sync_ms_per_call=1e3 * st.sync_s / calls,
                   host_ms_per_call=1e3 * st.host_s / calls,
                   measured_peak_bytes=res.peak_memory_bytes - baseline + st.staging_bytes,  # staging: host memory
                   queued_whole=pager.mailbox is not None)
        pager.close()
    else:
        run["measured_peak_bytes"] = run["mlx_peak_bytes"]
    del model, pager
    return run


def summarize(c: dict, runs: list[dict], ref: list[int], full: dict | None) -> dict:
    def stat(key: str) -> dict | None:
        xs = [r[key] for r in runs if r.get(key) is not None]
        return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)} if xs else None

    s = {k: stat(k) for k in ("decode_tok_per_s", "steady_decode_tok_per_s", "prefill_tok_per_s",
                              "bytes_read_per_token", "read_gb_per_s", "host_syncs_per_pass", "sync_ms_per_call",
                              "host_ms_per_call")}
    s["measured_peak_bytes"] = max(r["measured_peak_bytes"] for r in runs)
    for k in ("slots", "budget_bytes", "planned_peak_bytes"):
        s[k] = runs[0].get(k)
    s["staging_bytes"] = runs[0]["pager"]["staging_bytes"] if runs[0].get("pager") else None
    # whether the staging buffer is page-locked host memory (CUDA: transfer.Copier.host_buffer)
    s["staging_host_resident"] = runs[0]["pager"].get("staging_host_resident") if runs[0].get("pager") else None
    for k in ("hit_rate", "misses", "evictions", "hits", "speculated", "respun", "reruns", "queued", "queue_fallbacks"):
        xs = [r["pager"][k] for r in runs if r.get("pager") and r["pager"].get(k) is not None]
        s[k] = statistics.median(xs) if xs else None
    s["queued_whole"] = runs[0].get("queued_whole")
    s["queue_stopped"] = sum(bool(r.get("pager", {}).get("queue_stopped")) for r in runs)  # runs that stopped queuing
    s["same_tokens"] = sum(r["tokens"] == ref for r in runs)
    s["runs"] = len(runs)
    if full is not None:
        s["decode_share"] = s["decode_tok_per_s"]["median"] / full["decode_tok_per_s"]["median"]
        s["steady_share"] = s["steady_decode_tok_per_s"]["median"] / full["steady_decode_tok_per_s"]["median"]
    drops = [r["cached_after_drop"] for r in runs if r.get("cached_after_drop") is not None]
    s["cached_after_drop_max"] = max(drops) if drops else None
    warm = [r["cached_after_warm"] for r in runs if r.get("cached_after_warm") is not None]
    s["cached_after_warm_min"] = min(warm) if warm else None
    return s


RUN_KEYS = ("repeat", "decode_tok_per_s", "steady_decode_tok_per_s", "prefill_tok_per_s", "wall_s",
            "measured_peak_bytes", "cached_after_drop", "cached_after_warm", "queued_whole")
PAGER_KEYS = ("hits", "misses", "evictions", "bytes_read", "read_s", "sync_s", "host_s", "host_syncs", "speculated",
              "respun", "reruns", "queued", "queue_fallbacks", "queue_stopped")


def compact(x: dict) -> dict:
    """A run as the results file keeps it: its times and peak, and the pager's counters (floats to 4 digits)."""
    out = {k: x[k] for k in RUN_KEYS if x.get(k) is not None}
    out.update({k: x["pager"][k] for k in PAGER_KEYS if x.get("pager") and x["pager"].get(k) is not None})
    return {k: float(f"{v:.4g}") if isinstance(v, float) else v for k, v in out.items()}


def _mm(s: dict | None, f: str = "{:.1f}") -> str:
    if not s:
        return "-"
    return f"{f.format(s['median'])} ({f.format(s['min'])}-{f.format(s['max'])})"


def queued(s: dict, mode: str) -> str:
    """How the row's steps were queued (`mode`: its ExpertPager(queue=)): whole (and how many of those ran again layer
    by layer), "auto" and how many steps it queued whole, or by stretch."""
    if not s.get("queued_whole"):
        return "by stretch"
    fb = s.get("queue_fallbacks") or 0
    out = "whole" if mode == "always" else f"auto ({s.get('queued') or 0:.0f} whole)"
    out += "" if not fb else f" ({fb:.0f} of {s.get('queued') or 0:.0f} again)"
    stopped = s.get("queue_stopped") or 0
    return out if not stopped else f"{out}, then by stretch ({stopped} of {s.get('runs')} runs)"


def table(rows: list[dict], unit: tuple[str, float]) -> str:
    u, div = unit
    out = ["| experts resident | speculation | step queued | page cache | CRC32 | decode tok/s | steady tok/s "
           f"| of all resident (steady) | hit rate | misses | evictions | read MB/token | read GB/s | host syncs/pass | sync ms/call "
           f"| host ms/call | measured peak {u} | budget {u} | planned peak {u} | same tokens |",
           "| " + " | ".join(["---"] * 20) + " |"]

    def num(v, f="{:.1f}"):
        return "-" if v is None else f.format(v)

    for r in rows:
        c, s = r["cell"], r["summary"]
        paged = c["speculate"] is not None

        def med(k: str, f: str = "{:.1f}", scale: float = 1.0) -> str:
            v = (s[k] or {}).get("median")
            return num(None if v is None else v / scale, f)

        out.append("| " + " | ".join([
            f"{c['fraction']:.0%}", c["speculate"] or "—",
            queued(s, c["queue"]) if paged else "—", c["cache"] or "—",
            "—" if not paged else ("on" if c["verify"] else "off"),
            _mm(s["decode_tok_per_s"]), _mm(s["steady_decode_tok_per_s"]),
            f"{s.get('decode_share', 1.0):.0%} ({s.get('steady_share', 1.0):.0%})",
            num(s["hit_rate"] if paged else None, "{:.1%}"), num(s["misses"], "{:.0f}"),
            num(s["evictions"], "{:.0f}"), med("bytes_read_per_token", "{:.2f}", 1e6),
            med("read_gb_per_s", "{:.2f}"), med("host_syncs_per_pass"), med("sync_ms_per_call", "{:.3f}"),
            med("host_ms_per_call", "{:.3f}"), f"{s['measured_peak_bytes'] / div:.2f}",
            "-" if s["budget_bytes"] is None else f"{s['budget_bytes'] / div:.2f}",
            "-" if s["planned_peak_bytes"] is None else f"{s['planned_peak_bytes'] / div:.2f}",
            "yes" if s["same_tokens"] == s["runs"] else f"NO ({s['same_tokens']}/{s['runs']})"]) + " |")
    return "\n".join(out)


def note(meta: dict, rows: list[dict], a: argparse.Namespace) -> str:
    m = meta["model"]
    what = (f"Scaled-down Qwen3-MoE-shaped checkpoint with random weights ({meta['recipe']}, "
            f"{meta['quantized_bytes'] / 1e6:.1f} MB quantized, pages of {meta['page_bytes']} B, float32 scales)"
            if not meta.get("checkpoint") else
            ("Qwen3-30B-A3B-shaped synthetic checkpoint (random codes, qwen3-16gb)" if meta["synthetic"]
             else f"Checkpoint {meta['checkpoint']}"))
    text = (f"{what}: {m['num_hidden_layers']} layers, hidden {m['hidden_size']}, {m['num_experts']} experts "
            f"top-{m['num_experts_per_tok']}, moe_intermediate {m['moe_intermediate_size']}. Prompt {a.prompt} "
            f"tokens, {a.tokens} decoded " + (f"at temperature {a.temp} with a fixed seed" if a.temp > 0 else
                                               "greedily") +
            f"; a fresh model and pager every run, {a.repeats} repetitions of every row, interleaved, the rows' "
            "order rotating: median (min-max). Step queued: whole (the device waits inside the step for each MoE "
            "layer's slots and copies its pages in; CUDA), auto (timed both ways, the faster run: the steps queued "
            "whole, medians) or by stretch (the host queues the layers up to the next MoE layer after each "
            "routing read); \"again\": steps the device stopped waiting in, run again layer by layer (medians); "
            "\"then by stretch\": runs whose pager stopped queuing steps whole after QUEUE_GIVE_UP of them fell back. "
            "Counters (hit rate, misses, evictions) are medians of the runs; "
            "measured peak is the largest. Read GB/s: bytes read over the seconds spent reading and checking "
            "pages. sync and host ms: per MoE layer and forward pass, waiting for the routing read and in the "
            "pager's host work. Budget: the least `--memory-budget` the planner gives these slots for; measured "
            "peak: MLX's peak less what it held before the model loaded, plus the staging buffer the pages are "
            "read into (host memory).")
    def share(key: str, pick) -> float | None:
        xs = [r["summary"][key] for r in rows if r["summary"].get(key) is not None]
        return pick(xs) if xs else None

    warm = share("cached_after_warm_min", min)
    warm = f" (mincore: at least {warm:.1%} of it cached)" if warm is not None else ""
    if a.cold:
        drop = share("cached_after_drop_max", max)
        text += (" Cold: before each run the pack's files were dropped from the OS page cache with "
                 "posix_fadvise(POSIX_FADV_DONTNEED), without root, which is best-effort"
                 + (f" (mincore: at most {drop:.1%} of the pack still cached after a drop)" if drop is not None
                    else "") + f"; warm: the pack was read once before each run{warm}.")
    else:
        text += f" The pack was read once before each run{warm}: pages come from the OS page cache, not the disk."
    text += (" Routers are random, so the hit rates show how the pager behaves, not what a trained model's routing "
             f"gets. The machine ({meta['cpus']} cores) was shared with other jobs (1-min load average "
             f"{meta['load_average_start']:.1f} at the start, {meta['load_average_end']:.1f} at the end), so speeds "
             "are noisy, hence the interleaving.")
    return text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default 8; --synthetic: the config's)")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=32, help="prompt tokens (random ids), one prefill chunk")
    ap.add_argument("--tokens", type=int, default=64, help="tokens decoded a run")
    ap.add_argument("--repeats", type=int, default=3, help="runs of every row, interleaved")
    ap.add_argument("--temp", type=float, default=1.0, help="sampling temperature, seeded (0: greedy)")
    ap.add_argument("--fractions", default="1.0,0.5,0.25", help="shares of each layer's experts resident")
    ap.add_argument("--speculate", default="off,auto",
                    help="comma-separated ExpertPager(speculate=) values: off, auto (the default), always")
    ap.add_argument("--cold", action="store_true", help="also with the pack dropped from the OS page cache")
    ap.add_argument("--verify-cost", action="store_true", help="a row at 50%% without CRC32 checks")
    ap.add_argument("--by-stretch", action="store_true",
                    help="rows at 50%% with each step queued whole (queue=\"always\") and a stretch between two MoE "
                         "layers at a time (queue=\"off\")")
    ap.add_argument("--synthetic", metavar="DIR", help="write (or reuse) a real-size synthetic Qwen3-30B-A3B here")
    ap.add_argument("--ckpt", metavar="DIR", help="a quantized checkpoint to page instead")
    ap.add_argument("--no-save", action="store_true", help="print the table, write no results file")
    a = ap.parse_args()
    if a.synthetic and a.ckpt:
        ap.error("one of --synthetic DIR or --ckpt DIR")
    for s in a.speculate.split(","):
        if s.strip() not in ("off", "auto", "always"):
            ap.error(f"--speculate: {s!r} is not one of off, auto, always")
    from rq_core.checkpoint import load_config

    load_start = os.getloadavg()[0]
    tmp = None
    try:
        if a.synthetic or a.ckpt:
            ck, setup = existing(a)
            setup["checkpoint"] = str(ck)
        else:
            a.layers = 8 if a.layers is None else a.layers
            tmp = Path(tempfile.mkdtemp(prefix="rq-pager-"))
            ck, setup = scaled_down(tmp, a)
        cfg = load_config(ck)
        files = pack_files(ck)
        prompt = [int(x) for x in mx.random.randint(0, cfg["vocab_size"], (a.prompt,), key=mx.random.key(1))]
        todo = cells(a)
        if a.cold:
            print("--cold: page files dropped from the OS page cache with posix_fadvise(POSIX_FADV_DONTNEED), "
                  "best-effort (no root); mincore says how much stayed", flush=True)
        # one untimed run first: the process's first decode pays one-time costs (allocations, kernel setup)
        from rq_core.checkpoint import load
        from rq_core.generate import generate

        generate(load(ck, tokenizer=False).model, prompt, max_tokens=4, temp=a.temp, seed=0, prefill_chunk=a.prompt)
        runs: list[list[dict]] = [[] for _ in todo]
        for r in range(a.repeats):
            order = list(range(len(todo)))
            order = order[r % len(order):] + order[:r % len(order)]
            for i in order:
                x = run_one(ck, cfg, todo[i], prompt, a, files)
                x["repeat"] = r
                runs[i].append(x)
                extra = "" if x.get("cached_after_drop") is None else f", {x['cached_after_drop']:.1%} cached"
                print(f"repeat {r} {label(todo[i]):28} decode {x['decode_tok_per_s']:6.1f} tok/s, steady "
                      f"{x['steady_decode_tok_per_s']:6.1f}, peak {x['measured_peak_bytes'] / 1e6:8.1f} MB"
                      + extra, flush=True)
        ref = runs[0][0]["tokens"]
        full = summarize(todo[0], runs[0], ref, None)
        rows = [{"cell": c, "summary": full if i == 0 else summarize(c, runs[i], ref, full),
                 "runs": [compact(x) for x in runs[i]]} for i, c in enumerate(todo)]
        meta = {**setup, "model": {k: cfg[k] for k in MODEL_KEYS}, "prompt_tokens": a.prompt,
                "decode_tokens": a.tokens, "temp": a.temp, "repeats": a.repeats, "cpus": os.cpu_count(),
                "load_average_start": load_start, "load_average_end": os.getloadavg()[0]}
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    big = max(r["summary"]["measured_peak_bytes"] for r in rows) >= 1e9
    body = table(rows, ("GB", 1e9) if big else ("MB", 1e6)) + "\n\n" + note(meta, rows, a)
    print(body)
    if not a.no_save:
        from _readme import save

        save("pager", {"meta": meta, "rows": rows}, body)  # one file, overwritten by a rerun


if __name__ == "__main__":
    main()
