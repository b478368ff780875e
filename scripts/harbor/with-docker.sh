#!/usr/bin/env bash
# Runs a command with a Docker daemon of its own for its duration: Harbor's `docker` environment (the
# benchmark that runs Harbor beside this project on the same tasks) needs dockerd, and this machine has
# no systemd to start one. In order:
#   1. scripts/harbor/install.sh (Debian's docker.io, the Compose v2 plugin, Harbor's venv; warm: ~1 s);
#   2. dockerd in the background (default data root /var/lib/docker, socket /var/run/docker.sock), its
#      log in ${TRAJ_CACHE_DIR}/harbor/logs/dockerd-<time>.log; waits until `docker info` answers;
#   3. the image local/debian:12 (HARBOR_BASE_IMAGE), the tasks' base: a `docker import` of the
#      project's cached Debian root filesystem (scripts/images/build.sh --rootfs-only makes or finds
#      it), imported again when that file changes (the image's label traj.rootfs names it);
#   4. CMD, with DOCKER_CONFIG (the compose plugin; ~/.docker is not used), DOCKER_HOST,
#      HARBOR_TELEMETRY=0 (Harbor posts PostHog events otherwise) and the venv's `harbor` first on PATH
#      (only it: a directory holding one symlink; HARBOR is its path too);
#   5. whatever CMD returns (and on an interrupt): stops dockerd by its pid (it stops the containers
#      still running, then its containerd), and puts back what dockerd changed on the host: the
#      ip_forward sysctl, and the Docker iptables rules, chains and bridges that were not there before.
# Exits with CMD's status. CMD runs in the foreground: a TERM or INT sent to this script alone takes
# effect when CMD returns; signal the process group to stop both (Ctrl-C in a terminal does).
#
# dockerd starts a containerd of its own ("managed": socket /var/run/docker/containerd/containerd.sock,
# state under /var/run/docker/containerd, root /var/lib/docker/containerd) when no file
# /run/containerd/containerd.sock exists; when one does, dockerd 20.10 would put its containers in
# whichever containerd listens there, so this script refuses to start. The local Kubernetes node
# (scripts/cluster/node-up.sh) runs its containerd on a socket and root under the cache, which dockerd
# does not look at; the two can run at the same time.
#
# Usage: scripts/harbor/with-docker.sh CMD [ARG...]    (root)
#   e.g. scripts/harbor/with-docker.sh harbor run -p TASKS -e docker -a scripted_agent:ScriptedAgent ...
# Environment: TRAJ_CACHE_DIR, HARBOR_BASE_IMAGE (default local/debian:12), HARBOR_DOCKERD_ARGS (extra
#   dockerd arguments, split on spaces), HARBOR_DOCKERD_WAIT (seconds to wait for it; default 60).
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=scripts/lib.sh
source "${HERE}/../lib.sh"

log() { printf '[with-docker %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
die() {
	log "ERROR: $*"
	exit 1
}
case "${1:-}" in
"" | -h | --help)
	sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'
	[[ -n "${1:-}" ]] || exit 2
	exit 0
	;;
esac
[[ "$(id -u)" -eq 0 ]] || die "dockerd needs root"

export TRAJ_CACHE_DIR="${TRAJ_CACHE_DIR:-${HOME}/.cache/trajectory-operator}"
BASE_IMAGE="${HARBOR_BASE_IMAGE:-local/debian:12}"
SYSTEM_CONTAINERD_SOCK=/run/containerd/containerd.sock
MANAGED_CONTAINERD_PIDFILE=/var/run/docker/containerd/containerd.pid
LOGS="${TRAJ_CACHE_DIR}/harbor/logs"

harbor="$("${HERE}/install.sh" --print-path)"
DOCKER_CONFIG="$("${HERE}/install.sh" --print-docker-config)"
export DOCKER_CONFIG DOCKER_HOST=unix:///var/run/docker.sock HARBOR_TELEMETRY=0
rootfs="$("${HERE}/../images/build.sh" --rootfs-only 2>"${TMPDIR:-/tmp}/with-docker-rootfs.$$.log")" || {
	cat "${TMPDIR:-/tmp}/with-docker-rootfs.$$.log" >&2
	rm -f "${TMPDIR:-/tmp}/with-docker-rootfs.$$.log"
	die "scripts/images/build.sh --rootfs-only failed"
}
rm -f "${TMPDIR:-/tmp}/with-docker-rootfs.$$.log"
[[ -f "${rootfs}" ]] || die "no root filesystem at '${rootfs}'"

