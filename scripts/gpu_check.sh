#!/usr/bin/env bash
# Every GPU check of docs/gpu_session.md in one command, in priority order, for a lent GPU machine
# (one command of at most 10 minutes; 15 minutes of device time in all, start-up included):
#
#   bash scripts/gpu_check.sh [--dry-run] [--only STEP,...] [--budget SECONDS]
#
#   env       nvidia-smi, versions, the carried wheels installed under /tmp/site
#   gpu       pytest -m gpu (NCCL, CPU offload with cuda:nccl,cpu:gloo, CUDA metrics, float8)
#   runner    the integration runner on one GPU: baselines generated, then passing against them
#   compare   tokens/s and MFU against TorchTitan 0.2.2, same TOML, runs alternating: 1B eager, compiled
#   profile   the eager models alone, ours against TorchTitan's: step time, kernels launched, the top ones
#   peak      the estimator against torch.cuda.max_memory_allocated at the 1B shape
#   flex      block-causal FlexAttention (compiled) against the dense-mask path: logits and speed
#   moe       grouped experts against the loop on CUDA: outputs and speed
#   float8    float8 against bf16 tokens/s at the 1B shape, eager and compiled
#
# Each step has its own time limit, cut to what is left of --budget (default 480 s: a second try
# fits in the device time); a step that cannot get its minimum is skipped. Each step's JSON and its
# log land in $OUT as soon as it ends, so a step cut short loses only itself; $OUT gets at most 8
# files (the device tool brings back 8): gpu_check.log, steps.jsonl (one line per step: rc,
# seconds), cuda_losses.tar (the runner's baselines: tests/assets/losses/cuda_*.jsonl),
# compare_1b.json, peak_1b.json, flex.json, moe_cuda.json, float8_1b.json (the profile step's
# figures are in the log: a ninth file would not come back).
#
# --dry-run (any machine, no GPU needed): every command line is built and printed, the scripts it
# calls are checked to exist and compile, and the carried wheels to be there (scripts/gpu_wheels.sh
# makes them). Exit 0 when everything is in place.
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
DRY=0 ONLY="" BUDGET=480
while [ $# -gt 0 ]; do
    case "$1" in
        --dry-run) DRY=1 ;;
        --only) ONLY="$2"; shift ;;
        --budget) BUDGET="$2"; shift ;;
        *) echo "gpu_check.sh: unknown argument $1; expected --dry-run, --only STEP,..., --budget SECONDS" >&2; exit 2 ;;
    esac
    shift
done
STEPS="env gpu runner compare profile peak flex moe float8"
for s in ${ONLY//,/ }; do
    case " $STEPS " in *" $s "*) ;; *) echo "gpu_check.sh: --only: unknown step $s; steps: $STEPS" >&2; exit 2 ;; esac
done
OUT=${OUT:-/tmp/gpu_check_out}
WORK=${GPU_CHECK_WORK:-/tmp/gpu_check}
LOG=$OUT/gpu_check.log
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$REPO${PYTHONPATH:+:$PYTHONPATH}
START=$(date +%s)
FAILED=0

# 1B at Llama 3.2 1B's shape, batch 4 x 2048, bf16: the shape of TorchTitan's comparison rows.
SHAPE="--peak_ranks 1 --flavor 1B --seq_len 2048 --local_batch_size 4 --param_dtypes bfloat16"
BENCH_ONLY="--skip overhead,memory,collectives,auto,ac,compile,metainit,startup"

