#!/usr/bin/env bash
# Stops the control plane that up.sh started in TRAJ_CLUSTER_DIR (default /tmp/trajectory-cluster) and
# removes that directory. Only processes started from that directory are stopped: those named by its pid
# files, and any left-over process of a killed run whose command line refers to the directory. A real
# node (up.sh --real-node) is removed first by node-down.sh, with everything it made on the host.
#
# Usage: scripts/cluster/down.sh [--keep-logs] [--quiet]
#   --keep-logs  first copy every component's log to ${TRAJ_CLUSTER_LOGS_DIR:-${TRAJ_CLUSTER_DIR}-logs}/<time>/
#   --quiet      say nothing when there is nothing to stop
# Safe to run any number of times.
set -euo pipefail

# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/lib.sh"

KEEP_LOGS=0
QUIET=0
for arg in "$@"; do
	case "${arg}" in
	--keep-logs) KEEP_LOGS=1 ;;
	--quiet) QUIET=1 ;;
	-h | --help)
		sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'
		exit 0
		;;
	*) die "unknown argument: ${arg} (see --help)" ;;
	esac
done

DIR="${TRAJ_CLUSTER_DIR%/}"
[[ -n "${DIR}" && "${DIR}" != "/" ]] || die "TRAJ_CLUSTER_DIR must name a directory, got '${TRAJ_CLUSTER_DIR}'"

if [[ ! -e "${DIR}" ]]; then
	[[ "${QUIET}" == 1 ]] || log "nothing to stop: ${DIR} does not exist"
	exit 0
fi
if [[ ! -f "${DIR}/.trajectory-cluster" ]] && [[ -n "$(ls -A "${DIR}")" ]]; then
	die "${DIR} exists but was not made by scripts/cluster/up.sh (no .trajectory-cluster marker); not touching it"
fi

# ours PID: the process is alive and its command line refers to the state directory.
ours() {
	local cmdline
	cmdline="$(tr '\0' ' ' 2>/dev/null <"/proc/$1/cmdline")" || return 1
	[[ "${cmdline}" == *"${DIR}/"* ]]
}

# stop PID...: SIGTERM, up to 10 s to exit, then SIGKILL. Only processes that are still ours are signalled.
stop() {
	local pid left
	for pid in "$@"; do
		kill -TERM "${pid}" 2>/dev/null || true
	done
	for _ in $(seq 1 50); do
		left=()
		for pid in "$@"; do
			if kill -0 "${pid}" 2>/dev/null && ours "${pid}"; then
				left+=("${pid}")
			fi
		done
		[[ ${#left[@]} -gt 0 ]] || return 0
		sleep 0.2
	done
	for pid in "${left[@]}"; do
		log "process ${pid} ignored SIGTERM for 10 s; sending SIGKILL"
		kill -KILL "${pid}" 2>/dev/null || true
	done
}

# pid_of NAME: the pid recorded for a component, if that process is still ours.
pid_of() {
	local pid
	pid="$(cat "${DIR}/pids/$1.pid" 2>/dev/null || true)"
	if [[ "${pid}" =~ ^[0-9]+$ ]] && ours "${pid}"; then
		echo "${pid}"
	fi
}

stopped=0
# The real node first (its kubelet needs the API server to finish, its pods need containerd to be stopped).
if [[ -d "${DIR}/node" ]]; then
	if [[ "${KEEP_LOGS}" == 1 && -d "${DIR}/logs" ]]; then
		# Pod logs live in the node's directory, which node-down.sh removes.
		cp -r "${DIR}/node/pod-logs" "${DIR}/logs/pod-logs" 2>/dev/null || true
	fi
	quiet=()
	[[ "${QUIET}" != 1 ]] || quiet=(--quiet)
	"${CLUSTER_SCRIPTS_DIR}/node-down.sh" "${quiet[@]}" || die "stopping the real node failed; not removing ${DIR}"
	stopped=$((stopped + 1))
fi
# In reverse start order, in phases: kube-apiserver shuts down cleanly only while etcd still runs.
for phase in "kwok kube-scheduler kube-controller-manager" "kube-apiserver" "etcd"; do
	pids=()
	for name in ${phase}; do
		pid="$(pid_of "${name}")"
		[[ -z "${pid}" ]] || pids+=("${pid}")
	done
	if [[ ${#pids[@]} -gt 0 ]]; then
		log "stopping ${phase// /, } (pid ${pids[*]})"
		stop "${pids[@]}"
		stopped=$((stopped + ${#pids[@]}))
	fi
done
# Left-overs of a killed run whose pid files are gone: binaries from our cache started with this directory.
pids=()
for proc in /proc/[0-9]*; do
	pid="${proc#/proc/}"
	exe="$(readlink "${proc}/exe" 2>/dev/null || true)"
	[[ "${exe}" == "${TRAJ_CACHE_DIR}/"* ]] || continue
	if ours "${pid}"; then
		pids+=("${pid}")
	fi
done
if [[ ${#pids[@]} -gt 0 ]]; then
	log "stopping left-over process(es) of ${DIR} without pid files: ${pids[*]}"
	stop "${pids[@]}"
	stopped=$((stopped + ${#pids[@]}))
fi

if [[ "${KEEP_LOGS}" == 1 && -d "${DIR}/logs" ]]; then
	dest="${TRAJ_CLUSTER_LOGS_DIR}/$(date +%Y%m%d-%H%M%S)-$$"
	mkdir -p "${dest}"
	cp -r "${DIR}/logs/." "${dest}/"
	log "logs of every component kept in ${dest}"
fi

rm -rf "${DIR}"
[[ "${QUIET}" == 1 && "${stopped}" -eq 0 ]] || log "stopped ${stopped} process(es); removed ${DIR}"
