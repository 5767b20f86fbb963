"""The server's watch on its engine's processes. vLLM's own client marks the engine dead when its core process
exits (its requests then fail with HTTP 500, /health answers 503 and the server stops), but a process that is
stopped (SIGSTOP) or frozen sends no event, and every request would wait on it forever. The watch marks the
engine dead, the same way, once any of its processes has stayed stopped for `life.STOPPED_S`: requests in flight
and later ones get a 5xx within STOPPED_S + TICK_S, /health says 503, and vLLM stops the server (unless
VLLM_KEEP_ALIVE_ON_ENGINE_DEATH is set). A long step of a running process is waited out, as offline."""

import asyncio
import logging
import time

from interp_engine.backends.vllm import compat
from interp_engine.backends.vllm.life import STOPPED_S, TICK_S
from interp_engine.backends.vllm.procs import stopped

log = logging.getLogger(__name__)


async def watch(client, procs: list) -> None:
    """Until the engine is marked dead (by vLLM or here); cancelled when the server stops."""
    since = None
    while not client.errored:
        await asyncio.sleep(TICK_S)
        now = time.monotonic()
        if not stopped(procs):
            since = None
        elif since is None:
            since = now
        elif now - since >= STOPPED_S:
            log.error("interp_engine: an engine process has been stopped (SIGSTOP) for over %.0f s; the engine is "
                      "marked dead: requests fail with HTTP 500 and /health answers 503", STOPPED_S)
            compat.mark_dead(client)
            return
