"""A data-parallel harvest on Ray: R replicas (Ray actors), each with its own engine, fed chunks by the driver.

The driver does everything but the forward passes: it reads and checks the prompts, deals each chunk's token ids
to a replica, puts the replicas' rows back in chunk order and writes the shards itself (interp_engine.harvest),
so the folder is the one a single engine writes, byte for byte, and only the driver's machine needs to reach it.

Backpressure: a replica holds at most `PER_REPLICA` chunks (one in its forward pass, one queued so it never waits
for the driver), and the driver at most `PER_REPLICA` x live replicas chunks dealt and not yet stored (a result
that arrives before an earlier chunk's waits in that window). A replica that dies (its actor process killed, its
node lost) has its unfinished chunks dealt again to the others; when none is left the run stops with the
finished shards kept, and a rerun resumes as any harvest does.
"""

import asyncio
import collections
import os
import warnings
from collections.abc import Iterable, Iterator

from interp_engine.addresses import Address
from interp_engine.errors import HarvestError, InputTypeError, InterpEngineError, SpecError, fix
from interp_engine.handle import ModelHandle
from interp_engine.warnings import InterpEngineWarning

PER_REPLICA = 2
OBJECT_STORE_BYTES = 256 << 20  # a local cluster's: results beyond it spill to disk
PLACE_TIMEOUT_S = 30


class _Replica:
    """One engine in a Ray actor: loads the driver's model with the driver's load_model call."""

    def __init__(self, load_call: tuple, points: tuple[str, ...], spec, store, batch_size: int) -> None:
        from interp_engine.loading import load_model

        self.model = load_model(**dict(load_call))
        self.points, self.spec, self.store, self.batch_size = points, spec, store, batch_size

    def ready(self) -> int:
        asyncio.run(self.model.warmup())
        return os.getpid()

    def capture(self, ids: tuple[tuple[int, ...], ...]) -> dict:
        from interp_engine.func._prepare import prepare

        planned = prepare(self.model, [list(p) for p in ids], self.spec, list(self.points), purpose="forward",
                          verb="capture")
        ((_, rows),) = self.model.runtime.stream([planned], batch_size=self.batch_size)
        return {str(a): t.to(self.store) for a, t in rows.items()}

    def close(self) -> None:
        asyncio.run(self.model.shutdown())


def check_replicas(replicas) -> None:
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
        raise InputTypeError(fix(f"replicas={replicas!r} must be a positive int (engines harvesting in parallel).",
                                 "e.g. replicas=2, or leave it unset for one engine in this process."))


class Replicas:
    """R engines reserved on a Ray cluster: `reserve` refuses what cannot be placed before any model loads."""

    def __init__(self, model: ModelHandle, replicas: int, bundle: dict, group, started: bool) -> None:
        self.model, self.replicas, self.bundle, self.group, self.started = model, replicas, bundle, group, started
        self.actors: list = []

    @classmethod
    def reserve(cls, model: ModelHandle, replicas: int) -> "Replicas":
        check_replicas(replicas)
        if model.load_call is None:
            raise SpecError(fix("replicas= loads the model again in each replica, from the load_model call that "
                                "made this handle; this one was not made by load_model.",
                                "pass a handle from load_model(...)."))
        try:
            import ray
        except ImportError:
            raise SpecError(fix("replicas= runs its engines on Ray, which is not installed.",
                                "pip install 'interp_engine[ray]' (on every node of the cluster).")) from None
        started = _connect(ray)
        try:
            bundle = _bundle(model)
            group = _place(ray, bundle, replicas)
        except BaseException:
            if started:
                ray.shutdown()
            raise
        return cls(model, replicas, bundle, group, started)

    def stream(self, chunks: Iterable, *, batch_size: int, points: tuple[Address, ...], spec, store) -> Iterator:
        """(prompts, rows) for each chunk, in order: what `runtime.stream` yields, from R engines."""
        import ray
        from ray.exceptions import RayActorError, RayTaskError
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        remote = ray.remote(_Replica)
        extra = {k: v for k, v in self.bundle.items() if k not in ("CPU", "GPU")}
        for r in range(self.replicas):
            strategy = PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=r)
            self.actors.append(remote.options(
                num_cpus=self.bundle.get("CPU", 0), num_gpus=self.bundle.get("GPU", 0), resources=extra or None,
                max_restarts=0, max_task_retries=0, scheduling_strategy=strategy,
            ).remote(self.model.load_call, tuple(map(str, points)), spec, store, batch_size))
        source = iter(chunks)
        alive = set(range(self.replicas))
        load, finished = [0] * self.replicas, [0] * self.replicas
        held: dict[int, object] = {}  # chunk index -> its Prompts, dealt and not yet yielded
        results: dict[int, dict] = {}
        outstanding: dict = {}  # ObjectRef -> (replica, chunk index)
        redo: collections.deque[int] = collections.deque()
        dealt = stored = 0
        exhausted = False
        for r, actor in enumerate(self.actors):  # loads run in parallel; a failed load is a lost replica
            outstanding[actor.ready.remote()] = (r, None)
        while True:
            while stored in results:
                yield held.pop(stored), results.pop(stored)
                stored += 1
            for r in sorted(alive, key=lambda r: load[r]):  # each filled up to PER_REPLICA, least busy first
                while load[r] < PER_REPLICA:
                    if redo:
                        i = redo.popleft()
                    elif not exhausted and len(held) < PER_REPLICA * len(alive):
                        item = next(source, None)
                        if item is None:
                            exhausted = True
                            break
                        i, dealt = dealt, dealt + 1
                        held[i] = item[0]
                    else:
                        break
                    outstanding[self.actors[r].capture.remote(held[i].ids)] = (r, i)
                    load[r] += 1
            if not outstanding:
                return
            [ref], _ = ray.wait(list(outstanding), num_returns=1)
            r, i = outstanding.pop(ref)
            if i is not None:
                load[r] -= 1
            try:
                value = ray.get(ref)
            except RayActorError as e:
                if i is not None:
                    redo.append(i)
                if r in alive:  # its other chunks fail the same way, later
                    alive.discard(r)
                    if alive:
                        warnings.warn(f"harvest replica {r} was lost ({type(e).__name__}) after {finished[r]} "
                                      f"chunks; its unfinished chunks go to the {len(alive)} left.",
                                      InterpEngineWarning, stacklevel=2)
                if not alive:
                    raise HarvestError(fix(f"every one of the {self.replicas} harvest replicas was lost (the last: "
                                           f"{str(e).splitlines()[0]}); the finished shards are kept.",
                                           "rerun the same harvest(...) into this folder: it resumes.")) from None
                continue
            except RayTaskError as e:
                if isinstance(e.cause, InterpEngineError):
                    raise e.cause from None
                raise
            if i is not None:
                results[i] = {a: value[str(a)] for a in points}
                finished[r] += 1

    def release(self) -> None:
        """Shut every engine down, stop the actors and free their reservation (and a cluster started here)."""
        import ray

        closing = [actor.close.remote() for actor in self.actors]
        if closing:
            ray.wait(closing, num_returns=len(closing), timeout=120)
        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        ray.util.remove_placement_group(self.group)
        if self.started:
            ray.shutdown()


