"""harvest(..., format="saelens"): a HuggingFace `datasets` folder SAELens trains from directly.

    OUT/dataset_info.json, OUT/state.json, OUT/data-*.arrow   `Dataset.save_to_disk`'s layout, which SAELens's
    `ActivationsStore.load_cached_activation_dataset` opens with `datasets.load_from_disk(path)`

Columns are those SAELens's `CacheActivationsRunner` writes: one per point, named by its TransformerLens hook
(`blocks.3.hook_resid_post`), feature `Array2D(shape=(context_size, d_in), dtype=...)`, and `token_ids`,
`Sequence(Value("int32"), length=context_size)`. A row is one context window of exactly `context_size` tokens run
as its own forward pass (SAELens runs each window alone too). Each prompt is cut into consecutive windows; a
prompt's last `len % context_size` tokens, and prompts shorter than `context_size`, are not harvested (a warning
counts them): a row never mixes prompts and never pads. Points with a head axis are flattened to d_in = heads x
d_head, as SAELens flattens them.
"""

import importlib.util
import itertools
import shutil
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch

from interp_engine.addresses import Address
from interp_engine.errors import InterpEngineError, SpecError, fix
from interp_engine.handle import ModelHandle
from interp_engine.spec import Spec
from interp_engine.warnings import InterpEngineWarning

# Arrow has no bfloat16: such models are stored in float32 (exact), as SAELens's default dtype is.
_ARROW_FLOATS = {torch.float16: "float16", torch.float32: "float32", torch.float64: "float64"}
# Ours are after rotary; TL's attn.hook_q/hook_k are before it on rotary models, so the name would mislead.
_AMBIGUOUS = {"q": "attn.hook_rot_q (after rotary) or attn.hook_q", "k": "attn.hook_rot_k (after rotary) or attn.hook_k"}


def saelens_problems(model: ModelHandle, addresses: tuple[Address, ...], context_size, dtype,
                     chosen: torch.dtype) -> list[str]:
    """Every reason this harvest cannot be written in SAELens's layout (empty: it can), before any forward."""
    problems = []
    if importlib.util.find_spec("datasets") is None:
        problems.append(fix('format="saelens" writes with the `datasets` package, which is not installed.',
                            "pip install 'interp_engine[saelens]' (or pip install datasets)."))
    if isinstance(context_size, bool) or not isinstance(context_size, int) or context_size < 1:
        problems.append(fix(f'format="saelens" needs context_size, a positive int (got {context_size!r}).',
                            "pass context_size=128 (SAELens's context_size: tokens per row)."))
    elif context_size > model.dims.max_len:
        problems.append(fix(f"context_size={context_size} is longer than {model.name!r} reads "
                            f"({model.dims.max_len} tokens).", f"pass context_size<={model.dims.max_len}."))
    for a in addresses:
        if a.tl_name is None:
            problems.append(fix(f"{a} has no TransformerLens hook name, so SAELens cannot name its column.",
                                'harvest it with format="safetensors", or pick a point TL hooks (e.g. resid_post).'))
        elif a.point in _AMBIGUOUS:
            problems.append(fix(f"{a} is after rotary; TL's name for it depends on the model "
                                f"({_AMBIGUOUS[a.point]}).", 'harvest it with format="safetensors".'))
    if chosen not in _ARROW_FLOATS:
        asked = "dtype" if dtype is not None else "the model's dtype"
        problems.append(fix(f"{asked} {str(chosen).removeprefix('torch.')} has no Arrow type.",
                            'pass dtype="float32" (exact for bfloat16) or "float16".'))
    return problems


def arrow_default(model_dtype: torch.dtype) -> torch.dtype:
    """The stored dtype when none is asked for: the model's, or float32 where Arrow lacks it (bfloat16)."""
    return model_dtype if model_dtype in _ARROW_FLOATS else torch.float32


