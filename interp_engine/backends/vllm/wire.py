"""The driver/worker protocol of the vLLM backends, written once and imported by both sides.

- Requests of a call carry `extra_args[TAG] = {"call", "prompt", "length"}` (see `tag`); the engine's request
  ids are `request_id(call, i)`.
- The driver calls the workers' `InterpExtension` methods by the names below, with plain data: a table
  (`table`) in, results out.
- A call that failed in a worker (its failure contained there, the engine serving on) is answered by `COLLECT`
  with `failure(...)`, `{ERROR: message, IN_SPEC: bool}`, from every rank that failed; `result` turns it into
  the library's error.
- Results are rows keyed by (prompt, position): per recorded key three tensors, `key|prompt`, `key|pos` and
  `key|value`, where the key is the address (`str(address)`), or `lens:` + the address for a logit-lens read.
  They travel as safetensors bytes, or, on one host and when large, as a safetensors file the driver names
  (normally in /dev/shm) and deletes.
"""

import os
import socket
import tempfile
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from interp_engine.addresses import Address
from interp_engine.errors import BackendError, SpecError, fix

TAG = "interp_engine"
CONFIG_KEY = TAG  # vllm-static: the engine's `additional_config` key holding its taps

# RPC methods of `worker.InterpExtension` (names start with ie_ to stay clear of the worker's own).
INSTALL = "ie_install"
COLLECT = "ie_collect"
RELEASE = "ie_release"
STATUS = "ie_status"
METHODS = (INSTALL, COLLECT, RELEASE, STATUS)

ERROR = "interp_engine_error"  # a failed call's COLLECT answer: the message the driver raises
IN_SPEC = "in_spec"  # ...and whether an op failed (SpecError) rather than a read (BackendError)
LENS = "lens:"  # key prefix of a logit-lens read (log-probs computed in the worker)
# Results smaller than this go back through the RPC answer: for them a file's create, write, read and unlink
# cost more than the bytes do.
FILE_MIN_BYTES = 4 << 20


# ------------------------------------------------------------------------------------------- requests

def request_id(call: str, index: int) -> str:
    return f"{TAG}-{call}-{index}"


def tag(call: str, prompt: int, length: int) -> dict[str, Any]:
    """A request's `extra_args`: which call it belongs to, which prompt it is and how long that prompt is."""
    return {TAG: {"call": call, "prompt": prompt, "length": length}}


def read_tag(extra_args: Mapping | None) -> dict | None:
    """The tag of a request's `extra_args` (None: not one of ours)."""
    found = (extra_args or {}).get(TAG)
    return found if isinstance(found, dict) else None


# ------------------------------------------------------------------------------------------- tables

def table(call: str, spec: dict, fingerprint: str, reads, *, width: int = 0, lens=()) -> dict[str, Any]:
    """What `INSTALL` takes: the call id, its spec (`Spec.to_dict`, already validated by the driver, with its
    fingerprint), the addresses it reads, the padded width of pattern rows, and the addresses it lenses."""
    return {"call": call, "spec": spec, "fingerprint": fingerprint, "reads": [str(a) for a in reads],
            "width": width, "lens": [str(a) for a in lens]}


def table_call(table: dict[str, Any]) -> str:
    """The call id an INSTALL table belongs to."""
    return table["call"]


# ------------------------------------------------------------------------------------------- failures

def failure(message: str, *, in_spec: bool) -> dict[str, Any]:
    """Worker side: `COLLECT`'s answer for a call that failed on this rank."""
    return {ERROR: message, IN_SPEC: in_spec}


def recording_failed(address: Address | str, error: Exception) -> str:
    """A contained failure to record a call's rows (not the spec's doing): the message the driver raises."""
    return fix(f"recording {address} failed ({type(error).__name__}: {str(error).strip()[:300]}).",
               "retry the call; if it fails again, capture fewer points or prompts at once, or report it as an "
               "interp_engine bug.")


