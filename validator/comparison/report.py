"""The validator's outputs: JSON (every row), a markdown table (a summary, then every failure and every
refusal), and a PNG heatmap of capture errors (points x layers, one panel per model, backend and num_gpus)."""

import json
import math
from collections import Counter, defaultdict
from pathlib import Path

from interp_engine.addresses import POINTS
from validator.comparison.compare import FAILING, STATUSES, Row

KINDS = ("capture", "steer", "lens", "generate", "hf")


def write_json(path: Path, rows: list[Row], meta: dict) -> None:
    path.write_text(json.dumps({**meta, "failures": sum(r.failed for r in rows),
                                "rows": [r.to_dict() for r in rows]}, indent=1))


def _cell(rows: list[Row]) -> str:
    if not rows:
        return "-"
    counts = Counter(r.status for r in rows)
    passed = counts.pop("pass", 0)
    text = f"{passed}/{len(rows)}"
    if counts:
        text += " (" + ", ".join(f"{n} {s}" for s, n in sorted(counts.items())) + ")"
    return text


def _worst(rows: list[Row]) -> str:
    measured = [r for r in rows if r.max_rel is not None and r.kind != "generate" and not math.isinf(r.max_rel)
                and r.status in ("pass", *FAILING)]
    if not measured:
        return "-"
    r = max(measured, key=lambda r: r.max_abs / (r.atol + r.rtol) if r.rtol else r.max_abs)
    where = r.point + (f".{r.layer}" if r.layer is not None else "")
    return f"{r.max_abs:.1e} abs / {r.max_rel:.1e} rel ({r.kind} {r.op + ' ' if r.op else ''}{where})"


def markdown(rows: list[Row], meta: dict) -> str:
    groups: dict[tuple, list[Row]] = defaultdict(list)
    for r in rows:
        backend = "eager (vs HF)" if r.backend == "hf-vs-eager" else r.backend
        groups[(r.model, backend, r.num_gpus)].append(r)
    failures = [r for r in rows if r.failed]
    lines = [f"# Validator results ({meta['mode']} mode)", "",
             f"{meta['machine']}; {meta['when']}; {meta['seconds']:.0f} s. Reference: the eager backend at "
             "num_gpus=1. Cells: passed/compared per kind of check. Tolerances (validator/comparison/"
             f"tolerances.py): {meta['tolerances']}.", ""]
    if meta.get("plant"):
        lines += [f"**PLANTED ERROR: {meta['plant']}** (a test of the validator itself; these results are not a "
                  "validation of the library).", ""]
    lines += [f"**{'FAILED' if failures else 'PASSED'}**: {len(failures)} failing checks of "
              f"{sum(r.status == 'pass' for r in rows) + len(failures)} compared.", "",
              "| model | backend | num_gpus | status | captures | steering | logit lens | generation | worst error |",
              "|---|---|---|---|---|---|---|---|---|"]
    for (model, backend, ranks), group in groups.items():
        run = [r for r in group if r.kind == "run"]
        status = run[0].status if run else ("FAIL" if any(r.failed for r in group) else "pass")
        by_kind = {k: [r for r in group if r.kind == k] for k in KINDS}
        captures = by_kind["capture"] + by_kind["hf"]
        lines.append(f"| {model} | {backend} | {ranks} | {status} | {_cell(captures)} | {_cell(by_kind['steer'])} | "
                     f"{_cell(by_kind['lens'])} | {_cell(by_kind['generate'])} | {_worst(group)} |")
    lines += ["", "Statuses: " + "; ".join(f"`{s}` {d}" for s, d in STATUSES.items()) + ".", ""]
    if failures:
        lines += ["## Failures", ""] + [f"- {r.describe()}" for r in failures] + [""]
    refused = [r for r in rows if r.status not in ("pass", *FAILING)]
    if refused:
        lines += ["## Not compared (by design or not in this build)", ""]
        seen: dict[tuple, list[str]] = defaultdict(list)
        for r in refused:
            where = r.point + (f".{r.layer}" if r.layer is not None else "")
            seen[(r.backend, r.num_gpus, r.status)].append(f"{r.model}:{r.kind} {r.op + ' ' if r.op else ''}{where}"
                                                            if r.kind != "run" else r.model)
        for (backend, ranks, status), what in seen.items():
            shown = ", ".join(what[:12]) + (f", ... ({len(what)} in all)" if len(what) > 12 else "")
            lines.append(f"- {backend} num_gpus={ranks} `{status}`: {shown}")
        lines.append("")
    return "\n".join(lines)


def heatmap(path: Path, rows: list[Row]) -> None:
    """log10 of max abs capture error per (point, layer); failures framed in red, refusals grey."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    panels: dict[tuple, list[Row]] = defaultdict(list)
    for r in rows:
        if r.kind in ("capture", "lens"):
            panels[(r.model, r.backend, r.num_gpus)].append(r)
    panels = {k: v for k, v in panels.items() if any(r.max_abs is not None for r in v)}
    if not panels:
        panels = {("no comparisons", "-", 0): []}
    names = [*POINTS, "lens"]
    n_layers = max([(r.layer or 0) + 1 for v in panels.values() for r in v] or [1])
    cols = min(len(panels), 3)
    nrows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(1.2 + 0.45 * (n_layers + 1) * cols + 1.5 * cols, 5.2 * nrows),
                             squeeze=False)
    image = None
    for i, (ax, ((model, backend, ranks), group)) in enumerate(zip(axes.flat, panels.items())):
        grid = np.full((len(names), n_layers + 1), np.nan)
        for r in group:
            y = names.index("lens" if r.kind == "lens" else r.point)
            x = 0 if r.layer is None else r.layer + 1
            if r.max_abs is not None and not math.isinf(r.max_abs):
                grid[y, x] = max(grid[y, x] if not np.isnan(grid[y, x]) else -99, math.log10(max(r.max_abs, 1e-12)))
            if r.failed:
                ax.add_patch(plt.Rectangle((x - 0.5, y - 0.5), 1, 1, fill=False, edgecolor="red", lw=2.5))
            elif r.max_abs is None:
                ax.add_patch(plt.Rectangle((x - 0.5, y - 0.5), 1, 1, color="0.85"))
        image = ax.imshow(grid, cmap="viridis", vmin=-9, vmax=0, aspect="auto")
        ax.set_title(f"{Path(model).name}\n{backend} num_gpus={ranks}", fontsize=9)
        ax.set_yticks(range(len(names)), names if i % cols == 0 else [""] * len(names), fontsize=7)
        ax.set_xticks(range(n_layers + 1), ["-", *map(str, range(n_layers))], fontsize=7)
        ax.set_xlabel("layer ('-': model-level point)", fontsize=7)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.subplots_adjust(left=0.12, right=0.84, wspace=0.35, hspace=0.45)
    if image is not None:
        bar = fig.colorbar(image, cax=fig.add_axes([0.88, 0.25, 0.02, 0.5]))
        bar.set_label("log10 max |error| vs eager (red frame: fail; grey: refused)", fontsize=8)
    fig.savefig(path, dpi=90, bbox_inches="tight")
    plt.close(fig)


def main() -> None:
    """Regenerate results.md and heatmap.png from a results.json."""
    import sys

    path = Path(sys.argv[1] if len(sys.argv) > 1 else "validator/results/results.json")
    data = json.loads(path.read_text())
    rows = [Row(**r) for r in data.pop("rows")]
    (path.parent / "results.md").write_text(markdown(rows, data))
    heatmap(path.parent / "heatmap.png", rows)


if __name__ == "__main__":
    main()
