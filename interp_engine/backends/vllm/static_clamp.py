"""vllm-static: SAE feature clamps compiled into the graph, at points declared at load with an SAE in
`static_writes` (`Taps.clamps`).

A clamp sets features i to values t, error term kept: `x + sum_i (t_i - f_i(x)) W_dec[i]`; for relu and jumprelu
SAEs without normalisation (`SAE.acts_per_feature`; the others clamp in their splice tap, static_splice.py) `f_i`
needs only encoder column i, its bias and threshold. So the tap holds `CLAMP_SLOTS` slots, each one (SAE, feature)
pair: its encoder column, bias (`b_enc - b_dec @ W_enc` where SAELens subtracts b_dec first), threshold (0 for
relu: `relu(p) * (p > 0) == relu(p)`) and decoder row, filled on the host before each step from the clamps of
that step's calls (their SAEs arrived with their tables), and per row a count and a target per slot. The traced
body is tensor ops on those buffers only; rows of calls that clamp nothing have count 0, so x passes unchanged
(`x + 0`). It runs after the `(mul, add)` write tap and before the read, which is why the driver accepts one
Clamp per point per call, after that point's other ops (validate.py).
"""

import torch
from torch import Tensor

from interp_engine.edits import select
from interp_engine.spec import Clamp
from interp_engine.taps import CLAMP_SLOTS


class ClampTap:
    def __init__(self, rows: int, width: int, device):
        def zeros(*shape):  # float32 whatever the model's dtype: the SAE encodes in its own, as on eager
            return torch.zeros(shape, dtype=torch.float32, device=device)
        self.enc, self.bias, self.threshold = zeros(width, CLAMP_SLOTS), zeros(CLAMP_SLOTS), zeros(CLAMP_SLOTS)
        self.dec = zeros(CLAMP_SLOTS, width)
        self.count, self.target = zeros(rows, CLAMP_SLOTS), zeros(rows, CLAMP_SLOTS)
        self.held: dict[int, tuple] = {}  # slot -> the (SAE, feature) its buffers hold: a decode step refills none

    def __call__(self, x: Tensor) -> Tensor:
        """The traced body: x (n, ...) with this step's clamps applied."""
        n = x.shape[0]
        flat = x.reshape(n, -1)
        pre = flat.to(self.enc.dtype) @ self.enc + self.bias
        f = pre.relu() * (pre > self.threshold).to(pre.dtype)
        return (flat + ((self.count[:n] * (self.target[:n] - f)) @ self.dec).to(flat.dtype)).view(x.shape)

    def fill(self, editing: list, address) -> bool:
        """Slots and rows for this step's calls that clamp at `address` (each an `Active`); a call whose features
        find no free slot fails alone (its rows count 0). True when any row clamps."""
        slots: dict[tuple, int] = {}
        used = False
        for active in editing:
            # A topk or normalised SAE's clamps need its whole encode: the splice tap's (static_splice.py).
            for op in (o for o in active.call.ops[address] if isinstance(o, Clamp) and o.sae.acts_per_feature):
                mask = select(op.positions, active.step)
                rows = active.rows if mask is None else active.rows[mask[0].to(active.rows.device)]
                wanted = [(op.sae.key, f) for f in op.features]
                if len(slots.keys() | set(wanted)) > CLAMP_SLOTS:
                    active.call.fail(f"Clamp at {address}: this step's calls clamp more than {CLAMP_SLOTS} distinct "
                                     "features (the slots a vllm-static clamp tap holds); run fewer such calls at "
                                     'once, or use backend="vllm".', in_spec=True)
                    self.count[active.rows] = 0
                    continue
                for key, feature in zip(wanted, op.features):
                    if key not in slots:
                        slots[key] = j = len(slots)
                        if self.held.get(j) != key:
                            self._slot(j, op.sae, feature)
                            self.held[j] = key
                    self.count[rows, slots[key]] += 1
                    self.target[rows, slots[key]] = op.to
                    used = used or len(rows) > 0
        return used

    def _slot(self, j: int, sae, feature: int) -> None:
        column = sae.W_enc.tensor[:, feature]
        bias = sae.b_enc.tensor[feature] - (sae.b_dec.tensor @ column if sae.apply_b_dec_to_input else 0.0)
        self.enc[:, j] = column
        self.bias[j] = bias
        self.threshold[j] = sae.threshold.tensor[feature] if sae.activation == "jumprelu" else 0.0
        self.dec[j] = sae.W_dec.tensor[feature]

    def reset(self, n: int) -> None:
        self.count[:n].zero_()

