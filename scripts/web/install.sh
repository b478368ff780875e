#!/usr/bin/env bash
# Installs what the web tool tests use (worker/tests/web_tools.rs): Debian's searx (the project
# SearXNG forked from; its offline `sqlite` engine searches a local index) and python3-doc (530
# real HTML pages, served by Python's http.server and indexed by scripts/web/build-index.py,
# which the tests run once into ${TRAJ_CACHE_DIR:-~/.cache/trajectory-operator}/web).
#
# Usage: install.sh
# Idempotent: when both packages are installed it prints nothing and takes well under a second.
set -euo pipefail

packages=(searx python3-doc)
missing=()
for package in "${packages[@]}"; do
	if ! dpkg-query -W -f='${Status}' "${package}" 2>/dev/null | grep -q 'install ok installed'; then
		missing+=("${package}")
	fi
done
((${#missing[@]} == 0)) && exit 0

if [[ "$(id -u)" != 0 ]] || ! command -v apt-get >/dev/null 2>&1; then
	echo "web/install.sh: missing ${missing[*]}; install them (apt-get install ${missing[*]})" >&2
	exit 1
fi
log="${TRAJ_CACHE_DIR:-${HOME}/.cache/trajectory-operator}/logs/web-apt-get.log"
mkdir -p "$(dirname "${log}")"
echo "web/install.sh: apt-get install ${missing[*]}" >&2
if ! { apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "${missing[@]}"; } >"${log}" 2>&1; then
	echo "web/install.sh: apt-get install ${missing[*]} failed; the log's tail:" >&2
	tail -n 40 "${log}" >&2
	exit 1
fi
