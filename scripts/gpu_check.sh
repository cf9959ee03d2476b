#!/usr/bin/env bash
# What a lent CUDA machine runs: the book's GPU claims measured in priority order, as two
# commands of at most 6 minutes each (a lease is 15 minutes in all, and starting the machine
# takes one or two of them). The machine has torch preinstalled and no package registry:
# nothing is installed, and a step whose tools are missing is skipped with the reason.
#
#   bash scripts/gpu_check.sh 1       # the headline: the trainer on configs/gpt_1b.toml for 30
#                                     # iterations (tokens/s, MFU, peak memory against chapter
#                                     # 07's ledger) with kernels = torch, then with compile;
#                                     # the memory meter's CUDA test against the allocator
#   bash scripts/gpu_check.sh 2       # appendix C's kernels (bandwidth / HBM peak, flash / SDPA),
#                                     # recompute overhead, the staged checkpoint copy on the GPU,
#                                     # the full-iteration CUDA graph's speed-up, the NCCL
#                                     # pipeline (2+ GPUs), inductor's Triton, then pytest -m gpu
#                                     # with what is left of the 6 minutes
#   bash scripts/gpu_check.sh         # both, one after the other
#   bash scripts/gpu_check.sh budget  # print each command's step limits; fail if they overrun
#   GPU_CHECK_DRY=1 bash scripts/gpu_check.sh [1|2]   # CPU dry run: the budget check, then
#                                     # every step's CPU form (configs/tiny.toml, Triton's
#                                     # interpreter, small shapes, pytest --collect-only): about
#                                     # 2 + 4 minutes on 2 heavily loaded cores, under the same
#                                     # limits
#
# Each step runs under its own limit (`timeout`); a step that hits it is reported "timed out",
# one that fails "failed (exit N)" with its last log lines, and the next step runs. The report
# is rewritten after every step, so a command cut off by its lease still reports how far it
# got. What it writes, in $OUT when set (else benchmarks/results/gpu/; a dry run: a temp dir):
#   <device>.json        the measurements and each step's outcome (h200.json on an H200), with
#                        the torch, Triton and CUDA versions and the date: the file the book's
#                        pages render ("measured on <device>"); commit it as
#                        benchmarks/results/gpu/<device>.json. Command 2 keeps command 1's
#                        results when that file is there: put command 1's JSON there before
#                        command 2 runs (the working tree is what the machine gets).
#   gpu_check.md         the same as a short text
#   gpu_check_logs.tgz   every step's log (each cut to its last 2 MB) and raw outputs
# Checkpoints go to a scratch folder outside $OUT and are removed; the trainer saves only its
# final weights (it always does), no optimizer state.
set -uo pipefail
cd "$(dirname "$0")/.."
WHAT=${1:-all}
case "$WHAT" in 1|2|all|budget) ;;
  *) echo "usage: bash scripts/gpu_check.sh [1|2|budget] (got '$WHAT')" >&2; exit 2 ;;
esac
DRY=${GPU_CHECK_DRY:-0}
BUDGET_S=360   # one device command
SETUP_S=20     # finding tinytron, the report's header (torch imported once), packing the logs
GRACE_S=5      # timeout's --kill-after, per step
PYTEST_MIN_S=45
# name:limit_s:title, in the order they run; pytest_gpu gets what is left (at least PYTEST_MIN_S)
PLAN_1="trainer_torch:110:the trainer on configs/gpt_1b.toml with kernels = torch"
PLAN_1+=";trainer_compile:170:the trainer on configs/gpt_1b.toml with kernels = torch and compile"
PLAN_1+=";memory:45:chapter 07's ledger against the CUDA allocator"
PLAN_2="kernels:65:appendix C's kernels: bandwidth / HBM peak and flash / SDPA"
PLAN_2+=";recompute:35:selective and full recompute overhead"
PLAN_2+=";staging:40:the staged checkpoint copy's blocking time on the GPU"
PLAN_2+=";cudagraph:40:the full-iteration CUDA graph's speed-up (tests/test_reliability_gpu.py)"
PLAN_2+=";pipeline:50:chapter 07's step-time model against a traced NCCL run on 2 GPUs"
PLAN_2+=";inductor:25:inductor's Triton for RMSNorm (appendix C.6)"
PLAN_2+=";pytest_gpu:$PYTEST_MIN_S:pytest -m gpu with what is left"

