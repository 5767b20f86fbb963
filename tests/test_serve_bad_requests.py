"""What `interp-engine serve` refuses: every bad request gets its status and the Python API's message (with its
`Fix:` line), and the server goes on serving correctly; the command refuses what it cannot serve before starting.
The session's one server (`conftest.server`, `tests/servers.py`)."""

import base64
import json
import urllib.error
import urllib.request

import pytest
import torch

from interp_engine import Spec, client, load_model
from interp_engine import spec as S
from interp_engine.errors import InterpEngineError
from interp_engine.func.generate import generate
from tests.servers import MAX_OPS, PROMPTS, complete, offline, vector
from tests.skips import requires

pytestmark = requires("vllm")
openai = pytest.importorskip("openai")


def _message(call) -> str:
    with pytest.raises(InterpEngineError) as error:
        call()
    return str(error.value)


def test_bad_requests_are_refused_with_the_python_message_and_the_server_goes_on(server, api, eager):
    handle = load_model(server[2], backend="vllm")  # never loaded: the Python API refuses before any forward
    python = lambda spec: _message(lambda: generate(handle, PROMPTS[0], Spec.from_dict(spec), max_new_tokens=2))  # noqa: E731
    good = Spec((S.Add("resid_post.1", vector(3)),)).to_dict()
    nan = json.loads(json.dumps(good))
    nan["ops"][0]["vector"]["data"] = base64.b64encode(torch.full((128,), float("nan")).numpy().tobytes()).decode()
    cases = {
        "unknown op": ({"interp_engine_spec": 1, "ops": [{"op": "Exec", "point": "resid_post.0"}]}, None),
        "unknown point": (Spec((S.Scale("resid_mid.9", 2.0),)).to_dict(), None),
        "wrong shape": (Spec((S.Add("resid_post.1", torch.ones(64)),)).to_dict(), None),
        "NaN vector": (nan, None),
        "too many ops": (Spec(tuple(S.Scale("resid_post.0", 1.0) for _ in range(MAX_OPS + 1))).to_dict(),
                         "the server takes at most"),
        "over the byte limit": (good | {"padding": "x" * (1 << 20)}, "over the server's"),
    }
    for name, (spec, expected) in cases.items():
        with pytest.raises(openai.BadRequestError) as refused:
            api.completions.create(model=server[2], prompt=PROMPTS[0], max_tokens=2, extra_body={"interp": {"spec": spec}})
        message = refused.value.body["message"]
        assert "Fix:" in message, name
        assert (expected or python(spec)) in message, (name, message)
    oversized = client.extra_body(None, capture=[f"{p}.{i}" for p in ("resid_post", "attn_out") for i in range(3)])
    with pytest.raises(openai.BadRequestError, match="--max-capture-bytes"):
        api.completions.create(model=server[2], prompt=[5] * 120, max_tokens=2, extra_body=oversized)
    with pytest.raises(openai.APIError, match="--max-capture-bytes"):  # a stream's is its last chunk
        list(api.completions.create(model=server[2], prompt=[5] * 120, max_tokens=2, stream=True,
                                    extra_body=oversized))
    stranger = openai.OpenAI(base_url=server[1], api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):  # 401 before the body is read
        stranger.completions.create(model=server[2], prompt=PROMPTS[0], max_tokens=2,
                                    extra_body={"interp": {"spec": cases["unknown op"][0]}})
    keyless = urllib.request.Request(f"{server[1]}/completions", method="POST", headers={"Content-Type": "application/json"},
                                     data=json.dumps({"model": server[2], "prompt": "x", "max_tokens": 2}).encode())
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(keyless, timeout=60)
    assert refused.value.code == 401
    steered, _ = complete(api, server, PROMPTS, Spec.from_dict(good))  # still serving, and correctly
    assert steered == offline(eager, Spec.from_dict(good))


def test_the_command_refuses_what_it_cannot_serve_before_starting(tiny_path, tmp_path, capsys):
    from interp_engine.serve import main

    path = str(tiny_path("llama"))
    assert main([path, "--backend", "eager"]) == 2
    assert 'runs backend="vllm"' in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(Spec((S.Scale("resid_mid.9", 2.0),)).to_dict()))
    assert main([path, "--default-spec", str(bad)]) == 2
    assert "resid_mid.9" in capsys.readouterr().err
