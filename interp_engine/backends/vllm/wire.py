"""The driver/worker protocol of the vLLM backends, written once and imported by both sides.

- Requests of a call carry `extra_args[TAG] = {"call", "prompt", "length"}` (see `tag`), the first one also
  the call's table (`table`: plain data); the engine's request ids are `request_id(call, i)`.
- The driver calls the workers' `InterpExtension` methods by the names below, with plain data.
- A call that failed in a worker (its failure contained there, the engine serving on) is answered by `COLLECT`
  with `failure(...)`, `{ERROR: message, IN_SPEC: bool}`, from every rank that failed, or, handed back, by a
  file holding only that failure (`encode_failure`); `result` and `decode` turn either into the library's error.
- Results are rows keyed by (prompt, position): per recorded key three tensors, `key|prompt`, `key|pos` and
  `key|value`, where the key is the address (`str(address)`), or `lens:` + the address for a logit-lens read.
  On the driver's host they travel as a safetensors file the driver names (`result_path`, normally in
  /dev/shm) and deletes; from another host, as safetensors bytes.
"""

import io
import json
import os
import socket
import tempfile
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor

from interp_engine.addresses import Address
if TYPE_CHECKING:
    from interp_engine.inputs import Prompts

from interp_engine.backends.vllm import results
from interp_engine.errors import BackendError, SpecError, fix

TAG = "interp_engine"
CONFIG_KEY = TAG  # vllm-static: the engine's `additional_config` key holding its taps

# RPC methods of `worker.InterpExtension` (names start with ie_ to stay clear of the worker's own).
ATTACH = "ie_attach"
COLLECT = "ie_collect"
RELEASE = "ie_release"
STATUS = "ie_status"
WEIGHTS = "ie_weights"  # backends/vllm/weights.py
PUT_SAES = "ie_put_saes"  # SAEs sent once, named by reference in tables, evicted by the driver (sae_refs.py)
SAES = "ie_saes"  # what a worker holds of SAEs (sae_refs.held)
METHODS = (ATTACH, COLLECT, RELEASE, STATUS, WEIGHTS, PUT_SAES, SAES)

ERROR = "interp_engine_error"  # a failed call's COLLECT answer: the message the driver raises
IN_SPEC = "in_spec"  # ...and whether an op failed (SpecError) rather than a read (BackendError)
LENS = "lens:"  # key prefix of a logit-lens read (log-probs computed in the worker)
ROWS = "shared_rows"  # a result's metadata: {key: the key whose (prompt, position) index it shares}


# ------------------------------------------------------------------------------------------- requests

def request_id(call: str, index: int) -> str:
    return f"{TAG}-{call}-{index}"


def tag(call: str, prompt: int, length: int, table: dict | None = None, of: int = 0) -> dict[str, Any]:
    """A request's `extra_args`: which call it belongs to, which prompt it is and how long that prompt is; the
    call's first request also carries its table (the scheduler is first come, first served, so the workers
    see it no later than the call's other requests). `of`: how many requests the call sends at once, which the
    engine core's scheduler gathers into one step (`gather.py`)."""
    return {TAG: {"call": call, "prompt": prompt, "length": length, **({"table": table} if table else {}),
                  **({"of": of} if of > 1 else {})}}


def read_tag(extra_args: Mapping | None) -> dict | None:
    """The tag of a request's `extra_args` (None: not one of ours)."""
    found = (extra_args or {}).get(TAG)
    return found if isinstance(found, dict) else None


def prefill_requests(call: str, prompts: "Prompts", table: dict) -> tuple[list, list]:
    """A capture's requests: prefill only (one token sampled and dropped), nothing read from the prefix cache (every
    position must run through the taps), tagged with the call (the first with its table), salted with the call id
    (`cache_salt`): the KV they write was computed under the call's edits, and a later plain request with the same
    prefix must not read it."""
    from vllm import SamplingParams
    from vllm.inputs import tokens_input
    from vllm.sampling_params import RequestOutputKind

    # skip_clone: each request's params are its own, so vLLM need not deep-copy them as it adds the request
    # (0.3-0.5 ms a request of driver CPU, the call's table included).
    params = [SamplingParams(max_tokens=1, temperature=0.0, detokenize=False, skip_reading_prefix_cache=True,
                             output_kind=RequestOutputKind.FINAL_ONLY, skip_clone=True,
                             extra_args=tag(call, i, len(ids), table if i == 0 else None, len(prompts.ids)))
              for i, ids in enumerate(prompts.ids)]
    return [tokens_input(list(ids), cache_salt=call) for ids in prompts.ids], params


