#!/usr/bin/env bash
# `mpirun -H` over two machines, emulated on this one: a second network namespace with its own
# hostname, reached over a veth pair, where mpirun starts its daemon through a launch agent (in
# place of ssh). The ranks share no loopback and no shared memory: they talk over TCP between two
# addresses, as two hosts do. Checks: the 2-machine run trains exactly what a 1-machine 2-rank run
# trains (every logged figure), stoke reports the two machines, and SIGKILL of the remote rank ends
# the job within 30 s. Skips (exit 77) without root or network namespaces.
# Usage: multihost_test.sh path/to/stoke path/to/mpiexec
set -u
stoke=$(realpath "$1")
mpiexec=$2
source "$(dirname "$0")/../tools/cli_lib.sh"
source "$(dirname "$0")/dist_lib.sh"
[[ $(id -u) -eq 0 ]] || skip "network namespaces need root"
command -v ip >/dev/null || skip "iproute2 (ip) is not installed"
ns="stoke-peer-$$"
subnet="10.$((100 + $$ % 100)).$(($$ / 100 % 250)).0"
here=${subnet%.0}.1
peer=${subnet%.0}.2
veth="stk$$"
cleanup() {
  ip link del "${veth}a" 2>/dev/null
  ip netns del "$ns" 2>/dev/null
  rm -rf "$work"
}
trap cleanup EXIT
ip netns add "$ns" 2>/dev/null || skip "cannot create a network namespace here"
ip link add "${veth}a" type veth peer name "${veth}b" || skip "cannot create a veth pair here"
ip link set "${veth}b" netns "$ns"
ip addr add "$here/24" dev "${veth}a"
ip link set "${veth}a" up
ip netns exec "$ns" ip addr add "$peer/24" dev "${veth}b"
ip netns exec "$ns" ip link set "${veth}b" up
ip netns exec "$ns" ip link set lo up

# mpirun's launch agent: `agent HOST COMMAND...`, run in the peer's namespaces under its own hostname.
cat >"$work/agent" <<AGENT
#!/bin/bash
shift
exec ip netns exec $ns unshare --uts bash -c "hostname peer-machine; \$*"
AGENT
chmod +x "$work/agent"
mpi=("$mpiexec" --allow-run-as-root --oversubscribe --bind-to none)
two_hosts=("${mpi[@]}" --mca plm_rsh_agent "$work/agent" --mca btl tcp,self --mca btl_tcp_if_include "$subnet/24"
  --mca oob_tcp_if_include "$subnet/24" -H "$here:1,$peer:1" -np 2)

make_dataset
dist_batchnorm=1
dist_keys=", check_every_steps: 4"

config apart 2
check two_machines_train 0 "data-parallel: 2 ranks \(.* x1, peer-machine x1\)" -- \
  timeout 300 "${two_hosts[@]}" "$stoke" train --config "$work/apart.yaml" -q
check two_machines_logged 0 '"machines":\{.*"peer-machine":1' -- head -1 "$work/apart/metrics.jsonl"
config together 2
check one_machine_trains 0 "data-parallel: 2 ranks \(.* x2\)" -- \
  timeout 300 "${mpi[@]}" -np 2 "$stoke" train --config "$work/together.yaml" -q
same_figures two_machines_train_what_one_trains apart together

# SIGKILL the rank on the other machine mid-training: the job ends, non-zero, within 30 s.
remote_rank() {
  for pid in $(ip netns pids "$ns" 2>/dev/null); do
    [[ $(cat "/proc/$pid/comm" 2>/dev/null) == stoke ]] && echo "$pid" && return
  done
}
start_long long remote_rank "${two_hosts[@]}"
kill_expect_end kill_the_remote_rank long "the remote rank"
finish
