#!/usr/bin/env bash
# Stops the model server that start.sh started for ${TRAJ_MODEL_SERVER_DIR:-/tmp/trajectory-model-server}:
# SIGTERM, then SIGKILL after MODEL_SERVER_STOP_GRACE seconds (default 5). Also stops a left-over
# server of this state directory whose pid file is gone. Removes server.pid, port and env; keeps
# server.log for post-mortems. Stopping when nothing runs is not an error.
set -euo pipefail

# shellcheck source=scripts/model-server/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

case "${1:-}" in
-h | --help)
	awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "${BASH_SOURCE[0]}"
	exit 0
	;;
"") ;;
*) ms_die "stop.sh takes no arguments (see --help)" ;;
esac

GRACE="${MODEL_SERVER_STOP_GRACE:-5}"
mkdir -p "${TRAJ_MODEL_SERVER_DIR}"
exec 8>"${TRAJ_MODEL_SERVER_DIR}/.lock"
flock -w 300 8 || ms_die "another start.sh/stop.sh holds ${TRAJ_MODEL_SERVER_DIR}/.lock"

pids=()
if [[ -f "${MS_PID_FILE}" ]]; then
	pid="$(cat "${MS_PID_FILE}")"
	if ms_is_our_server "${pid}"; then
		pids+=("${pid}")
	else
		ms_log "removing stale pid file (pid ${pid} is not a model server of ${TRAJ_MODEL_SERVER_DIR})"
	fi
fi
for pid in $(ms_find_servers); do
	if [[ " ${pids[*]} " != *" ${pid} "* ]]; then pids+=("${pid}"); fi
done

rc=0
for pid in "${pids[@]}"; do
	if ms_kill_pid "${pid}" "${GRACE}"; then
		ms_log "stopped pid ${pid}"
	else
		rc=1
	fi
done
rm -f "${MS_PID_FILE}" "${MS_PORT_FILE}" "${MS_ENV_FILE}"
exit "${rc}"
