#!/usr/bin/env bash
# Builds (or reuses) llama.cpp's own OpenAI-compatible server, `llama-server`, from the llama.cpp
# that PyPI's llama-cpp-python sdist vendors (the version the project's model server pins in
# scripts/model-server/requirements.txt, the sdist checked against the hash below): the server
# that gives each sampled token's id with its logprob, and the prompt's ids through its
# /apply-template and /tokenize, for worker/tests/token_ids.rs. Into
#   ${TRAJ_CACHE_DIR:-~/.cache/trajectory-operator}/llama-server/<key>/bin/llama-server
# where <key> hashes the version, the cmake options, the CPU's flags (GGML_NATIVE) and this file.
#
# Usage: install.sh [--print-path] [--force]
#   --print-path  print the binary's path on stdout (also when it was already built)
#   --force       build again even if a finished build exists
# Environment: TRAJ_CACHE_DIR, TRAJ_BUILD_JOBS (default: nproc), LLAMA_SERVER_PYTHON (python3).
# Build log: ${TRAJ_CACHE_DIR}/logs/llama-server-<key>.log
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
TRAJ_CACHE_DIR="${TRAJ_CACHE_DIR:-${HOME}/.cache/trajectory-operator}"
PYTHON="${LLAMA_SERVER_PYTHON:-python3}"
JOBS="${TRAJ_BUILD_JOBS:-$(nproc)}"

VERSION="$(sed -n 's/^llama-cpp-python==\([0-9.]*\)$/\1/p' "${HERE}/../model-server/requirements.txt")"
# The sdist of llama-cpp-python ${VERSION}, as PyPI serves it.
SDIST_SHA256=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
# Only the server: no tests, examples or other tools; no web UI (it would be fetched, and the
# tests use the API only); no TLS; tuned for this CPU (so its flags are in the key).
CMAKE_ARGS=(
	-DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=OFF
	-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF
	-DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF
)

log() { printf '[llama-server %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
die() {
	log "ERROR: $*"
	exit 1
}

print_path=0
force=0
for arg in "$@"; do
	case "${arg}" in
	--print-path) print_path=1 ;;
	--force) force=1 ;;
	-h | --help)
		awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "${BASH_SOURCE[0]}"
		exit 0
		;;
	*) die "unknown argument '${arg}' (see --help)" ;;
	esac
done
[[ -n "${VERSION}" ]] || die "no llama-cpp-python==X pin in scripts/model-server/requirements.txt"

KEY="$({
	printf 'version=%s\ncmake=%s\n' "${VERSION}" "${CMAKE_ARGS[*]}"
	grep -m1 -E '^(flags|Features)' /proc/cpuinfo 2>/dev/null || true
	cat "${BASH_SOURCE[0]}"
} | sha256sum | cut -c1-12)"
DIR="${TRAJ_CACHE_DIR}/llama-server/${KEY}"
BIN="${DIR}/bin/llama-server"

finish() {
	if ((print_path)); then printf '%s\n' "${BIN}"; fi
	exit 0
}
if ((!force)) && [[ -f "${DIR}/.complete" && -x "${BIN}" ]]; then finish; fi

command -v cmake >/dev/null && command -v c++ >/dev/null ||
	die "needs cmake and a C++ compiler (scripts/model-server/install.sh installs them on Debian)"
mkdir -p "${TRAJ_CACHE_DIR}/logs"
LOG="${TRAJ_CACHE_DIR}/logs/llama-server-${KEY}.log"
WORK="$(mktemp -d "${TRAJ_CACHE_DIR}/llama-server/.build-XXXXXX" 2>/dev/null ||
	{ mkdir -p "${TRAJ_CACHE_DIR}/llama-server" && mktemp -d "${TRAJ_CACHE_DIR}/llama-server/.build-XXXXXX"; })"
trap 'rm -rf "${WORK}"' EXIT

started=${SECONDS}
log "building llama-server from llama-cpp-python ${VERSION}'s llama.cpp (log: ${LOG})"
{
	"${PYTHON}" -m pip download --quiet --no-deps --no-binary :all: --dest "${WORK}" \
		"llama-cpp-python==${VERSION}"
	sdist="${WORK}/llama_cpp_python-${VERSION}.tar.gz"
	echo "${SDIST_SHA256}  ${sdist}" | sha256sum -c -
	tar -xzf "${sdist}" -C "${WORK}" "llama_cpp_python-${VERSION}/vendor/llama.cpp"
	source_dir="${WORK}/llama_cpp_python-${VERSION}/vendor/llama.cpp"
	cmake -S "${source_dir}" -B "${WORK}/build" "${CMAKE_ARGS[@]}"
	cmake --build "${WORK}/build" --target llama-server -j "${JOBS}"
	rm -rf "${DIR}"
	mkdir -p "${DIR}/bin"
	cp "${WORK}/build/bin/llama-server" "${BIN}"
	"${BIN}" --version
} >"${LOG}" 2>&1 || {
	tail -n 40 "${LOG}" >&2
	die "the build failed (log: ${LOG})"
}
touch "${DIR}/.complete"
log "built in $((SECONDS - started)) s: ${BIN}"
finish
