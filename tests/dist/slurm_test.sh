#!/usr/bin/env bash
# `stoke train` under Slurm, on a private one-node cluster this script starts (its own munged,
# slurmctld and slurmd, configured in a scratch directory, stopped at exit): srun with PMIx gives
# the same training as mpirun; srun without a process-management interface fails at once saying
# what to add; one task runs as a world of one; a batch job (sbatch) and mpirun inside an
# allocation (salloc) work; a rank killed with SIGKILL ends the step within 30 s.
# Skips (exit 77) when Slurm's daemons are not installed or cannot start here (they need root).
# Usage: slurm_test.sh path/to/stoke path/to/mpiexec
set -u
stoke=$(realpath "$1")
mpiexec=$2
source "$(dirname "$0")/../tools/cli_lib.sh"
source "$(dirname "$0")/dist_lib.sh"
for tool in munged slurmctld slurmd srun sbatch salloc scontrol; do
  command -v "$tool" >/dev/null || [[ -x /usr/sbin/$tool ]] || skip "Slurm is not installed ($tool missing; scripts/install-deps installs it)"
done
[[ $(id -u) -eq 0 ]] || skip "slurmd must run as root to start tasks"
export PATH=$PATH:/usr/sbin

# ---- a private cluster: one node (this machine), one partition, munge on its own socket
cluster="$work/cluster"
mkdir -p "$cluster"/{state,spool,log}
chmod 700 "$cluster"
head -c 1024 /dev/urandom >"$cluster/munge.key"
chmod 600 "$cluster/munge.key"
munged --force --socket="$cluster/munge.socket" --key-file="$cluster/munge.key" --pid-file="$cluster/munged.pid" \
  --log-file="$cluster/munged.log" --seed-file="$cluster/munge.seed" || skip "munged did not start"
base=$((20000 + $$ % 20000))
node=$(hostname -s)
cat >"$cluster/slurm.conf" <<CONF
ClusterName=stoketest
SlurmctldHost=$node(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$cluster/munge.socket
CredType=cred/munge
StateSaveLocation=$cluster/state
SlurmdSpoolDir=$cluster/spool
SlurmctldPidFile=$cluster/slurmctld.pid
SlurmdPidFile=$cluster/slurmd.pid
SlurmctldLogFile=$cluster/log/slurmctld.log
SlurmdLogFile=$cluster/log/slurmd.log
SlurmctldPort=$base
SlurmdPort=$((base + 1))
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
NodeName=$node NodeAddr=127.0.0.1 CPUs=$(nproc) State=UNKNOWN
PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
CONF
export SLURM_CONF="$cluster/slurm.conf"
stop_cluster() {
  for d in slurmd slurmctld munged; do
    [[ -f $cluster/$d.pid ]] && kill "$(cat "$cluster/$d.pid")" 2>/dev/null
  done
  sleep 0.5
  rm -rf "$work"
}
trap stop_cluster EXIT
slurmctld -i -f "$SLURM_CONF" || skip "slurmctld did not start: $(tail -3 "$cluster/log/slurmctld.log")"
slurmd -f "$SLURM_CONF" || skip "slurmd did not start: $(tail -3 "$cluster/log/slurmd.log")"
for _ in $(seq 1 100); do
  sinfo -h -o %t 2>/dev/null | grep -qE '^idle' && break
  sleep 0.2
done
sinfo -h -o %t | grep -qE '^idle' || skip "the node did not come up: $(sinfo 2>&1; tail -3 "$cluster/log/slurmd.log")"
echo "a one-node Slurm ($(srun --version)) on $node"
if ! srun --mpi=list 2>&1 | grep -q pmix; then skip "this Slurm has no PMIx plugin"; fi

# ---- the data and a small 2-rank run (with batch norm, the ranks' models compared every 4 steps)
make_dataset
dist_batchnorm=1
dist_keys=", check_every_steps: 4"
config srun 2
check srun_pmix_two_ranks 0 "data-parallel: 2 ranks" -- timeout 300 srun -n 2 --mpi=pmix "$stoke" train --config "$work/srun.yaml" -q
config mpirun 2
check mpirun_two_ranks 0 "data-parallel: 2 ranks" -- \
  timeout 300 "$mpiexec" --oversubscribe --allow-run-as-root --bind-to none -np 2 "$stoke" train --config "$work/mpirun.yaml" -q
same_figures srun_trains_what_mpirun_trains srun mpirun

config nopmi 1
check srun_without_pmi_says_what_to_add 1 "srun --mpi=pmix" -- timeout 60 srun -n 2 "$stoke" train --config "$work/nopmi.yaml" -q
config single 1
check srun_one_task_trains 0 "backend cpu: steps 0 -> 8" -- timeout 300 srun -n 1 "$stoke" train --config "$work/single.yaml"
check srun_one_task_is_a_world_of_one 0 '"world":1' -- head -1 "$work/single/metrics.jsonl"

# A batch job, as users submit them: sbatch --wait returns the job's exit code.
config batch 1
cat >"$work/job.sh" <<JOB
#!/bin/bash
#SBATCH --ntasks=2
#SBATCH --output=$work/job.out
srun --mpi=pmix "$stoke" train --config "$work/batch.yaml" -q
JOB
check sbatch_job 0 "Submitted batch job" -- timeout 300 sbatch --wait "$work/job.sh"
check sbatch_job_trained_on_two_ranks 0 "data-parallel: 2 ranks" -- cat "$work/job.out"

# mpirun inside an allocation: Open MPI starts its daemons through Slurm.
config salloc 1
check mpirun_inside_salloc 0 "data-parallel: 2 ranks" -- \
  timeout 300 salloc -n 2 "$mpiexec" --allow-run-as-root --bind-to none "$stoke" train --config "$work/salloc.yaml" -q

# SIGKILL one task mid-training: the job ends, non-zero, within 30 s.
task1() { rank_with_env "$1" SLURM_PROCID=1; }
start_long long task1 srun -n 2 --mpi=pmix
kill_expect_end srun_kill_one_rank long "task 1"
finish
