#!/usr/bin/env bash
# Installs (or reuses) the Python that checks `trajectory-worker export`'s files with each
# format's own code (scripts/formats/validate.py): Harbor's ATIF models and Hugging Face
# datasets, hash-pinned in requirements.txt, with scripts/pip-tool.sh:
#   ${TRAJ_CACHE_DIR:-~/.cache/trajectory-operator}/formats/<key>/venv/
# Harbor needs Python 3.12 or later: the first of python3.12, python3.13 on PATH or in pyenv's
# versions is used (FORMATS_PYTHON names another).
#
# Usage: install.sh [--print-path] [--force]  (--print-path prints the venv's python)
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

# shellcheck source=scripts/lib.sh
source "${HERE}/../lib.sh"
python="$(python_312_or_later "${FORMATS_PYTHON:-}")" || python=""
[[ -n "${python}" ]] || {
	echo "[formats] no Python 3.12 or later found (Harbor needs it): install one, or name it in FORMATS_PYTHON" >&2
	exit 1
}
PIP_TOOL_PYTHON="${python}" PIP_TOOL_NO_DEPS=1 exec "${HERE}/../pip-tool.sh" formats \
	"${HERE}/requirements.txt" venv/bin/python "$@"
