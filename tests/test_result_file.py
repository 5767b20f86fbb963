"""How results travel from a vLLM worker to the driver (`backends/vllm/results.py`, `wire.encode/decode`), checked
against safetensors' own reader and writer and against plain `torch.cat` / `.cpu()`. No engine is started."""

import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from interp_engine.backends.vllm import results, wire
from interp_engine.errors import SpecError
from tests.skips import requires


def _records():
    """Three keys recorded at the same rows over two steps (as a call's addresses are), one of its own."""
    g = torch.Generator().manual_seed(0)
    prompts, positions = torch.arange(3).repeat_interleave(4), torch.arange(4).repeat(3)
    steps = [(prompts[:5], positions[:5]), (prompts[5:], positions[5:])]
    return {
        "resid_post.1": [(*w, torch.randn(len(w[0]), 8, generator=g)) for w in steps],
        "resid_post.2": [(*w, torch.randn(len(w[0]), 8, generator=g).bfloat16()) for w in steps],
        "lens:resid_post.2": [(*w, torch.randn(len(w[0]), 5, generator=g).double()) for w in steps],
        "attn_probs.0": [(torch.zeros(2, dtype=torch.long), torch.arange(2), torch.rand(2, 3, 4, generator=g).half())],
    }


def test_a_result_file_is_safetensors_and_reads_back_as_its_chunks_joined(tmp_path):
    records = _records()
    path = wire.encode(records, path=str(tmp_path / "r.safetensors"))
    reference = load_file(path)  # safetensors' own reader takes the file as it is
    flat = wire.decode(path)
    for key, chunks in records.items():
        for i, part in enumerate(("prompt", "pos", "value")):
            joined = torch.cat([c[i] for c in chunks])
            assert torch.equal(flat[f"{key}|{part}"], joined) and flat[f"{key}|{part}"].dtype == joined.dtype
            if key in ("resid_post.1", "attn_probs.0") or part == "value":
                assert torch.equal(reference[f"{key}|{part}"], joined)
    # keys recorded at the same rows share one index, written once
    assert "resid_post.2|pos" not in reference and flat["resid_post.2|pos"] is flat["resid_post.1|pos"]
    os.unlink(path)  # a mapped result outlives its file
    assert torch.equal(flat["resid_post.1|value"], torch.cat([c[2] for c in records["resid_post.1"]]))


def test_result_bytes_and_any_safetensors_file_decode_alike(tmp_path):
    records = _records()
    flat = wire.decode(wire.encode(records))
    assert torch.equal(flat["lens:resid_post.2|value"], torch.cat([c[2] for c in records["lens:resid_post.2"]]))
    odd = {"a": torch.arange(3, dtype=torch.int8), "b": torch.randn(3, 2), "c": torch.ones(2, dtype=torch.bool)}
    save_file(odd, tmp_path / "w.safetensors")  # another writer (the workers' weights)
    read = wire.decode(str(tmp_path / "w.safetensors"))
    assert all(torch.equal(read[k], v) for k, v in odd.items())
    assert wire.decode(b"") == {} and wire.decode("") == {}


def test_a_failed_call_file_raises_its_failure(tmp_path):
    path = str(tmp_path / "f.safetensors")
    wire.encode_failure("the op failed. Fix: do not.", in_spec=True, path=path)
    with pytest.raises(SpecError, match="the op failed"):
        wire.decode(path)


@requires("cuda")
def test_a_steps_rows_leave_the_device_in_one_copy_as_cpu_would_copy_them():
    values = [torch.randn(5, 7, device="cuda"), torch.randn(3, 2, device="cuda").half(),
              torch.arange(4, device="cuda"), torch.randn(2, 3), torch.ones(3, device="cuda", dtype=torch.bool)]
    hosted = results.to_host(values)
    for value, host in zip(values, hosted):
        assert host.device.type == "cpu" and host.dtype == value.dtype and torch.equal(host, value.cpu())
    assert hosted[3] is values[3]


def test_the_result_files_of_drivers_that_no_longer_run_are_swept_and_live_ones_kept():
    """A driver killed between a call and its read leaves its file in /dev/shm (memory until reboot): the next
    engine's start deletes the files of pids that no longer run, and no other file."""
    import subprocess
    import sys

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)  # exited: no process has it now (reuse within the test is vanishingly unlikely)
    orphan = wire.result_path("x").replace(f"-{os.getpid()}-", f"-{dead_pid}-")
    mine, other = wire.result_path("kept-by-a-live-driver"), orphan.replace(".safetensors", ".txt")
    for path in (orphan, mine, other):
        with open(path, "wb") as f:
            f.write(b"x")
    try:
        assert orphan in wire.sweep_orphans()
        assert not os.path.exists(orphan) and os.path.exists(mine) and os.path.exists(other)
    finally:
        for path in (orphan, mine, other):
            if os.path.exists(path):
                os.unlink(path)


def test_a_result_file_reserved_before_or_after_its_write_is_the_same_safetensors_file():
    """The driver reserves a call's file while the workers compute (`results.reserve`): whether the reservation
    lands before the worker's write (the usual order), after it (a fast step), or is too small or too large,
    the file reads back as written, by safetensors' own reader too, and counts as written only once written."""
    records = _records()
    reference = wire.encode(records)  # bytes: no file involved
    expected = {k: v.clone() for k, v in wire.decode(reference).items()}
    for name, before, after in (("usual", 1 << 20, 0), ("small", 100, 0), ("late", 0, 1 << 20)):
        path = wire.result_path(f"reserved-{name}")
        try:
            if before:
                results.reserve(path, before)
                assert os.path.getsize(path) == 0 and not results.written(path)
            wire.encode(records, path=path)
            if after:
                results.reserve(path, after)
            assert results.written(path) and os.path.getsize(path) == len(reference)
            assert set(load_file(path)) <= set(expected)
            flat = wire.decode(path)
            assert flat.keys() == expected.keys() and all(torch.equal(flat[k], v) for k, v in expected.items())
        finally:
            os.unlink(path)
    assert not results.written(wire.result_path("never-reserved"))
