#!/usr/bin/env bash
# One short lease of a GPU (issues 36, 58, 71), in one command, every phase under its own
# time limit so that a phase that hangs or fails leaves the others their time. In order of what
# the open goals need most (the lease of 2026-11-30 ran out of time at phase 5 of the old order):
#   1. the benchmark rows of GPT-2 small at its real vocabulary (MODELS, default gpt2_small;
#      POLICIES, default mixed_bf16 mixed_f16, fp32 always: every step waited for and back to
#      back; MFU both ways; the modeled time beside each measured one; ours against the
#      hand-written step, alternating, back to back and waited; the loss scale's cost):
#      python -m benchmarks (mixed_int8's compilation took 126 s of 168 on 2026-11-30; its step was
#      measured then: POLICIES="mixed_bf16 mixed_int8" to time it again);
#   2. stochastic rounding's bits in the lean update, hashed against threefry (benchmarks.rounding_cost
#      at 268M params: threefry's took 76 + 14 ms of the 8B step on 2026-11-30);
#   3. FP8 against bf16 at Llama-3-8B's shape, lean state (benchmarks.fp8_speed --shapes
#      llama3_8b; FP8_SHAPES, FP8_ARGS="--scaling rowwise" and the like change it);
#   4. decoding at batch 1, bf16 and int8 weights, 16 tokens a dispatch, timed beside the model of
#      the program it ran (benchmarks.decode_speed: 2 and 4 layers 4,096 wide, what one layer adds);
#      then a Hugging Face Llama's (Llama-3-8B's layers) through its own modules and through the
#      fused decode kernels (--decode-kernels fused: a Llama-3-8B shape's modeled 1.46x, GPT-2 small's; never timed);
#   5. the top kernels of our mixed_bf16 step and of the hand-written one (benchmarks.profile_step);
#   6. closed-form norms and the loss in blocks, each switched off in turn: time, memory plan,
#      the largest batch each allows, run (benchmarks.norms_and_loss);
#   7. the loss's reduction over GPT-2 small's logits five ways (benchmarks.loss_variants);
#   8. the tests that failed on the GPU last time (benchmarks/gpu_failures.txt), with tracebacks;
#   9. with the time left: the machine's ceilings (benchmarks.ceilings: a bf16, an int8 and an FP8
#      8192^3 product, a copy), FP8 at 1.35B as before (FP8_MORE) and the whole suite on the GPU,
#      one line per test as it ends (-v under xdist), so a run cut at its limit still names its failures;
# and, with CPU_SUITE=1, meanwhile on the CPU cores at low priority, the whole suite on this
# machine's JAX (JAX_PLATFORMS=cpu).
# Results go to $OUT/session.log (as they come) and $OUT/results.tgz (at the end):
# the lease brings back at most 8 files.
#
#   bash benchmarks/gpu_session.sh [SECONDS]   (default 560)
#
# SIZE=quick FP8_SHAPES=llama_tiny FP8_MORE=tiny bash benchmarks/gpu_session.sh 400 checks the
# script itself on a CPU in a few minutes.
#
# Missing packages travel as wheels in .whl/: bash benchmarks/gpu_wheels.sh makes it (carry .whl).
set -u
SECONDS_TOTAL=${1:-560}
SIZE=${SIZE:-gpu} FP8_SHAPES=${FP8_SHAPES:-llama3_8b} FP8_MORE=${FP8_MORE:-gpt_1b3} MODELS=${MODELS:-gpt2_small}
POLICIES=${POLICIES:-mixed_bf16 mixed_f16}
CPU_SUITE=${CPU_SUITE:-0} FP8_ARGS=${FP8_ARGS:-}
OUT=${OUT:-runs/gpu_session}
RES=$(mktemp -d)  # everything but the log, packed into $OUT/results.tgz at the end
mkdir -p "$OUT"
LOG="$OUT/session.log"
START=$(date +%s)
left() { echo $((SECONDS_TOTAL - ($(date +%s) - START))); }
phase() {  # phase NAME LIMIT COMMAND...: runs COMMAND for at most LIMIT seconds (less if less is left)
    local name=$1 limit=$2; shift 2
    local budget=$(($(left) - 15))
    ((limit > budget)) && limit=$budget
    if ((limit < 20)); then echo "== $name: skipped, ${limit} s left" | tee -a "$LOG"; return; fi
    echo "== $name (limit ${limit} s, $(left) s left): $*" | tee -a "$LOG"
    local t0=$(date +%s)
    timeout -k 5 "$limit" "$@" 2>&1 | tee -a "$LOG"
    echo "== $name: rc ${PIPESTATUS[0]} after $(($(date +%s) - t0)) s" | tee -a "$LOG"
}

