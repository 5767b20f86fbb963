"""The driver's result arena (`backends/vllm/arena.py`): slots written as a worker writes them
(`wire.encode(..., slot=...)`), read back against the same records encoded as plain bytes, reused only once
the results handed over are gone, never under a result still held, and nothing left in /dev/shm at close.
No engine is started (the engine-level checks are in test_vllm_backend.py)."""

import glob
import os

import pytest
import torch

from interp_engine.backends.vllm import arena as arena_module, calls, wire
from interp_engine.backends.vllm.arena import ResultArena
from tests.skips import requires


def _records(seed: int, rows: int = 12, width: int = 8):
    """Keys recorded at the same rows over two steps, as a call's addresses are: two of one dtype (written and
    read as one run), one of another."""
    g = torch.Generator().manual_seed(seed)
    prompts, positions, cut = torch.arange(rows) // 4, torch.arange(rows) % 4, rows // 3
    steps = [(prompts[:cut], positions[:cut]), (prompts[cut:], positions[cut:])]
    return {"resid_post.1": [(*s, torch.randn(len(s[0]), width, generator=g)) for s in steps],
            "resid_post.2": [(*s, torch.randn(len(s[0]), width, generator=g).bfloat16()) for s in steps],
            "resid_post.3": [(*s, torch.randn(len(s[0]), width, generator=g)) for s in steps]}


def _handed_back(arena: ResultArena, records, call: str):
    """What the driver reads for a call whose worker wrote `records`: (the slot, its result or None)."""
    slot = arena.take(1000)
    path = wire.result_path(call)
    try:
        wire.encode(records, path=path, slot=tuple(arena.table(slot)))
        nbytes = arena.written(slot)
        return slot, (wire.decode(arena.hand_over(slot, nbytes)) if nbytes else None), os.path.exists(path)
    finally:
        if os.path.exists(path):
            os.unlink(path)


def _equal(flat, records) -> bool:
    """The slot's result is every key's chunks joined (each key keeps its own index, shared or not)."""
    reference = {f"{key}|{part}": torch.cat([c[i] for c in chunks])
                 for key, chunks in records.items() for i, part in enumerate(("prompt", "pos", "value"))}
    return flat.keys() == reference.keys() and all(
        torch.equal(flat[k], v) and flat[k].dtype == v.dtype for k, v in reference.items())


def test_a_slot_is_reused_only_after_its_result_is_dropped_and_never_under_a_held_result():
    arena = ResultArena()
    try:
        first_records, second_records = _records(0), _records(1)
        slot, first, to_file = _handed_back(arena, first_records, "a")
        assert first is not None and not to_file and _equal(first, first_records)
        held = {k: v.clone() for k, v in first.items()}
        other, second, _ = _handed_back(arena, second_records, "b")  # while the first is held
        assert other.offset != slot.offset and _equal(second, second_records)
        assert all(torch.equal(first[k], v) for k, v in held.items())  # untouched by the second call
        del second  # its views die here (refcounting): the slot is free again
        again, third, _ = _handed_back(arena, _records(2), "c")
        assert again.offset == other.offset  # the dropped result's pages, reused
        assert all(torch.equal(first[k], v) for k, v in held.items())
        del first, third
        assert arena.take(1000).offset == slot.offset  # everything back, coalesced: the first span again
    finally:
        arena.close()


def test_a_result_too_large_for_its_slot_goes_to_the_calls_file():
    arena = ResultArena()
    try:
        records = _records(3, rows=4096, width=64)  # 1.5 MB: over the 64 KiB slot of a first call
        slot, result, to_file = _handed_back(arena, records, "big")
        assert result is None and to_file and arena.written(slot) == 0
        arena.give(slot)
    finally:
        arena.close()


def test_a_full_arena_refuses_slots_and_a_given_back_slot_serves_again(monkeypatch):
    monkeypatch.setattr(arena_module, "ARENA_BYTES", 4 * arena_module.SMALLEST)
    arena = ResultArena()
    try:
        slots = [arena.take(0) for _ in range(4)]
        assert None not in slots and arena.take(0) is None
        arena.give(slots[1])  # a failed call's slot, after RELEASE
        assert arena.take(0) == slots[1]
        assert arena.take(10 * arena_module.ARENA_BYTES) is None
    finally:
        arena.close()