# ------------------------------------------------------------------------------------------- tables

def table(call: str, spec: dict, fingerprint: str, reads, *, width: int = 0, lens=(), prompts: int = 0,
          failures: bool = False) -> dict[str, Any]:
    """A call's table: its id, its spec (`Spec.to_dict`, already validated by the driver, with its
    fingerprint), the addresses it reads, the padded width of pattern rows, the addresses it lenses, and, for a
    prefill call, how many prompts it has: the workers hand its results back at `result_path(call)` (on the
    driver's host) once every prompt's last position has run. `failures` (a call that only steers, its table in
    every request): a worker on the driver's host writes the call's failure there as it happens (`calls.py`); it
    is never collected, and leaves the workers with its last request."""
    return {"call": call, "spec": spec, "fingerprint": fingerprint, "reads": [str(a) for a in reads],
            "width": width, "lens": [str(a) for a in lens], "prompts": prompts, "failures": failures,
            "path": result_path(call) if prompts or failures else "", "host": host()}


def with_slot(table: dict, slot: list) -> dict:
    """A prefill call's table with its arena slot ([arena path, offset, size], `arena.py`): where rank 0 writes
    the call's results if they fit (`calls.WorkerCall.slot`), else the call's file still."""
    return {**table, "slot": slot}


# ------------------------------------------------------------------------------------------- failures

def failure(message: str, *, in_spec: bool) -> dict[str, Any]:
    """Worker side: `COLLECT`'s answer for a call that failed on this rank."""
    return {ERROR: message, IN_SPEC: in_spec}


def recording_failed(address: Address | str, error: Exception) -> str:
    """A contained failure to record a call's rows (not the spec's doing): the message the driver raises."""
    return fix(f"recording {address} failed ({type(error).__name__}: {str(error).strip()[:300]}).",
               "retry the call; if it fails again, capture fewer points or prompts at once, or report it as an "
               "interp_engine bug.")


def refused(error: Exception) -> str:
    """Worker side: why a call's table was refused (the driver's checks passed it), as its failure message."""
    return fix(f"the vLLM workers refused this call's table ({type(error).__name__}: {error}).",
               "this request passed the checks before it, so please report it (with Spec.to_dict()) as an "
               'interp_engine bug; backend="eager" runs it.')


def result(answers: list) -> bytes | str:
    """Driver side: rank 0's `COLLECT` answer, or the library's error for a call any rank failed."""
    for answer in answers:
        if isinstance(answer, Mapping) and isinstance(answer.get(ERROR), str):
            raise _failed(answer[ERROR], bool(answer.get(IN_SPEC)))
    return answers[0]


def _failed(message: str, in_spec: bool) -> Exception:
    kind = SpecError if in_spec else BackendError
    return kind(f"This call failed inside the vLLM workers (only it: the engine goes on serving other calls). "
                f"{message}")


# ------------------------------------------------------------------------------------------- results

def key(address: Address | str, *, lens: bool = False) -> str:
    return f"{LENS if lens else ''}{address}"


def encode(records: Mapping[str, list[tuple[Tensor, Tensor, Tensor]]], *, path: str = "",
           slot: tuple | None = None) -> bytes | str:
    """Worker side: per key, (prompt, position, value) host chunks -> the driver's arena `slot` if they fit
    there, else one file at `path` (either way `path` is returned), or its bytes. Chunks are written as they are (`results.write`), never joined; keys recorded at the same rows
    (every address of a call, step after step) share one (prompt, position) index, written once."""
    tensors: dict[str, list[Tensor]] = {}
    owners: dict[tuple[int, ...], str] = {}  # the identity of a key's index chunks -> the key holding them
    shared: dict[str, str] = {}
    for name, chunks in records.items():
        index = tuple(id(t) for c in chunks for t in c[:2])
        if (owner := owners.setdefault(index, name)) != name:
            shared[name] = owner
        else:
            tensors[f"{name}|prompt"] = [c[0] for c in chunks]
            tensors[f"{name}|pos"] = [c[1] for c in chunks]
        tensors[f"{name}|value"] = [c[2] for c in chunks]
    metadata = {ROWS: json.dumps(shared)} if shared else None
    if path:
        if not (slot and results.write_slot(*slot, tensors, metadata)):
            results.write(path, tensors, metadata)
        return path
    if not tensors:
        return b""
    buffer = io.BytesIO()
    results.write(buffer, tensors, metadata)
    return buffer.getvalue()


