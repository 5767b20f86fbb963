"""vLLM's own module tree of a model, built on the meta device in a child process (vLLM's distributed state is
process-wide): what the site tables of families vLLM does not serve through us yet are checked against."""

import json
import subprocess
import sys

_SCRIPT = """
import importlib, json, socket, sys, torch
exec(sys.argv.pop())  # the caller's prelude (a test-only import shim), before vLLM is imported
from vllm.config import ModelConfig, VllmConfig, set_current_vllm_config
from vllm.distributed import init_distributed_environment, initialize_model_parallel
path, module, name, dtype, overrides = sys.argv[1:]
cls = getattr(importlib.import_module(f"vllm.model_executor.models.{module}"), name)
s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
config = VllmConfig(model_config=ModelConfig(model=path, tokenizer=path, skip_tokenizer_init=True, dtype=dtype,
                                             hf_overrides=json.loads(overrides)))
with set_current_vllm_config(config):
    init_distributed_environment(1, 0, f"tcp://127.0.0.1:{port}", 0, "gloo")
    initialize_model_parallel(1)
    with torch.device("meta"):
        model = cls(vllm_config=config)
print(json.dumps({name: [type(m).__name__, getattr(m, "kv_sharing_target_layer_name", None)]
                  for name, m in model.named_modules()}))
"""


def module_tree(path, module: str, name: str, dtype: str = "float32", overrides: dict | None = None,
                prelude: str = ""):
    """({module path: class name}, {attention path: the layer whose KV cache it reads, where shared}) of vLLM's
    `vllm.model_executor.models.<module>.<name>` built from the model folder at `path`. `prelude`: Python run in
    the child before vLLM is imported."""
    proc = subprocess.run([sys.executable, "-c", _SCRIPT, str(path), module, name, dtype, json.dumps(overrides or {}),
                           prelude], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    tree = json.loads(proc.stdout.strip().splitlines()[-1])
    return {k: v[0] for k, v in tree.items()}, {k: v[1] for k, v in tree.items() if v[1]}


def check_hybrid_tree(tree: dict, table, root: str = "", linear=(0, 2)) -> None:
    """A hybrid (Gated DeltaNet + full attention) site table against vLLM's module tree of the tiny model
    (tiny.py: linear, full, linear), its text model under `root` (a wrapper's)."""
    at_root = lambda path: root + path  # noqa: E731
    assert tree[at_root(table.layers)] == "ModuleList" and at_root(table.final_norm) in tree
    for i in range(3):
        at = lambda path: at_root(f"{table.layers}.{i}.{path}")  # noqa: E731
        for path in (table.mlp_out, table.mid_norm, *(p for p in (table.router, table.mlp_down, table.mlp_in) if p)):
            assert at(path) in tree, at(path)
        is_linear = i in linear
        assert (at(table.linear_attn) in tree) == is_linear and (at(table.attn_out) in tree) == (not is_linear)
        if is_linear:
            assert "GatedDeltaNet" in tree[at(table.linear_attn)], tree[at(table.linear_attn)]
            assert tree[at(table.lin_norm)] == "RMSNormGated", tree[at(table.lin_norm)]
        else:
            assert tree[at(table.attention)] == tree[at(table.z_out)] == "Attention"
