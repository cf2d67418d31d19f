#!/usr/bin/env python3
"""Where a qwen3_5_moe prefill chunk spends its time, op by op, on one checkpoint (MLX CPU by
default): each piece is run on its own on the shapes of a T-token chunk and evaluated, the
median of --repeats. Both engines issue these MLX ops (rMLX: the sequential recurrence; mlx-vlm
on CPU/CUDA: the chunked one), so the split explains both.

Usage: .venv-ref/bin/python scripts/bench/profile_qwen3_5.py --model .bench/qwen3_5-moe-bench-fp32 [--tokens 255]
"""

import argparse
import statistics
import time
from pathlib import Path

import mlx.core as mx


def timed(fn, repeats):
    mx.eval(fn())  # warm-up
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        mx.eval(fn())
        out.append((time.perf_counter() - t) * 1000)
    return statistics.median(out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--tokens", type=int, default=255)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", choices=["cpu", "gpu"], default="cpu")
    args = ap.parse_args()
    mx.set_default_device(getattr(mx, args.device))

    from mlx_vlm.models.qwen3_5 import gated_delta as gd
    from mlx_vlm.utils import load_model

    model = load_model(Path(args.model))
    lm = model.language_model
    layers = lm.model.layers
    lin = next(i for i, layer in enumerate(layers) if layer.is_linear)
    full = next(i for i, layer in enumerate(layers) if not layer.is_linear)
    T = args.tokens
    norm = layers[0].input_layernorm.weight
    dtype = norm.dtype  # the activations' dtype (fp32, or bf16 for the 4-bit checkpoint)
    x = (0.5 * mx.random.normal((1, T, norm.shape[0]), key=mx.random.key(0))).astype(dtype)
    ga = layers[lin].linear_attn
    Hk, Hv, Dk, Dv = ga.num_k_heads, ga.num_v_heads, ga.head_k_dim, ga.head_v_dim
    conv_dim = ga.conv_dim
    K = ga.conv_kernel_size
    rows = {}

    def whole(kind, layer):
        from mlx_vlm.models.cache import ArraysCache, KVCache

        def run():
            cache = ArraysCache(size=2) if kind == "gdn" else KVCache()
            if kind == "gdn":
                return layer.linear_attn(x, mask=None, cache=cache)
            return layer.self_attn(x, mask="causal", cache=cache)

        return run

    rows["GDN mixer, whole (mlx-vlm: chunked)"] = timed(whole("gdn", layers[lin]), args.repeats)
    orig = gd.gated_delta_chunked
    gd.gated_delta_chunked = lambda q, k, v, g, beta, state, mask=None, C=64: gd.gated_delta_ops(q, k, v, g, beta, state, mask)
    try:
        rows["GDN mixer, whole (sequential ops, as rMLX)"] = timed(whole("gdn", layers[lin]), args.repeats)
    finally:
        gd.gated_delta_chunked = orig
    rows["  in_proj_qkv + z + a + b"] = timed(lambda: [ga.in_proj_qkv(x), ga.in_proj_z(x), ga.in_proj_a(x), ga.in_proj_b(x)], args.repeats)
    ci = mx.random.normal((1, T + K - 1, conv_dim), key=mx.random.key(1)).astype(dtype)
    rows["  conv1d (depthwise, groups = conv_dim)"] = timed(lambda: mx.conv1d(ci, ga.conv1d.weight, groups=conv_dim), args.repeats)
    q = mx.random.normal((1, T, Hk, Dk), key=mx.random.key(2)).astype(dtype) / Dk
    k = mx.random.normal((1, T, Hk, Dk), key=mx.random.key(3)).astype(dtype) / Dk ** 0.5
    v = mx.random.normal((1, T, Hv, Dv), key=mx.random.key(4)).astype(dtype)
    g = mx.random.uniform(0.1, 0.98, (1, T, Hv), key=mx.random.key(5))
    beta = mx.random.uniform(0.0, 1.0, (1, T, Hv), key=mx.random.key(6)).astype(dtype)
    state = mx.zeros((1, Hv, Dv, Dk), dtype=mx.float32)
    rows["  recurrence, sequential (gated_delta_ops)"] = timed(lambda: gd.gated_delta_ops(q, k, v, g, beta, state), args.repeats)
    rows["  recurrence, chunked (gated_delta_chunked)"] = timed(lambda: gd.gated_delta_chunked(q, k, v, g, beta, state), args.repeats)
    o = mx.random.normal((1, T, Hv * Dv), key=mx.random.key(7)).astype(dtype)
    rows["  out_proj"] = timed(lambda: ga.out_proj(o), args.repeats)
    rows["gated attention, whole"] = timed(whole("attn", layers[full]), args.repeats)
    rows["MoE block (router, 8 of E experts, shared expert)"] = timed(lambda: layers[lin].mlp(x), args.repeats)
    h = mx.random.normal((1, 1, x.shape[-1]), key=mx.random.key(8)).astype(dtype)
    rows["lm_head, 1 row"] = timed(lambda: lm.lm_head(h), args.repeats)
    n_lin = sum(1 for layer in layers if layer.is_linear)
    n_full = len(layers) - n_lin
    print(f"{args.model}: {T} tokens, {n_lin} GDN + {n_full} attention layers, device {args.device}, ms (median of {args.repeats})")
    for name, ms in rows.items():
        print(f"  {name:52s} {ms:9.1f}")
    moe = rows["MoE block (router, 8 of E experts, shared expert)"]
    for label, gdn in [("sequential", rows["GDN mixer, whole (sequential ops, as rMLX)"]),
                       ("chunked", rows["GDN mixer, whole (mlx-vlm: chunked)"])]:
        total = n_lin * gdn + n_full * rows["gated attention, whole"] + len(layers) * moe
        print(f"  per chunk, {label} GDN: {total:.0f} ms = GDN {n_lin * gdn / total:.0%}, attention "
              f"{n_full * rows['gated attention, whole'] / total:.0%}, MoE {len(layers) * moe / total:.0%} "
              f"(norms/embedding not counted)")


if __name__ == "__main__":
    main()
