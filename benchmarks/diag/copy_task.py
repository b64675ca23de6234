"""Can the reference architecture learn to copy on this device? (diagnostic for the needle training)

Trains a tiny qwen2_moe on "random tokens, then the same tokens again" and prints the loss on the
repeated half. It drops to ~0 within a few hundred steps on the CPU (measured 2026-11-29: 0.26 at
step 200). `--attn manual` swaps mx.fast.scaled_dot_product_attention for plain ops, to tell a bad
attention gradient apart from a bad model.
"""
import argparse
import time

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_map

from rq_core.models import qwen2_moe

ap = argparse.ArgumentParser()
ap.add_argument("--steps", type=int, default=300)
ap.add_argument("--attn", choices=["sdpa", "manual"], default="sdpa")
ap.add_argument("--compile", action="store_true")
ap.add_argument("--real", action="store_true", help="the bundled model's sizes (hidden 256, 6 layers, head_dim 128)")
ap.add_argument("--vocab", type=int, default=512)
ap.add_argument("--vary", action="store_true",
                help="spans of 16-64 tokens tiled over 128 (the offset varies per row: needs induction, "
                     "not a fixed-offset positional head); loss on the second half")
args = ap.parse_args()

if args.attn == "manual":
    def manual(cache, q, k, v, *, scale, window=None):
        L = q.shape[2]
        rep = q.shape[1] // k.shape[1]
        k, v = mx.repeat(k, rep, axis=1), mx.repeat(v, rep, axis=1)
        s = (q * scale) @ k.swapaxes(-1, -2)
        s = s + mx.triu(mx.full((L, L), -1e9, s.dtype), k=1)
        return mx.softmax(s.astype(mx.float32), axis=-1).astype(v.dtype) @ v
    qwen2_moe.attend = manual

cfg = dict(model_type="qwen2_moe", vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, head_dim=32, intermediate_size=128, moe_intermediate_size=64,
           shared_expert_intermediate_size=128, num_experts=4, num_experts_per_tok=2, norm_topk_prob=False,
           decoder_sparse_step=1, mlp_only_layers=[], rms_norm_eps=1e-6, rope_theta=10000.0,
           max_position_embeddings=256, tie_word_embeddings=False, qkv_bias=True)
cfg["vocab_size"] = args.vocab
if args.real:
    cfg.update(hidden_size=256, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2, head_dim=128,
               intermediate_size=512, moe_intermediate_size=192, shared_expert_intermediate_size=512, num_experts=8)
mx.random.seed(0)
model = qwen2_moe.Model(qwen2_moe.ModelArgs.from_dict(cfg))
model.update(tree_map(lambda p: mx.random.normal(p.shape, scale=0.02) if p.ndim >= 2 else p, model.parameters()))
opt = optim.AdamW(learning_rate=2e-3, weight_decay=0.1, betas=[0.9, 0.95])
rng = np.random.default_rng(0)


def loss_fn(m, x, y):
    return nn.losses.cross_entropy(m(x), y, reduction="none")[:, x.shape[1] // 2:].mean()


state = [model.state, opt.state]


def step(x, y):
    loss, g = nn.value_and_grad(model, loss_fn)(model, x, y)
    opt.update(model, g)
    return loss


step_c = mx.compile(step, inputs=state, outputs=state) if args.compile else step
t = time.time()
for i in range(args.steps + 1):
    if args.vary:
        r = np.stack([np.tile(rng.integers(0, args.vocab, size=n), 129 // n + 1)[:129]
                      for n in rng.integers(16, 65, size=16)]).astype(np.int32)
    else:
        s = rng.integers(0, args.vocab, size=(16, 32))
        r = np.concatenate([s, s], 1).astype(np.int32)
    loss = step_c(mx.array(r[:, :-1]), mx.array(r[:, 1:]))
    mx.eval(state, loss)
    if i % 50 == 0:
        print(f"{mx.default_device()} attn={args.attn} compile={args.compile} step {i} copy loss {loss.item():.4f} "
              f"({time.time() - t:.0f}s)", flush=True)
