#!/usr/bin/env bash
# Builds gitops-health (main.go next to this file: Flux's kstatus and Argo CD's Lua health code,
# from their own Go modules, judging one object; tests/tests/gitops.rs runs it) into
#   ${TRAJ_CACHE_DIR}/gitops-health/<hash>/bin/gitops-health
# where <hash> is that of go.mod, go.sum and main.go: any change to them builds anew. The same
# shape as scripts/go-tool.sh (which builds a released command, `go install PACKAGE@VERSION`):
# a temporary directory next to the final place, renamed when complete, so an interrupted or failed
# build never leaves a cache entry that looks complete.
#
# One module for both tools: github.com/argoproj/argo-cd/v3 v3.2.12 pins every k8s.io module to
# v0.34.0 with replace directives (copied into go.mod, as a module requiring it must), and
# github.com/fluxcd/cli-utils v1.3.0's kstatus package builds against those too. Measured on the
# 2 cores of the machine that added it, with an empty Go build cache and modules downloaded, while
# other builds ran (load 4-9): 301 s, about 1,430 packages, 70 MB. Argo CD's code is nearly all of
# it: kstatus alone, in a module of its own, built in 57 s (272 packages, 9 MB).
#
# Usage: scripts/gitops-health/build.sh [--check | --print-path]
#   --check        exit 0 when it is already built, 1 otherwise (builds nothing)
#   --print-path   build if needed, then print the binary's path on stdout
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
(($# == 0)) || {
	echo "usage: $0 [--check | --print-path]" >&2
	exit 2
}

NAME="gitops-health"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
SOURCES=(go.mod go.sum main.go)
HASH="$(cd "${HERE}" && sha256sum "${SOURCES[@]}" | sha256sum | cut -c1-16)"
TRAJ_CACHE_DIR="${TRAJ_CACHE_DIR:-${HOME}/.cache/trajectory-operator}"
FINAL="${TRAJ_CACHE_DIR}/${NAME}/${HASH}"
BINARY="${FINAL}/bin/${NAME}"

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

command -v go >/dev/null || die "go is not on PATH (Go >= 1.26 is needed to build scripts/gitops-health)"
mkdir -p "${TRAJ_CACHE_DIR}/${NAME}"

# One build at a time; whoever waited finds the finished binary.
exec 8>"${TRAJ_CACHE_DIR}/${NAME}/.build.lock"
if ! flock -n 8; then
	log "another build holds ${TRAJ_CACHE_DIR}/${NAME}/.build.lock; waiting for it"
	flock 8
fi
built && done_

# Temporary directories of builds that were killed (the lock says none is running now).
for stale in "${TRAJ_CACHE_DIR}/${NAME}"/.*.building.*; do
	[[ -d "${stale}" ]] || continue
	log "removing ${stale} (left by an interrupted build)"
	rm -rf "${stale}"
done

TMP="$(mktemp -d "${TRAJ_CACHE_DIR}/${NAME}/.${HASH}.building.XXXXXX")"
trap 'rm -rf "${TMP}"' EXIT
mkdir -p "${TMP}/bin" "${TMP}/src"
# Built from a copy: what is built is what was hashed, and -mod=mod never rewrites the
# repository's go.mod or go.sum.
(cd "${HERE}" && cp "${SOURCES[@]}" "${TMP}/src/")

log "building ${HERE} (${HASH}; several minutes on 2 cores, once)"
start=${SECONDS}
if ! (cd "${TMP}/src" && CGO_ENABLED=0 GOFLAGS="-mod=mod -p=${TRAJ_BUILD_JOBS:-2} -buildvcs=false" \
	GOTOOLCHAIN=local nice -n 19 go build -trimpath -ldflags "-s -w" -o "${TMP}/bin/${NAME}" .) \
	>"${TMP}/build.log" 2>&1; then
	mkdir -p "${TRAJ_CACHE_DIR}/build-logs"
	kept="${TRAJ_CACHE_DIR}/build-logs/failed-$(date +%Y%m%d-%H%M%S)-${NAME}.log"
	cp "${TMP}/build.log" "${kept}"
	log "FAILED: go build of ${HERE}; last 40 lines (full log: ${kept}):"
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
log "installed ${FINAL}/bin/${NAME} ($((SECONDS - start)) s)"
done_
