"""The eager backend on a CUDA device, checked against plain HF on the same device and dtype.

Run on a machine with a GPU (no vLLM needed): `python scripts/gpu_check.py [--out results.json]`. For every tiny
family, in float32 and bfloat16 with attn_implementation="eager": every point captured on CUDA against HF's own
`output_hidden_states` / `output_attentions`, a zero-vector steer against the baseline (bit-exact), a steer
against a hand-written HF forward hook, `run_with_grad` against `torch.autograd.grad` on a hand-written
equivalent (float32), greedy `generate` against HF's `generate`; then bnb-4bit against HF loaded with the same
BitsAndBytesConfig, the device_map path, the num_gpus refusal when the count exceeds the visible cards, and the
time of capture and steer against a plain HF forward on two bf16 models. Prints one line per
check and writes every measured error to JSON; exits 1 if any check fails.
"""

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from interp_engine import capture, generate, load_model, run_with_grad, steer  # noqa: E402
from interp_engine import spec as S  # noqa: E402
from interp_engine.tiny import FAMILIES, build_tiny_model  # noqa: E402

PROMPT = "The quick brown fox jumps over the lazy dog."
# Same kernels on both sides: float32 should agree to rounding; bfloat16 to a few ulps of the activations.
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2}
RESULTS: list[dict] = []
DEVICE = "cuda"  # --device cpu: a dry run of this script where no GPU is


def record(name: str, error: float, limit: float, **extra) -> None:
    ok = error <= limit
    RESULTS.append({"check": name, "max_error": error, "limit": limit, "ok": ok, **extra})
    print(f"{'ok  ' if ok else 'FAIL'} {name}: max error {error:.3g} (limit {limit:g})", flush=True)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Max abs difference, relative to the reference's largest entry (bf16 errors scale with magnitude)."""
    a, b = a.float(), b.float()
    finite = torch.isfinite(b)
    if not torch.equal(finite, torch.isfinite(a)):
        return float("inf")
    scale = max(b[finite].abs().max().item(), 1.0)
    return (a[finite] - b[finite]).abs().max().item() / scale


def check_family(family: str, path: Path, dtype: torch.dtype) -> None:
    from transformers import AutoModelForCausalLM

    tag = f"{family}/{str(dtype).removeprefix('torch.')}"
    model = load_model(str(path), backend="eager", device=DEVICE, dtype=dtype, attn_implementation="eager",
                       requires_grad=dtype == torch.float32)
    ref = AutoModelForCausalLM.from_pretrained(str(path), attn_implementation="eager", dtype=dtype).to(DEVICE).eval()
    tokens = model.to_tokens(PROMPT)
    limit = TOLERANCE[dtype]
    cache = capture(model, tokens, model.points())
    with torch.inference_mode():
        out = ref(tokens.to(DEVICE), output_hidden_states=True, output_attentions=True)
    n = model.n_layers
    errors = [rel(cache["embed"], out.hidden_states[0]), rel(cache["final"], out.hidden_states[n]),
              rel(cache["logits"], out.logits)]
    errors += [rel(cache[f"resid_post.{i}"], out.hidden_states[i + 1]) for i in range(n - 1)]
    errors += [rel(cache[f"attn_probs.{i}"], out.attentions[i]) for i in range(n)]
    record(f"{tag} capture vs HF hidden states/attentions/logits", max(errors), limit,
           device=str(cache["logits"].device))

    baseline = steer(model, tokens, [])
    zero = steer(model, tokens, S.Add("resid_post.1", torch.zeros(model.d_model, dtype=dtype)))
    record(f"{tag} zero-vector steer == baseline (bit-exact)",
           (zero.float() - baseline.float()).abs().max().item(), 0.0)

    vector = torch.randn(model.d_model, generator=torch.Generator().manual_seed(0)).to(dtype)
    steered = steer(model, tokens, S.Add("resid_post.1", vector, scale=2.0))
    layer = ref.get_submodule(model.arch.layers)[1]

    def add(module, args, output):
        hidden = output[0] if isinstance(output, tuple) else output
        hidden = hidden + 2.0 * vector.to(hidden.device)
        return (hidden, *output[1:]) if isinstance(output, tuple) else hidden

    handle = layer.register_forward_hook(add)
    try:
        with torch.inference_mode():
            by_hand = ref(tokens.to(DEVICE)).logits
    finally:
        handle.remove()
    record(f"{tag} steer vs a hand-written HF hook", rel(steered, by_hand), limit)

    if dtype == torch.float32:
        target = int(out.logits[0, -1].argmax())
        result = run_with_grad(model, tokens, loss=lambda logits: logits[0, -1, target], wrt=["resid_post.1"])
        captured = {}

        def keep(module, args, output):
            hidden = output[0] if isinstance(output, tuple) else output
            captured["h"] = hidden
            return output

        handle = layer.register_forward_hook(keep)
        try:
            logits = ref(tokens.to(DEVICE)).logits
            (grad,) = torch.autograd.grad(logits[0, -1, target], captured["h"])
        finally:
            handle.remove()
        record(f"{tag} run_with_grad vs torch.autograd.grad", rel(result.grads["resid_post.1"], grad), 1e-4)

        out_ie = generate(model, [PROMPT], max_new_tokens=8)
        with torch.inference_mode():
            hf = ref.generate(tokens.to(DEVICE), max_new_tokens=8, do_sample=False, pad_token_id=0)
        ours, theirs = list(out_ie.tokens[0]), hf[0, tokens.shape[1]:].tolist()
        same = ours == theirs
        record(f"{tag} greedy generate == HF generate", 0.0 if same else 1.0, 0.0, ours=str(ours), hf=str(theirs))
    left = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.runtime.model.modules())
    record(f"{tag} no hook left on the model", float(left), 0.0)
    del model, ref
    torch.cuda.empty_cache()


