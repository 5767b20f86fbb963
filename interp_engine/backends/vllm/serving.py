"""Per-request interp over vLLM's own OpenAI-compatible server: the request's `interp` object becomes a call.

A request to /v1/completions or /v1/chat/completions may carry `"interp": {"spec": Spec.to_dict(),
"capture": {"points": [...], "positions": "last", "dtype": "float16"}, "lens": {"points": [...], "positions": [-1],
"top_k": 5}}` (positions and top_k as `logit_lens`'s, counted in each row: the prompt and every generated token
but the last). The ASGI middleware (innermost: vLLM's API-key check runs
first) validates it with the offline path's own checks (`Spec.from_dict`, `validate.plan`) and answers a bad one
with HTTP 400 and the Python API's message; a good one becomes a `Job`. vLLM's serving code then calls the engine
client's `generate` once per prompt; our wrapper of it tags each engine request exactly as the offline path does
(`wire.tag`, the table in every request of the job, so the order vLLM schedules them in does not matter), salts
its prefix cache and skips reading it, and after the job's last request finishes collects the workers' records
(`wire.COLLECT`); a job that only steers has nothing to collect, and its table leaves the workers with its last
request (`InterpExtension._ie_finished`). A non-streaming response gets an `interp` field with the captures
(`encode_captures`), a stream a last chunk holding that field (before `data: [DONE]`). An SAE in a spec reaches
the workers once, before the first request that names it (`ie_put_saes`), and tables name it by digest
(`sae_refs.py`), as offline.
Nothing in a request is executed or unpickled: specs are JSON, tensors base64 bytes with dtype and shape.
"""

import asyncio
import base64
import contextlib
import contextvars
import copy
import dataclasses
import json
import os
import uuid
from typing import Any

import torch

from interp_engine.addresses import Address
from interp_engine.backends.vllm import results, sae_refs, wire
from interp_engine.errors import InterpEngineError, SpecError, fix
from interp_engine.func.lens import LensTop, lens_points, lens_result
from interp_engine.positions import at_positions, position_index
from interp_engine.sae import SAE
from interp_engine.spec import Spec
from interp_engine.tensor_data import MAX_INDEX
from interp_engine.validate import Plan, plan

ROUTES = ("/v1/completions", "/v1/chat/completions")
JOB: contextvars.ContextVar["Job | None"] = contextvars.ContextVar("interp_job", default=None)
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclasses.dataclass(frozen=True)
class Limits:
    """What one request may ask for (0: no limit)."""

    spec_bytes: int = 16 << 20  # the request body, when it carries interp
    ops: int = 64
    capture_bytes: int = 256 << 20  # the captures of one response, as returned


@dataclasses.dataclass(frozen=True)
class Asked:
    """A request's `interp` object, checked: its plan, what it captures (and where) and what it lenses."""

    plan: Plan
    reads: tuple[Address, ...] = ()
    dtype: torch.dtype | None = None
    positions: int | list[int] | str | None = None  # of the captures, as logit_lens's `positions`
    lens: tuple[Address, ...] = ()
    lens_positions: int | list[int] | str | None = None
    top_k: int | None = None


@dataclasses.dataclass
class Job:
    """One HTTP request's call: its table, its prompts as they finish, and what its workers recorded."""

    call: str
    table: dict
    asked: Asked
    started: int = 0
    ran: dict[int, list[int]] = dataclasses.field(default_factory=dict)  # prompt -> tokens that ran through the model
    finished: int = 0
    records: dict[Address, torch.Tensor] | None = None
    lensed: dict[Address, torch.Tensor] | None = None  # each lens point's log-probs, [prompts, positions, d_vocab]
    error: InterpEngineError | None = None
    saes: dict[str, SAE] = dataclasses.field(default_factory=dict)  # the table names them by key (sae_refs.py)
    ready: "asyncio.Future | None" = None  # its SAEs put to the workers, before its first request


