"""Regenerate the golden files: tiny random checkpoints built with transformers, and their reference outputs.

    python tests/make_golden.py            # every family
    python tests/make_golden.py qwen3_moe  # some

For each family (one builder function in BUILDERS), writes tests/golden/<family>/:
  model/            save_pretrained() output (fp32, tiny dims) + a tiny byte-level BPE tokenizer + chat template
  golden.json       prompt text and ids (32 tokens), transformers' greedy 16 tokens, the config used
  golden.safetensors  "logits": transformers' float32 logits [32, V] on the prompt

Needs torch and transformers (`pip install -e .[reference]`); the test suite does not.
Head dim 128 everywhere a KV cache is compressed, so IsoQuant's byte ratio is that of real models.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any, Callable

GOLDEN = Path(__file__).parent / "golden"
PROMPT_LEN = 32
GREEDY_TOKENS = 16
VOCAB = 320
# Text for the tokenizer's merges and the prompt (byte-level BPE, so any text encodes).
CORPUS = (
    "The quick brown fox jumps over the lazy dog. Rotary quantization keeps keys and values in three bits. "
    "Mixture of experts models route every token to a few experts; the rest stay idle. "
    "Hello world! The cache holds norms and codes, and attention runs in the rotated space. "
) * 4
PROMPT_TEXT = "The quick brown fox jumps over the lazy dog while the experts route every token in three bits."
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def build_tokenizer(out: Path) -> Any:
    """A byte-level BPE tokenizer with exactly VOCAB ids (3 specials first), saved as tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([CORPUS], trainer=trainer)
    assert tok.get_vocab_size() <= VOCAB, tok.get_vocab_size()
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>", "model_max_length": 128, "chat_template": CHAT_TEMPLATE}, indent=1))
    return tok


def qwen3_moe() -> Any:
    from transformers import Qwen3MoeConfig

    # 3 layers: two MoE (top-2 of 4 experts), the last a dense MLP (mlp_only_layers).
    return Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
        num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1, head_dim=128,
        num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[2],
        max_position_embeddings=128, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        rms_norm_eps=1e-6, tie_word_embeddings=False, initializer_range=0.2,
        bos_token_id=None, eos_token_id=2, pad_token_id=0)


def qwen2_moe() -> Any:
    from transformers import Qwen2MoeConfig

    # 3 layers: layer 0 sliding-window (window 8) MoE, layer 1 full MoE, layer 2 dense MLP; qkv bias;
    # shared expert behind a sigmoid gate.
    return Qwen2MoeConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
        shared_expert_intermediate_size=24, num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1,
        head_dim=128, num_experts=4, num_experts_per_tok=2, norm_topk_prob=False, decoder_sparse_step=1,
        mlp_only_layers=[2], qkv_bias=True, use_sliding_window=True, sliding_window=8, max_window_layers=1,
        max_position_embeddings=128, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        rms_norm_eps=1e-6, tie_word_embeddings=False, initializer_range=0.2,
        bos_token_id=None, eos_token_id=2, pad_token_id=0)


def nemotron_h() -> Any:
    from transformers import NemotronHConfig

    # 4 layers "M*E-": Mamba2 (4 heads x 8, 2 groups, chunk 8 so the prompt spans 4 SSD chunks), attention,
    # MoE (8 ReLU² experts, top-2 within the best 1 of 2 groups, latent projections as in the 120B Super,
    # shared expert), dense ReLU² MLP.
    return NemotronHConfig(
        vocab_size=VOCAB, hidden_size=32, hybrid_override_pattern="M*E-", intermediate_size=48,
        num_attention_heads=2, num_key_value_heads=1, head_dim=128,
        mamba_num_heads=4, mamba_head_dim=8, ssm_state_size=16, n_groups=2, conv_kernel=4, chunk_size=8,
        n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1, norm_topk_prob=True,
        routed_scaling_factor=2.5, moe_intermediate_size=16, moe_shared_expert_intermediate_size=24,
        moe_latent_size=16, max_position_embeddings=128, layer_norm_epsilon=1e-5,
        # 0.1 (not 0.2): at 0.2 this stack is chaotic enough that IsoQuant-3 agreement swings 0.5-0.8 by seed.
        tie_word_embeddings=False, initializer_range=0.1, bos_token_id=None, eos_token_id=2, pad_token_id=0)


def _tweak_nemotron_h(model: Any) -> None:
    import torch

    # Non-zero routing bias (a buffer, so the generic pass skips it), varied skip D and decay A.
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.copy_(0.3 * torch.randn_like(b))
    for name, p in model.named_parameters():
        if name.endswith("mixer.D"):
            p.copy_(torch.rand_like(p) + 0.5)
        elif name.endswith("mixer.A_log"):
            p.add_(0.5 * torch.randn_like(p))


