#!/usr/bin/env python3
"""Where a decode step's time goes on the MLX CUDA backend: per-op cost and the kernels of a
Qwen3-4B-shaped decode step at 1 and 8 rows, each timed alone (a chain of N calls, evaluated
once, median of repeats after a warm-up).

Measures, in one process on the default device:
- the cost of one tiny op (a chain of 2000 adds), plain and inside mx.compile;
- bf16 matmul and 4-bit (affine, g64) quantized_matmul of [M, 2560] x [2560, 9728] for
  M = 1, 2, 4, 8, 16 (GB/s of weight read: the decode bound);
- decode SDPA (32 query heads, 8 KV heads of 128, keys sliced from a 256-step cache) for B = 1, 8,
  without a mask, with an additive mask and with a boolean mask (the padded batch's);
- RoPE with a scalar offset and with per-row offsets.

Usage: python3 scripts/bench/h200/probe_ops.py [--json-out F] [--small]
"""
import argparse
import json
import statistics
import time

import mlx.core as mx

HIDDEN, MLP, HEADS, KV_HEADS, HEAD_DIM = 2560, 9728, 32, 8, 128


def timed(build, repeats=7):
    """Median wall seconds of `mx.eval(build())` after one warm-up."""
    mx.eval(build())
    mx.synchronize()
    walls = []
    for _ in range(repeats):
        start = time.perf_counter()
        out = build()
        mx.eval(out)
        mx.synchronize()
        walls.append(time.perf_counter() - start)
    return statistics.median(walls), min(walls), max(walls)


def per_op(results):
    n = 2000

    def chain():
        x = mx.zeros((1,))
        for _ in range(n):
            x = x + 1
        return x

    med, lo, hi = timed(chain)
    results["tiny_op_us"] = med / n * 1e6

    def build_only():
        start = time.perf_counter()
        chain()
        return time.perf_counter() - start

    results["tiny_op_build_us"] = statistics.median(build_only() for _ in range(5)) / n * 1e6

    fused = mx.compile(lambda g, u: (g * mx.sigmoid(g)) * u)
    g = mx.random.normal((8, MLP)).astype(mx.bfloat16)
    u = mx.random.normal((8, MLP)).astype(mx.bfloat16)
    mx.eval(g, u)

    def swiglu_chain(fn):
        def build():
            x = g
            for _ in range(200):
                x = fn(x, u)
            return x

        return build

    plain = lambda a, b: (a * mx.sigmoid(a)) * b
    results["swiglu_plain_us"] = timed(swiglu_chain(plain))[0] / 200 * 1e6
    results["swiglu_compiled_us"] = timed(swiglu_chain(fused))[0] / 200 * 1e6
    print(f"tiny op {results['tiny_op_us']:.2f} us (python build {results['tiny_op_build_us']:.2f}); "
          f"swiglu plain {results['swiglu_plain_us']:.1f} us, compiled {results['swiglu_compiled_us']:.1f} us")


def matmuls(results):
    count = 24  # 24 distinct weights (1.2 GB in bf16): nothing stays in L2
    key = mx.random.key(0)
    weights = [mx.random.normal((MLP, HIDDEN), key=mx.random.split(key, count)[i]).astype(mx.bfloat16)
               for i in range(count)]
    mx.eval(weights)
    quant = [mx.quantize(w, group_size=64, bits=4) for w in weights]
    mx.eval(quant)
    bf16_bytes = MLP * HIDDEN * 2
    q_bytes = sum(a.nbytes for a in quant[0])
    rows = {}
    for m in (1, 2, 4, 8, 16):
        x = mx.random.normal((m, HIDDEN)).astype(mx.bfloat16)
        mx.eval(x)
        dense = timed(lambda: [x @ w.T for w in weights])[0] / count
        quantized = timed(lambda: [mx.quantized_matmul(x, wq, s, b, transpose=True, group_size=64, bits=4)
                                   for wq, s, b in quant])[0] / count
        rows[m] = {"bf16_us": dense * 1e6, "bf16_gbs": bf16_bytes / dense / 1e9,
                   "q4_us": quantized * 1e6, "q4_gbs": q_bytes / quantized / 1e9}
        print(f"matmul M={m:2d}: bf16 {dense * 1e6:7.1f} us ({bf16_bytes / dense / 1e9:6.0f} GB/s)  "
              f"4-bit {quantized * 1e6:7.1f} us ({q_bytes / quantized / 1e9:6.0f} GB/s)")
    results["matmul"] = rows


def attention(results):
    rows = {}
    calls = 36
    for batch in (1, 8):
        for length in (640, 2048):
            capacity = (length + 255) // 256 * 256
            cache_k = mx.random.normal((batch, KV_HEADS, capacity, HEAD_DIM)).astype(mx.bfloat16)
            cache_v = mx.random.normal((batch, KV_HEADS, capacity, HEAD_DIM)).astype(mx.bfloat16)
            q = mx.random.normal((batch, HEADS, 1, HEAD_DIM)).astype(mx.bfloat16)
            mx.eval(cache_k, cache_v, q)
            k, v = cache_k[..., :length, :], cache_v[..., :length, :]
            pad = mx.array([i * 7 for i in range(batch)])
            bool_mask = (mx.arange(length)[None, :] >= pad[:, None])[:, None, None, :]
            add_mask = mx.where(bool_mask, 0.0, -mx.inf).astype(mx.bfloat16)
            mx.eval(bool_mask, add_mask)
            scale = HEAD_DIM ** -0.5
            entry = {}
            for name, mask in (("none", None), ("bool", bool_mask), ("additive", add_mask)):
                def build():
                    return [mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
                            for _ in range(calls)]
                entry[name] = timed(build)[0] / calls * 1e6
            rows[f"B{batch}_T{length}"] = entry
            print(f"sdpa B={batch} T={length}: " + ", ".join(f"{k} {v:.1f} us" for k, v in entry.items()))
    results["sdpa"] = rows


def rope(results):
    calls = 72
    entry = {}
    for batch in (1, 8):
        x = mx.random.normal((batch, HEADS, 1, HEAD_DIM)).astype(mx.bfloat16)
        mx.eval(x)
        offsets = mx.array([600 + i for i in range(batch)], dtype=mx.int32)
        entry[f"B{batch}_scalar"] = timed(lambda: [mx.fast.rope(x, HEAD_DIM, traditional=False, base=1e6,
                                                                scale=1.0, offset=600) for _ in range(calls)])[0] / calls * 1e6
        entry[f"B{batch}_rows"] = timed(lambda: [mx.fast.rope(x, HEAD_DIM, traditional=False, base=1e6,
                                                              scale=1.0, offset=offsets) for _ in range(calls)])[0] / calls * 1e6
    results["rope_us"] = entry
    print("rope: " + ", ".join(f"{k} {v:.1f} us" for k, v in entry.items()))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--json-out")
    parser.add_argument("--small", action="store_true", help="dims / 8: a smoke run on the CPU")
    args = parser.parse_args()
    if args.small:
        global HIDDEN, MLP
        HIDDEN, MLP = HIDDEN // 8, MLP // 8
    results = {"device": str(mx.default_device()), "mlx": mx.__version__}
    print(results)
    for probe in (per_op, matmuls, attention, rope):
        probe(results)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
