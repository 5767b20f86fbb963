"""One vLLM backend (vllm, vllm-static or vllm-generate) against plain vLLM on the same engine and prompts.

Baselines are the handle's own engine driven directly (`LLM.generate`): prefill is `max_tokens=1`, decode is
`max_tokens=T` with EOS ignored; both skip reading the prefix cache, as interp_engine's capture requests do, so
every repetition does the same work. Scenarios a backend refuses are listed as not served; a backend this
build lacks ("not in this build") is listed as not built.

    python -m benchmarks.suite_vllm SETTINGS_JSON BACKEND
"""

import asyncio
import sys

import torch

from benchmarks import common as B

SCENARIOS = {  # path -> (scenario, baseline)
    "capture_resid_post": ("capture resid_post (all layers)", "plain_prefill"),
    "capture_all_points": ("capture every point", "plain_prefill"),
    "logit_lens": ("logit lens (all layers)", "plain_prefill"),
    "steered_generate": ("steered generation", "plain_decode"),
    "generate": ("generation, no spec", "plain_decode"),
}


def load(settings: B.Settings, backend: str, mid: int):
    from interp_engine import load_model

    kwargs = dict(num_gpus=settings.num_gpus, max_model_len=512)
    if backend == "vllm-static":
        kwargs.update(static_points="auto", static_writes=[f"resid_post.{mid}"])
    if backend == "vllm-generate" and settings.quick:
        # CI exercises the code path; torch.compile would add a minute to the quick run and measure nothing.
        kwargs.update(extra_vllm_kwargs={"enforce_eager": True})
    model = load_model(settings.model, backend=backend, **kwargs)
    asyncio.run(model.warmup())
    return model


def main() -> None:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from interp_engine import InterpEngineError, capture, generate, logit_lens
    from interp_engine import spec as S
    from interp_engine.loading import read_config

    settings, backend = B.Settings.from_json(sys.argv[1]), sys.argv[2]
    suite, rows = backend, []
    n_layers = read_config(settings.model)[1].num_hidden_layers
    mid = n_layers // 2
    try:
        model = load(settings, backend, mid)
    except InterpEngineError as e:
        status = "not_built" if "not in this build" in str(e) else "not_served"
        rows = [{**B.refused(suite, s, p, str(e).splitlines()[0]), "status": status} for p, (s, _) in SCENARIOS.items()]
        B.write(settings, suite, rows, {"status": status, "env": B.env_info()})
        print(f"{backend}: {status}: {e}")
        return
    try:
        llm = model.runtime.llm
        resid = [f"resid_post.{i}" for i in range(n_layers)]
        every = [str(a) for a in model.points()]
        spec = S.Add(f"resid_post.{mid}", torch.randn(model.d_model, generator=torch.Generator().manual_seed(0)),
                     scale=4.0)
        new = settings.new_tokens

        def plain(batch, max_tokens):
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, detokenize=False,
                                    skip_reading_prefix_cache=True)
            return llm.generate([TokensPrompt(prompt_token_ids=p) for p in batch], params, use_tqdm=False)

        wait, refusals, baselines = B.IdleWaiter(settings.max_wait_s), {}, []
        for batch, seq in settings.sizes:
            ids = B.prompts(model.d_vocab, batch, seq)
            candidates = {
                "plain_prefill": lambda: plain(ids, 1),
                "capture_resid_post": lambda: capture(model, ids, resid, progress=False),
                "capture_all_points": lambda: capture(model, ids, every, progress=False),
                "logit_lens": lambda: logit_lens(model, ids, progress=False),
                "plain_decode": lambda: plain(ids, new),
                "steered_generate": lambda: generate(model, ids, spec, max_new_tokens=new, stop_at_eos=False,
                                                     progress=False),
                "generate": lambda: generate(model, ids, max_new_tokens=new, stop_at_eos=False, progress=False),
            }
            paths = {}
            for name, call in candidates.items():
                if name in refusals:
                    continue
                try:
                    call()  # the first warm-up call, and the probe for a refusal
                    paths[name] = call
                except InterpEngineError as e:
                    refusals[name] = str(e).splitlines()[0]
            timed = B.time_paths(paths, settings.reps, max(settings.warmup - 1, 0), wait)
            # What this engine's plain paths took: the driver divides vllm-static's paths by the default engine's.
            baselines.append({"batch": batch, "seq": seq, **{b: timed["median_ms"][b] for b in ("plain_prefill",
                                                                                                "plain_decode")}})
            for path, (scenario, baseline) in SCENARIOS.items():
                if path in paths:
                    rows.append(B.row(suite, scenario, batch, seq, path, baseline, timed,
                                      tokens=batch * new if "generate" in path else None))
            print(f"{backend} {batch}x{seq}: " + ", ".join(f"{k} {v:.0f} ms" for k, v in timed["median_ms"].items()),
                  flush=True)
        rows += [B.refused(suite, SCENARIOS[p][0], p, why) for p, why in refusals.items() if p in SCENARIOS]
        rows.append(B.refused(suite, "run_with_grad (resid_post, all layers)", "run_with_grad",
                              "gradients through the forward are eager-only (vLLM runs inference kernels)"))
    finally:
        asyncio.run(model.shutdown())
    B.write(settings, suite, rows, {"status": "ok", "env": B.env_info(), "threads": B.threads(),
                                    "baselines_ms": baselines,
                                    "engine": "enforce_eager=True (Python hooks)" if backend == "vllm"
                                    else "vLLM's default compilation"})


if __name__ == "__main__":
    main()
