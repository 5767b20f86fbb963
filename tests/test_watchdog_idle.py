"""What the watchdog counts as an idle engine (procs.demand_seconds, life.IDLE_S).

A probe left unanswered while the engine's processes sit idle is a dead input loop. Counting CPU time alone, an
engine starved of its core (niced, on a loaded machine) looked idle and was declared dead mid-step: the validator
saw it at load 25-30 on 2 cores. Waiting on the run queue now counts as busy; only sleeping counts as idle.
"""

import os
import subprocess
import sys
import time

import psutil

from interp_engine.backends.vllm import life
from interp_engine.backends.vllm.procs import demand_seconds

CORE = min(os.sched_getaffinity(0))
SPIN = f"import os\nos.sched_setaffinity(0, {{{CORE}}})\nwhile True:\n    pass\n"
WINDOW_S = 2.0


def _cpu(process: psutil.Process) -> float:
    times = process.cpu_times()
    return times.user + times.system


def test_a_process_starved_of_its_core_counts_as_busy_and_a_sleeping_one_as_idle():
    hog = subprocess.Popen([sys.executable, "-c", SPIN])
    starved = subprocess.Popen([sys.executable, "-c", "import os\nos.nice(19)\n" + SPIN])  # one core, shared
    sleeper = subprocess.Popen([sys.executable, "-c", "import time\ntime.sleep(60)"])
    try:
        time.sleep(0.5)
        watched = {name: psutil.Process(p.pid) for name, p in
                   (("starved", starved), ("sleeper", sleeper))}
        before = {name: (demand_seconds([p]), _cpu(p)) for name, p in watched.items()}
        time.sleep(WINDOW_S)
        after = {name: (demand_seconds([p]), _cpu(p)) for name, p in watched.items()}
    finally:
        for process in (hog, starved, sleeper):
            process.kill()
            process.wait()
    demand, cpu = (after["starved"][i] - before["starved"][i] for i in (0, 1))
    print(f"\n[watchdog] over {WINDOW_S} s a starved process ran {cpu:.3f} s and ran or waited {demand:.3f} s")
    assert cpu < 0.1 * WINDOW_S  # CPU time alone calls it idle
    assert demand > max(0.75 * WINDOW_S, life.IDLE_S * WINDOW_S / life.PROTOCOL_S)  # runnable throughout: busy
    assert after["sleeper"][0] - before["sleeper"][0] < 0.05 * WINDOW_S
