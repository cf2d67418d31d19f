#!/usr/bin/env python3
"""A random-weight bf16 `gemma4` checkpoint with gemma-4-31B-it's real layer shapes, made on the GPU
machine (scripts/bench/h200/run.sh, MODE=gemma_kv), for long-context decode with dense vs quantized KV.

config.json is the release fixture's (tests/fixtures/releases/gemma-4-31b-it: every key of
google/gemma-4-31B-it's config, its tokenizer's ids renumbered) with the text dims put back to the
release's: hidden 5376, MLP 21504, 32 query heads, sliding layers 16 KV heads of 256 with a
1024-token window, full layers 4 KV heads of 512 (keys are values), vocab 262144, tied embeddings.
Kept from the fixture: its 12 layers (the release's first 12: [5 sliding, 1 full] x 2 of 60), the
small vision tower (the model type needs one; the benchmark is text only) and the tokenizer (~1000
tokens; the ids past it exist in the model as the real model's do and decode to nothing).
Weights: random (mx.random, seeded), bf16, mlx-vlm's layout (language_model.model.*).

Usage: python3 scripts/bench/h200/make_gemma4_bench_model.py --out DIR [--device gpu]
       [--layers 12] [--scale 1]   (--scale 8 divides every width by 8: a quick local check)
"""

import argparse
import copy
import json
import math
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
FIXTURE = ROOT / "tests" / "fixtures" / "releases" / "gemma-4-31b-it"
REAL = ROOT / "tests" / "fixtures" / "real-configs" / "google__gemma-4-31B-it"
TOKENIZER_FILES = ["tokenizer.json", "tokenizer_config.json", "generation_config.json", "processor_config.json"]
REAL_DIMS = ["hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
             "global_head_dim", "num_global_key_value_heads", "sliding_window", "vocab_size",
             "vocab_size_per_layer_input"]
SEED = 20261250
NAME = "gemma-4-31b-shape-12l-bf16"


def config(layers, scale):
    cfg = json.loads((FIXTURE / "config.json").read_text())
    real = json.loads((REAL / "config.json").read_text())["text_config"]
    text = cfg["text_config"]
    for key in REAL_DIMS:
        text[key] = real[key]
    for key in ["hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                "num_global_key_value_heads"]:
        text[key] = max(1, text[key] // scale)
    text["num_hidden_layers"] = layers
    text["layer_types"] = real["layer_types"][:layers]
    return cfg


def randomize(model, seed):
    """Every parameter random, bf16, one at a time (the whole model never exists twice)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_unflatten

    params = sorted(tree_flatten(model.parameters()), key=lambda kv: kv[0])
    keys = mx.random.split(mx.random.key(seed), len(params))
    for i, (name, p) in enumerate(params):
        shape = p.shape
        z = mx.random.normal(shape, key=keys[i])
        fan_in = math.prod(shape[1:]) if len(shape) > 1 else 1
        if len(shape) == 1 or "norm" in name or name.endswith("layer_scalar"):
            w = 1.0 + 0.1 * z
        elif name.endswith("embed_tokens.weight"):
            # Gemma scales the embedding by sqrt(hidden): keep the residual stream ~unit.
            w = z / math.sqrt(shape[-1])
        else:
            w = (1.0 / math.sqrt(fan_in)) * z
        w = w.astype(mx.bfloat16)
        mx.eval(w)
        model.update(tree_unflatten([(name, w)]))
    mx.eval(model.parameters())
    return sum(math.prod(p.shape) for _, p in params)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="parent folder of the checkpoint")
    ap.add_argument("--device", choices=["cpu", "gpu", "default"], default="default")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--scale", type=int, default=1, help="divide the widths by this (a local check)")
    ap.add_argument("--name", default=NAME)
    args = ap.parse_args()

    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_vlm.models import gemma4
    from mlx_vlm.utils import save_weights

    if args.device != "default":
        mx.set_default_device(getattr(mx, args.device))
    out = Path(args.out) / args.name
    if (out / "config.json").exists():
        print(f"{out} exists; kept", file=sys.stderr)
        print(out)
        return
    t0 = time.time()
    cfg = config(args.layers, args.scale)
    mcfg = copy.deepcopy(cfg)
    mcfg["text_config"] = gemma4.TextConfig.from_dict(cfg["text_config"])
    mcfg["vision_config"] = gemma4.VisionConfig.from_dict(cfg["vision_config"])
    model = gemma4.Model(gemma4.ModelConfig.from_dict(mcfg))
    n = randomize(model, SEED)
    tmp = out.with_name(out.name + ".partial")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    save_weights(tmp, model)
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")
    for name in TOKENIZER_FILES:
        shutil.copy(FIXTURE / name, tmp / name)
    tmp.rename(out)
    nbytes = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    print(f"{out}: {n / 1e9:.3f} B parameters, {nbytes / 2**30:.2f} GiB as saved, {time.time() - t0:.1f} s",
          file=sys.stderr)
    print(out)


if __name__ == "__main__":
    main()
