#!/usr/bin/env bash
# Image prefill on an NVIDIA H200 (MLX CUDA backend): rmlx vs mlx-vlm 0.7.6 on a random-weight
# Qwen3-VL-4B-shaped bf16 checkpoint with the real Qwen vocabulary, made here on the GPU.
# The machine has Python 3.12 with PyTorch's CUDA 13 libraries (`nvidia` namespace) and no
# registry: everything else comes from scripts/bench/h200/pack.sh's two carry folders.
# Usage, through the device tool, calls back to back (the machine stays warm ~30 s):
#   1. carry .bench/h200/a:  bash scripts/bench/h200/run.sh stage-a   (copies it to /tmp, unpacks)
#   2. carry .bench/h200/b:  bash scripts/bench/h200/run.sh           (libmlx.so, model, bench)
#   3. (optional, still warm) e.g. MODE=cold SIZES=512 bash scripts/bench/h200/run.sh: steps
#      already done are skipped.
# MODE=qwen3_5 (step 2 instead of the image bench): a random 4-bit Qwen3.6-35B-A3B-shaped
#   checkpoint, 8 layers (make_qwen3_5_bench_model.py, on the GPU), then scripts/bench/bench.py
#   --reference mlx-vlm on it: decode/prefill interleaved with mlx-vlm's generate_step, and
#   two-turn conversations through `rmlx serve` (turn-2 TTFT with the prefix cache vs turn 1).
#   Env: Q35_PROMPT (512), Q35_GEN (128), Q35_RUNS (5), Q35_CHATS (3), Q35_WORDS (1500),
#   Q35_GDN (mlx-vlm's GDN prefill: chunked,sequential).
# MODE=gemma_kv (step 2 instead; issue 28): a random bf16 checkpoint with gemma-4-31B-it's layer
#   shapes, its first 12 layers (make_gemma4_bench_model.py, on the GPU), then `rmlx bench` at
#   G_PROMPT (32768) tokens of context with dense, 8-bit and 4-bit KV on the full-attention layers,
#   one process each, G_ROUNDS (2) interleaved rounds of G_RUNS (2) timed runs: decode tok/s, TTFT
#   and MLX's peak memory. Env: G_PROMPT, G_GEN (128), G_RUNS, G_ROUNDS, G_BITS ("dense 8 4").
# MODE=disk_restart (step 2 instead; issue 29): the MODE=qwen3_5 checkpoint (Qwen3.6-35B-A3B
#   layer shapes, 8 layers, 4-bit), then scripts/bench/disk_restart.py: turn 2 of a D_WORDS
#   (11500, ~30k tokens) conversation after `rmlx serve` restarted, read back from the disk
#   prefix cache vs prefilled cold, D_RUNS (3) runs, the page cache dropped before each server
#   where allowed. A kernel warm-up (`rmlx bench` at D_WARM_TOKENS, 30000) runs first, once per
#   machine. The servers' logs land in $OUT/disk-logs.
# MODE=spec (step 2 instead; issue 30): Qwen3.6-27B-shaped bf16 (S_LAYERS, 8) and 35B-A3B-shaped
#   4-bit checkpoints; `rmlx bench --draft-accuracy`: verify cost at depth 1..4, then p = 1, 0.8,
#   0.5, 0 under `auto` at 1 and S_STREAMS (8) streams. Env: S_PROMPT (512), S_GEN (128), S_RUNS (3),
#   S_MODELS ("27 35": one call may hold only one; a later warm call keeps the made checkpoints),
#   S_CELLS ("verify c1 c8 ragged").
# MODE=spec_profile (step 2 instead; issues 30, 31): the same shapes with random `mtp.*` heads;
#   `rmlx bench --step-profile` per cell of S_CELLS ("verify head auto"; also "auto0" (p = 0
#   alone), "c8", and "prime":
#   TTFT and peak memory over an S_PRIME_PROMPT (4096) token prompt with and without the head),
#   S_RUNS (2). Verify and head at the same depths (1, 3): their step times' difference is the
#   head's k draft steps.
# MODE=first_use (step 2 instead; issue 32 a): the MODE=qwen3_5 checkpoint; first_use_probe.py
#   (what a new shape costs MLX CUDA per op), then scripts/bench/first_use.py (load start -> first
#   token, first burst of 8 against a warm one) per binary of F_BINS ("before after": rmlx-before,
#   packed from RMLX_BEFORE, and rmlx), F_RUNS (1) runs each with an empty kernel cache; F_WARM (1)
#   more runs each sharing one kernel cache warmed by the first (a later process on the machine).
# MODE=fuse (step 2 instead; issue 32 d): projections fused at load against apart
#   (RMLX_FUSE_PROJECTIONS=1 / 0), `rmlx bench` single stream per model of S_MODELS ("27 35"),
#   U_ROUNDS (2) rounds alternating the two, U_RUNS (3) timed runs each.
# MODE=memory (step 2 instead; issue 32 b): the bf16 Qwen3-4B shape below; `rmlx serve`'s device
#   memory after one M_WORDS (5500, ~32k tokens) prompt against MLX's peak + the prefix cache.
# MODE=concurrency (step 2 instead): random Qwen3-4B-shaped bf16 and 4-bit checkpoints with the
#   real vocabulary (make_qwen3_bench_model.py, on the GPU); on each, single-stream decode and
#   warm TTFT through `rmlx serve` interleaved with mlx-lm's generate_step (bench.py), then
#   1 / 4 / 8 / 16 concurrent streams through `rmlx serve` and mlx-lm's server (concurrency.py).
#   Env: C_MODELS ("bf16 4bit"), C_STREAMS (1,4,8,16), C_RUNS (5), C_TOKENS (128), C_PROMPT (512),
#   C_RUNS_4BIT (C_RUNS), C_OPS_BUFFER (MLX_MAX_OPS_PER_BUFFER values to try first on one bf16
#   stream).
# MODE=prefill (step 2 instead; issue 32 f): the bf16 Qwen3-4B shape, prompts of L_TOKENS ("8192 32768
#   65536") against mlx-lm (bench.py: prefill tok/s, MLX peak), L_RUNS (2), L_CHUNK (2048).
# MODE=serve_ab (step 2 instead; issue 32): single-stream decode through `rmlx serve` against
#   mlx-lm's server per arm of AB_ARMS ("auto exact off", see the mode) on C_MODELS; AB_RUNS (3).
# MODE=pipeline (step 2 instead; issue 33 e): pipeline_overhead.py, two ranks on this GPU
#   against one process (PIPE_KIND bf16, PIPE_RUNS 3, PIPE_TOKENS 128).
# MODE=steps (step 2 instead; issue 32): probe_masked_decode.py, scripts/upstream/
#   mlx_cuda_qmm_small_m.py (the upstream report's table), then `rmlx bench --step-profile`
#   alone at S_STREAMS ("1 8") streams on C_MODELS' Qwen3-4B shapes (P_RUNS 2): the 8-row 4-bit
#   step against bf16's, and where a 4-row masked step's time goes; then bf16 at 4 streams
#   (--ragged-check, then plain) with RMLX_GROUPED_ONE_QUERY 0 / 1 alternating. S_PARTS: which
#   of "probe repro steps grouped" run, in that order (a short call: S_PARTS="grouped steps");
#   "sampled" (not in the default): 8 sampled streams with RMLX_BATCHED_SAMPLING 0 / 1.
# MODE=profile (step 2 instead): probe_ops.py (per-op costs of MLX CUDA at the decode shapes),
#   the same two checkpoints, `rmlx bench --step-profile` at 1 and P_STREAMS (8) streams (bf16 also
#   with MLX_DISABLE_COMPILE=1 RMLX_WEIGHTS_ON_DEVICE=0), then concurrency.py and bench.py on bf16.
#   Env: P_STREAMS (8), P_RUNS (3), C_MODELS, C_TOKENS, C_PROMPT.
# Env: SIZES (default 2560,512), RUNS (3), MODE (warm, cold, both: images.py --mode; or
# qwen3_5, concurrency or profile; default both), LIMIT (seconds from the start by which the bench must end, 575: the
# tool's limit is 600 and what is under $OUT comes back), OUT.
set -uo pipefail
root=$(cd "$(dirname "$0")/../../.." && pwd)
cd "$root"
OUT=${OUT:-/tmp/h200-out}
A=${A:-/tmp/h2/a}
B=${B:-.bench/h200/b}
SITE=/tmp/site
BENCH=/tmp/bench
SIZES=${SIZES:-2560,512}
RUNS=${RUNS:-3}
LIMIT=${LIMIT:-575}
MODE=${MODE:-both}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/run.log") 2>&1
step() { echo "== $(date +%T) +${SECONDS}s $*"; }
# The checkpoints of the speculative and fused-projection benches, made on the GPU once per
# machine: 27 (Qwen3.6-27B's layer shapes, S_LAYERS layers, bf16) or 35 (Qwen3.6-35B-A3B's,
# 8 layers, 4-bit); extra arguments (--mtp: a random draft head) go to the maker. Prints its path.
spec_model() {
  local which=$1; shift
  local shape=()
  [[ $which == 27 ]] && shape=(--release Qwen__Qwen3.6-27B --bits 16 --layers "${S_LAYERS:-8}")
  python3 scripts/bench/h200/make_qwen3_5_bench_model.py --device gpu --out "$BENCH" "${shape[@]}" "$@" \
    > "/tmp/q$which-path" || return 1
  tail -1 "/tmp/q$which-path"
}
# The random Qwen3-4B-shaped bf16 and 4-bit checkpoints (make_qwen3_bench_model.py), made on the
# GPU once per machine (a later call finds them).
qwen3_models() {
  step "models qwen3 4b"
  python3 scripts/bench/h200/make_qwen3_bench_model.py --device gpu --out "$BENCH" --tiktoken "$TIKTOKEN" \
    > /tmp/q3-paths
}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false

