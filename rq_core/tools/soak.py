"""Stability runs: generate for minutes or hours and track memory, speed and quality over time.

Every interval a sample records process and MLX memory, decode tok/s, pager stats and a light set of
quality checks; the report (JSON) is rewritten atomically after each sample, so it is valid whenever
the run stops. The summary judges: memory growth (least-squares slope of memory between
generations), throughput drift (slope of tok/s), and the checks.
"""

from __future__ import annotations

import math
import os
import resource
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import mlx.core as mx

from rq_core.errors import RQError
from rq_core.textio import dumps_strict, finite_or_none

SCHEMA = "rq.soak/1"
MB = 1 << 20
LEAK_ENV = "RQ_SOAK_TEST_LEAK_MB"  # test-only: allocate and keep this many MB at every sample


# ------------------------------------------------------------------------------------------- memory
def process_rss_bytes() -> int:
    """The process' resident set now (Linux /proc; elsewhere the peak, the best portable figure)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return peak_rss_bytes()


def peak_rss_bytes() -> int:
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(r if sys.platform == "darwin" else r * 1024)  # bytes on macOS, KiB on Linux


def memory_now() -> dict[str, int]:
    return {"rss_bytes": process_rss_bytes(), "active_bytes": int(mx.get_active_memory()),
            "cache_bytes": int(mx.get_cache_memory())}


# -------------------------------------------------------------------------------------------- stats
def linear_fit(xs: list[float], ys: list[float]) -> tuple[float, float, float]:
    """Least squares y ≈ slope·x + intercept: (slope, intercept, r²); needs two distinct x."""
    n = len(xs)
    if n < 2:
        raise ValueError("a fit needs at least two points")
    mx_, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx_) ** 2 for x in xs)
    if sxx == 0:
        raise ValueError("a fit needs two distinct x")
    sxy = sum((x - mx_) * (y - my) for x, y in zip(xs, ys))
    syy = sum((y - my) ** 2 for y in ys)
    slope = sxy / sxx
    r2 = (sxy * sxy) / (sxx * syy) if syy > 0 else 1.0
    return slope, my - slope * mx_, r2


def theil_sen(xs: list[float], ys: list[float], max_points: int = 1500) -> tuple[float, float]:
    """Robust line fit: (median pairwise slope, median intercept); long series are thinned evenly."""
    if len(xs) > max_points:
        step = len(xs) / max_points
        idx = [int(i * step) for i in range(max_points)]
        xs, ys = [xs[i] for i in idx], [ys[i] for i in idx]
    slopes = [(ys[j] - ys[i]) / (xs[j] - xs[i]) for i in range(len(xs)) for j in range(i + 1, len(xs))
              if xs[j] != xs[i]]
    if not slopes:
        raise ValueError("a fit needs two distinct x")
    slope = statistics.median(slopes)
    return slope, statistics.median([y - slope * x for x, y in zip(xs, ys)])


def coefficient_of_variation(ys: list[float]) -> Optional[float]:
    """Population standard deviation over the mean (None for an empty or zero-mean series)."""
    if not ys:
        return None
    m = sum(ys) / len(ys)
    if m == 0:
        return None
    return math.sqrt(sum((y - m) ** 2 for y in ys) / len(ys)) / m


class RunningStats:
    """Mean, CV, min and max of a long series without keeping it (Welford)."""

    def __init__(self) -> None:
        self.n, self.mean, self.m2 = 0, 0.0, 0.0
        self.min, self.max = math.inf, -math.inf

    def add(self, x: float) -> None:
        self.n += 1
        d = x - self.mean
        self.mean += d / self.n
        self.m2 += d * (x - self.mean)
        self.min, self.max = min(self.min, x), max(self.max, x)

    @property
    def cv(self) -> Optional[float]:
        if self.n == 0 or self.mean == 0:
            return None
        return math.sqrt(self.m2 / self.n) / self.mean


@dataclass
class Thresholds:
    """What makes a soak fail."""

    max_growth_mb: float = 64.0  # memory growth over the run (fit), absolute allowance ...
    max_growth_frac: float = 0.05  # ... or this fraction of the mean, whichever is larger
    max_throughput_drop: float = 0.30  # fitted decode tok/s at the end vs the start
    warmup_samples: int = 1  # samples left out of the fits (allocator and caches settling)


def _growth(ts: list[float], ys: list[float], th: Thresholds) -> dict[str, Any]:
    """Least-squares growth of one memory series; `passed` False when it grows past the allowance."""
    if len(ts) < 3 or ts[-1] == ts[0]:
        return {"slope_bytes_per_hour": None, "growth_bytes": None, "r2": None, "allowed_bytes": None,
                "passed": None, "note": "fewer than 3 samples after warm-up: no fit"}
    slope, _, r2 = linear_fit(ts, ys)  # bytes per second
    growth = slope * (ts[-1] - ts[0])
    allowed = max(th.max_growth_mb * MB, th.max_growth_frac * (sum(ys) / len(ys)))
    return {"slope_bytes_per_hour": slope * 3600, "growth_bytes": growth, "r2": r2, "allowed_bytes": allowed,
            "passed": growth <= allowed}


def summarize(samples: list[dict], th: Thresholds, decode_mem: Optional[RunningStats] = None) -> dict[str, Any]:
    """The verdict of a soak from its samples (see the module doc)."""
    failures: list[str] = []
    fit = samples[th.warmup_samples:] if len(samples) > th.warmup_samples else []
    ts = [s["t_s"] for s in fit]
    active = _growth(ts, [float(s["active_bytes"]) for s in fit], th)
    rss = _growth(ts, [float(s["rss_bytes"]) for s in fit], th)
    for name, g in (("MLX active memory", active), ("process RSS", rss)):
        if g["passed"] is False:
            failures.append(f"{name} grew {g['growth_bytes'] / MB:.1f} MB over the run "
                            f"(allowed {g['allowed_bytes'] / MB:.1f} MB)")

    # Throughput drift: decode tok/s of the last third of the run against the first third, each as
    # tokens / decode time summed over its samples (an interval with few tokens weighs little).
    tp = [x for x in fit if x.get("interval_decode_s")]
    drift: dict[str, Any] = {"slope_tok_per_s_per_hour": None, "start_tok_per_s": None, "end_tok_per_s": None,
                             "drift_frac": None, "passed": None}
    if len(tp) >= 6 and tp[-1]["t_s"] > tp[0]["t_s"]:
        k = len(tp) // 3
        start = sum(x["interval_tokens"] for x in tp[:k]) / sum(x["interval_decode_s"] for x in tp[:k])
        end = sum(x["interval_tokens"] for x in tp[-k:]) / sum(x["interval_decode_s"] for x in tp[-k:])
        frac = end / start - 1 if start > 0 else None
        ok = frac is None or frac >= -th.max_throughput_drop
        # Theil-Sen slope of the per-sample tok/s (median of pairwise slopes), for the record.
        slope, _ = theil_sen([x["t_s"] for x in tp], [x["decode_tok_per_s"] for x in tp])
        drift.update(slope_tok_per_s_per_hour=slope * 3600, start_tok_per_s=start, end_tok_per_s=end,
                     drift_frac=frac, passed=ok)
        if not ok:
            failures.append(f"decode throughput fell {-frac:.0%} over the run (allowed {th.max_throughput_drop:.0%})")
    else:
        drift["note"] = "fewer than 6 samples with decoding after warm-up: not judged"

    gates: dict[str, dict[str, Any]] = {}
    for s in samples:
        for name, g in (s.get("gates") or {}).items():
            agg = gates.setdefault(name, {"checks": 0, "failures": 0, "passed": True, "first_failure": None})
            agg["checks"] += 1
            if not g["passed"]:
                agg["failures"] += 1
                agg["passed"] = False
                if agg["first_failure"] is None:
                    agg["first_failure"] = {"t_s": s["t_s"], "detail": g.get("detail")}
    for name, agg in gates.items():
        if not agg["passed"]:
            failures.append(f"gate {name} failed {agg['failures']} of {agg['checks']} checks")

    if samples and not samples[-1].get("tokens_total"):  # nothing ran that the verdict could judge
        failures.append("no token was generated in the run's time (its first checks took all of it): nothing was "
                        "judged; run longer")
    tok = [s["decode_tok_per_s"] for s in samples if s.get("decode_tok_per_s")]
    rss_series = [s["rss_bytes"] for s in fit]
    act_series = [s["active_bytes"] for s in fit]
    return {
        "samples": len(samples),
        "tokens_generated": samples[-1]["tokens_total"] if samples else 0,
        "generations": samples[-1]["generations_total"] if samples else 0,
        "peak_rss_bytes": max([peak_rss_bytes()] + [s["rss_bytes"] for s in samples]),
        "peak_memory_bytes": max([s["peak_memory_bytes"] for s in samples], default=0),
        "memory_cv": decode_mem.cv if decode_mem and decode_mem.n else coefficient_of_variation(act_series),
        "memory_cv_between_generations": coefficient_of_variation(act_series),
        "rss_cv": coefficient_of_variation(rss_series),
        "memory_growth_bytes_per_hour": active["slope_bytes_per_hour"],
        "memory_growth": active,
        "rss_growth": rss,
        "decode_tok_per_s_mean": sum(tok) / len(tok) if tok else None,
        "throughput": drift,
        "throughput_drift": drift["drift_frac"],
        "gates": gates,
        "failures": failures,
        "passed": bool(samples) and not failures,
    }


# ------------------------------------------------------------------------------------------- report
def write_json_atomic(path: str | os.PathLike, obj: Any) -> None:
    """Write strict JSON (a NaN or infinite number becomes null) to a temp file in the same directory, then
    rename over `path` (never half a file)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(dumps_strict(finite_or_none(obj), indent=1, default=_json_default))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _json_default(o: Any) -> Any:
    if hasattr(o, "item"):
        return o.item()
    return str(o)


