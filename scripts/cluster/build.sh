#!/usr/bin/env bash
# Builds the local control plane from Go modules, once per pinned version (scripts/cluster/versions.env):
#   ${TRAJ_CACHE_DIR}/k8s/v<K8S_VERSION>/bin/{kube-apiserver,kube-controller-manager,kube-scheduler,kubectl}
#   ${TRAJ_CACHE_DIR}/etcd/v<ETCD_VERSION>/bin/etcd
#   ${TRAJ_CACHE_DIR}/kwok/v<KWOK_VERSION>/bin/{kwok,kwokctl}
# Each component is built in a temporary directory next to its final place and renamed when complete,
# so an interrupted or failed build never leaves a cache entry that looks complete.
#
# With --real-node (or TRAJ_REAL_NODE=1) also the node agent, from the same wrapper module and version:
#   ${TRAJ_CACHE_DIR}/k8s/v<K8S_VERSION>/bin/kubelet   (marked by .complete-node; a cache without it
#                                                       gets just the kubelet built)
#
# Usage: scripts/cluster/build.sh [--real-node] [--check]
#   --real-node  also build the kubelet (for up.sh --real-node)
#   --check      exit 0 when every binary is already built, 1 otherwise (builds nothing)
# Environment: TRAJ_CACHE_DIR (default ~/.cache/trajectory-operator), TRAJ_BUILD_JOBS (default 2),
#   TRAJ_REAL_NODE (1: as --real-node).
set -euo pipefail

# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/lib.sh"

CHECK=0
REAL_NODE="${TRAJ_REAL_NODE:-0}"
for arg in "$@"; do
	case "${arg}" in
	--check) CHECK=1 ;;
	--real-node) REAL_NODE=1 ;;
	-h | --help)
		sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'
		exit 0
		;;
	*) die "unknown argument: ${arg} (see --help)" ;;
	esac
done
if [[ "${CHECK}" == 1 ]]; then
	all_binaries_built || exit 1
	[[ "${REAL_NODE}" != 1 ]] || node_binaries_built
	exit
fi

command -v go >/dev/null || die "go is not on PATH (Go >= 1.26 is needed to build the control plane)"

export CGO_ENABLED=0
export GOFLAGS="-p=${TRAJ_BUILD_JOBS:-2} -buildvcs=false -trimpath"
export GOTOOLCHAIN="${GOTOOLCHAIN:-local}"

mkdir -p "${TRAJ_CACHE_DIR}"
BUILD_LOG_DIR="${TRAJ_CACHE_DIR}/build-logs"

TMP_DIRS=()
cleanup() {
	local d
	for d in "${TMP_DIRS[@]}"; do
		[[ -d "$d" ]] && rm -rf "$d"
	done
	return 0
}
trap cleanup EXIT

# run_step NAME LOG CMD...: run CMD with output to LOG; on failure name the step, show the log's tail,
# keep a copy of the log under ${BUILD_LOG_DIR} and exit.
run_step() {
	local name="$1" logfile="$2"
	shift 2
	log "step: ${name}"
	local start=${SECONDS}
	if ! "$@" >"${logfile}" 2>&1; then
		mkdir -p "${BUILD_LOG_DIR}"
		local kept
		kept="${BUILD_LOG_DIR}/failed-$(date +%Y%m%d-%H%M%S)-$(basename "${logfile}")"
		cp "${logfile}" "${kept}"
		log "FAILED step: ${name} (command: $*)"
		log "last 40 lines of its log (full log kept at ${kept}):"
		tail -n 40 "${logfile}" >&2
		exit 1
	fi
	log "done:  ${name} ($((SECONDS - start)) s)"
}

# new_build_dir COMPONENT VERSION: make and register a temporary build directory next to the final one
# and store its path in BUILD_DIR.
BUILD_DIR=""
new_build_dir() {
	mkdir -p "${TRAJ_CACHE_DIR}/$1"
	BUILD_DIR="$(mktemp -d "${TRAJ_CACHE_DIR}/$1/.v$2.building.XXXXXX")"
	TMP_DIRS+=("${BUILD_DIR}")
	mkdir -p "${BUILD_DIR}/src" "${BUILD_DIR}/bin" "${BUILD_DIR}/logs"
}

# finish_build TMP FINAL: mark TMP complete and move it into place atomically.
finish_build() {
	local tmp="$1" final="$2"
	{
		echo "built=$(date -u +%Y-%m-%dT%H:%M:%SZ)"
		echo "go=$(go env GOVERSION)"
	} >"${tmp}/.complete"
	rm -rf "${final}"
	mv "${tmp}" "${final}"
	log "installed $(basename "$(dirname "${final}")") $(basename "${final}") into ${final}/bin"
}