if pid="$(pgrep -x dockerd)"; then
	die "a dockerd is already running (pid ${pid//$'\n'/ }): this script starts and stops its own"
fi
[[ ! -e "${SYSTEM_CONTAINERD_SOCK}" ]] ||
	die "${SYSTEM_CONTAINERD_SOCK} exists: dockerd would use that containerd rather than start its own; stop it (or remove the stale socket)"

# --- what dockerd changes on the host, to put back afterwards -------------------------------------------
run_dir="$(mktemp -d "${TMPDIR:-/tmp}/with-docker.XXXXXX")"
ip_forward_before="$(cat /proc/sys/net/ipv4/ip_forward)"
iptables-save 2>/dev/null | grep -v '^#' >"${run_dir}/iptables-before.txt" || true
nft list tables 2>/dev/null | sort >"${run_dir}/nft-tables-before.txt" || true
ip -o link show | awk -F': ' '{print $2}' | sed 's/@.*//' | sort >"${run_dir}/links-before.txt"
mkdir -p "${run_dir}/bin"
ln -s "${harbor}" "${run_dir}/bin/harbor"
export HARBOR="${harbor}"

# Deletes the iptables rules that mention Docker's chains or bridges, then Docker's chains, that were
# not there before (the rules of anything else started meanwhile, e.g. a local node, stay).
restore_iptables() {
	local now table line chain
	command -v iptables-save >/dev/null || return 0
	now="$(iptables-save 2>/dev/null | grep -v '^#')" || return 0
	table=""
	while IFS= read -r line; do
		case "${line}" in
		\**) table="${line#\*}" ;;
		-A\ *DOCKER* | -A\ *docker0* | -A\ *br-[0-9a-f]*)
			grep -qxF -- "${line}" "${run_dir}/iptables-before.txt" ||
				eval "iptables -w -t ${table} -D ${line#-A }" 2>/dev/null ||
				log "could not delete iptables rule (${table}) ${line}"
			;;
		esac
	done <<<"${now}"
	table=""
	while IFS= read -r line; do
		case "${line}" in
		\**) table="${line#\*}" ;;
		:DOCKER*)
			chain="${line#:}"
			chain="${chain%% *}"
			if ! grep -q "^:${chain} " "${run_dir}/iptables-before.txt"; then
				iptables -w -t "${table}" -F "${chain}" 2>/dev/null || true
				iptables -w -t "${table}" -X "${chain}" 2>/dev/null || log "could not delete iptables chain ${table}/${chain}"
			fi
			;;
		esac
	done <<<"${now}"
	# dockerd sets the FORWARD policy to DROP when it turns ip_forward on (ACCEPT is the policy of a
	# filter table that did not exist before, too).
	if ! grep -q '^:FORWARD DROP' "${run_dir}/iptables-before.txt" && iptables -w -S FORWARD 2>/dev/null | grep -qx -- '-P FORWARD DROP'; then
		iptables -w -P FORWARD ACCEPT 2>/dev/null || log "could not set the FORWARD policy back to ACCEPT"
	fi
	# iptables-nft leaves the tables it made (ip filter, ip nat): remove those that were not there before
	# and now hold no rule and no chain of their own.
	command -v nft >/dev/null || return 0
	local family name
	while read -r _ family name; do
		[[ -n "${name}" ]] || continue
		[[ "${family}" == ip ]] || continue
		if ! iptables-save -t "${name}" 2>/dev/null | grep -v '^:\(INPUT\|OUTPUT\|FORWARD\|PREROUTING\|POSTROUTING\) ACCEPT ' |
			grep -q '^[-:]'; then
			nft delete table "${family}" "${name}" 2>/dev/null || log "could not delete nft table ${family} ${name}"
		fi
	done < <(nft list tables 2>/dev/null | sort | comm -13 "${run_dir}/nft-tables-before.txt" -)
}

