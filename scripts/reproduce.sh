#!/usr/bin/env bash
# Reproduce the paper's comparison (arXiv 2509.19128, Figs. 3, 5, 6, 7) at small scale on the embedded
# default (tiny model, arithmetic task), on the same 2 CPU cores for every setting, then plot it.
#
#   bash scripts/reproduce.sh [--task longtail] [--quick] [--dry-run] [--force] [--run-s S] [--steps N]
#                             [--seeds "0 1"] [--runs "NAME:SEED ..."] [--root RUNS_DIR] [--out FIGURES_DIR]
#                             [--target R]
#
# --task longtail: the same comparison on the long-tailed task (configs/longtail.yaml: a few completions
# many times longer than most, the workload the paper is about), with conventional RL tuned over
# G_steps 2, 4, 8, 16 x actor.max_inflight 64, 256 and the whole RL step's batch at once (B*G_steps);
# runs under runs/repro-longtail, figures in runs/repro-longtail/figures, 900 s a run by default (~4.5 h in all:
# finished runs are kept, so the matrix can be built over several sittings).
#
# The matrix (same trainer.batch_size B and trainer.lr, same seeds, one run at a time):
#   pipeline-H256              PipelineRL at the default (actor.max_inflight=256): engine on core 0, trainer core 1
#   pipeline-H64               PipelineRL at H=64 (the trade-off of Fig. 3b), first seed only
#   conventional-G{2,4,8}-H{64,256}
#                              conventional RL (configs/conventional.yaml): G_steps optimizer steps per RL step,
#                              actor.max_lag=G-1, actor.max_inflight=H; generation and training take turns, so
#                              each gets both cores: actor.cpu_cores=0-1 trainer.cpu_cores=0-1
# Pass 1 runs every setting at the first seed of --seeds (default "0 1 2"). The conventional setting that
# reached pass 1's common target first is "best conventional" (scripts/plot.py --best-conventional); pass 2
# runs it and pipeline-H256 at the other seeds. The tuning runs are one seed each: they choose, the two
# main settings are compared.
#
# Budget: every run gets the same wall-clock budget (--run-s, default 300 s including the ~40 s start-up of
# vLLM and the trainer), so the curves of Fig. 5a cover the same time; trainer.max_steps (--steps, default
# 1000) is only a cap. 8 + 4 runs x ~5 min ~= 62 min on 2 cores. --quick: PipelineRL H=256 and conventional
# G=4 H=256, seed 0, 90 s each (~4 min).
#
# --runs "NAME:SEED ...": only these settings of the task's matrix at these seeds, in this order, no passes
# (e.g. longer runs of the two main settings, built up over sittings:
#   bash scripts/reproduce.sh --task longtail --root runs/lt-2400 --run-s 2400 --steps 100000 \
#       --out docs/figures/longtail-2400 --target 0.459 --runs "pipeline-default:0 conventional-G8-H1024:0").
#
# A run that ends well (its budget or max_steps, with optimizer steps logged) gets a DONE file. A run
# directory with DONE is kept (skipped, and plotted with the others) unless --force, which deletes it first;
# one without DONE (a run interrupted or failed; or one made before DONE files: `touch DIR/DONE` keeps it)
# is deleted and run again. Runs go to --root/<name>-s<seed> (default runs/repro; --quick:
# runs/repro-quick); figures and summary.md to --out (default <root>/figures: the committed docs/figures are
# replaced only when asked, --out docs/figures);
# --target R: the figures' target test reward (default: the best every run reached).
# --dry-run prints the run.sh commands, and "# kept: DIR" for the runs kept, and exits (pass 2 as
# "best conventional" placeholders).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PY:-.venv/bin/python}"; [[ -x "$PY" ]] || PY=python3

QUICK=0; DRY=0; FORCE=0; RUN_S=""; STEPS=""; SEEDS=""; OUT=""; ROOT=""; TASK=arithmetic; RUNS=""; TARGET=()
while (( $# )); do
  case $1 in
    --task) TASK=$2; shift ;;
    --quick) QUICK=1 ;;
    --dry-run) DRY=1 ;;
    --force) FORCE=1 ;;
    --run-s) RUN_S=$2; shift ;;
    --steps) STEPS=$2; shift ;;
    --seeds) SEEDS=$2; shift ;;
    --runs) RUNS=$2; shift ;;
    --target) TARGET=(--target "$2"); shift ;;
    --out) OUT=$2; shift ;;
    --root) ROOT=$2; shift ;;
    -h|--help) sed -n '2,44p' "$0"; exit 0 ;;
    *) echo "reproduce.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done