# module_info MODULE@VERSION LOG: download a module and print "GoMod<TAB>Sum" for it.
module_info() {
	local json="$2"
	run_step "go mod download $1" "${json}" go mod download -json "$1"
	local gomod sum
	gomod="$(sed -n 's/^[[:space:]]*"GoMod": "\(.*\)",*$/\1/p' "${json}")"
	sum="$(sed -n 's/^[[:space:]]*"Sum": "\(.*\)",*$/\1/p' "${json}")"
	[[ -f "${gomod}" ]] || die "could not find the go.mod of $1 (see ${json})"
	printf '%s\t%s\n' "${gomod}" "${sum}"
}

# go_header GOMOD: the go and godebug directives of an upstream go.mod, to build with the same semantics.
go_header() {
	grep -E '^(go|godebug) ' "$1" || true
}

# k8s_ldflags SUM: linker flags that make the binaries' --version and /version report K8S_VERSION.
k8s_ldflags() {
	local sum="$1" minor build_date ldflags pkg
	IFS=. read -r _ minor _ <<<"${K8S_VERSION}"
	build_date="$(date -u +%Y-%m-%dT%H:%M:%SZ)"
	ldflags="-s -w"
	for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
		ldflags+=" -X ${pkg}.gitVersion=v${K8S_VERSION} -X ${pkg}.gitMajor=1 -X ${pkg}.gitMinor=${minor}"
		# The Go proxy does not say which git commit a tag points at; the module's content hash identifies the source.
		ldflags+=" -X ${pkg}.gitCommit=${sum:-unknown} -X ${pkg}.gitTreeState=clean -X ${pkg}.buildDate=${build_date}"
	done
	echo "${ldflags}"
}

