#!/usr/bin/env python3
"""What a new shape costs MLX CUDA the first time (issue 32 a): per op and shape, the first call
against the next one at the same shape, in a process whose kernel cache may already be warm.

- The Gated DeltaNet's depthwise causal conv (Qwen3.6-35B-A3B: 8192 channels, kernel 4) as MLX's
  grouped conv1d (what mlx-lm / mlx-vlm and rmlx before c1dc13a run: a cuDNN graph per input
  shape) and as rmlx's compiled sum over shifted views, at decode, verify and prefill shapes and
  batch widths.
- scaled_dot_product_attention at head_dim 128 (cuDNN's fused path, keyed by the full shapes) at
  new prefill lengths.
Usage: first_use_probe.py [--json-out PATH]
"""

import argparse
import json
import time

import mlx.core as mx


def timed(fn):
    start = time.perf_counter()
    mx.eval(fn())
    mx.synchronize()
    return (time.perf_counter() - start) * 1000


def conv1d_form(x, w):
    return mx.conv1d(x, w, groups=x.shape[-1])


def shifted_form_plain(views, taps):
    total = views[0].astype(mx.float32) * taps[0]
    for view, tap in zip(views[1:], taps[1:]):
        total = total + view.astype(mx.float32) * tap
    out = total.astype(views[0].dtype)
    return out * mx.sigmoid(out)


shifted_compiled = mx.compile(lambda *a: shifted_form_plain(a[: len(a) // 2], a[len(a) // 2:]), shapeless=True)


def shifted_form(x, taps):
    length = x.shape[1] - (len(taps) - 1)
    views = [x[:, j:j + length, :] for j in range(len(taps))]
    return shifted_compiled(*views, *taps)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--json-out")
    args = parser.parse_args()
    channels, kernel = 8192, 4
    w = (mx.random.normal((channels, kernel, 1)) * 0.1).astype(mx.bfloat16)
    taps = [w[:, j, 0].astype(mx.float32) for j in range(kernel)]
    mx.eval(w, *taps)
    rows = []
    # Decode (1), verify widths (2, 5), an odd prefill tail (37) and a chunk (512), 1 and 8 rows.
    for batch in (1, 8):
        for length in (1, 2, 5, 37, 512):
            x = mx.random.normal((batch, kernel - 1 + length, channels)).astype(mx.bfloat16)
            mx.eval(x)
            for name, fn in (("conv1d", lambda: conv1d_form(x, w)), ("shifted", lambda: shifted_form(x, taps))):
                first = timed(fn)
                again = timed(fn)
                rows.append({"op": f"gdn conv ({name})", "shape": [batch, length], "first_ms": first, "again_ms": again})
                print(f"{name:8s} B={batch} T={length:4d}: first {first:9.1f} ms, again {again:7.2f} ms", flush=True)
    # cuDNN SDPA (head_dim 128, bf16, causal): Qwen3-4B's attention, new prompt lengths.
    for length in (512, 37, 700):
        q = mx.random.normal((1, 32, length, 128)).astype(mx.bfloat16)
        k = mx.random.normal((1, 8, length, 128)).astype(mx.bfloat16)
        v = mx.random.normal((1, 8, length, 128)).astype(mx.bfloat16)
        mx.eval(q, k, v)
        fn = lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=128 ** -0.5, mask="causal")  # noqa: E731
        first = timed(fn)
        again = timed(fn)
        rows.append({"op": "sdpa hd128 causal", "shape": [1, length], "first_ms": first, "again_ms": again})
        print(f"sdpa     T={length:4d}: first {first:9.1f} ms, again {again:7.2f} ms", flush=True)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
