"""What every backend runtime shares: the tokenizer side, loaded with the handle (no weights needed), and the
default way of capturing a stream of chunks."""

from collections.abc import Iterable, Iterator

import torch

from interp_engine.addresses import Address
from interp_engine.inputs import Prompts
from interp_engine.validate import Plan


class TokenizerRuntime:
    """Text <-> ids with the checkpoint's own tokenizer; BOS handled the same way on every backend."""

    tokenizer = None

    def tokenize(self, text: str, *, prepend_bos: bool = True) -> list[int]:
        ids = list(self.tokenizer(text, add_special_tokens=True)["input_ids"])
        bos = self.tokenizer.bos_token_id
        if bos is not None:
            if prepend_bos and (not ids or ids[0] != bos):
                ids = [bos, *ids]
            elif not prepend_bos and ids and ids[0] == bos:
                ids = ids[1:]
        return ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    @property
    def pad_id(self) -> int:
        for candidate in (self.tokenizer.pad_token_id, self.tokenizer.eos_token_id, 0):
            if candidate is not None:
                return int(candidate)
        return 0

    @property
    def eos_id(self) -> int | None:
        return self.tokenizer.eos_token_id

    def stream(self, chunks: Iterable[tuple[Prompts, Plan]], *, batch_size: int
               ) -> Iterator[tuple[Prompts, dict[Address, torch.Tensor]]]:
        """Capture each chunk's reads, in order, as flat rows: [its total tokens, ...], prompt after prompt
        (what a harvest stores). Here one `forward` per chunk; the vLLM runtime overlaps the chunks."""
        for prompts, plan in chunks:
            _, records = self.forward(prompts, plan, batch_size=batch_size, want_logits=False, progress=False)
            yield prompts, {a: torch.cat([t[:n] for t, n in zip(records[a], prompts.lengths)]) for a in plan.reads}
