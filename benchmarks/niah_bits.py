"""Needle retention against the bits given to keys and to values (issue 6: the lever for needles).

Runs `rq eval niah`'s trials (3 lengths x 3 depths, --trials per cell) for one IsoQuant setting with the default
32-token fp16 window: the real cache at --bits, or kv_study's SplitBitsCache (quantize -> dequantize, the same life
cycle as the cache) with --key-bits / --value-bits. --compare pairs result files needle by needle with fp16.

    python benchmarks/niah_bits.py --seed 2 --key-bits 4 --value-bits 2 --out K4V2-s2.json
    python benchmarks/niah_bits.py --seed 2 --bits 4 --out bits4-s2.json
    python benchmarks/niah_bits.py --seed 2 --key-bits 4 --real --out K4V3-real-s2.json   # kv.key_bits
    python benchmarks/niah_bits.py --seed 2 --qjl --out qjl3-s2.json   # keys 2-bit codes + 1-bit residual sketch
    python benchmarks/niah_bits.py --seed 2 --pairvq --out pairvq3-s2.json   # keys: a 2-D codebook a coordinate pair
    python benchmarks/niah_bits.py --seed 2 --pair-points 128,32 --out pp-s2.json   # 2-D codebooks: 3.5 + 2.5 bits
    python benchmarks/niah_bits.py --seed 2 --pair-points 128,32 --real --out pp-real-s2.json   # kv.pair_points
    python benchmarks/niah_bits.py --compare fp16=A.json:fp16 K4V2=K4V2-s2.json ...
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from rq_core import eval as ev  # noqa: E402
from rq_core.kv_cache import KVSettings  # noqa: E402


def run(seed: int, trials: int, bits: int, key_bits: int | None, value_bits: int | None, real: bool = False,
        qjl: bool = False, pairvq: bool = False, pair_points: tuple = (), edge_layers: int = 0) -> dict:
    import kv_study

    em = ev.load_eval_model(None)
    ids = ev.encode_ids(em.tokenizer, ev.load_heldout_text())
    kv = KVSettings(mode="isoquant3", bits=bits, rotation="wht_so4", fp16_window=32,
                    key_bits=key_bits if real else None, pair_points=tuple(pair_points) if real and pair_points else (),
                    edge_layers=edge_layers)
    model = em.model
    emulated = bool(key_bits or value_bits or qjl or pairvq or pair_points) and not real
    if emulated:
        model = kv_study._CacheModel(em.model, kv_study.Setting("split", kv, key_bits=key_bits or bits,
                                                                 value_bits=value_bits or bits, qjl=qjl,
                                                                 pairvq=pairvq, pair_points=tuple(pair_points)))
    r = ev.niah(model, ids, ev.needle_token_pieces(em.tokenizer), [kv], lengths=[512, 1024, 2048],
                depths=[0.1, 0.5, 0.9], trials=trials, seed=seed)
    r.update(seed=seed, bits=bits, key_bits=key_bits or bits, value_bits=value_bits or bits,
             emulated=emulated, qjl=qjl, pairvq=pairvq, pair_points=list(pair_points), edge_layers=edge_layers)
    return r


def gates(key_bits: int | None, value_bits: int | None, pair_points: tuple = ()) -> dict:
    """`rq eval gates`' twelve gates (the bundled thresholds) for the emulated setting, against fp16."""
    import dataclasses

    import kv_study

    em = ev.load_eval_model(None)
    ids = ev.encode_ids(em.tokenizer, ev.load_heldout_text())
    kv = KVSettings(mode="isoquant3", bits=3, rotation="wht_so4", fp16_window=32, pair_points=())
    model = kv_study._CacheModel(em.model, kv_study.Setting("split", kv, key_bits=key_bits or 3,
                                                             value_bits=value_bits or 3, pair_points=tuple(pair_points)))
    runner = ev.GateRunner(em, ev.load_gates(), ids)
    runner.reference()  # fp16 through the plain model: the wrapper builds the study's caches whatever it is asked
    runner.em = dataclasses.replace(em, model=model)
    rep = runner.run(kv)
    return {"key_bits": key_bits or 3, "value_bits": value_bits or 3, "pair_points": list(pair_points),
            "gates": rep.gates, "passed": rep.passed}