def _connect(ray) -> bool:
    """Join the cluster this process is connected to, or RAY_ADDRESS's, or start a local one on the loopback;
    True when this call connected (and must disconnect)."""
    if ray.is_initialized():
        return False
    quiet = {"logging_level": "WARNING", "log_to_driver": False}
    if os.environ.get("RAY_ADDRESS"):
        ray.init(**quiet)
    else:
        ray.init(address="local", _node_ip_address="127.0.0.1", include_dashboard=False,
                 object_store_memory=OBJECT_STORE_BYTES, **quiet)
    return True


def _bundle(model: ModelHandle) -> dict:
    """What one replica reserves: its GPUs (and a core to drive them), or on the CPU one core per rank."""
    ranks = dict(model.load_call).get("num_gpus", 1)
    return {"CPU": 1, "GPU": ranks} if model.device.startswith("cuda") else {"CPU": ranks}


def _place(ray, bundle: dict, replicas: int):
    """A placement group of one bundle per replica, or the refusal that names what the cluster lacks. What the
    cluster lacks in all is refused at once; what is only busy (a previous harvest's replicas still exiting, other
    work) is waited for, up to PLACE_TIMEOUT_S."""
    from ray.util.placement_group import placement_group, remove_placement_group

    need = {k: v * replicas for k, v in bundle.items()}
    total = ray.cluster_resources()
    short = {k: v - total.get(k, 0) for k, v in need.items() if total.get(k, 0) < v}
    each = ", ".join(f"{v:g} {k}" for k, v in bundle.items())
    if short:
        raise SpecError(fix(f"replicas={replicas} need {_listed(need)} ({each} each); the Ray cluster has "
                            f"{_listed({k: total.get(k, 0) for k in need})} in all: missing {_listed(short)}.",
                            f"lower replicas to at most {_fits(total, bundle)}, or add nodes to the cluster "
                            "(ray start --address=HEAD:PORT on each)."))
    group = placement_group([dict(bundle) for _ in range(replicas)], strategy="SPREAD")
    if not group.wait(timeout_seconds=PLACE_TIMEOUT_S):
        remove_placement_group(group)
        free = ray.available_resources()
        raise SpecError(fix(f"replicas={replicas} ({each} each) could not be placed in {PLACE_TIMEOUT_S} s: the "
                            f"cluster has {_listed({k: free.get(k, 0) for k in need})} free now, and a replica needs "
                            f"{each} free on one node.", "lower replicas, wait for the cluster's other work to end, "
                            "or add nodes that each have a replica's resources."))
    return group


def _listed(resources: dict) -> str:
    return ", ".join(f"{v:g} {k}" for k, v in resources.items())


def _fits(free: dict, bundle: dict) -> int:
    return int(min(free.get(k, 0) // v for k, v in bundle.items()))
