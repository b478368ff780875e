#!/usr/bin/env bash
# Shows the components up.sh started in TRAJ_CLUSTER_DIR: pid, state and resident memory, and the total.
# Exit status 0 when every started component is running, 1 otherwise (or when no cluster is there).
#
# Usage: scripts/cluster/status.sh
set -euo pipefail

# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/lib.sh"

DIR="${TRAJ_CLUSTER_DIR%/}"
if [[ ! -d "${DIR}/pids" ]]; then
	log "no cluster in ${DIR}"
	exit 1
fi

ok=0
total_kib=0
printf '%-24s %8s %8s %10s\n' COMPONENT PID STATE RSS_MiB
for name in etcd kube-apiserver kube-controller-manager kube-scheduler kwok containerd kubelet; do
	f="${DIR}/pids/${name}.pid"
	[[ -f "${f}" ]] || continue
	pid="$(cat "${f}")"
	rss_kib="$(awk '/^VmRSS:/ {print $2}' "/proc/${pid}/status" 2>/dev/null || true)"
	if [[ -n "${rss_kib}" ]]; then
		total_kib=$((total_kib + rss_kib))
		printf '%-24s %8s %8s %10d\n' "${name}" "${pid}" running $((rss_kib / 1024))
	else
		printf '%-24s %8s %8s %10s\n' "${name}" "${pid}" stopped -
		ok=1
	fi
done
printf '%-24s %8s %8s %10d\n' total "" "" $((total_kib / 1024))
if [[ -f "${DIR}/env" ]]; then
	grep -E '^export (KUBECONFIG|TRAJ_CLUSTER_API|TRAJ_CLUSTER_NODES|TRAJ_CLUSTER_REAL_NODE|TRAJ_CLUSTER_NODE_HOST_IP)=' "${DIR}/env" | sed 's/^export /  /'
fi
exit "${ok}"