_SAMPLE_FIELDS = {"t_s": (int, float), "rss_bytes": int, "active_bytes": int, "cache_bytes": int,
                  "peak_memory_bytes": int, "tokens_total": int, "generations_total": int,
                  "decode_tok_per_s": (int, float, type(None)), "gates": dict}
_SUMMARY_FIELDS = ("peak_rss_bytes", "peak_memory_bytes", "memory_cv", "memory_growth_bytes_per_hour",
                   "throughput_drift", "gates", "failures", "passed")


def validate_report(report: Any) -> list[str]:
    """Problems with a soak report's structure (empty when it is valid)."""
    errs: list[str] = []
    if not isinstance(report, dict):
        return ["the report is not a JSON object"]
    if report.get("schema") != SCHEMA:
        errs.append(f"schema is {report.get('schema')!r}, expected {SCHEMA!r}")
    for k in ("model", "kv_mode", "interval_s", "duration_s", "started_at", "elapsed_s", "status", "samples",
              "summary", "passed", "thresholds"):
        if k not in report:
            errs.append(f"missing field {k!r}")
    if report.get("status") not in ("running", "completed", "interrupted", "error"):
        errs.append(f"bad status {report.get('status')!r}")
    samples = report.get("samples")
    if not isinstance(samples, list):
        errs.append("samples is not a list")
        samples = []
    last_t = -math.inf
    for i, s in enumerate(samples):
        for k, typ in _SAMPLE_FIELDS.items():
            if k not in s:
                errs.append(f"sample {i} lacks {k!r}")
            elif not isinstance(s[k], typ) or isinstance(s[k], bool):
                errs.append(f"sample {i}: {k!r} has type {type(s[k]).__name__}")
        if isinstance(s.get("t_s"), (int, float)):
            if s["t_s"] < last_t:
                errs.append(f"sample {i}: time goes backwards")
            last_t = s["t_s"]
    summary = report.get("summary")
    if not isinstance(summary, dict):
        errs.append("summary is not an object")
    else:
        for k in _SUMMARY_FIELDS:
            if k not in summary:
                errs.append(f"summary lacks {k!r}")
        if "passed" in summary and summary["passed"] != report.get("passed"):
            errs.append("summary.passed and passed disagree")
    if not isinstance(report.get("passed"), bool):
        errs.append("passed is not a boolean")
    return errs