# Stage a: copy the first carry folder out of the tree and unpack it.
if [[ ! -f $SITE/.stage-a ]]; then
  step "unpack a"
  if [[ ! -f $A/rmlx.xz ]]; then mkdir -p "$(dirname "$A")" && cp -r .bench/h200/a "$A" || exit 1; fi
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
    "$A"/mlx-0.32.2-*.whl "$A"/mlx_vlm-0.7.6-*.whl "$A"/mlx_lm-0.32.2-*.whl || exit 1
  mkdir -p "$SITE/mlx/lib" /tmp/rmlx
  tar -C "$SITE/mlx" -xJf "$A/mlx-include.tar.xz" || exit 1
  tar -C "$SITE" -xJf "$A/mlx_cuda_13.libs.tar.xz" || exit 1
  cp "$A/libmlxc.so" "$SITE/mlx/lib/"
  xz -dc "$A/rmlx.xz" > /tmp/rmlx/rmlx && chmod +x /tmp/rmlx/rmlx
  touch "$SITE/.stage-a"
fi
NV=$(python3 -c 'import nvidia; print(list(nvidia.__path__)[0])') || exit 1
# Every folder of the CUDA 13 libraries (nvidia/cu13/lib, nvidia/cudnn/lib, nvidia/nccl/lib, ...).
LD_LIBRARY_PATH=$(find "$NV" -name 'lib*.so*' -printf '%h\n' | sort -u | paste -sd:)${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export LD_LIBRARY_PATH
CUDA_HOME=$NV/cu13
[[ -d $CUDA_HOME ]] || CUDA_HOME=$(dirname "$(dirname "$(find "$NV" -name cuda_runtime.h | head -1)")")
export CUDA_HOME PYTHONPATH=$SITE
if [[ ${1:-} == stage-a ]]; then
  echo "NV=$NV CUDA_HOME=$CUDA_HOME"
  ls "$NV"
  python3 --version
  df -h /tmp | tail -1
  python3 -c "import pynvml; pynvml.nvmlInit(); h = pynvml.nvmlDeviceGetHandleByIndex(0); print(pynvml.nvmlDeviceGetName(h), pynvml.nvmlDeviceGetMemoryInfo(h).used)"
  step "stage a done"
  exit 0
fi

# Stage b: the other half of libmlx.so.
if [[ ! -f $SITE/mlx/lib/libmlx.so ]]; then
  step "unpack b"
  cat "$A/libmlx.so.xz.part0" "$B/libmlx.so.xz.part1" > /tmp/libmlx.so.xz || exit 1
  echo "$(cat "$A/libmlx.so.xz.sha256")  /tmp/libmlx.so.xz" | sha256sum -c - || exit 1
  xz -dc -T0 /tmp/libmlx.so.xz > "$SITE/mlx/lib/libmlx.so.partial" || exit 1
  mv "$SITE/mlx/lib/libmlx.so.partial" "$SITE/mlx/lib/libmlx.so"
fi

TIKTOKEN=$A/qwen.tiktoken
[[ -f $TIKTOKEN ]] || TIKTOKEN=$B/qwen.tiktoken
step check
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import sys, mlx.core as mx, transformers; print(sys.version.split()[0], 'mlx', mx.__version__, mx.default_device(), 'transformers', transformers.__version__, (mx.ones((64, 64)) @ mx.ones((64, 64))).sum().item())" || exit 1
RMLX_MLX_LIB_DIR=$SITE/mlx/lib /tmp/rmlx/rmlx doctor || exit 1
# `run.sh stage-b CMD...`: set up, then run CMD in this environment instead of the benchmark.
if [[ ${1:-} == stage-b ]]; then shift; "$@"; exit; fi

if [[ $MODE == qwen3_5 ]]; then
  step "model qwen3_5"
  python3 scripts/bench/h200/make_qwen3_5_bench_model.py --device gpu --out "$BENCH" > /tmp/q35-path || exit 1
  Q35=$(tail -1 /tmp/q35-path)
  du -sh "$Q35"; ls "$Q35"
  step "bench qwen3_5"
  left=$(( LIMIT - SECONDS ))
  RMLX_STEP_PROFILE=1 RMLX_MLX_LIB_DIR=$SITE/mlx/lib timeout "$left" python3 scripts/bench/bench.py --model "$Q35" --rmlx /tmp/rmlx/rmlx \
    --reference mlx-vlm --device gpu --prompt-tokens "${Q35_PROMPT:-512}" --gen-tokens "${Q35_GEN:-128}" \
    --runs "${Q35_RUNS:-5}" --mlx-vlm-gdn "${Q35_GDN:-chunked,sequential}" --prefill-chunk 512 \
    --chat-turns "${Q35_CHATS:-3}" --chat-words "${Q35_WORDS:-1500}" \
    --server-log "$OUT/rmlx-serve.log" --json-out "$OUT/h200-qwen3_5.json"
  rc=$?
  nvidia-smi --query-gpu=memory.used --format=csv,noheader
  step "done ($rc)"
  exit $rc
fi

if [[ $MODE == disk_restart ]]; then
  step "model qwen3_5"
  python3 scripts/bench/h200/make_qwen3_5_bench_model.py --device gpu --out "$BENCH" > /tmp/q35-path || exit 1
  Q35=$(tail -1 /tmp/q35-path)
  # One long prefill first: MLX CUDA compiles (and keeps under /tmp/mlx) its kernels for every new
  # shape, minutes at this one; the servers below then start from a warm kernel cache.
  if [[ ! -f /tmp/.disk-restart-warm ]]; then
    step "kernel warm-up: rmlx bench at ${D_WARM_TOKENS:-30000} tokens"
    left=$(( LIMIT - SECONDS ))
    RMLX_MLX_LIB_DIR=$SITE/mlx/lib timeout "$left" /tmp/rmlx/rmlx bench --model "$Q35" \
      --prompt-tokens "${D_WARM_TOKENS:-30000}" --gen-tokens 4 --runs 2 --json > "$OUT/disk-warm-bench.json" \
      && touch /tmp/.disk-restart-warm
    cat "$OUT/disk-warm-bench.json"; echo
  fi
  step "bench disk restart"
  left=$(( LIMIT - SECONDS ))
  RMLX_MLX_LIB_DIR=$SITE/mlx/lib timeout "$left" python3 scripts/bench/disk_restart.py --model "$Q35" \
    --rmlx /tmp/rmlx/rmlx --words "${D_WORDS:-11500}" --runs "${D_RUNS:-3}" --drop-caches \
    --log-dir "$OUT/disk-logs" --json-out "$OUT/h200-disk-restart.json"
  rc=$?
  step "done ($rc)"
  exit $rc
fi

if [[ $MODE == spec_profile ]]; then
  # Issues 30 and 31: where a speculative step's time goes (--step-profile: graph building,
  # the wait, the rollback), for prompt-lookup-style drafts at fixed depth and for the draft
  # head (random `mtp.*`: P = 1 forces answers, so every head draft is right; P = 0 leaves them
  # free, every draft wrong), then `auto` with the head. Models: S_MODELS ("27 35"), with heads.
  # Each bench's exit status is logged (a c8 run of MODE=spec ended silently once).
  rc=0
  for which in ${S_MODELS:-27 35}; do
    step "model $which"
    model=$(spec_model "$which" --mtp) || exit 1
    name=$(basename "$model")
    for cell in ${S_CELLS:-verify head auto}; do
      left=$(( LIMIT - SECONDS ))
      (( left > 30 )) || { echo "no time left for $name $cell"; rc=1; break 2; }
      shape=(--prompt-tokens "${S_PROMPT:-512}" --gen-tokens "${S_GEN:-128}")
      case $cell in
        verify) flags=(--draft-accuracy 0 --draft-depth 1,3) ;;
        head) flags=(--draft-head --draft-accuracy 1,0 --draft-depth 1,3) ;;
        auto) flags=(--draft-head --draft-accuracy 1,0) ;;
        # The random head alone (no forced cell before it to leave a kept-drafts prior).
        auto0) flags=(--draft-head --draft-accuracy 0) ;;
        c8) flags=(--draft-accuracy 0.5 --concurrency "${S_STREAMS:-8}") ;;
        # Priming the head over a long prompt: TTFT and each arm's peak, with and without it.
        prime) flags=(--draft-head --draft-accuracy 1 --draft-depth 1)
               shape=(--prompt-tokens "${S_PRIME_PROMPT:-4096}" --gen-tokens 16) ;;
      esac
      step "rmlx bench $name $cell"
      RUST_BACKTRACE=1 RMLX_MLX_LIB_DIR=$SITE/mlx/lib timeout "$left" /tmp/rmlx/rmlx bench --model "$model" \
        "${shape[@]}" --runs "${S_RUNS:-2}" \
        --step-profile "${flags[@]}" --json > "$OUT/profile-$name-$cell.json"
      status=$?
      echo "exit status $status"
      (( status == 0 )) || rc=1
      cat "$OUT/profile-$name-$cell.json"
    done
  done
  step "done ($rc)"
  exit $rc
