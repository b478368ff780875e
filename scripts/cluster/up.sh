#!/usr/bin/env bash
# Starts a local Kubernetes control plane on loopback, built from source by build.sh (run first if needed):
# etcd, kube-apiserver (TLS, RBAC, ServiceAccount tokens, admission with OwnerReferencesPermissionEnforcement
# as OpenShift enables it, so the chart's RBAC is tested against it), kube-controller-manager (all default
# controllers), kube-scheduler and kwok with KWOK_NODES fake nodes whose pods kwok moves to Running and,
# for pods owned by a Job, to Succeeded. With --real-node also a real node (node-up.sh): containerd, runc and
# a kubelet, tainted so that only pods tolerating trajectory.dev/real-node land on it.
#
# Usage: scripts/cluster/up.sh [--nodes N] [--no-scheduler] [--real-node]
#   eval "$(scripts/cluster/up.sh)"   # or copy the printed export line
# Environment:
#   TRAJ_CLUSTER_DIR       state directory (default /tmp/trajectory-cluster); removed by down.sh
#   KWOK_NODES             fake nodes to create (default 2; 0 starts neither kwok nor the scheduler)
#   TRAJ_CLUSTER_SCHEDULER 1 (default) or 0 to skip kube-scheduler
#   TRAJ_REAL_NODE         1: as --real-node (installs the Debian packages and builds the kubelet if needed)
#   TRAJ_CLUSTER_VERBOSITY klog verbosity of the Kubernetes components (default 0)
#   TRAJ_CLUSTER_PORTS     6 preferred ports "etcd etcd-peer apiserver controller-manager scheduler kwok"
#                          for the first attempt (default: free ones picked at random; taken ones are
#                          replaced by a retry on other ports)
# Stdout gets only the export line; progress goes to stderr. A cluster left in TRAJ_CLUSTER_DIR by an
# earlier run (running or killed) is stopped and replaced. On failure every component's log is copied
# to ${TRAJ_CLUSTER_LOGS_DIR:-${TRAJ_CLUSTER_DIR}-logs}/<time>/ and everything started is stopped.
set -euo pipefail

# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/lib.sh"

NODES="${KWOK_NODES:-2}"
SCHEDULER="${TRAJ_CLUSTER_SCHEDULER:-1}"
VERBOSITY="${TRAJ_CLUSTER_VERBOSITY:-0}"
REAL_NODE="${TRAJ_REAL_NODE:-0}"
while [[ $# -gt 0 ]]; do
	case "$1" in
	--nodes)
		NODES="${2:?--nodes needs a number}"
		shift 2
		;;
	--nodes=*)
		NODES="${1#--nodes=}"
		shift
		;;
	--no-scheduler)
		SCHEDULER=0
		shift
		;;
	--real-node)
		REAL_NODE=1
		shift
		;;
	-h | --help)
		sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'
		exit 0
		;;
	*) die "unknown argument: $1 (see --help)" ;;
	esac
done
[[ "${NODES}" =~ ^[0-9]+$ ]] || die "KWOK_NODES/--nodes must be a number, got '${NODES}'"
if [[ "${NODES}" -eq 0 && "${REAL_NODE}" != 1 ]]; then
	SCHEDULER=0
fi
for tool in openssl curl ss base64 setsid; do
	command -v "${tool}" >/dev/null || die "${tool} is needed (Debian: apt-get install openssl curl iproute2 coreutils util-linux)"
done

START=${SECONDS}
if ! all_binaries_built; then
	log "control-plane binaries not built yet: running build.sh"
	"${CLUSTER_SCRIPTS_DIR}/build.sh"
fi
if [[ "${REAL_NODE}" == 1 ]]; then
	"${CLUSTER_SCRIPTS_DIR}/install-node.sh" --check || "${CLUSTER_SCRIPTS_DIR}/install-node.sh"
	node_binaries_built || "${CLUSTER_SCRIPTS_DIR}/build.sh" --real-node
fi

