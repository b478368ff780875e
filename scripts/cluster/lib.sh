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
# The real node's agent (up.sh --real-node): built into K8S_BIN_DIR on its own, marked by .complete-node.
K8S_NODE_BINARIES=(kubelet)
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

# node_binaries_built: the kubelet of the real node is built (build.sh --real-node).
node_binaries_built() {
	[[ -f "${K8S_BIN_DIR}/../.complete-node" ]] || return 1
	local b
	for b in "${K8S_NODE_BINARIES[@]}"; do
		[[ -x "${K8S_BIN_DIR}/${b}" ]] || return 1
	done
}

# Debian packages of the real node (install-node.sh), and where Debian puts the CNI plugins.
# shellcheck disable=SC2034 # used by the scripts that source this file
NODE_PACKAGES=(containerd runc containernetworking-plugins iptables nftables busybox-static umoci skopeo)
# shellcheck disable=SC2034 # used by the scripts that source this file
CNI_BIN_DIR=/usr/lib/cni
# The real node's images (node-images.sh), imported into containerd without a registry.
# shellcheck disable=SC2034 # used by the scripts that source this file
NODE_BUSYBOX_IMAGE=trajectory.local/busybox:1
# shellcheck disable=SC2034 # used by the scripts that source this file
NODE_PAUSE_IMAGE=trajectory.local/pause:1
# The real node (node-up.sh / node-down.sh): its name, the bridge that joins its pods to the host, and
# their /24 (the host is .1 there: the node's InternalIP, and the address pods reach the host at).
TRAJ_NODE_NAME="${TRAJ_NODE_NAME:-trajectory-node}"
TRAJ_NODE_BRIDGE="${TRAJ_NODE_BRIDGE:-traj0}"
TRAJ_NODE_SUBNET="${TRAJ_NODE_SUBNET:-10.88.0.0/24}"
# shellcheck disable=SC2034 # used by the scripts that source this file
CNI_NETWORK=trajectory-node

# node_gateway: the host's address on the real node's bridge (.1 of TRAJ_NODE_SUBNET); fails unless
# TRAJ_NODE_SUBNET is a /24.
node_gateway() {
	[[ "${TRAJ_NODE_SUBNET}" =~ ^([0-9]+\.[0-9]+\.[0-9]+)\.0/24$ ]] ||
		die "TRAJ_NODE_SUBNET must be a /24 like 10.88.0.0/24, got '${TRAJ_NODE_SUBNET}'"
	echo "${BASH_REMATCH[1]}.1"
}
# The kernel tunables the kubelet sets at start (pkg/kubelet/cm setupKernelTunables), restored at stop.
# shellcheck disable=SC2034 # used by the scripts that source this file
KUBELET_SYSCTLS="vm.overcommit_memory vm.panic_on_oom kernel.panic kernel.panic_on_oops kernel.keys.root_maxkeys kernel.keys.root_maxbytes"

# restore_kernel_tunables FILE: write back each KEY=VALUE of FILE (the kubelet's tunables as node-up.sh
# recorded them) that differs now; prints each key it restored. Fails when a write fails.
restore_kernel_tunables() {
	local line key value
	while IFS= read -r line; do
		key="${line%%=*}"
		value="${line#*=}"
		if [[ "$(sysctl -n "${key}" 2>/dev/null)" != "${value}" ]]; then
			sysctl -q -w "${key}=${value}" >/dev/null || return 1
			echo "${key}=${value}"
		fi
	done <"$1"
}
