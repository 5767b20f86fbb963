"""Which rows of a vLLM step belong to which call: the per-step map every hook reads (`worker.StepState`)."""

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from interp_engine.backends.vllm import compat, wire
from interp_engine.backends.vllm.calls import WorkerCall
from interp_engine.edits import Step


@dataclass
class Active:
    """One call in one step: its rows, and where they sit in its prompts."""

    call: WorkerCall
    rows: Tensor  # indices into this step's flattened rows
    step: Step  # [1, n] view of those rows
    whole: bool = False  # rows are 0..n-1 of the step, in order: use the tensor as it is
    prompts_cpu: Tensor | None = None  # the step's (prompt, position) of each row, copied to the host once
    positions_cpu: Tensor | None = None
    ended: tuple[int, ...] = ()  # prompts whose last position is in this step


def calls_in_step(runner, calls: dict[str, WorkerCall], positions: Tensor) -> list[Active]:
    """This step's installed calls with their rows (`positions`: the step's, on the model's device)."""
    req_ids, qsl = compat.step_requests(runner)
    groups: dict[str, list[tuple[int, int, int, int]]] = {}  # call -> its requests' (start, end, prompt, length)
    for j, req_id in enumerate(req_ids):
        tag = wire.read_tag(compat.request_extra_args(runner, req_id))
        if tag is not None and tag.get("call") in calls:
            groups.setdefault(tag["call"], []).append((qsl[j], qsl[j + 1], int(tag["prompt"]),
                                                       int(tag["length"])))
    active: list[Active] = []
    if not groups:
        return active
    # Every call's rows, call after call, as one [5, rows] table (row, prompt, length, position, last) built on
    # the host by a few numpy ops a step, not per call or row (a step of 32 clients holds 32 calls); on the CPU
    # without a tensor op at all: torch's per-op dispatch was most of the ~0.3 ms this map took a step.
    spans = np.array([s for group in groups.values() for s in group], dtype=np.int64)
    counts = spans[:, 1] - spans[:, 0]
    host = np.empty((5, int(counts.sum())), dtype=np.int64)
    host[0] = np.repeat(spans[:, 0] - (np.cumsum(counts) - counts), counts) + np.arange(host.shape[1])
    host[1], host[2] = np.repeat(spans[:, 2], counts), np.repeat(spans[:, 3], counts)
    if positions.device.type == "cpu":
        host[3] = positions.numpy()[host[0]]
        # "last" is the last prompt token while prefilling, the newest token while generating.
        host[4] = np.where(host[3] < host[2], host[2] - 1, host[3])
        cols = pos_host = torch.from_numpy(host)
    else:  # one copy to the device, the positions brought back in one
        cols = torch.from_numpy(host).to(positions.device)
        cols[3] = positions.index_select(0, cols[0]).long()
        cols[4] = torch.where(cols[3] < cols[2], cols[2] - 1, cols[3])
        pos_host = torch.from_numpy(host)
        pos_host[3] = cols[3].cpu()
    ended = host[3] == host[2] - 1
    start = 0
    for call_id, group in groups.items():
        end = start + sum(b - a for a, b, _, _ in group)
        whole = group[0][0] == 0 and group[-1][1] == len(positions) and \
            all(b == a for (_, b, _, _), (a, _, _, _) in zip(group, group[1:]))
        part, mine = cols[:, start:end], pos_host[:, start:end]
        done = tuple(host[1, start:end][ended[start:end]].tolist())
        active.append(Active(calls[call_id], part[0], Step(part[3:4], part[4:5], part[2:3], part[1:2]), whole,
                             mine[1], mine[3], done))
        start = end
    return active