# ------------------------------------------------------------------------------------------ prompts
class PromptSource:
    """Varied prompts: slices of the shipped held-out text at random places and lengths (token ids)."""

    def __init__(self, tokenizer: Any, vocab_size: int, max_prompt: int, seed: int = 0) -> None:
        import numpy as np

        self.rng = np.random.default_rng(seed)
        self.tokenizer, self.vocab_size, self.max_prompt = tokenizer, vocab_size, max(4, max_prompt)
        self.text = ""
        if tokenizer is not None:
            try:
                from rq_core.tools.eval import load_heldout_text

                self.text = load_heldout_text()
            except (ImportError, RQError):
                self.text = ""

    def probe(self) -> list[int]:
        """The fixed prompt of the per-sample checks."""
        return self._from(0, 24)

    def next(self) -> list[int]:
        n = int(self.rng.integers(min(8, self.max_prompt), self.max_prompt + 1))
        span = max(1, len(self.text) - 8 * n) if self.text else 1 << 30
        start = int(self.rng.integers(0, span))
        return self._from(start, n)

    def _from(self, start: int, n: int) -> list[int]:
        n = min(n, self.max_prompt)
        if self.text:
            ids = self.tokenizer.encode(self.text[start : start + 8 * n + 64], add_special_tokens=False)
            if len(ids) >= 4:
                return list(ids[:n])
        import numpy as np

        return [int(x) for x in np.random.default_rng(start).integers(1, self.vocab_size, n)]


