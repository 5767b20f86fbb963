"""How large a call's result will be, from the last one of its kind: the driver takes an arena slot that large
(`arena.py`), or, without one, reserves that much memory for its file while the workers compute
(`results.reserve`), off the worker's path."""

import contextlib

from interp_engine.backends.vllm import results

KINDS = 64  # kinds of call remembered per engine, most recent kept


class ResultSizes:
    """Per engine: bytes per prompt token of the last result file of each kind of prefill call (its spec's
    fingerprint, reads and lens: what sets a row's bytes). A first call of its kind reserves nothing."""

    def __init__(self):
        self._per_token: dict[tuple, float] = {}

    def expect(self, table: dict, tokens: int) -> int:
        """Bytes expected of this call's result (0: none of its kind seen yet)."""
        per = self._per_token.get(_kind(table))
        return 0 if per is None else int(per * tokens)

    def reserve(self, table: dict, tokens: int) -> None:
        if table.get("path") and not table.get("slot") and (per := self._per_token.get(_kind(table))) is not None:
            with contextlib.suppress(OSError):  # best effort: the worker allocates what is not reserved
                results.reserve(table["path"], int(per * tokens))

    def learn(self, table: dict | None, tokens: int, size: int) -> None:
        """A call's result took `size` bytes (`table` None: not a prefill call)."""
        if table is not None and size and tokens:
            kind = _kind(table)
            self._per_token.pop(kind, None)
            self._per_token[kind] = size / tokens
            while len(self._per_token) > KINDS:
                self._per_token.pop(next(iter(self._per_token)))


def _kind(table: dict) -> tuple:
    return table["fingerprint"], tuple(table["reads"]), tuple(table["lens"])
