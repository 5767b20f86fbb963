"""vllm-static: Splice compiled into the graph, with the SAEs declared at load (`Taps.splices`).

Each SAE declared at a point holds its tensors in buffers of that point's tap, allocated at load from the
declared shapes and filled once, from the first call that splices with it (the driver checked that the call's SAE
is a declared one, by content: `SAE.key`; on the worker it is the SAE kept under that key, `sae.KEPT`). The traced
body runs `SAE.spliced`'s own arithmetic (its activation and normalisation: relu, jumprelu, topk, any of them) on
those buffers at every row, since a compiled graph cannot branch on a request, then keeps per row, by
`torch.where`, x itself (rows that do not splice are x bit for bit), the reconstruction, or the reconstruction
plus its error term. It runs after the point's (mul, add) write tap and clamp tap, before the read, which is why
the driver accepts one Clamp or Splice per point per call, after that point's other ops (validate.py).

The cost: every step encodes and decodes every row with each declared SAE at the point, splicing or not.
"""

import torch
from torch import Tensor

from interp_engine.edits import select
from interp_engine.sae import KEPT, SAE
from interp_engine.spec import Splice
from interp_engine.taps import DeclaredSAE
from interp_engine.tensor_data import SPEC_DTYPES, TensorData


class SpliceTap:
    def __init__(self, declared: tuple[DeclaredSAE, ...], rows: int, device):
        self.declared = declared
        self.saes: list[tuple[SAE, dict[str, Tensor]]] = []
        for d in declared:
            w = {name: torch.zeros(shape, dtype=SPEC_DTYPES[dtype], device=device) for name, shape, dtype in d.tensors}
            # The declared SAE over the buffers: its settings and shapes drive the arithmetic, `w` is what it reads.
            tensors = {name: TensorData._trusted(t, f"sae:{d.key}.{name}") for name, t in w.items()}
            self.saes.append((SAE(**tensors, reads=d.reads, **dict(d.settings)), w))
        self.on = torch.zeros((len(declared), rows), dtype=torch.bool, device=device)
        self.error = torch.zeros((rows, 1), dtype=torch.bool, device=device)
        self.filled: set[str] = set()

    def __call__(self, x: Tensor) -> Tensor:
        """The traced body: x (n, ...) with this step's splices applied."""
        n = x.shape[0]
        flat = x.reshape(n, -1)
        for i, (sae, w) in enumerate(self.saes):
            x_hat = sae.spliced(flat, False, w)
            new = torch.where(self.error[:n], x_hat + (flat - x_hat), x_hat)  # error=True as SAE.spliced adds it
            flat = torch.where(self.on[i, :n, None], new, flat)
        return flat.view(x.shape)

    def fill(self, editing: list, address) -> None:
        """The rows of this step's calls (each an `Active`) that splice at `address`, and the buffers of an SAE
        spliced with for the first time."""
        for active in editing:
            for op in (o for o in active.call.ops[address] if isinstance(o, Splice)):
                i = next((i for i, d in enumerate(self.declared) if KEPT.get(d.key) is op.sae), None)
                if i is None:  # pragma: no cover - the driver refuses an undeclared SAE (validate.py)
                    active.call.fail(f"Splice at {address}: its SAE was not declared at load.", in_spec=True)
                    continue
                if (key := self.declared[i].key) not in self.filled:
                    for name, buffer in self.saes[i][1].items():
                        buffer.copy_(getattr(op.sae, name).tensor)
                    self.filled.add(key)
                mask = select(op.positions, active.step)
                rows = active.rows if mask is None else active.rows[mask[0].to(active.rows.device)]
                self.on[i, rows] = True
                self.error[rows] = op.error

    def reset(self, n: int) -> None:
        self.on[:, :n] = False