# ---------------------------------------------------------------------------------------- the run
@dataclass
class SoakSettings:
    duration_s: float
    interval_s: float
    kv_mode: str = "isoquant3"
    max_tokens: int = 64  # per generation (shortened to fit the model's context)
    max_prompt: int = 256
    temp: float = 0.8
    top_p: float = 0.95
    seed: int = 0
    probe_tokens: int = 16
    thresholds: Thresholds = field(default_factory=Thresholds)


def default_interval(duration_s: float) -> float:
    """About 20 samples per run, between 1 s and 60 s apart."""
    return min(60.0, max(1.0, duration_s / 20))


def repeat_fraction(tokens: list[int], n: int = 4) -> float:
    """Share of repeated n-grams (as `rq eval gates` measures degenerate repetition)."""
    grams = [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]
    return 1.0 - len(set(grams)) / len(grams) if grams else 0.0


def gate_thresholds() -> dict[str, float]:
    """Thresholds of the gates the soak checks, from `rq eval gates`' gates.toml (defaults if absent)."""
    th = {"kv_bytes_ratio": 0.25, "no_degenerate_repetition": 0.10}
    try:
        from rq_core.tools.eval import load_gates

        th.update({k: float(v) for k, v in load_gates()["gates"].items() if k in th})
    except (ImportError, RQError, KeyError):
        pass
    return th


