"""Pictures (optional extra `plot`: matplotlib). Each function writes a PNG and returns its path."""

from pathlib import Path

import torch


def plot_logit_lens(lens: torch.Tensor, *, row_labels: list[str], position_labels: list[str],
                    top_tokens: list[list[str]], path: str | Path, title: str = "logit lens") -> Path:
    """Heatmap of layers x positions for one prompt: colour = log-prob of the top token, text = that token.

    `lens` is [layer, pos, d_vocab] log-probs (one prompt of `logit_lens`'s output).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    top = lens.max(-1).values.exp().cpu().numpy()
    n_rows, n_pos = top.shape
    fig, ax = plt.subplots(figsize=(1.0 + 0.9 * n_pos, 0.9 + 0.45 * n_rows))
    image = ax.imshow(top, aspect="auto", cmap="viridis", vmin=0.0, vmax=1.0, origin="lower")
    for r in range(n_rows):
        for c in range(n_pos):
            ax.text(c, r, top_tokens[r][c], ha="center", va="center", fontsize=7,
                    color="white" if top[r, c] < 0.6 else "black")
    ax.set_xticks(range(n_pos), position_labels, rotation=45, ha="right", fontsize=8)
    ax.set_yticks(range(n_rows), row_labels, fontsize=8)
    ax.set_title(title)
    fig.colorbar(image, ax=ax, label="probability of the top token")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
