"""Generation on the eager backend: a KV-cached loop whose every forward carries the call's edits.

Prompts are left-padded within a chunk; each column knows its position in its own prompt, so positions in a
spec mean the same thing here as in capture/steer. Edits to k/v are written into the KV cache, so later steps
attend to the edited keys and values exactly as a full re-run would.
"""

import torch
from torch import Tensor

from interp_engine.edits import Step
from interp_engine.errors import SpecError, fix
from interp_engine.backends.eager.run import Run
from interp_engine.inputs import Prompts
from interp_engine.progress import bar
from interp_engine.validate import Plan


def pick(logits: Tensor, *, temperature: float, top_k: int | None, top_p: float | None,
         generator: torch.Generator | None) -> Tensor:
    """Next token per row: argmax at temperature 0, else a sample after top-k / top-p filtering."""
    if temperature == 0:
        return logits.argmax(-1)
    scores = logits.float() / temperature
    if top_k is not None:
        kth = torch.topk(scores, min(top_k, scores.shape[-1])).values[:, -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p is not None:
        ordered, order = torch.sort(scores, descending=True)
        cumulative = torch.softmax(ordered, -1).cumsum(-1)
        drop = cumulative - torch.softmax(ordered, -1) > top_p  # keep the smallest set reaching top_p
        scores = scores.scatter(-1, order, ordered.masked_fill(drop, float("-inf")))
    probs = torch.softmax(scores, -1)
    if not bool(torch.isfinite(probs).all()):  # torch.multinomial's own error would name neither cause nor fix
        raise SpecError(fix("the logits are NaN or infinite, so no token can be sampled: an edit made the "
                            "activations overflow (a large factor, scale or vector).",
                            "use smaller numbers in the spec, or temperature=0 (argmax) to see what it does."))
    return torch.multinomial(probs, 1, generator=generator)[:, 0]


def decode(rt, prompts: Prompts, plan: Plan, *, max_new_tokens: int, temperature: float, top_k: int | None,
           top_p: float | None, seed: int | None, stop_at_eos: bool, batch_size: int, progress: bool):
    """Returns (new tokens per prompt, {address: [n_prompts, max_new, ...]} of generated positions)."""
    from transformers import DynamicCache

    model = rt.load()
    generator = None
    if temperature > 0:
        generator = torch.Generator(device=rt.device)
        generator.manual_seed(seed if seed is not None else torch.seed())
    new_tokens: list[list[int]] = []
    record_parts: dict = {a: [] for a in plan.reads}
    chunks = prompts.chunks(batch_size)
    sample = dict(temperature=temperature, top_k=top_k, top_p=top_p, generator=generator)
    # Counted in generation steps, so one long prompt shows its progress too.
    steps_bar = bar(total=len(chunks) * max_new_tokens, desc="generate", unit="tok", progress=progress)
    with torch.inference_mode(), steps_bar:
        for done, rows in enumerate(chunks, 1):
            lengths = torch.tensor([len(prompts.ids[i]) for i in rows], dtype=torch.long)
            width = int(lengths.max())
            ids = torch.full((len(rows), width), rt.pad_id, dtype=torch.long)
            mask = torch.zeros((len(rows), width), dtype=torch.long)
            for r, i in enumerate(rows):
                n = len(prompts.ids[i])
                ids[r, width - n:] = torch.tensor(prompts.ids[i])
                mask[r, width - n:] = 1
            abs_pos = torch.arange(width)[None, :] - (width - lengths)[:, None]
            abs_pos = abs_pos.masked_fill(abs_pos < 0, -1)
            index = torch.tensor(list(rows), dtype=torch.long)
            cache = DynamicCache(config=model.config)
            run = Run(plan.ops, frozenset())  # prompt positions are not "generated": read nothing in prefill
            step = Step.of_rows(abs_pos, last=lengths - 1, lengths=lengths, prompt_index=index, kv_in_place=True)
            logits = rt._forward(ids, step, run, attention_mask=mask.to(rt.device),
                                 position_ids=abs_pos.clamp_min(0).to(rt.device), past_key_values=cache, use_cache=True)
            run = Run(plan.ops, frozenset(plan.reads))
            chosen = [[] for _ in rows]
            active = torch.ones(len(rows), dtype=torch.bool)
            current = lengths.clone()
            fed_rows: list[Tensor] = []
            for t in range(max_new_tokens):
                token = pick(logits[:, -1], **sample).cpu()
                steps_bar.update(1)
                for r in range(len(rows)):
                    if active[r]:
                        chosen[r].append(int(token[r]))
                        if stop_at_eos and rt.eos_id is not None and int(token[r]) == rt.eos_id:
                            active[r] = False
                last_step = t == max_new_tokens - 1 or not bool(active.any())
                if last_step and not plan.reads:
                    break
                # Rows that stopped before this token feed padding, flagged -1 so no edit touches them.
                fed = torch.tensor([len(c) > t for c in chosen])
                feed = torch.where(fed, token, torch.full_like(token, rt.pad_id))
                pos = torch.where(fed, current, torch.full_like(current, -1))
                mask = torch.cat([mask, fed[:, None].long()], dim=1)
                step = Step.of_rows(pos[:, None], last=current, lengths=lengths, prompt_index=index, kv_in_place=True)
                logits = rt._forward(feed[:, None], step, run, attention_mask=mask.to(rt.device),
                                     position_ids=current[:, None].to(rt.device), past_key_values=cache,
                                     use_cache=True)
                fed_rows.append(fed)
                current = current + 1
                if last_step:
                    break
            steps_bar.update(done * max_new_tokens - steps_bar.n)  # the steps an early stop skipped
            new_tokens += chosen
            steps = max((len(c) for c in chosen), default=0)
            for address, parts in record_parts.items():
                seen = run.records.get(address, [])
                if not seen:
                    continue
                t = torch.cat(seen, dim=1)
                keep = torch.stack(fed_rows, dim=1).to(t.device)
                t = torch.where(keep.reshape(*keep.shape, *([1] * (t.ndim - 2))), t, torch.zeros((), dtype=t.dtype,
                                                                                               device=t.device))
                parts.append(t[:, :steps])
    width = max((len(c) for c in new_tokens), default=0)
    records = {}
    for address, parts in record_parts.items():
        padded = [torch.nn.functional.pad(p, (*([0, 0] * (p.ndim - 2)), 0, width - p.shape[1])) for p in parts]
        records[address] = torch.cat(padded)
    return new_tokens, records