# Where the API server listens: loopback; with a real node the host's bridge address instead (the
# host reaches it as well as the node's pods do, e.g. an operator running in a pod with
# KUBERNETES_SERVICE_HOST set to it, as there is no kube-proxy for the kubernetes Service).
API_HOST=127.0.0.1
if [[ "${REAL_NODE}" == 1 ]]; then
	API_HOST="$(node_gateway)"
fi

DIR="${TRAJ_CLUSTER_DIR%/}"
PKI="${DIR}/pki"
LOGS="${DIR}/logs"
PIDS="${DIR}/pids"

# Replace whatever an earlier run left here (running processes, stale pid files, data).
"${CLUSTER_SCRIPTS_DIR}/down.sh" --quiet

mkdir -p "${DIR}"
touch "${DIR}/.trajectory-cluster"
mkdir -p "${PKI}" "${LOGS}" "${PIDS}" "${DIR}/data"

UP_OK=0
on_exit() {
	if [[ "${UP_OK}" != 1 ]]; then
		log "start failed; stopping what was started"
		"${CLUSTER_SCRIPTS_DIR}/down.sh" --keep-logs --quiet || true
	fi
}
trap on_exit EXIT

# --- certificates -------------------------------------------------------------------------------------
# new_ca NAME CN: a self-signed EC P-256 CA.
new_ca() {
	openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 3650 -sha256 \
		-keyout "${PKI}/$1.key" -out "${PKI}/$1.crt" -subj "/CN=$2" \
		-addext "basicConstraints=critical,CA:TRUE" \
		-addext "keyUsage=critical,keyCertSign,cRLSign,digitalSignature" 2>>"${LOGS}/openssl.log"
}

# new_cert NAME SUBJECT EXTENSIONS [CA]: an EC P-256 key and a certificate signed by CA (default: ca).
new_cert() {
	local name="$1" subject="$2" ext="$3" ca="${4:-ca}"
	openssl req -new -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes \
		-keyout "${PKI}/${name}.key" -subj "${subject}" -out "${PKI}/${name}.csr" 2>>"${LOGS}/openssl.log"
	printf '%s\n' "${ext}" >"${PKI}/${name}.ext"
	openssl x509 -req -in "${PKI}/${name}.csr" -CA "${PKI}/${ca}.crt" -CAkey "${PKI}/${ca}.key" -CAcreateserial \
		-days 3650 -sha256 -extfile "${PKI}/${name}.ext" -out "${PKI}/${name}.crt" 2>>"${LOGS}/openssl.log"
}

