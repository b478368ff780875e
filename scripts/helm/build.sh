#!/usr/bin/env bash
# Builds Helm from its Go module, once per pinned version (scripts/helm/version.env), with
# scripts/go-tool.sh:
#   ${TRAJ_CACHE_DIR}/helm/v<HELM_VERSION>/bin/helm
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

mode="${1:-}"
case "${mode}" in
"" | --print-path | --check) ;;
*)
	echo "unknown argument '${mode}' (usage: $0 [--check | --print-path])" >&2
	exit 1
	;;
esac
# Helm's Makefile sets its version by ldflags; without them `helm version` says only "v4.3".
ldflags="-X helm.sh/helm/v4/internal/version.version=v${HELM_VERSION}"
ldflags+=" -X helm.sh/helm/v4/internal/version.gitTreeState=clean"
build() { "${HERE}/../go-tool.sh" "$@" helm "${HELM_VERSION}" helm.sh/helm/v4/cmd/helm "${ldflags}"; }
[[ "${mode}" == --check ]] && {
	build --check
	exit
}
helm="$(build --print-path)"
v="$("${helm}" version --template '{{.Version}}')"
if [[ "${v}" != "v${HELM_VERSION}" ]]; then
	rm -rf "$(dirname "$(dirname "${helm}")")"
	echo "[helm] ERROR: the built helm reports version '${v}', want 'v${HELM_VERSION}' (removed)" >&2
	exit 1
fi
if [[ "${mode}" == --print-path ]]; then printf '%s\n' "${helm}"; fi
