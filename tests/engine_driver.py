"""A driver process for tests/test_engine_life.py: `python -m tests.engine_driver MODE MODEL_DIR [N]`.

It loads MODEL_DIR on vllm through its first call, prints `pids <engine pids>`, then `first freed` if that
call's result, once dropped, was freed and its arena slot served the next call (`first held` if not), and then,
by MODE:
- `idle`: waits to be killed (SIGKILL: its engine must not outlive it);
- `interrupts`: captures in a loop; after each Ctrl-C (KeyboardInterrupt) the next capture must equal the solo
  one (prints `ok i` or `bad i`; `error i ...` and the traceback on stderr for anything else raised); after N
  interrupts it shuts down and prints `closed`.
"""

import asyncio
import sys
import time
import weakref

import torch

from interp_engine import capture, load_model

PROMPTS = ["Hello, world! Tell me a story", "Paris is the capital of", "The quick brown fox jumps over the lazy dog."]
POINTS = ["resid_post.0", "mlp_act.1"]


def say(*words) -> None:
    print(*words, flush=True)


def first_call(model) -> str:
    """The call that loads the engine, in a process where vLLM was never imported: its result must die with the
    caller's last reference (vLLM's import once kept the loading call's frames, and so its result, for good)."""
    first = capture(model, PROMPTS[:1], POINTS, progress=False)  # one prompt: its rows are views of its slot
    where, dropped = first[POINTS[0]].untyped_storage().data_ptr(), weakref.ref(first[POINTS[0]])
    del first
    again = capture(model, PROMPTS[:1], POINTS, progress=False)
    return "freed" if dropped() is None and again[POINTS[0]].untyped_storage().data_ptr() == where else "held"


def main(mode: str, folder: str, n: int = 0) -> None:
    model = load_model(folder, backend="vllm")
    first = first_call(model)
    expected = capture(model, PROMPTS, POINTS, progress=False)
    say("pids", *[p.pid for p in model.runtime._procs])
    say("first", first)
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
