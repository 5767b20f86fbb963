"""vllm-static: Splice compiled into the graph, with the SAEs declared at load (`Taps.splices`), and the Clamps of
those of them that are topk or normalised (`SAE.acts_per_feature` false: static_clamp.py cannot encode them).

Each SAE declared at a point holds its tensors in buffers of that point's tap, allocated at load from the
declared shapes and filled once, from the first call that splices with it (the driver checked that the call's SAE
is a declared one, by content: `SAE.key`; on the worker it is the SAE kept under that key, `sae.KEPT`). The traced
body runs `SAE.spliced`'s own arithmetic (its activation and normalisation: relu, jumprelu, topk, any of them) on
those buffers at every row, since a compiled graph cannot branch on a request, then keeps per row, by
`torch.where`, x itself (rows that do not splice are x bit for bit), the reconstruction, or the reconstruction
plus its error term. It runs after the point's (mul, add) write tap and clamp tap, before the read, which is why
the driver accepts one Clamp or Splice per point per call, after that point's other ops (validate.py).

A Clamp of a topk or normalised declared SAE takes `CLAMP_SLOTS` slots of that SAE's features (their indices,
and per row a count and a target), moved by `SAE.clamped_per_row` from the same whole encode as the
reconstruction; rows that clamp take it by `torch.where` on a per-row clamp mask.

The cost: every step encodes and decodes every row with each declared SAE at the point, splicing or not.
"""

import torch
from torch import Tensor

from interp_engine.edits import select
from interp_engine.sae import KEPT, SAE
from interp_engine.spec import Clamp, Splice
from interp_engine.taps import CLAMP_SLOTS, DeclaredSAE
from interp_engine.tensor_data import SPEC_DTYPES, TensorData


class SpliceTap:
    def __init__(self, declared: tuple[DeclaredSAE, ...], rows: int, device):
        self.declared = declared
        self.saes: list[tuple[SAE, dict[str, Tensor], _Slots | None]] = []
        for d in declared:
            w = {name: torch.zeros(shape, dtype=SPEC_DTYPES[dtype], device=device) for name, shape, dtype in d.tensors}
            # The declared SAE over the buffers: its settings and shapes drive the arithmetic, `w` is what it reads.
            tensors = {name: TensorData._trusted(t, f"sae:{d.key}.{name}") for name, t in w.items()}
            sae = SAE(**tensors, reads=d.reads, **dict(d.settings))
            self.saes.append((sae, w, None if sae.acts_per_feature else _Slots(rows, w["W_enc"].dtype, device)))
        self.on = torch.zeros((len(declared), rows), dtype=torch.bool, device=device)
        self.error = torch.zeros((rows, 1), dtype=torch.bool, device=device)
        self.filled: set[str] = set()

    def __call__(self, x: Tensor) -> Tensor:
        """The traced body: x (n, ...) with this step's splices and whole-encode clamps applied."""
        n = x.shape[0]
        flat = x.reshape(n, -1)
        for i, (sae, w, slots) in enumerate(self.saes):
            if slots is None:
                x_hat = sae.spliced(flat, False, w)
            else:
                moved, x_hat = sae.clamped_per_row(flat, slots.index, slots.count[:n], slots.target[:n], w)
            new = torch.where(self.error[:n], x_hat + (flat - x_hat), x_hat)  # error=True as SAE.spliced adds it
            if slots is not None:  # a row clamps or splices at a point, never both (one such op per call)
                new = torch.where(slots.on[:n], moved, new)
                on = self.on[i, :n, None] | slots.on[:n]
            else:
                on = self.on[i, :n, None]
            flat = torch.where(on, new, flat)
        return flat.view(x.shape)

    def fill(self, editing: list, address) -> None:
        """The rows of this step's calls (each an `Active`) that splice, or clamp with a topk or normalised SAE, at
        `address`, and the buffers of an SAE used for the first time. A call whose clamp finds no free slot fails
        alone (its rows stay x)."""
        for slots in (s for _, _, s in self.saes if s is not None):
            slots.taken.clear()
        for active in editing:
            for op in (o for o in active.call.ops[address]
                       if isinstance(o, Splice) or (isinstance(o, Clamp) and not o.sae.acts_per_feature)):
                i = next((i for i, d in enumerate(self.declared) if KEPT.get(d.key) is op.sae), None)
                if i is None:  # pragma: no cover - the driver refuses an undeclared SAE (validate.py)
                    active.call.fail(f"{type(op).__name__} at {address}: its SAE was not declared at load.",
                                     in_spec=True)
                    continue
                mask = select(op.positions, active.step)
                rows = active.rows if mask is None else active.rows[mask[0].to(active.rows.device)]
                if isinstance(op, Clamp) and not self.saes[i][2].take(op, rows):
                    active.call.fail(f"Clamp at {address}: this step's calls clamp more than {CLAMP_SLOTS} distinct "
                                     "features of one SAE (the slots a vllm-static tap holds); run fewer such calls "
                                     'at once, or use backend="vllm".', in_spec=True)
                    continue
                if (key := self.declared[i].key) not in self.filled:
                    for name, buffer in self.saes[i][1].items():
                        buffer.copy_(getattr(op.sae, name).tensor)
                    self.filled.add(key)
                if isinstance(op, Splice):
                    self.on[i, rows] = True
                    self.error[rows] = op.error

    def reset(self, n: int) -> None:
        self.on[:, :n] = False
        for slots in (s for _, _, s in self.saes if s is not None):
            slots.reset(n)


class _Slots:
    """One whole-encode SAE's clamp slots: which feature each holds, and per row a count, a target and a mask."""

    def __init__(self, rows: int, dtype, device):
        self.index = torch.zeros(CLAMP_SLOTS, dtype=torch.long, device=device)
        self.count = torch.zeros((rows, CLAMP_SLOTS), dtype=dtype, device=device)
        self.target = torch.zeros((rows, CLAMP_SLOTS), dtype=dtype, device=device)
        self.on = torch.zeros((rows, 1), dtype=torch.bool, device=device)
        self.taken: dict[int, int] = {}  # feature -> slot, this step
        self.held: list[int | None] = [None] * CLAMP_SLOTS  # the feature each slot's index holds: reused as is

    def take(self, op: Clamp, rows: Tensor) -> bool:
        """Slots for this Clamp's features on `rows`; False (nothing taken) when they do not fit."""
        if len(self.taken.keys() | set(op.features)) > CLAMP_SLOTS:
            return False
        for feature in op.features:
            if feature not in self.taken:
                self.taken[feature] = j = len(self.taken)
                if self.held[j] != feature:
                    self.index[j] = feature
                    self.held[j] = feature
            self.count[rows, self.taken[feature]] += 1
            self.target[rows, self.taken[feature]] = op.to
        self.on[rows] = True
        return True

    def reset(self, n: int) -> None:
        self.count[:n].zero_()
        self.on[:n] = False
