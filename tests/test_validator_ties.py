"""The validator's near-tie rule (validator/comparison/ties.py) on hand-made router logits and tokens, where the
right answer is known by construction: a choice made otherwise at a near tie cuts its prompt from that position;
one at a wide margin fails; what can follow from a cut choice is not judged again; a greedy token likewise."""

import torch

from validator.comparison import ties as T

K, MARGIN = 2, 0.15


def _logits() -> torch.Tensor:
    """[layer 2, prompt 2, pos 4, experts 4]: eager chooses experts 0 and 1 everywhere, 3.0 and 2.0 over 1.0."""
    t = torch.zeros(2, 2, 4, 4)
    t[..., 0], t[..., 1], t[..., 2] = 3.0, 2.0, 1.0
    return t


def test_a_near_tied_choice_cuts_its_prompt_there_and_what_follows_is_not_judged():
    ref, ours = _logits(), _logits()
    ref[0, 1, 2, 2] = 1.95  # eager: expert 1 over expert 2 by 0.05
    ours[0, 1, 2, 2] = 2.05  # the backend takes expert 2 there
    ours[1, 1, 3, 3] = 9.0  # a later layer, later position, same prompt: can follow from it
    out = T.experts(ours, ref, K, [4, 4], MARGIN)
    assert out.cuts == ((1, 2),) and not out.wide and "margin 0.050" in out.notes[0]
    kept = out.kept(torch.arange(8.0).reshape(2, 4), 1)
    assert kept.tolist() == [0, 1, 2, 3, 4, 5]  # prompt 0 whole, prompt 1 before position 2


def test_a_choice_made_otherwise_at_a_wide_margin_fails_and_padding_is_ignored():
    ref, ours = _logits(), _logits()
    ours[0, 0, 1, 3] = 9.0  # eager's margin there is 1.0
    ours[1, 1, 3, 3] = 9.0  # past prompt 1's length: padding
    out = T.experts(ours, ref, K, [4, 3], MARGIN)
    assert out.wide and "prompt 0 position 1 layer 0" in out.describe() and "above near_tie" in out.describe()
    earlier = _logits()
    earlier[1, 0, 0, 3] = 9.0  # alone at a later layer, following no cut choice: judged on its own
    assert len(T.experts(earlier, ref, K, [4, 4], MARGIN).wide) == 1


def test_expert_out_counts_the_chosen_experts_order_which_other_points_do_not():
    ref, ours = _logits(), _logits()
    ref[0, 0, 1, 1] = 2.95  # eager: expert 0 over expert 1 by 0.05, both chosen
    ours[0, 0, 1, 1] = 3.05  # the backend orders them the other way: the same set
    assert T.experts(ours, ref, K, [4, 4], MARGIN) == T.LeftOut()
    out = T.experts(ours, ref, K, [4, 4], MARGIN, ordered=True)
    assert out.cuts == ((0, 1),) and "in order, eager's margin 0.050" in out.notes[0]
    ours[0, 0, 1, 1], ref[0, 0, 1, 1] = 3.5, 2.0  # swapped at eager's margin of 1.0: fails
    assert T.experts(ours, ref, K, [4, 4], MARGIN, ordered=True).wide


def test_greedy_tokens_are_compared_up_to_a_near_tied_first_difference():
    ref = torch.tensor([[5, 6, 7], [5, 6, 7]])
    margins = torch.tensor([[1.0, 0.1, 1.0], [1.0, 1.0, 1.0]])
    near = T.greedy(torch.tensor([[5, 9, 9], [5, 6, 7]]), ref, margins, MARGIN)
    assert near.cuts == ((0, 1),) and not near.wide
    wide = T.greedy(torch.tensor([[5, 6, 7], [5, 6, 8]]), ref, margins, MARGIN)
    assert wide.wide and not wide.cuts
    assert T.greedy(ref.clone(), ref, margins, MARGIN) == T.LeftOut()


def _generation(ref_router: torch.Tensor, ours_router: torch.Tensor, ours_tokens: list[list[int]],
                margins: list[list[float]]) -> tuple[dict, dict]:
    """One backend's generate results and eager's: 2 prompts, 8 new tokens, router logits [layer, prompt, step, e]."""
    ref = {"generate/tokens": torch.tensor([[5] * 8] * 2), "margins/generate": torch.tensor(margins),
           "ties/generate": ref_router}
    return {"generate/tokens": torch.tensor(ours_tokens), "ties/generate": ours_router}, ref


def _steps() -> torch.Tensor:
    t = torch.zeros(2, 2, 8, 4)
    t[..., 0], t[..., 1], t[..., 2] = 3.0, 2.0, 1.0
    return t


def test_a_near_tied_expert_choice_at_a_generated_step_cuts_captures_there_and_tokens_after_it():
    reference = {"dims": {"top_k": K, "n_layers": 2}, "lengths": [3, 3]}
    ref, ours = _steps(), _steps()
    ref[0, 0, 5, 2], ours[0, 0, 5, 2] = 1.996, 2.1  # step 5 (takes new token 5): eager's margin 0.004
    wide = [1.0] * 8
    wide[6] = 0.156  # new token 6, which step 5 picks: made otherwise at a margin above near_tie
    mine, theirs = _generation(ref, ours, [[5] * 6 + [9, 9], [5] * 8], [wide, [1.0] * 8])
    tokens = T.left_out("generate/tokens", mine, theirs, reference, MARGIN)
    assert tokens.cuts == ((0, 6),) and not tokens.wide and "prompt 0 step 5 layer 0" in tokens.notes[0]
    assert "prompt 0 from new token 6" in tokens.describe()
    captured = T.left_out("generate/resid_post.1", mine, theirs, reference, MARGIN)
    assert captured.cuts == ((0, 5),) and "prompt 0 from step 5" in captured.describe()
    # without the expert choice made otherwise, that greedy token fails
    assert T.left_out("generate/tokens", {**mine, "ties/generate": ref}, theirs, reference, MARGIN).wide


def test_expert_choices_are_judged_up_to_the_first_greedy_token_made_otherwise():
    reference = {"dims": {"top_k": K, "n_layers": 2}, "lengths": [3, 3]}
    ref, ours = _steps(), _steps()
    ours[1, 1, 3, 3] = 9.0  # prompt 1, layer 1, step 3: eager's margin 1.0, but step 3 takes another new token 3
    near = [[1.0] * 8, [1.0, 1.0, 1.0, 0.1, 1.0, 1.0, 1.0, 1.0]]
    mine, theirs = _generation(ref, ours, [[5] * 8, [5, 5, 5, 9, 9, 9, 9, 9]], near)
    out = T.left_out("generate/tokens", mine, theirs, reference, MARGIN)
    assert out.cuts == ((1, 3),) and not out.wide
    ours[1, 1, 2, 3] = 9.0  # step 2: every input still eager's, so a wide margin there fails
    assert "prompt 1 step 2 layer 1" in T.left_out("generate/resid_post.1", mine, theirs, reference, MARGIN).wide[0]
