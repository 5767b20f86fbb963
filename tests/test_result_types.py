"""Every public function's result is checked by jaxtyping against typing.py's axes, bound to the model's sizes:
a wrongly shaped result is refused with a ResultTypeError (a TypeError) that names the result and the axis."""

import dataclasses
from typing import get_args

import pytest
import torch

from interp_engine import Address, Cache, capture, generate, logit_lens, run_with_grad, steer
from interp_engine import spec as S
from interp_engine.addresses import POINTS
from interp_engine.errors import InterpEngineError, ResultTypeError
from interp_engine.func.generate import Generation
from interp_engine.func.grad import Gradients
from interp_engine.func.shapes import check_result
from interp_engine.typing import AXES, Axis, Logits, activation
from tests.conftest import PROMPTS


def _refused(call, *needles: str) -> str:
    with pytest.raises(ResultTypeError) as info:
        call()
    message = str(info.value)
    assert isinstance(info.value, TypeError) and isinstance(info.value, InterpEngineError)
    assert "\n  Fix: this is a bug in interp_engine" in message
    for needle in needles:
        assert needle in message, message
    return message


class _Skewed:
    """A runtime that answers like the real one, then widens one axis of what it returns by one."""

    def __init__(self, runtime, change):
        self._runtime, self._change = runtime, change

    def __getattr__(self, name):
        return getattr(self._runtime, name)

    def forward(self, *args, **kwargs):
        logits, records = self._runtime.forward(*args, **kwargs)
        return self._change(logits), {a: self._change(t, a) for a, t in records.items()}

    def lens(self, *args, **kwargs):
        return {a: self._change(t) for a, t in self._runtime.lens(*args, **kwargs).items()}

    def forward_with_grad(self, *args, **kwargs):
        value, grads = self._runtime.forward_with_grad(*args, **kwargs)
        return value, {a: self._change(t, a) for a, t in grads.items()}


def _wider(t, address=None):
    return None if t is None else torch.cat([t, t[..., :1]], dim=-1)


def _skewed(model, change=_wider):
    return dataclasses.replace(model, runtime=_Skewed(model.runtime, change))


def test_the_vocabulary_covers_every_point_and_addresses_use_it():
    assert get_args(Axis) == AXES and "layer" in AXES
    for info in POINTS.values():
        assert activation(info.axes).dim_str.split() == list(info.axes)
    assert activation(("batch", "pos", "d_vocab")) is Logits
    with pytest.raises(ValueError, match="not in the vocabulary"):
        activation(("batch", "seq"))


def test_a_cache_with_the_wrong_d_model_is_refused(eager):
    model = eager("llama")
    good = torch.zeros(2, 3, model.d_model)
    check_result(Cache({Address("resid_post", 0): good}, (3, 2), model.n_layers, model.name), Cache, model,
                 what="capture()")
    bad = Cache({Address("resid_post", 0): torch.zeros(2, 3, model.d_model + 1)}, (3, 2), model.n_layers, model.name)
    _refused(lambda: check_result(bad, Cache, model, what="capture()"),
             "capture()['resid_post.0'] came back shaped (2, 3, " + str(model.d_model + 1), "d_model",
             f"d_model={model.d_model}")


def test_a_cache_whose_tensors_disagree_on_batch_or_pattern_sides_is_refused(eager):
    model = eager("llama")
    wrong_batch = Cache({Address("resid_post", 0): torch.zeros(3, 4, model.d_model)}, (4, 4), model.n_layers)
    _refused(lambda: check_result(wrong_batch, Cache, model, what="capture()"), "dimension batch")
    h = model.n_heads
    not_square = Cache({Address("attn_probs", 0): torch.zeros(2, h, 4, 5)}, (4, 4), model.n_layers)
    _refused(lambda: check_result(not_square, Cache, model, what="capture()"), "q_pos == k_pos")
    wrong_heads = Cache({Address("attn_probs", 0): torch.zeros(2, h + 1, 4, 4)}, (4, 4), model.n_layers)
    _refused(lambda: check_result(wrong_heads, Cache, model, what="capture()"), "n_heads")


def test_logits_of_the_wrong_vocab_are_refused(eager):
    model = eager("llama")
    _refused(lambda: check_result(torch.zeros(1, 2, model.d_vocab + 1), Logits, model, what="steer()"),
             "steer() came back shaped (1, 2, " + str(model.d_vocab + 1), "d_vocab")
    _refused(lambda: check_result(torch.zeros(1, 2, model.d_vocab, dtype=torch.long), Logits, model,
                                  what="steer()"), "dtype")


def test_gradients_of_the_wrong_shape_are_refused(eager):
    model = eager("llama")
    grads = Cache({Address("mlp_act", 1): torch.zeros(1, 2, model.d_mlp - 1)}, (2,), model.n_layers)
    _refused(lambda: check_result(Gradients(value=torch.tensor(1.0), grads=grads), Gradients, model,
                                  what="run_with_grad()"), "run_with_grad().grads['mlp_act.1']", "d_mlp")
    fine = Cache({Address("mlp_act", 1): torch.zeros(1, 2, model.d_mlp)}, (2,), model.n_layers)
    _refused(lambda: check_result(Gradients(value=torch.ones(2), grads=fine), Gradients, model,
                                  what="run_with_grad()"), "run_with_grad().value came back shaped (2,)")


def test_a_generation_is_checked_field_by_field(eager):
    model = eager("llama")
    ok = Generation(tokens=((1, 2),), text=("ab",), sequences=torch.zeros(1, 5, dtype=torch.long), lengths=(5,))
    check_result(ok, Generation, model, what="generate()")
    floats = dataclasses.replace(ok, sequences=torch.zeros(1, 5))
    _refused(lambda: check_result(floats, Generation, model, what="generate()"), "generate().sequences")
    cache = Cache({Address("k", 0): torch.zeros(1, 2, model.n_kv_heads + 1, model.d_head)}, (2,), model.n_layers)
    _refused(lambda: check_result(dataclasses.replace(ok, cache=cache), Generation, model, what="generate()"),
             "generate().cache['k.0']", "n_kv_heads")


def test_the_public_functions_refuse_what_a_skewed_backend_returns(eager):
    model = eager("llama", grad=True)
    skewed = _skewed(model)
    _refused(lambda: steer(skewed, PROMPTS[0], S.Spec(), progress=False), "steer()", "d_vocab")
    _refused(lambda: capture(skewed, PROMPTS[0], ["resid_post.0"], progress=False), "capture()['resid_post.0']",
             "d_model")
    _refused(lambda: logit_lens(skewed, PROMPTS[0], progress=False), "logit_lens()", "d_vocab")
    _refused(lambda: run_with_grad(skewed, PROMPTS[0], loss=lambda logits: logits[0, -1, 0], wrt=["z.0"]),
             "run_with_grad().grads['z.0']", "d_head")
    # and what the real backend returns passes the same checks
    assert steer(model, PROMPTS[0], S.Spec(), progress=False).shape[-1] == model.d_vocab
    out = generate(model, PROMPTS[0], max_new_tokens=2, capture=["resid_post.0"], progress=False)
    assert out.cache["resid_post.0"].shape[-1] == model.d_model
