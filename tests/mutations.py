"""Mutation run: plant each bug of MUTATIONS in a scratch copy of the repository, run the tests named for it, and
report whether they caught it.

    python3 tests/mutations.py              # every mutation (a baseline run of the named test files first)
    python3 tests/mutations.py --only 7     # mutation 7 alone
    python3 tests/mutations.py --list       # the list, nothing run
    python3 tests/mutations.py --markdown   # the result table as markdown (tests/README.md, "Mutation run")

The working tree is never written: the tracked and untracked-but-not-ignored files are copied into a temporary
folder once, each mutation is written there, its tests run (`PYTHONPATH=<scratch> python3 -m pytest -q -x`), and the
file put back before the next one. A mutation whose original snippet is not in its file exactly once is "stale"
(the code moved on: update the snippet). Exit status 1 when any mutation survived, was stale, or its tests failed
to run (collection error, timeout), or when the baseline run of the named tests fails on the unmutated copy.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT_S = 300  # one mutation's test run


@dataclass(frozen=True)
class Mutation:
    file: str  # relative to the repository root
    old: str  # exact snippet, present exactly once in the file
    new: str
    what: str  # one line
    tests: tuple[str, ...]  # pytest arguments: files or node ids


M = Mutation
NEW = "tests/test_mutation_catches.py::"  # tests written for mutations the other tests let through
MUTATIONS: list[Mutation] = [
    # -- rotation
    M("rq_core/codec/rotation.py",
      "return np.where(rng.random(d) < 0.5, -1.0, 1.0)",
      "return np.where(rng.random(d) < 0.5, 1.0, -1.0)",
      "rwht_so4 sign vector flipped (D_s negated: still orthogonal)",
      ("tests/test_rotation.py", NEW + "test_rotation_matches_format_md_by_quaternions")),
    M("rq_core/codec/rotation.py",
      "return quat_left(q[:, 0]) @ quat_right(quat_conj(q[:, 1]))",
      "return quat_left(q[:, 0]) @ quat_right(q[:, 1])",
      "SO(4) block uses q_R instead of conj(q_R) (still orthogonal)",
      ("tests/test_rotation.py",)),
    M("rq_core/codec/rotation.py",
      "        if self._blocks is not None:\n            y = self._blocks_apply(y, self._blocks.swapaxes(-1, -2))\n"
      "        if self.use_wht:\n            y = wht(y)\n",
      "        if self.use_wht:\n            y = wht(y)\n"
      "        if self._blocks is not None:\n            y = self._blocks_apply(y, self._blocks.swapaxes(-1, -2))\n",
      "inverse applies the WHT before the SO(4) blocks (wrong block order)",
      ("tests/test_rotation.py",)),
    # -- codebook
    M("rq_core/codec/codebook.py",
      "p = np.exp((d - 3) / 2 * np.log1p(-np.minimum(z * z / d, 1.0)))",
      "p = np.exp((d - 1) / 2 * np.log1p(-np.minimum(z * z / d, 1.0)))",
      "sphere marginal exponent (d-1)/2 instead of (d-3)/2 (every level moved slightly)",
      ("tests/test_codebook.py",)),
    M("rq_core/codec/codebook.py",
      "return float((z * z).sum() / (z * zh).sum())",
      "return float((z * zh).sum() / (z * z).sum())",
      "reconstruction gain inverted (1 - D instead of 1 / (1 - D))",
      ("tests/test_codebook.py", "tests/test_kv_cache.py")),
    M("rq_core/assets/pair_codebooks.json",
      '"d128_n32_s2":[0.34981802,',
      '"d128_n32_s2":[1.34981802,',
      "shipped values' pair codebook (d=128, 32 points): one point moved by +1.0",
      ("tests/test_codebook.py", "tests/test_kv_cache.py", NEW + "test_shipped_pair_codebook_is_a_lloyd_fixed_point")),
    M("rq_core/codec/codebook.py",
      "np.any(np.diff(levels) <= 0)",
      "np.any(np.diff(levels) < 0)",
      "codebook TOML: a repeated level accepted (a cell no value is coded to)",
      ("tests/test_codebook.py::test_bad_inputs",)),
    # -- packing
    M("rq_core/codec/packing.py",
      "k, s = divmod(j * bits, 32)",
      "k, s = divmod(j * bits + 1, 32)",
      "pack: every field one bit later in the stream",
      ("tests/test_packing.py",)),
    M("rq_core/codec/packing.py",
      "shifts = mx.arange(0, 8 * bits, bits, dtype=mx.uint32)",
      "shifts = mx.arange(1, 8 * bits + 1, bits, dtype=mx.uint32)",
      "unpack: bit offset off by one",
      ("tests/test_packing.py",)),
    # -- kv_cache
    M("rq_core/cache/kv_cache.py",
      "        if not self.prefilling:\n            self._spill(self.fp16_window)\n",
      "        if not self.prefilling:\n            self._spill(self.fp16_window + 1)\n",
      "decode keeps fp16_window + 1 tokens in fp16 (window off by one)",
      ("tests/test_kv_cache.py",)),
    M("rq_core/cache/kv_cache.py",
      "for i in sorted(set(idx[:n] + idx[-n:])):",
      "for i in sorted(set(idx[:n])):",
      "edge layers: only the first n compressed layers, not the last",
      ("tests/test_kv_cache.py",)),
    M("rq_core/cache/kv_cache.py",
      "              value_gain=settings.value_gain)",
      "              )",
      "make_kv_cache drops kv.value_gain (value gain never applied)",
      ("tests/test_kv_cache.py",)),
    M("rq_core/cache/kv_cache.py",
      "        return pack(idx, bits), m.astype(mx.float16)\n    thresholds",
      "        return pack(idx, bits), m.astype(mx.bfloat16)\n    thresholds",
      "pair-codebook norms stored as bfloat16 instead of float16",
      ("tests/test_kv_cache.py",)),
    M("rq_core/cache/kv_cache.py",
      "        n = min(self.offset, n)\n        self.offset -= n\n",
      "        self.offset -= n\n",
      "FP16Cache.trim drops past the start (offset negative)",
      ("tests/test_kv_cache.py::test_fp16_cache_trim_stops_at_the_start",)),
    M("rq_core/cache/kv_cache.py",
      "    if not 2 <= edge_bits <= 4:\n",
      "    if not 1 <= edge_bits <= 4:\n",
      "check_edges: kv.edge_bits = 1 accepted",
      ("tests/test_recipe.py::test_validation_is_one_line",)),
    # -- dispatch
    M("rq_core/attention/dispatch.py",
      'm = None if (isinstance(mask, str) and L == 1) else mask',
      'm = None',
      "prompt (nothing packed): causal mask dropped",
      ("tests/test_dispatch.py", "tests/test_kv_cache.py")),
    M("rq_core/attention/dispatch.py",
      '    if cfg.attention == "fused":\n        if arr_mask is not None:',
      '    if cfg.attention != "reference":\n        if arr_mask is not None:',
      "RQ_ATTN=four takes the fused kernel (wrong path chosen)",
      ("tests/test_dispatch.py", NEW + "test_four_setting_takes_the_four_kernel_pipeline_not_the_fused_kernel")),
    # -- attention reference
    M("rq_core/attention/reference.py",
      "s = mx.where(k_pos[None, :] <= q_pos, s, -mx.inf)",
      "s = mx.where(k_pos[None, :] < q_pos, s, -mx.inf)",
      "online attention: a query does not see its own key (causal off by one)",
      ("tests/test_attention.py",)),
    M("rq_core/attention/reference.py",
      "kscale = k_norms[:, :, k0:k1].astype(mx.float32) * inv_sqrt_d",
      "kscale = k_norms[:, :, k0:k1].astype(mx.float32)",
      "packed attention: keys' 1/sqrt(d) scale missing",
      ("tests/test_attention.py",)),
    M("rq_core/attention/reference.py",
      "    w = w / mx.maximum(total, 1e-30)\n",
      "",
      "merge: segment weights not normalized",
      ("tests/test_attention.py",)),
    # -- generate
    M("rq_core/generate.py",
      "drop_sorted = (mx.cumsum(sorted_p, axis=-1) - sorted_p) >= top_p",
      "drop_sorted = (mx.cumsum(sorted_p, axis=-1) - sorted_p) < top_p",
      "top-p keeps the tail instead of the nucleus",
      ("tests/test_models.py",)),
    M("rq_core/generate.py",
      "drop_sorted = (mx.cumsum(sorted_p, axis=-1) - sorted_p) >= top_p",
      "drop_sorted = mx.cumsum(sorted_p, axis=-1) > top_p",
      "top-p drops the token whose mass crosses top_p",
      ("tests/test_models.py",)),
    M("rq_core/generate.py",
      '            res.stop_reason = "eos"\n            break\n',
      '            res.stop_reason = "eos"\n            continue\n',
      "EOS does not stop generation",
      ("tests/test_models.py", NEW + "test_generate_stops_at_eos_and_leaves_it_out")),
    M("rq_core/generate.py",
      "max_tokens = min(max_tokens, context_length - len(prompt))",
      "max_tokens = min(max_tokens, context_length - len(prompt) + 1)",
      "one token past the context (max tokens off by one)",
      ("tests/test_models.py", NEW + "test_generate_stops_at_the_context_length")),
    M("rq_core/generate.py",
      "    if seed is not None:\n        mx.random.seed(seed)\n",
      "    if seed:\n        mx.random.seed(seed)\n",
      "seed 0 ignored (truth test instead of a None check)",
      ("tests/test_models.py::test_seed_zero_repeats_a_sampled_generation",)),
    M("rq_core/generate.py",
      "        final = i + chunk >= len(prompt)\n",
      "        final = i + chunk > len(prompt)\n",
      "prefill: a last chunk that ends the prompt exactly is taken for one before it (no logits)",
      ("tests/test_models.py::test_prefill_in_chunks_samples_after_the_last_prompt_token",)),
    # -- pager / pack / planner
    M("rq_core/paging/pager.py",
      "                lru.move_to_end(e)\n",
      "                pass\n",
      "pager: a hit does not refresh the expert (LRU turned FIFO)",
      ("tests/test_pager.py",)),
    M("rq_core/paging/pager.py",
      "self.free = list(range(self.slots))",
      "self.free = list(range(self.slots - 1))",
      "pager: one slot fewer than planned",
      ("tests/test_pager.py",)),
    M("rq_core/paging/pager.py",
      "if pager.verify and not self.checked[e]]",
      "if pager.verify and self.checked[e]]",
      "pager: CRC never checked (test inverted)",
      ("tests/test_untrusted_pages.py",)),
    M("rq_core/paging/pager.py",
      "_, s = lru.popitem(last=False)",
      "_, s = lru.popitem(last=True)",
      "pager: a miss evicts the most recently used expert, not the least",
      ("tests/test_pager.py::test_a_miss_evicts_the_least_recently_used_expert",)),  # the rest of the file hangs
    M("rq_core/paging/pager.py",
      '_COUNTERS = ("hits", "misses", "bytes_read", "evictions", "host_syncs",',
      '_COUNTERS = ("hits", "misses", "bytes_read", "host_syncs",',
      "pager: PagerStats.since leaves evictions out (decode reports the prompt's too)",
      ("tests/test_pager.py::test_decode_counters_are_counted_from_their_start",)),
    M("rq_core/paging/pages.py",
      's not in (".", "..")',
      's != "."',
      "page index: a '..' file name accepted",
      ("tests/test_untrusted_pages.py", NEW + "test_page_index_refuses_a_file_name_outside_the_pack")),
    M("rq_core/paging/planner.py",
      "slots = max(0, min(E, free // (n_moe * per_expert))) if per_expert else E",
      "slots = max(0, min(E, free // per_expert)) if per_expert else E",
      "planner: free bytes not shared among the MoE layers",
      ("tests/test_planner.py",)),
    M("rq_core/paging/planner.py",
      "per_tok = sum(2 * h * per_vec(d, edge_bits if i in edge else kv_bits)",
      "per_tok = sum(h * per_vec(d, edge_bits if i in edge else kv_bits)",
      "planner: KV bytes count keys only",
      ("tests/test_planner.py",)),
    M("rq_core/paging/planner.py",
      "return -(-d * bits // 32) * 4 + 2",
      "return d * bits // 32 * 4 + 2",
      "planner: a packed row's uint32 words rounded down, not up",
      ("tests/test_planner.py::test_kv_bytes_per_token_is_what_compressed_caches_hold",)),
    M("rq_core/paging/planner.py",
      "fits = slots >= k",
      "fits = slots > k",
      "planner: exactly top-k slots a layer does not fit",
      ("tests/test_planner.py::test_a_budget_of_exactly_top_k_slots_fits",)),
    M("rq_core/paging/planner.py",
      "min(context, max(prefill_fp16, prefill_chunk))",
      "min(context, prefill_fp16)",
      "planner: kv.prefill_fp16 below the prefill chunk not raised to the chunk",
      ("tests/test_planner.py::test_a_prompt_chunk_longer_than_prefill_fp16_is_counted_whole",)),
    # -- quantize / roles / recipe / checkpoint
    M("rq_core/quant/quantize.py",
      "q, s, b = mx.quantize(a, group_size=spec.group_size, bits=spec.bits)",
      "q, s, b = mx.quantize(a, bits=spec.bits)",
      "quantize: the role's group size ignored (MLX default 64)",
      ("tests/test_quantize.py",)),
    M("rq_core/quant/roles.py",
      'return SHARED_EXPERT if tc.get("enable_moe_block", True) else DENSE_MLP',
      'return DENSE_MLP if tc.get("enable_moe_block", True) else SHARED_EXPERT',
      "gemma4: shared-expert and dense-MLP roles swapped (their bits swapped)",
      ("tests/test_roles.py", "tests/test_quantize.py")),
    M("rq_core/quant/recipe.py",
      "if (lo is not None and v < lo) or (hi is not None and v > hi):",
      "if lo is not None and v < lo:",
      "recipe: upper range check dropped",
      ("tests/test_recipe.py",)),
    M("rq_core/shards.py",
      'if (not isinstance(name, str) or not name.endswith(".safetensors") or Path(name).name != name\n'
      '            or any(c in name for c in "/\\\\\\0")):',
      'if not isinstance(name, str) or not name.endswith(".safetensors") or name.startswith("/"):',
      "checkpoint index: only absolute shard names refused ('../x.safetensors' accepted)",
      ("tests/test_untrusted_checkpoint.py",)),
    M("rq_core/checkpoint.py",
      "if not all(_is_int(t) and t >= 0 for t in es):",
      "if not all(_is_int(t) for t in es):",
      "checkpoint: a negative eos_token_id accepted",
      ("tests/test_untrusted_checkpoint.py::test_malformed_config_values_are_one_line",)),
    M("rq_core/checkpoint.py",
      "    if not _is_int(n) or n < 1:\n",
      "    if not _is_int(n) or n < 0:\n",
      "checkpoint: max_position_embeddings 0 accepted (a context of 0 tokens)",
      ("tests/test_untrusted_checkpoint.py::test_context_length_is_a_positive_integer",)),
    M("rq_core/checkpoint.py",
      "if key in spec and (not _is_int(spec[key]) or spec[key] < 1):",
      "if key in spec and (not _is_int(spec[key]) or spec[key] < 0):",
      "checkpoint: a quantization group_size or bits of 0 accepted",
      ("tests/test_untrusted_checkpoint.py::test_quantization_sizes_are_positive_integers",)),
    # -- models
    M("rq_core/models/qwen2_moe.py",
      "rope = make_rope(args.head_dim, theta, scaling,",
      "rope = make_rope(args.head_dim, 10000.0, scaling,",
      "qwen MoE: rope_theta ignored (10000)",
      ("tests/test_models.py", NEW + "test_qwen_rope_uses_config_theta")),
    M("rq_core/models/qwen2_moe.py",
      "self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)",
      "self.input_layernorm = nn.RMSNorm(args.hidden_size)",
      "qwen MoE: input norm's rms_norm_eps ignored (MLX default 1e-5)",
      ("tests/test_models.py",)),
    M("rq_core/models/base.py",
      "    inds = topk_indices(probs, k)\n",
      "    inds = topk_indices(probs, k - 1)\n",
      "softmax routing picks top-(k-1) experts",
      ("tests/test_models.py",)),
    M("rq_core/models/qwen2_moe.py",
      "y = y + mx.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)",
      "y = y + self.shared_expert(x)",
      "qwen2_moe: shared-expert sigmoid gate dropped",
      ("tests/test_models.py",)),
    M("rq_core/models/base.py",
      "(not isinstance(kv, int) or kv < 1 or heads % kv)",
      "(not isinstance(kv, int) or kv < 1)",
      "config: num_attention_heads not a multiple of num_key_value_heads accepted",
      ("tests/test_untrusted_checkpoint.py::test_malformed_config_values_are_one_line",)),
    M("rq_core/models/base.py",
      "if partial > 1 or int(dims * partial) < 2:",
      "if int(dims * partial) < 2:",
      "config: rope partial_rotary_factor > 1 accepted (more dims than a head has)",
      ("tests/test_untrusted_checkpoint.py::test_malformed_config_values_are_one_line",)),
    M("rq_core/models/base.py",
      'if kind == "default" and scaling.get("partial_rotary_factor", 1.0) == 1.0:',
      'if kind == "default":',
      "rope_params: a default rope's partial_rotary_factor dropped (every dim rotates)",
      ("tests/test_models.py::test_rope_params_spellings",)),
    # -- kernels (CUDA/Metal source, run by the g++ emulator)
    M("metal/kv_decode.body",
      "if (sh + FB > 32) c |= codes[wi + 1u] << (32 - sh);",
      "if (sh + FB > 32) c |= codes[wi + 1u] << (31 - sh);",
      "kv_decode: a field straddling two words reads the high word one bit off",
      ("tests/test_kv_decode_kernel.py",)),
    M("metal/kv_append.body",
      "for (int t = 0; t < nl - 1; ++t) c += z > consts[loff + nl + t] ? 1u : 0u;",
      "for (int t = 0; t < nl - 2; ++t) c += z > consts[loff + nl + t] ? 1u : 0u;",
      "kv_append: scalar code ignores the top threshold",
      ("tests/test_kv_append_kernel.py",)),
    M("metal/softmax.body",
      "exp2_f(sv * LOG2E - M) * inv",
      "exp2_f(sv * 1.4427f - M) * inv",
      "softmax kernel: LOG2E rounded to 1.4427 (the row max uses the exact one)",
      ("tests/test_split_kernels.py",)),
    M("metal/attn_fused.body",
      "const float fo = den > 0.0f ? rsqrt_f((float)D) / den : 0.0f;",
      "const float fo = den > 0.0f ? 1.0f / den : 0.0f;",
      "attn_fused: output's 1/sqrt(D) dropped",
      ("tests/test_kernels.py",)),
    # -- pager: checksums off the critical path, speculation's gate; Mamba conv
    M("rq_core/paging/pager.py",
      "                if f.exception() is not None:\n                    layer.drop(e)\n",
      "                if f.exception() is not None:\n                    pass\n",
      "pager: a page that failed its deferred check stays resident (served from its slot on the next call)",
      ("tests/test_pager.py::test_a_page_that_fails_its_check_raises_before_the_call_returns_and_leaves_its_slot",)),
    M("rq_core/paging/pager.py",
      "        if error is not None:\n            raise error\n",
      "        pass\n",
      "pager: a failed deferred checksum never raised (a corrupt page used silently)",
      ("tests/test_pager.py::test_corrupt_page_is_detected", "tests/test_untrusted_pages.py")),
    M("rq_core/paging/pager.py",
      "        mx.eval(read)\n        self.join_checks()\n",
      "        mx.eval(read)\n",
      "pager: a layer-by-layer step returns its token before its pages' checksums are done",
      ("tests/test_pager.py::test_no_checksum_is_pending_when_a_decode_step_or_call_returns",)),
    M("rq_core/paging/pager.py",
      "            mx.eval(y)\n            layer.pager.join_checks()\n",
      "            mx.eval(y)\n",
      "pager: a paged MoE call returns before its pages' checksums are done",
      ("tests/test_pager.py::test_no_checksum_is_pending_when_a_decode_step_or_call_returns",)),
    M("rq_core/paging/pager.py",
      "        if self._missing is None or self._missing >= MAX_MISSING_LAYERS:\n            return False\n",
      "",
      "pager: auto speculates however often steps miss (a step rebuilt from every layer that missed)",
      ("tests/test_pager.py::test_auto_speculates_only_where_steps_miss_in_few_layers",)),
    M("rq_core/models/mamba.py",
      "            y = y + x[:, k:k + L] * w[k]",
      "            y = y + x[:, k:k + L] * w[K - 1 - k]",
      "Mamba conv: taps in reverse order (a convolution, not the conv1d's cross-correlation)",
      ("tests/test_models_hybrid.py::test_mamba_conv_is_the_depthwise_conv1d_without_the_conv_op",)),
    M("rq_core/paging/pager.py",
      "        if self._lut_stale:\n",
      "        if False:\n",
      "pager: the device table is never brought up to date after steps queued whole (a later call reads old slots)",
      ("tests/test_pager.py::test_a_step_queued_whole_serves_each_layer_after_the_next_is_queued",)),
    M("rq_core/paging/pager.py",
      "            if self._launch is not None:\n                mx.async_eval(self._launch)\n"
      "                self._launch = None\n            self._answers.join()\n",
      "            self._answers.join()\n            if self._launch is not None:\n"
      "                mx.async_eval(self._launch)\n                self._launch = None\n",
      "pager: a queued step waits for its answers before its last layers are launched (the device never posts them)",
      ("tests/test_pager.py::test_a_step_queued_whole_serves_each_layer_after_the_next_is_queued",)),
    M("rq_core/paging/pager.py",
      "not hits twice\n                for f in undo:\n                    f()\n",
      "not hits twice\n",
      "pager: a step the device stopped waiting in runs again on caches that kept its first run's tokens",
      ("tests/test_pager.py::test_a_step_the_device_stopped_waiting_in_runs_again_layer_by_layer",)),
    M("rq_core/tools/soak.py",
      "            while gen_i == 0 or time.perf_counter() < self._deadline:",
      "            while time.perf_counter() < self._deadline:",
      "soak: a run whose first checks outlast it decodes nothing (no verdict)",
      ("tests/test_soak.py::test_a_run_shorter_than_its_first_checks_still_decodes",)),
    M("rq_core/paging/transfer.py",
      "            self._lib.cudaStreamSynchronize(self._stream)\n",
      "            self._lib.cudaStreamSynchronize(None)\n",
      "copier: the fence waits on the legacy default stream (held by a spinning wait of a step queued whole)",
      ("tests/test_pager.py::test_copier_writes_and_reads_through_the_copy_engine_where_the_cuda_runtime_is_found",)),
    M("rq_core/paging/transfer.py",
      "MEMCPY_DEFAULT, self._stream)\n            if rc == 0:",
      "MEMCPY_DEFAULT, None)\n            if rc == 0:",
      "copier: slot writes queued on the legacy default stream, which its fence does not wait for",
      ("tests/test_pager.py::test_copier_writes_and_reads_through_the_copy_engine_where_the_cuda_runtime_is_found",)),
    M("rq_core/paging/pager.py",
      'speculate: str = "auto", queue: str = "auto",',
      'speculate: str = "auto", queue: str = "off",',
      "pager: steps queued a stretch at a time by default where the device could wait inside a whole step",
      ("tests/test_pager.py::test_auto_queuing_runs_the_faster_way_and_the_slower_less_and_less",)),
    M("rq_core/paging/pager.py",
      "            self.stats.hits -= recounted\n",
      "",
      "pager: a queued step run again layer by layer counts the experts its first try read in as hits again",
      ("tests/test_pager.py::test_a_step_the_device_stopped_waiting_in_runs_again_layer_by_layer",)),
    M("rq_core/paging/mailbox.py",
      "copier.device_copies and copier.own_stream and",
      "copier.device_copies and",
      "mailbox: steps queued whole where the copies share the legacy default stream (a fence waits on a spinning wait)",
      ("tests/test_pager.py::test_a_step_is_queued_whole_only_where_the_copies_have_a_stream_of_their_own",)),
    M("rq_core/paging/transfer.py",
      "                self._held.append(src)",
      "                pass",
      "copier: a queued copy's source (a cast page, a contiguous copy) freed before the copy reads it",
      ("tests/test_pager.py::test_copier_writes_and_reads_through_the_copy_engine_where_the_cuda_runtime_is_found",)),
    M("rq_core/paging/transfer.py",
      "        self._dirty = True\n        self.fence()  # the copy done",
      "        self._dirty = True\n        pass  # the copy done",
      "copier: a routing read returns before its copy has landed",
      ("tests/test_pager.py::test_copier_writes_and_reads_through_the_copy_engine_where_the_cuda_runtime_is_found",)),
    M("rq_core/paging/pager.py",
      "self._layered_steps > WARMUP_STEPS and markable and",
      "self._layered_steps > WARMUP_STEPS and",
      "pager: a step queued whole with a cache that cannot be put back (AttributeError on its first step)",
      ("tests/test_pager.py::test_a_step_that_cannot_be_queued_whole_runs_layer_by_layer",)),
    M("rq_core/paging/pager.py",
      "                except (RQError, RuntimeError):  # no page-locked memory",
      "                except RQError:  # no page-locked memory",
      "pager: mailbox kernels that do not build on the device fail every paged run instead of queuing by stretch",
      ("tests/test_pager.py::test_a_step_that_cannot_be_queued_whole_runs_layer_by_layer",)),
    M("rq_core/paging/mailbox.py",
      "                if self._error is None:\n                    answer()\n",
      "                answer()\n",
      "mailbox: a step's answers go on after one failed (pages read and slots written for a step already given up)",
      ("tests/test_pager.py::test_an_answer_that_fails_on_its_thread_is_raised_by_the_step",
       "tests/test_pager.py::test_answers_run_in_order_on_their_thread_and_raise_on_the_callers")),
    M("rq_core/paging/mailbox.py",
      "                del item, answer, box\n",
      "",
      "mailbox: the answers' thread holds its last answer (and so a dropped pager's banks) until the next",
      ("tests/test_pager.py::test_answers_run_in_order_on_their_thread_and_raise_on_the_callers",)),
    M("rq_core/paging/mailbox.py",
      "            if self._released or box[:, FAILED].any():  # (released",
      "            if box[:, FAILED].any():  # (released",
      "mailbox: a fetch of a layer never launched spins after the step was released (the answers hang)",
      ("tests/test_pager.py::test_a_fetch_gives_up_when_the_step_is_released_or_its_wait_gave_up",)),
    M("rq_core/paging/mailbox.py",
      "        return self._released or bool(self.box[:, FAILED].any())",
      "        return bool(self.box[:, FAILED].any())",
      "mailbox: a released step (its layers ran on stale slots) is taken as a good one",
      ("tests/test_pager.py::test_a_fetch_gives_up_when_the_step_is_released_or_its_wait_gave_up",)),
    M("rq_core/paging/pager.py",
      "        if progress is not None:\n            progress()\n",
      "",
      "pager: reading a layer's pages does not move its progress on (a cold disk's reads outlast the device's patience)",
      ("tests/test_pager.py::test_a_step_queued_whole_serves_each_layer_after_the_next_is_queued",)),
    M("rq_core/paging/pager.py",
      "            for e in miss:\n                layer.drop(e)\n",
      "            for e in miss:\n                pass\n",
      "pager: after a failed queued step, experts whose pages the device never copied are taken as resident",
      ("tests/test_pager.py::test_experts_a_failed_step_read_in_are_read_again",)),
    M("rq_core/paging/pager.py",
      "            except BaseException:  # (a page that failed its check): the caches as before the step\n"
      "                self._forget_answered()\n",
      "            except BaseException:  # (a page that failed its check): the caches as before the step\n",
      "pager: after a queued step raised, experts whose pages the device never copied are taken as resident",
      ("tests/test_pager.py::test_experts_a_step_that_raised_read_in_are_read_again",)),
    M("rq_core/paging/pager.py",
      "cp.copy(addr + s * row, base + j * used + off, nb)",
      "cp.copy(addr + s * row, base + off, nb)",
      "pager: copies by address all read the staging buffer's first row (a batch's experts all the first one's)",
      ("tests/test_pager.py::test_batches_that_reuse_the_staging_buffer_each_write_their_own_experts",)),
    M("rq_core/paging/pager.py",
      "            self.probe_every = min(2 * self.probe_every, PROBE_MAX) if same else PROBE_STEPS",
      "            self.probe_every = PROBE_STEPS",
      "pager: auto (queuing, speculation) runs the slower way every 32 steps however long it stays slower",
      ("tests/test_pager.py::test_race_runs_the_faster_way_and_probes_the_slower_less_and_less",
       "tests/test_pager.py::test_auto_queuing_runs_the_faster_way_and_the_slower_less_and_less")),
    M("rq_core/paging/mailbox.py",
      "                and np.array_equal(dst_raw[:done], src[:done]) and not dst_raw[done:].any()):",
      "                and True):",
      "mailbox: a device whose copies do not land is used (queued steps compute on stale experts)",
      ("tests/test_pager.py::test_a_mailbox_whose_device_side_does_not_check_out_is_refused",)),
    M("rq_core/paging/mailbox.py",
      "        row[NCOPY] = len(copies)\n",
      "        row[NCOPY] = 0\n",
      "mailbox: an answer's copies are written but the device is told of none",
      ("tests/test_pager.py::test_an_answer_lays_out_its_slots_and_copies_where_the_load_kernel_reads_them",)),
    M("rq_core/paging/mailbox.py",
      "            self.box[self.box[:, GO] == 0, NCOPY] = 0\n",
      "",
      "mailbox: a released entry never answered copies what an earlier step's answer listed (into slots now in use)",
      ("tests/test_pager.py::test_an_answer_lays_out_its_slots_and_copies_where_the_load_kernel_reads_them",)),
    M("rq_core/paging/pager.py",
      "                self._forget_answered()\n"
      "                for f in undo:\n                    f()\n                raise\n",
      "                self._forget_answered()\n                raise\n",
      "pager: a queued step that raised leaves its caches holding part of the step",
      ("tests/test_pager.py::test_an_answer_that_fails_on_its_thread_is_raised_by_the_step",)),
    M("rq_core/cache/kv_cache.py",
      "        elif not self.prefilling and self._fk.shape[2] > self._fp16_capacity(keep + 1):\n"
      "            self._rebuffer(keep + 1)",
      "        elif not self.prefilling and self._fk.shape[2] > self._fp16_capacity(keep):\n"
      "            self._rebuffer(keep)",
      "kv cache: the window's rows shrunk one row short (the next token grows them again, every 64 steps)",
      ("tests/test_kv_cache.py::test_a_short_prompts_buffer_shrinks_to_its_window_once",)),
    M("rq_core/cache/kv_cache.py",
      "        grain = self.step // 4 if not self.prefilling or need <= self.step else self.step",
      "        grain = self.step",
      "kv cache: a short prompt's fp16 rows kept at FP16Cache's 256 for a 32-token window",
      ("tests/test_kv_cache.py::test_a_short_prompts_buffer_shrinks_to_its_window_once",
       "tests/test_kv_cache.py::test_a_compressed_cache_peaks_no_higher_than_fp16_on_the_bundled_model")),
    M("rq_core/tools/bench.py",
      "            others = sum(v for k, v in held.items() if k != r)",
      "            others = 0",
      "bench: a runner's peak counts the other runners' caches held during its turns",
      ("tests/test_bench.py::test_runners_take_turns",)),
    M("rq_core/paging/pager.py",
      "            pager._launch = slots\n",
      "            pager._launch = slots\n            mx.async_eval(slots)\n",
      "pager: a step queued whole is launched layer by layer while the building thread, holding the GIL, still builds",
      ("tests/test_pager.py::test_a_step_queued_whole_serves_each_layer_after_the_next_is_queued",)),
]


def scratch_copy(dst: Path) -> None:
    """Tracked and untracked-but-not-ignored files of the working tree (what the tests see) into dst."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                         capture_output=True, check=True).stdout.decode()
    for rel in filter(None, out.split("\0")):
        src = ROOT / rel
        if not src.is_file():  # deleted but still in the index
            continue
        t = dst / rel
        t.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, t, follow_symlinks=False)