fi

if [[ $MODE == first_use ]]; then
  [[ -f $B/rmlx-before.xz && ! -x /tmp/rmlx/rmlx-before ]] && xz -dc "$B/rmlx-before.xz" > /tmp/rmlx/rmlx-before \
    && chmod +x /tmp/rmlx/rmlx-before
  step "model qwen3_5"
  python3 scripts/bench/h200/make_qwen3_5_bench_model.py --device gpu --out "$BENCH" > /tmp/q35-path || exit 1
  Q35=$(tail -1 /tmp/q35-path)
  if [[ ! -f $OUT/first-use-probe.json && ${F_PROBE:-1} == 1 ]]; then
    step "probe: new shapes per op"
    timeout $(( LIMIT - SECONDS )) python3 scripts/bench/h200/first_use_probe.py --json-out "$OUT/first-use-probe.json"
  fi
  rc=0
  for pass in fresh warm; do
    # The warm pass shares every kernel the fresh runs compiled (MLX keeps them under $TMPDIR/mlx).
    [[ $pass == warm ]] && for d in /tmp/fu-warm/rmlx-first-use-*/mlx; do [[ -d $d ]] && cp -rn "$d" /tmp/fu-warm/; done
    for bin in ${F_BINS:-before after}; do
      exe=/tmp/rmlx/rmlx; [[ $bin == before ]] && exe=/tmp/rmlx/rmlx-before
      [[ -x $exe ]] || { echo "no $exe"; rc=1; continue; }
      left=$(( LIMIT - SECONDS ))
      (( left > 60 )) || { echo "no time left for $bin $pass"; rc=1; break 2; }
      if [[ $pass == fresh ]]; then runs=${F_RUNS:-1}; keep=(); else runs=${F_WARM:-1}; keep=(--keep-kernels); fi
      (( runs > 0 )) || continue
      step "first use: $bin, $pass kernel cache, $runs run(s)"
      mkdir -p /tmp/fu-warm
      TMPDIR=/tmp/fu-warm RMLX_MLX_LIB_DIR=$SITE/mlx/lib timeout "$left" python3 scripts/bench/first_use.py \
        --model "$Q35" --rmlx "$exe" --runs "$runs" "${keep[@]}" --json-out "$OUT/first-use-$bin-$pass.json" || rc=1
      cp /tmp/bench-first-use-rmlx-*.log "$OUT/" 2>/dev/null
    done
  done
  step "done ($rc)"
  exit $rc