class Service:
    """The model handle the requests are checked against, the server's default spec and limits."""

    def __init__(self, handle, *, default: dict | None = None, limits: Limits = Limits()):
        self.handle, self.limits = handle, limits
        # The engine's rank 0 shares this host (`InterpExtension.ie_attach`'s answer, set once the engine is up):
        # a steering job's failure then comes back as a file as it happens, and the job is never collected.
        self.local = True
        sae_refs.bound()  # a bad INTERP_ENGINE_SAE_BYTES: refused before the server starts
        self.default = None if default is None else self.interp({"spec": default}, n_prompts=1)

    def interp(self, body: Any, *, n_prompts: int) -> Asked:
        """The request's `interp` object, checked as the Python API checks."""
        if not isinstance(body, dict) or set(body) - {"spec", "capture", "lens"}:
            raise SpecError(fix(f"interp must be an object with 'spec', 'capture' and/or 'lens', got {_shown(body)}.",
                                'send {"interp": {"spec": Spec.to_dict(), "capture": {"points": ["resid_post.0"]}}} '
                                "(interp_engine.client.extra_body builds it)."))
        raw = body.get("spec")
        spec = Spec() if raw is None else Spec.from_dict(raw)
        if self.limits.ops and len(spec.ops) > self.limits.ops:
            raise SpecError(fix(f"this spec has {len(spec.ops)} ops; the server takes at most {self.limits.ops}.",
                                "send fewer ops per request, or start the server with a larger --max-ops."))
        capture = body.get("capture") or {}
        points = capture.get("points", []) if isinstance(capture, dict) else None
        dtype = capture.get("dtype") if isinstance(capture, dict) else None
        if not isinstance(points, list) or not all(isinstance(p, str) for p in points) or \
                (dtype is not None and dtype not in DTYPES) or (isinstance(capture, dict) and
                                                                set(capture) - {"points", "dtype", "positions"}):
            raise SpecError(fix(f"capture must be {{'points': [names], 'positions', 'dtype': optional}}, got "
                                f"{_shown(capture)}.", f'e.g. {{"points": ["resid_post.0"], "positions": "last", '
                                f'"dtype": "float16"}}; dtype one of {", ".join(DTYPES)}.'))
        lens = body.get("lens")
        if lens is not None and (not isinstance(lens, dict) or set(lens) - {"points", "positions", "top_k"} or
                                 not isinstance(lens.get("points", []), list)):
            raise SpecError(fix(f"lens must be {{'points', 'positions', 'top_k'}}, each optional, got {_shown(lens)}.",
                                'e.g. {"points": ["resid_post.0", "resid_post.1"], "positions": "last", "top_k": 5}; '
                                "{} lenses resid_post at every layer, as logit_lens."))
        reads = [Address.parse(p) for p in points]
        lensed = [] if lens is None else lens_points(self.handle, lens.get("points"), lens.get("top_k"))
        # Prompt lengths are known only once vLLM has tokenized: index positions are checked as generate's are.
        checked = plan(self.handle, spec, reads + lensed, n_prompts=n_prompts, longest=1, purpose="generate")
        n = self.handle.n_layers
        return Asked(checked, tuple(dict.fromkeys(a.resolve(n) for a in reads)),
                     None if dtype is None else DTYPES[dtype], _positions(capture.get("positions"), "capture"),
                     tuple(dict.fromkeys(a.resolve(n) for a in lensed)),
                     None if lens is None else _positions(lens.get("positions"), "lens"),
                     None if lens is None else lens.get("top_k"))

    def job(self, payload: dict, *, chat: bool) -> Job | None:
        """The request's job (None: a plain request), or the library's error for a bad one."""
        if "interp" not in payload and self.default is None:
            return None
        n_prompts = 1 if chat else _count_prompts(payload.get("prompt"))
        asked = self.interp(payload["interp"], n_prompts=n_prompts) if "interp" in payload else self.default
        if not asked.plan.ops and not asked.plan.reads:
            return None
        if (payload.get("n") or 1) != 1 or payload.get("use_beam_search") or payload.get("best_of"):
            raise SpecError(fix("interp requests take one sample per prompt (n=1, no beam search, no best_of).",
                                "send one request per sample."))
        spec = asked.plan.spec()
        compiled, saes = sae_refs.referenced(spec, spec.to_dict())
        sae_refs.fits(saes, sae_refs.bound())
        call = uuid.uuid4().hex
        table = wire.table(call, compiled, spec.fingerprint(), asked.reads, lens=asked.lens,
                           failures=self.local and not asked.plan.reads)
        return Job(call, table, asked, saes=saes)


