"""The worker side: a `worker_extension_cls` mixed into every vLLM worker.

The driver sends each call's hook table as plain data (`ie_install`), tags its requests with
`extra_args["interp_engine"] = {"call", "prompt", "length"}`, and fetches results as safetensors bytes
(`ie_collect`). Hooks exist only while at least one call is installed. Each step, the rows of the flattened
batch are mapped back to (call, prompt, position) from the model runner, and every call's ops run on its own
rows only, through the same `edits.apply` the eager backend uses.
"""

from dataclasses import dataclass, field

import torch
from safetensors.torch import save, save_file
from torch import Tensor

from interp_engine.addresses import Address
from interp_engine.edits import Step, apply
from interp_engine.spec import Spec

TAG = "interp_engine"
EMBED, FINAL, LOGITS = Address("embed"), Address("final"), Address("logits")
# Results smaller than this go back through the RPC answer: for them a file's create, write, read and unlink
# cost more than the bytes do.
FILE_MIN_BYTES = 4 << 20


@dataclass
class WorkerCall:
    """One driver call's table, and what was recorded for it (per address: (prompt, position, value) rows)."""

    ops: dict[Address, tuple]
    reads: frozenset[Address]
    width: int = 0  # longest prompt: attention-pattern rows are padded to it
    lens: frozenset[Address] = frozenset()  # points read through the final norm and unembedding, here
    records: dict[Address | str, list[tuple[Tensor, Tensor, Tensor]]] = field(default_factory=dict)
    keys: dict[tuple[int, int], list[tuple[Tensor, Tensor]]] = field(default_factory=dict)  # (prompt, layer)

    @classmethod
    def from_table(cls, table: dict) -> "WorkerCall":
        ops: dict[Address, list] = {}
        for op in Spec.from_dict(table["spec"]).ops:
            ops.setdefault(op.point, []).append(op)
        return cls({a: tuple(o) for a, o in ops.items()}, frozenset(Address.parse(r) for r in table["reads"]),
                   int(table.get("width", 0)), frozenset(Address.parse(r) for r in table.get("lens", ())))

    def wants(self, address: Address) -> bool:
        return address in self.ops or address in self.reads or address in self.lens


@dataclass
class Active:
    call: WorkerCall
    rows: Tensor  # indices into this step's flattened rows
    step: Step  # [1, n] view of those rows
    whole: bool = False  # rows are 0..n-1 of the step, in order: use the tensor as it is
    prompts_cpu: Tensor | None = None  # the step's (prompt, position) of each row, copied to the host once
    positions_cpu: Tensor | None = None


class InterpExtension:
    """Methods callable by name through `collective_rpc`. Names start with `ie_` to stay clear of the worker's."""

    def ie_install(self, table: dict) -> bool:
        calls = self._ie_calls()
        calls[table["call"]] = WorkerCall.from_table(table)
        self._ie_rehook()
        return True

    def ie_collect(self, call_id: str, path: str = "", host: str = "") -> bytes | str:
        """A call's results, and its removal. Rank 0 answers; other ranks return empty bytes. With `path` (a
        file the driver can read, normally in /dev/shm), the driver on this host and results of at least
        FILE_MIN_BYTES, the results go there and the path comes back: far cheaper than pushing hundreds of MB
        through the RPC channel. Smaller results, and a worker on another node (Ray, multi-node), answer with
        bytes."""
        import socket

        if host and host != socket.gethostname():
            path = ""
        call = self._ie_calls().pop(call_id, None)
        self._ie_rehook()
        if call is None or self._ie_rank() != 0:
            return b""
        join = lambda parts: parts[0] if len(parts) == 1 else torch.cat(parts)  # noqa: E731
        out: dict[str, Tensor] = {}
        for address, chunks in call.records.items():
            out[f"{address}|prompt"] = torch.cat([c[0] for c in chunks])  # small; shared by every address
            out[f"{address}|pos"] = torch.cat([c[1] for c in chunks])
            out[f"{address}|value"] = join([c[2] for c in chunks]).contiguous()
        if path and sum(t.nbytes for t in out.values()) >= FILE_MIN_BYTES:
            save_file(out, path)
            return path
        return save(out) if out else b""

    def ie_release(self, call_id: str) -> bool:
        self._ie_calls().pop(call_id, None)
        self._ie_rehook()
        return True

    def ie_status(self) -> dict:
        """For leak checks: installed calls and hooks in this worker."""
        return {"calls": len(self._ie_calls()), "hooks": len(getattr(self, "_ie_handles", []))}

    # ------------------------------------------------------------------------------------------- internals
    def _ie_calls(self) -> dict[str, WorkerCall]:
        if not hasattr(self, "_ie_table"):
            self._ie_table = {}
        return self._ie_table

    def _ie_rank(self) -> int:
        from vllm.distributed import get_tensor_model_parallel_rank

        return get_tensor_model_parallel_rank()

    def _ie_rehook(self) -> None:
        for handle in getattr(self, "_ie_handles", []):
            handle.remove()
        self._ie_handles = []
        calls = self._ie_calls()
        if calls:
            self._ie_handles = install(self.model_runner, calls)