def test_close_leaves_nothing_in_dev_shm_and_results_held_stay_valid():
    mine = wire.result_path("arena-*")
    before = set(glob.glob(mine))
    arena = ResultArena()
    records = _records(4)
    _, result, _ = _handed_back(arena, records, "d")
    assert len(set(glob.glob(mine)) - before) == 1
    arena.close()
    assert set(glob.glob(mine)) == before and arena.take(0) is None
    assert _equal(result, records)  # the mapping keeps its pages after the file is gone
    del result  # its finalizer runs on a closed arena: nothing happens


def test_a_worker_maps_only_a_slot_named_as_the_driver_names_its_arenas():
    good = [wire.result_path("arena-abc"), 0, 65536]
    assert calls._slot({"slot": good}) == tuple(good)
    for bad in (["/etc/passwd", 0, 10], [wire.result_path("x"), 0, 10], [good[0], -1, 10], [good[0], 0], "x"):
        assert calls._slot({"slot": bad}) is None


@pytest.mark.parametrize("raw", ["-1", "0", "abc", "64MiB", "9" * 400 + "x", "1", "4095",
                                 str(arena_module.SMALLEST - 1)])
def test_a_hostile_arena_size_is_refused_with_the_fix_when_the_engine_starts(raw, monkeypatch):
    """INTERP_ENGINE_ARENA_BYTES is read as an engine's arena is made (not at import): anything but whole bytes,
    at least the smallest slot (below it, not one result would ever fit: every call would silently go to a file),
    is refused naming the variable, and nothing is left in /dev/shm."""
    from interp_engine.errors import SpecError

    before = set(glob.glob(wire.result_path("arena-*")))
    monkeypatch.setenv(arena_module.ARENA_ENV, raw)
    with pytest.raises(SpecError, match="INTERP_ENGINE_ARENA_BYTES") as caught:
        ResultArena()
    assert "Fix:" in str(caught.value) and set(glob.glob(wire.result_path("arena-*"))) == before
    assert f"at least {arena_module.SMALLEST} (the smallest result slot)" in str(caught.value)
    monkeypatch.setenv(arena_module.ARENA_ENV, str(arena_module.SMALLEST))
    arena = ResultArena()
    assert arena.size == arena_module.SMALLEST and arena.take(0) is not None  # the least it takes holds a result
    arena.close()


@requires("vllm")
def test_a_hostile_arena_size_refuses_load_model_before_any_engine_starts(monkeypatch, tiny_path):
    """load_model checks INTERP_ENGINE_ARENA_BYTES with the other engine arguments: no engine, no child process."""
    from interp_engine import load_model
    from interp_engine.errors import SpecError
    from tests.conftest import no_child_survives

    monkeypatch.setenv(arena_module.ARENA_ENV, "lots")
    with no_child_survives(), pytest.raises(SpecError, match="INTERP_ENGINE_ARENA_BYTES"):
        load_model(str(tiny_path("llama")), backend="vllm")


def test_the_arena_allocates_pages_as_slots_first_reach_them_and_keeps_them_until_close(monkeypatch):
    """Its memory grows to the furthest slot taken, allocated by the driver before a worker writes (st_blocks:
    what tmpfs holds), stays for the next large result once the slot is back, and goes at close."""
    import errno

    arena = ResultArena()
    try:
        small = arena.take(0)
        path = arena.path
        held = os.stat(path).st_blocks * 512
        assert small.size <= held < 2 * small.size  # a small slot's pages, not the arena's size
        large = arena.take(8 << 20)
        grown = os.stat(path).st_blocks * 512
        assert grown >= large.offset + large.size and grown < arena.size
        arena.give(large)
        arena.give(small)
        again = arena.take(8 << 20)
        assert again.offset == 0 and os.stat(path).st_blocks * 512 == grown  # reused: nothing allocated
        arena.give(again)

        def full(*args):  # /dev/shm without room: the slot is refused, never handed to a worker to SIGBUS on
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(os, "posix_fallocate", full)
        assert arena.take(16 << 20) is None
        assert arena.take(8 << 20) == again  # within what is allocated: served, and the refusal lost no span
    finally:
        arena.close()
    assert not os.path.exists(path)
