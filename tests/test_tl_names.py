"""TransformerLens hook names: each mapped name parses to our point, `tl_name` spells it back, a capture by TL
name equals one by our name, and a TL name with no equivalent is refused naming the nearest point."""

import dataclasses

import pytest
import torch

from interp_engine import Address, PointError, capture
from interp_engine import spec as S
from interp_engine.addresses import POINTS

MAPPED = {
    "blocks.3.hook_resid_pre": "resid_pre.3",
    "blocks.3.attn.hook_q": "q.3",
    "blocks.3.attn.hook_rot_q": "q.3",
    "blocks.3.attn.hook_k": "k.3",
    "blocks.3.attn.hook_rot_k": "k.3",
    "blocks.3.attn.hook_v": "v.3",
    "blocks.3.attn.hook_z": "z.3",
    "blocks.3.attn.hook_result": "attn_result.3",
    "blocks.3.attn.hook_attn_scores": "attn_scores.3",
    "blocks.3.attn.hook_pattern": "attn_probs.3",
    "blocks.3.hook_attn_out": "attn_out.3",
    "blocks.3.hook_resid_mid": "resid_mid.3",
    "blocks.3.mlp.hook_pre": "mlp_pre.3",
    "blocks.3.mlp.hook_pre_linear": "mlp_pre_linear.3",
    "blocks.3.mlp.hook_post": "mlp_act.3",
    "blocks.3.hook_mlp_out": "mlp_out.3",
    "blocks.3.hook_resid_post": "resid_post.3",
    "blocks.-1.hook_resid_post": "resid_post.-1",
    "hook_embed": "embed",
    "ln_final.hook_normalized": "final",
}


@pytest.mark.parametrize("tl, ours", MAPPED.items())
def test_tl_names_parse_to_our_points(tl, ours):
    address = Address.parse(tl)
    assert address == Address.parse(ours) and str(address) == ours
    assert Address.parse(address.tl_name) == address  # tl_name spells back a name that parses to the same point


def test_every_point_but_logits_and_expert_points_has_a_tl_name():
    for name, info in POINTS.items():
        address = Address(name, 2) if info.layered else Address(name)
        # expert_weights holds every expert's weight; TL's MoE hooks hold the k chosen ones' (its nearest-point
        # list); TL has no hook on each chosen expert's output (expert_out), nor latent attention (kv_latent), nor
        # linear attention (lin_*)
        assert (address.tl_name is None) == (name in ("logits", "expert_weights", "expert_out", "kv_latent")
                                             or name.startswith("lin_")), name
    assert Address("resid_post", 10).tl_name == "blocks.10.hook_resid_post"
    assert Address("q", 1).tl_name == "blocks.1.attn.hook_q" and Address("final").tl_name == "ln_final.hook_normalized"


def test_address_stays_a_frozen_slotted_value():
    address = Address.parse("blocks.2.hook_mlp_out")
    assert not hasattr(address, "__dict__") and repr(address) == "Address('mlp_out', 2)"
    with pytest.raises(dataclasses.FrozenInstanceError):
        address.layer = 3
    assert {address: 1}[Address("mlp_out", 2)] == 1


@pytest.mark.parametrize("tl, nearest", [
    ("blocks.3.ln1.hook_scale", "resid_pre.3"),
    ("blocks.3.ln2.hook_normalized", "resid_mid.3"),
    ("blocks.0.hook_mlp_in", "resid_mid.0"),
    ("hook_pos_embed", "embed"),
    ("ln_final.hook_scale", "final"),
])
def test_tl_names_without_an_equivalent_are_refused_naming_the_nearest_point(tl, nearest):
    with pytest.raises(PointError, match="no equivalent") as e:
        Address.parse(tl)
    assert f"Fix: the nearest point is {nearest} (TL's {Address.parse(nearest).tl_name})" in str(e.value)


def test_misspelled_tl_names_suggest_the_closest_hook_at_the_same_layer():
    with pytest.raises(PointError, match=r"did you mean 'blocks.4.hook_resid_post' \(resid_post.4\)"):
        Address.parse("blocks.4.hook_resid_pots")
    with pytest.raises(PointError, match="Fix:"):
        S.Add("blocks.4.hook_resid_pots", torch.ones(4))


def test_capture_and_specs_take_tl_names(eager):
    model = eager("llama")
    tl = ["blocks.1.hook_resid_post", "blocks.0.attn.hook_pattern", "blocks.2.mlp.hook_post", "hook_embed"]
    ours = ["resid_post.1", "attn_probs.0", "mlp_act.2", "embed"]
    spec_tl = S.Add("blocks.0.hook_resid_mid", torch.ones(model.d_model))
    by_tl = capture(model, ["Paris is the capital of"], tl, spec_tl, progress=False)
    by_ours = capture(model, ["Paris is the capital of"], ours, S.Add("resid_mid.0", torch.ones(model.d_model)),
                      progress=False)
    for a, b in zip(tl, ours):
        assert torch.equal(by_tl[a], by_ours[b])
    assert [str(a) for a in by_tl] == ours  # the cache keys are our spelling
