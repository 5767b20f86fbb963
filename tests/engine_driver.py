"""A driver process for tests/test_engine_life.py: `python -m tests.engine_driver MODE MODEL_DIR [N]`.

It loads MODEL_DIR on vllm, prints `pids <engine pids>` and then, by MODE:
- `idle`: waits to be killed (SIGKILL: its engine must not outlive it);
- `interrupts`: captures in a loop; after each Ctrl-C (KeyboardInterrupt) the next capture must equal the solo
  one (prints `ok i` or `bad i`; `error i ...` and the traceback on stderr for anything else raised); after N
  interrupts it shuts down and prints `closed`.
"""

import asyncio
import sys
import time

import torch

from interp_engine import capture, load_model

PROMPTS = ["Hello, world! Tell me a story", "Paris is the capital of", "The quick brown fox jumps over the lazy dog."]
POINTS = ["resid_post.0", "mlp_act.1"]


def say(*words) -> None:
    print(*words, flush=True)


def main(mode: str, folder: str, n: int = 0) -> None:
    model = load_model(folder, backend="vllm")
    expected = capture(model, PROMPTS, POINTS, progress=False)
    say("pids", *[p.pid for p in model.runtime._procs])
    if mode == "idle":
        while True:
            time.sleep(3600)
    done = 0
    while done < n:
        try:
            say("go", done)
            while True:
                capture(model, PROMPTS * 16, POINTS, progress=False)  # 48 sends a call: Ctrl-C lands in some
        except KeyboardInterrupt:
            pass
        except Exception as e:  # anything but the interrupt is a failure the test must name
            say("error", done, type(e).__name__, *str(e).split()[:40])
            raise
        try:
            got = capture(model, PROMPTS, POINTS, progress=False)
        except BaseException as e:
            say("error", done, "after the interrupt:", type(e).__name__, *str(e).split()[:40])
            raise
        same = all(torch.equal(got[k], expected[k]) for k in expected)
        same = same and model.runtime.llm.llm_engine.get_num_unfinished_requests() == 0
        say("ok" if same else "bad", done)
        done += 1
    asyncio.run(model.shutdown())
    say("closed")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], *[int(a) for a in sys.argv[3:]])
