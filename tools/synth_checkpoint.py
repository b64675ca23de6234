"""Write a quantized checkpoint of a real model config with random weights (rq_core.tools.synth), for benchmarks.

    python3 tools/synth_checkpoint.py qwen3-30b-a3b --recipe qwen3-16gb -o /tmp/q3
    python3 tools/synth_checkpoint.py nemotron3-nano-30b-a3b --recipe nemotron-32gb -o /tmp/nano --layers 4
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rq_core.errors import RQError  # noqa: E402
from rq_core.tools.synth import default_recipe, read_config, truncate, write  # noqa: E402


def _stderr_progress(stage: str, done: int, total: int) -> None:
    print(f"\r{stage} {done}/{total}", end="\n" if done == total else "", file=sys.stderr, flush=True)


def main() -> None:
    try:
        _main()
    except RQError as e:  # bad input: one line
        sys.exit(f"error: {e}")


def _main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config", help="a config JSON, or a name in tests/data/configs (qwen3-30b-a3b, ...)")
    ap.add_argument("--recipe", help="recipe name or TOML (default: the family's shipped recipe)")
    ap.add_argument("-o", "--out", required=True, help="output directory (replaced)")
    ap.add_argument("--layers", type=int, help="decoder layers (default: the config's)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--routing", default="uniform", help="uniform (random routers) or zipf[:S]: router rows scaled so "
                                                         "that experts' selection follows a Zipf law of exponent S")
    ap.add_argument("--packed", action="store_true", help="the routed experts only in OUT/experts, as `rq pack --move` "
                                                          "leaves them (one copy on disk)")
    ap.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    a = ap.parse_args()
    cfg = read_config(a.config)
    if a.layers is not None:
        cfg = truncate(cfg, a.layers)
    try:
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
        bar = Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                       TimeElapsedColumn(), transient=True)
    except ImportError:  # pragma: no cover
        bar = None
    recipe_name = a.recipe or default_recipe(cfg)
    if bar is None:
        s = write(cfg, recipe_name, a.out, seed=a.seed, progress=_stderr_progress, routing=a.routing,
                  packed=a.packed)
    else:
        with bar:
            task = bar.add_task("writing shards", total=None)
            s = write(cfg, recipe_name, a.out, seed=a.seed, routing=a.routing, packed=a.packed,
                      progress=lambda st, d, t: bar.update(task, completed=d, total=t))
    if a.json:
        print(json.dumps({"out": a.out, **s}))
    else:
        print(f"wrote {a.out}: {s['tensors']} tensors ({s['quantized']} quantized), {s['shards']} shards, "
              f"{s['bytes'] / 1e9:.2f} GB in {s['seconds']:.1f} s")


if __name__ == "__main__":
    main()
