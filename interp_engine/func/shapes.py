"""Every tensor leaving a pure function has its point's axes, with sizes from the model's dims."""

from interp_engine.cache import Cache


def check_shapes(cache: Cache, model) -> None:
    d = model.dims
    sizes = {"batch": len(cache.lengths), "d_model": d.d_model, "n_heads": d.n_heads, "n_kv_heads": d.n_kv_heads,
             "d_head": d.d_head, "d_mlp": d.d_mlp, "d_vocab": d.d_vocab}
    for address, t in cache.tensors.items():
        axes = address.info.axes
        named = dict(zip(axes, t.shape))
        if t.ndim != len(axes) or any(a in sizes and sizes[a] != s for a, s in named.items()) or \
                named.get("q_pos", 0) != named.get("k_pos", 0):
            raise AssertionError(f"internal: {address} came back {tuple(t.shape)}, expected axes {axes}")
