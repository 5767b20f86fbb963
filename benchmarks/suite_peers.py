"""Peers on the same model, each against a plain HF forward timed in the same rounds: TransformerLens
(`TransformerBridge.run_with_cache` filtered to resid_post) and nnsight (`trace` + `save` of every layer's
output), on HF; nnsight on vLLM where vLLM is installed beside it. Runs in whichever Python has the peers
(benchmarks/run_all.py uses PEERS_PYTHON, default /work/peers-venv/bin/python, when it exists).

    python -m benchmarks.suite_peers SETTINGS_JSON
"""

import sys

import torch

from benchmarks import common as B


def transformer_lens_path(path: str, n_layers: int):
    from transformer_lens.model_bridge import TransformerBridge

    # The bridge forces eager attention so that patterns are hookable: that cost is part of what a user pays.
    bridge = TransformerBridge.boot_transformers(path, device="cpu", dtype=torch.float32)
    names = {f"blocks.{i}.hook_resid_post" for i in range(n_layers)}

    def run(ids):
        with torch.inference_mode():
            _, cache = bridge.run_with_cache(ids, names_filter=lambda name: name in names)
        return cache[f"blocks.{n_layers - 1}.hook_resid_post"]

    return run


def nnsight_path(path: str):
    try:
        from nnsight import TransformersModel as Model  # LanguageModel is a deprecated alias from 0.8 on
    except ImportError:
        from nnsight import LanguageModel as Model
    model = Model(path, task="text-generation", device_map="cpu", dispatch=True, dtype=torch.float32,
                  attn_implementation="sdpa")

    def run(ids):
        saved = []
        # An explicit loop: nnsight 0.8.1 does not hand back a list built by a comprehension inside a trace.
        with torch.inference_mode(), model.trace(ids):
            for layer in model.model.layers:
                saved.append(layer.output.save())
        return saved[-1]

    return run


def main() -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    settings = B.Settings.from_json(sys.argv[1])
    torch.set_num_threads(B.threads())
    n_layers = AutoConfig.from_pretrained(settings.model).num_hidden_layers
    vocab = AutoConfig.from_pretrained(settings.model).vocab_size
    hf = AutoModelForCausalLM.from_pretrained(settings.model, dtype=torch.float32, attn_implementation="sdpa")
    hf.eval().requires_grad_(False)
    paths, rows = {"hf_forward": lambda ids: hf(input_ids=ids, use_cache=False)}, []
    for name, make in (("transformer_lens", lambda: transformer_lens_path(settings.model, n_layers)),
                       ("nnsight", lambda: nnsight_path(settings.model))):
        try:
            paths[name] = make()
        except ImportError as e:
            rows.append(B.refused("peers", "capture resid_post (all layers)", name, f"not installed ({e})"))
    try:
        import vllm  # noqa: F401
        rows.append(B.refused("peers", "capture resid_post (all layers)", "nnsight_vllm",
                              "nnsight's VLLM wrapper is not benchmarked yet"))
    except ImportError:
        rows.append(B.refused("peers", "capture resid_post (all layers)", "nnsight_vllm",
                              "vLLM is not installed beside nnsight in the peers' Python"))
    wait = B.IdleWaiter(settings.max_wait_s)
    for batch, seq in settings.sizes:
        ids = torch.tensor(B.prompts(vocab, batch, seq))
        with torch.inference_mode():
            timed = B.time_paths({k: (lambda f=f: f(ids)) for k, f in paths.items()}, settings.reps,
                                 settings.warmup, wait)
        rows += [B.row("peers", "capture resid_post (all layers)", batch, seq, name, "hf_forward", timed)
                 for name in paths if name != "hf_forward"]
        print(f"peers {batch}x{seq}: " + ", ".join(f"{k} {v:.0f} ms" for k, v in timed["median_ms"].items()),
              flush=True)
    B.write(settings, "peers", rows, {"env": B.env_info(), "threads": torch.get_num_threads()})


if __name__ == "__main__":
    main()
