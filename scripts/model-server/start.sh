#!/usr/bin/env bash
# Starts the local OpenAI-compatible model server (llama-cpp-python, SmolLM2-135M-Instruct Q4_1,
# chat format chatml-function-calling unless MODEL_SERVER_CHAT_FORMAT says otherwise) on 127.0.0.1
# (or MODEL_SERVER_HOST) in the background, installing it first if needed.
# Waits until GET /v1/models answers, then writes and prints ${TRAJ_MODEL_SERVER_DIR}/env:
#   export MODEL_BASE_URL=http://127.0.0.1:<port>/v1
#   export MODEL_NAME=<the model id the server reports>
#   export MODEL_SERVER_HOST=<the address it listens on>
# If a healthy server of this state directory is already running, it is reused (same env printed).
# A stale pid file or a left-over server of a killed run is cleaned up first.
#
# Usage: start.sh            then: source "${TRAJ_MODEL_SERVER_DIR:-/tmp/trajectory-model-server}/env"
# Environment:
#   TRAJ_MODEL_SERVER_DIR       state dir: server.pid, port, env, server.log (default /tmp/trajectory-model-server)
#   MODEL_SERVER_PORT           fixed port (default: a free one)
#   MODEL_SERVER_HOST           address to listen on (default 127.0.0.1); 0.0.0.0 also makes it
#                               reachable from the real node's pods, at the bridge address 10.88.0.1
#   MODEL_SERVER_START_TIMEOUT  seconds to wait for /v1/models (default 120)
#   MODEL_SERVER_N_CTX          context size (default 4096)
#   MODEL_SERVER_THREADS        threads (default 2)
#   MODEL_SERVER_OMP_WAIT_POLICY  OMP_WAIT_POLICY of the server (default passive; see below)
#   MODEL_SERVER_MODEL_ALIAS    model id to serve under (default smollm2-135m-instruct-q4_1)
#   MODEL_SERVER_CHAT_FORMAT    llama-cpp-python's chat format (default chatml-function-calling: the
#                               tools' schemas go into the system message, tool calls are parsed
#                               from what the model writes, and tool results are left out of the
#                               prompts of tool-calling turns); "model" takes the model's own chat
#                               template from its GGUF, as vLLM and llama-server do: every message
#                               is written as it is, tool results included, and a tool call is made
#                               only when the request's tool_choice names the function
#   MODEL_SERVER_CACHE_BYTES    keep the states of earlier prompts in a RAM cache of this size, and
#                               start a prompt from the longest cached prefix (default: none; the
#                               server then keeps only its last prompt, like one llama.cpp slot)
#   and install.sh's (TRAJ_CACHE_DIR, TRAJ_BUILD_JOBS, ...).
set -euo pipefail

# shellcheck source=scripts/model-server/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

case "${1:-}" in
-h | --help)
	awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "${BASH_SOURCE[0]}"
	exit 0
	;;
"") ;;
*) ms_die "start.sh takes no arguments (see --help)" ;;
esac

PORT_REQ="${MODEL_SERVER_PORT:-}"
HOST="${MODEL_SERVER_HOST:-127.0.0.1}"
# Where this script checks the server and where local clients reach it.
case "${HOST}" in
0.0.0.0) CHECK_HOST=127.0.0.1 ;;
*) CHECK_HOST="${HOST}" ;;
esac
TIMEOUT="${MODEL_SERVER_START_TIMEOUT:-120}"
N_CTX="${MODEL_SERVER_N_CTX:-4096}"
THREADS="${MODEL_SERVER_THREADS:-2}"
# llama.cpp's OpenMP threads spin while they wait: on a busy machine (a cargo build beside the tests)
# 2 spinning threads made calls ~10x slower (1 s -> 10 s). passive makes them sleep instead.
OMP_POLICY="${MODEL_SERVER_OMP_WAIT_POLICY:-passive}"
if [[ -n "${PORT_REQ}" && ! "${PORT_REQ}" =~ ^[0-9]+$ ]]; then ms_die "MODEL_SERVER_PORT must be a number, got '${PORT_REQ}'"; fi
CHAT_FORMAT="${MODEL_SERVER_CHAT_FORMAT:-chatml-function-calling}"
case "${CHAT_FORMAT}" in
model) CHAT_ARGS=() ;;
*[!a-z0-9-]* | "") ms_die "MODEL_SERVER_CHAT_FORMAT must be a llama-cpp-python chat format or 'model', got '${CHAT_FORMAT}'" ;;
*) CHAT_ARGS=(--chat_format "${CHAT_FORMAT}") ;;
esac
CACHE_ARGS=()
if [[ -n "${MODEL_SERVER_CACHE_BYTES:-}" ]]; then
	[[ "${MODEL_SERVER_CACHE_BYTES}" =~ ^[0-9]+$ ]] || ms_die "MODEL_SERVER_CACHE_BYTES must be a number, got '${MODEL_SERVER_CACHE_BYTES}'"
	CACHE_ARGS=(--cache True --cache_type ram --cache_size "${MODEL_SERVER_CACHE_BYTES}")
