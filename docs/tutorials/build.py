"""Writes the tutorial notebooks from the cells below (outputs empty; CI executes them in tests/test_tutorials.py).

    python docs/tutorials/build.py
"""

from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

HERE = Path(__file__).parent

# Every notebook starts here: a tiny real model (a scaled-down HF config, trained for seconds on a built-in
# corpus), unless TUTORIAL_MODEL names a folder (CI builds one per run) or you swap in a Hub repo id.
SETUP = '''import os, tempfile
import torch
from interp_engine.tiny import build_tiny_model

MODEL = os.environ.get("TUTORIAL_MODEL") or str(build_tiny_model("llama", tempfile.mkdtemp(), train_steps=200,
                                                                 initializer_range=0.02))
# e.g. MODEL = "Qwen/Qwen3-0.6B": a repo id not in the local HF cache is downloaded first.
OUT = tempfile.mkdtemp()'''

FIRST_LOOK = [
    new_markdown_cell("# A first look: capture, the logit lens, attention\n\nLoad a model, look at its shape "
                      "and tokens, read activations, and draw the logit lens and one layer's attention."),
    new_code_cell(SETUP),
    new_code_cell('''from interp_engine import capture, load_model, logit_lens

model = load_model(MODEL, backend="eager", attn_implementation="eager", device="cpu")  # lazy: loads at first use
print(model)
print(model.cfg)
prompt = "Paris is the capital of"
print(model.to_str_tokens(prompt))'''),
    new_markdown_cell("`capture` reads any points in one forward pass; rows of ragged prompts are right-padded with "
                      "zeros and `cache.lengths` says where each prompt ends."),
    new_code_cell('''cache = capture(model, [prompt, "Berlin is"], ["resid_post.0", "attn_probs.0"])
print(cache.lengths, tuple(cache["resid_post.0"].shape), tuple(cache["attn_probs.0"].shape))
assert cache["resid_post.0"][1, cache.lengths[1]:].abs().sum() == 0  # padding is zeros'''),
    new_markdown_cell("The logit lens reads each layer's residual stream through the final norm and the "
                      "unembedding: which token would the model predict if it stopped here?"),
    new_code_cell('''from IPython.display import Image, display
from interp_engine.plot import plot_attention, plot_logit_lens

lens = logit_lens(model, prompt)[:, 0]  # [layer, pos, d_vocab] log-probs
labels = model.to_str_tokens(prompt)
top_tokens = [[model.to_string([int(i)]) for i in row.argmax(-1)] for row in lens]
display(Image(plot_logit_lens(lens, row_labels=[f"resid_post.{i}" for i in range(model.n_layers)],
                              position_labels=labels, top_tokens=top_tokens, path=f"{OUT}/lens.png")))
top = logit_lens(model, prompt, positions="last", top_k=3)  # only what is asked: [layer, batch, 1, 3]
print([model.to_string([int(i)]) for i in top.tokens[-1, 0, 0]])'''),
    new_code_cell('''pattern = capture(model, prompt, ["attn_probs.0"])["attn_probs.0"][0]  # [n_heads, q_pos, k_pos]
assert torch.allclose(pattern.sum(-1), torch.ones(pattern.shape[:2]))  # each query's weights sum to 1
display(Image(plot_attention(pattern, token_labels=labels, path=f"{OUT}/attention.png")))'''),
]

