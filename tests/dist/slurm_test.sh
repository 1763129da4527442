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

# ---- a private cluster: one node (this machine), one partition, munge on its own socket.
# Every wait here is bounded by the clock: a Slurm client retries an unreachable controller for
# about 10 s per call, so a loop of plain `sinfo` calls could outlast ctest's timeout in silence.
cluster="$work/cluster"
node=$(hostname -s)
export SLURM_CONF="$cluster/slurm.conf"

# A TCP port nothing listens on, in 10000-29999 (below Linux's ephemeral range).
free_port() {
  local p
  for _ in $(seq 1 50); do
    p=$((10000 + RANDOM % 20000))
    ss -Htln "sport = :$p" 2>/dev/null | grep -q . || ss -Htln "sport = :$((p + 1))" 2>/dev/null | grep -q . ||
      { echo "$p"; return; }
  done
  echo $((10000 + RANDOM % 20000))
}
daemon_alive() { [[ -s $cluster/$1.pid ]] && kill -0 "$(cat "$cluster/$1.pid")" 2>/dev/null; }
# A daemon that wrote its pid file and is gone (a daemonized one writes the file a moment after
# its start command returns).
daemon_died() { [[ -s $cluster/$1.pid ]] && ! kill -0 "$(cat "$cluster/$1.pid")" 2>/dev/null; }
# stop_daemons PATTERN: TERM the daemons whose command line matches, KILL what is left after 5 s
# (by command line, not pid file: a daemon just started may not have written its file yet).
stop_daemons() {
  pkill -f -- "$1" 2>/dev/null
  for _ in $(seq 1 50); do
    pgrep -f -- "$1" >/dev/null || return 0
    sleep 0.1
  done
  pkill -9 -f -- "$1" 2>/dev/null
  return 0
}
# What Slurm knows now: printed under a failed check and when the test runs out of time.
diagnose() {
  echo "-- slurm state:"
  for d in slurmctld slurmd; do daemon_alive "$d" && echo "$d running" || echo "$d NOT running"; done
  timeout 10 sinfo -N -l 2>&1 | tail -5
  timeout 10 squeue -a -o '%i %j %T %r %M' 2>&1 | tail -10
  timeout 10 scontrol show node "$node" 2>&1 | grep -E 'State=|Reason=' | sed 's/^ *//'
  for f in slurmctld slurmd; do
    echo "-- tail of $f.log:"
    tail -8 "$cluster/log/$f.log" 2>/dev/null
  done
}

