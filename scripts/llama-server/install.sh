#!/usr/bin/env bash
# Builds (or reuses) llama.cpp once for both of its users: its shared libraries, which the
# project's model server (scripts/model-server, llama-cpp-python) loads, and its own
# OpenAI-compatible server, `llama-server`, which gives each sampled token's id with its logprob
# and the prompt's ids through its /apply-template and /tokenize (worker/tests/token_ids.rs).
# The source is the llama.cpp that PyPI's llama-cpp-python sdist vendors, at the version the
# model server pins in scripts/model-server/requirements.txt, the sdist checked against the hash
# below: the Python bindings and the libraries come from the same release. Into
#   ${TRAJ_CACHE_DIR:-~/.cache/trajectory-operator}/llama-cpp/<key>/{bin/llama-server,lib/*.so*}
# where <key> hashes the version, the cmake options, the CPU's flags (GGML_NATIVE) and this file.
# One compile of ggml and llama serves both (they were two: ~15 CPU minutes each on 2 cores).
#
# Usage: install.sh [--print-path | --print-lib-dir | --print-key] [--force]
#   --print-path     print llama-server's path on stdout (also when it was already built)
#   --print-lib-dir  print the directory of the shared libraries (libllama.so, libggml*.so)
#   --print-key      print the cache key only, building nothing
#   --force          build again even if a finished build exists
# A second install of the same key waits for the first, then finds it built.
# Environment: TRAJ_CACHE_DIR, TRAJ_BUILD_JOBS (default: nproc), LLAMA_SERVER_PYTHON (python3),
#   LLAMA_CPP_CMAKE_ARGS (extra llama.cpp cmake options; they change the key).
# Build log: ${TRAJ_CACHE_DIR}/logs/llama-cpp-<key>.log
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=scripts/model-server/lib.sh
source "${HERE}/../model-server/lib.sh"
PYTHON="${LLAMA_SERVER_PYTHON:-python3}"
JOBS="${TRAJ_BUILD_JOBS:-$(nproc)}"

VERSION="$(sed -n 's/^llama-cpp-python==\([0-9.]*\)$/\1/p' "${MODEL_SERVER_SCRIPTS_DIR}/requirements.txt")"
# The sdist of llama-cpp-python ${VERSION}, as PyPI serves it.
SDIST_SHA256=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
# Shared libraries as llama-cpp-python builds them (LLAMA_CURL off, tuned for this CPU, so its
# flags are in the key), found beside each other and from bin/ through the RPATH; of the tools
# only the server: no tests or examples, no web UI (it would be fetched, and the tests use the API
# only), no TLS.
CMAKE_ARGS=(
	-DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=ON -DLLAMA_CURL=OFF
	"-DCMAKE_INSTALL_RPATH=\$ORIGIN/../lib" -DCMAKE_BUILD_WITH_INSTALL_RPATH=ON
	-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF
	-DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF
)
# shellcheck disable=SC2206 # options are words
if [[ -n "${LLAMA_CPP_CMAKE_ARGS:-}" ]]; then CMAKE_ARGS+=(${LLAMA_CPP_CMAKE_ARGS}); fi

log() { printf '[llama.cpp %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
die() {
	log "ERROR: $*"
	exit 1
}

print=""
force=0
for arg in "$@"; do
	case "${arg}" in
	--print-path | --print-lib-dir | --print-key) print="${arg#--print-}" ;;
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
if [[ "${print}" == key ]]; then
	printf '%s\n' "${KEY}"
	exit 0
fi
ROOT="${TRAJ_CACHE_DIR}/llama-cpp"
DIR="${ROOT}/${KEY}"
BIN="${DIR}/bin/llama-server"

finish() {
	case "${print}" in
	path) printf '%s\n' "${BIN}" ;;
	lib-dir) printf '%s\n' "${DIR}/lib" ;;
	esac
	exit 0
}
built() { [[ -f "${DIR}/.complete" && -x "${BIN}" && -f "${DIR}/lib/libllama.so" ]]; }
if ((!force)) && built; then finish; fi

mkdir -p "${ROOT}" "${TRAJ_CACHE_DIR}/logs"
# One build per key at a time: scripts/test.sh starts it in the background while the model
# server's install needs its libraries; the second caller waits here and then finds it built.
exec 9>"${ROOT}/.${KEY}.lock"
if ! flock -n 9; then
	log "another build of ${DIR} is running; waiting for it"
	flock 9
fi
if ((!force)) && built; then finish; fi

ms_ensure_build_tools "${TRAJ_CACHE_DIR}/logs/llama-cpp-apt-get.log"
LOG="${TRAJ_CACHE_DIR}/logs/llama-cpp-${KEY}.log"
WORK="$(mktemp -d "${ROOT}/.build-XXXXXX")"
trap 'rm -rf "${WORK}"' EXIT

started=${SECONDS}
log "building llama.cpp's libraries and llama-server from llama-cpp-python ${VERSION}'s sdist (log: ${LOG})"
{
	"${PYTHON}" -m pip download --quiet --no-deps --no-binary :all: --dest "${WORK}" \
		"llama-cpp-python==${VERSION}"
	sdist="${WORK}/llama_cpp_python-${VERSION}.tar.gz"
	echo "${SDIST_SHA256}  ${sdist}" | sha256sum -c -
	tar -xzf "${sdist}" -C "${WORK}" "llama_cpp_python-${VERSION}/vendor/llama.cpp"
	source_dir="${WORK}/llama_cpp_python-${VERSION}/vendor/llama.cpp"
	cmake -S "${source_dir}" -B "${WORK}/build" "${CMAKE_ARGS[@]}"
	# llama-server links llama and ggml (with ggml's CPU backend): the libraries the bindings load.
	cmake --build "${WORK}/build" --target llama-server -j "${JOBS}"
	rm -rf "${DIR}"
	mkdir -p "${DIR}/bin" "${DIR}/lib"
	cp "${WORK}/build/bin/llama-server" "${BIN}"
	# -P keeps the versioned names' symlinks (libllama.so -> libllama.so.0 -> ...).
	find "${WORK}/build" -name 'lib*.so*' \( -type f -o -type l \) -exec cp -P {} "${DIR}/lib/" \;
	ls -l "${DIR}/lib"
	"${BIN}" --version
} >"${LOG}" 2>&1 || {
	tail -n 40 "${LOG}" >&2
	die "the build failed (log: ${LOG})"
}
touch "${DIR}/.complete"
log "built in $((SECONDS - started)) s: ${DIR}"
finish
