#!/usr/bin/env bash
# Builds Kueue (sigs.k8s.io/kueue: the job queueing controller a cluster may put in front of a
# run's Jobs; spec.queueName) from its Go module, once per pinned version, with
# scripts/go-tool.sh:
#   ${TRAJ_CACHE_DIR}/kueue/v<KUEUE_VERSION>/bin/kueue
# Its CRDs and webhook manifests ship in the module zip, which `go install` leaves in the module
# cache: --print-src prints that directory (the tests apply the CRD bases and register the job
# and Kueue webhooks from it).
#
# Usage: scripts/kueue/build.sh [--check | --print-path | --print-src]
# Environment: TRAJ_CACHE_DIR (default ~/.cache/trajectory-operator), TRAJ_BUILD_JOBS (default 2).
set -euo pipefail

KUEUE_VERSION="0.19.2"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
export GOTOOLCHAIN="${GOTOOLCHAIN:-local}"
if [[ "${1:-}" == --print-src ]]; then
	"${HERE}/../go-tool.sh" --print-path kueue "${KUEUE_VERSION}" sigs.k8s.io/kueue/cmd/kueue >/dev/null
	src="$(go env GOMODCACHE)/sigs.k8s.io/kueue@v${KUEUE_VERSION}"
	if [[ ! -d "${src}/config/components/crd/bases" ]]; then
		GOFLAGS=-mod=mod go mod download "sigs.k8s.io/kueue@v${KUEUE_VERSION}" >&2
	fi
	printf '%s\n' "${src}"
	exit 0
fi
exec "${HERE}/../go-tool.sh" "$@" kueue "${KUEUE_VERSION}" sigs.k8s.io/kueue/cmd/kueue
