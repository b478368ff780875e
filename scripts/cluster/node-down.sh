#!/usr/bin/env bash
# Stops the real node node-up.sh started in TRAJ_CLUSTER_DIR and removes everything it made, using what
# node-up.sh recorded in ${TRAJ_CLUSTER_DIR}/node/record/ (down.sh calls it first, before the control plane
# stops). Safe after a failed or killed start, and any number of times. In order:
#   1. the kubelet; then every container task (SIGKILL), containerd, its shims, and any process left in
#      the node's cgroups;
#   2. every mount under the state directory (pod volumes, container root filesystems, containerd's shm)
#      and the pods' network namespaces under /run/netns, lazily when busy;
#   3. the bridge and the veth devices on it; iptables rules and chains that were not there before;
#   4. the kernel tunables the kubelet set, written back to their recorded values (if node-up.sh did
#      not get to it); then the whole
#      `sysctl -a` is compared with the one recorded before the start, and differences are reported;
#   5. the cgroups (the node's cgroup root, and each parent directory node-up.sh had to make);
#   6. libcni's cache entries of the node's network, and the directories node-up.sh found missing;
#   7. ${TRAJ_CLUSTER_DIR}/node itself.
#
# Usage: scripts/cluster/node-down.sh [--quiet]
set -euo pipefail

# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/lib.sh"
# shellcheck source=scripts/lib.sh
source "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/../lib.sh"

QUIET=0
[[ "${1:-}" != "--quiet" ]] || QUIET=1
DIR="${TRAJ_CLUSTER_DIR%/}"
[[ -n "${DIR}" && "${DIR}" != "/" ]] || die "TRAJ_CLUSTER_DIR must name a directory, got '${TRAJ_CLUSTER_DIR}'"
NODE="${DIR}/node"
REC="${NODE}/record"
PIDS="${DIR}/pids"
SOCK="${NODE}/containerd/containerd.sock"
if [[ ! -d "${NODE}" ]]; then
	[[ "${QUIET}" == 1 ]] || log "no real node in ${DIR}"
	exit 0
fi
say() { [[ "${QUIET}" == 1 ]] || log "$@"; }
warnings=0
warn() {
	log "WARNING: $*"
	warnings=$((warnings + 1))
}

# cmdline_has PID TEXT: the process is alive and its command line contains TEXT.
cmdline_has() {
	local cmdline
	cmdline="$(tr '\0' ' ' 2>/dev/null <"/proc/$1/cmdline")" || return 1
	[[ "${cmdline}" == *"$2"* ]]
}

# recorded_pid NAME: the pid of component NAME, if that process is ours (names the state directory).
recorded_pid() {
	local pid
	pid="$(cat "${PIDS}/$1.pid" 2>/dev/null || true)"
	if [[ "${pid}" =~ ^[0-9]+$ ]] && cmdline_has "${pid}" "${DIR}/"; then
		echo "${pid}"
	fi
}

# pids_matching TEXT: processes whose command line contains TEXT.
pids_matching() {
	local proc
	for proc in /proc/[0-9]*; do
		if cmdline_has "${proc#/proc/}" "$1"; then
			echo "${proc#/proc/}"
		fi
	done
}

