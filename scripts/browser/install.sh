#!/usr/bin/env bash
# Installs Debian's chromium, the browser the `browser` toolset drives over the DevTools protocol
# (worker/src/tools/browser; its tests start it headless against local pages).
# Idempotent: does nothing (and says one line) when the package is installed. Runs as root, with
# apt-get only: no browser build is downloaded from anywhere else.
#
# Usage: scripts/browser/install.sh [--check]
#   --check   exit 0 when chromium is installed, 1 otherwise (installs nothing)
# Log of an install: ${TRAJ_CACHE_DIR:-~/.cache/trajectory-operator}/build-logs/browser-install-<time>.log
set -euo pipefail

TRAJ_CACHE_DIR="${TRAJ_CACHE_DIR:-${HOME}/.cache/trajectory-operator}"
# fonts-liberation: without any font, pages render without glyphs and text inputs have no size,
# so clicks on them miss.
PACKAGES=(chromium fonts-liberation)

log() { printf '[browser %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
die() {
	log "ERROR: $*"
	exit 1
}

CHECK=0
for arg in "$@"; do
	case "${arg}" in
	--check) CHECK=1 ;;
	-h | --help)
		sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'
		exit 0
		;;
	*) die "unknown argument: ${arg} (see --help)" ;;
	esac
done

# shellcheck source=scripts/apt.sh
source "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/../apt.sh"

mapfile -t missing < <(apt_missing "${PACKAGES[@]}")
if [[ ${#missing[@]} -eq 0 ]]; then
	[[ "${CHECK}" == 1 ]] || log "installed: ${PACKAGES[*]} ($(chromium --version 2>/dev/null || echo 'chromium --version failed'))"
	exit 0
fi
[[ "${CHECK}" == 0 ]] || exit 1
start=${SECONDS}
apt_install browser-install "${missing[@]}"
command -v chromium >/dev/null || die "chromium is not on PATH after installing ${PACKAGES[*]}"
log "installed ${missing[*]}: $(chromium --version) ($((SECONDS - start)) s)"