STEERING = [
    new_markdown_cell("# A steering vector from contrastive prompts, applied on vLLM\n\nThe difference of mean "
                      "activations between two sets of prompts is a direction; adding it while the model runs "
                      "steers what comes next. The same code runs on every backend: `BACKEND` is `vllm` "
                      "(set `TUTORIAL_BACKEND=eager` where vLLM is not installed; CI runs this notebook on "
                      "eager to stay within its time budget, and the vLLM backends are tested equal to eager "
                      "in tests/)."),
    new_code_cell(SETUP),
    new_code_cell('''from interp_engine import capture, generate, load_model, steer
from interp_engine import spec as S

BACKEND = os.environ.get("TUTORIAL_BACKEND", "vllm")
model = load_model(MODEL, backend=BACKEND)
print(model)'''),
    new_code_cell('''france = ["Paris is the capital of", "The capital of France is Paris,", "Paris is in France."]
germany = ["Berlin is the capital of", "The capital of Germany is Berlin,", "Berlin is in Germany."]
point = f"resid_post.{model.n_layers // 2}"

def mean_activation(prompts):
    cache = capture(model, prompts, [point])
    # Ragged prompts: average each prompt over its own positions only (padding is zeros).
    return torch.stack([cache[point][i, :n].mean(0) for i, n in enumerate(cache.lengths)]).mean(0)

vector = mean_activation(germany) - mean_activation(france)
print(point, vector.norm())'''),
    new_code_cell('''prompt = "Paris is the capital of"
steering = S.Add(point, vector, scale=4.0)
plain = steer(model, prompt, None, positions="last")[0, -1]  # only the last position's logits
steered = steer(model, prompt, steering, positions="last")[0, -1]
germany_id, france_id = model.to_single_token(" Germany"), model.to_single_token(" France")
shift = (steered[germany_id] - steered[france_id]) - (plain[germany_id] - plain[france_id])
print(f"logit(Germany) - logit(France) moved by {float(shift):+.2f}")  # on a trained model: towards Germany
top = lambda logits: [model.to_string([int(i)]) for i in logits.topk(5).indices]  # noqa: E731
print("plain  ", top(plain))
print("steered", top(steered))
assert not torch.allclose(plain, steered)'''),
    new_code_cell('''print(generate(model, prompt, max_new_tokens=8).text[0])
print(generate(model, prompt, steering, max_new_tokens=8).text[0])  # the edit applies at every step'''),
    new_code_cell("await model.shutdown()  # vLLM holds one engine per process: give it back (a notebook awaits)"),
]

ATTRIBUTION = [
    new_markdown_cell("# Attribution: gradients and direct logit attribution\n\n`run_with_grad` differentiates "
                      "a loss on the logits with respect to activations (eager, `requires_grad=True`); "
                      "`decompose_resid` and `logit_attrs` split the final residual stream into what each "
                      "layer wrote and how much of it points at an answer."),
    new_code_cell(SETUP),
    new_code_cell('''from interp_engine import load_model, run_with_cache, run_with_grad

model = load_model(MODEL, backend="eager", requires_grad=True, device="cpu")
prompt = "Paris is the capital of"
right, wrong = model.to_single_token(" France"), model.to_single_token(" Germany")
layers = [f"resid_post.{i}" for i in range(model.n_layers)]
result = run_with_grad(model, prompt, loss=lambda lg: lg[0, -1, right] - lg[0, -1, wrong], wrt=layers)
print("logit difference", float(result.value))
for point in layers:
    print(point, [round(x, 3) for x in result.grads[point][0].norm(dim=-1).tolist()])'''),
    new_code_cell('''logits, cache = run_with_cache(model, prompt)
parts, labels = cache.decompose_resid(return_labels=True)  # [component, batch, pos, d_model]
assert torch.allclose(parts.sum(0), cache[f"resid_post.{model.n_layers - 1}"], atol=1e-4)
attrs = cache.logit_attrs(parts, " France", " Germany", model=model)[:, 0, -1]  # [component]
for label, value in zip(labels, attrs.tolist()):
    print(f"{label:12s} {value:+.3f}")
# The components' attributions add up to the logit difference (the final norm linearised at this prompt).
print("sum", float(attrs.sum()), "logit difference", float(logits[0, -1, right] - logits[0, -1, wrong]))
assert torch.allclose(attrs.sum(), logits[0, -1, right] - logits[0, -1, wrong], atol=1e-3)'''),
]


def main() -> None:
    for name, cells in (("01_first_look", FIRST_LOOK), ("02_steering_vector", STEERING),
                        ("03_attribution", ATTRIBUTION)):
        notebook = new_notebook(cells=cells, metadata={"kernelspec": {"name": "python3", "display_name": "Python 3",
                                                                      "language": "python"}})
        nbformat.write(notebook, HERE / f"{name}.ipynb")


if __name__ == "__main__":
    main()