fi

VENV="$("${MODEL_SERVER_SCRIPTS_DIR}/install.sh" --print-venv)"
MS_PY="${VENV}/bin/python"
MODEL="${VENV}/$(cat "${VENV}/model-path")"
[[ -f "${MODEL}" ]] || ms_die "model file missing: ${MODEL} (remove ${VENV} and rerun)"

mkdir -p "${TRAJ_MODEL_SERVER_DIR}"
# One start/stop at a time per state directory.
exec 8>"${TRAJ_MODEL_SERVER_DIR}/.lock"
flock -w $((TIMEOUT + 60)) 8 || ms_die "another start.sh/stop.sh holds ${TRAJ_MODEL_SERVER_DIR}/.lock"

print_env() {
	cat "${MS_ENV_FILE}"
}

# Reuse a healthy server of this state dir (unless it listens on another port than the one asked for).
if [[ -f "${MS_PID_FILE}" && -f "${MS_PORT_FILE}" && -f "${MS_ENV_FILE}" ]]; then
	old_pid="$(cat "${MS_PID_FILE}")"
	old_port="$(cat "${MS_PORT_FILE}")"
	old_cmdline="$(tr '\0' ' ' 2>/dev/null <"/proc/${old_pid}/cmdline" || true)"
	if ms_is_our_server "${old_pid}" && [[ "${old_cmdline}" == *" --model ${MODEL} "* ]] &&
		if ((${#CACHE_ARGS[@]})); then [[ "${old_cmdline}" == *" ${CACHE_ARGS[*]} "* ]]; else [[ "${old_cmdline}" != *" --cache True "* ]]; fi &&
		if ((${#CHAT_ARGS[@]})); then [[ "${old_cmdline}" == *" ${CHAT_ARGS[*]} "* ]]; else [[ "${old_cmdline}" != *" --chat_format "* ]]; fi &&
		[[ -z "${PORT_REQ}" || "${PORT_REQ}" == "${old_port}" ]] &&
		grep -qx "export MODEL_SERVER_HOST=${HOST}" "${MS_ENV_FILE}" &&
		ms_server_healthy "${old_port}" "${CHECK_HOST}"; then
		ms_log "already running (pid ${old_pid}, port ${old_port}); reusing it"
		print_env
		exit 0
	fi
fi

# Clean up: a server from an earlier run (pid file or not), then stale state.
for pid in $(ms_find_servers); do
	ms_log "stopping left-over model server pid ${pid}"
	ms_kill_pid "${pid}" 5 || true
done
rm -f "${MS_PID_FILE}" "${MS_PORT_FILE}" "${MS_ENV_FILE}"

# free_port: a port that was free on HOST a moment ago.
free_port() {
	"${MS_PY}" -c 'import socket, sys; s = socket.socket(); s.bind((sys.argv[1], 0)); print(s.getsockname()[1]); s.close()' "${HOST}"
}
port_in_use() {
	"${MS_PY}" - "$1" "${HOST}" <<'PY'
import socket, sys
s = socket.socket()
try:
    s.bind((sys.argv[2], int(sys.argv[1])))
except OSError:
    sys.exit(0)
sys.exit(1)
PY
}

if [[ -n "${PORT_REQ}" ]] && port_in_use "${PORT_REQ}"; then
	ms_die "MODEL_SERVER_PORT=${PORT_REQ} is already in use on ${HOST} ($(ss -ltnpH "sport = :${PORT_REQ}" 2>/dev/null | head -1 || true))"
fi

# start_server PORT: starts the server in its own session; sets SERVER_PID.
# It must not inherit fd 8 (it would hold the state dir's lock for its whole life).
# The environment is cleared: the server's settings are pydantic-settings, which would also read
# ambient variables such as API_KEY, PORT, HOST, MODEL, SEED or CONFIG_FILE.
# --interrupt_requests False: by default the server ends a streamed answer early ("[DONE]" in the
# middle of it) as soon as another request waits for the model, so that parallel workers or tests
# streaming from one server would get each other's answers cut short; with it they queue instead.
start_server() {
	: >"${MS_LOG_FILE}"
	env -i PATH="${PATH}" HOME="${HOME}" LANG=C.UTF-8 TMPDIR="${TMPDIR:-/tmp}" \
		TRAJ_MODEL_SERVER_DIR="${TRAJ_MODEL_SERVER_DIR}" OMP_WAIT_POLICY="${OMP_POLICY}" \
		setsid "${MS_PY}" -m llama_cpp.server \
		--model "${MODEL}" \
		--model_alias "${MODEL_SERVER_MODEL_ALIAS}" \
		"${CHAT_ARGS[@]}" \
		--interrupt_requests False \
		--host "${HOST}" --port "$1" \
		--n_ctx "${N_CTX}" --n_threads "${THREADS}" --n_threads_batch "${THREADS}" \
		"${CACHE_ARGS[@]}" \
		</dev/null >>"${MS_LOG_FILE}" 2>&1 8>&- &
	SERVER_PID=$!
	printf '%s\n' "${SERVER_PID}" >"${MS_PID_FILE}"
	printf '%s\n' "$1" >"${MS_PORT_FILE}"
}

# wait_healthy PORT: 0 when healthy; 1 when the server died (2 if of a port clash); exits on time-out.
wait_healthy() {
	local deadline=$((SECONDS + TIMEOUT))
	while ((SECONDS < deadline)); do
		if ! kill -0 "${SERVER_PID}" 2>/dev/null; then
			if grep -qi 'address already in use' "${MS_LOG_FILE}"; then return 2; fi
			return 1
		fi
		if ms_server_healthy "$1" "${CHECK_HOST}"; then return 0; fi
		sleep 0.25
	done
	ms_log "ERROR: the model server did not answer GET http://${CHECK_HOST}:$1/v1/models within ${TIMEOUT}s"
	ms_tail "${MS_LOG_FILE}" 40
	ms_kill_pid "${SERVER_PID}" 3 || true
	rm -f "${MS_PID_FILE}" "${MS_PORT_FILE}"
	exit 1
}

T0=${SECONDS}
for attempt in 1 2 3; do
	PORT="${PORT_REQ:-$(free_port)}"
	start_server "${PORT}"
	rc=0
	wait_healthy "${PORT}" || rc=$?
	if ((rc == 0)); then break; fi
	rm -f "${MS_PID_FILE}" "${MS_PORT_FILE}"
	if ((rc == 2)) && [[ -z "${PORT_REQ}" ]] && ((attempt < 3)); then
		ms_log "port ${PORT} was taken meanwhile; trying another"
		continue
	fi
	wait "${SERVER_PID}" 2>/dev/null && status=0 || status=$?
	ms_log "ERROR: the model server exited during start-up (exit ${status})"
	ms_tail "${MS_LOG_FILE}" 40
	exit 1
done

MODEL_NAME="$(ms_http_get "http://${CHECK_HOST}:${PORT}/v1/models" | "${MS_PY}" -c 'import json, sys; print(json.load(sys.stdin)["data"][0]["id"])')" ||
	ms_die "cannot read the model id from /v1/models"
{
	printf 'export MODEL_BASE_URL=http://%s:%s/v1\n' "${CHECK_HOST}" "${PORT}"
	printf 'export MODEL_NAME=%q\n' "${MODEL_NAME}"
	printf 'export MODEL_SERVER_HOST=%s\n' "${HOST}"
} >"${MS_ENV_FILE}.tmp"
mv "${MS_ENV_FILE}.tmp" "${MS_ENV_FILE}"
ms_log "started pid ${SERVER_PID} on ${HOST}:${PORT} in $((SECONDS - T0))s (log: ${MS_LOG_FILE})"
print_env
