#!/usr/bin/env bash
# Installs the Debian packages the real node (up.sh --real-node) runs on, with apt-get only:
#   containerd, runc, containernetworking-plugins   the container runtime and the CNI plugins (/usr/lib/cni)
#   iptables, nftables                               node-down.sh checks with them that the host's rules and
#                                                    tables are as found (removing any the node added)
#   busybox-static, umoci, skopeo                    the node's pause and test images, built without a daemon
# Idempotent: does nothing when every package is installed. Fails naming each package that apt could not
# install. Runs as root (no sudo here).
#
# Usage: scripts/cluster/install-node.sh [--check]
#   --check   exit 0 when every package is installed, 1 otherwise (installs nothing)
set -euo pipefail

# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/lib.sh"
# shellcheck source=scripts/apt.sh
source "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/../apt.sh"

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

# The NODE_PACKAGES that dpkg does not report as installed.
mapfile -t missing < <(apt_missing "${NODE_PACKAGES[@]}")
if [[ ${#missing[@]} -eq 0 ]]; then
	[[ "${CHECK}" == 1 ]] || log "node packages installed: ${NODE_PACKAGES[*]}"
	exit 0
fi
[[ "${CHECK}" == 0 ]] || exit 1

start=${SECONDS}
# No daemon is started by the packages' maintainer scripts: there is no init system here, and up.sh starts
# containerd itself with its own configuration.
apt_install install-node "${missing[@]}"
for tool in containerd containerd-shim-runc-v2 ctr runc umoci skopeo iptables nft; do
	command -v "${tool}" >/dev/null || die "${tool} is not on PATH after installing ${NODE_PACKAGES[*]}"
done
for plugin in bridge host-local loopback; do
	[[ -x "${CNI_BIN_DIR}/${plugin}" ]] || die "CNI plugin ${CNI_BIN_DIR}/${plugin} missing (package containernetworking-plugins)"
done
[[ -x /bin/busybox ]] || die "/bin/busybox missing (package busybox-static)"
log "installed ${missing[*]} ($((SECONDS - start)) s)"
