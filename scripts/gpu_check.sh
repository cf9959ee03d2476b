#!/usr/bin/env bash
# One command for a CUDA machine that has torch preinstalled and no package registry: measure
# the book's GPU claims in priority order, each step under its own time limit, and write one
# Markdown report of ratios (absolute numbers labelled as this GPU's). A step that fails says
# why in the report and the next one runs. About 10 minutes on one H200:
#   1. the trainer on configs/gpt_1b.toml (~1B) for a few dozen iterations: tokens/s and MFU
#      with kernels = torch, triton, and torch.compile           (limit 3 x 150 s)
#      and the Triton kernels inductor writes for RMSNorm (appendix C.6)               (60 s)
#   2. appendix C's kernels: achieved bandwidth / HBM peak, flash attention / SDPA flash (90 s)
#   3. chapter 07's memory meter on CUDA against the ledger and the allocator          (60 s)
#   4. selective and full recompute overhead, the staged checkpoint copy's blocking time,
#      the full-iteration CUDA graph's speed-up                                  (3 x 60 s)
#      and chapter 07's step-time model against a traced DP2 / PP2 run on 2 GPUs      (240 s)
#   5. pytest -m gpu                                                                  (150 s)
#
#   bash scripts/gpu_check.sh                  # report: benchmarks/results/gpu/gpu_report.md
#   OUT=/some/dir bash scripts/gpu_check.sh    # report and logs there instead
#   GPU_CHECK_DRY=1 bash scripts/gpu_check.sh  # CPU dry run: every step's plumbing with tiny
#                                              # shapes (configs/tiny.toml, Triton's interpreter,
#                                              # pytest --collect-only); ~5 minutes on 2 loaded
#                                              # cores, so it is run by hand, not in the suite
# In the dry run the triton variant runs the torch kernels and the staged-copy step only
# checks its script's arguments; every other step runs its real command on the CPU.
set -uo pipefail
cd "$(dirname "$0")/.."
DRY=${GPU_CHECK_DRY:-0}
DEST=${OUT:-benchmarks/results/gpu}
mkdir -p "$DEST"
DEST=$(cd "$DEST" && pwd)
REPORT="$DEST/gpu_report.md"
export PYTHONUNBUFFERED=1 MPLBACKEND=Agg
if [ "$DRY" = 1 ]; then
  DEVICE=cpu; SCALE=1; export OMP_NUM_THREADS=1   # the same limits: a loaded CPU is slow
else
  DEVICE=cuda; SCALE=1
fi
limit() { python3 -c "import sys; print(max(5, int(float(sys.argv[1]) * $SCALE)))" "$1"; }

# tinytron importable: already installed, else pip without dependencies or build isolation
# (which would need the network), else a tree of links on PYTHONPATH.
if ! python3 -c 'import tinytron' >/dev/null 2>&1; then
  if ! python3 -m pip install -q --no-deps --no-build-isolation -e . >"$DEST/install.log" 2>&1; then
    LINKS=$(mktemp -d)
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
    echo "pip install failed (see install.log); using a link tree on PYTHONPATH" >>"$DEST/install.log"
  fi
fi

{
  echo "# tinytron GPU check — $(date -u +%Y-%m-%dT%H:%MZ)"
  [ "$DRY" = 1 ] && echo && echo "**Dry run on CPU** (GPU_CHECK_DRY=1): plumbing only, no number below is a GPU's."
  echo
  echo '```'
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | head -4
  python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "devices", torch.cuda.device_count())'
  echo '```'
} >"$REPORT"

