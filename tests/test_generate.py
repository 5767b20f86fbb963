"""generate() against re-running steer() greedily, token by token."""

import pytest
import torch

from interp_engine import capture, generate, steer
from interp_engine import spec as S
from tests.conftest import PROMPTS


def _greedy_by_steer(model, prompt, spec, n):
    ids = model.tokenize(prompt)
    out = []
    for _ in range(n):
        token = int(steer(model, [ids], spec)[0, -1].argmax())
        out.append(token)
        ids = ids + [token]
    return out


@pytest.mark.parametrize("family", ["llama", "gpt2", "gemma2", "gpt_neox"])
def test_steered_generation_equals_steer_token_by_token(family, eager):
    model = eager(family)
    vector = torch.randn(model.d_model, generator=torch.Generator().manual_seed(3))
    spec = S.Add("resid_post.1", vector, scale=4.0) + S.Scale("v.0", 0.5, heads=[1])
    out = generate(model, PROMPTS, spec, max_new_tokens=6, stop_at_eos=False)
    plain = generate(model, PROMPTS, max_new_tokens=6, stop_at_eos=False)
    assert out.tokens != plain.tokens, "the steering must change what is generated"
    for i, prompt in enumerate(PROMPTS):
        assert list(out.tokens[i]) == _greedy_by_steer(model, prompt, spec, 6), (family, i)
        assert list(plain.tokens[i]) == _greedy_by_steer(model, prompt, S.Spec(), 6), (family, i)
        assert out.text[i] == model.to_string(list(out.tokens[i]))


def test_generated_positions_capture_equals_capture_of_the_sequence(eager):
    model = eager("qwen3")
    spec = S.Add("resid_post.0", torch.ones(model.d_model), positions="all")
    out = generate(model, PROMPTS, spec, max_new_tokens=5, stop_at_eos=False,
                   capture=["resid_post.2", "k.1", "mlp_act.0"])
    for i in range(len(PROMPTS)):
        full = out.sequences[i, : out.lengths[i]]
        n_prompt = out.lengths[i] - len(out.tokens[i])
        again = capture(model, full[None], ["resid_post.2", "k.1", "mlp_act.0"], spec)
        for address in ("resid_post.2", "k.1", "mlp_act.0"):
            assert (out.cache[address][i, :5] - again[address][0, n_prompt:]).abs().max() < 1e-4, address


def test_sampling_is_reproducible_with_a_seed(eager):
    model = eager("llama")
    a = generate(model, PROMPTS, max_new_tokens=8, temperature=1.0, top_k=20, top_p=0.9, seed=7, stop_at_eos=False)
    b = generate(model, PROMPTS, max_new_tokens=8, temperature=1.0, top_k=20, top_p=0.9, seed=7, stop_at_eos=False)
    c = generate(model, PROMPTS, max_new_tokens=8, temperature=1.0, seed=8, stop_at_eos=False)
    assert a.tokens == b.tokens
    assert a.tokens != c.tokens


def test_stop_at_eos_and_edits_at_generated_positions(eager):
    model = eager("llama")
    eos = model.runtime.eos_id
    # Forcing EOS through the logits at every step stops each prompt after one token.
    force = torch.full((model.d_vocab,), -1e4)
    force[eos] = 1e4
    out = generate(model, PROMPTS, S.Set("logits", force), max_new_tokens=5)
    assert out.tokens == ((eos,),) * len(PROMPTS)
    # An index past the prompt lands on a generated token: only the third new token is forced.
    n = len(model.tokenize(PROMPTS[0]))
    out = generate(model, PROMPTS[0], S.Set("logits", force, positions=[n + 1]), max_new_tokens=5, stop_at_eos=False)
    assert out.tokens[0][2] == eos and eos not in out.tokens[0][:2]
