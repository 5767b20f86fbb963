"""The compiled SAE taps of vllm-static (`static_clamp.ClampTap`, `static_splice.SpliceTap`) run on the CPU against
the eager clamp and splice (checked against HF hooks in test_sae.py), and the SAE memory bound read from the
environment (`INTERP_ENGINE_SAE_BYTES`)."""

import pytest
import torch

from interp_engine import spec as S
from tests.conftest import random_sae


def _active(point, op, rows):
    """A worker's call with one op at `point`, on `rows` of a one-prompt step of len(rows) positions."""
    from interp_engine.backends.vllm.worker import Active, WorkerCall
    from interp_engine.edits import Step

    n = len(rows)
    step = Step(torch.arange(n)[None], torch.tensor([[n - 1]]), torch.tensor([[n]]), torch.zeros(1, n, dtype=torch.long))
    return Active(WorkerCall({point: (op,)}, frozenset()), torch.tensor(rows), step)


def _dims(d: int):
    """The dims sae_taps checks an SAE against: two layers of a d-wide residual stream."""
    from types import SimpleNamespace

    dims = SimpleNamespace(n_layers=2, d_model=d, layer_sizes=())
    dims.at = lambda layer: dims
    return dims


def test_the_compiled_clamp_tap_equals_the_eager_clamp_and_fails_only_a_call_past_its_slots():
    """static_clamp.ClampTap (the body vllm-static traces) on CPU, against SAE.clamped (eager's, checked against
    HF hooks above): relu with b_dec subtracted, jumprelu and a last-position clamp, three calls in one step;
    then a call whose features find no free slot fails alone."""
    from interp_engine.backends.vllm.static_clamp import ClampTap
    from interp_engine.taps import CLAMP_SLOTS

    d, point = 16, S.Address("resid_post", 1)
    saes = (random_sae(d, 1, 5, apply_b_dec_to_input=True),
            random_sae(d, 1, 6, activation="jumprelu", threshold=torch.full((4 * d,), 0.1)))
    ops = (S.Clamp(saes[0], [3, 7], to=4.0), S.Clamp(saes[1], [7, 9], to=-2.0),
           S.Clamp(saes[0], [7], to=9.0, positions=[-1]))
    x = torch.randn(9, d, generator=torch.Generator().manual_seed(0))

    def active(op, rows):
        return _active(point, op, rows)

    calls = [active(op, rows) for op, rows in zip(ops, ([0, 1, 2], [3, 4, 5, 6], [7, 8]))]
    tap = ClampTap(16, d, "cpu")
    assert tap.fill(calls, point)
    out = tap(x)
    assert not torch.allclose(out, x, atol=1e-3)
    expected = torch.cat([saes[0].clamped(x[:3], (3, 7), 4.0), saes[1].clamped(x[3:7], (7, 9), -2.0),
                          x[7:8], saes[0].clamped(x[8:], (7,), 9.0)])
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    tap.reset(16)
    assert torch.equal(tap(x), x), "rows of calls that clamp nothing pass unchanged"
    assert tap.fill(calls, point)  # the next step: the slots already hold these features
    torch.testing.assert_close(tap(x), expected, rtol=1e-5, atol=1e-5)
    tap.reset(16)

    two = [random_sae(d, 1, seed) for seed in (7, 8)]  # 40 features of each: 80 distinct pairs
    many = [active(S.Clamp(sae, list(range(40)), to=1.0), [i]) for i, sae in enumerate(two)]
    assert tap.fill(many, point)
    assert many[0].call.error == "" and f"more than {CLAMP_SLOTS} distinct features" in many[1].call.error
    torch.testing.assert_close(tap(x)[:2], torch.cat([two[0].clamped(x[:1], tuple(range(40)), 1.0), x[1:2]]),
                               rtol=1e-5, atol=1e-5)


def test_the_compiled_splice_tap_equals_the_eager_splice_and_leaves_other_rows_bit_identical():
    """static_splice.SpliceTap (the body vllm-static traces) on CPU, from the SAEs' declarations as the worker gets
    them, against SAE.spliced (eager's, checked against HF hooks above): relu with b_dec subtracted, jumprelu, and
    topk with input normalisation; error=False, error=True and a last-position splice in one step; rows of calls
    that splice nothing are x itself, bit for bit."""
    from interp_engine.backends.vllm.static_splice import SpliceTap
    from interp_engine.sae import KEPT
    from interp_engine.sae_taps import declared_saes

    d, point = 16, S.Address("resid_post", 1)
    saes = (random_sae(d, 1, 5, apply_b_dec_to_input=True),
            random_sae(d, 1, 6, activation="jumprelu", threshold=torch.full((4 * d,), 0.1)),
            random_sae(d, 1, 7, activation="topk", k=5, normalize="constant_norm_rescale"))
    _, _, declared = declared_saes([S.Splice(sae) for sae in saes], _dims(d))
    ops = (S.Splice(saes[0]), S.Splice(saes[1], error=True), S.Splice(saes[2], positions=[-1]),
           S.Splice(saes[2], error=True))
    x = torch.randn(12, d, generator=torch.Generator().manual_seed(0)) * 3

    def active(op, rows):
        return _active(point, op, rows)

    KEPT.update({sae.key: sae for sae in saes})  # as the worker keeps what the driver sent (sae_refs.py)
    try:
        calls = [active(op, rows) for op, rows in zip(ops, ([0, 1, 2], [3, 4], [5, 6, 7], [8, 9]))]
        tap = SpliceTap(declared, 16, "cpu")
        tap.fill(calls, point)
        out = tap(x)
        expected = torch.cat([saes[0].spliced(x[:3], False), saes[1].spliced(x[3:5], True), x[5:7],
                              saes[2].spliced(x[7:8], False), saes[2].spliced(x[8:10], True), x[10:]])
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
        assert not torch.allclose(out[:3], x[:3], atol=1e-2), "error=False must change the rows"
        assert torch.equal(out[5:7], x[5:7]) and torch.equal(out[10:], x[10:]), "rows not spliced are x"
        tap.reset(16)
        assert torch.equal(tap(x), x), "rows of calls that splice nothing pass unchanged"
        assert all(not c.call.error for c in calls)
    finally:
        for sae in saes:
            KEPT.pop(sae.key, None)


