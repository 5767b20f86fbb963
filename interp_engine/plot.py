"""Pictures (optional extra `plot`: matplotlib). Each function writes a PNG and returns its path."""

from pathlib import Path

import torch

from interp_engine.errors import SpecError, fix


def plot_logit_lens(lens: torch.Tensor, *, row_labels: list[str], position_labels: list[str],
                    top_tokens: list[list[str]], path: str | Path, title: str = "logit lens") -> Path:
    """Heatmap of layers x positions for one prompt: colour = log-prob of the top token, text = that token.

    `lens` is [layer, pos, d_vocab] log-probs (one prompt of `logit_lens`'s output).
    """
    top = lens.max(-1).values.exp().cpu().numpy()
    n_rows, n_pos = top.shape
    fig = _figure(figsize=(1.0 + 0.9 * n_pos, 0.9 + 0.45 * n_rows))
    ax = fig.subplots()
    image = ax.imshow(top, aspect="auto", cmap="viridis", vmin=0.0, vmax=1.0, origin="lower")
    for r in range(n_rows):
        for c in range(n_pos):
            ax.text(c, r, top_tokens[r][c], ha="center", va="center", fontsize=7,
                    color="white" if top[r, c] < 0.6 else "black")
    ax.set_xticks(range(n_pos), position_labels, rotation=45, ha="right", fontsize=8)
    ax.set_yticks(range(n_rows), row_labels, fontsize=8)
    ax.set_title(title)
    fig.colorbar(image, ax=ax, label="probability of the top token")
    return _save(fig, path)


def plot_attention(pattern: torch.Tensor, *, token_labels: list[str], path: str | Path,
                   title: str = "attention") -> Path:
    """One heatmap per head, query rows x key columns, for one prompt at one layer.

    `pattern` is [n_heads, q_pos, k_pos] probabilities (one prompt of `capture(...)["attn_probs.L"]`).
    """
    if pattern.ndim != 3 or pattern.shape[1] != pattern.shape[2] or pattern.shape[1] != len(token_labels):
        raise SpecError(fix(f"plot_attention wants [n_heads, pos, pos] and one label per position; got "
                            f"{tuple(pattern.shape)} and {len(token_labels)} labels.",
                            "pass one prompt's pattern, e.g. capture(model, text, "
                            '["attn_probs.0"])["attn_probs.0"][0].'))
    n_heads, n = pattern.shape[0], pattern.shape[1]
    cols = min(n_heads, 4)
    rows = -(-n_heads // cols)
    side = 0.9 + 0.28 * n
    fig = _figure(figsize=(side * cols + 1.2, side * rows + 0.6), layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False)
    values = pattern.detach().float().cpu().numpy()
    for h, ax in enumerate(axes.flat):
        if h >= n_heads:
            ax.axis("off")
            continue
        image = ax.imshow(values[h], cmap="Blues", vmin=0.0, vmax=1.0)
        ax.set_title(f"head {h}", fontsize=9)
        ax.set_xticks(range(n), token_labels, rotation=90, fontsize=6)
        ax.set_yticks(range(n), token_labels, fontsize=6)
    fig.colorbar(image, ax=axes, shrink=0.8, label="attention probability")
    fig.suptitle(f"{title} (rows: queries, columns: keys)")
    return _save(fig, path, tight=False)


def plot_steering_norms(steered: torch.Tensor, plain: torch.Tensor, *, layer_labels: list[str], path: str | Path,
                        title: str = "steering effect by layer") -> Path:
    """Per layer, how far the edit moved the residual stream: ||steered - plain|| at the last position and
    averaged over positions, beside ||plain|| for scale.

    `steered` and `plain` are [layer, pos, d_model] for one prompt (e.g. stacked `resid_post.L` captures with
    and without the spec).
    """
    if steered.shape != plain.shape or steered.ndim != 3 or steered.shape[0] != len(layer_labels):
        raise SpecError(fix(f"plot_steering_norms wants two [layer, pos, d_model] tensors and one label per layer; "
                            f"got {tuple(steered.shape)}, {tuple(plain.shape)} and {len(layer_labels)} labels.",
                            "stack one prompt's resid_post.L captures: torch.stack([cache[a][0] for a in layers])."))
    delta = (steered - plain).float().norm(dim=-1).cpu()
    base = plain.float().norm(dim=-1).cpu()
    x = list(range(len(layer_labels)))
    fig = _figure(figsize=(max(6.0, 1.5 + 0.6 * len(x)), 3.8))
    ax = fig.subplots()
    ax.plot(x, delta[:, -1].tolist(), marker="o", label="||steered - plain||, last position")
    ax.plot(x, delta.mean(1).tolist(), marker="s", label="||steered - plain||, mean over positions")
    ax.plot(x, base.mean(1).tolist(), linestyle="--", color="grey", label="||plain||, mean over positions")
    ax.set_xticks(x, layer_labels, rotation=45, ha="right", fontsize=8)
    ax.set_ylabel("L2 norm")
    ax.set_ylim(0, 1.4 * max(float(delta.max()), float(base.mean(1).max())))  # headroom for the legend
    ax.legend(fontsize=7, loc="upper left")
    ax.set_title(title)
    return _save(fig, path)


def _figure(**kwargs):
    # A bare Figure, never pyplot: no global backend switch and no figure registry in the caller's session.
    from matplotlib.figure import Figure

    return Figure(**kwargs)


def _save(fig, path: str | Path, *, tight: bool = True) -> Path:
    if tight:
        fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    return path
