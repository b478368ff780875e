#!/usr/bin/env bash
# Builds versitygw (versity/versitygw: an S3 gateway; with its POSIX backend, a real S3-compatible
# server over a local directory) from its Go module, once per pinned version, with
# scripts/go-tool.sh:
#   ${TRAJ_CACHE_DIR}/versitygw/v<VERSITYGW_VERSION>/bin/versitygw
# The object-storage tests and benchmarks (spec.storage.object, `local --output s3://...`) run
# against it.
#
# Usage: scripts/versitygw/build.sh [--check | --print-path]
#   --check        exit 0 when versitygw is already built, 1 otherwise (builds nothing)
#   --print-path   build if needed, then print the versitygw binary's path on stdout
# Environment: TRAJ_CACHE_DIR (default ~/.cache/trajectory-operator), TRAJ_BUILD_JOBS (default 2).
set -euo pipefail

VERSITYGW_VERSION="1.8.0"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
export GOTOOLCHAIN="${GOTOOLCHAIN:-go1.26.10+auto}"
exec "${HERE}/../go-tool.sh" "$@" versitygw "${VERSITYGW_VERSION}" \
	github.com/versity/versitygw/cmd/versitygw