def run_tests(scratch: Path, tests: tuple[str, ...]) -> tuple[int, str, float]:
    env = dict(os.environ, PYTHONPATH=str(scratch), PYTHONDONTWRITEBYTECODE="1")
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-rf", "-p", "no:cacheprovider", *tests]
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, cwd=scratch, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
        rc, out = p.returncode, p.stdout + p.stderr
    except subprocess.TimeoutExpired as e:
        rc, out = -1, f"timeout after {TIMEOUT_S} s\n{e.stdout or ''}"
    return rc, out, time.perf_counter() - t0


def first_failure(out: str) -> str:
    m = re.search(r"^FAILED (.+?)(?: - .*)?$", out, re.M)
    return m.group(1) if m else ""


def run_one(scratch: Path, i: int, mu: Mutation) -> dict:
    path = scratch / mu.file
    original = path.read_text()
    n = original.count(mu.old)
    if n != 1:
        return dict(i=i, mu=mu, result="stale", by=f"snippet found {n} times", s=0.0)
    path.write_text(original.replace(mu.old, mu.new))
    try:
        rc, out, dt = run_tests(scratch, mu.tests)
    finally:
        path.write_text(original)
    if rc == 0:
        return dict(i=i, mu=mu, result="survived", by="", s=dt)
    if rc == 1 and first_failure(out):
        return dict(i=i, mu=mu, result="caught", by=first_failure(out), s=dt)
    tail = out.strip().splitlines()[-1] if out.strip() else f"rc {rc}"
    return dict(i=i, mu=mu, result="error", by=tail[:100], s=dt)


