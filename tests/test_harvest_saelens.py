"""harvest(format="saelens") read back the way SAELens reads its cached activations, against capture()."""

import warnings

import pytest
import torch

from interp_engine import InputTypeError, SpecError, capture, harvest
from interp_engine import spec as S
from interp_engine.warnings import InterpEngineWarning

datasets = pytest.importorskip("datasets", reason="the saelens extra (pip install -e '.[saelens]') is not installed")

CONTEXT = 5
# (our point, SAELens's column): a TL name in, a head-axis point (flattened to heads x d_head), a d_mlp point.
POINTS = {"resid_post.1": "blocks.1.hook_resid_post", "blocks.0.attn.hook_z": "blocks.0.attn.hook_z",
          "mlp_act.-1": "blocks.2.mlp.hook_post"}


def _prompts() -> list[list[int]]:
    """Ragged token-id prompts: 2 (too short), 5 (one window), 12 (two windows and 2 tokens left), 10 (two)."""
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, 500, (n,), generator=g).tolist() for n in (2, 5, 12, 10)]


def _load_like_saelens(path: str, hook_name: str, context_size: int, d_in: int, dtype: torch.dtype):
    """SAELens's ActivationsStore.load_cached_activation_dataset and _load_raw_llm_batch_from_cached, step by step."""
    ds = datasets.load_from_disk(path)
    columns = [hook_name] + (["token_ids"] if "token_ids" in ds.column_names else [])
    ds.set_format(type="torch", columns=columns, device=torch.device("cpu"), dtype=dtype)
    assert isinstance(ds, datasets.Dataset)
    assert ds.features[hook_name].shape == (context_size, d_in)
    batch = ds[0:len(ds)]
    return batch[hook_name], batch["token_ids"]


def test_saelens_dataset_holds_captures_of_each_window_under_tl_names(eager, tmp_path):
    model = eager("llama")
    prompts = _prompts()
    spec = S.Add("resid_post.0", torch.linspace(-1, 1, model.d_model), scale=2.0)  # read after the spec's edits
    with pytest.warns(InterpEngineWarning, match="4 tokens not harvested"):
        harvest(model, prompts, list(POINTS), tmp_path / "acts", spec=spec, format="saelens", context_size=CONTEXT,
                chunk_prompts=2, progress=False)

    windows = [p[i:i + CONTEXT] for p in prompts for i in range(0, len(p) - CONTEXT + 1, CONTEXT)]
    assert len(windows) == 5
    # Windows are captured 2 at a time (chunk_prompts=2), so the reference is too: bit-identical rows.
    chunks = [capture(model, windows[i:i + 2], list(POINTS), spec, progress=False) for i in range(0, 5, 2)]
    on_disk = datasets.load_from_disk(str(tmp_path / "acts"))
    assert sorted(on_disk.column_names) == sorted([*POINTS.values(), "token_ids"])
    assert on_disk.features["token_ids"] == datasets.Sequence(datasets.Value("int32"), length=CONTEXT)
    for point, column in POINTS.items():
        expected = torch.cat([c[point].flatten(2) for c in chunks])
        feature = on_disk.features[column]
        assert isinstance(feature, datasets.Array2D)
        assert (feature.shape, feature.dtype) == ((CONTEXT, expected.shape[-1]), "float32")
        acts, ids = _load_like_saelens(str(tmp_path / "acts"), column, CONTEXT, expected.shape[-1], torch.float32)
        assert acts.shape == (5, CONTEXT, expected.shape[-1])
        torch.testing.assert_close(acts, expected, rtol=0, atol=0)
        assert ids.tolist() == [[float(t) for t in w] for w in windows]
    half = harvest(model, [windows[0]], ["resid_post.1"], tmp_path / "half", spec=spec, format="saelens",
                   context_size=CONTEXT, dtype="float16", progress=False)
    assert half.features["blocks.1.hook_resid_post"].dtype == "float16"
    # Against a capture of the same batch: a window run alone may round differently from one run beside another.
    solo = capture(model, [windows[0]], ["resid_post.1"], spec, progress=False)["resid_post.1"][0]
    assert torch.equal(half.with_format("torch")["blocks.1.hook_resid_post"][0], solo.to(torch.float16).float())
    stored = on_disk.data.column("token_ids")  # the Arrow column itself: formatters widen ints to int64
    assert str(stored.type.value_type) == "int32" and stored.to_pylist() == windows