def _positions(value: Any, what: str) -> int | list[int] | str | None:
    """`positions` of a capture or lens, checked as logit_lens checks them, save against the rows' lengths
    (known once generated)."""
    if value is not None:
        position_index(value, (MAX_INDEX,), f"the {what}")
    return value


def _count_prompts(prompt: Any) -> int:
    """How many engine requests vLLM makes of a completion's `prompt` (a text, ids, or a list of either)."""
    if isinstance(prompt, list) and prompt and not all(isinstance(p, int) for p in prompt):
        return len(prompt)
    return 1


def _shown(value: Any) -> str:
    text = json.dumps(value)[:80] if _jsonable(value) else type(value).__name__
    return text


def _jsonable(value: Any) -> bool:
    try:
        json.dumps(value)
        return True
    except (TypeError, ValueError):
        return False


# ------------------------------------------------------------------------------------------- the engine side

@dataclasses.dataclass
class Holding:
    """The server's record of the SAEs its engine's workers hold, its puts one at a time, and the jobs in flight
    that put SAEs (until collected: what they name is never evicted)."""

    held: sae_refs.Held = dataclasses.field(default_factory=sae_refs.Held)
    lock: asyncio.Lock = dataclasses.field(default_factory=asyncio.Lock)
    in_flight: set[str] = dataclasses.field(default_factory=set)


def wrap_generate(engine) -> None:
    """Make `engine.generate` (vLLM's AsyncLLM, called by its serving code once per prompt) run the request's job."""
    plain, holding = engine.generate, Holding()

    def generate(prompt, sampling_params, request_id, *args, **kwargs):
        job = JOB.get()
        if job is None:
            extra = getattr(sampling_params, "extra_args", None)
            if extra and wire.TAG in extra:  # never a table a client wrote (vllm_xargs)
                sampling_params = copy.copy(sampling_params)
                sampling_params.extra_args = {k: v for k, v in extra.items() if k != wire.TAG}
            return plain(prompt, sampling_params, request_id, *args, **kwargs)
        index, job.started = job.started, job.started + 1
        return _tabled(engine, plain, holding, job, index, prompt, sampling_params, request_id, args, kwargs)

    engine.generate = generate


async def _tabled(engine, plain, holding: Holding, job: Job, index: int, prompt, sampling_params, request_id,
                  args, kwargs):
    from vllm.sampling_params import RequestOutputKind

    ids = list(prompt.get("prompt_token_ids") or []) if isinstance(prompt, dict) else []
    params = copy.copy(sampling_params)
    params.extra_args = {**(sampling_params.extra_args or {}), **wire.tag(job.call, index, len(ids), job.table)}
    # As offline: the KV this request writes was computed under its edits, and it reads none computed without.
    params.skip_reading_prefix_cache = True
    delta = sampling_params.output_kind == RequestOutputKind.DELTA
    new: list[int] = []
    try:
        if job.table["failures"]:  # where a worker writes the job's failure, before any request of it runs
            wire.make_failure_file(job.table["path"])
        if job.saes:  # the job's first prompt puts them; the others wait for it (a hang-up cancels no put)
            job.ready = job.ready or asyncio.ensure_future(_put(engine, holding, job))
            await asyncio.shield(job.ready)
        async for out in plain({**prompt, "cache_salt": job.call}, params, request_id, *args, **kwargs):
            tokens = list(out.outputs[0].token_ids) if out.outputs else []
            new = new + tokens if delta else tokens
            yield out
    finally:
        # The last generated token never ran through the model: the rows are the prompt and the others.
        job.ran[index] = ids + new[:-1]
        job.finished += 1
        # vLLM's serving code calls generate for every prompt before it reads any: the last to end collects,
        # shielded: a client that hangs up cancels its request's task, and the table must leave the workers.
        # A job that only steers has nothing to collect: it is answered at once (`_answered`).
        if job.finished == job.started and job.table["failures"]:
            _answered(holding, job)
        elif job.finished == job.started:
            await asyncio.shield(_collect(engine, holding, job))


async def _put(engine, holding: Holding, job: Job) -> None:
    """The job's SAEs into the workers, each once while they hold it; evictions decided here (`sae_refs.Held`)."""
    holding.in_flight.add(job.call)
    async with holding.lock:  # a job whose SAE another is putting waits, then finds it held
        new, evicted = holding.held.plan(job.call, job.saes, holding.in_flight)
        if new or evicted:
            try:
                encoded = await asyncio.to_thread(sae_refs.encoded, new)  # base64 of a large SAE: off the loop
                await engine.collective_rpc(wire.PUT_SAES, args=(encoded, evicted))
            except BaseException:
                holding.held.forget(new)
                raise