def encode_failure(message: str, *, in_spec: bool, path: str, create: bool = True) -> None:
    """Worker side: a handed-back call that failed (rank 0's view: every rank runs the same ops on the same
    gathered rows) leaves its failure where its records would be, for `decode` to raise. A steering call's
    (`create=False`) only into the file its driver made (`make_failure_file`)."""
    results.write(path, {}, {ERROR: message, IN_SPEC: "1" if in_spec else ""}, create=create)


def make_failure_file(path: str) -> None:
    """Driver side: a steering call's file (`table(failures=True)`), made empty before a request of the call
    reaches the engine, deleted once the call is answered. Its workers write into it and never create it: a
    request aborted mid-step (a client that hung up) can fail in a worker after its driver answered and deleted
    the file, and that failure then goes nowhere, rather than into a file no one would delete."""
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT, 0o600))


def decode(answer: bytes | str | Tensor) -> dict[str, Tensor]:
    """Driver side: what `encode` returned, or an arena slot's bytes -> the flat tensor dict (a failure file raises the call's error), each
    tensor a view of the one mapped file (`results.read`); keys sharing an index get the same index tensors.
    Ctrl-C waits until it is read."""
    from interp_engine.backends.vllm.procs import deferred_interrupt

    if not isinstance(answer, Tensor) and not answer:
        return {}
    try:
        with deferred_interrupt():
            flat, meta = results.read(answer)
        failed = meta.get(ERROR)
        if failed is None:
            for name, owner in json.loads(meta.get(ROWS, "{}")).items():
                flat[f"{name}|prompt"], flat[f"{name}|pos"] = flat[f"{owner}|prompt"], flat[f"{owner}|pos"]
    except (OSError, ValueError, KeyError, TypeError, AttributeError, IndexError, RuntimeError, OverflowError) as e:
        # Truncated, overwritten or never written whole (a worker killed mid-write): this call's loss only.
        raise BackendError(fix(f"the vLLM workers' answer to this call could not be read ({type(e).__name__}: "
                               f"{str(e).strip()[:200]}).", "retry the call; if it fails again, report it as an "
                               "interp_engine bug.")) from None
    if failed is not None:
        raise _failed(str(failed), bool(meta.get(IN_SPEC)))
    return flat


def _results_folder() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def result_path(call: str) -> str:
    """Where a worker on this host may write a call's large results (the driver deletes it)."""
    return os.path.join(_results_folder(), f"{TAG}-{os.getpid()}-{call}.safetensors")


def sweep_orphans() -> list[str]:
    """Delete the result files of drivers that no longer run (killed before they could delete them: /dev/shm is
    memory until reboot); the paths removed. A file's pid names its driver: gone, or now another process's (one
    started after the file was last written), it is an orphan."""
    import psutil

    removed = []
    for name in os.listdir(folder := _results_folder()):
        parts = name.split("-")
        if len(parts) < 3 or parts[0] != TAG or not name.endswith(".safetensors") or not parts[1].isdigit():
            continue
        path = os.path.join(folder, name)
        try:
            if psutil.Process(int(parts[1])).create_time() <= os.stat(path).st_mtime + 1.0:
                continue  # its driver (on a loaded machine the clocks of the two may differ by a tick)
        except psutil.AccessDenied:  # alive, another user's
            continue
        except (psutil.NoSuchProcess, FileNotFoundError):
            pass
        try:
            os.unlink(path)
            removed.append(path)
        except OSError:  # another driver swept it first, or another user's
            pass
    return removed


