#!/bin/bash
# Long runs of the long-tailed task's two headline settings, one at a time, for as many seeds as
# a sitting allows: PipelineRL at its default and conventional RL at G = 8, H = 1024 (the best of
# reproduce.sh --task longtail's matrix). Each run is reproduce.sh's command for that setting,
# stopped by SIGTERM after RUN_S seconds; a finished run (its DONE file) is kept and skipped, so
# the set can be built up over several sittings. Run it alone on the machine.
#
#   bash scripts/longtail_seeds.sh [--dry-run] [--root DIR] [--run-s S] SETTING:SEED ...
#   SETTING: pipeline-default | conventional-G8-H1024
#   e.g. bash scripts/longtail_seeds.sh --run-s 2400 pipeline-default:0 conventional-G8-H1024:0
#
# Runs go to DIR/<setting>-s<seed> (default runs/lt-2400); then
#   .venv/bin/python scripts/plot.py runs/lt-2400/*/ --out docs/figures/longtail-2400 --target 0.459
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=runs/lt-2400; RUN_S=2400; DRY=0; ITEMS=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --dry-run) DRY=1 ;;
    --root) ROOT=$2; shift ;;
    --run-s) RUN_S=$2; shift ;;
    -h|--help) sed -n '2,13p' "$0"; exit 0 ;;
    *:*) ITEMS+=("$1") ;;
    *) echo "longtail_seeds.sh: unknown argument '$1' (SETTING:SEED, --run-s, --root, --dry-run)" >&2; exit 2 ;;
  esac
  shift
done
[[ ${#ITEMS[@]} -gt 0 ]] || { echo "longtail_seeds.sh: no SETTING:SEED given (see --help)" >&2; exit 2; }
COMMON=(trainer.batch_size=128 trainer.lr=1.0e-4 trainer.checkpoint_every=0 actor.eval_every=16
        trainer.max_steps=100000)
for item in "${ITEMS[@]}"; do
  name=${item%%:*}; seed=${item##*:}
  case "$name" in
    pipeline-default) extra=() ;;
    conventional-G8-H1024) extra=(configs/conventional.yaml actor.cpu_cores=0-1 trainer.cpu_cores=0-1
                                  actor.G_steps=8 actor.max_lag=7 actor.max_inflight=1024) ;;
    *) echo "longtail_seeds.sh: unknown setting '$name' (pipeline-default, conventional-G8-H1024)" >&2; exit 2 ;;
  esac
  [[ "$seed" =~ ^[0-9]+$ ]] || { echo "longtail_seeds.sh: seed '$seed' is not a number" >&2; exit 2; }
  dir=$ROOT/$name-s$seed
  cmd=(timeout --signal=TERM --kill-after=60 "$RUN_S" bash run.sh configs/longtail.yaml "${extra[@]}"
       "${COMMON[@]}" "run.seed=$seed" "run.dir=$dir")
  if [[ -f $dir/DONE ]]; then echo "kept: $dir"; continue; fi
  if [[ $DRY == 1 ]]; then echo "${cmd[*]}"; continue; fi
  rm -rf "$dir"; mkdir -p "$ROOT"
  echo "$(date +%T) start $dir ($RUN_S s)"
  rc=0; "${cmd[@]}" > "$ROOT/$name-s$seed.log" 2>&1 || rc=$?
  # 124: stopped by the budget, the expected end; anything else is a failure to look at
  if [[ $rc != 0 && $rc != 124 ]]; then echo "$(date +%T) FAILED: $dir (exit $rc; $ROOT/$name-s$seed.log)" >&2; exit 1; fi
  touch "$dir/DONE"
  echo "$(date +%T) done $dir"
done