def hits(spec: str, first: int) -> list[int]:
    """FILE[:MODE] -> the mode's needle outcomes, the first `first` of each cell (default mode: the non-fp16 one)."""
    path, _, mode = spec.partition(":")
    modes = json.loads(Path(path).read_text())["modes"]
    mode = mode or next(m for m in modes if m != "fp16")
    return [h for c in modes[mode]["cells"] for h in c["hits"][:first]]


def compare(specs: list[str], first: int) -> None:
    """NAME=SPEC[,SPEC...]: needles concatenated over the specs; the first NAME is the reference."""
    rows = {}
    for s in specs:
        name, _, rest = s.partition("=")
        rows[name] = [h for part in rest.split(",") for h in hits(part, first)]
    ref_name, ref = next(iter(rows.items()))
    print(f"| KV cache | needles retrieved | against {ref_name}: lost / gained | exact McNemar p |")
    print("| --- | --- | --- | --- |")
    for name, h in rows.items():
        lost = sum(1 for r, x in zip(ref, h) if r and not x)
        gained = sum(1 for r, x in zip(ref, h) if x and not r)
        p = "-" if name == ref_name else f"{ev.mcnemar_p(lost, gained):.3f}"
        print(f"| {name} | {sum(h)} / {len(h)} | {lost} / {gained} | {p} |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=2)
    ap.add_argument("--trials", type=int, default=4)
    ap.add_argument("--bits", type=int, default=3, help="the real cache's bits (keys and values)")
    ap.add_argument("--key-bits", type=int, default=None, help="emulated split widths (kv_study.SplitBitsCache)")
    ap.add_argument("--value-bits", type=int, default=None)
    ap.add_argument("--real", action="store_true", help="--key-bits (kv.key_bits; values at --bits) or --pair-points "
                    "(kv.pair_points) through the cache itself, not the emulation")
    ap.add_argument("--qjl", action="store_true", help="keys as (key bits - 1)-bit codes plus a 1-bit sketch of the "
                    "residual (kv_study.QJLKeysCache, TurboQuant's inner-product quantizer)")
    ap.add_argument("--pairvq", action="store_true", help="keys with a 2-D codebook a pair of rotated coordinates "
                    "at the same bits (kv_study.PairVQKeysCache)")
    ap.add_argument("--pair-points", default="", help="K,V: keys and values with 2-D codebooks of K and V points "
                    "(kv_study.PairVQCache; 128,32 is 3.5 + 2.5 bits a coordinate, IsoQuant-3's bytes)")
    ap.add_argument("--edge-layers", type=int, default=0, help="the real cache's kv.edge_layers (first and last N "
                    "layers at 4 bits)")
    ap.add_argument("--gates", action="store_true", help="the twelve gates for the emulated setting instead of needles")
    ap.add_argument("--out", default=None)
    ap.add_argument("--compare", nargs="+", default=None, metavar="NAME=FILE[:MODE][,FILE[:MODE]...]")
    a = ap.parse_args()
    if a.compare:
        compare(a.compare, a.trials)
        return 0
    pp = tuple(int(x) for x in a.pair_points.split(",")) if a.pair_points else ()
    if a.gates:
        g = gates(a.key_bits, a.value_bits, pp)
        text = json.dumps(g, indent=1)
        if a.out:
            Path(a.out).write_text(text)
        print(f"{g['passed']} of {len(g['gates'])} gates passed: "
              + ", ".join(f"{x['name']} {'ok' if x['passed'] else 'FAIL'}" for x in g["gates"]))
        return 0
    r = run(a.seed, a.trials, a.bits, a.key_bits, a.value_bits, a.real, a.qjl, a.pairvq, pp, a.edge_layers)
    print(json.dumps({k: v["accuracy"] for k, v in r["modes"].items()}))
    if a.out:
        Path(a.out).write_text(json.dumps(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