fi

if [[ $MODE == fuse ]]; then
  rc=0
  for which in ${S_MODELS:-27 35}; do
    step "model $which"
    model=$(spec_model "$which") || exit 1
    name=$(basename "$model")
    for round in $(seq "${U_ROUNDS:-2}"); do
      for fuse in 1 0; do
        left=$(( LIMIT - SECONDS ))
        (( left > 30 )) || { echo "no time left for $name fuse=$fuse"; rc=1; break 3; }
        step "rmlx bench $name fuse=$fuse round $round"
        RMLX_FUSE_PROJECTIONS=$fuse RMLX_MLX_LIB_DIR=$SITE/mlx/lib timeout "$left" /tmp/rmlx/rmlx bench \
          --model "$model" --prompt-tokens 512 --gen-tokens 128 --runs "${U_RUNS:-3}" --json \
          > "$OUT/fuse-$name-$fuse-$round.json" || rc=1
        cat "$OUT/fuse-$name-$fuse-$round.json"
      done
    done
  done
  step "done ($rc)"
  exit $rc
fi

if [[ $MODE == memory ]]; then
  # Issue 32 (b): what `rmlx serve` holds on the card after one ~32k-token prompt on the bf16
  # Qwen3-4B shape, against MLX's peak plus the prefix cache (memory_after_prompt.py).
  qwen3_models || exit 1
  step "memory after a long prompt"
  left=$(( LIMIT - SECONDS ))
  RMLX_MLX_LIB_DIR=$SITE/mlx/lib timeout "$left" python3 scripts/bench/memory_after_prompt.py \
    --rmlx /tmp/rmlx/rmlx --model "$BENCH/qwen3-4b-shape-bf16" --words "${M_WORDS:-5500}" \
    --log "$OUT/memory-serve.log" | tee "$OUT/memory-after-prompt.json"
  rc=$?
  nvidia-smi --query-gpu=memory.used --format=csv,noheader
  step "done ($rc)"
  exit $rc
