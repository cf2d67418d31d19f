#!/usr/bin/env python3
"""Reproduction for MLX upstream (docs/upstream/mlx-cuda-qmm-small-m.md): a 4-bit affine
`quantized_matmul` at decode's small M reads its weights far slower than a bf16 matmul of the
same shape reads twice the bytes, on MLX's CUDA backend. Only `mlx` is needed.

For M = 1, 2, 4, 8, 16 rows of x [M, K] against W [N, K] (Qwen3-4B's MLP up projection, K 2560,
N 9728): bf16 `x @ W.T` and `mx.quantized_matmul(x, Wq, scales, biases, transpose=True,
group_size=64, bits=4)`, each a chain of --chain calls evaluated once (launch cost amortised),
median of --repeats after a warm-up. Prints microseconds per call and the weight bytes read per
second, and the kernel MLX 0.32's dispatch (`cuda/quantized/quantized.cpp`) picks for each M.

Usage: python3 scripts/upstream/mlx_cuda_qmm_small_m.py [--k 2560] [--n 9728] [--chain 50]
       [--repeats 7] [--json-out F]
"""
import argparse
import json
import statistics
import subprocess
import time

import mlx.core as mx


def timed(build, repeats):
    mx.eval(build())
    mx.synchronize()
    walls = []
    for _ in range(repeats):
        start = time.perf_counter()
        mx.eval(build())
        mx.synchronize()
        walls.append(time.perf_counter() - start)
    return statistics.median(walls)


def expected_kernel(m):
    """What MLX 0.32's CUDA dispatch picks for a [m, K] x quantized [N, K] (no batch)."""
    if not mx.cuda.is_available():
        return "cpu"
    major = None
    try:  # "9.0" on an H100 / H200
        out = subprocess.run(["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30).stdout
        major = int(out.split()[0].split(".")[0])
    except (OSError, ValueError, IndexError, subprocess.SubprocessError):
        return "?"
    if major == 9:
        return "qmv" if m == 1 else "qmm_sm90"
    return "qmv" if m < 8 else "qmm_sm80"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--k", type=int, default=2560)
    ap.add_argument("--n", type=int, default=9728)
    ap.add_argument("--chain", type=int, default=50)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--json-out")
    args = ap.parse_args()
    k, n = args.k, args.n
    w = (mx.random.normal((n, k), key=mx.random.key(0)) * 0.02).astype(mx.bfloat16)
    wq, scales, biases = mx.quantize(w, group_size=64, bits=4)
    wt = w.T  # a transposed view: what an engine keeps for x @ W.T
    mx.eval(w, wq, scales, biases)
    dense_bytes = w.nbytes
    quant_bytes = wq.nbytes + scales.nbytes + biases.nbytes
    print(f"device {mx.default_device()}, W [{n}, {k}] bf16 {dense_bytes / 1e6:.1f} MB, "
          f"4-bit g64 {quant_bytes / 1e6:.1f} MB, {args.chain} calls per timed graph")
    print("| M | kernel (expected) | bf16 us | bf16 GB/s | 4-bit us | 4-bit GB/s | 4-bit / bf16 time |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    rows = []
    for m in (1, 2, 4, 8, 16):
        xs = [mx.random.normal((m, k), key=mx.random.key(10 + i)).astype(mx.bfloat16)
              for i in range(args.chain)]
        mx.eval(xs)
        dense = timed(lambda: [x @ wt for x in xs], args.repeats) / args.chain
        quant = timed(lambda: [mx.quantized_matmul(x, wq, scales, biases, transpose=True,
                                                   group_size=64, bits=4) for x in xs],
                      args.repeats) / args.chain
        row = {"m": m, "kernel": expected_kernel(m), "bf16_us": dense * 1e6,
               "bf16_gbs": dense_bytes / dense / 1e9, "q4_us": quant * 1e6,
               "q4_gbs": quant_bytes / quant / 1e9}
        rows.append(row)
        print(f"| {m} | {row['kernel']} | {row['bf16_us']:.1f} | {row['bf16_gbs']:.0f} | "
              f"{row['q4_us']:.1f} | {row['q4_gbs']:.0f} | {quant / dense:.2f} |")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"device": str(mx.default_device()), "k": k, "n": n, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