# name, limit (s), minimum (s), command
declare -a NAMES LIMITS MINS CMDS
add() { NAMES+=("$1"); LIMITS+=("$2"); MINS+=("$3"); CMDS+=("$4"); }
add env 60 10 "nvidia-smi; $PY -c 'import sys, torch; print(sys.version); print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda, torch.cuda.get_device_name() if torch.cuda.is_available() else \"no GPU\")'; \
if ls .whl/*.whl >/dev/null 2>&1; then $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1; fi; \
$PY -c 'import torchao, torchtitan, datasets, tyro; print(\"torchao\", torchao.__version__, \"torchtitan importable, datasets\", datasets.__version__)'"
add gpu 150 60 "$PY -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py"
add runner 110 40 "rm -rf $WORK/losses && $PY scripts/integration_tests.py --device cuda --ngpu 1 --generate_baselines --baseline_dir $WORK/losses --output_dir $WORK/runner1 \
&& $PY scripts/integration_tests.py --device cuda --ngpu 1 --baseline_dir $WORK/losses --output_dir $WORK/runner2; rc=\$?; \
tar -cf $OUT/cuda_losses.tar -C $WORK/losses .; exit \$rc"
add compare 230 120 "$PY scripts/compare_torchtitan.py --rows 1B,1B_compile --steps 20 --skip_steps 8 --corpus_mb 4 \
--workdir $WORK/compare --timeout 150 --json $OUT/compare_1b.json; rc=\$?; \
for f in $WORK/compare/runs/*/*.log; do echo \"--- \$f (last 25 lines)\"; tail -n 25 \"\$f\"; done; exit \$rc"
add profile 90 40 "$PY scripts/profile_eager.py --layers 16 --seq_len 2048 --local_batch_size 4"
add peak 150 60 "$PY scripts/benchmark.py $BENCH_ONLY --parts peak $SHAPE \
--peak_cases default:none,default:full,default:op,default:2,always:none:offload,never:none:offload --json $OUT/peak_1b.json"
add flex 60 25 "$PY scripts/bench_flex.py --flavor 1B --layers 4 --seq_len 2048 --local_batch_size 4 --json $OUT/flex.json"
add moe 45 15 "$PY scripts/bench_moe.py --device cuda --tokens 16384 --dim 2048 --hidden 768 --experts 64 --top_k 8 --json $OUT/moe_cuda.json \
&& $PY scripts/bench_moe.py --device cuda --tokens 16384 --dim 2048 --hidden 1024 --experts 16 --top_k 2"
add float8 150 60 "$PY scripts/benchmark.py $BENCH_ONLY --parts float8 $SHAPE --float8_steps 25 --float8_modes eager,compiled \
--json $OUT/float8_1b.json"

if [ "$DRY" = 1 ]; then
    missing=0
    for i in "${!NAMES[@]}"; do
        echo "[${NAMES[$i]}] limit ${LIMITS[$i]} s, minimum ${MINS[$i]} s: ${CMDS[$i]}"
        for f in $(grep -oE '(scripts|tests)/[A-Za-z0-9_./]+\.py' <<<"${CMDS[$i]}" | sort -u); do
            if [ ! -f "$f" ]; then echo "  missing: $f"; missing=1
            elif ! $PY -m py_compile "$f"; then echo "  does not compile: $f"; missing=1; fi
        done
    done
    for w in torchtitan-0.2.2 torchao-0.18.0 torchdata-0.11.0 datasets-4.7.0 tyro-1.0.17; do
        ls .whl/"$w"-*.whl >/dev/null 2>&1 || { echo "  missing wheel: .whl/$w-*.whl (run scripts/gpu_wheels.sh)"; missing=1; }
    done
    total=0; for l in "${LIMITS[@]}"; do total=$((total + l)); done
    echo "dry run: ${#NAMES[@]} steps, limits $total s in all, cut to a budget of $BUDGET s; outputs in $OUT"
    [ "$missing" = 0 ] && echo "dry run: everything in place" || echo "dry run: something is missing"
    exit "$missing"
fi

mkdir -p "$OUT" "$WORK"
echo "gpu_check: $(date -u +%FT%TZ), budget $BUDGET s, steps ${ONLY:-$STEPS}" | tee -a "$LOG"
for i in "${!NAMES[@]}"; do
    name=${NAMES[$i]}
    if [ -n "$ONLY" ] && [[ ",$ONLY," != *",$name,"* ]]; then continue; fi
    left=$((BUDGET - ($(date +%s) - START)))
    limit=$(( LIMITS[i] < left ? LIMITS[i] : left ))
    if [ "$limit" -lt "${MINS[$i]}" ]; then
        echo "=== [$name] skipped: $left s of the budget left, needs ${MINS[$i]}" | tee -a "$LOG"
        echo "{\"step\": \"$name\", \"rc\": null, \"skipped\": \"out of time\"}" >> "$OUT/steps.jsonl"
        continue
    fi
    echo "=== [$name] limit $limit s: ${CMDS[$i]}" | tee -a "$LOG"
    t0=$(date +%s)
    timeout -k 10 "$limit" bash -c "${CMDS[$i]}" >> "$LOG" 2>&1
    rc=$?
    secs=$(( $(date +%s) - t0 ))
    [ "$rc" = 124 ] || [ "$rc" = 137 ] && status="timed out" || { [ "$rc" = 0 ] && status=ok || status=failed; }
    [ "$rc" = 0 ] || FAILED=1
    echo "=== [$name] $status (rc $rc) in $secs s" | tee -a "$LOG"
    echo "{\"step\": \"$name\", \"rc\": $rc, \"status\": \"$status\", \"seconds\": $secs, \"limit\": $limit}" >> "$OUT/steps.jsonl"
done
echo "gpu_check: done in $(( $(date +%s) - START )) s" | tee -a "$LOG"
exit "$FAILED"
