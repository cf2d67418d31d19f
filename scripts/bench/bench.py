#!/usr/bin/env python3
"""rmlx vs mlx-lm on one checkpoint, same MLX CPU backend, interleaved runs.

Both sides get the same random prompt ids, greedy decoding, no EOS stop. Timings are taken the
same way on both: TTFT = start of the call to the first token on the host; prefill tok/s =
prompt tokens / TTFT; decode tok/s = (tokens - 1) / (last token time - first token time).
Usage: bench.py --model DIR --rmlx BIN [--prompt-tokens 512] [--gen-tokens 64] [--runs 3]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import mlx.core as mx  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "fixtures"))
from make_releases import patch_gather_qmm  # noqa: E402
from mlx_lm import load  # noqa: E402
from mlx_lm.generate import generate_step  # noqa: E402
from mlx_lm.sample_utils import make_sampler  # noqa: E402


def prompt_ids(count, vocab, seed=0):
    # Same LCG as `rmlx bench`, so both engines see identical prompts.
    state = seed
    out = []
    for _ in range(count):
        state = (state * 6364136223846793005 + 1442695040888963407) % 2**64
        out.append((state >> 33) % vocab)
    return out


def run_mlx_lm(model, ids, gen_tokens, prefill_chunk):
    prompt = mx.array(ids)
    sampler = make_sampler(temp=0.0)
    start = time.perf_counter()
    stamps = []
    for n, (token, _) in enumerate(
        generate_step(prompt, model, max_tokens=gen_tokens, sampler=sampler, prefill_step_size=prefill_chunk)
    ):
        stamps.append(time.perf_counter())
    ttft = stamps[0] - start
    decode = (len(stamps) - 1) / (stamps[-1] - stamps[0]) if len(stamps) > 1 else 0.0
    return {"ttft_ms": ttft * 1000, "prefill_tps": len(ids) / ttft, "decode_tps": decode}


def run_rmlx(binary, model_dir, prompt_tokens, gen_tokens, prefill_chunk):
    out = subprocess.run(
        [binary, "bench", "--model", model_dir, "--prompt-tokens", str(prompt_tokens),
         "--gen-tokens", str(gen_tokens), "--prefill-chunk", str(prefill_chunk), "--json"],
        check=True, capture_output=True, text=True,
    )
    return json.loads(out.stdout)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--rmlx", required=True)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--gen-tokens", type=int, default=64)
    parser.add_argument("--prefill-chunk", type=int, default=512)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()

    mx.set_default_device(mx.cpu)
    # mlx-lm 0.32.2 cannot run a quantized MoE on MLX 0.32.2 as shipped (global_scale=None
    # reaches gather_qmm); the fixture script's one-line fix lets the 4-bit MoE run.
    patch_gather_qmm()
    model, _ = load(args.model)
    vocab = model.args.vocab_size
    ids = prompt_ids(args.prompt_tokens, vocab)
    run_mlx_lm(model, ids[:16], 4, args.prefill_chunk)  # warm-up

    results = {"rmlx": [], "mlx_lm": []}
    for run in range(args.runs):
        results["rmlx"].append(run_rmlx(args.rmlx, args.model, args.prompt_tokens, args.gen_tokens, args.prefill_chunk))
        results["mlx_lm"].append(run_mlx_lm(model, ids, args.gen_tokens, args.prefill_chunk))
        print(f"run {run + 1}: rmlx {results['rmlx'][-1]}  mlx_lm {results['mlx_lm'][-1]}", file=sys.stderr)

    def median(engine, key):
        return statistics.median(r[key] for r in results[engine])

    print(f"model {args.model}  prompt {args.prompt_tokens}  gen {args.gen_tokens}  runs {args.runs} (medians)")
    print(f"{'':14s}{'rmlx':>12s}{'mlx_lm':>12s}{'ratio':>9s}")
    for key, label, higher_better in [("prefill_tps", "prefill tok/s", True),
                                      ("decode_tps", "decode tok/s", True),
                                      ("ttft_ms", "TTFT ms", False)]:
        ours, theirs = median("rmlx", key), median("mlx_lm", key)
        ratio = ours / theirs if higher_better else theirs / ours
        print(f"{label:14s}{ours:12.1f}{theirs:12.1f}{ratio:8.2f}x")
    print("(ratio > 1 means rmlx is faster)")


if __name__ == "__main__":
    main()
