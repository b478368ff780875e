#!/usr/bin/env bash
# Runs CMD against a fresh local control plane: up.sh (building first if needed), KUBECONFIG exported,
# CMD, then always down.sh - also when CMD fails or the script is interrupted. Exits with CMD's status
# (or up.sh's when the cluster did not start). When anything failed, every component's log is kept in
# ${TRAJ_CLUSTER_LOGS_DIR:-${TRAJ_CLUSTER_DIR}-logs}/<time>/ (the path is printed).
#
# Usage: scripts/cluster/with-cluster.sh [--real-node] CMD [ARGS...]
#   e.g. scripts/cluster/with-cluster.sh cargo test -p trajectory-tests
#        scripts/cluster/with-cluster.sh --real-node cargo test -p trajectory-tests --test real_node
#   --real-node  start the real node too (up.sh --real-node; as TRAJ_REAL_NODE=1)
# Environment: as up.sh (TRAJ_CLUSTER_DIR, KWOK_NODES, ...). Runs sharing one TRAJ_CLUSTER_DIR wait for
# each other (lock file ${TRAJ_CLUSTER_DIR}.lock).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "${HERE}/lib.sh"

if [[ "${1:-}" == --real-node ]]; then
	export TRAJ_REAL_NODE=1
	shift
fi
[[ $# -gt 0 ]] || die "usage: $0 [--real-node] CMD [ARGS...]"

DIR="${TRAJ_CLUSTER_DIR%/}"
mkdir -p "$(dirname "${DIR}")"
exec 9>"${DIR}.lock"
if ! flock -n 9; then
	log "another run uses ${DIR}; waiting for its lock ${DIR}.lock"
	flock 9
fi

status=0
child=""
# shellcheck disable=SC2317 # called from the traps
finish() {
	trap - EXIT INT TERM
	if [[ -n "${child}" ]] && kill -0 "${child}" 2>/dev/null; then
		log "interrupted: stopping ${child_cmd}"
		kill -TERM "${child}" 2>/dev/null || true
		wait "${child}" 2>/dev/null || true
	fi
	if [[ "${status}" -ne 0 ]]; then
		"${HERE}/down.sh" --keep-logs --quiet || true
	else
		"${HERE}/down.sh" --quiet || true
	fi
	exit "${status}"
}
trap finish EXIT
trap 'status=130; finish' INT
trap 'status=143; finish' TERM

"${HERE}/up.sh" >/dev/null || {
	status=$?
	log "the control plane did not start (exit ${status})"
	exit "${status}"
}
# shellcheck source=/dev/null
source "${DIR}/env"
log "running: $* (KUBECONFIG=${KUBECONFIG})"
# In the background so that a signal to this script is handled at once (bash runs traps only between
# foreground commands); stdin is passed on explicitly (a background command would get /dev/null).
child_cmd="$*"
"$@" <&0 &
child=$!
wait "${child}" || status=$?
child=""
if [[ "${status}" -ne 0 ]]; then
	log "command exited with ${status}"
fi
exit "${status}"