fi

if [[ $MODE == spec ]]; then
  # Issue 30: speculative decoding's mechanism (random weights: a proposer right with
  # probability p, see crates/rmlx-cli/src/bench_spec.rs). Per model: the verify cost of a step
  # of k + 1 tokens (p = 0 at fixed depth k: plain / speculative is its cost in plain steps),
  # then p = 1, 0.8, 0.5, 0 under `auto` at 1 and S_STREAMS (8) streams.
  models=()
  for which in ${S_MODELS:-27 35}; do
    step "model $which"
    model=$(spec_model "$which") || exit 1
    models+=("$model")
  done
  rc=0
  for model in "${models[@]}"; do
    name=$(basename "$model")
    for cell in ${S_CELLS:-verify c1 c8 ragged}; do
      left=$(( LIMIT - SECONDS ))
      (( left > 30 )) || { echo "no time left for $name $cell"; rc=1; break 2; }
      case $cell in
        verify) flags=(--draft-accuracy 0 --draft-depth 1,2,3,4) ;;
        c1) flags=(--draft-accuracy 1,0.8,0.5,0) ;;
        c8) flags=(--draft-accuracy 1,0.8,0.5,0 --concurrency "${S_STREAMS:-8}") ;;
        ragged) flags=(--ragged-check --concurrency "${S_STREAMS:-8}") ;;
      esac
      step "rmlx bench $name $cell"
      RMLX_MLX_LIB_DIR=$SITE/mlx/lib timeout "$left" /tmp/rmlx/rmlx bench --model "$model" \
        --prompt-tokens "${S_PROMPT:-512}" --gen-tokens "${S_GEN:-128}" --runs "${S_RUNS:-3}" \
        "${flags[@]}" --json > "$OUT/spec-$name-$cell.json" || rc=1
      cat "$OUT/spec-$name-$cell.json"
    done
  done
  step "done ($rc)"
  exit $rc
fi

if [[ $MODE == gemma_kv ]]; then
  step "model gemma4 31b shape"
  python3 scripts/bench/h200/make_gemma4_bench_model.py --device gpu --out "$BENCH" > /tmp/g4-path || exit 1
  G4=$(tail -1 /tmp/g4-path)
  du -sh "$G4"
  rc=0
  for round in $(seq 1 "${G_ROUNDS:-2}"); do
    for bits in ${G_BITS:-dense 8 4}; do
      left=$(( LIMIT - SECONDS ))
      (( left > 30 )) || { echo "no time left for round $round $bits"; rc=1; break 2; }
      kv=(); [[ $bits == dense ]] || kv=(--kv-bits "$bits")
      step "rmlx bench round $round kv $bits"
      RMLX_MLX_LIB_DIR=$SITE/mlx/lib timeout "$left" /tmp/rmlx/rmlx bench --model "$G4" "${kv[@]}" \
        --prompt-tokens "${G_PROMPT:-32768}" --gen-tokens "${G_GEN:-128}" --runs "${G_RUNS:-2}" --json \
        > "$OUT/gemma-kv-$bits-r$round.json" || rc=1
      cat "$OUT/gemma-kv-$bits-r$round.json"; echo
    done
  done
  nvidia-smi --query-gpu=memory.used --format=csv,noheader
  step "done ($rc)"
  exit $rc
fi

