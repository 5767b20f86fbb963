"""Mixture-of-experts routing as data and as one function: where a family's router sits and how every backend
chooses experts from its logits (re-exported by `interp_engine.arch`)."""

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Moe:
    """A sparse (mixture-of-experts) MLP in every layer: where its router sits and how it chooses.

    The router's first output is the router logits; the experts take the softmax's top k, renormalised to sum
    to 1 where `renormalize` says (a config key, or True for always). `top_k_first`: the router takes the top k
    of the logits and softmaxes those (GPT-OSS): the same weights as the renormalised softmax's top k, not the
    same rounding, and a zero edit must change nothing.

    Gemma 4 (26B-A4B) is all three below: its experts exist only where a config flag says (`enabled_key`), run
    beside a dense MLP whose points stay (`dense_mlp`), and their renormalised weights are multiplied by a learned
    per-expert scale after the choice (`expert_scale`)."""

    router: str  # relative to a layer: the gate module
    n_experts_key: str
    renormalize: str | bool
    top_k_key: str = "num_experts_per_tok"
    top_k_first: bool = False
    experts: str = "mlp.experts"  # relative to a layer: the experts module, forward(rows, top-k ids, top-k weights)
    # DeepSeek-V3: sigmoid scores, chosen within the best groups after the gate's correction bias (`Grouped`).
    grouped: bool = False
    # Layers below this config key's value are dense MLPs (DeepSeek's first_k_dense_replace); None: none is.
    dense_first_key: str | None = None
    enabled_key: str | None = None  # a config flag without which the family's models are dense; None: always
    dense_mlp: bool = False  # every layer also runs a dense MLP beside the experts (mlp_act etc. are its points)
    expert_scale: str | None = None  # relative to a layer: a per-expert scale the chosen weights are multiplied by

    def enabled(self, config) -> bool:
        """Whether this config has the experts (a dense checkpoint of a family that has MoE ones has not)."""
        return self.enabled_key is None or bool(getattr(config, self.enabled_key, False))

    def routing(self, config, gate=None, layer=None) -> tuple:
        """(top k, renormalised, top k first[, Grouped][, per-expert scale]) as this config (and, grouped, the gate
        module's correction bias; scaled, the decoder layer's per-expert scale) sets them: `route`'s arguments
        after the logits."""
        renormalize = self.renormalize if isinstance(self.renormalize, bool) else getattr(config, self.renormalize)
        plain = (getattr(config, self.top_k_key), bool(renormalize), self.top_k_first)
        if self.expert_scale is not None:
            return (*plain, None, layer.get_parameter(self.expert_scale))
        if not self.grouped:
            return plain
        return (*plain, Grouped(config.n_group, config.topk_group, config.routed_scaling_factor,
                                gate.e_score_correction_bias))


@dataclass(frozen=True, slots=True)
class Grouped:
    """DeepSeek-V3's router (noaux_tc): each expert's score is the sigmoid of its logit; the choice adds the
    correction bias, keeps the `topk_group` groups whose two best biased scores sum highest, and takes the top k
    there; the weights are the unbiased scores, renormalised (+1e-20) where the config says, times `scale`."""

    n_group: int
    topk_group: int
    scale: float
    bias: object  # the gate's e_score_correction_bias, [n_experts] float32


def route(logits, top_k: int, renormalize: bool, top_k_first: bool = False, grouped: Grouped | None = None,
          scale=None):
    """(weights, indices) of the chosen experts from router logits, as HF's routers and vLLM's top-k compute them:
    softmax in float32, top k, renormalised to sum to 1 where the family does (or the softmax of the top k
    logits, `top_k_first`; or DeepSeek's grouped sigmoid routing, op for op as HF's), then times the chosen
    experts' entries of `scale` (Gemma 4's per-expert scale, [n_experts]). One semantics for every backend."""
    import torch

    if grouped is not None:
        return _route_grouped(logits, top_k, renormalize, grouped)
    if top_k_first:
        values, indices = torch.topk(logits, top_k, dim=-1)
        return torch.softmax(values, dim=-1, dtype=values.dtype), indices
    weights, indices = torch.topk(torch.softmax(logits, dim=-1, dtype=torch.float), top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if scale is not None:
        weights = weights * scale.to(weights.device)[indices]
    return weights.to(logits.dtype), indices


def _route_grouped(logits, top_k: int, renormalize: bool, g: Grouped):
    import torch

    scores = logits.float().sigmoid()
    choice = scores + g.bias
    n = scores.shape[-1]
    group_scores = choice.view(-1, g.n_group, n // g.n_group).topk(2, dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores, k=g.topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
    score_mask = group_mask.unsqueeze(-1).expand(-1, g.n_group, n // g.n_group).reshape(-1, n)
    choice = choice.masked_fill(~score_mask.bool(), float("-inf"))
    indices = torch.topk(choice, k=top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, indices)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * g.scale, indices


def dense_weights(weights, indices, n_experts: int):
    """expert_weights: every expert's weight in the token's mlp_out, zero where it was not chosen."""
    import torch

    return torch.zeros((*weights.shape[:-1], n_experts), dtype=weights.dtype,
                       device=weights.device).scatter(-1, indices, weights)
