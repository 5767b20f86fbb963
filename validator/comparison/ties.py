"""Near ties: where a backend may leave eager's path, because rounding decides a choice eager made by less than
the family's `near_tie` margin (tolerances.py; today Qwen3-Next in bfloat16).

Two choices are discrete: the experts a token takes (the top k of its router logits) and a greedy token (the top
logit). Where a backend's choice at a position differs from eager's, that position and every later one of the
prompt follow from the other choice (a causal model: earlier positions cannot), so no tolerance compares them:
the prompt is compared up to that position, and the row names where and by how little eager chose, if eager's
margin there is within `near_tie`. A choice made otherwise at a wider margin is a failure. A difference that can
follow from an earlier cut choice (a later layer, at or after its position) is not judged again.

Generation makes both, one step after another: captured step j is the forward that takes new token j and picks
token j + 1. Until the first greedy token made otherwise, every step's inputs are eager's, so an expert choice made
otherwise at step j is a first difference like one at a prompt position: it cuts the captures from step j and the
tokens from new token j + 1, and a greedy token made otherwise there or later is not judged again.
"""

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class LeftOut:
    cuts: tuple[tuple[int, int], ...] = ()  # (prompt, first position left out)
    notes: tuple[str, ...] = ()  # each near-tied choice made otherwise
    wide: tuple[str, ...] = ()  # choices made otherwise where eager's margin was wider: the row fails
    unit: str = "position"  # what a cut counts: positions, generated steps or new tokens

    def describe(self) -> str:
        if self.wide:
            return "other choice than eager's at a margin above near_tie: " + "; ".join(self.wide)
        cut = ", ".join(f"prompt {p} from {self.unit} {t}" for p, t in self.cuts)
        return f"left out ({cut}) after near-tied choices: " + "; ".join(self.notes)

    def kept(self, t: torch.Tensor, pos_axis: int) -> torch.Tensor:
        """The entries of `t` ([prompt, ...], positions along `pos_axis`) before each prompt's cut, flattened."""
        cut = dict(self.cuts)
        return torch.cat([row.narrow(pos_axis - 1, 0, min(cut.get(p, row.shape[pos_axis - 1]),
                                                           row.shape[pos_axis - 1])).reshape(-1)
                          for p, row in enumerate(t)])


def left_out(key: str, ours: dict, refs: dict, reference: dict, margin: float) -> LeftOut:
    """The prompts left out of the comparison of result `key` (a dict of one backend's results)."""
    kind = key.partition("/")[0]
    if kind == "generate":
        return generated(key, ours, refs, reference["dims"]["top_k"], margin)
    if kind in ("steer", "route"):  # the router logits of that edited forward
        mine, theirs = ours.get(f"ties/{key}"), refs.get(f"ties/{key}")
    else:  # captures and the logit lens: the unedited forward's
        mine, theirs = (_stacked(r, reference["dims"]["n_layers"]) for r in (ours, refs))
    if mine is None or theirs is None or mine.shape != theirs.shape:
        return LeftOut()
    # expert_out's slots are the chosen experts in weight order: there a near tie between two chosen ones swaps two
    # slots, though the set (and everything computed from it) is the same
    ordered = key.startswith("capture/expert_out.")
    return experts(mine, theirs, reference["dims"]["top_k"], reference["lengths"], margin, ordered)


def _stacked(results: dict, n_layers: int) -> torch.Tensor | None:
    layers = [results.get(f"capture/router_logits.{i}") for i in range(n_layers)]
    return torch.stack(layers) if all(isinstance(t, torch.Tensor) for t in layers) else None


def experts(ours: torch.Tensor, ref: torch.Tensor, k: int, lengths: list[int], margin: float,
            ordered: bool = False, unit: str = "position") -> LeftOut:
    """ours, ref: [layer, prompt, pos, n_experts] router logits. `ordered`: the chosen experts' order counts too
    (eager's margin is then the least gap among the top k + 1). `unit`: what a position is called (a generated
    step)."""
    ref = ref.float()
    chosen = [t.float().topk(k, dim=-1).indices for t in (ours, ref)]
    chosen = chosen if ordered else [c.sort(-1).values for c in chosen]
    differ = (chosen[0] != chosen[1]).any(-1).nonzero().tolist()
    causes: dict[int, list[tuple[int, int]]] = {}
    notes, wide = [], []
    for layer, prompt, pos in sorted(differ):
        if pos >= lengths[prompt] or any(l < layer and t <= pos for l, t in causes.get(prompt, ())):
            continue
        top = ref[layer, prompt, pos].sort(descending=True).values
        gap = float((top[:k] - top[1:k + 1]).min() if ordered else top[k - 1] - top[k])
        note = f"prompt {prompt} {unit} {pos} layer {layer}: experts{' in order' if ordered else ''}, " \
               f"eager's margin {gap:.3f}"
        if gap <= margin:
            causes.setdefault(prompt, []).append((layer, pos))
            notes.append(note)
        else:
            wide.append(note)
    cuts = tuple((p, min(t for _, t in c)) for p, c in sorted(causes.items()))
    return LeftOut(cuts, tuple(notes), tuple(wide), unit)


def generated(key: str, ours: dict, refs: dict, k: int, margin: float) -> LeftOut:
    """Generation's result `key`: the experts chosen at each step ("ties/generate": [layer, prompt, step, n_experts]
    router logits, MoE only), judged up to each prompt's first greedy token made otherwise, then that token where
    no expert choice cut its prompt before it."""
    tokens = [r.get("generate/tokens") for r in (ours, refs)]
    if not all(isinstance(t, torch.Tensor) for t in tokens) or tokens[0].shape != tokens[1].shape:
        return LeftOut()
    same = [next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
            for a, b in zip(*(t.tolist() for t in tokens))]
    routers = [r.get("ties/generate") for r in (ours, refs)]
    moved = experts(*routers, k, same, margin, unit="step") \
        if all(isinstance(t, torch.Tensor) for t in routers) and routers[0].shape == routers[1].shape else LeftOut()
    chose = greedy(*tokens, refs.get("margins/generate"), margin, skip={p for p, _ in moved.cuts})
    after = int(key == "generate/tokens")  # the token step j picks is new token j + 1
    return LeftOut(tuple(sorted([(p, j + after) for p, j in moved.cuts] + list(chose.cuts))),
                   moved.notes + chose.notes, moved.wide + chose.wide, "new token" if after else "step")


def greedy(ours, ref, margins, margin: float, skip: frozenset[int] | set[int] = frozenset()) -> LeftOut:
    """ours, ref: [prompt, new token] greedy tokens; margins: eager's top-two logit gap at each (worker.py).
    `skip`: prompts not judged (cut before their first token made otherwise)."""
    if not all(isinstance(t, torch.Tensor) for t in (ours, ref, margins)) or ours.shape != ref.shape:
        return LeftOut()
    cuts, notes, wide = [], [], []
    for prompt, (a, b) in enumerate(zip(ours.tolist(), ref.tolist())):
        first = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if first is None or prompt in skip:
            continue
        gap = float(margins[prompt, first])
        note = f"prompt {prompt} new token {first}: greedy token, eager's margin {gap:.3f}"
        if gap <= margin:
            cuts.append((prompt, first))
            notes.append(note)
        else:
            wide.append(note)
    return LeftOut(tuple(cuts), tuple(notes), tuple(wide))
