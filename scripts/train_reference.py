"""Train the bundled reference model from scratch: a small qwen2_moe on Shakespeare, with MLX.

Stages (each reads what the one before wrote under --data, default `.train/`, git-ignored):

    python scripts/build_corpus.py                       # train.txt + rq_core/assets/heldout.txt
    python scripts/train_reference.py tokenize           # BPE tokenizer + token ids + unigram baseline
    python scripts/train_reference.py train --out DIR --time-budget 540 --reserve 40   # one H200
    rq quantize DIR --recipe shakespeare-moe --out rq_core/assets/default_model

The bundled model was trained in two phases by `scripts/train_two_phase.sh` (a copy-task phase until induction
forms, then text + needles), then continued with `train --init`: its lineage is in
rq_core/assets/default_model/train_log.md and docs/TRAINING_NOTES.md. Training fits the time budget from the
measured step time, so another machine runs other step counts.

`train` writes a Hugging Face-format checkpoint to DIR (config.json with model_type qwen2_moe,
safetensors with HF names, sharded below --shard-mb, tokenizer.json, tokenizer_config.json,
generation_config.json) and train_log.json / train_log.md (seed, arguments, steps, loss curve,
held-out perplexity next to the unigram baseline's, needle accuracy). A share of the training
sequences carry a synthetic needle (a secret number, asked for later in the same sequence:
`rq_core.tools.eval.needle_token_pieces`) so that the model can learn to retrieve from its context,
which `rq eval niah` measures.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

EOS = "<|endoftext|>"
DOC_SEP = "\f"

# The reference architecture (config.json keys as transformers' Qwen2MoeConfig names them).
MODEL_CONFIG = {
    "architectures": ["Qwen2MoeForCausalLM"],
    "model_type": "qwen2_moe",
    "vocab_size": 4096,
    "hidden_size": 256,
    "num_hidden_layers": 6,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 128,
    "intermediate_size": 512,
    "moe_intermediate_size": 192,
    "shared_expert_intermediate_size": 512,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "norm_topk_prob": False,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": False,
    "use_sliding_window": False,
    "sliding_window": None,
    "max_window_layers": 6,
    "attention_dropout": 0.0,
    "qkv_bias": True,
    "output_router_logits": False,
    "router_aux_loss_coef": 0.001,
    "initializer_range": 0.02,
    "torch_dtype": "bfloat16",
    "bos_token_id": 0,
    "eos_token_id": 0,
    "pad_token_id": 0,
}


# ------------------------------------------------------------------------------------ tokenize
def train_tokenizer(text_path: Path, vocab_size: int):
    """Byte-level BPE; digits are split one per token (the needle's secret number stays copyable)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=[EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    docs = text_path.read_text(encoding="utf-8").split(DOC_SEP)
    tok.train_from_iterator(docs, trainer=trainer)
    return tok


def encode_docs(tok, docs: list[str]) -> np.ndarray:
    eos = tok.token_to_id(EOS)
    out: list[int] = []
    for enc in tok.encode_batch(docs, add_special_tokens=False):
        out.extend(enc.ids)
        out.append(eos)
    return np.asarray(out, dtype=np.uint16)


def unigram_ppl(train_ids: np.ndarray, eval_ids: np.ndarray, vocab: int) -> float:
    """Perplexity of an add-one-smoothed unigram model fitted on the training tokens."""
    counts = np.bincount(train_ids.astype(np.int64), minlength=vocab).astype(np.float64) + 1.0
    logp = np.log(counts / counts.sum())
    return float(np.exp(-logp[eval_ids.astype(np.int64)].mean()))


def cmd_tokenize(args: argparse.Namespace) -> None:
    from rq_core.tools.eval import load_heldout_text

    data = args.data
    tok = train_tokenizer(data / "train.txt", args.vocab)
    tok.save(str(data / "tokenizer.json"))
    docs = (data / "train.txt").read_text(encoding="utf-8").split(DOC_SEP)
    train_ids = encode_docs(tok, docs)
    held_ids = np.asarray(tok.encode(load_heldout_text(), add_special_tokens=False).ids, dtype=np.uint16)
    np.save(data / "train_ids.npy", train_ids)
    np.save(data / "heldout_ids.npy", held_ids)
    info = {"vocab_size": tok.get_vocab_size(), "train_tokens": int(train_ids.size),
            "heldout_tokens": int(held_ids.size),
            "unigram_heldout_ppl": unigram_ppl(train_ids, held_ids, tok.get_vocab_size())}
    (data / "tokens.json").write_text(json.dumps(info, indent=2) + "\n")
    print(json.dumps(info))


# --------------------------------------------------------------------------------------- train
def needle_batch_rows(rng: np.random.Generator, rows: np.ndarray, pieces: dict, weights: np.ndarray,
                      answer_weight: float, max_pairs: int = 4) -> None:
    """Overwrite parts of each row (in place) with needle ... question + answer pairs.

    A row is cut into k (1..max_pairs) segments, each holding one needle at a random point and its
    question at a random later point, so distances up to the row length are trained and each question
    refers to the nearest needle before it. Answer digits get a larger loss weight.
    """
    B, T = rows.shape
    nd = pieces["n_digits"]
    for b in range(B):
        k = int(rng.integers(1, max_pairs + 1)) if max_pairs > 1 else 1
        seg = T // k
        for s in range(k):
            digits = rng.integers(0, 10, size=nd)
            needle = np.concatenate([pieces["needle_prefix"], pieces["digits"][digits], pieces["needle_suffix"]])
            qa = np.concatenate([pieces["question"], pieces["digits"][digits]])
            room = seg - len(needle) - len(qa)
            if room <= 0:
                continue
            i = s * seg + int(rng.integers(0, room))
            j = int(rng.integers(i + len(needle), s * seg + room + len(needle) + 1))
            rows[b, i : i + len(needle)] = needle
            rows[b, j : j + len(qa)] = qa
            a0 = j + len(pieces["question"])
            # weights index targets: target t is predicted at position t - 1
            weights[b, a0 - 1 : a0 - 1 + nd] = answer_weight


def copy_rows(rng: np.random.Generator, rows: np.ndarray, vocab: int, max_span: int = 256) -> None:
    """Overwrite rows (in place) with a random token span of 16..256 tokens repeated to fill the row.

    Needles alone do not teach the model to copy from its context, and copy rows mixed into text from
    the first step did not either (docs/TRAINING_NOTES.md): a copy-task phase comes first
    (scripts/train_two_phase.sh), and these rows (--copy-share) keep the copy heads in the text phase.
    Off by default."""
    B, T = rows.shape
    for b in range(B):
        n = int(rng.integers(16, max_span + 1))
        span = rng.integers(1, vocab, size=n)  # id 0 is the end-of-text token
        rows[b] = np.tile(span, T // n + 1)[:T]


def needle_check(model, held_ids: np.ndarray, pieces: dict, T: int, rng: np.random.Generator,
                 n: int = 32) -> float:
    """Share of needles (random depth, haystack of held-out text, T tokens) whose digits the model
    predicts exactly (argmax, teacher-forced: the same as greedy for an exact match). The prompt is
    `rq_core.tools.eval.needle_trials`'s format: haystack with the needle, then question + answer at the end."""
    import mlx.core as mx

    rows = np.stack([held_ids[s : s + T] for s in rng.integers(0, held_ids.size - T, size=n)]).astype(np.int32)
    nd = pieces["n_digits"]
    qa_len = len(pieces["question"]) + nd
    if T <= qa_len + len(pieces["needle_prefix"]) + nd + len(pieces["needle_suffix"]):
        return float("nan")  # too short for a needle (tiny smoke runs)
    answers = []
    for b in range(n):
        digits = rng.integers(0, 10, size=nd)
        needle = np.concatenate([pieces["needle_prefix"], pieces["digits"][digits], pieces["needle_suffix"]])
        i = int(rng.integers(0, T - qa_len - len(needle)))
        rows[b, i : i + len(needle)] = needle
        rows[b, T - qa_len :] = np.concatenate([pieces["question"], pieces["digits"][digits]])
        answers.append(pieces["digits"][digits])
    ok = 0
    for b in range(0, n, 8):
        logits = model(mx.array(rows[b : b + 8]))
        pred = np.array(mx.argmax(logits[:, T - nd - 1 : T - 1], axis=-1))
        ok += sum(bool((pred[j] == answers[b + j]).all()) for j in range(pred.shape[0]))
    return ok / n


def to_hf_weights(params: dict, n_layers: int) -> dict:
    """mlx-lm parameter names → Hugging Face qwen2_moe names (experts unstacked)."""
    out = {}
    for k, v in params.items():
        if ".switch_mlp." in k:
            pre, rest = k.split(".switch_mlp.")  # rest: gate_proj.weight
            for e in range(v.shape[0]):
                out[f"{pre}.experts.{e}.{rest}"] = v[e]
        else:
            out[k] = v
    return out


def cmd_train(args: argparse.Namespace) -> None:
    import mlx.core as mx
    import mlx.nn as nn
    import mlx.optimizers as optim
    from mlx.utils import tree_flatten, tree_map

    from rq_core.tools.eval import needle_token_pieces
    from rq_core.models import qwen2_moe

    data, out = args.data, args.out
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.time()
    print(f"device: {mx.default_device()}", flush=True)
    mx.random.seed(args.seed)
    rng = np.random.default_rng(args.seed)
    check_rng = np.random.default_rng([args.seed, 1])  # needle checks never shift the training data

    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(data / "tokenizer.json"))
    train_ids = np.load(data / "train_ids.npy").astype(np.int32)
    held_ids = np.load(data / "heldout_ids.npy").astype(np.int32)
    tokinfo = json.loads((data / "tokens.json").read_text())
    pieces = needle_token_pieces(tok)

    config = dict(MODEL_CONFIG)
    config["vocab_size"] = tok.get_vocab_size()
    for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_experts", "moe_intermediate_size",
              "shared_expert_intermediate_size"):
        if getattr(args, k, None):
            config[k] = getattr(args, k)
    config["max_window_layers"] = config["num_hidden_layers"]
    config["max_position_embeddings"] = max(args.seq_len, 2048)
    model = qwen2_moe.Model(qwen2_moe.ModelArgs.from_dict(config))
    # Small init (GPT-2 style) for every matrix; norms stay at one.
    def init(path, p):
        if p.ndim >= 2:
            return mx.random.normal(p.shape, scale=config["initializer_range"]).astype(p.dtype)
        return p
    from mlx.utils import tree_map_with_path

    model.update(tree_map_with_path(init, model.parameters()))
    if args.init:  # continue from a checkpoint of this architecture (e.g. a copy-task phase 1)
        from rq_core.checkpoint import load_weights

        w = model.sanitize(load_weights(args.init))
        model.load_weights([(k, v.astype(mx.float32)) for k, v in w.items()])
        print(f"initialised from {args.init}", flush=True)
    n_params = sum(v.size for _, v in tree_flatten(model.parameters()))
    print(f"parameters: {n_params:,}", flush=True)

    # Router load-balancing (Switch-Transformer aux loss): the routers record their logits while
    # training (a subclass swap, so the parameter names stay as they are).
    router_logits: list = []

    class RecordingLinear(nn.Linear):
        def __call__(self, x):
            y = super().__call__(x)
            router_logits.append(y)
            return y

    gates = [layer.mlp.gate for layer in model.layers if hasattr(layer.mlp, "switch_mlp")]
    for g in gates:
        g.__class__ = RecordingLinear
    E, K = config["num_experts"], config["num_experts_per_tok"]

    def aux_loss() -> mx.array:
        total = mx.array(0.0)
        for lg in router_logits:
            probs = mx.softmax(lg.astype(mx.float32), axis=-1).reshape(-1, E)
            top = mx.stop_gradient(mx.argpartition(-probs, kth=K - 1, axis=-1)[:, :K])
            frac = (top[..., None] == mx.arange(E)).astype(mx.float32).sum(axis=(0, 1)) / top.size
            total = total + E * mx.sum(frac * probs.mean(axis=0))
        return total / max(len(router_logits), 1)

    def loss_fn(model, x, y, w):
        router_logits.clear()
        logits = model(x)
        ce = nn.losses.cross_entropy(logits.astype(mx.float32), y, reduction="none")
        lm = (ce * w).sum() / w.sum()
        aux = aux_loss()
        router_logits.clear()
        return lm + args.aux_coef * aux, (lm, aux)

    # The learning rate lives in the optimizer state and is set before each step (schedule below).
    opt = optim.AdamW(learning_rate=0.0, weight_decay=args.weight_decay, betas=[0.9, 0.95])
    state = [model.state, opt.state]

    def step_fn(x, y, w):
        (loss, (lm, aux)), grads = nn.value_and_grad(model, loss_fn)(model, x, y, w)
        grads, _ = optim.clip_grad_norm(grads, args.clip)
        opt.update(model, grads)
        return lm, aux

    step_c = step_fn if args.no_compile else mx.compile(step_fn, inputs=state, outputs=state)

    T, B = args.seq_len, args.batch
    # The last tokens of the training plays pick the best checkpoint (the held-out plays never do).
    val_ids = train_ids[-args.val_tokens:]
    train_ids = train_ids[: -args.val_tokens]
    n_train = train_ids.size

    def batch():
        starts = rng.integers(0, n_train - T - 1, size=B)
        rows = np.stack([train_ids[s : s + T + 1] for s in starts])
        w = np.ones((B, T), np.float32)
        n_needle = int(round(B * args.needle_share))
        if n_needle:
            sub = rows[:n_needle]
            needle_batch_rows(rng, sub, pieces, w[:n_needle], args.answer_weight, args.needle_pairs)
        n_copy = int(round(B * args.copy_share))
        if n_copy:  # the last rows: random tokens, repeated (teaches the copy heads needles need)
            copy_rows(rng, rows[B - n_copy :], args.copy_vocab or config["vocab_size"], args.copy_span)
        return mx.array(rows[:, :-1]), mx.array(rows[:, 1:]), mx.array(w)

    def heldout_nll(ids: np.ndarray, max_windows: int = 10**9) -> tuple[float, int]:
        """Mean NLL over non-overlapping windows of length T of `ids`, full precision."""
        n_win = min((ids.size - 1) // T, max_windows)
        tot, cnt = 0.0, 0
        for i in range(0, n_win, B):
            rows = np.stack([ids[s * T : s * T + T + 1] for s in range(i, min(i + B, n_win))])
            x, y = mx.array(rows[:, :-1]), mx.array(rows[:, 1:])
            logits = model(x)
            ce = nn.losses.cross_entropy(logits.astype(mx.float32), y, reduction="sum")
            tot += ce.item()
            cnt += y.size
        return tot / cnt, cnt

    # Measure speed with a constant warm-up learning rate, then fix the schedule to the budget.
    curve = []
    warm = args.warmup
    probe = args.probe_steps
    mx.eval(model.parameters())
    t0 = time.time()
    setup = t0 - t_start
    print(f"setup (data, model) {setup:.1f} s", flush=True)
    for s in range(probe):
        x, y, w = batch()
        opt.learning_rate = args.lr * min(1.0, (s + 1) / warm)
        lm, aux = step_c(x, y, w)
        mx.eval(state, lm, aux)
        if s == 0:
            first_step = time.time() - t0
            print(f"first step (compile) {first_step:.1f} s", flush=True)
        if s == 1:
            t1 = time.time()  # after compile
    sec_per_step = (time.time() - t1) / max(probe - 2, 1)
    remaining = args.time_budget - (time.time() - t_start) - args.reserve
    # 4% margin: the validation/needle evals every --eval-every steps are not in the step time.
    total_steps = args.steps or max(probe + 10, int(remaining / (sec_per_step * (1 + 0.04))))
    print(f"{sec_per_step * 1000:.1f} ms/step -> {total_steps} steps", flush=True)

    def cosine(s):
        s = float(s)
        if s < warm:
            return args.lr * (s + 1) / warm
        if args.schedule == "constant":
            return args.lr
        p = min(1.0, (s - warm) / max(1, total_steps - warm))
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * p)))

    best = (float("inf"), -1)
    best_params = None
    evals = []
    step = probe
    t_train = time.time()
    while step < total_steps:
        x, y, w = batch()
        opt.learning_rate = cosine(step)
        lm, aux = step_c(x, y, w)
        step += 1
        if step % args.log_every == 0 or step == total_steps:
            mx.eval(lm, aux)
            curve.append({"step": step, "loss": round(lm.item(), 4), "aux": round(aux.item(), 4),
                          "lr": cosine(step), "t": round(time.time() - t_start, 1)})
            if args.stop_loss and step >= warm and curve[-1]["loss"] < args.stop_loss:
                print(f"loss {curve[-1]['loss']} < {args.stop_loss} at step {step}: stopping", flush=True)
                total_steps = step  # evaluates and keeps this step below, then leaves the loop
        if step % args.eval_every == 0 or step == total_steps:
            mx.eval(state)
            nll, _ = heldout_nll(val_ids)
            acc = needle_check(model, held_ids, pieces, T, check_rng, n=16)
            evals.append({"step": step, "val_nll": round(nll, 4), "val_ppl": round(math.exp(nll), 3),
                          "needle_acc": acc})
            print(f"step {step}/{total_steps} loss {curve[-1]['loss']:.3f} val ppl {math.exp(nll):.2f} "
                  f"needle {acc:.2f} ({time.time() - t_start:.0f}s)", flush=True)
            router_logits.clear()  # the eval forwards above recorded router logits too
            if nll < best[0] or args.keep == "last":
                best = (nll, step)
                best_params = tree_map(lambda p: mx.array(p), dict(tree_flatten(model.parameters())))
                mx.eval(best_params)
        if time.time() - t_start > args.time_budget - args.reserve / 2:
            print(f"time budget reached at step {step}", flush=True)
            break
    train_time = time.time() - t_train

    for g in gates:
        g.__class__ = nn.Linear
    if best_params is not None:
        model.load_weights(list(best_params.items()))
    nll, n_tok = heldout_nll(held_ids)
    final = {"heldout_ppl": math.exp(nll), "heldout_tokens": n_tok, "best_step": best[1],
             "val_ppl": math.exp(best[0]) if best[1] >= 0 else None,
             "needle_accuracy_fp32": needle_check(model, held_ids, pieces, T, check_rng, n=64),
             "needle_accuracy_fp32_half": needle_check(model, held_ids, pieces, T // 2, check_rng, n=64)}
    print(f"held-out ppl {final['heldout_ppl']:.3f} over {n_tok} tokens (unigram {tokinfo['unigram_heldout_ppl']:.1f}); "
          f"needle {final['needle_accuracy_fp32']:.2f} at {T}, {final['needle_accuracy_fp32_half']:.2f} at {T // 2}",
          flush=True)

    # Save: HF names, bf16.
    params = dict(tree_flatten(model.parameters()))
    hf = {k: v.astype(mx.bfloat16) for k, v in to_hf_weights(params, config["num_hidden_layers"]).items()}
    save_sharded(out, hf, args.shard_mb * 1e6)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    write_tokenizer_files(data, out)
    log = {
        "seed": args.seed, "device": str(mx.default_device()), "parameters": int(n_params),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "config": config, "seq_len": T, "batch": B, "needle_share": args.needle_share,
        "lr": args.lr, "weight_decay": args.weight_decay, "aux_coef": args.aux_coef,
        "steps": step, "planned_steps": total_steps, "sec_per_step": sec_per_step,
        "first_step_seconds": round(first_step, 1), "setup_seconds": round(setup, 1),
        "train_seconds": round(train_time, 1), "tokens_seen": step * B * T,
        "train_tokens": int(n_train), "epochs": round(step * B * T / n_train, 2),
        "unigram_heldout_ppl": tokinfo["unigram_heldout_ppl"], "final": final,
        "loss_curve": curve, "evals": evals,
    }
    (out / "train_log.json").write_text(json.dumps(log, indent=1) + "\n")
    (out / "train_log.md").write_text(log_markdown(log))
    print(f"saved to {out} ({sum(f.stat().st_size for f in out.iterdir()) / 1e6:.1f} MB)", flush=True)


def save_sharded(out: Path, weights: dict, shard_bytes: float) -> None:
    """HF safetensors, split into shards of at most `shard_bytes` (plus the index) when larger."""
    import mlx.core as mx

    shards: list[dict] = [{}]
    size = 0
    for k in sorted(weights):
        nb = weights[k].nbytes
        if shards[-1] and size + nb > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][k] = weights[k]
        size += nb
    if len(shards) == 1:
        mx.save_safetensors(str(out / "model.safetensors"), shards[0], metadata={"format": "pt"})
        return
    index = {"metadata": {"total_size": sum(v.nbytes for v in weights.values())}, "weight_map": {}}
    for i, sh in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        mx.save_safetensors(str(out / name), sh, metadata={"format": "pt"})
        index["weight_map"].update({k: name for k in sh})
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def write_tokenizer_files(data: Path, out: Path) -> None:
    """tokenizer.json, tokenizer_config.json and generation_config.json of the checkpoint."""
    (out / "tokenizer.json").write_bytes((data / "tokenizer.json").read_bytes())
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0, "do_sample": True, "temperature": 0.8,
         "top_p": 0.95}, indent=2) + "\n")


