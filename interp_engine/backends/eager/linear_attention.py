"""Linear-attention (Gated DeltaNet) points on eager: q, k, v, beta and g where HF's delta rule receives them,
the output gate z and the rule's output where the gated norm receives them (arch/qwen3_next.py says what each
point is).

HF's Gated DeltaNet forward computes q, k, v (after its short convolution), beta and g in local variables no
module hook reaches, and hands them to a module-level delta-rule function (chunked for a prompt, recurrent for a
cached decode step), passing its own **kwargs along. `register` wraps those functions once per modeling module:
with no site in the kwargs the wrapper calls HF's function as it was, so an un-hooked forward computes exactly
what HF computes. A site is put in the layer's kwargs per call by a pre-hook on the `linear_attn` module (as the
attention site is, backends/eager/attention.py) and removed with it.
"""

import functools
import sys

from torch import Tensor

SITE_KW = "interp_engine_linear_site"
_RULES = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule")


def _wrap(rule):
    @functools.wraps(rule)
    def wrapped(query, key, value, *args, **kwargs):
        site = kwargs.pop(SITE_KW, None)
        if site is None:
            return rule(query, key, value, *args, **kwargs)
        query, key, value, kwargs["g"], kwargs["beta"] = site.enter(query, key, value, kwargs["g"], kwargs["beta"])
        return rule(query, key, value, *args, **kwargs)

    wrapped.interp_engine_wrapped = True
    return wrapped


def register(model) -> None:
    """Idempotent: wrap the delta-rule functions of every modeling module whose Gated DeltaNet `model` has."""
    for module in {sys.modules[type(m).__module__] for m in model.modules() if type(m).__name__.endswith("GatedDeltaNet")}:
        for name in _RULES:
            rule = getattr(module, name, None)
            if rule is None:
                raise RuntimeError(f"internal: {module.__name__} has no {name}; transformers changed its Gated "
                                   "DeltaNet (arch/qwen3_next.py's points are read at that function's call)")
            if not getattr(rule, "interp_engine_wrapped", False):
                setattr(module, name, _wrap(rule))


class LinearSite:
    """One linear-attention layer's points in one call; `run` is the call's sites.Run, `at` its addresses."""

    def __init__(self, run, at, rep: int):
        self.run, self.at, self.rep = run, at, rep  # rep: value heads per key head
        self.rows: tuple[int, ...] = ()

    def pre_hook(self, module, args, kwargs):
        """On the linear_attn module: put the site in its kwargs; remember the rows' (batch, pos)."""
        hidden = args[0] if args else kwargs["hidden_states"]
        self.rows = tuple(hidden.shape[:2])
        return args, {**kwargs, SITE_KW: self}

    def _per_key_head(self, point: str, x: Tensor) -> Tensor:
        # HF repeats each key head for the value heads it serves before the rule; the point is the key head's own.
        if not self.run.wants(self.at(point)):
            return x
        own = x[:, :, ::self.rep] if self.rep > 1 else x
        edited = self.run.touch(self.at(point), own)
        if edited is own:
            return x
        return edited.repeat_interleave(self.rep, dim=2) if self.rep > 1 else edited

    def enter(self, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor) -> tuple[Tensor, ...]:
        run, at = self.run, self.at
        q, k = self._per_key_head("lin_q", q), self._per_key_head("lin_k", k)
        return q, k, run.touch(at("lin_v"), v), run.touch(at("lin_g"), g), run.touch(at("lin_beta"), beta)

    def norm_hook(self, module, args):
        """On the gated norm, called as norm(out, z) with both flattened to one row per (batch, pos, head)."""
        out, z = args[0], args[1]
        shape = (*self.rows, -1, out.shape[-1])
        new_out = self.run.touch(self.at("lin_out"), out.reshape(shape)).reshape(out.shape)
        new_z = self.run.touch(self.at("lin_z"), z.reshape(shape)).reshape(z.shape)
        return (new_out, new_z, *args[2:])