make_pki() {
	new_ca ca trajectory-cluster-ca
	# Aggregation layer (front proxy): the API server authenticates to extension API servers with it.
	new_ca front-proxy-ca trajectory-front-proxy-ca
	local client="basicConstraints=critical,CA:FALSE
keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage=clientAuth"
	new_cert apiserver "/CN=kube-apiserver" "basicConstraints=critical,CA:FALSE
keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage=serverAuth
subjectAltName=IP:127.0.0.1,IP:${API_HOST},IP:10.96.0.1,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local"
	new_cert admin "/O=system:masters/CN=kubernetes-admin" "${client}"
	new_cert controller-manager "/CN=system:kube-controller-manager" "${client}"
	new_cert scheduler "/CN=system:kube-scheduler" "${client}"
	new_cert front-proxy-client "/CN=front-proxy-client" "${client}" front-proxy-ca
	# The API server's identity towards kubelets (logs, exec); the kubelet authorizes system:masters.
	new_cert apiserver-kubelet-client "/O=system:masters/CN=kube-apiserver-kubelet-client" "${client}"
	# ServiceAccount token signing key.
	openssl genrsa -out "${PKI}/sa.key" 2048 2>>"${LOGS}/openssl.log"
	openssl rsa -in "${PKI}/sa.key" -pubout -out "${PKI}/sa.pub" 2>>"${LOGS}/openssl.log"
	chmod 600 "${PKI}"/*.key
}

# write_kubeconfig FILE CERT_NAME: a kubeconfig for the API server with the credentials embedded.
write_kubeconfig() {
	local file="$1" name="$2"
	cat >"${file}" <<-EOF
		apiVersion: v1
		kind: Config
		clusters:
		- name: trajectory
		  cluster:
		    server: https://${API_HOST}:${API_PORT}
		    certificate-authority-data: $(base64 -w0 <"${PKI}/ca.crt")
		users:
		- name: ${name}
		  user:
		    client-certificate-data: $(base64 -w0 <"${PKI}/${name}.crt")
		    client-key-data: $(base64 -w0 <"${PKI}/${name}.key")
		contexts:
		- name: trajectory
		  context:
		    cluster: trajectory
		    user: ${name}
		current-context: trajectory
	EOF
	chmod 600 "${file}"
}

# --- ports ---------------------------------------------------------------------------------------------
# pick_ports N: N distinct free TCP ports on loopback in 20000-59999 (nothing listening there now).
PORTS=()
pick_ports() {
	local used p
	used=" $(ss -Htan 2>/dev/null | awk '{n = split($4, a, ":"); printf "%s ", a[n]}') "
	PORTS=()
	while [[ ${#PORTS[@]} -lt $1 ]]; do
		p=$((20000 + (RANDOM * 32768 + RANDOM) % 40000))
		if [[ "${used}" != *" ${p} "* ]]; then
			PORTS+=("${p}")
			used+="${p} "
		fi
	done
}

# --- processes -----------------------------------------------------------------------------------------
# start NAME BINARY ARGS...: run in its own session, log to logs/NAME.log, pid in pids/NAME.pid.
start() {
	local name="$1" bin="$2"
	shift 2
	log "starting ${name}"
	setsid "${bin}" "$@" >"${LOGS}/${name}.log" 2>&1 </dev/null &
	echo "$!" >"${PIDS}/${name}.pid"
}

# alive NAME: the component's process is still running.
alive() {
	local pid
	pid="$(cat "${PIDS}/$1.pid" 2>/dev/null)" || return 1
	kill -0 "${pid}" 2>/dev/null
}

# wait_for WHAT TIMEOUT_S COMPONENT CMD...: poll CMD until it succeeds; fail early if COMPONENT died.
wait_for() {
	local what="$1" timeout="$2" component="$3"
	shift 3
	local deadline=$((SECONDS + timeout))
	until "$@" >/dev/null 2>&1; do
		if [[ -n "${component}" ]] && ! alive "${component}"; then
			log "${component} exited while waiting for ${what}; last lines of ${LOGS}/${component}.log:"
			tail -n 20 "${LOGS}/${component}.log" >&2 || true
			return 1
		fi
		if ((SECONDS >= deadline)); then
			log "timed out after ${timeout} s waiting for ${what}"
			return 1
		fi
		sleep 0.2
	done
	log "ready: ${what} ($((SECONDS - START)) s)"
}

api_get() {
	curl -fsS --max-time 5 --cacert "${PKI}/ca.crt" --cert "${PKI}/admin.crt" --key "${PKI}/admin.key" \
		"https://${API_HOST}:${API_PORT}$1"
}
api_readyz() { [[ "$(api_get /readyz)" == "ok" ]]; }
kubectl() { "${K8S_BIN_DIR}/kubectl" --kubeconfig "${DIR}/kubeconfig" "$@"; }

# kwok's default stages, its pod stages kept off the pods the tests' own kubelet plays (tests/src/e2e.rs):
# those select the node label trajectories.dev/e2e-kubelet, and once an autoscaler (Karpenter's kwok
# provider) gives them a kwok node of that label, they are bound there but run, end and are deleted by
# the test-kubelet, as on a real node, not by kwok.
test_kubelet_stages() {
	awk '
		/^---/ { pod = 0 }
		/^    kind: Pod$/ { pod = 1 }
		{ print }
		pod && /^    matchExpressions:$/ {
			print "    - key: \x27.spec.nodeSelector[\"trajectories.dev/e2e-kubelet\"]\x27"
			print "      operator: \x27DoesNotExist\x27"
		}
	' "${KWOK_STAGES_FILE}"
}
# nodes_ready: all KWOK_NODES fake nodes report Ready (one list; `kubectl wait` goes node by node).
nodes_ready() {
	local ready
	ready="$(kubectl get nodes --selector=type=kwok \
		-o jsonpath='{range .items[*]}{.status.conditions[?(@.type=="Ready")].status}{"\n"}{end}' |
		grep -c '^True$')" || return 1
	[[ "${ready}" -ge "${NODES}" ]]
}

fake_nodes_yaml() {
	local i
	for ((i = 0; i < NODES; i++)); do
		cat <<-EOF
			---
			apiVersion: v1
			kind: Node
			metadata:
			  name: kwok-node-${i}
			  annotations:
			    kwok.x-k8s.io/node: fake
			    node.alpha.kubernetes.io/ttl: "0"
			  labels:
			    type: kwok
			    kubernetes.io/arch: amd64
			    kubernetes.io/os: linux
			    kubernetes.io/hostname: kwok-node-${i}
			    kubernetes.io/role: agent
			    node-role.kubernetes.io/agent: ""
			status:
			  allocatable: {cpu: "32", memory: 256Gi, pods: "110"}
			  capacity: {cpu: "32", memory: 256Gi, pods: "110"}
		EOF
	done
}

# start_components: one attempt at starting everything on fresh ports. Returns non-zero on failure.
start_components() {
	if [[ "${attempt}" -eq 1 && -n "${TRAJ_CLUSTER_PORTS:-}" ]]; then
		read -ra PORTS <<<"${TRAJ_CLUSTER_PORTS}"
		[[ ${#PORTS[@]} -eq 6 ]] || die "TRAJ_CLUSTER_PORTS needs 6 ports, got '${TRAJ_CLUSTER_PORTS}'"
	else
		pick_ports 6
	fi
	ETCD_PORT="${PORTS[0]}"
	ETCD_PEER_PORT="${PORTS[1]}"
	API_PORT="${PORTS[2]}"
	KCM_PORT="${PORTS[3]}"
	SCHED_PORT="${PORTS[4]}"
	KWOK_PORT="${PORTS[5]}"

	write_kubeconfig "${DIR}/kubeconfig" admin
	write_kubeconfig "${DIR}/controller-manager.kubeconfig" controller-manager
	write_kubeconfig "${DIR}/scheduler.kubeconfig" scheduler

	rm -rf "${DIR}/data/etcd"
	start etcd "${ETCD_BIN_DIR}/etcd" \
		--name=trajectory --data-dir="${DIR}/data/etcd" \
		--listen-client-urls="http://127.0.0.1:${ETCD_PORT}" --advertise-client-urls="http://127.0.0.1:${ETCD_PORT}" \
		--listen-peer-urls="http://127.0.0.1:${ETCD_PEER_PORT}" \
		--initial-advertise-peer-urls="http://127.0.0.1:${ETCD_PEER_PORT}" \
		--initial-cluster="trajectory=http://127.0.0.1:${ETCD_PEER_PORT}" \
		--unsafe-no-fsync --log-level=warn
	# shellcheck disable=SC2016 # expanded by the inner bash
	wait_for "etcd /health" 30 etcd \
		bash -c '[[ "$(curl -fsS --max-time 2 "$1")" == *"\"health\":\"true\""* ]]' _ \
		"http://127.0.0.1:${ETCD_PORT}/health" || return 1

	local kubelet_flags=()
	if [[ "${REAL_NODE}" == 1 ]]; then
		# The real node's InternalIP is its bridge address on this host (node-up.sh); its serving
		# certificate is signed by the cluster CA.
		kubelet_flags=(--kubelet-preferred-address-types=InternalIP --kubelet-certificate-authority="${PKI}/ca.crt")
	fi
	start kube-apiserver "${K8S_BIN_DIR}/kube-apiserver" \
		--kubelet-client-certificate="${PKI}/apiserver-kubelet-client.crt" \
		--kubelet-client-key="${PKI}/apiserver-kubelet-client.key" \
		"${kubelet_flags[@]}" \
		--etcd-servers="http://127.0.0.1:${ETCD_PORT}" \
		--bind-address="${API_HOST}" --secure-port="${API_PORT}" --advertise-address="${API_HOST}" \
		--endpoint-reconciler-type=none \
		--tls-cert-file="${PKI}/apiserver.crt" --tls-private-key-file="${PKI}/apiserver.key" \
		--client-ca-file="${PKI}/ca.crt" \
		--requestheader-client-ca-file="${PKI}/front-proxy-ca.crt" \
		--requestheader-allowed-names=front-proxy-client \
		--requestheader-username-headers=X-Remote-User \
		--requestheader-group-headers=X-Remote-Group \
		--requestheader-extra-headers-prefix=X-Remote-Extra- \
		--proxy-client-cert-file="${PKI}/front-proxy-client.crt" \
		--proxy-client-key-file="${PKI}/front-proxy-client.key" \
		--authorization-mode=Node,RBAC \
		--enable-admission-plugins=NodeRestriction,OwnerReferencesPermissionEnforcement \
		--service-account-issuer=https://kubernetes.default.svc.cluster.local \
		--service-account-key-file="${PKI}/sa.pub" \
		--service-account-signing-key-file="${PKI}/sa.key" \
		--service-cluster-ip-range=10.96.0.0/16 \
		--allow-privileged=true \
		--profiling=false \
		--v="${VERBOSITY}"
	wait_for "kube-apiserver /readyz" 90 kube-apiserver api_readyz || return 1

	start kube-controller-manager "${K8S_BIN_DIR}/kube-controller-manager" \
		--kubeconfig="${DIR}/controller-manager.kubeconfig" \
		--authentication-kubeconfig="${DIR}/controller-manager.kubeconfig" \
		--authorization-kubeconfig="${DIR}/controller-manager.kubeconfig" \
		--bind-address=127.0.0.1 --secure-port="${KCM_PORT}" \
		--leader-elect=false \
		--controllers='*' \
		--use-service-account-credentials=true \
		--service-account-private-key-file="${PKI}/sa.key" \
		--root-ca-file="${PKI}/ca.crt" \
		--cluster-signing-cert-file="${PKI}/ca.crt" --cluster-signing-key-file="${PKI}/ca.key" \
		--v="${VERBOSITY}"

	if [[ "${SCHEDULER}" == 1 ]]; then
		start kube-scheduler "${K8S_BIN_DIR}/kube-scheduler" \
			--kubeconfig="${DIR}/scheduler.kubeconfig" \
			--authentication-kubeconfig="${DIR}/scheduler.kubeconfig" \
			--authorization-kubeconfig="${DIR}/scheduler.kubeconfig" \
			--bind-address=127.0.0.1 --secure-port="${SCHED_PORT}" \
			--leader-elect=false \
			--v="${VERBOSITY}"
	fi

	if [[ "${NODES}" -gt 0 ]]; then
		test_kubelet_stages >"${DIR}/kwok-stages.yaml"
		[[ "$(grep -c 'trajectories.dev/e2e-kubelet' "${DIR}/kwok-stages.yaml")" -eq 3 ]] ||
			die "kwok's pod stages (ready, complete, delete) not found in ${KWOK_STAGES_FILE}"
		start kwok "${KWOK_BIN_DIR}/kwok" \
			--kubeconfig="${DIR}/kubeconfig" \
			--config="${DIR}/kwok-stages.yaml" \
			--manage-all-nodes=false \
			--manage-nodes-with-annotation-selector=kwok.x-k8s.io/node=fake \
			--node-lease-duration-seconds=40 \
			--server-address="127.0.0.1:${KWOK_PORT}"
	fi

	wait_for "ServiceAccount default/default" 60 kube-controller-manager \
		kubectl get serviceaccount default --namespace default || return 1

	if [[ "${NODES}" -gt 0 ]]; then
		fake_nodes_yaml >"${DIR}/nodes.yaml"
		kubectl create -f "${DIR}/nodes.yaml" >"${LOGS}/create-nodes.log" 2>&1 || {
			log "creating the fake nodes failed:"
			cat "${LOGS}/create-nodes.log" >&2
			return 1
		}
		wait_for "${NODES} kwok node(s) Ready" 120 kwok nodes_ready || return 1
	fi

	local c
	for c in etcd kube-apiserver kube-controller-manager kube-scheduler kwok; do
		if [[ -f "${PIDS}/${c}.pid" ]] && ! alive "${c}"; then
			log "${c} exited; last lines of ${LOGS}/${c}.log:"
			tail -n 20 "${LOGS}/${c}.log" >&2 || true
			return 1
		fi
	done
}

# stop_components: stop this attempt's processes but keep the state directory (for a retry).
stop_components() {
	local f pid
	for f in "${PIDS}"/*.pid; do
		[[ -f "${f}" ]] || continue
		pid="$(cat "${f}")"
		kill "${pid}" 2>/dev/null || true
	done
	sleep 1
	for f in "${PIDS}"/*.pid; do
		[[ -f "${f}" ]] || continue
		pid="$(cat "${f}")"
		kill -9 "${pid}" 2>/dev/null || true
		rm -f "${f}"
	done
}

if [[ "${REAL_NODE}" == 1 ]]; then
	# The bridge first: the API server listens on its address.
	"${CLUSTER_SCRIPTS_DIR}/node-up.sh" --network || die "making the real node's bridge failed"
fi
make_pki
attempt=1
until start_components; do
	# A port picked as free can be taken by another process before our component binds it: retry then.
	if ((attempt < 3)) && grep -qs "address already in use" "${LOGS}"/*.log; then
		log "a port was taken meanwhile (attempt ${attempt}); retrying on other ports"
		stop_components
		mkdir -p "${LOGS}/attempt-${attempt}"
		find "${LOGS}" -maxdepth 1 -name '*.log' -exec mv {} "${LOGS}/attempt-${attempt}/" \;
		attempt=$((attempt + 1))
		continue
	fi
	exit 1
done

if [[ "${REAL_NODE}" == 1 ]]; then
	"${CLUSTER_SCRIPTS_DIR}/node-up.sh" || {
		log "the real node did not start (logs: ${LOGS}/kubelet.log, ${LOGS}/containerd.log)"
		exit 1
	}
fi

cat >"${DIR}/env" <<EOF
export KUBECONFIG=${DIR}/kubeconfig
export TRAJ_CLUSTER_API=https://${API_HOST}:${API_PORT}
export TRAJ_CLUSTER_API_HOST=${API_HOST}
export TRAJ_CLUSTER_API_PORT=${API_PORT}
export TRAJ_CLUSTER_ETCD=http://127.0.0.1:${ETCD_PORT}
export TRAJ_CLUSTER_KUBECTL=${K8S_BIN_DIR}/kubectl
export TRAJ_CLUSTER_NODES=${NODES}
EOF
if [[ "${REAL_NODE}" == 1 ]]; then
	cat "${DIR}/node/env" >>"${DIR}/env"
fi
UP_OK=1
log "control plane v${K8S_VERSION} ready in $((SECONDS - START)) s: API https://${API_HOST}:${API_PORT}," \
	"${NODES} kwok node(s)$([[ "${REAL_NODE}" != 1 ]] || echo ", real node ${TRAJ_NODE_NAME}"), logs in ${LOGS}; kubectl: ${K8S_BIN_DIR}/kubectl; stop with scripts/cluster/down.sh"
echo "export KUBECONFIG=${DIR}/kubeconfig"
