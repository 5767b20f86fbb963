"""`interp-engine serve`'s answers equal the offline API's: steered completions (chat and streams too), captures,
positions and the lens, SAEs, 32 concurrent clients each with its own vector. The session's one server
(`conftest.server`, `tests/servers.py`), the official `openai` client, the eager backend (HF's own forward) as
the reference."""

import concurrent.futures
import re

import pytest
import torch

from interp_engine import client
from interp_engine import spec as S
from interp_engine.backends.vllm import sae_refs
from interp_engine.func.capture import capture
from interp_engine.func.generate import generate
from interp_engine.func.lens import logit_lens
from tests.conftest import random_sae
from tests.servers import ATOL, DEFAULT, PROMPTS, RTOL, SAE_BOUND, complete, offline, vector, worker_status
from tests.skips import requires

pytestmark = requires("vllm")
openai = pytest.importorskip("openai")


def test_steered_completions_equal_offline_generate(server, api, eager):
    spec = S.Add("resid_post.1", vector(0)) + S.Scale("mlp_out.2", 0.5)
    steered, _ = complete(api, server, PROMPTS, spec)
    assert steered == offline(eager, spec)
    plain, _ = complete(api, server, PROMPTS, None)  # spec None: the default switched off
    assert plain == offline(eager, None) != steered
    defaulted, _ = complete(api, server, PROMPTS)  # no interp: the server's default spec
    assert defaulted == offline(eager, DEFAULT) != plain


def test_captures_equal_offline_capture(server, api, eager):
    spec, points = S.Add("resid_post.1", vector(1)), ["resid_post.0", "attn_out.1", "resid_post.2"]
    _, out = complete(api, server, PROMPTS, spec, capture=points)
    cache, tokens = client.cache_of(out), client.tokens_of(out)
    # Each row: the prompt and every generated token but the last (the last never ran through the model).
    assert [len(t) for t in tokens] == [len(eager("llama").tokenize(p)) + 5 for p in PROMPTS]
    reference = capture(eager("llama"), tokens, points, spec, progress=False)
    assert cache.lengths == reference.lengths
    for point in points:
        assert cache[point].shape == reference[point].shape
        assert torch.allclose(cache[point], reference[point], rtol=RTOL, atol=ATOL), point
    half = client.cache_of(complete(api, server, PROMPTS[:1], spec, capture=points[:1], dtype="float16")[1])
    assert half[points[0]].dtype == torch.float16


def test_capture_positions_and_the_lens_equal_offline(server, api, eager):
    spec, points = S.Add("resid_post.1", vector(4)), ["resid_post.0", "q.1"]
    _, out = complete(api, server, PROMPTS, spec, capture=points, positions=[0, -1], lens=True, top_k=5)
    tokens = client.tokens_of(out)
    lengths = [len(t) for t in tokens]
    assert out.model_extra["interp"]["positions"] == [[0, n - 1] for n in lengths]
    cache, reference = client.cache_of(out), capture(eager("llama"), tokens, points, spec, progress=False)
    for i, n in enumerate(lengths):
        assert torch.allclose(cache["resid_post.0"][i], reference["resid_post.0"][i, [0, n - 1]], rtol=RTOL, atol=ATOL)
        assert torch.allclose(cache["q.1"][i], reference["q.1"][i, [0, n - 1]], rtol=RTOL, atol=ATOL)
    top, expected = client.lens_of(out), logit_lens(eager("llama"), tokens, spec=spec, positions=[0, -1], top_k=5,
                                                     progress=False)
    assert torch.equal(top.tokens, expected.tokens)
    assert torch.allclose(top.logprobs, expected.logprobs, rtol=RTOL, atol=1e-4)
    _, out = complete(api, server, PROMPTS, spec, lens=["resid_post.-1"])  # every position, the whole vocabulary
    whole = logit_lens(eager("llama"), client.tokens_of(out), points=["resid_post.2"], spec=spec, progress=False)
    assert torch.allclose(client.lens_of(out), whole, rtol=RTOL, atol=1e-4)
    assert out.model_extra["interp"]["lens_points"] == ["resid_post.2"]
    for extra, message in ((client.extra_body(None, lens=["q.0"]), "not d_model-shaped"),
                           (client.extra_body(None, lens=True, top_k=0), "top_k=0 is outside"),
                           (client.extra_body(None, capture=["resid_post.0"], positions=[40]), "positions [40] fall")):
        with pytest.raises(openai.BadRequestError, match=re.escape(message)):
            api.completions.create(model=server[2], prompt=PROMPTS[0], max_tokens=2, extra_body=extra)


