"""A harvest folder is verified before it is trusted (issue 19, items 4 and 5): every tampered, damaged or hostile
folder is refused at load with HarvestError and a Fix: line, and a resume redoes the shards that do not verify."""

import json
import os
import shutil
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from interp_engine import HarvestError, InterpEngineWarning, SpecError, harvest, load_harvest
from interp_engine.cli import main as cli
from interp_engine.harvest_store import OLD_FORMAT, file_digest
from tests.test_harvest import _prompts, _same_folder, _stored

POINTS = ["resid_post.1", "mlp_act.2"]
SETTINGS = dict(chunk_prompts=8, shard_tokens=100, progress=False)


@pytest.fixture(scope="module")
def made(eager, tmp_path_factory):
    """One clean harvest of 60 prompts in several shards; each test works on its own copy."""
    out = tmp_path_factory.mktemp("integrity") / "clean"
    h = harvest(eager("llama"), _prompts(60, seed=7), POINTS, out, **SETTINGS)
    assert h.n_shards >= 3
    return out


@pytest.fixture
def folder(made, tmp_path):
    copy = tmp_path / "h"
    shutil.copytree(made, copy)
    return copy


def _manifest(out: Path) -> dict:
    return json.loads((out / "manifest.json").read_text())


def _edit(out: Path, change) -> None:
    m = _manifest(out)
    change(m)
    (out / "manifest.json").write_text(json.dumps(m))


def _forge(out: Path, k: int, change) -> None:
    """Rewrite shard k with changed tensors and record the new size and sha256, as a consistent forgery would:
    only the structural checks can tell."""
    path = out / f"shard-{k:05d}.safetensors"
    tensors = load_file(path)
    change(tensors)
    save_file(tensors, str(path))
    _edit(out, lambda m: m["shards"][k].update(bytes=path.stat().st_size, sha256=file_digest(path)))


def _data_start(path: Path, name: str) -> int:
    """Where tensor `name`'s bytes start in a safetensors file."""
    raw = path.read_bytes()
    length = struct.unpack("<Q", raw[:8])[0]
    return 8 + length + json.loads(raw[8:8 + length])[name]["data_offsets"][0]


def _poke(path: Path, at: int, data: bytes) -> None:
    with path.open("r+b") as f:
        f.seek(at)
        f.write(data)


def _outside(out: Path) -> Path:
    """A real shard copied outside the folder (what a path escaping the folder would read)."""
    target = out.parent / "outside.safetensors"
    shutil.copy(out / "shard-00000.safetensors", target)
    return target


def _symlink_shard(out: Path) -> None:
    target = _outside(out)
    (out / "shard-00000.safetensors").unlink()
    (out / "shard-00000.safetensors").symlink_to(target)


def _symlink_manifest(out: Path) -> None:
    target = out.parent / "elsewhere.json"
    shutil.move(out / "manifest.json", target)
    (out / "manifest.json").symlink_to(target)


def _shift_tokens(m: dict) -> None:  # the counts still add up; the file disagrees
    m["shards"][0]["tokens"] += 1
    m["n_tokens"] += 1


def _shift_prompts(m: dict) -> None:
    m["shards"][0]["prompts"] -= 1
    m["n_prompts"] -= 1
    for s in m["shards"][1:]:
        s["first_prompt"] -= 1


def _bad_offsets(out: Path) -> None:  # offsets[1] > offsets[2]: not rising
    _forge(out, 0, lambda t: t["offsets"].__setitem__(1, t["offsets"][2] + 1))


def _offsets_past_end(out: Path) -> None:
    _forge(out, 0, lambda t: t["offsets"].__setitem__(-1, t["offsets"][-1] + 5))


def _fifo(out: Path) -> None:  # opening a FIFO would block forever
    (out / "shard-00001.safetensors").unlink()
    os.mkfifo(out / "shard-00001.safetensors")


def _garbage(out: Path) -> None:  # the recorded size, but not a safetensors file
    path = out / "shard-00001.safetensors"
    path.write_bytes(b"\xff" * path.stat().st_size)


def _m(change):
    return lambda out: _edit(out, change)


