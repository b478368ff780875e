#!/usr/bin/env bash
# Runs CMD with a local model server: start.sh, then CMD with MODEL_BASE_URL and MODEL_NAME exported,
# then stop.sh whatever CMD did. Exits with CMD's exit code.
# SIGTERM/SIGINT/SIGHUP (e.g. from `timeout`) are passed on to CMD as SIGTERM; the server is stopped
# once CMD has exited. A server already running for this state directory is reused, and stopped too:
# concurrent users need distinct TRAJ_MODEL_SERVER_DIRs. start.sh's output goes to stderr.
#
# Usage: with-model-server.sh CMD [ARG...]
#   e.g. scripts/model-server/with-model-server.sh python3 scripts/model-server/smoke.py
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=scripts/model-server/lib.sh
source "${HERE}/lib.sh"

if (($# == 0)) || [[ "$1" == -h || "$1" == --help ]]; then
	awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "${BASH_SOURCE[0]}" >&2
	(($# > 0)) && exit 0
	exit 2
fi

CHILD=""
# shellcheck disable=SC2317 # called by traps
stop_server() { "${HERE}/stop.sh" || true; }
# shellcheck disable=SC2317 # called by traps
on_signal() {
	if [[ -n "${CHILD}" ]]; then
		kill -TERM "${CHILD}" 2>/dev/null || true
		wait "${CHILD}" 2>/dev/null || true
	fi
	exit "$1"
}
trap stop_server EXIT
trap 'on_signal 129' HUP
trap 'on_signal 130' INT
trap 'on_signal 143' TERM

"${HERE}/start.sh" >&2
# shellcheck source=/dev/null
source "${MS_ENV_FILE}"

# In the background so that signals reach the traps at once; <&0 keeps CMD's stdin (a background
# command would get /dev/null).
"$@" <&0 &
CHILD=$!
rc=0
wait "${CHILD}" || rc=$?
CHILD=""
exit "${rc}"
