"""One rank of tests/test_distributed.py: greedy tokens of each case (checkpoint, KV mode) split over the
group that MLX_RANK / MLX_HOSTFILE describe; rank 0 writes them as JSON to argv[1]. argv[2]: the cases
(JSON [[path, kv mode], ...])."""

from __future__ import annotations

import json
import sys

from rq_core import distributed as dist
from rq_core.cache.kv_cache import KVSettings
from rq_core.checkpoint import load
from rq_core.generate import generate

PROMPT = list(range(3, 23))  # 20 tokens: past the tiny Gemma's window of 8 and the Mamba chunk of 16
KV = {"fp16": KVSettings(), "isoquant3": KVSettings(mode="isoquant3", fp16_window=4, edge_layers=1)}


def tokens(rank: dist.Rank, path: str, kv: str) -> list[int]:
    ckpt = dist.shard_checkpoint(load(path, cpu_float32=True, tokenizer=False), rank)
    cache = ckpt.model.make_cache(KV[kv])
    res = generate(ckpt.model, PROMPT, max_tokens=8, kv=KV[kv], prefill_chunk=6, cache=cache)
    return res.tokens


def main() -> None:
    out, cases = sys.argv[1], json.loads(sys.argv[2])
    rank = dist.start()
    got = [tokens(rank, p, kv) for p, kv in cases]
    if rank.rank == 0:
        with open(out, "w") as f:
            json.dump(got, f)


if __name__ == "__main__":
    main()