# (what is done to the folder, the message asserted); each is refused at load_harvest with HarvestError.
CASES = {
    "dotdot path": (_m(lambda m: m["shards"][0].update(file="../../x")), "names the file '../../x'"),
    "absolute path": (lambda out: _edit(out, lambda m: m["shards"][0].update(file=str(_outside(out)))),
                      "shard 0 names the file '/.*, not 'shard-00000.safetensors'"),
    "/etc/passwd": (_m(lambda m: m["shards"][1].update(file="/etc/passwd")),
                    "shard 1 names the file '/etc/passwd', not 'shard-00001.safetensors'"),
    "symlink out": (_symlink_shard, "shard-00000.safetensors is a symbolic link"),
    "manifest symlink": (_symlink_manifest, "manifest.json is a symbolic link"),
    "not JSON": (lambda out: (out / "manifest.json").write_text("{'format': 1"), "is not valid JSON"),
    "not UTF-8": (lambda out: (out / "manifest.json").write_bytes(b'{"a": "\xff\xfe"}'), "is not UTF-8 text"),
    "deep JSON": (lambda out: (out / "manifest.json").write_text("[" * 100000 + "]" * 100000), "not valid JSON"),
    "a list": (lambda out: (out / "manifest.json").write_text("[1, 2]"), "holds a JSON list, not an object"),
    "missing key": (_m(lambda m: m.pop("shards")), "lacks 'shards'"),
    "missing shard key": (_m(lambda m: m["shards"][2].pop("sha256")), "shard 2 lacks 'sha256'"),
    "str count": (_m(lambda m: m.update(n_tokens="12")), "n_tokens is '12', not a non-negative int"),
    "bool count": (_m(lambda m: m["shards"][0].update(prompts=True)), "prompts is true, not a non-negative int"),
    "negative count": (_m(lambda m: m.update(n_prompts=-1)), "n_prompts is -1, not a non-negative int"),
    "str complete": (_m(lambda m: m.update(complete="yes")), "complete is 'yes', not a JSON bool"),
    "unknown format": (_m(lambda m: m.update(format="interp_engine.harvest/9")), "has format 'interp_engine.harv"),
    "int dtype": (_m(lambda m: m.update(dtype="int8")), "dtype 'int8' is not one harvest stores"),
    "repeated point": (_m(lambda m: m.update(points=["resid_post.1", "resid_post.1"])), "not a list of distinct"),
    "total tokens": (_m(lambda m: m.update(n_tokens=m["n_tokens"] + 1)), "tokens, but its shards hold"),
    "total prompts": (_m(lambda m: m.update(n_prompts=m["n_prompts"] - 1)), "prompts and .* tokens, but its sha"),
    "first_prompt": (_m(lambda m: m["shards"][1].update(first_prompt=0)), "shard 1 starts at prompt 0, but"),
    "zero prompts": (_m(lambda m: m["shards"][0].update(prompts=0, tokens=0)), "each shard holds at least one"),
    "shard tokens": (_m(_shift_tokens), r"tokens is I64 \[\d+\], the manifest says I64 \[\d+\]"),
    "shard prompts": (_m(_shift_prompts), r"offsets is I64 \[\d+\], the manifest says I64 \[\d+\]"),
    "stored dtype": (_m(lambda m: m.update(dtype="float16")), r"resid_post.1 is F32 \[.*the manifest says F16"),
    "row shape": (_m(lambda m: m["shapes"].update({"mlp_act.2": [7]})),
                  r"mlp_act.2 is F32 \[\d+, \d+\], the manifest says F32 \[\d+, 7\]"),
    "bad shapes": (_m(lambda m: m.update(shapes={"resid_post.1": [32]})), "does not give each point's row shape"),
    "extra point": (_m(lambda m: (m["points"].append("resid_post.0"), m["shapes"].update({"resid_post.0": [32]}))),
                    r"missing \['resid_post.0'\]"),
    "point missing": (lambda out: _forge(out, 1, lambda t: t.pop("mlp_act.2")), r"missing \['mlp_act.2'\]"),
    "unlisted tensor": (lambda out: _forge(out, 1, lambda t: t.update(extra=torch.zeros(1))), r"unexpected \['ext"),
    "offsets not rising": (_bad_offsets, "its prompt offsets do not rise from 0"),
    "offsets past end": (_offsets_past_end, "its prompt offsets do not rise from 0"),
    "missing shard": (lambda out: (out / "shard-00001.safetensors").unlink(),
                      r"shard 1 \(shard-00001.safetensors\) is missing from"),
    "truncated": (lambda out: os.truncate(out / "shard-00002.safetensors", 1000), r"is 1000 bytes, but it was \d+"),
    "fifo": (_fifo, "shard-00001.safetensors is not a plain file"),
    "garbage": (_garbage, "is not a safetensors file"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_tampered_folder_is_refused_at_load(folder, case):
    damage, message = CASES[case]
    damage(folder)
    with pytest.raises(HarvestError, match=message) as e:
        load_harvest(folder)
    assert "Fix:" in str(e.value), str(e.value)
    assert isinstance(e.value, RuntimeError)  # a LoadError: `except RuntimeError` catches it too


def test_changed_bytes_are_found_at_first_open_or_at_load_with_verify_eager(folder, made):
    path = folder / "shard-00001.safetensors"
    at = _data_start(path, "resid_post.1")
    _poke(path, at, bytes(b ^ 0xFF for b in path.read_bytes()[at:at + 4]))  # same size, same header
    h = load_harvest(folder)  # lazy: the header and counts agree, the bytes are not read yet
    h.prompt(0)  # shard 0 is fine
    for read in (lambda: h.prompt(h.manifest["shards"][1]["first_prompt"]), lambda: h.shard(1),
                 lambda: h[h.manifest["shards"][0]["tokens"]], h.verify):
        with pytest.raises(HarvestError, match="shard-00001.safetensors does not hash to the sha256 recorded") as e:
            read()
        assert "Fix: rerun the same harvest(...) into this folder" in str(e.value)
    with pytest.raises(HarvestError, match="does not hash"):
        load_harvest(folder, verify="upfront")
    clean = load_harvest(made, verify="upfront")
    assert clean._verified == set(range(clean.n_shards))
    with pytest.raises(SpecError, match="verify='full' is not one of") as e:
        load_harvest(made, verify="full")
    assert "Fix:" in str(e.value)


def test_a_format_1_folder_still_loads_with_a_warning_and_is_not_resumed(folder, made, eager):
    def old(m):
        m["format"] = OLD_FORMAT
        del m["shapes"]
        for s in m["shards"]:
            del s["bytes"], s["sha256"]
    _edit(folder, old)
    with pytest.warns(InterpEngineWarning, match="records no shard digests"):
        h = load_harvest(folder, verify="upfront")
    assert torch.equal(_stored(h, "mlp_act.2"), _stored(load_harvest(made), "mlp_act.2"))
    os.truncate(folder / "shard-00000.safetensors", 1000)  # the structural checks still apply
    with pytest.raises(HarvestError, match="not a safetensors file|tensors do not tile"):
        load_harvest(folder)
    with pytest.raises(SpecError, match=f"holds a harvest in {OLD_FORMAT}; this run writes .* cannot resume") as e:
        harvest(eager("llama"), _prompts(60, seed=7), POINTS, folder, **SETTINGS)
    assert "Fix: harvest into a new folder" in str(e.value)


def _flip(out: Path) -> None:
    path = out / "shard-00001.safetensors"
    at = _data_start(path, "mlp_act.2") + 8
    _poke(path, at, bytes(b ^ 0x01 for b in path.read_bytes()[at:at + 2]))


RESUMES = {
    "deleted": (lambda out: (out / "shard-00001.safetensors").unlink(), "is missing"),
    "truncated": (lambda out: os.truncate(out / "shard-00001.safetensors", 500), "is 500 bytes"),
    "bytes changed": (_flip, "does not hash"),
    "offsets forged": (_bad_offsets, "prompt offsets do not rise"),
}


@pytest.mark.parametrize("case", list(RESUMES))
def test_resume_redoes_a_finished_shard_that_does_not_verify(folder, made, eager, case):
    damage, message = RESUMES[case]
    damage(folder)
    m = _manifest(folder)
    assert m["complete"]  # the folder says it is done; it is not
    with pytest.warns(InterpEngineWarning, match=f"{message}.* Redoing shard") as w:
        h = harvest(eager("llama"), _prompts(60, seed=7), POINTS, folder, **SETTINGS)
    assert len([x for x in w if issubclass(x.category, InterpEngineWarning)]) == 1
    assert h.n_prompts == 60 and h._verified == set(range(h.n_shards))
    _same_folder(made, folder)  # every file and the manifest equal a clean run's
    load_harvest(folder, verify="upfront")


def test_an_unfinished_folder_with_a_damaged_shard_resumes_from_it(folder, made, eager):
    m = _manifest(folder)
    keep = 3
    for s in m["shards"][keep:]:
        (folder / s["file"]).unlink()
    m["shards"], m["complete"] = m["shards"][:keep], False
    m["n_prompts"], m["n_tokens"] = (sum(s[k] for s in m["shards"]) for k in ("prompts", "tokens"))
    (folder / "manifest.json").write_text(json.dumps(m))
    os.truncate(folder / "shard-00000.safetensors", 100)
    with pytest.warns(InterpEngineWarning, match="Redoing shard 0 and the 2 after it"):
        harvest(eager("llama"), _prompts(60, seed=7), POINTS, folder, **SETTINGS)
    _same_folder(made, folder)


def test_a_damaged_manifest_is_never_resumed_over(folder, eager):
    (folder / "manifest.json").write_bytes(b"\x00\x01garbage")
    with pytest.raises(HarvestError, match="is not UTF-8 text|is not valid JSON") as e:
        harvest(eager("llama"), _prompts(60, seed=7), POINTS, folder, **SETTINGS)
    assert "Fix: the manifest was edited or damaged" in str(e.value)
    assert (folder / "shard-00000.safetensors").is_file()  # nothing of the folder was removed


def test_cli_reports_a_damaged_folder_in_a_message_not_a_traceback(folder, tiny_path, tmp_path, capsys):
    (tmp_path / "p.txt").write_text("Hello there\nGeneral Kenobi\n")
    args = ["harvest", str(tiny_path("llama")), "--backend", "eager", "--device", "cpu", "--points", "resid_post.1",
            "--prompts", str(tmp_path / "p.txt"), "--out", str(folder), "--no-progress"]
    (folder / "manifest.json").write_text('{"format": "interp_engine.harvest/2", "shards": [')
    assert cli(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("interp-engine harvest: ") and "is not valid JSON" in err and "Fix:" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 2  # the message and its Fix: line
    _edit_ok = {"format": "interp_engine.harvest/2"}
    (folder / "manifest.json").write_text(json.dumps(_edit_ok))
    assert cli(args) == 2
    assert "lacks 'model'" in capsys.readouterr().err


VALUES = [None, -1, 0, 1, 7, 2**70, 1.5, float("nan"), "", "x", "../x", "/etc/passwd", "shard-00000.safetensors", [],
          [1], ["resid_post.1"], {}, {"a": 1}, True, False]


def test_random_manifest_and_header_damage_gives_only_library_errors(folder):
    """Seeded random damage (a manifest value replaced by a random JSON value, or header bytes of a shard changed,
    with the manifest's size and sha256 forged to match): load_harvest and a full read either work or raise
    HarvestError; nothing else escapes."""
    import random

    rng, clean, path = random.Random(19), _manifest(folder), folder / "shard-00001.safetensors"
    original, outcomes = path.read_bytes(), {"refused": 0, "read": 0}
    header_end = 8 + struct.unpack("<Q", original[:8])[0]
    for trial in range(400):
        m, shard_bytes = json.loads(json.dumps(clean)), bytearray(original)
        if trial % 2:
            target = m if rng.random() < 0.4 else rng.choice(m["shards"])
            target[rng.choice(sorted(target))] = rng.choice(VALUES)
        else:
            for _ in range(rng.randint(1, 3)):
                shard_bytes[rng.randrange(header_end)] = rng.randrange(256)
            path.write_bytes(bytes(shard_bytes))
            m["shards"][1].update(bytes=len(shard_bytes), sha256=file_digest(path))
        (folder / "manifest.json").write_text(json.dumps(m))
        try:
            h = load_harvest(folder, partial=True, verify="upfront")
            [h.shard(k) for k in range(h.n_shards)], h.prompt(h.n_prompts - 1), h[h.n_tokens - 1]
            outcomes["read"] += 1
        except HarvestError as e:
            assert "Fix:" in str(e)
            outcomes["refused"] += 1
        path.write_bytes(original)
    assert outcomes["refused"] > 200 and outcomes["read"] > 10, outcomes
