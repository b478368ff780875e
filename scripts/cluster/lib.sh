# shellcheck shell=bash
# Shared settings for scripts/cluster/*.sh. Source it; it defines paths and helpers only.

CLUSTER_SCRIPTS_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source-path=SCRIPTDIR source=versions.env
source "${CLUSTER_SCRIPTS_DIR}/versions.env"

TRAJ_CACHE_DIR="${TRAJ_CACHE_DIR:-${HOME}/.cache/trajectory-operator}"
TRAJ_CLUSTER_DIR="${TRAJ_CLUSTER_DIR:-/tmp/trajectory-cluster}"
# Logs of failed runs are copied here (one sub-directory per run).
TRAJ_CLUSTER_LOGS_DIR="${TRAJ_CLUSTER_LOGS_DIR:-${TRAJ_CLUSTER_DIR%/}-logs}"

# One directory per component and version; a directory exists only once its build completed.
K8S_BIN_DIR="${TRAJ_CACHE_DIR}/k8s/v${K8S_VERSION}/bin"
ETCD_BIN_DIR="${TRAJ_CACHE_DIR}/etcd/v${ETCD_VERSION}/bin"
KWOK_BIN_DIR="${TRAJ_CACHE_DIR}/kwok/v${KWOK_VERSION}/bin"

K8S_BINARIES=(kube-apiserver kube-controller-manager kube-scheduler kubectl)
ETCD_BINARIES=(etcd)
KWOK_BINARIES=(kwok kwokctl)
# kwok's default stages (node init + lease heartbeat, pod ready/complete/delete), copied from its module.
KWOK_STAGES_FILE="${KWOK_BIN_DIR}/../etc/kwok-stages.yaml"

log() { printf '[cluster %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
die() {
	log "ERROR: $*"
	exit 1
}

# component_complete DIR BIN...: true when DIR/.complete exists and every BIN is executable.
component_complete() {
	local bin_dir="$1"
	shift
	[[ -f "${bin_dir}/../.complete" ]] || return 1
	local b
	for b in "$@"; do
		[[ -x "${bin_dir}/${b}" ]] || return 1
	done
}

all_binaries_built() {
	component_complete "${K8S_BIN_DIR}" "${K8S_BINARIES[@]}" &&
		component_complete "${ETCD_BIN_DIR}" "${ETCD_BINARIES[@]}" &&
		component_complete "${KWOK_BIN_DIR}" "${KWOK_BINARIES[@]}" &&
		[[ -f "${KWOK_STAGES_FILE}" ]]
}
