"""Every reason a test may skip, in one place. Use `requires(...)` so the reason is printed (pytest -ra)."""

import importlib.util
import os
import platform

import pytest
import torch

REASONS = {
    "vllm": "vLLM is not installed: scripts/setup.sh installs vllm-cpu only on x86-64 CPUs with AVX-512",
    "cuda": "no CUDA GPU on this machine; the CUDA checks of the eager backend run on a lent GPU machine",
    "bitsandbytes": "bitsandbytes or accelerate is not installed: eager bnb-4bit/bnb-8bit loads need both "
                    "(bitsandbytes 0.48+ runs on CPUs too)",
    "vllm-bnb": "vllm-bnb-plugin or bitsandbytes is not installed: bnb-4bit on vLLM 0.32 needs the out-of-tree "
                "plugin (pip install --no-deps vllm-bnb-plugin bitsandbytes)",
    "torchvision": "torchvision does not import here (vLLM's qwen3_5, gemma3_mm and gemma4_mm modules import it): "
                   "scripts/setup.sh installs one that imports beside torch CPU",
    "glibc": "the C library is not glibc's: allocator.py's settings are glibc's (mallopt), elsewhere it makes none",
    "ray": "Ray is not installed: scripts/setup.sh installs it (the ray extra); replicated harvests run on it",
    "saelens": "datasets is not installed: harvest(format=\"saelens\") needs the saelens extra "
               "(pip install -e '.[saelens]')",
    "slow": ("INTERP_ENGINE_SLOW=1 is not set. Only with it (and in validator/comparison/run_all_models.sh) run: "
             "vllm-static's per-family compile of the newer families, Gemma 4's included (about 50-70 s on 2 "
             "shared cores); "
             "GPT-2's and Phi's vllm engines and GPT-NeoX's two-rank one (about 30 s each); "
             "two vLLM harvest replicas on Ray (about 150 s); "
             "SAEs on two-rank vllm and vllm-static engines (about 2 min); "
             "vLLM's module trees built on the meta device: Qwen3-Next's (about 50 s), its four Qwen3.5 trees "
             "(about 4 min), Gemma 4's (about 45 s each, its MoE block's included) and DeepSeek-V3's (about 30 s); "
             "Gemma 4's MoE block's two-rank and vllm-static engines (about 4 min); "
             "DeepSeek-V3's two-rank engine and its vllm-static engines (its one-rank engine runs in CI); "
             "Qwen3-Next's engines: vllm at num_gpus 1 and 2, and vllm-static (about 5 min); "
             "Kimi-K2.5's wrapper on vllm (num_gpus 1 and 2) and vllm-static (about 3 min); "
             "Gemma 3's and Gemma 4's wrappers on vllm (about 60 s each) and Qwen3.5 on vllm (about 60-190 s), where "
             "torchvision imports; vLLM's trees of Gemma "
             "3's and Gemma 4's multimodal wrappers (about 25 s each, three) and its registry asked about "
             "Kimi-K2.5's wrapper class as backend=\"auto\" on CUDA asks it (about 18 s); "
             "the validator's quick run of Gemma 2 (two engines, one compiled: about 100 s); "
             "the quick benchmarks' vllm-static and vllm-generate suites (two engine starts, one compiled: about "
             "2 min)"),
}


def _available(name: str) -> bool:
    if name == "cuda":
        return torch.cuda.is_available()
    if name == "glibc":
        return platform.libc_ver()[0] == "glibc"
    if name in ("vllm", "ray"):
        return importlib.util.find_spec(name) is not None
    if name == "bitsandbytes":
        return all(importlib.util.find_spec(m) is not None for m in ("bitsandbytes", "accelerate"))
    if name == "saelens":
        return importlib.util.find_spec("datasets") is not None
    if name == "torchvision":
        from interp_engine.arch.vllm_cpu import torchvision_failure

        return torchvision_failure() is None
    if name == "slow":
        return os.environ.get("INTERP_ENGINE_SLOW") == "1"
    if name == "vllm-bnb":
        return all(importlib.util.find_spec(m) is not None for m in ("vllm", "vllm_bnb_plugin", "bitsandbytes"))
    raise KeyError(name)


def requires(name: str):
    """A marker that skips, with its listed reason, when `name` is missing."""
    return pytest.mark.skipif(not _available(name), reason=REASONS[name])
