#!/usr/bin/env bash
# Builds Karpenter with its kwok provider (sigs.k8s.io/karpenter/kwok: the node autoscaler that
# creates kwok nodes for pending pods and consolidates them away, issue 41's autoscaling tests)
# from its Go module, once per pinned version, with scripts/go-tool.sh:
#   ${TRAJ_CACHE_DIR}/karpenter/v<KARPENTER_VERSION>/bin/kwok
# Its CRDs ship in the module zip, which `go install` leaves in the module cache: --print-src
# prints that directory (kwok/charts/crds/ and kwok/apis/crds/).
#
# Usage: scripts/karpenter/build.sh [--check | --print-path | --print-src]
# Environment: TRAJ_CACHE_DIR (default ~/.cache/trajectory-operator), TRAJ_BUILD_JOBS (default 2).
set -euo pipefail

KARPENTER_VERSION="1.14.1"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
export GOTOOLCHAIN="${GOTOOLCHAIN:-local}"
if [[ "${1:-}" == --print-src ]]; then
	"${HERE}/../go-tool.sh" --print-path karpenter "${KARPENTER_VERSION}" sigs.k8s.io/karpenter/kwok >/dev/null
	printf '%s\n' "$(go env GOMODCACHE)/sigs.k8s.io/karpenter@v${KARPENTER_VERSION}"
	exit 0
fi
exec "${HERE}/../go-tool.sh" "$@" karpenter "${KARPENTER_VERSION}" sigs.k8s.io/karpenter/kwok
