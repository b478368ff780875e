#!/usr/bin/env bash
# Starts the real node of the control plane up.sh runs in TRAJ_CLUSTER_DIR (called by `up.sh --real-node`;
# stopped and removed by node-down.sh, which down.sh calls): Debian's containerd and runc, the CNI bridge,
# and a kubelet registered as node TRAJ_NODE_NAME. Everything it makes is recorded in
# ${TRAJ_CLUSTER_DIR}/node/ first, so that node-down.sh removes it even after a failed or killed start:
#   node/containerd/   containerd's config, root, state and socket (runc's state in node/runc)
#   node/cni/          the CNI config (bridge + host-local + portmap; containerd adds loopback) and IPAM
#   node/kubelet/      the kubelet's config, kubeconfig, certificates and --root-dir; pod logs in node/pod-logs
#   node/record/       what the host looked like before (sysctls, iptables, mounts, devices) and what was made
#
# The node:
#   - is tainted trajectory.dev/real-node=true:NoSchedule and labelled type=real, so a pod lands on it only
#     when it tolerates the taint; kwok's fake nodes (type=kwok) keep every other pod;
#   - reaches and is reached by the host on the bridge TRAJ_NODE_BRIDGE with the host's address
#     TRAJ_NODE_GATEWAY (the node's InternalIP): a server on the host for pods listens there (or on
#     0.0.0.0), not on 127.0.0.1, which inside a pod is the pod's own loopback;
#   - has no kube-proxy and no DNS: pods reach the host by IP, nothing needs a Service;
#   - puts its cgroups (kubepods, and so every container's) under the cgroup this script runs in;
#   - leaves the host's sysctls as found: the kubelet sets six kernel tunables (vm.overcommit_memory,
#     kernel.panic, ...) once, when its container manager starts; once the node is Ready they are written
#     back to the values recorded before (and node-down.sh does it again after a failed start).
#
# Usage: scripts/cluster/node-up.sh [--network]
#   --network  only record the host and make the bridge (up.sh runs it before the control plane, so
#              that the API server can listen on the bridge address, where the operator's pod reaches
#              it); a later run without it starts the rest (after up.sh started the control plane)
# Environment: TRAJ_CLUSTER_DIR, TRAJ_NODE_NAME (default trajectory-node), TRAJ_NODE_BRIDGE (default traj0),
#   TRAJ_NODE_SUBNET (a /24, default 10.88.0.0/24; the host is .1), TRAJ_CLUSTER_VERBOSITY,
#   TRAJ_NODE_IMAGES  more docker/OCI archives to import (space-separated paths), e.g. the ones
#                     scripts/images/build.sh writes: out/images/trajectory-worker-<version>.tar
set -euo pipefail

# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/lib.sh"

NETWORK_ONLY=0
case "${1:-}" in
"") ;;
--network) NETWORK_ONLY=1 ;;
*) die "unknown argument: $1 (usage: node-up.sh [--network])" ;;
esac
DIR="${TRAJ_CLUSTER_DIR%/}"
[[ -f "${DIR}/.trajectory-cluster" ]] || die "no cluster state in ${DIR}: start it with up.sh"
[[ "${NETWORK_ONLY}" == 1 || -f "${DIR}/kubeconfig" ]] || die "no control plane in ${DIR}: start it with up.sh"
PKI="${DIR}/pki"
LOGS="${DIR}/logs"
PIDS="${DIR}/pids"
NODE="${DIR}/node"
REC="${NODE}/record"
VERBOSITY="${TRAJ_CLUSTER_VERBOSITY:-0}"
NAME="${TRAJ_NODE_NAME}"
BRIDGE="${TRAJ_NODE_BRIDGE}"
SUBNET="${TRAJ_NODE_SUBNET}"
GATEWAY="$(node_gateway)"
SOCK="${NODE}/containerd/containerd.sock"
START=${SECONDS}