# the paper's B and lr are 1024 and 1e-6 on Qwen2.5-7B; these are the tiny model's
# (docs/DESIGN.md, "The tiny model's learning rate")
B=128; LR=1.0e-4
COMMON=("trainer.batch_size=$B" "trainer.lr=$LR" "trainer.checkpoint_every=0")
CONV=("configs/conventional.yaml" "actor.cpu_cores=0-1" "trainer.cpu_cores=0-1")
TASK_ARGS=()  # first on every command line: a setting's own overrides win over the task's overlay
if [[ "$TASK" == longtail ]]; then
  ROOT="${ROOT:-runs/repro-longtail}"; FIG="${OUT:-$ROOT/figures}"
  RUN_S="${RUN_S:-900}"; STEPS="${STEPS:-3000}"; SEEDS="${SEEDS:-0 1 2}"
  TASK_ARGS=("configs/longtail.yaml")
  COMMON+=("actor.eval_every=16")
  PIPE="pipeline-default|"
  # The strongest conventional candidates first (the throughput model favours a whole RL step's batch
  # at once and G around 8), so that a matrix stopped part-way already holds them.
  TUNE=()
  for GH in 8:1024 4:512 16:2048 2:256 8:256 4:256 16:256 2:64 4:64 8:64 16:64; do
    G=${GH%:*}; H=${GH#*:}   # H = B*G: the whole RL step's batch at once (G=2: that is 256)
    TUNE+=("conventional-G$G-H$H|${CONV[*]} actor.G_steps=$G actor.max_lag=$((G - 1)) actor.max_inflight=$H")
  done
elif [[ "$TASK" != arithmetic ]]; then
  echo "reproduce.sh: --task arithmetic|longtail, not $TASK" >&2; exit 2
elif (( QUICK )); then
  ROOT="${ROOT:-runs/repro-quick}"; FIG="${OUT:-$ROOT/figures}"
  RUN_S="${RUN_S:-90}"; STEPS="${STEPS:-1000}"; SEEDS="${SEEDS:-0}"
  COMMON+=("actor.eval_every=4" "data.test_size=100")   # a few evaluations within ~50 s of training
  PIPE="pipeline-H256|actor.max_inflight=256"
  TUNE=("conventional-G4-H256|${CONV[*]} actor.G_steps=4 actor.max_lag=3 actor.max_inflight=256")
else
  ROOT="${ROOT:-runs/repro}"; FIG="${OUT:-$ROOT/figures}"
  RUN_S="${RUN_S:-300}"; STEPS="${STEPS:-1000}"; SEEDS="${SEEDS:-0 1 2}"
  COMMON+=("actor.eval_every=16")   # a multiple of every G: conventional runs evaluate at the same versions
  PIPE="pipeline-H256|actor.max_inflight=256"
  TUNE=("pipeline-H64|actor.max_inflight=64")
  for G in 2 4 8; do for H in 64 256; do
    TUNE+=("conventional-G$G-H$H|${CONV[*]} actor.G_steps=$G actor.max_lag=$((G - 1)) actor.max_inflight=$H")
  done; done
fi
read -r -a SEED_LIST <<< "$SEEDS"

command_for() {  # name|overrides|seed -> the run.sh arguments, one per line
  local name overrides seed
  IFS='|' read -r name overrides seed <<< "$1"
  local args=()
  read -r -a args <<< "$overrides"
  printf '%s\n' "${TASK_ARGS[@]}" "${args[@]}" "${COMMON[@]}" "run.seed=$seed" "trainer.max_steps=$STEPS" "run.dir=$ROOT/$name-s$seed"
}

# --runs: each NAME:SEED as name|overrides|seed, from the task's matrix
SELECTED=(); names=""
for s in "$PIPE" "${TUNE[@]}"; do names+="${names:+, }${s%%|*}"; done
for item in $RUNS; do
  name=${item%:*}; seed=${item##*:}; found=""
  for s in "$PIPE" "${TUNE[@]}"; do
    if [[ "${s%%|*}" == "$name" ]]; then found=$s; fi
  done
  if [[ "$item" != *:* || ! "$seed" =~ ^[0-9]+$ ]]; then
    echo "reproduce.sh: --runs takes NAME:SEED items, not '$item'" >&2; exit 2
  fi
  if [[ -z "$found" ]]; then
    echo "reproduce.sh: --runs: no setting '$name' in the $TASK matrix ($names)" >&2; exit 2
  fi
  SELECTED+=("$found|$seed")
done

is_kept() { [[ -f "$1/DONE" ]] && (( ! FORCE )); }   # run directory

if (( DRY )); then
  show() {  # name|overrides|seed -> its run.sh command, or "# kept: DIR"
    local args
    mapfile -t args < <(command_for "$1")
    local dir="${args[-1]#run.dir=}"
    if is_kept "$dir"; then echo "# kept: $dir"; else echo "bash run.sh ${args[*]}"; fi
  }
  if (( ${#SELECTED[@]} )); then
    echo "# ${#SELECTED[@]} runs, one at a time, each stopped after ${RUN_S} s (timeout -s TERM) or trainer.max_steps"
    for r in "${SELECTED[@]}"; do show "$r"; done
  else
    echo "# pass 1: $((1 + ${#TUNE[@]})) runs, one at a time, each stopped after ${RUN_S} s (timeout -s TERM) or trainer.max_steps"
    for s in "$PIPE" "${TUNE[@]}"; do show "$s|${SEED_LIST[0]}"; done
    for seed in "${SEED_LIST[@]:1}"; do
      echo "# pass 2, seed $seed: ${PIPE%%|*} and the best conventional setting of pass 1"
      show "$PIPE|$seed"
    done
  fi
  echo "# then: $PY scripts/plot.py $ROOT/*/ --out $FIG ${TARGET[*]}"
  exit 0
fi

mkdir -p "$ROOT"
failed=(); t_all=$SECONDS; TPID=""
# Ctrl-C / TERM: stop the current run (run.sh stops its roles on TERM), then exit. The run is waited on in
# the background because bash runs traps only between commands.
on_signal() {
  echo "[reproduce] interrupted: stopping the current run"
  [[ -n "$TPID" ]] && kill -TERM "$TPID" 2>/dev/null
  wait; exit 130
}
trap on_signal INT TERM
run_one() {  # name|overrides|seed
  local r=$1 dir rc args
  mapfile -t args < <(command_for "$r")
  dir="${args[-1]#run.dir=}"
  if is_kept "$dir"; then echo "[reproduce] $dir is done: kept (--force to redo)"; return; fi
  if [[ -e "$dir" ]]; then
    [[ -f "$dir/DONE" ]] || echo "[reproduce] $dir has no DONE file (the run was interrupted or failed): run again"
    rm -rf -- "$dir"
  fi
  echo "[reproduce] $(date +%H:%M:%S) bash run.sh ${args[*]}   (budget ${RUN_S} s)"
  mkdir -p "$dir"
  # run.sh stops every role on SIGTERM; rc 124 = the wall-clock budget ended the run (the normal case).
  timeout --signal=TERM --kill-after=60 "$RUN_S" bash run.sh "${args[@]}" > "$dir/reproduce.log" 2>&1 &
  TPID=$!
  rc=0; wait "$TPID" || rc=$?
  TPID=""
  if [[ ($rc == 0 || $rc == 124) && -s "$dir/metrics_trainer.jsonl" ]]; then
    { grep '^step ' "$dir/reproduce.log" || true; } | tail -n 1 | sed 's/^/[reproduce]   last: /'
    touch "$dir/DONE"
  else
    echo "[reproduce] FAILED (rc $rc; with rc 0 or 124: no optimizer step logged): $dir; last lines of" \
         "$dir/reproduce.log:" >&2
    tail -n 15 "$dir/reproduce.log" >&2 || true
    failed+=("$dir")
  fi
  sleep "${REPRO_GAP_S:-2}"   # let the ports of the stopped roles close before the next run binds them
}

# --runs: those runs only. Otherwise pass 1: every setting at the first seed; pass 2: the two main
# settings at the other seeds.
if (( ${#SELECTED[@]} )); then
  for r in "${SELECTED[@]}"; do run_one "$r"; done
else
  for s in "$PIPE" "${TUNE[@]}"; do run_one "$s|${SEED_LIST[0]}"; done
fi
if (( ${#SELECTED[@]} == 0 && ${#SEED_LIST[@]} > 1 )); then
  best=$("$PY" scripts/plot.py "$ROOT"/*-s"${SEED_LIST[0]}"/ --best-conventional) || best=""
  echo "[reproduce] best conventional setting at seed ${SEED_LIST[0]}: ${best:-none reached the target}"
  for seed in "${SEED_LIST[@]:1}"; do
    run_one "$PIPE|$seed"
    for s in "${TUNE[@]}"; do if [[ "${s%%|*}" == "$best" ]]; then run_one "$s|$seed"; fi; done
  done
fi
echo "[reproduce] all runs done in $(( (SECONDS - t_all) / 60 )) min; plotting"
"$PY" scripts/plot.py "$ROOT"/*/ --out "$FIG" "${TARGET[@]}"
if (( ${#failed[@]} )); then echo "[reproduce] failed runs: ${failed[*]}" >&2; exit 1; fi
