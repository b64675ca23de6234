"""K and V vectors of the bundled model on the calibration text (not the held-out plays), for
`rq calibrate-codebook --from-samples`: the fp16 cache's keys (after RoPE) and values of every layer and kv head,
as [N, d] float32 tensors `keys` and `values` in one .safetensors file.

    python3 tools/kv_samples.py --out kv.safetensors [--windows 4 --context 1024]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
from safetensors.numpy import save_file  # noqa: E402

from rq_core.tools import eval as ev  # noqa: E402
from rq_core.cache.kv_cache import KVSettings  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--context", type=int, default=1024)
    a = ap.parse_args()
    em = ev.load_eval_model(None)
    text = (ROOT / "rq_core" / "assets" / "calibration.txt").read_text()
    ids = ev.encode_ids(em.tokenizer, text)
    ks, vs = [], []
    for w in ev.windows(ids, a.context, a.windows):
        cache = em.model.make_cache(KVSettings(mode="fp16"))
        mx.eval(em.model(mx.array(w[None, :-1]), cache=cache))
        for c in cache:
            k, v = c.keys[..., : c.offset, :], c.values[..., : c.offset, :]
            ks.append(np.array(k.astype(mx.float32)).reshape(-1, k.shape[-1]))
            vs.append(np.array(v.astype(mx.float32)).reshape(-1, v.shape[-1]))
    save_file({"keys": np.concatenate(ks), "values": np.concatenate(vs)}, a.out)
    print(f"{a.out}: keys {sum(x.shape[0] for x in ks)} x {ks[0].shape[1]}, values likewise")
    return 0


if __name__ == "__main__":
    sys.exit(main())