def test_compiled_clamps_of_topk_and_normalised_saes_equal_the_eager_clamp_beside_splices():
    """The splice tap's clamps (SAEs whose features need the whole encode: topk with constant_norm_rescale, relu
    with layer_norm; declared bare, as a user declares clamps), in one step with a splice of the same SAE and a
    plain call, against SAE.clamped (eager's, checked against HF hooks below); a call past one SAE's slots fails
    alone."""
    from interp_engine.backends.vllm.static_splice import SpliceTap
    from interp_engine.sae import KEPT
    from interp_engine.sae_taps import declared_saes
    from interp_engine.taps import CLAMP_SLOTS

    d, point = 32, S.Address("resid_post", 1)  # 128 features: two calls of 40 each find no 64 slots
    saes = (random_sae(d, 1, 7, activation="topk", k=5, normalize="constant_norm_rescale"),
            random_sae(d, 1, 8, normalize="layer_norm", apply_b_dec_to_input=True))
    writes, clamps, declared = declared_saes(["resid_post.1", *saes], _dims(d))
    assert writes == ["resid_post.1"] and clamps == (point, point) and [s.key for s in declared] == [s.key for s in saes]
    ops = (S.Clamp(saes[0], [1, 4], to=6.0), S.Splice(saes[0]), S.Clamp(saes[1], [2], to=-3.0, positions=[-1]),
           S.Clamp(saes[1], [2, 9], to=0.0))
    x = torch.randn(14, d, generator=torch.Generator().manual_seed(0)) * 3
    KEPT.update({sae.key: sae for sae in saes})
    try:
        calls = [_active(point, op, rows) for op, rows in zip(ops, ([0, 1, 2], [3, 4], [5, 6, 7], [8, 9]))]
        tap = SpliceTap(declared, 16, "cpu")
        tap.fill(calls, point)
        out = tap(x)
        expected = torch.cat([saes[0].clamped(x[:3], (1, 4), 6.0), saes[0].spliced(x[3:5], False), x[5:7],
                              saes[1].clamped(x[7:8], (2,), -3.0), saes[1].clamped(x[8:10], (2, 9), 0.0), x[10:]])
        assert not torch.allclose(out[:3], x[:3], atol=1e-2) and not torch.allclose(out[7:10], x[7:10], atol=1e-2)
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
        assert torch.equal(out[5:7], x[5:7]) and torch.equal(out[10:], x[10:]), "rows that edit nothing are x"
        tap.reset(16)
        assert torch.equal(tap(x), x), "rows of calls that clamp nothing pass unchanged"
        tap.fill(calls, point)  # the next step: the slots already hold these features
        torch.testing.assert_close(tap(x), expected, rtol=1e-5, atol=1e-5)
        tap.reset(16)
        assert all(not c.call.error for c in calls)
        many = [_active(point, S.Clamp(saes[0], list(range(i * 40, i * 40 + 40)), to=1.0), [i]) for i in (0, 1)]
        tap.fill(many, point)
        assert many[0].call.error == "" and f"more than {CLAMP_SLOTS} distinct features" in many[1].call.error
        torch.testing.assert_close(tap(x)[:2], torch.cat([saes[0].clamped(x[:1], tuple(range(40)), 1.0), x[1:2]]),
                                   rtol=1e-5, atol=1e-5)
    finally:
        for sae in saes:
            KEPT.pop(sae.key, None)


@pytest.mark.parametrize("raw", ["-1", "0", "abc", "1e9", "4GiB", " 8", "9" * 400 + "x"])
def test_a_hostile_sae_bound_is_refused_with_the_fix(raw, monkeypatch):
    """INTERP_ENGINE_SAE_BYTES, read at each call that uses an SAE: anything but whole positive bytes is refused
    before anything is sent, naming the variable."""
    from interp_engine.backends.vllm import sae_refs
    from interp_engine.errors import SpecError

    monkeypatch.setenv(sae_refs.BOUND_ENV, raw)
    with pytest.raises(SpecError, match="INTERP_ENGINE_SAE_BYTES") as caught:
        sae_refs.bound()
    assert "Fix:" in str(caught.value)
    monkeypatch.setenv(sae_refs.BOUND_ENV, str(3 << 20))
    assert sae_refs.bound() == 3 << 20
