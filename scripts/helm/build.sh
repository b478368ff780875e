#!/usr/bin/env bash
# Builds Helm from its Go module, once per pinned version (scripts/helm/version.env):
#   ${TRAJ_CACHE_DIR}/helm/v<HELM_VERSION>/bin/helm
# It is built in a temporary directory next to its final place and renamed when complete, so an
# interrupted or failed build never leaves a cache entry that looks complete.
#
# Usage: scripts/helm/build.sh [--check | --print-path]
#   --check        exit 0 when helm is already built, 1 otherwise (builds nothing)
#   --print-path   build if needed, then print the helm binary's path on stdout
# Environment: TRAJ_CACHE_DIR (default ~/.cache/trajectory-operator), TRAJ_BUILD_JOBS (default 2).
# Build log: ${TRAJ_CACHE_DIR}/build-logs/ (kept when the build fails).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source-path=SCRIPTDIR source=version.env
source "${HERE}/version.env"

TRAJ_CACHE_DIR="${TRAJ_CACHE_DIR:-${HOME}/.cache/trajectory-operator}"
FINAL="${TRAJ_CACHE_DIR}/helm/v${HELM_VERSION}"
HELM="${FINAL}/bin/helm"

log() { printf '[helm %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
die() {
	log "ERROR: $*"
	exit 1
}

built() { [[ -f "${FINAL}/.complete" && -x "${HELM}" ]]; }

mode="${1:-}"
case "${mode}" in
"" | --print-path) ;;
--check)
	built
	exit
	;;
*) die "unknown argument '${mode}' (usage: $0 [--check | --print-path])" ;;
esac

done_() {
	if [[ "${mode}" == --print-path ]]; then printf '%s\n' "${HELM}"; fi
	exit 0
}

built && done_

command -v go >/dev/null || die "go is not on PATH (Go >= 1.26 is needed to build Helm v${HELM_VERSION})"
mkdir -p "${TRAJ_CACHE_DIR}/helm"

# One build at a time; whoever waited finds the finished binary.
exec 8>"${TRAJ_CACHE_DIR}/helm/.build.lock"
if ! flock -n 8; then
	log "another build holds ${TRAJ_CACHE_DIR}/helm/.build.lock; waiting for it"
	flock 8
fi
built && done_

# Temporary directories of builds that were killed (the lock says none is running now).
for stale in "${TRAJ_CACHE_DIR}"/helm/.v*.building.*; do
	[[ -d "${stale}" ]] || continue
	log "removing ${stale} (left by an interrupted build)"
	rm -rf "${stale}"
done

TMP="$(mktemp -d "${TRAJ_CACHE_DIR}/helm/.v${HELM_VERSION}.building.XXXXXX")"
trap 'rm -rf "${TMP}"' EXIT
mkdir -p "${TMP}/bin"

log "helm v${HELM_VERSION}: building from helm.sh/helm/v4 (a few minutes on 2 cores)"
start=${SECONDS}
# Helm's Makefile sets its version by ldflags; without them `helm version` says only "v4.3".
ldflags="-s -w -X helm.sh/helm/v4/internal/version.version=v${HELM_VERSION}"
ldflags+=" -X helm.sh/helm/v4/internal/version.gitTreeState=clean"
if ! CGO_ENABLED=0 GOFLAGS="-p=${TRAJ_BUILD_JOBS:-2} -buildvcs=false -trimpath" \
	GOTOOLCHAIN="${GOTOOLCHAIN:-local}" GOBIN="${TMP}/bin" \
	nice -n 19 go install -ldflags "${ldflags}" "helm.sh/helm/v4/cmd/helm@v${HELM_VERSION}" \
	>"${TMP}/build.log" 2>&1; then
	mkdir -p "${TRAJ_CACHE_DIR}/build-logs"
	kept="${TRAJ_CACHE_DIR}/build-logs/failed-$(date +%Y%m%d-%H%M%S)-helm.log"
	cp "${TMP}/build.log" "${kept}"
	log "FAILED: go install helm.sh/helm/v4/cmd/helm@v${HELM_VERSION}; last 40 lines (full log: ${kept}):"
	tail -n 40 "${TMP}/build.log" >&2
	exit 1
fi

v="$("${TMP}/bin/helm" version --template '{{.Version}}')"
[[ "${v}" == "v${HELM_VERSION}" ]] || die "the built helm reports version '${v}', want 'v${HELM_VERSION}'"
{
	echo "built=$(date -u +%Y-%m-%dT%H:%M:%SZ)"
	echo "go=$(go env GOVERSION)"
	echo "seconds=$((SECONDS - start))"
} >"${TMP}/.complete"
rm -rf "${FINAL}"
mv "${TMP}" "${FINAL}"
log "installed helm v${HELM_VERSION} into ${FINAL}/bin ($((SECONDS - start)) s)"
done_