# budget N: the worst case of command N (every step at its limit plus its kill grace) must fit.
budget() {
  local plan total=$SETUP_S item name lim
  plan=$([ "$1" = 1 ] && echo "$PLAN_1" || echo "$PLAN_2")
  echo "command $1 (budget $BUDGET_S s): setup $SETUP_S s"
  IFS=';' read -ra items <<<"$plan"
  for item in "${items[@]}"; do
    IFS=: read -r name lim _ <<<"$item"
    echo "  $name: limit $lim s + $GRACE_S s kill grace"
    total=$((total + lim + GRACE_S))
  done
  if [ "$total" -gt "$BUDGET_S" ]; then
    echo "gpu_check: OVER BUDGET: command $1's steps add up to $total s, more than its $BUDGET_S s" >&2
    return 1
  fi
  echo "  worst case $total s <= $BUDGET_S s"
}
if [ "$WHAT" = budget ]; then budget 1 && budget 2; exit; fi

SCRATCH=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")   # checkpoints and logs: never $OUT
trap 'rm -rf "$SCRATCH"' EXIT
LOGS="$SCRATCH/logs"; mkdir -p "$LOGS"
if [ "$DRY" = 1 ]; then DEST=${OUT:-$SCRATCH/out}; else DEST=${OUT:-benchmarks/results/gpu}; fi
mkdir -p "$DEST"; DEST=$(cd "$DEST" && pwd)
export PYTHONUNBUFFERED=1 MPLBACKEND=Agg DRY LOGS SCRATCH GRACE_S
[ "$DRY" = 1 ] && export OMP_NUM_THREADS=1

# tinytron importable: already installed, else pip without dependencies or build isolation
# (which would need the network), else a tree of links on PYTHONPATH.
if ! python3 -c 'import tinytron' >/dev/null 2>&1; then
  if ! python3 -m pip install -q --no-deps --no-build-isolation -e . >"$LOGS/install.log" 2>&1; then
    LINKS=$(mktemp -d "$SCRATCH/links.XXXXXX")
    python3 - "$LINKS" <<'PY'
import os, sys, tomllib
dest = sys.argv[1]
dirs = tomllib.load(open("pyproject.toml", "rb"))["tool"]["setuptools"]["package-dir"]
os.makedirs(os.path.join(dest, "tinytron"))
for name in os.listdir("chapters"):
    if name.endswith(".py"):
        os.symlink(os.path.abspath(os.path.join("chapters", name)), os.path.join(dest, "tinytron", name))
for pkg, folder in dirs.items():
    if pkg != "tinytron":
        os.symlink(os.path.abspath(folder), os.path.join(dest, *pkg.split(".")))
PY
    export PYTHONPATH="$LINKS${PYTHONPATH:+:$PYTHONPATH}"
    echo "pip install failed; using a link tree on PYTHONPATH" >>"$LOGS/install.log"
  fi
fi