def gemma4() -> Any:
    from transformers import Gemma4Config

    # The multimodal release layout (model_type gemma4, nested text_config, a vision tower rq skips) like
    # gemma-4-26B-A4B: 4 layers sliding/full/sliding/full, window 8 (< the 32-token prompt, so the sliding
    # cache wraps); full layers with their own head dim 128 and 1 kv head, K = V; proportional partial RoPE;
    # dense GeGLU MLP in parallel with 4 routed experts (top-2); final soft-capping; per-layer embeddings.
    text = dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        num_attention_heads=2, num_key_value_heads=2, head_dim=32, global_head_dim=128,
        num_global_key_value_heads=1, attention_k_eq_v=True, sliding_window=8,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                            "rope_theta": 1000000.0}},
        enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=16,
        hidden_size_per_layer_input=8, vocab_size_per_layer_input=VOCAB, num_kv_shared_layers=0,
        final_logit_softcapping=30.0, max_position_embeddings=128, rms_norm_eps=1e-6,
        use_bidirectional_attention="vision", tie_word_embeddings=True, initializer_range=0.2,
        bos_token_id=None, eos_token_id=2, pad_token_id=0)
    vision = dict(hidden_size=16, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=2, head_dim=8, position_embedding_size=16, patch_size=4, pooling_kernel_size=1)
    return Gemma4Config(text_config=text, vision_config=vision, audio_config=None, tie_word_embeddings=True,
                        eos_token_id=2)


def gemma4_text() -> Any:
    from transformers import Gemma4TextConfig

    # A text-only export (model_type gemma4_text) shaped like the small dense Gemma 4 models: 4 layers
    # sliding/full/sliding/full where the last two reuse the K/V of the first two (num_kv_shared_layers)
    # and have double-wide MLPs; separate K and V projections; per-layer embeddings; untied head.
    return Gemma4TextConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=32, num_hidden_layers=4,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, global_head_dim=128, attention_k_eq_v=False,
        sliding_window=8, num_kv_shared_layers=2, use_double_wide_mlp=True, enable_moe_block=False,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                            "rope_theta": 1000000.0}},
        hidden_size_per_layer_input=8, vocab_size_per_layer_input=VOCAB, final_logit_softcapping=30.0,
        max_position_embeddings=128, rms_norm_eps=1e-6, tie_word_embeddings=False, initializer_range=0.2,
        bos_token_id=None, eos_token_id=2, pad_token_id=0)


def _tweak_gemma4(model: Any) -> None:
    import torch

    # Router scales and the per-layer scalar (a buffer) away from their all-ones init. Gemma 4 attends with
    # scale 1 on RMS-normed q and k, so unit norm weights give logits of std ~sqrt(head_dim) (near one-hot
    # attention, unlike a trained model): shrink the q/k norm weights to ~0.3.
    for name, p in model.named_parameters():
        if name.endswith(("router.scale", "router.per_expert_scale")):
            p.add_(0.2 * torch.randn_like(p))
        elif name.endswith(("q_norm.weight", "k_norm.weight")):
            p.mul_(0.3)
    for name, b in model.named_buffers():
        if name.endswith("layer_scalar"):
            b.copy_(torch.rand_like(b) + 0.5)


# family → builder returning a transformers config (H3 adds nemotron_h and gemma4 here).
BUILDERS: dict[str, Callable[[], Any]] = {
    "qwen3_moe": qwen3_moe,
    "qwen2_moe": qwen2_moe,
    "nemotron_h": nemotron_h,
    "gemma4": gemma4,
    "gemma4_text": gemma4_text,
}

# family → extra in-place randomisation of the built model (under no_grad), after the generic one.
TWEAKS: dict[str, Callable[[Any], None]] = {
    "nemotron_h": _tweak_nemotron_h,
    "gemma4": _tweak_gemma4,
    "gemma4_text": _tweak_gemma4,
}


def make(family: str, seed: int = 0) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, GenerationConfig

    config = BUILDERS[family]()
    config._attn_implementation = "eager"
    out = GOLDEN / family
    model_dir = out / "model"
    if out.exists():
        shutil.rmtree(out)
    model_dir.mkdir(parents=True)

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager").eval()
    # Random biases/norm weights away from their init constants, so every parameter matters.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
        if family in TWEAKS:
            TWEAKS[family](model)
    model.save_pretrained(model_dir, safe_serialization=True)
    GenerationConfig(eos_token_id=config.eos_token_id, do_sample=False).save_pretrained(model_dir)
    (model_dir / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    tok = build_tokenizer(model_dir)

    ids = tok.encode(PROMPT_TEXT).ids
    assert len(ids) >= PROMPT_LEN, f"prompt encodes to {len(ids)} tokens"
    ids = ids[:PROMPT_LEN]
    text = tok.decode(ids)
    assert tok.encode(text).ids == ids, "prompt text does not round-trip"

    with torch.no_grad():
        x = torch.tensor([ids])
        logits = model(x).logits[0].float()
        seq = list(ids)
        for _ in range(GREEDY_TOKENS):  # plain greedy loop, full recompute: no cache subtleties
            seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
    greedy = seq[PROMPT_LEN:]
    eos = config.eos_token_id
    assert eos not in greedy, f"greedy output hits EOS; pick another seed for {family}"

    save_file({"logits": logits.contiguous()}, str(out / "golden.safetensors"))
    (out / "golden.json").write_text(json.dumps({
        "family": family, "seed": seed, "prompt_text": text, "prompt_ids": ids, "greedy": greedy,
        "transformers_version": __import__("transformers").__version__,
        "torch_version": torch.__version__}, indent=1) + "\n")
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    print(f"{family}: {out} ({size / 1024:.0f} KiB), greedy {greedy}")


if __name__ == "__main__":
    families = sys.argv[1:] or list(BUILDERS)
    for fam in families:
        if fam not in BUILDERS:
            sys.exit(f"unknown family {fam!r} (known: {', '.join(BUILDERS)})")
        make(fam)