# step NAME TITLE LIMIT_S COMMAND: run COMMAND under its limit (log: $DEST/NAME.log), then add
# its section: the outcome, why it failed if it did, and the Markdown it left in $DEST/NAME.md.
step() {
  local name=$1 title=$2 lim=$3; shift 3
  local t0=$SECONDS rc
  rm -f "$DEST/$name.md"
  timeout --kill-after=10 "$lim" bash -c "$*" >"$DEST/$name.log" 2>&1
  rc=$?
  {
    echo
    echo "## $title"
    echo
    if [ $rc -eq 0 ]; then
      echo "ok in $((SECONDS - t0)) s (limit $lim s)."
    elif [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
      echo "**failed: timed out** after $lim s (its limit); what it finished is below. Log: \`$name.log\`."
    else
      echo "**failed: exit $rc** after $((SECONDS - t0)) s. Last lines of \`$name.log\`:"
      echo; echo '```'; tail -n 8 "$DEST/$name.log"; echo '```'
    fi
    [ -s "$DEST/$name.md" ] && { echo; cat "$DEST/$name.md"; }
  } >>"$REPORT"
  echo "[gpu_check] $name: exit $rc ($((SECONDS - t0)) s)"
  return 0
}

# -- 1. the trainer: tokens/s and MFU per kernel choice ---------------------------------------
# One row per variant, from the trainer's own JSONL log (the last logged interval).
trainer_variant() {  # VARIANT: torch | triton | compile
  local v=$1 run="$DEST/train_$1"
  local extra=(--model.kernels "$v")
  [ "$v" = compile ] && extra=(--model.kernels torch --model.compile true)
  if [ "$DRY" = 1 ]; then
    [ "$v" = triton ] && extra=(--model.kernels torch)   # no Triton on CPU: the torch path
    args=(--config configs/tiny.toml --training.device cpu --training.train_iters 3
          --training.log_interval 1 --training.eval_interval none --training.global_batch_size 8
          --scheduler.lr_warmup_iters 1
          --optimizer.use_distributed_optimizer false --ddp.overlap_grad_reduce false)
  else
    args=(--config configs/gpt_1b.toml --training.train_iters 24 --training.log_interval 8
          --training.eval_interval none --training.global_batch_size 16
          --scheduler.lr_warmup_iters 2 --scheduler.lr_decay_iters none
          --checkpoint.no_save_optim true)
  fi
  rm -rf "$run"
  timeout --kill-after=10 "$(limit 150)" python3 -m tinytron.train "${args[@]}" "${extra[@]}" \
    --checkpoint.save "$run" >"$DEST/train_$v.log" 2>&1
  local rc=$?
  python3 - "$v" "$rc" "$run/log.jsonl" "$DEST/train_$v.log" >>"$DEST/trainer.md" <<'PY'
import json, os, sys
v, rc, path, log = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
recs = [json.loads(x) for x in open(path)] if os.path.exists(path) else []
if rc == 0 and recs:
    r = recs[-1]
    mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") is not None else "n/a"
    print(f"| {v} | ok | {r['iteration']} | {r['tokens_per_second']:,.0f} | {mfu} "
          f"| {r['ms_per_iteration']:.0f} |")
else:
    lines = [x.strip() for x in open(log, errors="replace").read().splitlines() if x.strip()]
    why = "timed out" if rc in (124, 137) else (lines[-1][:160] if lines else f"exit {rc}")
    print(f"| {v} | failed: {why.replace('|', '/')} | | | | |")
PY
  return $rc
}
export -f trainer_variant limit
export DEST DRY SCALE
{
  echo "Absolute numbers are this machine's. MFU against the peak the trainer assumes for this GPU."
  echo
  echo "| kernels | outcome | iteration | tokens/s | MFU | ms/iteration |"
  echo "|---|---|---|---|---|---|"
} >"$DEST/trainer.md.head"
step trainer "1. The trainer: $([ "$DRY" = 1 ] && echo configs/tiny.toml on CPU || echo configs/gpt_1b.toml), tokens/s and MFU" \
  "$(( 3 * $(limit 150) + 30 ))" \
  'cp "$DEST/trainer.md.head" "$DEST/trainer.md"; f=0; for v in torch triton compile; do trainer_variant $v || { f=1; echo "kernels=$v failed: see train_$v.log"; }; done; exit $f'

# -- 1b. what torch.compile writes: inductor's Triton for RMSNorm (forward and backward) --------
# On the GPU a real compile at 4096 x 4096 bf16; in the dry run the same code generator's Triton
# for the CPU, taken before it would be compiled (appendix C.6's inductor_triton_source).
step inductor "1b. torch.compile: inductor's Triton kernels for RMSNorm (beside appendix C.1's)" \
  "$(limit 60)" \
  "python3 -c 'import sys; from tinytron.kernels.inductor import write_triton_report as w; print(w(sys.argv[1], sys.argv[2]), \"kernels\")' '$DEST/inductor.md' $DEVICE"

# -- 2. appendix C's kernels ------------------------------------------------------------------
summarize_kernels() {  # the ratios of benchmarks/bench_kernels.py's JSON, as a table
  python3 - "$DEST/kernels.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
words = ("fraction", "ratio", "_vs_", "_over_", "tflops", "gap", "peak", "bandwidth")
def flat(d, pre=""):  # one level of nesting: {"triton": {"fraction_of_peak": {...}}} too
    for k, x in d.items():
        if isinstance(x, dict):
            yield from flat(x, f"{pre}{k}.")
        else:
            yield f"{pre}{k}", x
print("| kernel | ratios and figures (absolute ones: this GPU) |\n|---|---|")
for name, v in r.items():
    if isinstance(v, dict):
        keys = [(k, x) for k, x in flat(v) if any(w in k for w in words)
                and isinstance(x, (int, float, str))][:10]
        if keys:
            print(f"| {name} | " + ", ".join(f"{k} {x:.3g}" if isinstance(x, float) else
                                             f"{k} {x}" for k, x in keys) + " |")
PY
}
export -f summarize_kernels
KARGS="--device $DEVICE --budget-s $(limit 60) --out $DEST/kernels.json"
[ "$DRY" = 1 ] && KARGS="$KARGS --reps 1"
step kernels "2. Kernels: bandwidth / HBM peak, flash attention / SDPA flash" "$(limit 90)" \
  "python3 benchmarks/bench_kernels.py $KARGS && summarize_kernels >'$DEST/kernels.md'"

# -- 3. the memory meter on CUDA --------------------------------------------------------------
step memory "3. Memory meter (CUDA path) against the ledger and torch.cuda.max_memory_allocated" \
  "$(limit 60)" \
  "python3 -m pytest -q -p no:cacheprovider -rs tests/test_memory_measured.py -k cuda_allocator \
   && grep -E 'passed|skipped' '$DEST/memory.log' | tail -n 3 >'$DEST/memory.md'"

# -- 4. recompute, staged checkpoint copy, full-iteration CUDA graph --------------------------
RARGS="--device $DEVICE --rounds 2 --steps 2"
[ "$DRY" = 1 ] && RARGS="--device cpu --rounds 1 --steps 1"
step recompute "4a. Selective and full recompute overhead" "$(limit 60)" \
  "python3 benchmarks/bench_recompute.py $RARGS --out '$DEST/recompute.json' 2>&1 | tail -n 12 \
   | sed 's/^/    /' >'$DEST/recompute.md'; exit \${PIPESTATUS[0]}"
if [ "$DRY" = 1 ]; then  # a 1.2 GB checkpoint is no dry run: the script's own checks only
  STAGING="python3 benchmarks/bench_checkpoint_staging.py --help >/dev/null && echo '    dry run: --help only' >'$DEST/staging.md'"
else
  STAGING="python3 benchmarks/bench_checkpoint_staging.py --repeats 1 --dir '$DEST/ckpt_tmp' \
   2>&1 | tail -n 8 | sed 's/^/    /' >'$DEST/staging.md'; s=\${PIPESTATUS[0]}; rm -rf '$DEST/ckpt_tmp'; exit \$s"
fi
step staging "4b. Staged checkpoint copy: blocking time" "$(limit 60)" "$STAGING"
step cudagraph "4c. Full-iteration CUDA graph: speed-up" "$(limit 60)" \
  "python3 -m pytest -q -p no:cacheprovider -rs tests/test_reliability_gpu.py \
   && grep -E 'passed|skipped|failed' '$DEST/cudagraph.log' | tail -n 3 >'$DEST/cudagraph.md'"

# -- 4d. the step-time model against a traced 2-GPU run ---------------------------------------
# Chapter 07.8's model fed with this machine's micro-batch time (CUDA events) and NCCL's
# all-reduce / send-recv bandwidth, against tinytron.train traced on 2 GPUs (DP2 and PP2). With
# fewer than 2 GPUs the script says so in one line and exits 0; the dry run takes the CPU path
# (gloo) with 3 iterations, the fewest it times (iterations 3..N).
if [ "$DRY" = 1 ]; then STARGS="--device cpu --iters 3"; STLIM=400
else STARGS="--device cuda --iters 16"; STLIM=240; fi
step step_time "4d. Step-time model against a traced 2-GPU run" "$(limit $STLIM)" \
  "python3 benchmarks/bench_step_time.py $STARGS --out '$DEST/step_time.json' \
   --summary '$DEST/step_time.md'"

# -- 5. the GPU tests, last -------------------------------------------------------------------
if [ "$DRY" = 1 ]; then PYARGS="--collect-only -q"; else PYARGS="-q"; fi
step pytest_gpu "5. pytest -m gpu" "$(limit 150)" \
  "python3 -m pytest -m gpu $PYARGS -p no:cacheprovider tests \
   && tail -n 1 '$DEST/pytest_gpu.log' >'$DEST/pytest_gpu.md'"

echo "[gpu_check] report: $REPORT"
cat "$REPORT"
