"""`interp-engine serve --backend vllm-static`: one real server with compiled taps (behind `slow`: its compile
alone is ~50-70 s here), the eager backend as the reference, as tests/test_serve.py (`tests/servers.py`)."""

import signal

import psutil
import pytest
import torch

from interp_engine import client
from interp_engine import spec as S
from interp_engine.func.capture import capture
from tests.conftest import no_child_survives
from tests.servers import ATOL, DEFAULT, KEY, PROMPTS, RTOL, complete, offline, served, vector
from tests.skips import requires

pytestmark = [requires("vllm"), requires("slow")]
openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def static_server(tiny_path, tmp_path_factory):
    with no_child_survives():
        yield from served(str(tiny_path("llama")), tmp_path_factory, ("--backend", "vllm-static", "--static-points",
                                                                     "resid_post.0,resid_post.2", "--static-writes",
                                                                     "resid_post.0,resid_post.1"))


def test_vllm_static_serves_its_declared_taps_as_offline_and_refuses_the_others(static_server, eager):
    api = openai.OpenAI(base_url=static_server[1], api_key=KEY, max_retries=0, timeout=120)
    spec = S.Add("resid_post.1", vector(6)) + S.Scale("resid_post.0", 0.5)
    steered, out = complete(api, static_server, PROMPTS, spec, capture=["resid_post.2"])
    assert steered == offline(eager, spec)
    tokens = client.tokens_of(out)
    reference = capture(eager("llama"), tokens, ["resid_post.2"], spec, progress=False)
    assert torch.allclose(client.cache_of(out)["resid_post.2"], reference["resid_post.2"], rtol=RTOL, atol=ATOL)
    defaulted, _ = complete(api, static_server, PROMPTS)  # the default spec writes resid_post.0: declared
    assert defaulted == offline(eager, DEFAULT)
    with pytest.raises(openai.BadRequestError, match="mlp_out.1") as refused:
        complete(api, static_server, PROMPTS, S.Scale("mlp_out.1", 2.0))
    assert "Fix:" in refused.value.body["message"]
    process = static_server[0]
    children = psutil.Process(process.pid).children(recursive=True)
    process.send_signal(signal.SIGTERM)
    assert process.wait(60) == 0
    _, alive = psutil.wait_procs(children, timeout=10)
    assert not alive, f"the server's children survived SIGTERM: {alive}"
