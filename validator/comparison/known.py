"""Library discrepancies the validator has found and that are not fixed yet, each with its cause.

A failing row that matches an entry is reported as `known` (listed first in the report, not counted as a
failure), so CI stays green while the issue stays visible; an entry that no longer fails is reported too, so it
gets removed. Add an entry only with a cause and an owner's issue, never to silence a new failure.
"""

from dataclasses import dataclass

from validator.comparison.compare import Row


@dataclass(frozen=True, slots=True)
class Known:
    backend: str  # prefix: "vllm" matches vllm and vllm-static
    kind: str  # "*": any
    op: str  # "*": any
    point: str  # "*": any
    reason: str
    models: tuple[str, ...] = ()  # (): any
    num_gpus: int | None = None  # None: any

    def matches(self, row: Row) -> bool:
        return (row.backend.startswith(self.backend) and (not self.models or row.model in self.models)
                and self.num_gpus in (None, row.num_gpus)
                and all(want in ("*", got) for want, got in ((self.kind, row.kind), (self.op, row.op),
                                                             (self.point, row.point))))


KNOWN: tuple[Known, ...] = (
)


def classify(rows: list[Row]) -> tuple[list[Row], list[str]]:
    """Rows with known failures marked `known`; and the known entries that matched rows but no longer fail."""
    from dataclasses import replace

    out, fixed = [], set()
    for row in rows:
        entry = next((k for k in KNOWN if k.matches(row)), None)
        if entry is not None and row.status == "fail":
            row = replace(row, status="known", message=f"known issue: {entry.reason} [{row.message}]".strip())
        elif entry is not None and row.status == "pass":
            fixed.add(f"{entry.backend} {entry.kind} {entry.op} {entry.point}")
        out.append(row)
    still = {f"{k.backend} {k.kind} {k.op} {k.point}" for k in KNOWN
             for r in out if r.status == "known" and k.matches(r)}
    return out, sorted(fixed - still)