pack_logs() {  # every log, cut to its last 2 MB, into one archive beside the report
  rm -rf "$SCRATCH/pack"; mkdir -p "$SCRATCH/pack"
  for f in "$LOGS"/*; do [ -f "$f" ] && tail -c 2000000 "$f" >"$SCRATCH/pack/$(basename "$f")"; done
  tar czf "$DEST/gpu_check_logs.tgz" -C "$SCRATCH/pack" . 2>/dev/null
}

# step NAME LIMIT RAW COMMAND: run COMMAND under LIMIT (log: $LOGS/NAME.log; exit 77 = skipped,
# its last line the reason), then fold its outcome and RAW (its JSON output) into the report.
step() {
  local name=$1 lim=$2 raw=$3 t0=$SECONDS rc status; shift 3
  timeout --kill-after="$GRACE_S" "$lim" bash -c "$*" >"$LOGS/$name.log" 2>&1
  rc=$?
  case $rc in
    0) status=ok ;; 77) status=skipped ;; 124|137) status="timed out" ;; *) status="failed (exit $rc)" ;;
  esac
  python3 benchmarks/gpu_check.py record --json "$REPORT" --step "$name" --status "$status" \
    --seconds $((SECONDS - t0)) --limit "$lim" --raw "$raw" --log "$LOGS/$name.log"
  pack_logs
  echo "[gpu_check] $name: $status ($((SECONDS - t0)) s, limit $lim s)"
}
limit_of() { tr ';' '\n' <<<"$PLAN_1;$PLAN_2" | awk -F: -v n="$1" '$1 == n {print $2}'; }

# -- command 1: the trainer, the ledger against the allocator -------------------------------
# trainer_run VARIANT LIMIT: the real trainer, then its JSONL summarized (exit 124 when it timed
# out, 3 when it stopped short of the asked iterations: only a full run counts).
trainer_run() {
  local v=$1 lim=$2 run="$SCRATCH/train_$1" rc iters args
  if [ "$DRY" = 1 ]; then
    iters=3
    # a 20-file corpus, built once: the embedded 5 MB one takes ~90 s on 2 loaded cores
    [ -s "$SCRATCH/corpus_prefix" ] || python3 -c 'import sys
from tinytron.data.preprocess import run, stdlib_corpus
print(run(["--input", *stdlib_corpus(20), "--output-prefix", sys.argv[1], "--workers", "1",
           "--no-progress", "--append-eod"]))' "$SCRATCH/corpus" | tail -n 1 >"$SCRATCH/corpus_prefix"
    args=(--data.data_path "$(cat "$SCRATCH/corpus_prefix")" --config configs/tiny.toml
          --training.device cpu --training.train_iters 3
          --training.log_interval 1 --training.global_batch_size 8 --scheduler.lr_warmup_iters 1
          --optimizer.use_distributed_optimizer false --ddp.overlap_grad_reduce false
          --model.kernels torch)   # no compile on the CPU: the plumbing, not inductor's minutes
  else
    iters=30
    args=(--config configs/gpt_1b.toml --training.train_iters 30 --training.log_interval 10
          --training.global_batch_size 16 --scheduler.lr_warmup_iters 2
          --scheduler.lr_decay_iters none --model.kernels torch)
    [ "$v" = compile ] && args+=(--model.compile true)
  fi
  # no validation, no periodic save; the final save (weights only) goes to the scratch folder.
  # No signal handler: a SIGTERM from `timeout` must end the run, not save and exit 0.
  args+=(--training.eval_interval none --training.exit_signal_handler false
         --checkpoint.async_save false --checkpoint.no_save_optim true --checkpoint.save "$run")
  mkdir -p "$run"
  [ -d "$SCRATCH/data" ] && mv "$SCRATCH/data" "$run/data"   # the corpus, built once
  timeout --kill-after="$GRACE_S" $((lim - 25)) python3 -m tinytron.train "${args[@]}"
  python3 benchmarks/gpu_check.py trainer --variant "$v" --rc $? --jsonl "$run/log.jsonl" \
    --iters $iters --out "$LOGS/trainer_$v.json" -- "${args[@]}"
  rc=$?
  [ -d "$run/data" ] && mv "$run/data" "$SCRATCH/data"
  rm -rf "$run"
  return $rc
}
export -f trainer_run

command_1() {
  step trainer_torch "$(limit_of trainer_torch)" "$LOGS/trainer_torch.json" \
    trainer_run torch "$(limit_of trainer_torch)"
  step trainer_compile "$(limit_of trainer_compile)" "$LOGS/trainer_compile.json" \
    trainer_run compile "$(limit_of trainer_compile)"
  step memory "$(limit_of memory)" "" \
    python3 -m pytest -q -rs -p no:cacheprovider \
    tests/test_memory_measured.py::test_ledger_against_cuda_allocator
}

# -- command 2: kernels, recompute, staging, CUDA graph, pipeline, inductor, pytest -m gpu ------
command_2() {
  local dev=cuda ndev pytest_left
  [ "$DRY" = 1 ] && dev=cpu
  ndev=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["device_count"])' "$REPORT")
  step kernels "$(limit_of kernels)" "$LOGS/kernels.json" \
    "python3 -c 'import triton' 2>/dev/null || { echo 'skipped: Triton is not installed'; exit 77; }
     python3 benchmarks/bench_kernels.py --device $dev --budget-s 30 --out $LOGS/kernels.json \
       $([ "$DRY" = 1 ] && echo --reps 1)"
  step recompute "$(limit_of recompute)" "$LOGS/recompute.json" \
    python3 benchmarks/bench_recompute.py --device $dev --out "$LOGS/recompute.json" \
    "$([ "$DRY" = 1 ] && echo --small --rounds 1 --steps 1 || echo --rounds 2 --steps 2)"
  step staging "$(limit_of staging)" "$LOGS/staging.json" \
    "python3 benchmarks/bench_checkpoint_staging.py --device $dev --dir $SCRATCH/staging \
       --out $LOGS/staging.json $([ "$DRY" = 1 ] && echo --small --repeats 1 --modes thread_staged \
       || echo --repeats 2 --modes thread_staged,thread_unstaged); s=\$?; rm -rf $SCRATCH/staging; exit \$s"
  step cudagraph "$(limit_of cudagraph)" "" \
    python3 -m pytest -q -s -rs -p no:cacheprovider tests/test_reliability_gpu.py
  if [ "$ndev" -ge 2 ]; then
    step pipeline "$(limit_of pipeline)" "$LOGS/pipeline.json" \
      python3 benchmarks/bench_step_time.py --device cuda --iters 6 --out "$LOGS/pipeline.json"
  else
    step pipeline 5 "" "echo 'skipped: the NCCL pipeline needs 2 GPUs; this machine has $ndev'; exit 77"
  fi
  # on 2 loaded cores importing inductor alone took 25 s and tracing the norm 45 s: the dry run
  # only finds the module (importing tinytron.kernels, not torch._inductor)
  if [ "$DRY" = 1 ]; then
    step inductor "$(limit_of inductor)" "" \
      "python3 -c 'import importlib.util as u; assert u.find_spec(\"tinytron.kernels.inductor\")' \
       && echo 'dry run: tinytron.kernels.inductor found; write_triton_report not run'"
  else
    step inductor "$(limit_of inductor)" "" \
      "python3 -c 'import sys; from tinytron.kernels.inductor import write_triton_report as w; \
       print(w(sys.argv[1], \"cuda\"), \"kernels\")' $LOGS/inductor.md"
  fi
  # what is left of the budget; the tests the steps above ran are left out (none runs twice)
  pytest_left=$((BUDGET_S - (SECONDS - T0) - GRACE_S - 5))
  [ "$pytest_left" -lt "$PYTEST_MIN_S" ] && pytest_left=$PYTEST_MIN_S
  step pytest_gpu "$pytest_left" "" \
    python3 -m pytest -m gpu -v -rfE -p no:cacheprovider tests \
    "$([ "$DRY" = 1 ] && echo --collect-only -q)" \
    --deselect tests/test_memory_measured.py::test_ledger_against_cuda_allocator \
    --ignore tests/test_reliability_gpu.py
}

for N in 1 2; do
  [ "$WHAT" = all ] || [ "$WHAT" = "$N" ] || continue
  T0=$SECONDS
  if [ "$DRY" = 1 ]; then budget "$N" || exit 1; fi
  PLAN=$([ "$N" = 1 ] && echo "$PLAN_1" || echo "$PLAN_2")
  REPORT=$(python3 benchmarks/gpu_check.py start --dest "$DEST" --command "$N" --plan "$PLAN" \
           $([ "$DRY" = 1 ] && echo --dry)) \
    || { echo "gpu_check: could not start the report" >&2; exit 1; }
  export REPORT
  "command_$N"
  echo "[gpu_check] command $N: $((SECONDS - T0)) s of $BUDGET_S; report $REPORT"
done
cat "$DEST/gpu_check.md"
