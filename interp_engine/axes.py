"""The one axis vocabulary, as names: plain data with no torch import, so the point table (addresses.py) can use
it where tensors never go. `typing.py` builds the jaxtyping aliases from these names.

`layer` counts the rows of a stacked result (the logit lens' points); `q_pos`/`k_pos` are the query and key
positions of an attention pattern; `d_sae` is an SAE's number of features (its own width, never the model's)
and `top_features` the k a sparse feature read keeps per position;
`n_experts` counts a mixture-of-experts layer's routed experts and `top_k` the experts each token is routed to
(both 0 on a dense model). `d_head` is q's and k's head width, `d_head_v` v's and z's (the same but under
multi-head latent attention); `d_latent` is the width of MLA's compressed key-value latent (0 without one).
A linear-attention (Gated DeltaNet) layer has its own heads: `n_lin_k_heads` heads of q and k, `d_lin_k` wide, and
`n_lin_v_heads` heads of v, the gates and the output, `d_lin_v` wide (all 0 in a model without such layers).
"""

from typing import Literal, get_args

Axis = Literal["layer", "batch", "pos", "d_model", "n_heads", "n_kv_heads", "d_head", "d_head_v", "d_mlp", "d_vocab",
               "q_pos", "k_pos", "d_sae", "top_features", "n_experts", "top_k", "d_latent",
               "n_lin_k_heads", "n_lin_v_heads", "d_lin_k", "d_lin_v"]
AXES: tuple[str, ...] = get_args(Axis)
# The axes whose size is a property of the model (read from its config), bound before a result is checked.
MODEL_AXES: tuple[str, ...] = ("d_model", "n_heads", "n_kv_heads", "d_head", "d_head_v", "d_mlp", "d_vocab", "n_experts",
                               "top_k", "d_latent", "n_lin_k_heads", "n_lin_v_heads", "d_lin_k", "d_lin_v")