CGROUP_ROOT="$(cat "${REC}/cgroup-root.txt" 2>/dev/null || true)"
# cgroup_pids: every process in the node's cgroups (pods' containers), over all hierarchies.
cgroup_pids() {
	[[ -n "${CGROUP_ROOT}" ]] || return 0
	local d
	for d in /sys/fs/cgroup/*/"${CGROUP_ROOT#/}"; do
		[[ -d "${d}" ]] || continue
		find "${d}" -name cgroup.procs -exec cat {} + 2>/dev/null
	done | sort -un
}

stop_processes() {
	local pid
	pid="$(recorded_pid kubelet)"
	if [[ -n "${pid}" ]]; then
		say "stopping kubelet (pid ${pid})"
		stop_pids 10 "${pid}"
	fi
	pid="$(recorded_pid containerd)"
	if [[ -n "${pid}" ]] && ctr --address "${SOCK}" version >/dev/null 2>&1; then
		local id
		for id in $(ctr --address "${SOCK}" -n k8s.io tasks ls -q 2>/dev/null); do
			ctr --address "${SOCK}" -n k8s.io tasks delete --force "${id}" >/dev/null 2>&1 ||
				ctr --address "${SOCK}" -n k8s.io tasks kill -s SIGKILL "${id}" >/dev/null 2>&1 || true
		done
	fi
	if [[ -n "${pid}" ]]; then
		say "stopping containerd (pid ${pid})"
		stop_pids 10 "${pid}"
	fi
	# Shims outlive containerd; their command line names containerd's socket in the state directory.
	mapfile -t pids < <(pids_matching "-address ${SOCK}")
	if [[ ${#pids[@]} -gt 0 ]]; then
		say "stopping ${#pids[@]} containerd-shim(s): ${pids[*]}"
		stop_pids 5 "${pids[@]}"
	fi
	mapfile -t pids < <(cgroup_pids)
	if [[ ${#pids[@]} -gt 0 ]]; then
		say "killing ${#pids[@]} process(es) left in the node's cgroups: ${pids[*]}"
		kill -KILL "${pids[@]}" 2>/dev/null || true
		sleep 0.5
	fi
	pid="$(recorded_pid registry)"
	if [[ -n "${pid}" ]]; then
		say "stopping the image registry (pid ${pid})"
		stop_pids 5 "${pid}"
	fi
	# Left-overs of a killed run without pid files: a kubelet, containerd or registry started with our
	# config or state.
	mapfile -t pids < <(
		pids_matching "${NODE}/kubelet/config.yaml"
		pids_matching "${NODE}/containerd/config.toml"
		pids_matching "--disk ${NODE}/registry"
	)
	if [[ ${#pids[@]} -gt 0 ]]; then
		say "stopping left-over node process(es): ${pids[*]}"
		stop_pids 5 "${pids[@]}"
	fi
}

# unmount_all: mounts under the state directory, and network namespaces (/run/netns) made since the start.
unmount_all() {
	local targets=() t
	mapfile -t targets < <(findmnt -rn -o TARGET | grep -F "${DIR}/" | sort -r)
	if [[ -f "${REC}/mounts-before.txt" ]]; then
		mapfile -t -O "${#targets[@]}" targets < <(findmnt -rn -o TARGET | grep -E '^(/var)?/run/netns/cni-' |
			grep -vxF -f "${REC}/mounts-before.txt" | sort -r)
	fi
	[[ ${#targets[@]} -gt 0 ]] || return 0
	say "unmounting ${#targets[@]} mount(s) of the node"
	for t in "${targets[@]}"; do
		# findmnt escapes blanks as \x20.
		t="$(printf '%b' "${t}")"
		umount "${t}" 2>/dev/null || umount -l "${t}" 2>/dev/null || umount -R -l "${t}" 2>/dev/null || true
		if [[ "${t}" == */run/netns/cni-* ]]; then
			rm -f "${t}"
		fi
	done
	if findmnt -rn -o TARGET | grep -qF "${DIR}/"; then
		warn "mounts left under ${DIR}: $(findmnt -rn -o TARGET | grep -F "${DIR}/" | tr '\n' ' ')"
		return 1
	fi
}

remove_network() {
	local bridge link
	bridge="$(cat "${REC}/bridge.txt" 2>/dev/null || true)"
	if [[ -n "${bridge}" ]] && ip link show "${bridge}" >/dev/null 2>&1; then
		for link in $(ip -o link show master "${bridge}" | awk -F': ' '{print $2}' | sed 's/@.*//'); do
			ip link del "${link}" 2>/dev/null || true
		done
		ip link del "${bridge}"
		say "removed the bridge ${bridge} and its veth devices"
	fi
	local save
	for save in iptables ip6tables; do
		restore_rules "${save}"
	done
	# iptables-nft leaves the (now empty) nft tables it made: remove the tables that were not there before.
	if command -v nft >/dev/null && [[ -f "${REC}/nft-tables-before.txt" ]]; then
		local table
		while IFS= read -r table; do
			[[ -n "${table}" ]] || continue
			# shellcheck disable=SC2086 # "table FAMILY NAME" splits into words on purpose
			nft delete ${table} 2>/dev/null || warn "could not delete nft ${table}"
			say "removed nft ${table} (made since the node started)"
		done < <(nft list tables 2>/dev/null | sort | comm -13 "${REC}/nft-tables-before.txt" -)
	fi
}

# restore_rules iptables|ip6tables: delete the rules, then the chains, that were not there before the start.
restore_rules() {
	local cmd="$1" before="${REC}/$1-before.txt" now table line chain
	command -v "${cmd}-save" >/dev/null || return 0
	[[ -f "${before}" ]] || return 0
	now="$("${cmd}-save" 2>/dev/null | grep -v '^#')" || return 0
	[[ "${now}" != "$(cat "${before}")" ]] || return 0
	# Rules: "-A CHAIN ..." lines under "*table" that were not there before.
	table=""
	while IFS= read -r line; do
		case "${line}" in
		\**) table="${line#\*}" ;;
		-A\ *)
			if ! grep -qxF -- "${line}" "${before}"; then
				eval "${cmd} -w -t ${table} -D ${line#-A }" 2>/dev/null || warn "could not delete ${cmd} rule (${table}) ${line}"
			fi
			;;
		esac
	done <<<"${now}"
	# Chains: ":NAME POLICY [..]" lines that were not there before (user chains: policy "-").
	table=""
	while IFS= read -r line; do
		case "${line}" in
		\**) table="${line#\*}" ;;
		:*)
			chain="${line#:}"
			chain="${chain%% *}"
			if ! grep -q "^:${chain} " "${before}"; then
				"${cmd}" -w -t "${table}" -F "${chain}" 2>/dev/null || true
				"${cmd}" -w -t "${table}" -X "${chain}" 2>/dev/null || true
			fi
			;;
		esac
	done <<<"${now}"
	say "${cmd}: removed the rules and chains added since the node started"
}