def write_saelens(model: ModelHandle, source: Iterator, addresses: tuple[Address, ...], out: Path, *,
                  context_size: int, spec: Spec, store: torch.dtype, chunk_prompts: int, tokenize, progress: bool):
    """Cut the prompts into windows, capture them `chunk_prompts` windows at a time and save the dataset.
    Returns it, read back with `datasets.load_from_disk` (memory-mapped)."""
    import datasets

    from interp_engine.func.capture import capture

    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise SpecError(fix(f"{out} is not an empty folder; a SAELens dataset is written whole, never resumed.",
                            "harvest into a new or empty folder."))
    dropped = {"prompts": 0, "tokens": 0}
    windows = _windows(source, context_size, chunk_prompts, tokenize, dropped)
    first = next(windows, None)
    if first is None:
        raise SpecError(fix(f"no prompt has {context_size} tokens, so there is no context window to harvest.",
                            "pass a smaller context_size, or longer prompts."))

    def rows(chunk: list[tuple[int, ...]]) -> dict:
        cache = capture(model, chunk, list(addresses), spec, progress=False)
        out_rows = {a.tl_name: cache[a].flatten(2).to("cpu", store).numpy() for a in addresses}
        out_rows["token_ids"] = torch.tensor(chunk, dtype=torch.int32).numpy()
        return out_rows

    head = rows(first)
    features = datasets.Features({a.tl_name: datasets.Array2D(shape=head[a.tl_name].shape[1:],
                                                              dtype=_ARROW_FLOATS[store]) for a in addresses}
                                 | {"token_ids": datasets.Sequence(datasets.Value("int32"), length=context_size)})

    def generate():
        for chunk_rows in itertools.chain([head], (rows(chunk) for chunk in windows)):
            for i in range(len(chunk_rows["token_ids"])):
                yield {name: column[i] for name, column in chunk_rows.items()}

    out.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=".interp_engine-saelens-", dir=out.parent))
    quiet = not progress and not datasets.utils.are_progress_bars_disabled()
    if quiet:  # datasets' bars are a global switch: turned back on below
        datasets.utils.disable_progress_bars()
    try:
        # `fingerprint` spares datasets hashing the generator (it would pickle the model to do it).
        built = datasets.Dataset.from_generator(generate, features=features, cache_dir=str(scratch),
                                                fingerprint=scratch.name)
        built.save_to_disk(str(out))
        del built
    except datasets.exceptions.DatasetGenerationError as e:
        # A later chunk's refusal (a bad prompt) surfaces wrapped by datasets: give the caller ours, with its fix.
        if isinstance(e.__cause__, InterpEngineError):
            raise e.__cause__ from None
        raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        if quiet:
            datasets.utils.enable_progress_bars()
    if dropped["tokens"]:
        warnings.warn(f"harvest: {dropped['tokens']} tokens not harvested ({dropped['prompts']} prompts shorter "
                      f"than context_size={context_size}, and each prompt's last partial window).",
                      InterpEngineWarning, stacklevel=3)
    return datasets.load_from_disk(str(out))


def _windows(source: Iterator, size: int, chunk: int, tokenize, dropped: dict) -> Iterator[list[tuple[int, ...]]]:
    """Lists of up to `chunk` windows of `size` token ids, in prompt order; counts what does not fill a window."""
    held: list[tuple[int, ...]] = []
    first = 0
    while prompts := list(itertools.islice(source, chunk)):
        try:
            tokenized = tokenize(prompts)
        except InterpEngineError as e:  # it numbers prompts within the chunk: say where the chunk is
            raise type(e)(f"harvest, prompts {first}..{first + len(prompts) - 1}: {e}") from None
        first += len(prompts)
        for ids in tokenized:
            n = len(ids) // size
            dropped["prompts"] += n == 0
            dropped["tokens"] += len(ids) - n * size
            held.extend(ids[i * size:(i + 1) * size] for i in range(n))
            while len(held) >= chunk:
                yield held[:chunk]
                held = held[chunk:]
    if held:
        yield held
