#!/usr/bin/env python3
"""Random Qwen3 checkpoints of a benchmark size (mlx-lm's `benchmark` shape: hidden 1024,
8 layers) with the fixture tokenizer, in fp32 and affine 4-bit (bf16 scales), under .bench/,
and a Qwen3-30B-A3B-shaped MoE (`qwen3_moe`, top-8 routing, the real config's keys) scaled to
this machine: 32 experts of width 256 instead of 128 of 768, in fp32 and in mlx-lm's 4-bit
recipe (8-bit router). Reuses the fixture generators' builders so both share one definition
of each checkpoint."""

import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts" / "fixtures"))

import make_qwen3 as fx  # noqa: E402
import make_releases as releases  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402
from mlx_lm.convert import convert  # noqa: E402

OUT = ROOT / ".bench"
SHAPE = {
    "hidden_size": 1024,
    "num_hidden_layers": 8,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "intermediate_size": 3072,
    "max_window_layers": 8,
    "max_position_embeddings": 40960,
}


def main():
    tok = fx.build_tokenizer()
    tok_files, ids = fx.tokenizer_files(tok)
    vocab = ((tok.get_vocab_size() + 63) // 64) * 64
    config = fx.model_config(vocab, ids, tie=True)
    config.update(SHAPE)
    fp32 = OUT / "qwen3-bench-fp32"
    q4 = OUT / "qwen3-bench-4bit"
    if not fp32.exists():
        model = fx.random_model(config, seed=7, scales=fx.TIED_SCALES)
        fx.write_checkpoint(fp32, model, config, tok_files, fx.generation_config(ids))
    if not q4.exists():
        convert(str(fp32), str(q4), quantize=True, q_bits=4, q_group_size=64, q_mode="affine", dtype="bfloat16")
    print(fp32, q4)
    make_moe(tok_files, ids, vocab)


MOE_SHAPE = {
    "hidden_size": 1024,
    "num_hidden_layers": 8,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "intermediate_size": 3072,
    "max_window_layers": 8,
    "num_experts": 32,
    "moe_intermediate_size": 256,
}


def make_moe(tok_files, ids, vocab):
    real = releases.real_config("Qwen__Qwen3-30B-A3B")
    config = dict(real)
    config.update(MOE_SHAPE)
    config.update(vocab_size=vocab, bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"])
    fp32 = OUT / "qwen3-moe-bench-fp32"
    q4 = OUT / "qwen3-moe-bench-4bit"
    if not fp32.exists():
        model = releases.build_model(config, seed=8, scales=fx.UNTIED_SCALES)
        weights = dict(tree_flatten(model.parameters()))
        releases.write_release(fp32, weights, config, tok_files, fx.generation_config(ids))
    if not q4.exists():
        convert(str(fp32), str(q4), quantize=True, q_bits=4, q_group_size=64, q_mode="affine", dtype="bfloat16")
        (q4 / "README.md").unlink(missing_ok=True)
    print(fp32, q4)


if __name__ == "__main__":
    main()