def tokenizer_config() -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": EOS, "eos_token": EOS, "pad_token": EOS, "unk_token": None,
        "model_max_length": 2048, "add_bos_token": False, "clean_up_tokenization_spaces": False,
    }


def log_markdown(log: dict) -> str:
    f = log["final"]
    lines = [
        "# Reference model training log", "",
        f"- seed {log['seed']}, device {log['device']}, {log['parameters']:,} parameters",
        f"- {log['steps']} steps x batch {log['batch']} x {log['seq_len']} tokens "
        f"({log['tokens_seen']:,} tokens, {log['epochs']} epochs of {log['train_tokens']:,}), "
        f"{log['sec_per_step'] * 1000:.0f} ms/step, {log['train_seconds']} s",
        f"- lr {log['lr']}, weight decay {log['weight_decay']}, "
        f"router aux {log['aux_coef']}",
        f"- held-out perplexity {f['heldout_ppl']:.3f} over {f['heldout_tokens']:,} tokens "
        f"(checkpoint of step {f['best_step']}, picked on validation tokens of the training plays); "
        f"unigram {log['unigram_heldout_ppl']:.1f}",
        f"- needle share {log['needle_share']}, up to {log['args'].get('needle_pairs')} pairs per row, "
        f"answer weight {log['args'].get('answer_weight')}",
        f"- needle retrieval (teacher-forced exact match, full precision, 64 needles): "
        f"{f['needle_accuracy_fp32']} at {log['seq_len']} tokens, {f.get('needle_accuracy_fp32_half')} at "
        f"{log['seq_len'] // 2}",
        f"- setup {log.get('setup_seconds')} s, first (compiled) step {log['first_step_seconds']} s", "",
        "| step | train loss | validation ppl |", "| --- | --- | --- |",
    ]
    ev = {e["step"]: e["val_ppl"] for e in log["evals"]}
    for c in log["loss_curve"]:
        lines.append(f"| {c['step']} | {c['loss']:.3f} | {ev.get(c['step'], '')} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description="Train the bundled reference qwen2_moe model.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("tokenize")
    t.add_argument("--data", type=Path, default=ROOT / ".train")
    t.add_argument("--vocab", type=int, default=4096)
    k = sub.add_parser("package", help="(re)write the tokenizer/generation files into a checkpoint dir "
                                       "(when only weights and config came back from the GPU machine)")
    k.add_argument("--data", type=Path, default=ROOT / ".train")
    k.add_argument("--ckpt", type=Path, required=True)
    r = sub.add_parser("train")
    r.add_argument("--data", type=Path, default=ROOT / ".train")
    r.add_argument("--out", type=Path, required=True)
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--seq-len", type=int, default=2048)
    r.add_argument("--batch", type=int, default=16)
    r.add_argument("--lr", type=float, default=2e-3)
    r.add_argument("--weight-decay", type=float, default=0.1)
    r.add_argument("--clip", type=float, default=1.0)
    r.add_argument("--aux-coef", type=float, default=0.01)
    # Needle rows lose only ~1.5% of their text tokens per pair, so a large share costs the LM little;
    # 1..4 pairs per row give short distances (segments of T/k) where copying is learned first.
    r.add_argument("--needle-share", type=float, default=0.5)
    r.add_argument("--needle-pairs", type=int, default=4, help="most needle/question pairs per needle row")
    r.add_argument("--copy-share", type=float, default=0.0,
                   help="share of rows that are a random token span repeated (induction/copy signal)")
    r.add_argument("--copy-vocab", type=int, default=0,
                   help="copy rows draw their tokens from ids 1..N-1 (0 = the whole vocabulary); a small "
                        "alphabet makes the copy signal easy to pick up early")
    r.add_argument("--copy-span", type=int, default=256, help="longest random span of a copy row")
    r.add_argument("--answer-weight", type=float, default=10.0, help="loss weight of needle answer digits")
    r.add_argument("--init", type=Path, default=None, help="start from this checkpoint's weights")
    r.add_argument("--schedule", choices=["cosine", "constant"], default="cosine",
                   help="learning rate after warm-up (constant: the copy-task phase, whose induction step "
                        "comes at an unknown point)")
    r.add_argument("--keep", choices=["best", "last"], default="best",
                   help="weights saved: best validation perplexity, or the last evaluated step (copy phase)")
    r.add_argument("--stop-loss", type=float, default=0.0,
                   help="stop once a logged training loss is below this (the copy phase: induction has formed)")
    r.add_argument("--warmup", type=int, default=50)
    r.add_argument("--probe-steps", type=int, default=12)
    r.add_argument("--steps", type=int, default=0, help="fixed step count (0 = fit --time-budget)")
    r.add_argument("--time-budget", type=float, default=300.0, help="seconds for the whole stage")
    r.add_argument("--reserve", type=float, default=25.0, help="seconds kept for final eval and saving")
    r.add_argument("--log-every", type=int, default=20)
    r.add_argument("--eval-every", type=int, default=400)
    r.add_argument("--no-compile", action="store_true")
    r.add_argument("--shard-mb", type=float, default=15.0, help="largest safetensors shard (MB)")
    r.add_argument("--val-tokens", type=int, default=65536)
    r.add_argument("--hidden-size", dest="hidden_size", type=int, default=0)
    r.add_argument("--layers", dest="num_hidden_layers", type=int, default=0)
    r.add_argument("--heads", dest="num_attention_heads", type=int, default=0)
    r.add_argument("--experts", dest="num_experts", type=int, default=0)
    r.add_argument("--moe-intermediate", dest="moe_intermediate_size", type=int, default=0)
    r.add_argument("--shared-intermediate", dest="shared_expert_intermediate_size", type=int, default=0)
    args = ap.parse_args()
    if args.cmd == "tokenize":
        cmd_tokenize(args)
    elif args.cmd == "package":
        write_tokenizer_files(args.data, args.ckpt)
    else:
        cmd_train(args)


if __name__ == "__main__":
    main()
