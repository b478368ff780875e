# shellcheck shell=bash
# Debian packages for the scripts that need some (scripts/cluster/install-node.sh,
# scripts/browser/install.sh). Source it after defining log and die; it defines functions only.

# apt_missing PKG...: the packages dpkg does not report as installed, one per line.
apt_missing() {
	local p
	for p in "$@"; do
		[[ "$(dpkg-query -W -f='${db:Status-Status}' "${p}" 2>/dev/null)" == installed ]] || echo "${p}"
	done
}

# apt_install LABEL PKG...: installs the packages with apt-get (root only; `apt-get update` first),
# logging to ${TRAJ_CACHE_DIR}/build-logs/LABEL-<time>.log; dies naming any package still missing.
apt_install() {
	local label="$1" still
	shift
	[[ "$(id -u)" -eq 0 ]] || die "missing Debian packages: $*; install them as root: apt-get install $*"
	local apt_log
	apt_log="${TRAJ_CACHE_DIR:-${HOME}/.cache/trajectory-operator}/build-logs/${label}-$(date +%Y%m%d-%H%M%S).log"
	mkdir -p "$(dirname "${apt_log}")"
	log "installing $* (apt-get; log: ${apt_log})"
	if ! apt-get update >"${apt_log}" 2>&1; then
		tail -n 20 "${apt_log}" >&2
		die "apt-get update failed (log: ${apt_log})"
	fi
	if ! DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "$@" >>"${apt_log}" 2>&1; then
		tail -n 20 "${apt_log}" >&2
		log "apt-get install failed (log: ${apt_log})"
	fi
	mapfile -t still < <(apt_missing "$@")
	[[ ${#still[@]} -eq 0 ]] || die "Debian package(s) not installed: ${still[*]} (log: ${apt_log})"
}