def test_chat_and_streaming_are_steered(server, api, eager):
    spec = S.Add("resid_post.1", vector(2))
    chat = api.chat.completions.create(
        model=server[2], messages=[{"role": "user", "content": PROMPTS[0]}], max_tokens=5, temperature=0.0,
        extra_body=client.extra_body(spec, capture=["resid_post.2"]))
    tokens = client.tokens_of(chat)
    reference = capture(eager("llama"), tokens, ["resid_post.2"], spec, progress=False)
    assert torch.allclose(client.cache_of(chat)["resid_post.2"], reference["resid_post.2"], rtol=RTOL, atol=ATOL)
    ids = tokens[0]  # the prompt as the chat template rendered it, and 4 of the 5 new tokens
    steered = generate(eager("llama"), [ids[:-4]], spec, max_new_tokens=4, stop_at_eos=False, progress=False)
    assert list(steered.tokens[0]) == ids[-4:]
    whole, _ = complete(api, server, PROMPTS[:1], spec)
    stream = api.completions.create(model=server[2], prompt=PROMPTS[0], max_tokens=6, temperature=0.0, stream=True,
                                    extra_body={**client.extra_body(spec), "return_token_ids": True})
    assert [t for chunk in stream for c in chunk.choices for t in (getattr(c, "token_ids", None) or [])] == whole[0]


def test_a_stream_brings_its_captures_in_its_last_chunk(server, api, eager):
    """Streamed tokens and the captures of the stream's last chunk equal the non-streaming response's and offline
    capture's (completions with two prompts, and chat)."""
    spec, points = S.Add("resid_post.1", vector(6)), ["resid_post.0", "attn_out.1"]
    whole, out = complete(api, server, PROMPTS, spec, capture=points, lens=True, top_k=3)
    chunks = list(api.completions.create(
        model=server[2], prompt=PROMPTS, max_tokens=6, temperature=0.0, stream=True,
        extra_body={**client.extra_body(spec, capture=points, lens=True, top_k=3), "return_token_ids": True}))
    streamed = [[] for _ in PROMPTS]
    for chunk in chunks:
        for choice in chunk.choices:
            streamed[choice.index] += choice.token_ids or []
    assert streamed == whole and not chunks[-1].choices
    tokens = client.tokens_of(chunks)
    assert tokens == client.tokens_of(out)
    cache, whole_cache = client.cache_of(chunks), client.cache_of(out)
    reference = capture(eager("llama"), tokens, points, spec, progress=False)
    for point in points:
        assert cache[point].shape == reference[point].shape
        assert torch.allclose(cache[point], reference[point], rtol=RTOL, atol=ATOL), point
        assert torch.allclose(cache[point], whole_cache[point], rtol=RTOL, atol=ATOL), point
    top, whole_top = client.lens_of(chunks), client.lens_of(out)
    assert torch.equal(top.tokens, whole_top.tokens)
    assert torch.allclose(top.logprobs, whole_top.logprobs, rtol=RTOL, atol=1e-4)
    chat = list(api.chat.completions.create(
        model=server[2], messages=[{"role": "user", "content": PROMPTS[1]}], max_tokens=4, temperature=0.0,
        stream=True, extra_body=client.extra_body(spec, capture=["resid_post.2"])))
    tokens = client.tokens_of(chat)
    reference = capture(eager("llama"), tokens, ["resid_post.2"], spec, progress=False)
    assert torch.allclose(client.cache_of(chat)["resid_post.2"], reference["resid_post.2"], rtol=RTOL, atol=ATOL)


def test_saes_cross_to_the_worker_once_and_leave_it_past_the_bound(server, api, eager):
    """Four concurrent requests with one SAE, then a fifth: the worker was sent it once (its own count). Two more
    SAEs in turn push it out (the server's bound holds two), and the next request naming it puts it again. Every
    response equals offline generate."""
    saes = [random_sae(128, 1, 40 + i) for i in range(3)]
    specs = [S.Clamp(sae, [3, 7], to=20.0) for sae in saes]
    expected = [offline(eager, spec) for spec in specs]
    assert expected[0] != offline(eager, None), "the clamp must change the tokens"
    [before] = worker_status(server, "ie_saes")
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda _: complete(api, server, PROMPTS, specs[0])[0], range(4)))
    assert got == [expected[0]] * 4
    assert complete(api, server, PROMPTS, specs[0])[0] == expected[0]
    [held] = worker_status(server, "ie_saes")
    assert held["puts"] - before["puts"] == 1 and held["saes"] == [sae_refs.key(saes[0])]
    for spec, tokens in zip([*specs[1:], specs[0]], [*expected[1:], expected[0]]):
        assert complete(api, server, PROMPTS, spec)[0] == tokens
        [held] = worker_status(server, "ie_saes")
        assert held["bytes"] <= SAE_BOUND, held
    assert held["puts"] - before["puts"] == 4, "the first SAE was evicted by the third and put again"
    assert held["saes"] == sorted(sae_refs.key(s) for s in (saes[2], saes[0]))


def test_concurrent_clients_each_get_their_own_vector(server, api, eager):
    specs = [S.Add("resid_post.1", vector(10 + i)) for i in range(32)]
    with concurrent.futures.ThreadPoolExecutor(len(specs)) as pool:
        got = list(pool.map(lambda s: complete(api, server, PROMPTS[:1], s)[0][0], specs))
    expected = [offline(eager, s, PROMPTS[:1])[0] for s in specs]
    assert got == expected
    assert len({tuple(t) for t in expected}) > 8  # the vectors differ in what they generate
