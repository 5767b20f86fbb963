"""One call's requests in a vLLM engine, as the driver tracks them (`runtime.py`)."""

import dataclasses
from typing import Any

from interp_engine.backends.vllm.life import EngineLife


@dataclasses.dataclass
class CallRequests:
    """One call's requests in the engine: their ids (ours, `wire.request_id`), those not finished yet, and the
    outputs of those that finished. Whichever thread is stepping the engine hands each output to its call."""

    call: str
    ids: list[str] = dataclasses.field(default_factory=list)
    waiting: set[str] = dataclasses.field(default_factory=set)
    outputs: dict[str, Any] = dataclasses.field(default_factory=dict)
    life: EngineLife | None = None  # the engine they were added to: the call never moves to another one
