#!/usr/bin/env bash
# Builds one command of a Go module with `go install`, once per version, into
#   ${TRAJ_CACHE_DIR}/<name>/v<version>/bin/<command>
# in a temporary directory next to its final place, renamed when complete, so an interrupted or
# failed build never leaves a cache entry that looks complete. Used by scripts/helm/build.sh and
# scripts/registry/build.sh, which pin the versions.
#
# Usage: scripts/go-tool.sh [--check | --print-path] NAME VERSION PACKAGE [LDFLAGS]
#   NAME          the cache directory's name (helm, crane)
#   VERSION       the module version without its v (4.3.2)
#   PACKAGE       the command's package (helm.sh/helm/v4/cmd/helm); built at @vVERSION
#   LDFLAGS       extra -ldflags (version stamps)
#   --check       exit 0 when it is already built, 1 otherwise (builds nothing)
#   --print-path  build if needed, then print the binary's path on stdout
# Environment: TRAJ_CACHE_DIR (default ~/.cache/trajectory-operator), TRAJ_BUILD_JOBS (default 2).
# Build log: ${TRAJ_CACHE_DIR}/build-logs/ (kept when the build fails).
set -euo pipefail

mode=""
case "${1:-}" in
--check | --print-path)
	mode="$1"
	shift
	;;
esac
(($# == 3 || $# == 4)) || {
	echo "usage: $0 [--check | --print-path] NAME VERSION PACKAGE [LDFLAGS]" >&2
	exit 2
}
NAME="$1" VERSION="$2" PACKAGE="$3" LDFLAGS="${4:-}"

TRAJ_CACHE_DIR="${TRAJ_CACHE_DIR:-${HOME}/.cache/trajectory-operator}"
FINAL="${TRAJ_CACHE_DIR}/${NAME}/v${VERSION}"
BINARY="${FINAL}/bin/${PACKAGE##*/}"

log() { printf '[%s %s] %s\n' "${NAME}" "$(date +%H:%M:%S)" "$*" >&2; }
die() {
	log "ERROR: $*"
	exit 1
}

built() { [[ -f "${FINAL}/.complete" && -x "${BINARY}" ]]; }

[[ "${mode}" == --check ]] && {
	built
	exit
}

done_() {
	if [[ "${mode}" == --print-path ]]; then printf '%s\n' "${BINARY}"; fi
	exit 0
}

built && done_

command -v go >/dev/null || die "go is not on PATH (Go >= 1.26 is needed to build ${PACKAGE}@v${VERSION})"
mkdir -p "${TRAJ_CACHE_DIR}/${NAME}"

# One build at a time; whoever waited finds the finished binary.
exec 8>"${TRAJ_CACHE_DIR}/${NAME}/.build.lock"
if ! flock -n 8; then
	log "another build holds ${TRAJ_CACHE_DIR}/${NAME}/.build.lock; waiting for it"
	flock 8
fi
built && done_

# Temporary directories of builds that were killed (the lock says none is running now).
for stale in "${TRAJ_CACHE_DIR}/${NAME}"/.v*.building.*; do
	[[ -d "${stale}" ]] || continue
	log "removing ${stale} (left by an interrupted build)"
	rm -rf "${stale}"
done

TMP="$(mktemp -d "${TRAJ_CACHE_DIR}/${NAME}/.v${VERSION}.building.XXXXXX")"
trap 'rm -rf "${TMP}"' EXIT
mkdir -p "${TMP}/bin"

log "${NAME} v${VERSION}: building ${PACKAGE} (a few minutes on 2 cores)"
start=${SECONDS}
if ! CGO_ENABLED=0 GOFLAGS="-p=${TRAJ_BUILD_JOBS:-2} -buildvcs=false -trimpath" \
	GOTOOLCHAIN="${GOTOOLCHAIN:-local}" GOBIN="${TMP}/bin" \
	nice -n 19 go install -ldflags "-s -w ${LDFLAGS}" "${PACKAGE}@v${VERSION}" \
	>"${TMP}/build.log" 2>&1; then
	mkdir -p "${TRAJ_CACHE_DIR}/build-logs"
	kept="${TRAJ_CACHE_DIR}/build-logs/failed-$(date +%Y%m%d-%H%M%S)-${NAME}.log"
	cp "${TMP}/build.log" "${kept}"
	log "FAILED: go install ${PACKAGE}@v${VERSION}; last 40 lines (full log: ${kept}):"
	tail -n 40 "${TMP}/build.log" >&2
	exit 1
fi
{
	echo "built=$(date -u +%Y-%m-%dT%H:%M:%SZ)"
	echo "go=$(go env GOVERSION)"
	echo "seconds=$((SECONDS - start))"
} >"${TMP}/.complete"
rm -rf "${FINAL}"
mv "${TMP}" "${FINAL}"
log "installed ${PACKAGE}@v${VERSION} into ${FINAL}/bin ($((SECONDS - start)) s)"
done_
