"""The engine core's scheduler (`scheduler_cls`): a call's requests reach vLLM's own scheduler together.

The driver sends a call's requests one message each. vLLM's engine core steps as soon as it holds one request,
and its busy loop, woken by the first message, usually wins the race against its own input thread for the
rest: a call of 8 prompts ran as a step of one prompt and a step of seven (1.9 engine steps per 8x16 call,
measured), paying a whole step's fixed cost twice. A call's requests say how many the call sends at once (`of`,
`wire.tag`); this scheduler holds them as they arrive and adds them to vLLM's scheduler, in the order they came,
once all have arrived or those held fill one step (its token or sequence budget), so a small call runs in one
step. While only held requests wait, the engine has no work and sleeps on its input, as it would without them.
An abort of a held request (the driver's Ctrl-C mid-submit) ends its call's hold; requests without `of` pass
straight through. Runs in the engine core's process; vLLM's own scheduler class is chosen as vLLM would.
"""

import functools

from interp_engine.backends.vllm import wire

QUALNAME = f"{__name__}.scheduler"  # what `engine.settings` gives vLLM as `scheduler_cls`


def scheduler(**kwargs):
    """vLLM builds its scheduler by calling `scheduler_cls(...)`: here, its default class with holding mixed in."""
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler

    base = AsyncScheduler if kwargs["vllm_config"].scheduler_config.async_scheduling else Scheduler
    return _gathering(base)(**kwargs)


@functools.cache
def _gathering(base: type) -> type:
    class Gathering(base):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.held: dict[str, _Hold] = {}  # call -> its requests arrived so far, and those not yet added

        def add_request(self, request) -> None:
            tag = wire.read_tag(getattr(request.sampling_params, "extra_args", None))
            of = tag.get("of") if tag is not None else None
            if not isinstance(of, int) or of < 2 or not isinstance(tag.get("call"), str):
                return super().add_request(request)
            hold = self.held.setdefault(tag["call"], _Hold(of))
            hold.arrived.add(request.request_id)
            hold.waiting.append(request)
            hold.tokens += request.num_prompt_tokens
            done = len(hold.arrived) >= hold.of
            if done or hold.tokens >= self.max_num_scheduled_tokens or len(hold.waiting) >= self.max_num_running_reqs:
                if done:
                    del self.held[tag["call"]]
                self._release(hold)

        def finish_requests(self, request_ids, finished_status):
            if request_ids is None:
                self.held.clear()
            elif self.held:
                request_ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
                ended = set(request_ids)
                for call, hold in list(self.held.items()):
                    if hold.arrived & ended:  # the driver aborts a call whole: nothing more of it will come
                        del self.held[call]
                        hold.waiting = [r for r in hold.waiting if r.request_id not in ended]
                        self._release(hold)
            return super().finish_requests(request_ids, finished_status)

        def _release(self, hold: "_Hold") -> None:
            waiting, hold.waiting, hold.tokens = hold.waiting, [], 0
            for request in waiting:
                super().add_request(request)

    Gathering.__name__ = Gathering.__qualname__ = f"Gathering{base.__name__}"
    return Gathering


class _Hold:
    """One call's requests in the scheduler's hold."""

    def __init__(self, of: int):
        self.of, self.arrived, self.waiting, self.tokens = of, set(), [], 0