dockerd_pid=""
cleanup() {
	local rc=$? containerd_pid="" link
	trap - EXIT INT TERM
	if [[ -n "${dockerd_pid}" ]]; then
		containerd_pid="$(cat "${MANAGED_CONTAINERD_PIDFILE}" 2>/dev/null || true)"
		if kill -0 "${dockerd_pid}" 2>/dev/null; then
			log "stopping dockerd ${dockerd_pid}"
			# dockerd gives running containers their stop timeout (10 s), then stops its containerd.
			stop_pids 60 "${dockerd_pid}"
		fi
		wait "${dockerd_pid}" 2>/dev/null || true
		if [[ -n "${containerd_pid}" ]] && kill -0 "${containerd_pid}" 2>/dev/null; then
			log "dockerd's containerd ${containerd_pid} outlived it: stopping it"
			stop_pids 10 "${containerd_pid}"
		fi
		restore_iptables
		for link in $(ip -o link show | awk -F': ' '{print $2}' | sed 's/@.*//' | grep -E '^(docker0|br-[0-9a-f]{12})$' |
			sort | comm -13 "${run_dir}/links-before.txt" -); do
			ip link del "${link}" 2>/dev/null || true
		done
		if [[ "$(cat /proc/sys/net/ipv4/ip_forward)" != "${ip_forward_before}" ]]; then
			echo "${ip_forward_before}" >/proc/sys/net/ipv4/ip_forward || log "could not set ip_forward back to ${ip_forward_before}"
		fi
		# Compose's buildx keeps a record per build (one per Harbor trial) that nothing reads back.
		rm -rf "${DOCKER_CONFIG}/buildx/refs" "${DOCKER_CONFIG}/buildx/activity"
		log "dockerd stopped (log: ${dockerd_log})"
	fi
	rm -rf "${run_dir}"
	exit "${rc}"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# --- dockerd ------------------------------------------------------------------------------------------------
mkdir -p "${LOGS}"
# The logs of the 20 latest runs are kept.
find "${LOGS}" -maxdepth 1 -name 'dockerd-*.log' -printf '%T@ %p\n' | sort -rn | tail -n +20 | cut -d' ' -f2- |
	xargs -r rm -f
dockerd_log="${LOGS}/dockerd-$(date +%Y%m%d-%H%M%S).log"
read -r -a extra_args <<<"${HARBOR_DOCKERD_ARGS:-}"
log "starting dockerd (log: ${dockerd_log})"
setsid dockerd --host "${DOCKER_HOST}" "${extra_args[@]}" >"${dockerd_log}" 2>&1 </dev/null &
dockerd_pid=$!
wait_s="${HARBOR_DOCKERD_WAIT:-60}"
start=${SECONDS}
until docker info --format '{{.ServerVersion}}' >/dev/null 2>&1; do
	if ! kill -0 "${dockerd_pid}" 2>/dev/null; then
		tail -n 30 "${dockerd_log}" >&2
		die "dockerd exited while starting (log: ${dockerd_log})"
	fi
	((SECONDS - start < wait_s)) || {
		tail -n 30 "${dockerd_log}" >&2
		die "docker info did not answer within ${wait_s} s (log: ${dockerd_log})"
	}
	sleep 0.2
done
# dockerd 20.10 logs this when it starts its own containerd (it logs nothing of the kind when it connects
# to /run/containerd/containerd.sock, which was checked absent above).
grep -q 'libcontainerd: started new containerd process' "${dockerd_log}" ||
	die "dockerd did not start a containerd of its own (log: ${dockerd_log})"
log "dockerd ${dockerd_pid} answers ($((SECONDS - start)) s; its containerd: pid $(cat "${MANAGED_CONTAINERD_PIDFILE}" 2>/dev/null || echo '?'))"

# --- the tasks' base image ------------------------------------------------------------------------------
rootfs_name="$(basename "${rootfs}")"
if [[ "$(docker image inspect --format '{{index .Config.Labels "traj.rootfs"}}' "${BASE_IMAGE}" 2>/dev/null)" != "${rootfs_name}" ]]; then
	log "importing ${rootfs} as ${BASE_IMAGE}"
	docker import --change "LABEL traj.rootfs=${rootfs_name}" --change 'CMD ["/bin/bash"]' \
		"${rootfs}" "${BASE_IMAGE}" >/dev/null || die "docker import of ${rootfs} failed"
fi

# --- the command --------------------------------------------------------------------------------------------
rc=0
PATH="${run_dir}/bin:${PATH}" "$@" || rc=$?
exit "${rc}"
