#!/usr/bin/env bash
# One node's part of scripts/slurm.sbatch (srun starts it once per node): SLURM's variables -> run.sh's.
#   NNODES = SLURM_NNODES, NODE_RANK = SLURM_NODEID (else SLURM_PROCID: one task per node), and MASTER_ADDR
#   as given, else the first host of SLURM_JOB_NODELIST. SLURM's values win over NNODES/NODE_RANK inherited
#   from the submitting shell (those would be the same on every node).
set -euo pipefail
: "${SLURM_NNODES:?not under SLURM: start it with srun (scripts/slurm.sbatch), or use run.sh with NNODES/NODE_RANK/MASTER_ADDR}"
export NNODES="$SLURM_NNODES" NODE_RANK="${SLURM_NODEID:-$SLURM_PROCID}"
export MASTER_ADDR="${MASTER_ADDR:-$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)}"
exec bash "$(dirname "$0")/../run.sh" "$@"