def test_saelens_refusals_come_before_any_forward_and_all_at_once(eager, tmp_path):
    model = eager("llama")
    with pytest.raises(SpecError) as e:
        harvest(model, [[1, 2, 3]], ["logits", "q.0", "resid_post.0"], tmp_path / "a", format="saelens",
                context_size=0, dtype="bfloat16", progress=False)
    message = str(e.value)
    for part in ("context_size, a positive int", "logits has no TransformerLens hook name", "q.0 is after rotary",
                 "bfloat16 has no Arrow type"):
        assert part in message
    with pytest.raises(SpecError, match="context_size<="):
        harvest(model, [[1]], ["resid_post.0"], tmp_path / "b", format="saelens",
                context_size=model.dims.max_len + 1, progress=False)
    with pytest.raises(SpecError, match="no prompt has 9 tokens"):
        harvest(model, [[1, 2]], ["resid_post.0"], tmp_path / "c", format="saelens", context_size=9, progress=False)
    assert not any((tmp_path / d).exists() for d in "abc")  # refused before anything was written
    with pytest.raises(InputTypeError, match="not a harvest format"):
        harvest(model, [[1]], ["resid_post.0"], tmp_path / "d", format="parquet", progress=False)
    with pytest.raises(InputTypeError, match="context_size applies only"):
        harvest(model, [[1]], ["resid_post.0"], tmp_path / "e", context_size=4, progress=False)
    # A bad prompt in a later chunk is found while datasets writes (which wraps errors): ours comes out, and
    # nothing is left behind.
    with pytest.raises(SpecError, match="prompts 2..3: prompt 1 has token ids outside the vocabulary"):
        harvest(model, [[1, 2, 3]] * 3 + [[10**9, 2, 3]], ["resid_post.0"], tmp_path / "f", format="saelens",
                context_size=3, chunk_prompts=2, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    with warnings.catch_warnings(), pytest.raises(SpecError, match="not an empty folder"):
        harvest(model, [[1, 2]], ["resid_post.0"], tmp_path / "full", format="saelens", context_size=2,
                progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["full"]


def test_the_cli_writes_the_saelens_folder_of_captured_windows(eager, tiny_path, tmp_path, capsys):
    """`interp-engine harvest --format saelens --context-size N` on text prompts: token_ids are the prompts'
    tokens cut into windows, and each column equals capture() of those windows on an eager handle of its own."""
    from interp_engine.cli import main as cli

    model = eager("llama")
    texts = ["The quick brown fox jumps over the lazy dog again and again", "Paris is the capital of France, "
             "and Berlin is the capital of Germany"]
    (tmp_path / "p.txt").write_text("\n".join(texts) + "\n")
    args = ["harvest", str(tiny_path("llama")), "--backend", "eager", "--device", "cpu", "--points",
            "resid_post.1,blocks.0.hook_mlp_out", "--prompts", str(tmp_path / "p.txt"), "--no-progress"]
    assert cli([*args, "--out", str(tmp_path / "bad"), "--context-size", "4"]) == 2
    assert "context_size applies only" in capsys.readouterr().err and not (tmp_path / "bad").exists()
    with pytest.warns(InterpEngineWarning, match="tokens not harvested"):
        assert cli([*args, "--out", str(tmp_path / "acts"), "--format", "saelens", "--context-size", "4"]) == 0
    windows = [ids[i:i + 4] for ids in map(model.tokenize, texts) for i in range(0, len(ids) - 3, 4)]
    assert len(windows) > 4
    on_disk = datasets.load_from_disk(str(tmp_path / "acts"))
    assert on_disk.data.column("token_ids").to_pylist() == windows
    expected = capture(model, windows, ["resid_post.1", "mlp_out.0"], progress=False)
    for point, column in (("resid_post.1", "blocks.1.hook_resid_post"), ("mlp_out.0", "blocks.0.hook_mlp_out")):
        acts, _ = _load_like_saelens(str(tmp_path / "acts"), column, 4, model.d_model, torch.float32)
        torch.testing.assert_close(acts, expected[point], rtol=1e-4, atol=1e-5)  # another handle: rounding
