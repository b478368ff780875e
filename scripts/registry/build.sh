#!/usr/bin/env bash
# Builds crane (go-containerregistry's registry client, which also serves a registry: `crane
# registry serve`) from its Go module, once per pinned version (version.env), with
# scripts/go-tool.sh:
#   ${TRAJ_CACHE_DIR}/crane/v<CRANE_VERSION>/bin/crane
#
# Usage: scripts/registry/build.sh [--check | --print-path]
#   --check        exit 0 when crane is already built, 1 otherwise (builds nothing)
#   --print-path   build if needed, then print the crane binary's path on stdout
# Environment: TRAJ_CACHE_DIR (default ~/.cache/trajectory-operator), TRAJ_BUILD_JOBS (default 2).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source-path=SCRIPTDIR source=version.env
source "${HERE}/version.env"
exec "${HERE}/../go-tool.sh" "$@" crane "${CRANE_VERSION}" github.com/google/go-containerregistry/cmd/crane