def check_bnb(path: Path) -> None:
    try:
        import bitsandbytes  # noqa: F401
        from transformers import AutoModelForCausalLM, BitsAndBytesConfig
    except ImportError as e:
        print(f"skip bnb-4bit: {e}", flush=True)
        return
    model = load_model(str(path), backend="eager", device=DEVICE, dtype="bfloat16", quantization="bnb-4bit",
                       attn_implementation="eager")
    tokens = model.to_tokens(PROMPT)
    logits = steer(model, tokens, [])
    kwargs = model.runtime.hf_kwargs
    config = kwargs.get("quantization_config") or BitsAndBytesConfig(load_in_4bit=True,
                                                                     bnb_4bit_compute_dtype=torch.bfloat16)
    ref = AutoModelForCausalLM.from_pretrained(str(path), attn_implementation="eager", dtype=torch.bfloat16,
                                               quantization_config=config, device_map={"": DEVICE}).eval()
    with torch.inference_mode():
        by_hf = ref(tokens.to(DEVICE)).logits
    record("llama/bnb-4bit steer() vs HF with the same BitsAndBytesConfig", rel(logits, by_hf), 1e-2)
    layer = model.runtime.model.get_submodule(model.arch.layers)[0]
    linear = type(layer.get_submodule(model.arch.mlp_down)).__name__
    record(f"llama/bnb-4bit down_proj is a 4-bit layer ({linear})", 0.0 if "4bit" in linear else 1.0, 0.0)


SPEED_MODELS = {  # name: (config overrides, batch, length)
    "8 layers d_model 1024, 8x256": (dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                                          num_attention_heads=16, num_key_value_heads=4, head_dim=64,
                                          max_position_embeddings=2048), 8, 256),
    "4 layers d_model 4096, 8x512": (dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=4,
                                          num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                                          max_position_embeddings=2048), 8, 512),
}


def check_speed(root: Path) -> None:
    """capture, steer and a steer with no edit against a plain HF forward, bf16, interleaved, 15 timed rounds
    after 3 warm-ups; reported as the median per-round ratio and its 10th-90th percentile spread (not asserted).
    The no-edit steer is the fixed per-call cost (validation, padding, the result check), the others add hooks."""
    import statistics

    from transformers import AutoModelForCausalLM

    for label, (overrides, batch, length) in SPEED_MODELS.items():
        path = build_tiny_model("llama", root / f"speed-{batch}x{length}-{overrides['hidden_size']}",
                                overrides=overrides)
        model = load_model(str(path), backend="eager", device=DEVICE, dtype="bfloat16")
        ref = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16).to(DEVICE).eval()
        tokens = torch.randint(3, 500, (batch, length), generator=torch.Generator().manual_seed(0))
        points = [f"resid_post.{i}" for i in range(model.n_layers)]
        vector = torch.randn(model.d_model).to(torch.bfloat16)

        def hf():
            with torch.inference_mode():
                ref(tokens.to(DEVICE))

        paths = {"hf_forward": hf,
                 "steer_no_edit": lambda: steer(model, tokens, [], progress=False),
                 "steer_one_add": lambda: steer(model, tokens, S.Add(f"resid_post.{model.n_layers // 2}", vector),
                                                progress=False),
                 "capture_resid_post_every_layer": lambda: capture(model, tokens, points, progress=False)}
        times: dict[str, list[float]] = {name: [] for name in paths}
        for rep in range(18):
            for name, run in paths.items():
                torch.cuda.synchronize() if DEVICE == "cuda" else None
                start = time.perf_counter()
                run()
                torch.cuda.synchronize() if DEVICE == "cuda" else None
                if rep >= 3:
                    times[name].append(time.perf_counter() - start)
        base = statistics.median(times["hf_forward"])
        for name in list(paths)[1:]:
            ratios = sorted(t / b for t, b in zip(times[name], times["hf_forward"]))
            ms = statistics.median(times[name]) * 1e3
            RESULTS.append({"check": f"speed {name} / HF forward ({label}, bf16)", "ok": True,
                            "median_ratio": statistics.median(ratios), "ratio_p10": ratios[1], "ratio_p90": ratios[-2],
                            "hf_forward_ms": base * 1e3, "path_ms": ms})
            print(f"info speed {label} {name}: {ms:.2f} ms vs HF {base * 1e3:.2f} ms, ratio median "
                  f"{statistics.median(ratios):.3f} (p10 {ratios[1]:.3f}, p90 {ratios[-2]:.3f})", flush=True)
        del model, ref
        torch.cuda.empty_cache() if DEVICE == "cuda" else None


