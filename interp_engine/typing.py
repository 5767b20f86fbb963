"""The one axis vocabulary, as jaxtyping aliases.

Axes: batch pos d_model n_heads n_kv_heads d_head d_mlp d_vocab q_pos k_pos.
"""

from jaxtyping import Float, Int
from torch import Tensor

Tokens = Int[Tensor, "batch pos"]
Resid = Float[Tensor, "batch pos d_model"]
Heads = Float[Tensor, "batch pos n_heads d_head"]
KVHeads = Float[Tensor, "batch pos n_kv_heads d_head"]
Pattern = Float[Tensor, "batch n_heads q_pos k_pos"]
MLPAct = Float[Tensor, "batch pos d_mlp"]
Logits = Float[Tensor, "batch pos d_vocab"]
LogProbs = Float[Tensor, "layer batch pos d_vocab"]
Vector = Float[Tensor, "..."]

__all__ = ["Tokens", "Resid", "Heads", "KVHeads", "Pattern", "MLPAct", "Logits", "LogProbs", "Vector"]
