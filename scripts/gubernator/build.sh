#!/usr/bin/env bash
# Builds Gubernator (gubernator-io/gubernator: the distributed rate limiter through which a run's
# pods, and runs that name the same key, share their model's limits; spec.model.limits.gubernator)
# from its Go module, once per pinned version, with scripts/go-tool.sh:
#   ${TRAJ_CACHE_DIR}/gubernator/v<GUBERNATOR_VERSION>/bin/gubernator
# Its go.mod asks for a newer Go patch release than Debian's may be: GOTOOLCHAIN lets go fetch that
# toolchain from the Go module proxy.
#
# Usage: scripts/gubernator/build.sh [--check | --print-path]
#   --check        exit 0 when gubernator is already built, 1 otherwise (builds nothing)
#   --print-path   build if needed, then print the gubernator binary's path on stdout
# Environment: TRAJ_CACHE_DIR (default ~/.cache/trajectory-operator), TRAJ_BUILD_JOBS (default 2).
set -euo pipefail

GUBERNATOR_VERSION="2.21.0"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
export GOTOOLCHAIN="${GOTOOLCHAIN:-go1.26.10+auto}"
exec "${HERE}/../go-tool.sh" "$@" gubernator "${GUBERNATOR_VERSION}" \
	github.com/gubernator-io/gubernator/v2/cmd/gubernator