if ls .whl/*.whl > /dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1 MP_COMPILE_CACHE_DIR=/tmp/mp-jax-cache
# Everything below imports the project: a missing package stops the lease here, in seconds,
# rather than failing every phase (2026-11-29: no pydantic, the wheels left behind).
if ! python3 -c "import precision, train, jmp, benchmarks.suite, benchmarks.fp8_speed, benchmarks.norms_and_loss, benchmarks.decode_speed, benchmarks.loss_variants, benchmarks.rounding_cost" \
        > "$OUT/preflight.log" 2>&1; then
    tail -n 3 "$OUT/preflight.log" | tee -a "$LOG"
    echo "== stopped: the project does not import here. Run 'bash benchmarks/gpu_wheels.sh' on your machine and" \
         "carry .whl in the device call." | tee -a "$LOG"
    exit 3
fi
{
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv
    python3 -c "import sys, jax, flax, optax, chex; print(sys.version.split()[0], 'jax', jax.__version__, 'flax', flax.__version__, 'optax', optax.__version__, jax.devices())"
} 2>&1 | tee -a "$LOG"
((CPU_SUITE)) && (JAX_PLATFORMS=cpu XLA_PYTHON_CLIENT_PREALLOCATE=false nice -n 19 timeout -k 5 $((SECONDS_TOTAL - 30)) python3 -m pytest -n 8 -p no:cacheprovider \
    -m "not gpu and not gpu_compile" -v -o console_output_style=classic --tb=line > "$RES/pytest_cpu.log" 2>&1) &
cpu_suite=$!

phase "benchmarks" 200 python3 -m benchmarks --size "$SIZE" --models $MODELS --policies fp32 $POLICIES \
    --rounds 10 --out "$RES/bench" --save-programs "$RES/programs"
phase "rounding bits" 40 python3 -m benchmarks.rounding_cost --params $([ "$SIZE" = quick ] && echo 65536 || echo 268435456) \
    --out "$RES/rounding"
phase "fp8 at 8B" 130 env XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 python3 -m benchmarks.fp8_speed --shapes "$FP8_SHAPES" \
    --steps 5 --rounds 3 --profile --out "$RES/fp8" $FP8_ARGS
phase "decode" 100 python3 -m benchmarks.decode_speed --shapes $([ "$SIZE" = quick ] && echo tiny,tiny_4 || echo wide_2,wide_4) \
    --out "$RES/decode"
phase "fused decode" 110 python3 -m benchmarks.decode_speed --shapes $([ "$SIZE" = quick ] && \
    echo llama_tiny,llama_tiny_4,hf_gpt2_tiny || echo llama_2,llama_4,hf_gpt2_small) --dtypes bf16 --kernels xla,fused \
    --out "$RES/decode-fused"
phase "profile, ours" 45 python3 -m benchmarks.profile_step --model ${MODELS%% *} --size "$SIZE" --out "$RES/profile"
phase "profile, hand-written" 45 python3 -m benchmarks.profile_step --model ${MODELS%% *} --size "$SIZE" --hand-written \
    --out "$RES/profile"
phase "norms and loss" 150 env XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 python3 -m benchmarks.norms_and_loss --rounds 6 \
    $([ "$SIZE" = quick ] && echo --size quick --limit-gib 0.3) --out "$RES/norms"
phase "loss variants" 40 python3 -m benchmarks.loss_variants $([ "$SIZE" = quick ] && echo --shape 4,64,512) \
    --out "$RES/loss"
# The tests that failed on the GPU last time, with their tracebacks (not beside a benchmark: XLA
# autotunes its GEMMs on the device while it compiles, and other work there would sway its choices).
phase "last time's GPU failures" 60 env JAX_PLATFORMS=cuda XLA_PYTHON_CLIENT_PREALLOCATE=false python3 -m pytest -q -n 3 \
    -p no:cacheprovider --tb=short -rf $(sed -e 's/#.*//' benchmarks/gpu_failures.txt)
phase "ceilings" 60 python3 -m benchmarks.ceilings --narrow int8 fp8 $([ "$SIZE" = quick ] && echo --size 512 --copy-gib 0.01) \
    --out "$RES"
phase "fp8 as before" 170 python3 -m benchmarks.fp8_speed --shapes "$FP8_MORE" --steps 20 --rounds 2 --out "$RES/fp8_more" $FP8_ARGS
phase "suite on the GPU" 600 env JAX_PLATFORMS=cuda XLA_PYTHON_CLIENT_PREALLOCATE=false python3 -m pytest -v -n 6 \
    -p no:cacheprovider -m "not gpu_compile" --tb=line -o console_output_style=classic > "$RES/pytest_cuda.log"
grep -E "(FAILED|ERROR) " "$RES/pytest_cuda.log" 2>/dev/null | sed -E 's/^.*(FAILED|ERROR) /\1 /' | sort | head -60

if ((CPU_SUITE)); then
    wait "$cpu_suite"
    echo "== CPU suite on this machine's JAX: rc $?; $(tail -n 1 "$RES/pytest_cpu.log")" | tee -a "$LOG"
    grep -E "(FAILED|ERROR) " "$RES/pytest_cpu.log" | sed -E 's/^.*(FAILED|ERROR) /\1 /' | sort | head -40 | tee -a "$LOG"
fi
tar czf "$OUT/results.tgz" -C "$RES" . && rm -rf "$RES"
echo "== done in $(($(date +%s) - START)) s" | tee -a "$LOG"
