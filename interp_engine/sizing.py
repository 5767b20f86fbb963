"""The GPU sizer: what a `load_model(...)` call needs per GPU, priced from config.json alone, and whether it fits.

Nothing is downloaded and no weights are read. Per GPU it adds:

- weights: the parameter count from the per-family layout table below (equal to HF's own count), at the model
  dtype, except the weight matrices of the decoder blocks' linear layers (attention and MLP projections, GPT-2's
  Conv1D included), which `quantization` narrows:
    fp8       1 byte/param + one fp32 scale per matrix (vLLM's online per-tensor fp8)
    bnb-4bit  0.5 byte/param + one fp32 absmax per block of 64 params (bitsandbytes' default, no double quant)
    bnb-8bit  1 byte/param + one fp32 scale per output row
  Embeddings, learned positions, lm_head, biases and norms stay at the model dtype under every scheme.
- KV cache: `kv_bytes_per_token` = 2 * n_layers * n_kv_heads * d_head * bytes(kv dtype), times
  max_model_len * concurrency. kv_cache_dtype "fp8" is 1 byte; "auto" (or None) is the model dtype. Sliding-window
  layers (Gemma-2) are priced at full length, an upper bound.
- captures (vllm-static only): per declared point, TOKENS_PER_STEP(gpu) rows x the point's width per token x the
  model dtype; attn_scores/attn_probs are n_heads x max_model_len wide per token.
- overhead: a fixed OVERHEAD_BYTES per GPU (see there).

Across num_gpus (tensor parallel on vLLM, device_map="auto" on eager) weights and KV divide by num_gpus, except
the norms, which every rank holds whole; vLLM also keeps at least one KV head per rank (it replicates KV heads
when num_gpus > n_kv_heads). Capture buffers hold gathered values, so every GPU holds them whole. The estimate fits
when the per-GPU sum is at most gpu_memory_utilization x the card's memory (vLLM's budget; on eager the same
fraction is the headroom left to the allocator).

dtype="auto" is the checkpoint's dtype; on the vLLM backends a float32 (or unstated) checkpoint is served in 16 bits,
as vLLM's "auto" does, while eager keeps float32.
"""

import difflib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from interp_engine.addresses import Address
from interp_engine.arch import Dims, arch_for, read_dims, supported_model_types
from interp_engine.errors import BackendError, LoadError, SpecError, fix
from interp_engine.loading import _DTYPES, _check_backend, _checkpoint_dtype
from interp_engine.quantization import VLLM_BACKENDS, check_scheme
from interp_engine.sizing_tables import (GPUS_MIB, KV_CACHE_DTYPES, LAYOUTS, OVERHEAD_BYTES, SCHEME_PRICES,
                                         tokens_per_step)

GiB = 2**30


@dataclass(frozen=True, slots=True)
class ParamCount:
    linear: int  # weight matrices of the blocks' linear layers: what quantization narrows
    linear_matrices: int
    linear_rows: int  # output rows summed over those matrices
    norms: int  # held whole by every tensor-parallel rank
    rest: int  # embeddings, learned positions, lm_head, biases

    @property
    def total(self) -> int:
        return self.linear + self.norms + self.rest