def table(rows: list[dict], markdown: bool) -> str:
    if markdown:
        lines = ["| # | file | mutation | result | caught by |", "|---|---|---|---|---|"]
        lines += [f"| {r['i']} | {r['mu'].file} | {r['mu'].what} | {r['result']} | {r['by']} |" for r in rows]
        return "\n".join(lines)
    w = max(len(r["mu"].what) for r in rows)
    lines = [f"{'#':>3}  {'result':8}  {'s':>6}  {'mutation':{w}}  caught by"]
    lines += [f"{r['i']:>3}  {r['result']:8}  {r['s']:6.1f}  {r['mu'].what:{w}}  {r['by']}" for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", type=int, action="append", help="run mutation N (1-based; may repeat)")
    ap.add_argument("--list", action="store_true", help="list the mutations and exit")
    ap.add_argument("--markdown", action="store_true", help="print the table as markdown")
    ap.add_argument("--no-baseline", action="store_true", help="skip the unmutated run of the named tests")
    a = ap.parse_args(argv)
    chosen = [(i, MUTATIONS[i - 1]) for i in (a.only or range(1, len(MUTATIONS) + 1))
              if 1 <= i <= len(MUTATIONS)]
    if a.only and len(chosen) != len(a.only):
        ap.error(f"--only takes 1 .. {len(MUTATIONS)}")
    if a.list:
        for i, mu in chosen:
            print(f"{i:>3}  {mu.file:34}  {mu.what}  [{' '.join(mu.tests)}]")
        return 0
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="rq_mutations_") as d:
        scratch = Path(d)
        scratch_copy(scratch)
        if not a.no_baseline:
            files = tuple(dict.fromkeys(t for _, mu in chosen for t in mu.tests))
            rc, out, dt = run_tests(scratch, files)
            verdict = "pass" if rc == 0 else "FAIL"
            print(f"baseline ({len(files)} test files and tests, unmutated): {verdict} in {dt:.0f} s", flush=True)
            if rc != 0:
                print(out[-3000:])
                return 1
        rows = []
        for i, mu in chosen:
            r = run_one(scratch, i, mu)
            rows.append(r)
            print(f"{i:>3} {r['result']:8} {r['s']:6.1f}s  {mu.what}  {r['by']}", flush=True)
    print()
    print(table(rows, a.markdown))
    counts = {k: sum(r["result"] == k for r in rows) for k in ("caught", "survived", "stale", "error")}
    print(f"\n{len(rows)} mutations: " + ", ".join(f"{v} {k}" for k, v in counts.items())
          + f"; {time.perf_counter() - t0:.0f} s in all")
    return 0 if counts["caught"] == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