def same_host(host: str) -> bool:
    return not host or host == socket.gethostname()


def host() -> str:
    return socket.gethostname()


def rows(flat: Mapping[str, Tensor], address: Address, *, lens: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """One address's (prompt, position, value) rows out of a decoded result."""
    name = key(address, lens=lens)
    if f"{name}|value" not in flat:
        raise BackendError(f"internal: the workers recorded nothing at {address}")
    return flat[f"{name}|prompt"], flat[f"{name}|pos"], flat[f"{name}|value"]


def assemble(flat: dict[str, Tensor], reads: list[Address], lengths: tuple[int, ...],
             offsets: tuple[int, ...] | None = None, lens: bool = False) -> dict[Address, Tensor]:
    """Rows keyed by (prompt, position) -> right-padded [n_prompts, width, ...] tensors, zeros past each end.

    With `offsets`, row `offsets[i] + j` of prompt i lands at column j (generated positions)."""
    width = max(max(lengths), 1)
    starts = np.cumsum((0, *lengths))
    in_order: dict[int, bool] = {}  # per index (keys share one, see `decode`): checked once, not per address
    out = {}
    for address in reads:
        prompt, pos, value = rows(flat, address, lens=lens)
        patterns = address.info.pos_axis == 2 and not lens
        if offsets is None and not patterns:
            if (whole := in_order.get(id(pos))) is None:  # in numpy: a handful of torch ops cost ~40 us
                whole = in_order[id(pos)] = len(pos) == sum(lengths) and bool(
                    (starts[prompt.numpy()] + pos.numpy() == np.arange(len(pos))).all())
            if whole:
                # Each prompt's rows once, in order (the usual case): a view, or one copy per prompt where ragged.
                # The index_put below is a parallel op in the driver; on a busy machine its threads stall the call.
                out[address] = _padded(value, lengths, width)
                continue
        if offsets is not None:
            pos = pos - torch.tensor(offsets)[prompt]
        keep = (pos >= 0) & (pos < torch.tensor(lengths)[prompt])
        full = torch.zeros((len(lengths), width, *value.shape[1:]), dtype=value.dtype)
        full[prompt[keep], pos[keep]] = value[keep]
        # Pattern rows arrive as [q, heads, k]; the point's axes are batch n_heads q_pos k_pos.
        out[address] = full.permute(0, 2, 1, 3).contiguous() if patterns else full
    return out


def _padded(value: Tensor, lengths: tuple[int, ...], width: int) -> Tensor:
    """Rows of prompt after prompt, each whole -> [n_prompts, width, ...], zeros past each end."""
    if all(n == width for n in lengths):
        return value.view(len(lengths), width, *value.shape[1:])
    # One op, its per-prompt copies in C++: a Python loop over prompts cost every address ~prompts x 10 us.
    return torch.nn.utils.rnn.pad_sequence(value.split(lengths), batch_first=True)


def flatten(flat: dict[str, Tensor], reads: tuple[Address, ...], lengths: tuple[int, ...]) -> dict[Address, Tensor]:
    """Rows keyed by (prompt, position) -> [sum(lengths), ...], prompt after prompt, each position once."""
    starts = torch.tensor((0, *lengths)).cumsum(0)
    total = int(starts[-1])
    in_order: dict[int, Tensor | None] = {}  # per index (shared by keys): None if in order, else where rows go
    out = {}
    for address in reads:
        prompt, pos, value = rows(flat, address)
        if id(pos) not in in_order:
            index = starts[prompt] + pos
            seen = torch.zeros(total, dtype=torch.bool)
            seen[index] = True
            if len(index) != total or not seen.all():
                raise BackendError(f"internal: the workers recorded {len(index)} rows at {address} for {total} "
                                   f"prompt tokens ({int(seen.sum())} distinct)")
            in_order[id(pos)] = None if torch.equal(index, torch.arange(total)) else index
        if (index := in_order[id(pos)]) is None:  # recorded in order already (the usual case): no copy
            out[address] = value
            continue
        out_rows = torch.empty_like(value)
        out_rows[index] = value
        out[address] = out_rows
    return out