class Shards:
    """Tensor-parallel gather and split of sharded points (heads, MLP neurons). Every rank calls these in the
    same order (the decision to gather depends only on the broadcast schedule), so the collectives match."""

    def __init__(self, config):
        from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

        self.size, self.rank = get_tensor_model_parallel_world_size(), get_tensor_model_parallel_rank()
        self.kv_total = getattr(config, "num_key_value_heads", None) or config.num_attention_heads

    def gather(self, x: Tensor, dim: int) -> Tensor:
        if self.size == 1:
            return x
        from vllm.distributed import tensor_model_parallel_all_gather

        return tensor_model_parallel_all_gather(x.contiguous(), dim=dim)

    def gather_kv(self, x: Tensor) -> Tensor:
        """[T, local kv heads, D] -> [T, kv heads, D]; with more ranks than kv heads each head is replicated
        on `size // kv_total` ranks, so keep one copy of each."""
        full = self.gather(x, 1)
        replicas = max(1, self.size // self.kv_total)
        return full if replicas == 1 else full[:, ::replicas]

    def split(self, full: Tensor, dim: int, local: int) -> Tensor:
        return full if self.size == 1 else full.narrow(dim, self.rank * local, local)

    def split_kv(self, full: Tensor, local: int) -> Tensor:
        replicas = max(1, self.size // self.kv_total)
        return full if self.size == 1 else full.narrow(1, (self.rank // replicas) * local, local)


def _layout(runner):
    from interp_engine.arch import arch_for

    return arch_for(runner.model_config.hf_config).vllm


class StepState:
    """Per forward: which rows belong to which call, built at the first layer's pre-hook."""

    def __init__(self, runner, calls: dict[str, WorkerCall]):
        self.runner, self.calls = runner, calls
        self.shards = Shards(runner.model_config.hf_config)
        model = runner.get_model()
        norm = model.get_submodule(_layout(runner).final_norm)
        # Every rank runs this (compute_logits gathers the vocab-parallel shards, a collective).
        # norm.forward, not norm(): hooks on the final norm belong to the model's own final, not to a lens read.
        self.lens = lambda x: torch.log_softmax(model.compute_logits(norm.forward(x)).float(), dim=-1)
        self.active: list[Active] = []

    def begin(self, positions: Tensor) -> None:
        batch = self.runner.input_batch
        n = batch.num_reqs
        qsl = self.runner.query_start_loc.np[: n + 1].tolist()
        groups: dict[str, tuple[list, list, list]] = {}
        for j, req_id in enumerate(batch.req_ids[:n]):
            params = self.runner.requests[req_id].sampling_params
            tag = (params.extra_args or {}).get(TAG) if params is not None else None
            if not isinstance(tag, dict) or tag.get("call") not in self.calls:
                continue
            rows, prompts, lengths = groups.setdefault(tag["call"], ([], [], []))
            count = qsl[j + 1] - qsl[j]
            rows.append(torch.arange(qsl[j], qsl[j + 1]))
            prompts.append(torch.full((count,), int(tag["prompt"])))
            lengths.append(torch.full((count,), int(tag["length"])))
        self.active = []
        device = positions.device
        for call_id, (rows, prompts, lengths) in groups.items():
            rows = torch.cat(rows).to(device)
            pos = positions.index_select(0, rows).long()
            length = torch.cat(lengths).to(device)
            # "last" is the last prompt token while prefilling, the newest token while generating.
            last = torch.where(pos < length, length - 1, pos)
            step = Step(pos[None], last[None], length[None], torch.cat(prompts).to(device)[None])
            whole = len(rows) == len(positions) and bool((rows == torch.arange(len(rows), device=device)).all())
            self.active.append(Active(self.calls[call_id], rows, step, whole, step.prompt_index[0].cpu(),
                                      pos.cpu()))

    def touch(self, address: Address, x: Tensor) -> Tensor:
        """x is [rows, ...]: apply each call's ops on its rows and record its reads. Out of place; returns x
        itself when nothing changed."""
        for active in self.active:
            call = active.call
            if not call.wants(address):
                continue
            whole = active.whole
            mine = x[None] if whole else x.index_select(0, active.rows)[None]
            edited = mine
            for op in call.ops.get(address, ()):
                edited = apply(op, edited, address.info, active.step)
            # One copy per read: index_select already made one, unless these rows are the whole step.
            self.keep(active, address, edited[0], copied=not (edited is mine and whole))
            if edited is not mine:
                x = edited[0].to(x.dtype) if whole else x.index_copy(0, active.rows, edited[0].to(x.dtype))
        return x

    def keep(self, active: Active, address: Address, rows: Tensor, *, copied: bool) -> None:
        """Record a call's rows at `address` (and their logit lens, if it asked). `copied`: `rows` is not a view
        of a tensor the model goes on using."""
        call, where = active.call, (active.prompts_cpu, active.positions_cpu)
        if address in call.reads:
            kept = rows.detach() if copied else rows.detach().clone()
            call.records.setdefault(address, []).append((*where, kept.cpu()))
        if address in call.lens:
            call.records.setdefault(f"lens:{address}", []).append((*where, self.lens(rows).cpu()))


def install(runner, calls: dict[str, WorkerCall]) -> list:
    """Register the hooks these calls need on the runner's model; return their handles."""
    layout = _layout(runner)
    model = runner.get_model()
    state = StepState(runner, calls)
    needed = set().union(*(c.ops.keys() | c.reads | c.lens for c in calls.values()))
    handles = []
    for i, layer in enumerate(model.get_submodule(layout.layers)):
        handles += _layer_hooks(layer, i, layout, state, needed)
    if FINAL in needed or LOGITS in needed:
        handles.append(model.get_submodule(layout.final_norm).register_forward_hook(
            lambda m, args, out: _final(model, state, out, LOGITS in needed)))
    return handles


def _final(model, state: StepState, out, want_logits: bool):
    normed = out[0] if isinstance(out, tuple) else out
    edited = state.touch(FINAL, normed)
    if want_logits:
        # All ranks compute (the vocab-parallel gather is a collective); rank 0's copy is returned.
        state.touch(LOGITS, model.compute_logits(edited))
    if edited is normed:
        return None
    return (edited, *out[1:]) if isinstance(out, tuple) else edited


def _layer_args(args, kwargs):
    names = ("positions", "hidden_states", "residual")
    values = list(args) + [kwargs.get(n) for n in names[len(args):]]
    return values[0], values[1], values[2]


def _with_layer_args(args, kwargs, hidden, residual):
    if len(args) >= 3:
        return (args[0], hidden, residual, *args[3:]), kwargs
    if len(args) == 2:
        return (args[0], hidden), {**kwargs, "residual": residual}
    return args, {**kwargs, "hidden_states": hidden, "residual": residual}


def _layer_hooks(layer, i: int, layout, state: StepState, needed: set) -> list:
    at = lambda point: Address(point, i)  # noqa: E731
    wants = lambda point: at(point) in needed  # noqa: E731
    handles = []
    attention = layer.get_submodule(layout.attention)

    if i == 0 or wants("resid_pre"):
        def layer_in(module, args, kwargs):
            positions, hidden, residual = _layer_args(args, kwargs)
            if i == 0:
                state.begin(positions)
            if not state.active:
                return None
            x = hidden if residual is None else hidden + residual
            start = x
            if i == 0 and EMBED in needed:
                x = state.touch(EMBED, x)
            x = state.touch(at("resid_pre"), x)
            if x is start:
                return None
            # vLLM carries the stream as (hidden, residual) and adds them first thing: hand it (x, 0).
            return _with_layer_args(args, kwargs, x, None if residual is None else torch.zeros_like(residual))
        handles.append(layer.register_forward_pre_hook(layer_in, with_kwargs=True))

    patterns = wants("attn_scores") or wants("attn_probs")
    if any(wants(p) for p in ("q", "k", "v")) or patterns:
        def attn_in(module, args):
            if not state.active:
                return None
            q, k, v = args[:3]
            shards = state.shards
            new, full = [], {}
            for point, t, local in (("q", q, attention.num_heads), ("k", k, attention.num_kv_heads),
                                    ("v", v, attention.num_kv_heads)):
                if wants(point) or (patterns and point in "qk"):
                    heads = t.reshape(t.shape[0], local, -1)
                    gathered = shards.gather(heads, 1) if point == "q" else shards.gather_kv(heads)
                    edited = state.touch(at(point), gathered) if wants(point) else gathered
                    full[point] = edited
                    if edited is not gathered:
                        mine = shards.split(edited, 1, local) if point == "q" else shards.split_kv(edited, local)
                        t = mine.reshape(t.shape).to(t.dtype)
                new.append(t)
            if patterns:  # recomputed from the q and k the kernel will see, after any edits to them
                record_patterns(state, i, full["q"], full["k"], attention)
            if all(a is b for a, b in zip(new, (q, k, v))):
                return None
            return (*new, *args[3:])
        handles.append(attention.register_forward_pre_hook(attn_in))

    if wants("z"):
        def z_in(module, args):
            if not state.active:
                return None
            local = attention.num_heads
            z = state.shards.gather(args[0].reshape(args[0].shape[0], local, -1), 1)
            edited = state.touch(at("z"), z)
            if edited is z:
                return None
            return (state.shards.split(edited, 1, local).reshape(args[0].shape).to(args[0].dtype), *args[1:])
        handles.append(layer.get_submodule(layout.o_proj).register_forward_pre_hook(z_in))

    if wants("attn_out"):
        def attn_out(module, args, out):
            if not state.active:
                return None
            a = state.touch(at("attn_out"), out)
            return None if a is out else a
        handles.append(layer.get_submodule(layout.attn_out).register_forward_hook(attn_out))

    if wants("resid_mid"):
        def mid_in(module, args):
            if not state.active:
                return None
            hidden, residual = args[:2]  # (attn_out, resid_pre): the norm adds them first thing
            r = hidden + residual
            edited = state.touch(at("resid_mid"), r)
            # Hand it (edited, 0), as layer_in does: a zeroed stream stays exactly zero through the norm.
            return None if edited is r else (edited, torch.zeros_like(residual), *args[2:])
        handles.append(layer.get_submodule(layout.mid_norm).register_forward_pre_hook(mid_in))

    if wants("mlp_act"):
        def mlp_in(module, args):
            if not state.active:
                return None
            local = args[0].shape[-1]
            act = state.shards.gather(args[0], -1)
            edited = state.touch(at("mlp_act"), act)
            return None if edited is act else (state.shards.split(edited, -1, local).to(args[0].dtype), *args[1:])
        handles.append(layer.get_submodule(layout.mlp_down).register_forward_pre_hook(mlp_in))

    if wants("mlp_out"):
        def mlp_out(module, args, out):
            if not state.active:
                return None
            edited = state.touch(at("mlp_out"), out)
            return None if edited is out else edited
        handles.append(layer.get_submodule(layout.mlp_out).register_forward_hook(mlp_out))

    if wants("resid_post"):
        def layer_out(module, args, out):
            if not state.active:
                return None
            hidden, residual = out
            x = hidden + residual
            edited = state.touch(at("resid_post"), x)
            return None if edited is x else (edited, torch.zeros_like(residual))
        handles.append(layer.register_forward_hook(layer_out))
    return handles


def record_patterns(state: StepState, layer: int, q: Tensor, k: Tensor, attention) -> None:
    """attn_scores / attn_probs rows for the calls that read them, from post-rotary q and every key so far.

    q and k arrive gathered ([rows, heads, d_head]). Keys are kept per (prompt, layer) across steps, so a
    chunked prefill still sees its earlier chunks."""
    scores_at, probs_at = Address("attn_scores", layer), Address("attn_probs", layer)
    n_heads, n_kv = q.shape[1], k.shape[1]
    scale = attention.impl.scale
    cap = getattr(attention.impl, "logits_soft_cap", None) or None
    window = getattr(attention, "sliding_window", None)
    for active in state.active:
        call = active.call
        if scores_at not in call.reads and probs_at not in call.reads:
            continue
        q_rows = q.index_select(0, active.rows).float()
        k_rows = k.index_select(0, active.rows).float()
        prompts, positions, lengths = active.step.prompt_index[0], active.step.abs_pos[0], active.step.lengths[0]
        for prompt in prompts.unique().tolist():
            mine = prompts == prompt
            length = int(lengths[mine][0])
            stash = call.keys.setdefault((prompt, layer), [])
            stash.append((positions[mine], k_rows[mine]))
            key_pos = torch.cat([p for p, _ in stash])
            keys = torch.cat([t for _, t in stash]).repeat_interleave(n_heads // n_kv, dim=1)
            q_pos = positions[mine]
            scores = torch.einsum("qhd,khd->qhk", q_rows[mine], keys) * scale
            if cap:
                scores = torch.tanh(scores / cap) * cap
            masked = key_pos[None, :] > q_pos[:, None]
            if window:
                masked |= (q_pos[:, None] - key_pos[None, :]) >= window
            scores = scores.masked_fill(masked[:, None, :], float("-inf"))
            for address, values in ((scores_at, scores), (probs_at, torch.softmax(scores, dim=-1))):
                if address not in call.reads:
                    continue
                row = torch.zeros((len(q_pos), n_heads, call.width), dtype=q.dtype, device=q.device)
                if address is scores_at:  # keys of later chunks, not seen yet, are future keys: masked
                    row[:, :, :length] = float("-inf")
                row[:, :, key_pos] = values.to(q.dtype)
                call.records.setdefault(address, []).append(
                    (torch.full((len(q_pos),), prompt).cpu(), q_pos.cpu(), row.cpu()))
