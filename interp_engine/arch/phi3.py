"""Phi-3 (and Phi-3.5, Phi-4-mini's text layout): Llama's sequential block with fused qkv_proj and gate_up_proj.
Points are read where Llama's are (q/k/v at the attention function, after the split and rotary; mlp_act at the
down projection's input), so the fusion changes no path. vLLM implements it as a Llama subclass."""

import dataclasses

from interp_engine.arch import llama

# Llama's module paths, in HF and in vLLM, but for mlp_pre and mlp_pre_linear: gate and up are the halves of the
# fused gate_up_proj's output.
ARCHES = (dataclasses.replace(llama.ARCHES[0], family="phi3", model_types=("phi3",),
                              mlp_pre="mlp.gate_up_proj", mlp_up="mlp.gate_up_proj",
                              mlp_pre_half=True),)
