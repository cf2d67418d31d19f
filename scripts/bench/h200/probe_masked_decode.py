#!/usr/bin/env python3
"""What a decode step's attention costs at each new cache length on MLX CUDA, with and without
the padded / ragged batch's mask, and over the cache's whole buffer (attention.rs
`reads_whole_buffer`): the first call at a length against a second at the same length.

Qwen3-4B's attention shape (32 query heads, 8 KV heads of 128, bf16), 4 rows, one query each,
keys growing one position a step from --start (as decode does), --steps steps:
- exact:  keys [4, 8, L, 128], no mask (an unpadded batch);
- masked: the same keys with a boolean mask [4, 1, 1, L] (a padded or ragged batch's);
- whole:  keys [4, 8, BUFFER, 128] (the buffer, rounded up to 256) with the mask over it;
- grouped: the masked step as attention.rs `grouped_one_query` computes it: each KV head's 4
  query heads as the rows of one matmul (MLX 0.32.2 CUDA sends a one-query SDPA with a mask
  array to its unfused fallback, whose matmuls broadcast the keys over those 4 heads).
If a new length builds anything (a cuDNN graph, a kernel), the first call at it is the slow one.

Usage: python3 scripts/bench/h200/probe_masked_decode.py [--start 600] [--steps 12] [--layers 36]
       [--json-out F]
"""
import argparse
import json
import statistics
import time

import mlx.core as mx

ROWS, HEADS, KV_HEADS, DIM = 4, 32, 8, 128
LAYERS = 36


def grouped(q, k, v, mask):
    rows, heads, _, dim = q.shape
    kv_heads = k.shape[1]
    qg = (q * DIM ** -0.5).reshape(rows, kv_heads, heads // kv_heads, dim)
    scores = qg @ k.swapaxes(-1, -2)
    scores = mx.where(mask, scores, mx.finfo(scores.dtype).min)
    weights = mx.softmax(scores, axis=-1, precise=True)
    return (weights @ v).reshape(rows, heads, 1, dim)


def once(q, k, v, mask, fold=False):
    """One call per layer (--layers of them in one graph, as a decode step has), timed."""
    t = time.perf_counter()
    outs = []
    for _ in range(LAYERS):
        if fold:
            outs.append(grouped(q, k, v, mask))
        else:
            outs.append(mx.fast.scaled_dot_product_attention(q, k, v, scale=DIM ** -0.5, mask=mask))
    mx.eval(*outs)
    mx.synchronize()
    return (time.perf_counter() - t) * 1000


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--start", type=int, default=600)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--dtype", default="bfloat16", help="bfloat16, float16 or float32")
    ap.add_argument("--layers", type=int, default=36, help="attention calls per timed graph")
    ap.add_argument("--json-out")
    args = ap.parse_args()
    global LAYERS
    LAYERS = args.layers
    key = mx.random.key(0)
    dtype = getattr(mx, args.dtype)
    q = mx.random.normal((ROWS, HEADS, 1, DIM), key=key).astype(dtype)
    top = ((args.start + args.steps) // 256 + 1) * 256
    k_all = mx.random.normal((ROWS, KV_HEADS, top, DIM), key=mx.random.key(1)).astype(dtype)
    v_all = mx.random.normal((ROWS, KV_HEADS, top, DIM), key=mx.random.key(2)).astype(dtype)
    mx.eval(q, k_all, v_all)
    # Row 1 starts 7 columns later (left padding), as a joined batch's shorter row does.
    pads = mx.array([0, 7, 0, 3]).reshape(ROWS, 1, 1, 1)
    results = {"exact": [], "masked": [], "whole": [], "grouped": []}
    for step in range(args.steps):
        length = args.start + step
        k, v = k_all[:, :, :length], v_all[:, :, :length]
        cols = mx.arange(length).reshape(1, 1, 1, length)
        mask = cols >= pads
        whole_cols = mx.arange(top).reshape(1, 1, 1, top)
        whole_mask = mx.logical_and(whole_cols >= pads, whole_cols < length)
        mx.eval(k, v, mask, whole_mask)
        for name, (kk, vv, m) in {"exact": (k, v, None), "masked": (k, v, mask),
                                  "whole": (k_all, v_all, whole_mask),
                                  "grouped": (k, v, mask)}.items():
            fold = name == "grouped"
            first, again = once(q, kk, vv, m, fold), once(q, kk, vv, m, fold)
            results[name].append({"length": length, "first_ms": first, "again_ms": again})
    for name, rows in results.items():
        firsts = [r["first_ms"] for r in rows[1:]]
        agains = [r["again_ms"] for r in rows[1:]]
        print(f"{name:6s}: first call at a new length {statistics.median(firsts):8.3f} ms "
              f"(max {max(firsts):.3f}), again {statistics.median(agains):.3f} ms")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"device": str(mx.default_device()), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