build_kubernetes() {
	local final="${TRAJ_CACHE_DIR}/k8s/v${K8S_VERSION}"
	if component_complete "${final}/bin" "${K8S_BINARIES[@]}"; then
		log "kubernetes v${K8S_VERSION}: cached in ${final}"
		return
	fi
	log "kubernetes v${K8S_VERSION}: building (15-30 min on 2 cores)"
	local tmp info gomod sum minor patch
	new_build_dir k8s "${K8S_VERSION}"
	tmp="${BUILD_DIR}"
	info="$(module_info "k8s.io/kubernetes@v${K8S_VERSION}" "${tmp}/logs/download.json")"
	gomod="${info%%$'\t'*}"
	sum="${info#*$'\t'}"
	IFS=. read -r _ minor patch <<<"${K8S_VERSION}"

	# Every module upstream replaces with ./staging/src/k8s.io/<name> is published as k8s.io/<name> v0.<minor>.<patch>.
	local staging
	staging="$(awk '
		/^replace[[:space:]]*\($/ { inblock = 1; next }
		inblock && /^\)/ { inblock = 0; next }
		inblock && $2 == "=>" && $3 ~ /^\.\/staging\// { print $1 }
		/^replace[[:space:]]+[^(]/ && $3 == "=>" && $4 ~ /^\.\/staging\// { print $2 }
	' "${gomod}")"
	[[ -n "${staging}" ]] || die "found no staging replace directives in ${gomod}"

	{
		echo "// Generated by scripts/cluster/build.sh: builds the binaries of k8s.io/kubernetes v${K8S_VERSION}."
		echo "module trajectory.local/k8s-build"
		echo
		go_header "${gomod}"
		echo
		echo "require k8s.io/kubernetes v${K8S_VERSION}"
		echo
		echo "replace ("
		local m
		for m in ${staging}; do
			echo "	${m} => ${m} v0.${minor}.${patch}"
		done
		echo ")"
	} >"${tmp}/src/go.mod"
	cat >"${tmp}/src/tools.go" <<-'EOF'
		//go:build tools

		package tools

		import (
			_ "k8s.io/kubernetes/cmd/kube-apiserver"
			_ "k8s.io/kubernetes/cmd/kube-controller-manager"
			_ "k8s.io/kubernetes/cmd/kube-scheduler"
			_ "k8s.io/kubernetes/cmd/kubectl"
		)
	EOF
	log "wrapper module replaces $(wc -w <<<"${staging}") staging modules with v0.${minor}.${patch}"

	local ldflags
	ldflags="$(k8s_ldflags "${sum}")"

	# shellcheck disable=SC2016 # expanded by the inner bash
	run_step "go mod tidy (kubernetes wrapper module)" "${tmp}/logs/tidy.log" \
		bash -c 'cd "$1" && go mod tidy' _ "${tmp}/src"
	# shellcheck disable=SC2016 # expanded by the inner bash
	run_step "go build kube-apiserver kube-controller-manager kube-scheduler kubectl" "${tmp}/logs/build.log" \
		bash -c 'cd "$1" && nice -n 19 go build -ldflags "$2" -o "$3/" \
			k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kube-controller-manager \
			k8s.io/kubernetes/cmd/kube-scheduler k8s.io/kubernetes/cmd/kubectl' \
		_ "${tmp}/src" "${ldflags}" "${tmp}/bin"

	local v
	v="$("${tmp}/bin/kube-apiserver" --version 2>&1)"
	[[ "${v}" == "Kubernetes v${K8S_VERSION}" ]] || die "kube-apiserver --version printed '${v}', want 'Kubernetes v${K8S_VERSION}'"
	finish_build "${tmp}" "${final}"
}

# build_kubelet: the node agent, from the same wrapper module and version as the control plane (which
# build_kubernetes made first). It is added to that component's bin/ directory on its own, marked by
# .complete-node, so a cache made before the real node existed stays valid and only the kubelet is built.
build_kubelet() {
	local final="${TRAJ_CACHE_DIR}/k8s/v${K8S_VERSION}"
	if node_binaries_built; then
		log "kubelet v${K8S_VERSION}: cached in ${final}"
		return
	fi
	[[ -f "${final}/src/go.mod" ]] || die "no wrapper module in ${final}/src (build the control plane first)"
	log "kubelet v${K8S_VERSION}: building (the control plane's packages are in Go's build cache)"
	local tmp info sum
	new_build_dir k8s "${K8S_VERSION}-kubelet"
	tmp="${BUILD_DIR}"
	cp "${final}/src/go.mod" "${final}/src/go.sum" "${tmp}/src/"
	cat >"${tmp}/src/tools.go" <<-'EOF'
		//go:build tools

		package tools

		import _ "k8s.io/kubernetes/cmd/kubelet"
	EOF
	info="$(module_info "k8s.io/kubernetes@v${K8S_VERSION}" "${tmp}/logs/download.json")"
	sum="${info#*$'\t'}"
	# shellcheck disable=SC2016 # expanded by the inner bash
	run_step "go mod tidy (kubernetes wrapper module, kubelet)" "${tmp}/logs/kubelet-tidy.log" \
		bash -c 'cd "$1" && go mod tidy' _ "${tmp}/src"
	# shellcheck disable=SC2016 # expanded by the inner bash
	run_step "go build kubelet" "${tmp}/logs/kubelet-build.log" \
		bash -c 'cd "$1" && nice -n 19 go build -ldflags "$2" -o "$3/kubelet" k8s.io/kubernetes/cmd/kubelet' \
		_ "${tmp}/src" "$(k8s_ldflags "${sum}")" "${tmp}/bin"
	local v
	v="$("${tmp}/bin/kubelet" --version 2>&1)"
	[[ "${v}" == "Kubernetes v${K8S_VERSION}" ]] || die "kubelet --version printed '${v}', want 'Kubernetes v${K8S_VERSION}'"
	cp "${tmp}/logs/kubelet-tidy.log" "${tmp}/logs/kubelet-build.log" "${final}/logs/" 2>/dev/null || true
	mv "${tmp}/bin/kubelet" "${final}/bin/kubelet"
	{
		echo "built=$(date -u +%Y-%m-%dT%H:%M:%SZ)"
		echo "go=$(go env GOVERSION)"
	} >"${final}/.complete-node"
	log "installed kubelet v${K8S_VERSION} into ${final}/bin"
}

build_etcd() {
	local final="${TRAJ_CACHE_DIR}/etcd/v${ETCD_VERSION}"
	if component_complete "${final}/bin" "${ETCD_BINARIES[@]}"; then
		log "etcd v${ETCD_VERSION}: cached in ${final}"
		return
	fi
	log "etcd v${ETCD_VERSION}: building"
	local tmp info gomod sum
	new_build_dir etcd "${ETCD_VERSION}"
	tmp="${BUILD_DIR}"
	info="$(module_info "go.etcd.io/etcd/server/v3@v${ETCD_VERSION}" "${tmp}/logs/download.json")"
	gomod="${info%%$'\t'*}"
	sum="${info#*$'\t'}"

	# The server module replaces its sibling modules (api, client/pkg, client/v3, pkg) with ../<dir>;
	# each is published at the same version.
	local siblings
	siblings="$(awk '
		/^replace[[:space:]]*\($/ { inblock = 1; next }
		inblock && /^\)/ { inblock = 0; next }
		inblock && $2 == "=>" && $3 ~ /^\.\.\// { print $1 }
		/^replace[[:space:]]+[^(]/ && $3 == "=>" && $4 ~ /^\.\.\// { print $2 }
	' "${gomod}")"
	[[ -n "${siblings}" ]] || die "found no sibling replace directives in ${gomod}"
	{
		echo "// Generated by scripts/cluster/build.sh: builds etcd v${ETCD_VERSION}."
		echo "module trajectory.local/etcd-build"
		echo
		go_header "${gomod}"
		echo
		echo "require go.etcd.io/etcd/server/v3 v${ETCD_VERSION}"
		echo
		echo "replace ("
		local m
		for m in ${siblings}; do
			echo "	${m} => ${m} v${ETCD_VERSION}"
		done
		echo ")"
	} >"${tmp}/src/go.mod"
	cat >"${tmp}/src/tools.go" <<-'EOF'
		//go:build tools

		package tools

		import _ "go.etcd.io/etcd/server/v3"
	EOF

	# shellcheck disable=SC2016 # expanded by the inner bash
	run_step "go mod tidy (etcd wrapper module)" "${tmp}/logs/tidy.log" \
		bash -c 'cd "$1" && go mod tidy' _ "${tmp}/src"
	# shellcheck disable=SC2016 # expanded by the inner bash
	run_step "go build etcd" "${tmp}/logs/build.log" \
		bash -c 'cd "$1" && nice -n 19 go build -ldflags "$2" -o "$3/etcd" go.etcd.io/etcd/server/v3' \
		_ "${tmp}/src" "-s -w -X go.etcd.io/etcd/api/v3/version.GitSHA=${sum:-unknown}" "${tmp}/bin"

	"${tmp}/bin/etcd" --version 2>&1 | grep -q "etcd Version: ${ETCD_VERSION}" ||
		die "etcd --version does not report ${ETCD_VERSION}"
	finish_build "${tmp}" "${final}"
}

build_kwok() {
	local final="${TRAJ_CACHE_DIR}/kwok/v${KWOK_VERSION}"
	if component_complete "${final}/bin" "${KWOK_BINARIES[@]}" && [[ -f "${KWOK_STAGES_FILE}" ]]; then
		log "kwok v${KWOK_VERSION}: cached in ${final}"
		return
	fi
	log "kwok v${KWOK_VERSION}: building"
	local tmp
	new_build_dir kwok "${KWOK_VERSION}"
	tmp="${BUILD_DIR}"
	run_step "go install kwok kwokctl" "${tmp}/logs/build.log" \
		env GOBIN="${tmp}/bin" nice -n 19 go install -ldflags "-s -w" \
		"sigs.k8s.io/kwok/cmd/kwok@v${KWOK_VERSION}" "sigs.k8s.io/kwok/cmd/kwokctl@v${KWOK_VERSION}"
	"${tmp}/bin/kwok" --version 2>&1 | grep -q "${KWOK_VERSION}" || die "kwok --version does not report ${KWOK_VERSION}"

	# The kwok binary has no built-in stages (kwokctl writes them into its config): keep upstream's default
	# ones (node initialize + heartbeat with lease, pod ready/complete/delete) as one config file.
	local info dir f
	info="$(module_info "sigs.k8s.io/kwok@v${KWOK_VERSION}" "${tmp}/logs/download.json")"
	dir="$(sed -n 's/^[[:space:]]*"Dir": "\(.*\)",*$/\1/p' "${tmp}/logs/download.json")"
	[[ -d "${dir}" ]] || die "could not find the source of sigs.k8s.io/kwok@v${KWOK_VERSION} (${info})"
	mkdir -p "${tmp}/etc"
	for f in node/fast/node-initialize.yaml node/heartbeat-with-lease/node-heartbeat-with-lease.yaml \
		pod/fast/pod-ready.yaml pod/fast/pod-complete.yaml pod/fast/pod-delete.yaml; do
		[[ -f "${dir}/kustomize/stage/${f}" ]] || die "kwok stage ${f} not found in ${dir}"
		echo "---"
		cat "${dir}/kustomize/stage/${f}"
	done >"${tmp}/etc/kwok-stages.yaml"
	finish_build "${tmp}" "${final}"
}

# One build at a time per cache directory.
exec 8>"${TRAJ_CACHE_DIR}/.build.lock"
if ! flock -n 8; then
	log "another build holds ${TRAJ_CACHE_DIR}/.build.lock; waiting for it"
	flock 8
fi

# Temporary directories of builds that were killed (the lock says none is running now).
for stale in "${TRAJ_CACHE_DIR}"/{k8s,etcd,kwok}/.v*.building.*; do
	if [[ -d "${stale}" ]]; then
		log "removing ${stale} (left by an interrupted build)"
		rm -rf "${stale}"
	fi
done

start=${SECONDS}
build_etcd
build_kwok
build_kubernetes
if [[ "${REAL_NODE}" == 1 ]]; then
	build_kubelet
fi
log "all binaries ready ($((SECONDS - start)) s)"