if [[ $MODE == steps ]]; then
  # Issue 32: what one decode step costs, rmlx alone. probe_masked_decode.py (a 4-row one-query
  # attention with and without the ragged batch's mask, over the whole buffer, and grouped),
  # then `rmlx bench --step-profile` at S_STREAMS (1,8) on the Qwen3-4B shapes of C_MODELS:
  # the 8-row 4-bit step against bf16's; then the grouped one-query A/B. S_PARTS picks the
  # parts and their order (default "probe repro steps grouped"; a short call: "grouped steps").
  for part in ${S_PARTS:-probe repro steps grouped}; do
    case $part in
      probe)
        step "probe masked decode"
        timeout 120 python3 scripts/bench/h200/probe_masked_decode.py --json-out "$OUT/probe-masked-decode.json" ;;
      repro)
        step "upstream reproduction: 4-bit matmul at small M"
        timeout 120 python3 scripts/upstream/mlx_cuda_qmm_small_m.py --json-out "$OUT/qmm-small-m.json" ;;
      steps)
        qwen3_models || exit 1
        for kind in ${C_MODELS:-bf16 4bit}; do
          for streams in ${S_STREAMS:-1 8}; do
            left=$(( LIMIT - SECONDS ))
            (( left > 40 )) || { echo "no time left for $kind x$streams"; break 2; }
            step "rmlx bench $kind x$streams"
            RMLX_MLX_LIB_DIR=$SITE/mlx/lib timeout "$left" /tmp/rmlx/rmlx bench --model "$BENCH/qwen3-4b-shape-$kind" \
              --prompt-tokens "${C_PROMPT:-512}" --gen-tokens "${C_TOKENS:-128}" --runs "${P_RUNS:-2}" \
              --concurrency "$streams" --step-profile | tee "$OUT/steps-$kind-s$streams.txt"
          done
        done ;;
      grouped)
        # The masked one-query step computed by grouped matmuls (RMLX_GROUPED_ONE_QUERY=1)
        # against MLX's SDPA fallback, in a ragged batch of 4 and in 4 streams as served (bf16).
        qwen3_models || exit 1
        for grouped in 0 1 0 1; do
          left=$(( LIMIT - SECONDS ))
          (( left > 40 )) || { echo "no time left for grouped=$grouped"; break; }
          step "ragged and 4 streams, RMLX_GROUPED_ONE_QUERY=$grouped"
          model=$BENCH/qwen3-4b-shape-bf16
          RMLX_GROUPED_ONE_QUERY=$grouped RMLX_MLX_LIB_DIR=$SITE/mlx/lib timeout "$left" /tmp/rmlx/rmlx bench \
            --model "$model" --prompt-tokens 512 --gen-tokens 128 --runs 2 --concurrency 4 --ragged-check \
            | tee -a "$OUT/grouped-$grouped.txt"
          RMLX_GROUPED_ONE_QUERY=$grouped RMLX_MLX_LIB_DIR=$SITE/mlx/lib timeout "$left" /tmp/rmlx/rmlx bench \
            --model "$model" --prompt-tokens 512 --gen-tokens 128 --runs 2 --concurrency 4 --step-profile \
            | tee -a "$OUT/grouped-$grouped.txt"
        done ;;
      sampled)
        # Sampled rows drawn with the batch (session 29) against one by one
        # (RMLX_BATCHED_SAMPLING=0), 8 streams of bf16 at temperature 1, then with the
        # releases' recommended top-p 0.95 / top-k 20, alternating.
        qwen3_models || exit 1
        for batched in 0 1 0 1; do
          for filters in "" "--top-p 0.95 --top-k 20"; do
            left=$(( LIMIT - SECONDS ))
            (( left > 40 )) || { echo "no time left for batched=$batched"; break 2; }
            step "8 sampled streams, RMLX_BATCHED_SAMPLING=$batched $filters"
            RMLX_BATCHED_SAMPLING=$batched RMLX_MLX_LIB_DIR=$SITE/mlx/lib timeout "$left" /tmp/rmlx/rmlx bench \
              --model "$BENCH/qwen3-4b-shape-bf16" --prompt-tokens 512 --gen-tokens 128 --runs 2 \
              --concurrency 8 --temperature 1 $filters --step-profile | tee -a "$OUT/sampled-$batched.txt"
          done
        done ;;
    esac
  done
  step "done"
  exit 0
fi

if [[ $MODE == profile ]]; then
  # Issue 15 stage 3: where a decode step's time goes. Per-op costs (probe_ops.py), then
  # `rmlx bench --step-profile` at 1 and P_STREAMS streams with this build's defaults and with
  # compile and the device copy of the weights off, then the engines side by side.
  step "probe ops"
  timeout 120 python3 scripts/bench/h200/probe_ops.py --json-out "$OUT/probe-ops.json"
  qwen3_models || exit 1
  profile() {  # label model streams env...
    local label=$1 model=$2 streams=$3; shift 3
    local left=$(( LIMIT - SECONDS ))
    (( left > 40 )) || { echo "no time left for $label"; return 1; }
    step "rmlx bench $label"
    env "$@" RMLX_MLX_LIB_DIR=$SITE/mlx/lib timeout "$left" /tmp/rmlx/rmlx bench --model "$model" \
      --prompt-tokens "${C_PROMPT:-512}" --gen-tokens "${C_TOKENS:-128}" --runs "${P_RUNS:-3}" \
      --concurrency "$streams" --max-batch 16 --step-profile | tee "$OUT/bench-$label.txt"
  }
  for kind in ${C_MODELS:-bf16 4bit}; do
    model=$BENCH/qwen3-4b-shape-$kind
    for streams in 1 ${P_STREAMS:-8}; do
      profile "$kind-s$streams" "$model" "$streams" RMLX_PROFILE_VARIANT=default
      [[ $kind == bf16 ]] && profile "$kind-s$streams-plain" "$model" "$streams" MLX_DISABLE_COMPILE=1 RMLX_WEIGHTS_ON_DEVICE=0
    done
  done
  model=$BENCH/qwen3-4b-shape-bf16
  step "concurrent streams bf16"
  left=$(( LIMIT - SECONDS ))
  (( left > 60 )) && RMLX_MLX_LIB_DIR=$SITE/mlx/lib timeout "$left" python3 scripts/bench/concurrency.py --model "$model" \
    --rmlx /tmp/rmlx/rmlx --streams "1,${P_STREAMS:-8}" --runs "${P_RUNS:-3}" --max-tokens "${C_TOKENS:-128}" \
    --rmlx-args "--max-batch 16" --json-out "$OUT/h200-concurrency-bf16.json"
  step "single stream bf16"
  left=$(( LIMIT - SECONDS ))
  (( left > 60 )) && RMLX_MLX_LIB_DIR=$SITE/mlx/lib timeout "$left" python3 scripts/bench/bench.py --model "$model" \
    --rmlx /tmp/rmlx/rmlx --reference mlx-lm --rmlx-via serve --device gpu --prompt-tokens "${C_PROMPT:-512}" \
    --gen-tokens "${C_TOKENS:-128}" --runs "${P_RUNS:-3}" --server-log "$OUT/rmlx-serve-bf16.log" \
    --json-out "$OUT/h200-single-bf16.json"
  step "done"
  exit 0
