"""Eager backend against plain HF transformers on the same model, in one process.

Scenarios (path vs baseline): capture resid_post at every layer vs an HF forward; capture every point vs an HF
forward with eager attention (patterns need it); logit lens vs a hand-written lens (HF hidden states through
the final norm and unembedding); run_with_grad vs torch.autograd.grad w.r.t. HF's hidden states; steered
generation vs HF's greedy generate.

    python -m benchmarks.suite_eager SETTINGS_JSON      (run by benchmarks/run_all.py)
"""

import sys

import torch

from benchmarks import common as B


def hf_model(path: str, attn: str, device: str, num_gpus: int):
    from transformers import AutoModelForCausalLM

    kwargs = {"device_map": "auto"} if num_gpus > 1 else {}
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=attn, **kwargs)
    if num_gpus == 1:
        model.to(device)
    return model.eval().requires_grad_(False)


def main() -> None:
    from interp_engine import capture, generate, load_model, logit_lens, run_with_grad
    from interp_engine import spec as S

    settings = B.Settings.from_json(sys.argv[1])
    torch.set_num_threads(B.threads())
    device = "cuda" if torch.cuda.is_available() else "cpu"
    hf, hf_eager = (hf_model(settings.model, a, device, settings.num_gpus) for a in ("sdpa", "eager"))
    common = dict(backend="eager", device=device, dtype="float32", num_gpus=settings.num_gpus)
    ie = load_model(settings.model, attn_implementation="sdpa", **common)
    ie_patterns = load_model(settings.model, attn_implementation="eager", **common)
    ie_grad = load_model(settings.model, attn_implementation="sdpa", requires_grad=True, **common)
    for handle in (ie, ie_patterns, ie_grad):
        handle.runtime.load()
    n, vocab, mid = ie.n_layers, ie.d_vocab, ie.n_layers // 2
    resid = [f"resid_post.{i}" for i in range(n)]
    every = [str(a) for a in ie_patterns.points()]
    vector = torch.randn(ie.d_model, generator=torch.Generator().manual_seed(0))
    steer_spec = S.Add(f"resid_post.{mid}", vector, scale=4.0)
    new = settings.new_tokens
    loss = lambda logits: logits[:, -1].logsumexp(-1).sum()  # noqa: E731

    def hand_lens(ids):
        # What a user writes without a library: every hidden state through the final norm and unembedding.
        with torch.inference_mode():
            states = hf(input_ids=ids, output_hidden_states=True, use_cache=False).hidden_states[1:]
            return [torch.log_softmax(hf.lm_head(hf.model.norm(h)), -1) for h in states]

    def hand_grad(ids):
        # Parameters are frozen, so the graph starts at embeddings that require grad; the hidden states are
        # intermediate tensors of that graph and autograd.grad takes gradients w.r.t. them directly.
        with torch.enable_grad():
            embeds = hf.get_input_embeddings()(ids).detach().requires_grad_()
            out = hf(inputs_embeds=embeds, output_hidden_states=True, use_cache=False)
            return torch.autograd.grad(loss(out.logits), out.hidden_states[1:])

    rows, wait = [], B.IdleWaiter(settings.max_wait_s)
    for batch, seq in settings.sizes:
        ids = torch.tensor(B.prompts(vocab, batch, seq), device=device)
        paths = {
            "hf_forward": lambda: hf(input_ids=ids, use_cache=False),
            "capture_resid_post": lambda: capture(ie, ids, resid, progress=False),
            "hf_forward_eager_attn": lambda: hf_eager(input_ids=ids, use_cache=False),
            "capture_all_points": lambda: capture(ie_patterns, ids, every, progress=False),
            "hf_hand_lens": lambda: hand_lens(ids),
            "logit_lens": lambda: logit_lens(ie, ids, progress=False),
            "hf_hand_grad": lambda: hand_grad(ids),
            "run_with_grad": lambda: run_with_grad(ie_grad, ids, loss=loss, wrt=resid),
            "hf_generate": lambda: hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                               max_new_tokens=new, min_new_tokens=new, pad_token_id=0),
            "steered_generate": lambda: generate(ie, ids, steer_spec, max_new_tokens=new, stop_at_eos=False,
                                                 progress=False),
        }
        with torch.inference_mode():
            plain = {k: v for k, v in paths.items() if k not in ("hf_hand_grad", "run_with_grad")}
            timed = B.time_paths(plain, settings.reps, settings.warmup, wait)
        grads = B.time_paths({k: paths[k] for k in ("hf_hand_grad", "run_with_grad")}, settings.reps,
                             settings.warmup, wait)
        timed = {key: {**timed[key], **grads[key]} if isinstance(timed[key], dict) else timed[key] + grads[key]
                 for key in timed}
        scenario = lambda s, p, b, **kw: B.row("eager", s, batch, seq, p, b, timed, **kw)  # noqa: E731
        rows += [scenario("capture resid_post (all layers)", "capture_resid_post", "hf_forward"),
                 scenario("capture every point", "capture_all_points", "hf_forward_eager_attn",
                          note="patterns need eager attention; the baseline runs it too"),
                 scenario("capture every point", "capture_all_points", "hf_forward",
                          note="against HF's default (sdpa) forward: what reading patterns costs in all"),
                 scenario("logit lens (all layers)", "logit_lens", "hf_hand_lens"),
                 scenario("run_with_grad (resid_post, all layers)", "run_with_grad", "hf_hand_grad"),
                 scenario("steered generation", "steered_generate", "hf_generate", tokens=batch * new)]
        print(f"eager {batch}x{seq}: " + ", ".join(f"{k} {v:.0f} ms" for k, v in timed["median_ms"].items()),
              flush=True)
    n_params = sum(p.numel() for p in hf.parameters())
    B.write(settings, "eager", rows, {"n_params": n_params, "env": B.env_info(), "threads": torch.get_num_threads(),
                                      "device": device})


if __name__ == "__main__":
    main()
