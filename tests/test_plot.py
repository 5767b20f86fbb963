"""The pictures: each writes a PNG laid out from its input, refuses a wrong shape with the fix, and leaves no
global matplotlib state behind (no pyplot figures, no backend switch)."""

import sys

import pytest
import torch
from matplotlib.image import imread

from interp_engine import SpecError
from interp_engine.plot import plot_attention, plot_logit_lens, plot_steering_norms

PNG = b"\x89PNG\r\n\x1a\n"


def _pattern(heads: int, n: int) -> torch.Tensor:
    causal = torch.ones(n, n).triu(1).bool()
    return torch.softmax(torch.randn(heads, n, n).masked_fill(causal, float("-inf")), -1)


def test_attention_grid_has_a_panel_per_head(tmp_path):
    labels = [f"t{i}" for i in range(5)]
    four = imread(plot_attention(_pattern(4, 5), token_labels=labels, path=tmp_path / "a4.png"))
    eight = imread(plot_attention(_pattern(8, 5), token_labels=labels, path=tmp_path / "a8.png"))
    assert eight.shape[0] > 1.5 * four.shape[0], "8 heads take two rows of 4"
    with pytest.raises(SpecError, match="Fix:"):
        plot_attention(_pattern(4, 5), token_labels=labels[:4], path=tmp_path / "bad.png")
    assert not (tmp_path / "bad.png").exists()


def test_steering_norms_and_logit_lens_write_pngs(tmp_path):
    plain = torch.randn(3, 6, 16)
    path = plot_steering_norms(plain + 0.1, plain, layer_labels=["a", "b", "c"], path=tmp_path / "deep" / "s.png")
    assert path.read_bytes()[:8] == PNG
    with pytest.raises(SpecError, match="Fix:"):
        plot_steering_norms(plain[:2], plain, layer_labels=["a", "b", "c"], path=tmp_path / "x.png")
    lens = torch.log_softmax(torch.randn(3, 4, 10), -1)
    tops = [[str(int(i)) for i in row.argmax(-1)] for row in lens]
    path = plot_logit_lens(lens, row_labels=["0", "1", "2"], position_labels=list("abcd"), top_tokens=tops,
                           path=tmp_path / "lens.png")
    assert path.read_bytes()[:8] == PNG
    if "matplotlib.pyplot" in sys.modules:
        assert sys.modules["matplotlib.pyplot"].get_fignums() == []
