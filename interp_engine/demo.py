"""The main job, end to end on a model built here (no network): capture, steer, generate with steering, read
the logit lens, take a gradient, and draw pictures: the lens as a heatmap, one layer's attention patterns,
and the steering edit's effect on the residual stream layer by layer.

    python -m interp_engine.demo --out out/demo
"""

import argparse
import asyncio
import time
from pathlib import Path

import torch

from interp_engine import Address, capture, generate, load_model, logit_lens, run_with_grad, steer
from interp_engine import spec as S
from interp_engine.plot import plot_attention, plot_logit_lens, plot_steering_norms
from interp_engine.tiny import build_tiny_model


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="out/demo", help="folder for the model, the PNG and the summary")
    parser.add_argument("--family", default="llama", help="architecture family of the demo model")
    parser.add_argument("--train-steps", type=int, default=300, help="steps fitting the model to a tiny corpus")
    args = parser.parse_args(argv)
    out = Path(args.out)
    torch.manual_seed(0)

    started = time.perf_counter()
    path = build_tiny_model(args.family, out / "model", train_steps=args.train_steps, initializer_range=0.02)
    print(f"built and trained a tiny {args.family} model in {time.perf_counter() - started:.1f}s -> {path}")
    model = load_model(str(path), backend="eager", attn_implementation="eager", requires_grad=True, device="cpu")
    asyncio.run(model.warmup())
    print(f"loaded: {model.n_layers} layers, d_model {model.d_model}, {model.n_heads} heads "
          f"({model.n_kv_heads} kv), d_mlp {model.d_mlp}, vocab {model.d_vocab}, {len(model.points())} points\n")

    paris, berlin = "Paris is the capital of", "Berlin is the capital of"
    point = Address("resid_post", 0)

    # 1. Capture: every point of the model in one pass.
    cache = capture(model, [paris, berlin], model.points(), progress=False)
    print(f"1. capture: {len(cache)} points; {point} is {tuple(cache[point].shape)}, "
          f"attn_probs.0 is {tuple(cache['attn_probs.0'].shape)}")

    # 2. A steering vector: Berlin minus Paris at `point`, averaged over positions (both prompts have the
    #    same length here), added at every position with scale 2.
    vector = (cache[point][1] - cache[point][0]).mean(0)
    steering = S.Add(point, vector, scale=2.0)
    logits = steer(model, paris, steering)
    plain = steer(model, paris, S.Spec())
    top = lambda lg: model.to_string([int(lg[0, -1].argmax())])  # noqa: E731
    print(f"2. steer at {point}: next token {top(plain)!r} -> {top(logits)!r}")

    # 3. Generation with the same edit applied at every step.
    before = generate(model, paris, max_new_tokens=8, progress=False).text[0]
    after = generate(model, paris, steering, max_new_tokens=8, progress=False).text[0]
    print(f"3. generate: {paris!r} + {before!r}\n   steered:  {paris!r} + {after!r}")

    # 4. Logit lens over every layer, drawn as a heatmap.
    lens = logit_lens(model, paris, progress=False)[:, 0]
    tokens = model.to_tokens(paris)[0].tolist()
    labels = [model.to_string([t]) for t in tokens]
    top_tokens = [[model.to_string([int(i)]) for i in row.argmax(-1)] for row in lens]
    png = plot_logit_lens(lens, row_labels=[f"resid_post.{i}" for i in range(model.n_layers)],
                          position_labels=labels, top_tokens=top_tokens, path=out / "logit_lens.png",
                          title=f"logit lens: {paris!r}")
    print(f"4. logit lens: last position reads {[row[-1] for row in top_tokens]} by layer -> {png}")

    # 5. Attribution: gradient of the logit difference France - Germany w.r.t. each layer's residual stream;
    #    its norm per position shows where the answer is still being decided.
    france, germany = (model.tokenize(w, prepend_bos=False)[0] for w in (" France", " Germany"))
    layers = [Address("resid_post", i) for i in range(model.n_layers)]
    result = run_with_grad(model, paris, loss=lambda lg: lg[0, -1, france] - lg[0, -1, germany], wrt=layers)
    print(f"5. run_with_grad: logit(France) - logit(Germany) = {float(result.value):.2f}; gradient norm by "
          f"position {labels}:")
    for address in layers:
        norms = result.grads[address][0].norm(dim=-1)
        print(f"   {str(address):13s}" + " ".join(f"{n:7.3f}" for n in norms.tolist()))

    # 6. Pictures of steps 1 and 2: attention at layer 0, and how far the steering edit moves resid_post.
    grid = plot_attention(cache["attn_probs.0"][0], token_labels=labels, path=out / "attention_layer0.png",
                          title=f"attn_probs.0: {paris!r}")
    steered = capture(model, paris, layers, steering, progress=False)
    plain_run = capture(model, paris, layers, progress=False)
    stack = lambda run: torch.stack([run[a][0] for a in layers])  # noqa: E731  [layer, pos, d_model]
    norms = plot_steering_norms(stack(steered), stack(plain_run),
                                layer_labels=[str(a) for a in layers], path=out / "steering_norms.png",
                                title=f"Add at {point}, scale 2: effect on resid_post")
    print(f"6. pictures: {grid}, {norms}")

    asyncio.run(model.shutdown())
    print(f"\ndone in {time.perf_counter() - started:.1f}s; outputs in {out}/")


if __name__ == "__main__":
    main()
