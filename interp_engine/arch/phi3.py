"""Phi-3 (and Phi-3.5, Phi-4-mini's text layout): Llama's sequential block with fused qkv_proj and gate_up_proj.
Points are read where Llama's are (q/k/v at the attention function, after the split and rotary; mlp_act at the
down projection's input), so the fusion changes no path. vLLM implements it as a Llama subclass."""

import dataclasses

from interp_engine.arch import llama

# The same module paths as Llama's, in HF and in vLLM: one layout, its own family name.
ARCHES = (dataclasses.replace(llama.ARCHES[0], family="phi3", model_types=("phi3",)),)