def refused(error: Exception) -> BackendError:
    """Driver side: the library's error for workers that refused a call's table (`INSTALL` raised)."""
    return BackendError(fix(f"the vLLM workers refused this call's table ({error}); the engine serves on.",
                            "this request passed the checks before it, so please report it (with Spec.to_dict()) "
                            'as an interp_engine bug; backend="eager" runs it.'))


def result(answers: list) -> bytes | str:
    """Driver side: rank 0's `COLLECT` answer, or the library's error for a call any rank failed."""
    for answer in answers:
        if isinstance(answer, Mapping) and isinstance(answer.get(ERROR), str):
            kind = SpecError if answer.get(IN_SPEC) else BackendError
            raise kind(f"This call failed inside the vLLM workers (only it: the engine goes on serving other "
                       f"calls). {answer[ERROR]}")
    return answers[0]


# ------------------------------------------------------------------------------------------- results

def key(address: Address | str, *, lens: bool = False) -> str:
    return f"{LENS if lens else ''}{address}"


def encode(records: Mapping[str, list[tuple[Tensor, Tensor, Tensor]]], *, path: str = "") -> bytes | str:
    """Worker side: per key, (prompt, position, value) chunks -> safetensors bytes, or, with `path` and at
    least FILE_MIN_BYTES, a file at `path` whose name is returned."""
    from safetensors.torch import save, save_file

    join = lambda parts: parts[0] if len(parts) == 1 else torch.cat(parts)  # noqa: E731
    out: dict[str, Tensor] = {}
    for name, chunks in records.items():
        out[f"{name}|prompt"] = torch.cat([c[0] for c in chunks])  # small; shared by every address
        out[f"{name}|pos"] = torch.cat([c[1] for c in chunks])
        out[f"{name}|value"] = join([c[2] for c in chunks]).contiguous()
    if path and sum(t.nbytes for t in out.values()) >= FILE_MIN_BYTES:
        save_file(out, path)
        return path
    return save(out) if out else b""


def decode(answer: bytes | str) -> dict[str, Tensor]:
    """Driver side: what `encode` returned -> the flat tensor dict."""
    from safetensors.torch import load, load_file

    if isinstance(answer, str) and answer:
        return load_file(answer)
    return load(answer) if answer else {}


def result_path(call: str) -> str:
    """Where a worker on this host may write a call's large results (the driver deletes it)."""
    folder = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    return os.path.join(folder, f"{TAG}-{os.getpid()}-{call}.safetensors")


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
    out = {}
    for address in reads:
        prompt, pos, value = rows(flat, address, lens=lens)
        if offsets is not None:
            pos = pos - torch.tensor(offsets)[prompt]
        keep = (pos >= 0) & (pos < torch.tensor(lengths)[prompt])
        full = torch.zeros((len(lengths), width, *value.shape[1:]), dtype=value.dtype)
        full[prompt[keep], pos[keep]] = value[keep]
        # Pattern rows arrive as [q, heads, k]; the point's axes are batch n_heads q_pos k_pos.
        patterns = address.info.pos_axis == 2 and not lens
        out[address] = full.permute(0, 2, 1, 3).contiguous() if patterns else full
    return out


def flatten(flat: dict[str, Tensor], reads: tuple[Address, ...], lengths: tuple[int, ...]) -> dict[Address, Tensor]:
    """Rows keyed by (prompt, position) -> [sum(lengths), ...], prompt after prompt, each position once."""
    starts = torch.tensor((0, *lengths)).cumsum(0)
    total = int(starts[-1])
    out = {}
    for address in reads:
        prompt, pos, value = rows(flat, address)
        index = starts[prompt] + pos
        seen = torch.zeros(total, dtype=torch.bool)
        seen[index] = True
        if len(index) != total or not seen.all():
            raise BackendError(f"internal: the workers recorded {len(index)} rows at {address} for {total} "
                               f"prompt tokens ({int(seen.sum())} distinct)")
        if torch.equal(index, torch.arange(total)):  # recorded in order already (the usual case): no copy
            out[address] = value
            continue
        out_rows = torch.empty_like(value)
        out_rows[index] = value
        out[address] = out_rows
    return out