class Soak:
    """Generate continuously, sampling every `interval_s`; `run()` returns the final report."""

    def __init__(self, ckpt: Any, settings: SoakSettings, report_path: str | os.PathLike, *,
                 kv: Any = None, pager: Any = None, on_sample: Optional[Callable[[dict], None]] = None) -> None:
        from rq_core.checkpoint import context_length, text_config
        from rq_core.cache.kv_cache import KVSettings

        if not (math.isfinite(settings.duration_s) and settings.duration_s > 0):
            raise RQError("the soak needs a positive, finite duration")
        if not (math.isfinite(settings.interval_s) and settings.interval_s > 0):
            raise RQError("--interval must be positive and finite")
        self.ckpt, self.s, self.path = ckpt, settings, Path(report_path)
        self.kv = kv or KVSettings(mode=settings.kv_mode)
        self.pager, self.on_sample = pager, on_sample
        cfg = text_config(ckpt.config)
        self.context = context_length(ckpt.config) or 4096
        vocab = cfg.get("vocab_size") or 32000
        max_prompt = min(settings.max_prompt, max(4, self.context // 2))
        self.max_tokens = max(1, min(settings.max_tokens, self.context - max_prompt))
        self.prompts = PromptSource(ckpt.tokenizer, vocab, max_prompt, settings.seed)
        self.eos = ckpt.eos_token_ids if hasattr(ckpt, "eos_token_ids") else set()
        self.samples: list[dict] = []
        self.decode_mem = RunningStats()
        self.leak_mb = float(os.environ.get(LEAK_ENV, "0") or 0)
        self._leaked: list[mx.array] = []
        self._probe_own: Optional[list[int]] = None
        self._ref_cont: Optional[list[int]] = None
        self._ref_repeat = 0.0
        self._probe_agreement: Optional[float] = None
        self.gate_thresholds = gate_thresholds()
        self.report: dict[str, Any] = {}

    # -- one generation --
    def _generate(self, prompt: list[int], *, temp: float, max_tokens: int, seed: int,
                  on_token: Optional[Callable[[int], None]] = None, kv: Any = None) -> Any:
        from rq_core.generate import generate

        return generate(self.ckpt.model, prompt, max_tokens=max_tokens, temp=temp, top_p=self.s.top_p, seed=seed,
                        kv=kv or self.kv, eos_token_ids=self.eos, context_length=self.context, on_token=on_token)

    def _reference(self, probe: list[int]) -> None:
        """fp16 references for the checks, computed once: the greedy probe continuation and its repetition."""
        from rq_core.cache.kv_cache import KVSettings

        fp16 = KVSettings(mode="fp16")
        self._ref_cont = self._generate(probe, temp=0.0, max_tokens=self.s.probe_tokens, seed=0, kv=fp16).tokens
        self._ref_repeat = repeat_fraction(self._ref_cont)

    def _checks(self) -> dict[str, dict[str, Any]]:
        """A light subset of `rq eval gates` (names and thresholds from its gates.toml) on a fixed probe:
        finite, kv_bytes_ratio, deterministic, no_degenerate_repetition."""
        model, th = self.ckpt.model, self.gate_thresholds
        probe = self.prompts.probe()
        if self._ref_cont is None:
            self._reference(probe)
        gates: dict[str, dict[str, Any]] = {}
        # Teacher-forced on fp16's greedy continuation: finite logits and top-1 agreement with fp16.
        cache = model.make_cache(self.kv)
        logits = model(mx.array([probe], mx.int32), cache=cache)[:, -1]
        for c in cache:
            c.end_prefill()
        finite, agree = True, 0
        for i, t in enumerate(self._ref_cont):
            finite = finite and bool(mx.all(mx.isfinite(logits)).item())
            agree += int(mx.argmax(logits, axis=-1).item()) == t
            if i + 1 < len(self._ref_cont):
                logits = model(mx.array([[t]], mx.int32), cache=cache)[:, -1]
        gates["finite"] = {"passed": finite, "value": float(finite), "detail": "no NaN/Inf in the probe's logits"}
        # Top-1 agreement with fp16's greedy probe, for the record only: on one short probe it moves in
        # steps of 1/probe_tokens, too coarse to judge `greedy_agreement`'s threshold (rq eval gates does,
        # over 4 prompts x 64 tokens); a change during the soak shows up in `deterministic`.
        self._probe_agreement = agree / len(self._ref_cont) if self._ref_cont else None
        # Bytes of the compressed layers' packed tokens against fp16 for the same tokens (the probe is short, so the
        # fp16 window would dominate a ratio over all tokens; not checked when the window holds every token)
        sizes = [c.packed_ratio() for c in cache if hasattr(c, "packed_ratio")]
        if sum(f for _, f in sizes):
            ratio = sum(p for p, _ in sizes) / sum(f for _, f in sizes)
            gates["kv_bytes_ratio"] = {"passed": ratio <= th["kv_bytes_ratio"], "value": ratio,
                                       "detail": f"<= {th['kv_bytes_ratio']} (packed tokens of compressed layers)"}
        del cache
        # The mode's own greedy probe: unchanged since the start (no state leaks between generations),
        # and no more repetitive than fp16's.
        own = self._generate(probe, temp=0.0, max_tokens=self.s.probe_tokens, seed=0).tokens
        if self._probe_own is None:
            self._probe_own = own
        same = own == self._probe_own
        gates["deterministic"] = {"passed": same, "value": float(same),
                                  "detail": "greedy probe unchanged since the start" if same
                                  else f"greedy probe gave {own}, at the start {self._probe_own}"}
        rep = repeat_fraction(own) - self._ref_repeat
        gates["no_degenerate_repetition"] = {"passed": rep <= th["no_degenerate_repetition"], "value": rep,
                                             "detail": f"repeated-4-gram share - fp16's <= "
                                                       f"{th['no_degenerate_repetition']}"}
        return gates

    # -- the loop --
    def _sample(self, t: float, acc: dict, *, checks: bool = True) -> dict:
        """One row of the series (memory, speed, pager; the checks when due). Resets the interval's counters."""
        if self.leak_mb > 0:  # test hook: a leak the growth fit must catch
            a = mx.ones((int(self.leak_mb * MB) // 4,), mx.float32)
            mx.eval(a)
            self._leaked.append(a)
        mem = memory_now()  # before the checks, which allocate caches of their own
        peak = max(acc["peak"], int(mx.get_peak_memory()))
        gates = None
        now = time.perf_counter()
        due = self._last_check is None or (now - self._last_check >= self._check_every
                                           and now + self._check_cost < self._deadline)
        if checks and due:
            gates = self._checks()
            done = time.perf_counter()
            # Checks take at most ~25% of the run: on a slow machine they are spaced by 3× their own
            # cost (on a fast one they run every interval), and none starts that would overrun the time.
            self._check_cost = done - now
            self._check_every = max(self.s.interval_s, 3 * self._check_cost)
            self._last_check = done
        s = {
            "t_s": round(t, 3),
            "wall_time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            **mem,
            "peak_memory_bytes": peak,
            "decode_memory_max_bytes": int(acc["decode_mem_max"]),
            "tokens_total": self._tokens_total,
            "generations_total": self._gens_total,
            "interval_tokens": acc["tokens"],
            "interval_decode_s": round(acc["decode_s"], 6),
            "decode_tok_per_s": acc["tokens"] / acc["decode_s"] if acc["decode_s"] > 0 else None,
            "pager": self._pager_stats(),
            "gates": gates or {},
            "probe_greedy_agreement": self._probe_agreement if gates else None,
        }
        if self.leak_mb > 0:
            s["test_leak_bytes"] = len(self._leaked) * int(self.leak_mb * MB)
        self.samples.append(s)
        acc.update(self._new_acc())
        return s

    def _pager_stats(self) -> Optional[dict]:
        if self.pager is None:
            return None
        st = self.pager.report() if hasattr(self.pager, "report") else getattr(self.pager, "stats", None)
        if st is None:
            return None
        return asdict(st) if hasattr(st, "__dataclass_fields__") else dict(st)

    def _write(self, status: str, t0_wall: str, elapsed: float) -> dict:
        summary = summarize(self.samples, self.s.thresholds, self.decode_mem)
        self.report = {
            "schema": SCHEMA,
            "model": str(getattr(self.ckpt, "path", "")),
            "model_type": self.ckpt.config.get("model_type"),
            "kv_mode": self.kv.mode,
            "kv": asdict(self.kv) if hasattr(self.kv, "__dataclass_fields__") else None,
            "pager": None if self.pager is None else getattr(self.pager, "policy", "on"),
            "backend": "cpu" if mx.default_device() == mx.cpu else "gpu",
            "interval_s": self.s.interval_s,
            "duration_s": self.s.duration_s,
            "started_at": t0_wall,
            "updated_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "elapsed_s": round(elapsed, 3),
            "status": status,
            "thresholds": asdict(self.s.thresholds),
            "gate_thresholds": self.gate_thresholds,  # of the checked subset of `rq eval gates`
            "checks_every_s": round(self._check_every, 3),  # spacing of the checks (≥ interval_s)
            "test_leak_mb": self.leak_mb or None,
            "samples": self.samples,
            "summary": summary,
            "passed": summary["passed"] if status != "error" else False,
        }
        write_json_atomic(self.path, self.report)
        return self.report

    def run(self) -> dict:
        """Generate until the time is up (or Ctrl-C), sampling every interval; returns the final report."""
        s = self.s
        self._tokens_total = self._gens_total = 0
        self._last_check, self._check_every, self._check_cost = None, s.interval_s, 0.0
        # Warm-up (not in the series): compile/allocate what a generation needs.
        self._generate(self.prompts.next(), temp=s.temp, max_tokens=min(8, self.max_tokens), seed=s.seed)
        self._t0_wall = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        self._t0 = time.perf_counter()
        self._deadline = self._t0 + s.duration_s
        acc = self._new_acc()
        status = "running"
        try:
            self._emit(self._sample(0.0, acc), status)
            self._last_sample = time.perf_counter()
            gen_i = 0
            # at least one generation, to its first decode token, however long the first checks took (a slow
            # machine, a short run): a run with nothing decoded has nothing to judge
            while gen_i == 0 or time.perf_counter() < self._deadline:
                gen_i += 1
                self._one_generation(gen_i, acc)
            status = "completed"
        except _TimeUp:
            status = "completed"
        except KeyboardInterrupt:
            status = "interrupted"
        try:  # the last partial interval, without checks (they would overrun the time limit)
            if acc["tokens"]:
                self._sample(time.perf_counter() - self._t0, acc, checks=False)
        except KeyboardInterrupt:
            status = "interrupted"
        report = self._write(status, self._t0_wall, time.perf_counter() - self._t0)
        if self.on_sample:
            self.on_sample(report)
        return report

    def _emit(self, sample: dict, status: str) -> None:
        report = self._write(status, self._t0_wall, time.perf_counter() - self._t0)
        if self.on_sample:
            self.on_sample(report)

    @staticmethod
    def _new_acc() -> dict:
        return {"tokens": 0, "decode_s": 0.0, "peak": 0, "decode_mem_max": 0}

    def _one_generation(self, i: int, acc: dict) -> None:
        """One generation; samples are taken between its tokens when due, so intervals stay regular."""
        state = {"last": None, "n": 0}

        def on_token(_: int) -> None:
            now = time.perf_counter()
            if state["last"] is not None:  # a decode step (the first token comes from the prefill)
                acc["decode_s"] += now - state["last"]
                acc["tokens"] += 1
            state["n"] += 1
            self._tokens_total += 1
            if state["n"] % 4 == 0:  # memory while the cache is live: the decode-time series
                m = mx.get_active_memory()
                self.decode_mem.add(float(m))
                acc["decode_mem_max"] = max(acc["decode_mem_max"], m)
            if now >= self._deadline and acc["tokens"]:
                raise _TimeUp
            if now - self._last_sample >= self.s.interval_s:
                self._emit(self._sample(now - self._t0, acc), "running")
                self._last_sample = now
                now = time.perf_counter()  # the sample's own time is not decode time
            state["last"] = now

        self._gens_total += 1
        res = self._generate(self.prompts.next(), temp=self.s.temp, max_tokens=self.max_tokens,
                             seed=self.s.seed + i, on_token=on_token)
        acc["peak"] = max(acc["peak"], res.peak_memory_bytes)


class _TimeUp(Exception):
    """Raised from inside a generation when the soak's time is up."""
