#!/bin/bash
# A real one-node SLURM on this machine, to run scripts/slurm/cpu_1node.sbatch (and the
# test that submits it, tests/test_slurm.py) without a cluster. Needs root and Debian's
# slurm-wlm + munge (`apt-get install -y slurm-wlm munge`). docs/multi-host.md says more.
#
#   scripts/slurm/one_node_cluster.sh start     # munged, slurmctld, slurmd; waits for idle
#   scripts/slurm/one_node_cluster.sh stop      # stops the daemons it started
#
# State, spool, logs and pid files live in ${JAXDIST_SLURM_DIR:-/tmp/jaxdist-slurm}.
set -euo pipefail
DIR=${JAXDIST_SLURM_DIR:-/tmp/jaxdist-slurm}
CONF=/etc/slurm/slurm.conf

stop() {
  for pid in "${DIR}"/slurmd.pid "${DIR}"/slurmctld.pid; do
    [ -f "${pid}" ] && kill "$(cat "${pid}")" 2>/dev/null || true
  done
  # munged only if this script started it (a munged that was already running stays)
  if [ -f "${DIR}/started-munged" ]; then
    su -s /bin/sh munge -c "/usr/sbin/munged --stop" 2>/dev/null || true
    rm -f "${DIR}/started-munged"
  fi
}

start() {
  command -v slurmctld >/dev/null && command -v munged >/dev/null || {
    echo "one_node_cluster: slurm-wlm and munge are not installed (apt-get install -y slurm-wlm munge)" >&2
    exit 2; }
  [ "$(id -u)" = 0 ] || { echo "one_node_cluster: needs root (slurmd, munge's key)" >&2; exit 2; }
  mkdir -p "${DIR}/state" "${DIR}/spool" /etc/slurm /run/munge
  if [ ! -s /etc/munge/munge.key ]; then
    dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 status=none
  fi
  chown munge:munge /etc/munge/munge.key /run/munge && chmod 0400 /etc/munge/munge.key
  if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
    su -s /bin/sh munge -c "/usr/sbin/munged"
    touch "${DIR}/started-munged"
  fi
  munge -n | unmunge >/dev/null
  host=$(hostname -s)
  node=$(slurmd -C | head -n 1)  # NodeName=<host> CPUs=... RealMemory=... as slurmd sees it
  cat > "${CONF}" <<EOF
ClusterName=jaxdist
SlurmctldHost=${host}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
StateSaveLocation=${DIR}/state
SlurmdSpoolDir=${DIR}/spool
SlurmctldPidFile=${DIR}/slurmctld.pid
SlurmdPidFile=${DIR}/slurmd.pid
SlurmctldLogFile=${DIR}/slurmctld.log
SlurmdLogFile=${DIR}/slurmd.log
${node}
PartitionName=debug Nodes=ALL Default=YES State=UP OverSubscribe=FORCE:4
EOF
  slurmctld
  slurmd
  for _ in $(seq 1 30); do
    if sinfo -h -o %T 2>/dev/null | grep -qx idle; then sinfo; return 0; fi
    sleep 1
  done
  echo "one_node_cluster: the node did not become idle in 30 s (logs in ${DIR})" >&2
  exit 1
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  *) echo "usage: $0 start|stop" >&2; exit 2 ;;
esac