node_binaries_built || die "the kubelet is not built: run scripts/cluster/build.sh --real-node"
"${CLUSTER_SCRIPTS_DIR}/install-node.sh" --check || die "node packages missing: run scripts/cluster/install-node.sh"
# The network made by an earlier `node-up.sh --network` for this state directory.
NETWORK_MADE=0
[[ "${NETWORK_ONLY}" == 1 || ! -f "${REC}/network-made" ]] || NETWORK_MADE=1
if [[ "${NETWORK_MADE}" != 1 ]]; then
	[[ ! -e "${NODE}" ]] || die "${NODE} exists: stop the old node first (scripts/cluster/node-down.sh)"
	if ip link show "${BRIDGE}" >/dev/null 2>&1; then
		die "network device ${BRIDGE} exists already (another real node?): set TRAJ_NODE_BRIDGE and TRAJ_NODE_SUBNET"
	fi
fi
mkdir -p "${REC}" "${NODE}/containerd" "${NODE}/runc" "${NODE}/cni/net.d" "${NODE}/cni/ipam" \
	"${NODE}/kubelet/root" "${NODE}/kubelet/pki" "${NODE}/pod-logs" "${LOGS}" "${PIDS}"

# --- what the host looks like before: node-down.sh restores and compares ---------------------------
record_host() {
	sysctl -a 2>/dev/null | sort >"${REC}/sysctl-before.txt" || true
	for key in ${KUBELET_SYSCTLS}; do
		echo "${key}=$(sysctl -n "${key}")"
	done >"${REC}/sysctl-kubelet-before.txt"
	iptables-save 2>/dev/null | grep -v '^#' >"${REC}/iptables-before.txt" || true
	ip6tables-save 2>/dev/null | grep -v '^#' >"${REC}/ip6tables-before.txt" || true
	nft list tables 2>/dev/null | sort >"${REC}/nft-tables-before.txt" || true
	ip -o link show | awk -F': ' '{print $2}' | sed 's/@.*//' | sort >"${REC}/links-before.txt"
	findmnt -rn -o TARGET | sort >"${REC}/mounts-before.txt"
	local d
	# /var/lib/kubelet: the kubelet's device-plugin socket is there whatever --root-dir says (so one real node
	# per host); /run/mount: libmount's table of the kubelet's mounts.
	for d in /run/netns /var/lib/cni /run/containerd /var/lib/kubelet /run/mount; do
		[[ -e "${d}" ]] || echo "${d}"
	done >"${REC}/dirs-created.txt"
}

