"""An eager model on the CPU keeps freed memory for the next call (`allocator.py`), as a vLLM CPU engine's processes
do: counted as page faults in a fresh process, against the same process before the model was loaded (glibc's own
settings), and a setting the user made stays theirs."""

import json
import os
import subprocess
import sys

from tests.skips import requires

CODE = r"""
import json, resource, sys, torch
from interp_engine import allocator, capture, load_model

def faults():
    # 64 MiB, above the largest threshold glibc adapts to (32 MiB), allocated and freed again and again: the fewest
    # page faults of a round. (The fewest: a small block that glibc happens to place right after the big one can
    # leave the freed block a few bytes short of the next aligned request once.)
    counts = []
    for _ in range(4):
        start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        torch.ones(16 << 20).sum()
        counts.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - start)
    return min(counts[1:])

before = faults()
model = load_model(sys.argv[1], backend="eager", device="cpu", dtype="float32")
capture(model, "a prompt", ["resid_post.0"], progress=False)
print(json.dumps({"before": before, "after": faults(), "made": allocator.apply()}))
"""
PAGES = (64 << 20) // 4096


def _run(folder, **env) -> dict:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    done = subprocess.run([sys.executable, "-c", CODE, str(folder)], env={**environ, **env}, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@requires("glibc")
def test_an_eager_cpu_model_keeps_freed_pages_for_the_next_call(tiny_path):
    seen = _run(tiny_path("llama"))
    assert seen["made"] == ["MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_"]
    assert seen["before"] >= PAGES // 2, seen  # glibc's defaults: the block's pages faulted in again
    assert seen["after"] < PAGES // 20, seen


@requires("glibc")
def test_an_allocator_setting_the_user_made_stays_theirs(tiny_path):
    # The user's mmap threshold (glibc's default value, no longer adapted) maps the block afresh every time.
    seen = _run(tiny_path("llama"), MALLOC_MMAP_THRESHOLD_="131072")
    assert seen["made"] == ["MALLOC_TRIM_THRESHOLD_"]
    assert seen["after"] >= PAGES // 2, seen
    seen = _run(tiny_path("llama"), GLIBC_TUNABLES="glibc.malloc.mmap_threshold=131072")
    assert seen["made"] == ["MALLOC_TRIM_THRESHOLD_"]
    assert seen["after"] >= PAGES // 2, seen