# start_cluster: a fresh configuration on fresh ports, both daemons started, and the node idle
# within 30 s; on failure, why is in $cluster_error.
start_cluster() {
  stop_daemons "slurm(ctld|d) .*-f $SLURM_CONF"
  rm -rf "$cluster"/{state,spool,log,tmp} "$cluster"/slurm{ctld,d}.pid
  mkdir -p "$cluster"/{state,spool,log,tmp}
  local base
  base=$(free_port)
  # TmpFS: srun's PMIx plugin makes a directory per step named by job id, and job ids start at 1
  # in every private cluster; in the shared /tmp, one left by an earlier run fails the launch.
  cat >"$SLURM_CONF" <<CONF
ClusterName=stoketest
SlurmctldHost=$node(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$cluster/munge.socket
CredType=cred/munge
StateSaveLocation=$cluster/state
SlurmdSpoolDir=$cluster/spool
TmpFS=$cluster/tmp
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
  cluster_error=""
  if ! timeout 30 slurmctld -i -f "$SLURM_CONF"; then
    cluster_error="slurmctld did not start: $(tail -3 "$cluster/log/slurmctld.log" 2>/dev/null)"
    return 1
  fi
  if ! timeout 30 slurmd -f "$SLURM_CONF"; then
    cluster_error="slurmd did not start: $(tail -3 "$cluster/log/slurmd.log" 2>/dev/null)"
    return 1
  fi
  local deadline=$((SECONDS + 30))
  while ((SECONDS < deadline)); do
    for d in slurmctld slurmd; do
      if daemon_died "$d"; then
        cluster_error="$d (ports $base, $((base + 1))) exited: $(tail -3 "$cluster/log/$d.log" 2>/dev/null)"
        return 1
      fi
    done
    timeout 5 sinfo -h -o %t 2>/dev/null | grep -qE '^idle' && return 0
    sleep 0.3
  done
  cluster_error="the node did not come up within 30 s (ports $base, $((base + 1))): $(diagnose 2>&1 | tr '\n' ' ')"
  return 1
}
stop_cluster() {
  if [[ -n ${watchdog:-} ]]; then
    local sleeper
    sleeper=$(pgrep -P "$watchdog")
    kill "$watchdog" 2>/dev/null  # first: its sleep's end must not let it go on
    [[ -n $sleeper ]] && kill $sleeper 2>/dev/null
  fi
  stop_daemons "slurm(ctld|d) .*-f $SLURM_CONF"
  stop_daemons "munged .*--socket=$cluster/munge.socket"
  # A step daemon outlives slurmd when its job was killed under it (the watchdog); it runs in
  # the cluster's log directory.
  local pid
  for pid in $(pgrep -x slurmstepd); do
    [[ $(readlink "/proc/$pid/cwd" 2>/dev/null) == "$cluster"* ]] && kill -9 "$pid" 2>/dev/null
  done
  rm -rf "$work"
}
trap stop_cluster EXIT
mkdir -p "$cluster"
chmod 700 "$cluster"
head -c 1024 /dev/urandom >"$cluster/munge.key"
chmod 600 "$cluster/munge.key"
timeout 30 munged --force --socket="$cluster/munge.socket" --key-file="$cluster/munge.key" --pid-file="$cluster/munged.pid" \
  --log-file="$cluster/munged.log" --seed-file="$cluster/munge.seed" || skip "munged did not start"
started=0
for attempt in 1 2 3; do
  if start_cluster; then
    started=1
    break
  fi
  echo "cluster start, attempt $attempt: $cluster_error"
done
((started)) || skip "the private Slurm cluster did not come up in 3 attempts: $cluster_error"

# The whole test stays inside ctest's 600 s: at 480 s (STOKE_SLURM_TEST_LIMIT_S) the state is
# printed and every job of the test is killed (each step then fails, naming itself), so a hang
# shows where it was.
limit_s=${STOKE_SLURM_TEST_LIMIT_S:-480}
(
  sleep "$limit_s" >/dev/null 2>&1  # holds no pipe of ctest's after the test ends
  echo "FAIL the test ran for $limit_s s; killing its jobs"
  diagnose | sed 's/^/    /'
  while true; do
    pkill -9 -f -- "$work/[a-z]+\.(yaml|sh)" 2>/dev/null
    sleep 1 >/dev/null 2>&1
  done
) &
watchdog=$!
echo "a one-node Slurm ($(srun --version)) on $node"
if ! srun --mpi=list 2>&1 | grep -q pmix; then skip "this Slurm has no PMIx plugin"; fi

# ---- the data and a small 2-rank run (with batch norm, the ranks' models compared every 4 steps)
make_dataset
dist_batchnorm=1
dist_keys=", check_every_steps: 4"
config srun 2
check srun_pmix_two_ranks 0 "data-parallel: 2 ranks" -- timeout 300 srun -I60 -n 2 --mpi=pmix "$stoke" train --config "$work/srun.yaml" -q
config mpirun 2
check mpirun_two_ranks 0 "data-parallel: 2 ranks" -- \
  timeout 300 "$mpiexec" --oversubscribe --allow-run-as-root --bind-to none -np 2 "$stoke" train --config "$work/mpirun.yaml" -q
same_figures srun_trains_what_mpirun_trains srun mpirun

config nopmi 1
check srun_without_pmi_says_what_to_add 1 "srun --mpi=pmix" -- timeout 60 srun -I60 -n 2 "$stoke" train --config "$work/nopmi.yaml" -q
# PMI-2 is an interface, but not one this Open MPI speaks: stoke's message, not MPI_Init's abort.
if srun --mpi=list 2>&1 | grep -q pmi2; then
  check srun_pmi2_says_pmix 1 "PMI-2 .--mpi=pmi2.*speaks PMIx" -- timeout 60 srun -I60 -n 2 --mpi=pmi2 "$stoke" train --config "$work/nopmi.yaml" -q
fi
config single 1
check srun_one_task_trains 0 "backend cpu: steps 0 -> 8" -- timeout 300 srun -I60 -n 1 "$stoke" train --config "$work/single.yaml"
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
  timeout 300 salloc -I60 -n 2 "$mpiexec" --allow-run-as-root --bind-to none "$stoke" train --config "$work/salloc.yaml" -q

# SIGKILL one task mid-training: the job ends, non-zero, within 30 s.
task1() { rank_with_env "$1" SLURM_PROCID=1; }
start_long long task1 srun -I60 -n 2 --mpi=pmix
kill_expect_end srun_kill_one_rank long "task 1"
finish
