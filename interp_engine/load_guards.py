"""What a model folder may not do to the machine that loads it: run its own code unasked, or allocate more
memory than is there. Both are refused before any weight is read (`loading.load_model` and the backends' `load`).
"""


import torch

from interp_engine import quantization as Q
from interp_engine.errors import LoadError, fix
from interp_engine.selection import BackendSelection

# Refused only when the weights alone need more than this many times the memory there, so that an estimate that
# runs high (a shipped scheme the sizer prices at the model dtype, eager's device_map offload to CPU, pages the
# OS would free) never refuses a model that would load; a config that cannot fit is off by orders of magnitude.
HEADROOM = 2


def load_tokenizer(source: str, *, trust_remote_code: bool, name: str, config=None):
    """The folder's tokenizer, read with trust_remote_code=False first, always explicit: left as None, a folder whose
    tokenizer_config.json has an `auto_map` makes transformers ask on the terminal whether to run its code. The
    folder's code runs only when the user asked for it and no tokenizer class transformers ships can read the
    folder (so load_model stays free of checkpoint code wherever it can be). `config`: the model's, where
    config.json is not transformers' to read (arch/aliases.py)."""
    from transformers import AutoTokenizer

    extra = {"config": config} if config is not None else {}
    try:
        return AutoTokenizer.from_pretrained(source, local_files_only=True, trust_remote_code=False, **extra)
    except ValueError as e:
        if "trust_remote_code" not in str(e):
            raise
    if trust_remote_code:
        return AutoTokenizer.from_pretrained(source, local_files_only=True, trust_remote_code=True, **extra)
    raise LoadError(fix(
        f"{name!r} names its own tokenizer code (auto_map in tokenizer_config.json or config.json), and "
        "interp_engine never runs a folder's code unless asked.",
        "pass trust_remote_code=True (on vLLM: extra_vllm_kwargs={\"trust_remote_code\": True}) only if you trust "
        f"the folder: it imports the .py files in {source} with your permissions. Or replace the auto_map with a "
        "tokenizer_class transformers ships."))


def memory_there(device: str, num_gpus: int) -> tuple[int, str]:
    """(bytes, where): free memory on the devices the model will use, plus the CPU RAM a load may spill into."""
    import psutil

    ram = psutil.virtual_memory().available + psutil.swap_memory().free
    if device.startswith("cuda") and torch.cuda.is_available():
        gpus = range(min(num_gpus, torch.cuda.device_count()))
        free = sum(torch.cuda.mem_get_info(i)[0] for i in gpus)
        return free + ram, f"{_gib(free)} free on {len(gpus)} GPU(s) + {_gib(ram)} of CPU RAM and swap"
    return ram, f"{_gib(ram)} of CPU RAM and swap available"


def check_fits(name: str, config, selection: BackendSelection, *, quantization: str | None, num_gpus: int,
               there: tuple[int, str] | None = None) -> None:
    """Refuse a config whose weights, priced by the sizer, need more than HEADROOM x the memory there."""
    from interp_engine.sizing_shapes import count_params, shipped_scheme
    from interp_engine.arch.aliases import ALIASES
    from interp_engine.sizing_tables import LAYOUTS, SCHEMES, WRAPPERS

    if getattr(config, "model_type", None) not in {*LAYOUTS, *WRAPPERS, *ALIASES}:
        return  # the sizer does not price this family; the loaders refuse what they cannot serve
    shipped = Q.shipped_quantization(config)
    scheme = quantization or (shipped if shipped in SCHEMES else None)
    need = count_params(config).bytes(selection.dtype.itemsize,
                                      scheme if scheme in SCHEMES else shipped_scheme(config))
    available, where = there or memory_there(selection.device, num_gpus)
    if need > HEADROOM * available:
        raise LoadError(fix(
            f"{name!r} needs about {_gib(need)} ({need:,} bytes) for its weights alone at "
            f"{str(selection.dtype).removeprefix('torch.')}, and this machine has {where}: it cannot fit "
            f"(refused above {HEADROOM}x the memory there, before allocating).",
            "load it quantized (quantization=\"bnb-4bit\" or \"fp8\"), shard it over more GPUs (num_gpus=), or use "
            "a smaller model; interp_engine.sizing.estimate(...) prices each choice."))


def _gib(n: int) -> str:
    return f"{n / 2**30:,.1f} GiB"