fi

if [[ $MODE == serve_ab ]]; then
  # Issue 32: single-stream decode through `rmlx serve` against mlx-lm's server (bench.py
  # --rmlx-via serve, each arm its own ratio) on the Qwen3-4B shapes of C_MODELS ("bf16 4bit"),
  # per arm of AB_ARMS ("auto exact off"): auto = the default (`auto` speculation; short steps
  # over the cache's whole buffer on CUDA), exact = auto with RMLX_ATTEND_WHOLE_BUFFER=0 (verify
  # steps over exactly the written columns, cuDNN graphs per cache length, before 7d2c4d3),
  # off = RMLX_SPECULATIVE=off. Each server's step profile is in serve-KIND-ARM.log.
  qwen3_models || exit 1
  rc=0
  for kind in ${C_MODELS:-bf16 4bit}; do
    for arm in ${AB_ARMS:-auto exact off}; do
      case $arm in
        auto) arm_env=(RMLX_PROFILE_ARM=auto) ;;
        exact) arm_env=(RMLX_ATTEND_WHOLE_BUFFER=0) ;;
        off) arm_env=(RMLX_SPECULATIVE=off) ;;
        *) echo "unknown arm $arm"; rc=1; continue ;;
      esac
      left=$(( LIMIT - SECONDS ))
      (( left > 45 )) || { echo "no time left for $kind $arm"; rc=1; break 2; }
      step "single stream $kind $arm"
      env "${arm_env[@]}" RMLX_STEP_PROFILE=1 RMLX_MLX_LIB_DIR=$SITE/mlx/lib timeout "$left" \
        python3 scripts/bench/bench.py --model "$BENCH/qwen3-4b-shape-$kind" --rmlx /tmp/rmlx/rmlx \
        --reference mlx-lm --rmlx-via serve --device gpu --prompt-tokens "${C_PROMPT:-512}" \
        --gen-tokens "${C_TOKENS:-128}" --runs "${AB_RUNS:-3}" --server-log "$OUT/serve-$kind-$arm.log" \
        --json-out "$OUT/ab-$kind-$arm.json" || rc=1
      grep -A8 "decode steps" "$OUT/serve-$kind-$arm.log"
    done
  done
  step "done ($rc)"
  exit $rc
fi

if [[ $MODE == pipeline ]]; then
  # Issue 33 (e): a two-rank pipeline (ring over loopback, both ranks on this one GPU with the
  # CUDA backend) against one process, `rmlx generate` on the bf16 Qwen3-4B shape: TTFT and
  # decode tok/s, the per-token overhead (overhead only: two ranks share one GPU).
  qwen3_models || exit 1
  left=$(( LIMIT - SECONDS ))
  step "pipeline overhead"
  RMLX_MLX_LIB_DIR=$SITE/mlx/lib timeout "$left" python3 scripts/bench/pipeline_overhead.py \
    --rmlx /tmp/rmlx/rmlx --model "$BENCH/qwen3-4b-shape-${PIPE_KIND:-bf16}" --runs "${PIPE_RUNS:-3}" \
    --tokens "${PIPE_TOKENS:-128}" --json-out "$OUT/pipeline-overhead.json"
  rc=$?
  step "done ($rc)"
  exit $rc
fi