# --- cgroups: under the cgroup this script runs in ---------------------------------------------------
# The deepest cgroup path of this process among the v1 hierarchies (here: the memory hierarchy's; the
# others are at their root), plus trajectory-node-<name>. The same path is made in every hierarchy, each
# directory made recorded (deepest last) for node-down.sh.
make_cgroups() {
	local own
	own="$(awk -F: '$1 != 0 && $3 != "/" { print $3 }' /proc/self/cgroup | awk '{ print length, $0 }' | sort -rn | head -n 1 | cut -d' ' -f2-)"
	CGROUP_ROOT="${own%/}/trajectory-node-${NAME}"
	echo "${CGROUP_ROOT}" >"${REC}/cgroup-root.txt"
	: >"${REC}/cgroups-created.txt"
	local h path parts p
	for h in /sys/fs/cgroup/*/; do
		h="${h%/}"
		[[ -f "${h}/cgroup.procs" ]] || continue
		path="${h}"
		IFS=/ read -ra parts <<<"${CGROUP_ROOT#/}"
		for p in "${parts[@]}"; do
			path="${path}/${p}"
			if [[ ! -d "${path}" ]]; then
				mkdir "${path}"
				echo "${path}" >>"${REC}/cgroups-created.txt"
				if [[ -f "${path}/cpuset.cpus" ]]; then
					cat "$(dirname "${path}")/cpuset.cpus" >"${path}/cpuset.cpus"
					cat "$(dirname "${path}")/cpuset.mems" >"${path}/cpuset.mems"
				fi
			fi
		done
	done
	log "cgroup root of the node: ${CGROUP_ROOT} (in every hierarchy)"
}

# --- network: the bridge with the host's address, before the kubelet binds to it ---------------------
make_bridge() {
	echo "${BRIDGE}" >"${REC}/bridge.txt"
	ip link add "${BRIDGE}" type bridge
	# A bridge whose address was never set takes the lowest of its ports' addresses, so it changes
	# when a pod's veth comes or goes: the running pods' ARP entries for the host then name an
	# address nobody has, and their connections to the host (the model server) stall until the
	# entry expires (a model call timed out twice, 10 s each, as another pod ended). Set once, even
	# to the random address it has, the bridge keeps it.
	ip link set "${BRIDGE}" address "$(cat "/sys/class/net/${BRIDGE}/address")"
	ip addr add "${GATEWAY}/24" dev "${BRIDGE}"
	ip link set "${BRIDGE}" up
	# containerd's CNI calls bridge (attach the pod's veth; the address above is already the gateway, so
	# isGateway is off: no ip_forward sysctl, no masquerade rule) and host-local (IPAM state in our
	# directory); containerd adds the loopback plugin itself. No portmap: hostPort would need iptables NAT
	# rules in the host's tables, and nothing here needs to reach a pod from outside the pod network.
	cat >"${NODE}/cni/net.d/10-trajectory-node.conflist" <<-EOF
		{
		  "cniVersion": "1.0.0",
		  "name": "${CNI_NETWORK}",
		  "plugins": [
		    {
		      "type": "bridge",
		      "bridge": "${BRIDGE}",
		      "isGateway": false,
		      "ipMasq": false,
		      "hairpinMode": true,
		      "ipam": {
		        "type": "host-local",
		        "dataDir": "${NODE}/cni/ipam",
		        "ranges": [[{ "subnet": "${SUBNET}", "rangeStart": "${GATEWAY%.1}.10", "gateway": "${GATEWAY}" }]],
		        "routes": []
		      }
		    }
		  ]
		}
	EOF
}

start_containerd() {
	cat >"${NODE}/containerd/config.toml" <<-EOF
		version = 2
		root = "${NODE}/containerd/root"
		state = "${NODE}/containerd/state"
		oom_score = 0
		disabled_plugins = ["io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs",
		  "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.zfs",
		  "io.containerd.internal.v1.tracing", "io.containerd.tracing.processor.v1.otlp"]
		[grpc]
		  address = "${SOCK}"
		[ttrpc]
		  address = "${SOCK}.ttrpc"
		[metrics]
		  address = ""
		[plugins."io.containerd.internal.v1.opt"]
		  path = "${NODE}/containerd/opt"
		[plugins."io.containerd.grpc.v1.cri"]
		  sandbox_image = "${NODE_PAUSE_IMAGE}"
		  # Root lacks CAP_SYS_RESOURCE here: clamp the kubelet's oom_score_adj to containerd's own.
		  restrict_oom_score_adj = true
		  stream_server_address = "127.0.0.1"
		  stream_server_port = "0"
		  enable_selinux = false
		  disable_apparmor = true
		  [plugins."io.containerd.grpc.v1.cri".containerd]
		    snapshotter = "overlayfs"
		    default_runtime_name = "runc"
		    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
		      runtime_type = "io.containerd.runc.v2"
		      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
		        BinaryName = "$(command -v runc)"
		        Root = "${NODE}/runc"
		        SystemdCgroup = false
		  [plugins."io.containerd.grpc.v1.cri".registry]
		    # The test registry, plain HTTP at both its addresses (start_registry).
		    config_path = "${NODE}/containerd/certs.d"
		  [plugins."io.containerd.grpc.v1.cri".cni]
		    bin_dir = "${CNI_BIN_DIR}"
		    conf_dir = "${NODE}/cni/net.d"
		    max_conf_num = 1
	EOF
	log "starting containerd"
	setsid containerd --config "${NODE}/containerd/config.toml" >"${LOGS}/containerd.log" 2>&1 </dev/null &
	echo "$!" >"${PIDS}/containerd.pid"
	wait_ready "containerd" 30 containerd ctr_ok
}

ctr_ok() { ctr --address "${SOCK}" version >/dev/null 2>&1; }

# An image registry that the node pulls from over plain HTTP, holding the tests' task images
# (scripts/registry/task-images.sh): go-containerregistry's `crane registry serve`, storing blobs in
# node/registry. Sets REGISTRY (127.0.0.1:<port>, the port the kernel gave it) and POD_REGISTRY
# (the same registry at the host's address on the bridge, where pods reach it: a run's build pods
# push there, and the node pulls from there too, over plain HTTP as containerd's hosts.toml
# below says).
start_registry() {
	local crane
	crane="$("${CLUSTER_SCRIPTS_DIR}/../registry/build.sh" --print-path)"
	mkdir -p "${NODE}/registry"
	log "starting the image registry"
	setsid "${crane}" registry serve --address 0.0.0.0:0 --disk "${NODE}/registry" \
		>"${LOGS}/registry.log" 2>&1 </dev/null &
	echo "$!" >"${PIDS}/registry.pid"
	wait_ready "the image registry" 30 registry registry_port
	REGISTRY="127.0.0.1:$(registry_port)"
	POD_REGISTRY="${GATEWAY}:$(registry_port)"
	local host
	for host in "${REGISTRY}" "${POD_REGISTRY}"; do
		mkdir -p "${NODE}/containerd/certs.d/${host}"
		printf 'server = "http://%s"\n\n[host."http://%s"]\n  capabilities = ["pull", "resolve"]\n' \
			"${host}" "${host}" >"${NODE}/containerd/certs.d/${host}/hosts.toml"
	done
	TRAJ_CRANE="${crane}" "${CLUSTER_SCRIPTS_DIR}/../registry/task-images.sh" "${REGISTRY}" ||
		die "pushing the task images to ${REGISTRY} failed"
}

registry_port() { sed -n 's/.*serving on port \([0-9][0-9]*\)$/\1/p' "${LOGS}/registry.log" | grep .; }

# wait_ready WHAT TIMEOUT_S PIDNAME CMD...: poll CMD; fail early, with the log's tail, if PIDNAME died.
wait_ready() {
	local what="$1" timeout="$2" name="$3"
	shift 3
	local deadline=$((SECONDS + timeout)) pid
	pid="$(cat "${PIDS}/${name}.pid")"
	until "$@" >/dev/null 2>&1; do
		if ! kill -0 "${pid}" 2>/dev/null; then
			log "${name} exited while waiting for ${what}; last lines of ${LOGS}/${name}.log:"
			tail -n 30 "${LOGS}/${name}.log" >&2 || true
			return 1
		fi
		if ((SECONDS >= deadline)); then
			log "timed out after ${timeout} s waiting for ${what}; last lines of ${LOGS}/${name}.log:"
			tail -n 30 "${LOGS}/${name}.log" >&2 || true
			return 1
		fi
		sleep 0.5
	done
	log "ready: ${what} ($((SECONDS - START)) s)"
}

import_images() {
	local dir f
	dir="$("${CLUSTER_SCRIPTS_DIR}/node-images.sh")"
	for f in pause busybox; do
		ctr --address "${SOCK}" -n k8s.io images import "${dir}/${f}.tar" >>"${LOGS}/ctr-import.log" 2>&1 ||
			{
				tail -n 20 "${LOGS}/ctr-import.log" >&2
				die "importing ${dir}/${f}.tar into containerd failed"
			}
	done
	local ref listed
	listed="$(ctr --address "${SOCK}" -n k8s.io images ls -q)"
	for ref in "${NODE_PAUSE_IMAGE}" "${NODE_BUSYBOX_IMAGE}"; do
		grep -qxF "${ref}" <<<"${listed}" ||
			die "image ${ref} is not in containerd's k8s.io namespace after the import (log: ${LOGS}/ctr-import.log)"
	done
	log "images imported: ${NODE_PAUSE_IMAGE}, ${NODE_BUSYBOX_IMAGE}"
	local archive imported
	for archive in ${TRAJ_NODE_IMAGES:-}; do
		[[ -f "${archive}" ]] || die "TRAJ_NODE_IMAGES names ${archive}, which does not exist (build it: scripts/images/build.sh)"
		imported="$(ctr --address "${SOCK}" -n k8s.io images import "${archive}" 2>>"${LOGS}/ctr-import.log")" || {
			tail -n 20 "${LOGS}/ctr-import.log" >&2
			die "importing ${archive} into containerd failed"
		}
		printf '%s\n' "${imported}" >>"${LOGS}/ctr-import.log"
		log "imported ${archive}: $(awk '/^unpacking /{print $2}' <<<"${imported}" | tr '\n' ' ')"
	done
}

# --- the kubelet's identity: client cert for the API server, serving cert for the API server's calls --
make_kubelet_pki() {
	local k="${NODE}/kubelet/pki"
	openssl req -new -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -keyout "${k}/client.key" \
		-subj "/O=system:nodes/CN=system:node:${NAME}" -out "${k}/client.csr" 2>>"${LOGS}/openssl.log"
	printf 'basicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\nextendedKeyUsage=clientAuth\n' \
		>"${k}/client.ext"
	openssl x509 -req -in "${k}/client.csr" -CA "${PKI}/ca.crt" -CAkey "${PKI}/ca.key" -CAcreateserial -days 3650 \
		-sha256 -extfile "${k}/client.ext" -out "${k}/client.crt" 2>>"${LOGS}/openssl.log"
	openssl req -new -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -keyout "${k}/serving.key" \
		-subj "/CN=${NAME}" -out "${k}/serving.csr" 2>>"${LOGS}/openssl.log"
	printf 'basicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\nsubjectAltName=IP:%s,DNS:%s\n' \
		"${GATEWAY}" "${NAME}" >"${k}/serving.ext"
	openssl x509 -req -in "${k}/serving.csr" -CA "${PKI}/ca.crt" -CAkey "${PKI}/ca.key" -CAcreateserial -days 3650 \
		-sha256 -extfile "${k}/serving.ext" -out "${k}/serving.crt" 2>>"${LOGS}/openssl.log"
	chmod 600 "${k}"/*.key
	local server
	server="$(sed -n 's/^[[:space:]]*server: //p' "${DIR}/kubeconfig" | head -n 1)"
	cat >"${NODE}/kubelet/kubeconfig" <<-EOF
		apiVersion: v1
		kind: Config
		clusters:
		- name: trajectory
		  cluster:
		    server: ${server}
		    certificate-authority: ${PKI}/ca.crt
		users:
		- name: system:node:${NAME}
		  user:
		    client-certificate: ${k}/client.crt
		    client-key: ${k}/client.key
		contexts:
		- name: trajectory
		  context: {cluster: trajectory, user: "system:node:${NAME}"}
		current-context: trajectory
	EOF
}

# free_port: a TCP port nothing listens on (20000-59999).
free_port() {
	local used p
	used=" $(ss -Htan 2>/dev/null | awk '{n = split($4, a, ":"); printf "%s ", a[n]}') "
	while :; do
		p=$((20000 + (RANDOM * 32768 + RANDOM) % 40000))
		[[ "${used}" == *" ${p} "* ]] || break
	done
	echo "${p}"
}

start_kubelet() {
	KUBELET_PORT="$(free_port)"
	HEALTHZ_PORT="$(free_port)"
	cat >"${NODE}/kubelet/config.yaml" <<-EOF
		apiVersion: kubelet.config.k8s.io/v1beta1
		kind: KubeletConfiguration
		# cgroup v1 hierarchies here: kubelet 1.35+ refuses them unless told otherwise.
		failCgroupV1: false
		cgroupDriver: cgroupfs
		cgroupRoot: ${CGROUP_ROOT}
		cgroupsPerQOS: true
		failSwapOn: false
		# "true" refuses to start on this host's values; the kubelet sets them once at start, and node-up.sh
		# writes the recorded values back when the node is Ready.
		protectKernelDefaults: false
		serializeImagePulls: true
		oomScoreAdj: 0
		address: ${GATEWAY}
		port: ${KUBELET_PORT}
		readOnlyPort: 0
		healthzBindAddress: 127.0.0.1
		healthzPort: ${HEALTHZ_PORT}
		tlsCertFile: ${NODE}/kubelet/pki/serving.crt
		tlsPrivateKeyFile: ${NODE}/kubelet/pki/serving.key
		rotateCertificates: false
		serverTLSBootstrap: false
		authentication:
		  anonymous: {enabled: false}
		  webhook: {enabled: true}
		  x509: {clientCAFile: ${PKI}/ca.crt}
		authorization:
		  mode: Webhook
		containerRuntimeEndpoint: unix://${SOCK}
		imageServiceEndpoint: unix://${SOCK}
		podLogsDir: ${NODE}/pod-logs
		volumePluginDir: ${NODE}/kubelet/volume-plugins
		# No cluster DNS, and not the host's resolvers either: pods address the host by IP.
		resolvConf: ""
		clusterDomain: cluster.local
		# Imported images must stay (there is no registry to pull them again).
		imageGCHighThresholdPercent: 100
		imageGCLowThresholdPercent: 99
		evictionHard: {memory.available: 100Mi, nodefs.available: 1%, imagefs.available: 1%, nodefs.inodesFree: 1%}
		shutdownGracePeriod: 0s
		registerNode: true
		registerWithTaints:
		- {key: trajectory.dev/real-node, value: "true", effect: NoSchedule}
		maxPods: 20
	EOF
	log "starting kubelet (node ${NAME}, ${GATEWAY}:${KUBELET_PORT})"
	# Without iptables on its PATH the kubelet adds no chains or rules to the host's tables (it would add
	# KUBE-FIREWALL, which drops packets to 127.0.0.0/8 from other sources, and canary chains): nothing
	# here needs them, as there is no kube-proxy. Its mount and umount are in /usr/bin.
	setsid env PATH=/usr/local/bin:/usr/bin:/bin "${K8S_BIN_DIR}/kubelet" \
		--config="${NODE}/kubelet/config.yaml" \
		--kubeconfig="${NODE}/kubelet/kubeconfig" \
		--root-dir="${NODE}/kubelet/root" \
		--cert-dir="${NODE}/kubelet/pki" \
		--hostname-override="${NAME}" \
		--node-ip="${GATEWAY}" \
		--node-labels="type=real,trajectory.dev/real-node=true" \
		--v="${VERBOSITY}" >"${LOGS}/kubelet.log" 2>&1 </dev/null &
	echo "$!" >"${PIDS}/kubelet.pid"
	wait_ready "kubelet /healthz" 60 kubelet \
		curl -fsS --max-time 2 "http://127.0.0.1:${HEALTHZ_PORT}/healthz"
	wait_ready "node ${NAME} Ready" 120 kubelet node_ready
	# The kubelet set its kernel tunables once, in its container manager's start (before Ready), and does
	# not look at them again: give the host its own values back now.
	local restored
	restored="$(restore_kernel_tunables "${REC}/sysctl-kubelet-before.txt")" ||
		die "could not write back the kernel tunables of ${REC}/sysctl-kubelet-before.txt"
	[[ -z "${restored}" ]] || log "kernel tunables the kubelet changed written back: $(tr '\n' ' ' <<<"${restored}")"
}

node_ready() {
	[[ "$("${K8S_BIN_DIR}/kubectl" --kubeconfig "${DIR}/kubeconfig" get node "${NAME}" \
		-o jsonpath='{.status.conditions[?(@.type=="Ready")].status}' 2>/dev/null)" == True ]]
}

if [[ "${NETWORK_MADE}" != 1 ]]; then
	record_host
	make_bridge
	touch "${REC}/network-made"
fi
if [[ "${NETWORK_ONLY}" == 1 ]]; then
	log "bridge ${BRIDGE} with the host's address ${GATEWAY} made"
	exit 0
fi
make_cgroups
start_registry
start_containerd
import_images
make_kubelet_pki
start_kubelet
cat >"${NODE}/env" <<EOF
export TRAJ_CLUSTER_REAL_NODE=${NAME}
export TRAJ_CLUSTER_NODE_HOST_IP=${GATEWAY}
export TRAJ_CLUSTER_NODE_CONTAINERD=${SOCK}
export TRAJ_CLUSTER_REGISTRY=${REGISTRY}
export TRAJ_CLUSTER_POD_REGISTRY=${POD_REGISTRY}
EOF
log "real node ${NAME} Ready in $((SECONDS - START)) s: pods reach the host at ${GATEWAY}; images" \
	"${NODE_BUSYBOX_IMAGE}, ${NODE_PAUSE_IMAGE}; registry ${REGISTRY}; taint trajectory.dev/real-node=true:NoSchedule"