async def _collect(engine, holding: Holding, job: Job) -> None:
    """The job's records out of the workers (and its table with them); a contained failure becomes its error."""
    path = wire.result_path(job.call)
    try:
        answers = await engine.collective_rpc(wire.COLLECT, args=(job.call, path, wire.host()))
        flat = wire.decode(wire.result(answers))
        lengths = tuple(len(job.ran.get(i, [])) for i in range(job.started))
        job.records = wire.assemble(flat, list(job.asked.reads), lengths)
        job.lensed = wire.assemble(flat, list(job.asked.lens), lengths, lens=True)
    except InterpEngineError as e:
        job.error = e
    finally:
        holding.in_flight.discard(job.call)
        if os.path.exists(path):
            os.unlink(path)


def _answered(holding: Holding, job: Job) -> None:
    """A steering job's end, without a round trip to the engine, which would wait for the step in progress to
    end (a step of latency per request, and a slot of the batch left empty, under load). A worker that failed
    the call wrote why where we look, as its ops ran, before the step's outputs left it (`calls.py`); its table
    leaves the workers with the job's last request, at the scheduler's next step (`InterpExtension._ie_finished`)."""
    path = wire.result_path(job.call)
    holding.in_flight.discard(job.call)  # its requests have ended: its SAEs are not needed any more
    try:
        if results.written(path):  # made empty (`_tabled`): a worker failed the call
            wire.decode(path)  # raises the call's error
    except InterpEngineError as e:
        job.error = e
    finally:
        with contextlib.suppress(FileNotFoundError):  # no worker writes it afterwards (`wire.make_failure_file`)
            os.unlink(path)


def encode_captures(job: Job, n_layers: int, limit: int) -> dict[str, Any]:
    """The response's `interp` field: the captures as safetensors bytes (base64), keyed by address, each
    [prompts, positions, ...] right-padded with zeros, with their shapes and the tokens each row's positions
    hold (prompt, then every generated token but the last, which never ran through the model); with positions,
    only those (`positions`: each row's, counted from 0). The lens as `logit_lens` returns it, in `lens`."""
    asked, rows = job.asked, [job.ran.get(i, []) for i in range(job.started)]
    lengths = tuple(len(r) for r in rows)
    out: dict[str, Any] = {"tokens": rows, "n_layers": n_layers}
    tensors = {}
    index = None if asked.positions is None else position_index(asked.positions, lengths, "capture")
    for address, t in job.records.items():
        if index is not None:  # patterns are refused while generating: pos is every point's second axis
            t = at_positions(t, index, dim=1)
        tensors[str(address)] = (t if asked.dtype is None else t.to(asked.dtype)).contiguous()
    if index is not None:
        out["positions"] = index.tolist()
    lensed = {}
    if asked.lens:
        index = None if asked.lens_positions is None else position_index(asked.lens_positions, lengths, "lens")
        found = lens_result(torch.stack([job.lensed[a] for a in asked.lens]), index, asked.top_k)
        lensed = {"logprobs": found.logprobs, "tokens": found.tokens} if isinstance(found, LensTop) else \
            {"logprobs": found}
        out.update(lens_points=[str(a) for a in asked.lens], lens_positions=None if index is None else index.tolist())
    blobs = {name: _saved(t) for name, t in (("captures", tensors), ("lens", lensed))}
    size = sum(len(b) for b in blobs.values())
    if limit and size > limit:
        raise SpecError(fix(f"these captures take {size} bytes; the server returns at most {limit} per response.",
                            'capture fewer points, prompts or tokens, fewer "positions", a smaller "dtype" '
                            '(float16), a lens "top_k", or start the server with a larger --max-capture-bytes.'))
    return {**out, **{name: base64.b64encode(b).decode() for name, b in blobs.items()},
            "shapes": {k: list(t.shape) for k, t in tensors.items()}}


def _saved(tensors: dict[str, torch.Tensor]) -> bytes:
    from safetensors.torch import save

    return save({k: t.contiguous() for k, t in tensors.items()}) if tensors else b""