if [[ $MODE == prefill ]]; then
  # Issue 32 (f): long prompts against mlx-lm on the bf16 Qwen3-4B shape, prefill tok/s and MLX's
  # peak memory at each of L_TOKENS (one `rmlx bench` process per run, mlx-lm in-process, both
  # warmed at the shape, runs interleaved). Qwen3-4B's config says 40,960 positions (rmlx refuses
  # longer prompts); a sibling folder with the same weights says 131,072 for the 64k row.
  qwen3_models || exit 1
  long=$BENCH/qwen3-4b-shape-bf16-131k
  if [[ ! -f $long/config.json ]]; then
    mkdir -p "$long"
    for f in "$BENCH"/qwen3-4b-shape-bf16/*; do ln -sf "$f" "$long/"; done
    rm "$long/config.json"
    python3 -c 'import json,sys; c=json.load(open(sys.argv[1])); c["max_position_embeddings"]=131072; json.dump(c,open(sys.argv[2],"w"),indent=1)' \
      "$BENCH/qwen3-4b-shape-bf16/config.json" "$long/config.json"
  fi
  rc=0
  for n in ${L_TOKENS:-8192 32768 65536}; do
    left=$(( LIMIT - SECONDS ))
    (( left > 30 )) || { echo "no time left for $n"; rc=1; break; }
    step "prefill $n tokens"
    RMLX_MLX_LIB_DIR=$SITE/mlx/lib timeout "$left" python3 scripts/bench/bench.py --model "$long" \
      --rmlx /tmp/rmlx/rmlx --reference mlx-lm --device gpu --prompt-tokens "$n" --gen-tokens "${L_GEN:-8}" \
      --prefill-chunk "${L_CHUNK:-2048}" --runs "${L_RUNS:-2}" --json-out "$OUT/prefill-$n.json" || rc=1
  done
  step "done ($rc)"
  exit $rc
fi

if [[ $MODE == concurrency ]]; then
  qwen3_models || exit 1
  rc=0
  # C_OPS_BUFFER="100 400": single-stream decode at each MLX_MAX_OPS_PER_BUFFER (ops per CUDA
  # graph MLX captures; its sm90 default is 100), before the tables.
  for ops in ${C_OPS_BUFFER:-}; do
    step "rmlx bench bf16 MLX_MAX_OPS_PER_BUFFER=$ops"
    MLX_MAX_OPS_PER_BUFFER=$ops RMLX_MLX_LIB_DIR=$SITE/mlx/lib timeout 60 /tmp/rmlx/rmlx bench \
      --model "$BENCH/qwen3-4b-shape-bf16" --prompt-tokens "${C_PROMPT:-512}" --gen-tokens "${C_TOKENS:-128}" \
      --runs 3 --step-profile | tee "$OUT/bench-ops-$ops.txt"
  done
  for kind in ${C_MODELS:-bf16 4bit}; do
    model=$BENCH/qwen3-4b-shape-$kind
    runs=${C_RUNS:-5}
    [[ $kind == 4bit ]] && runs=${C_RUNS_4BIT:-$runs}
    step "single stream $kind"
    [[ ${C_SINGLE:-1} == 1 ]] || { echo "skipped (C_SINGLE=0)"; }
    [[ ${C_SINGLE:-1} == 1 ]] && left=$(( LIMIT - SECONDS )) &&
    RMLX_STEP_PROFILE=1 RMLX_MLX_LIB_DIR=$SITE/mlx/lib timeout "$left" python3 scripts/bench/bench.py --model "$model" \
      --rmlx /tmp/rmlx/rmlx --reference mlx-lm --rmlx-via serve --device gpu --prompt-tokens "${C_PROMPT:-512}" \
      --gen-tokens "${C_TOKENS:-128}" --runs "$runs" --server-log "$OUT/rmlx-serve-$kind.log" \
      --json-out "$OUT/h200-single-$kind.json" || rc=1
    grep -A4 "decode steps" "$OUT/rmlx-serve-$kind.log"
    step "concurrent streams $kind"
    left=$(( LIMIT - SECONDS ))
    RMLX_STEP_PROFILE=1 RMLX_MLX_LIB_DIR=$SITE/mlx/lib timeout "$left" python3 scripts/bench/concurrency.py --model "$model" \
      --rmlx /tmp/rmlx/rmlx --streams "${C_STREAMS:-1,4,8,16}" --runs "$runs" \
      --max-tokens "${C_TOKENS:-128}" --rmlx-args "--max-batch 16" --json-out "$OUT/h200-concurrency-$kind.json" || rc=1
    # rmlx serve's step profile (RMLX_STEP_PROFILE=1), printed when it stopped.
    cp /tmp/bench-concurrency-rmlx.log "$OUT/concurrency-rmlx-$kind.log" 2>/dev/null
    grep -A20 "decode steps" "$OUT/concurrency-rmlx-$kind.log"
  done
  nvidia-smi --query-gpu=memory.used --format=csv,noheader
  step "done ($rc)"
  exit $rc
fi

if [[ ! -f $BENCH/qwen3-vl-4b-bf16/config.json ]]; then
  step model
  python3 scripts/bench/make_vl_bench_model.py --shape 4b --device gpu --out "$BENCH" --tiktoken "$TIKTOKEN" || exit 1
  du -sh "$BENCH/qwen3-vl-4b-bf16"
fi

bench() {  # sizes mode json
  local left=$(( LIMIT - SECONDS ))
  (( left > 30 )) || { echo "no time left for $1"; return 1; }
  timeout "$left" python3 scripts/bench/images.py --model "$BENCH/qwen3-vl-4b-bf16" --rmlx /tmp/rmlx/rmlx \
    --mlx-lib-dir "$SITE/mlx/lib" --sizes "$1" --runs "$RUNS" --mode "$2" --image-dir "$BENCH/images" \
    --json-out "$OUT/$3"
}
# Warm (one loaded process per engine, rmlx through `rmlx serve`) for all sizes at once, then
# cold (a fresh process per run) size by size.
if [[ $MODE == warm || $MODE == both ]]; then step "bench warm $SIZES"; bench "$SIZES" warm "h200-warm.json"; fi
if [[ $MODE == cold || $MODE == both ]]; then
  for size in ${SIZES//,/ }; do
    step "bench cold $size"
    bench "$size" cold "h200-cold-$size.json"
  done
fi
step done