restore_sysctls() {
	local restored
	[[ -f "${REC}/sysctl-kubelet-before.txt" ]] || return 0
	# node-up.sh wrote them back once the node was Ready; again here for a start that failed before that.
	restored="$(restore_kernel_tunables "${REC}/sysctl-kubelet-before.txt")" ||
		warn "could not restore the kernel tunables of ${REC}/sysctl-kubelet-before.txt"
	[[ -z "${restored}" ]] || say "sysctls restored: $(tr '\n' ' ' <<<"${restored}")"
	[[ -f "${REC}/sysctl-before.txt" ]] || return 0
	# Counters and per-device keys (of devices that come and go) change by themselves: compare the rest.
	local volatile='^(fs\.(dentry-state|file-nr|inode-nr|inode-state|quota\.)|kernel\.(random\.|ns_last_pid|pty\.nr|sched_domain)|net\.(ipv4|ipv6)\.conf\.|net\.ipv6\.neigh\.|net\.ipv4\.neigh\.|net\.netfilter\.nf_conntrack_count|vm\.stat_refresh|net\.core\.netdev_rss_key|dev\.cdrom)'
	local changed
	changed="$(diff <(grep -vE "${volatile}" "${REC}/sysctl-before.txt") <(sysctl -a 2>/dev/null | sort | grep -vE "${volatile}") |
		grep '^[<>]' || true)"
	if [[ -n "${changed}" ]]; then
		warn "sysctls differ from before the node started (< before, > now):"
		printf '%s\n' "${changed}" >&2
	fi
}

remove_cgroups() {
	[[ -n "${CGROUP_ROOT}" ]] || return 0
	local d
	for d in /sys/fs/cgroup/*/"${CGROUP_ROOT#/}"; do
		[[ -d "${d}" ]] || continue
		find "${d}" -depth -type d -exec rmdir {} \; 2>/dev/null || true
		[[ ! -d "${d}" ]] || warn "cgroup ${d} could not be removed: $(find "${d}" -name cgroup.procs -exec cat {} + | tr '\n' ' ')"
	done
	if [[ -f "${REC}/cgroups-created.txt" ]]; then
		# Deepest first (the file lists parents before children).
		tac "${REC}/cgroups-created.txt" | while IFS= read -r d; do
			[[ ! -d "${d}" ]] || rmdir "${d}" 2>/dev/null || warn "cgroup ${d} could not be removed"
		done
	fi
}

remove_host_files() {
	local d id
	# libcni's cache (/var/lib/cni/results/<network>-<sandbox id>-<interface>): entries of our network,
	# and of containerd's loopback network for our sandboxes (left when containerd died before the
	# sandbox's CNI DEL).
	rm -f /var/lib/cni/results/"${CNI_NETWORK}"-* 2>/dev/null || true
	for d in "${NODE}"/containerd/{root,state}/io.containerd.grpc.v1.cri/sandboxes/*/; do
		[[ -d "${d}" ]] || continue
		id="$(basename "${d}")"
		rm -f /var/lib/cni/results/*-"${id}"-* 2>/dev/null || true
	done
	[[ -f "${REC}/dirs-created.txt" ]] || return 0
	while IFS= read -r d; do
		case "${d}" in
		/run/netns) rmdir /run/netns 2>/dev/null || true ;;
		/var/lib/cni) find /var/lib/cni -depth -type d -empty -delete 2>/dev/null || true ;;
		/var/lib/kubelet)
			rm -f /var/lib/kubelet/device-plugins/kubelet.sock
			find /var/lib/kubelet -depth -type d -empty -delete 2>/dev/null || true
			;;
		/run/mount)
			rm -f /run/mount/utab
			rmdir /run/mount 2>/dev/null || true
			;;
		/run/containerd)
			# Shims' sockets (/run/containerd/s) and the runtime's empty directories; nothing else runs containerd here.
			find /run/containerd -depth \( -type s -o -type d -empty \) -delete 2>/dev/null || true
			;;
		esac
	done <"${REC}/dirs-created.txt"
}

stop_processes
unmount_all || true
remove_network
restore_sysctls
remove_cgroups
remove_host_files
if findmnt -rn -o TARGET | grep -qF "${DIR}/"; then
	die "mounts remain under ${DIR}; not removing ${NODE} (see findmnt)"
fi
rm -rf "${NODE}"
rm -f "${PIDS}/kubelet.pid" "${PIDS}/containerd.pid"
if [[ "${warnings}" -gt 0 ]]; then
	log "real node removed with ${warnings} warning(s) (above)"
else
	say "real node removed: processes, mounts, bridge, rules, sysctls, cgroups, ${NODE}"
fi
