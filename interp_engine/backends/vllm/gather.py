"""The engine core's scheduler (`scheduler_cls`): a call's requests reach vLLM's own scheduler together.

The driver sends a call's requests one message each. vLLM's engine core steps as soon as it holds one request,
and its busy loop, woken by the first message, usually wins the race against its own input thread for the
rest: a call of 8 prompts ran as a step of one prompt and a step of seven (1.9 engine steps per 8x16 call,
measured), paying a whole step's fixed cost twice. A call's requests say how many the call sends at once (`of`,
`wire.tag`); this scheduler holds them as they arrive and adds them to vLLM's scheduler, in the order they came,
once all have arrived or those held fill one step (its token or sequence budget), so a small call runs in one
step. While only held requests wait, the engine has no work and sleeps on its input, as it would without them.
An abort of a held request (the driver's Ctrl-C mid-submit) ends its call's hold, and vLLM finishes the
requests as any it holds; requests without `of` pass straight through. Runs in the engine core's process; vLLM's
own scheduler class is chosen as vLLM would.
"""

import functools
from dataclasses import dataclass, field

from interp_engine.backends.vllm import compat, wire

QUALNAME = f"{__name__}.scheduler"  # what `engine.settings` gives vLLM as `scheduler_cls`


def scheduler(**kwargs):
    """vLLM builds its scheduler by calling `scheduler_cls(...)`: here, its default class with holding mixed in."""
    return _gathering(compat.scheduler_class(kwargs["vllm_config"]))(**kwargs)


@functools.cache
def _gathering(base: type) -> type:
    class Gathering(base):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.held: dict[str, _Hold] = {}  # call -> its requests arrived so far, and those not yet added

        def add_request(self, request) -> None:
            request_id, extra_args, tokens = compat.arriving(request)
            tag = wire.read_tag(extra_args)
            of = tag.get("of") if tag is not None else None
            if not isinstance(of, int) or of < 2 or not isinstance(tag.get("call"), str):
                return super().add_request(request)
            hold = self.held.setdefault(tag["call"], _Hold(of))
            hold.arrived.add(request_id)
            hold.waiting.append(request)
            hold.tokens += tokens
            done = len(hold.arrived) >= hold.of
            budget, seqs = compat.step_budget(self)
            if done or hold.tokens >= budget or len(hold.waiting) >= seqs:
                if done:
                    del self.held[tag["call"]]
                self._release(hold)

        def finish_requests(self, request_ids, finished_status):
            """An abort ends the hold of every call it names (the driver aborts a call whole: nothing more of it
            will come), and of every call where it names none (vLLM's abort of all): their held requests are added
            first, so that vLLM finishes them as any request waiting."""
            if self.held:
                ended = None if request_ids is None else \
                    {request_ids} if isinstance(request_ids, str) else set(request_ids)
                for call, hold in list(self.held.items()):
                    if ended is None or hold.arrived & ended:
                        del self.held[call]
                        self._release(hold)
                request_ids = request_ids if ended is None else ended  # an iterator was read once already
            return super().finish_requests(request_ids, finished_status)

        def _release(self, hold: "_Hold") -> None:
            waiting, hold.waiting, hold.tokens = hold.waiting, [], 0
            for request in waiting:
                super().add_request(request)

    Gathering.__name__ = Gathering.__qualname__ = f"Gathering{base.__name__}"
    return Gathering


@dataclass
class _Hold:
    """One call's requests in the scheduler's hold."""

    of: int  # how many the call sends
    arrived: set[str] = field(default_factory=set)  # the ids of those that came (released ones too)
    waiting: list = field(default_factory=list)  # those not yet added to vLLM's scheduler, in arrival order
    tokens: int = 0  # their prompt tokens
