"""Lifecycle soak, short: 3 load / capture / shutdown cycles on vLLM with no growth in child processes, file
descriptors or resident memory beyond the bounds stated (and justified) in benchmarks/soak.py, which runs 20."""

from benchmarks.soak import FD_SLACK, RSS_SLACK_MB, check, soak
from tests.skips import requires

CYCLES = 3


@requires("vllm")
def test_load_capture_shutdown_cycles_leak_nothing(tiny_path):
    rows = soak(str(tiny_path("llama")), CYCLES, log=lambda line: print(f"[soak] {line}"))
    first, last = rows[0], rows[-1]
    print(f"[soak] {CYCLES} cycles: children {[r['children'] for r in rows]}, fds {first['fds']}->{last['fds']} "
          f"(bound +{FD_SLACK}), RSS {first['rss_mb']}->{last['rss_mb']} MB (bound +{RSS_SLACK_MB})")
    assert check(rows) == []
