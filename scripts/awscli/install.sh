#!/usr/bin/env bash
# Installs (or reuses) the AWS CLI, the standard S3 client the object-storage benchmark compares
# the worker's plan and merge with (`aws s3 cp` of the same bytes), from PyPI, hash-pinned in
# requirements.txt, with scripts/pip-tool.sh:
#   ${TRAJ_CACHE_DIR:-~/.cache/trajectory-operator}/awscli/<key>/venv/
#
# Usage: install.sh [--print-path] [--force]  (see scripts/pip-tool.sh)
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
exec "${HERE}/../pip-tool.sh" awscli "${HERE}/requirements.txt" venv/bin/aws "$@"