def check_device_map(path: Path) -> None:
    """The device_map path (num_gpus over every visible card; with one card, device_map="auto" passed through to
    from_pretrained) against HF loaded on one card: captures and a steer, float32."""
    from transformers import AutoModelForCausalLM

    count = torch.cuda.device_count()
    keywords = {"num_gpus": count} if count > 1 else {"device_map": "auto"}
    model = load_model(str(path), backend="eager", device=DEVICE, dtype="float32", attn_implementation="eager",
                       **keywords)
    ref = AutoModelForCausalLM.from_pretrained(str(path), attn_implementation="eager", dtype=torch.float32
                                               ).to(DEVICE).eval()
    tokens = model.to_tokens(PROMPT)
    cache = capture(model, tokens, ["resid_post.0", "attn_probs.1", "logits"])
    with torch.inference_mode():
        out = ref(tokens.to(DEVICE), output_hidden_states=True, output_attentions=True)
    error = max(rel(cache["resid_post.0"], out.hidden_states[1]), rel(cache["attn_probs.1"], out.attentions[1]),
                rel(cache["logits"], out.logits))
    record(f"llama/float32 device_map ({keywords}) capture vs HF on one card", error, 1e-4,
           devices=str(sorted({str(p.device) for p in model.runtime.model.parameters()})))


def check_refusal(path: Path) -> None:
    count = torch.cuda.device_count()
    try:
        load_model(str(path), backend="eager", device=DEVICE, num_gpus=count + 1)
    except Exception as e:  # noqa: BLE001 - the message is what is checked
        said = str(e)
        record(f"num_gpus={count + 1} refused naming the visible count", 0.0 if "CUDA devices" in said else 1.0, 0.0,
               message=said)
        return
    record(f"num_gpus={count + 1} refused", 1.0, 0.0)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="gpu_check.json")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--families", default=",".join(FAMILIES))
    args = parser.parse_args()
    global DEVICE
    DEVICE = args.device
    if DEVICE == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: nothing to check", flush=True)
        return 1
    started = time.time()
    with tempfile.TemporaryDirectory() as root:
        families = args.families.split(",")
        paths = {family: build_tiny_model(family, Path(root) / family) for family in {*families, "llama"}}
        for family in families:
            for dtype in (torch.float32, torch.bfloat16):
                try:
                    check_family(family, paths[family], dtype)
                except Exception as e:  # noqa: BLE001 - report and go on to the next family
                    record(f"{family}/{dtype} raised {type(e).__name__}: {e}"[:400], 1.0, 0.0)
        for name, check, arg in (("bnb", check_bnb, paths["llama"]), ("refusal", check_refusal, paths["llama"]),
                                 ("device_map", check_device_map, paths["llama"]),
                                 ("speed", check_speed, Path(root))) if DEVICE == "cuda" else ():
            try:
                check(arg)
            except Exception as e:  # noqa: BLE001
                record(f"{name} raised {type(e).__name__}: {e}"[:400], 1.0, 0.0)
    meta = {"device": torch.cuda.get_device_name(0) if DEVICE == "cuda" else DEVICE, "torch": torch.__version__,
            "seconds": time.time() - started}
    import transformers

    meta["transformers"] = transformers.__version__
    Path(args.out).write_text(json.dumps({"meta": meta, "results": RESULTS}, indent=1))
    failed = [r for r in RESULTS if not r["ok"]]
    print(f"{len(RESULTS) - len(failed)} passed, {len(failed)} failed", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
