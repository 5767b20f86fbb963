"""Gemma 3 (text): Gemma-2's four norms per layer, so attn_out/mlp_out are the post-norms' outputs; q/k RMS norms
per head inside attention (q and k are read after them and after rotary); sliding and global layers as
`layer_types` says, each with its own rotary base; embeddings scaled by sqrt(d_model) inside the embedding
module, so `embed` is the scaled one (what layer 0 reads). No softcapping in the published configs."""

import dataclasses

from interp_engine.arch import gemma2

# The same module paths as Gemma-2's, in HF and in vLLM: one layout, its own family name.
ARCHES = (dataclasses.replace(gemma2.ARCHES[0], family="gemma3", model_types=("gemma3_text",)),)
