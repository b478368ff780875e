#!/usr/bin/env bash
# Checks the images scripts/images/build.sh made, the way a cluster would use them: reads each
# image's configuration (user, entrypoint, env, tag), unpacks it into an OCI runtime bundle with
# umoci and runs it with runc — as uid 65532, read-only root filesystem, no capabilities, no new
# privileges, like the operator's pods under the `restricted` Pod Security Standard.
#
# Usage: scripts/images/verify.sh [operator] [worker]      (no image named: both)
#
# Always: both binaries start (`--version`, `crd`, `prompt --help`, `distributions`), the worker
# image's shell and python3 run as 65532, the operator image has no shell.
# With a cluster (KUBECONFIG set, e.g. under scripts/cluster/with-cluster.sh): the operator image
# connects to it, turns ready and creates the plan Job of a TrajectoryRun.
# With a model server (MODEL_BASE_URL and MODEL_NAME set, e.g. under
# scripts/model-server/with-model-server.sh): the worker image answers a prompt with the terminal
# tool, i.e. spawns bash inside the image.
# Needs root (runc); installs runc with apt-get when missing.
set -euo pipefail
# shellcheck source=scripts/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/../lib.sh"
# shellcheck source=scripts/images/common.sh
source "${REPO_ROOT}/scripts/images/common.sh"
cd "${REPO_ROOT}"

select_images "$0" "$@"
[[ ${#options[@]} -eq 0 ]] || die "unknown argument ${options[0]} (see --help)"
[[ $(id -u) -eq 0 ]] || die "runs the images with runc, which needs root"
need_commands umoci:umoci skopeo:skopeo runc:runc

work="$(mktemp -d "${TMPDIR:-/tmp}/trajectory-images-verify.XXXXXX")"
containers=()
cleanup() {
  local id
  for id in "${containers[@]}"; do runc delete --force "${id}" >/dev/null 2>&1 || true; done
  rm -rf "${work}"
}
trap cleanup EXIT

checks=0
pass() {
  checks=$((checks + 1))
  echo "  ok: $*" >&2
}
fail() {
  echo "  FAILED: $*" >&2
  exit 1
}

# Prints the image's OCI config (JSON) of layout $1.
image_config() { skopeo inspect --config "oci:${OUT}/$1:${VERSION}"; }

# Rewrites the runtime config of bundle $1 for one run: read-only root, tmpfs on /tmp and
# /workspace (the pods' emptyDirs), all capabilities dropped, no new privileges, the host's network
# (to reach a loopback API or model server), and process args $2... (none: the image's own).
configure_bundle() {
  local bundle="$1"
  shift
  python3 - "${bundle}/config.json" "$@" <<'PY'
import json, sys
path, args = sys.argv[1], sys.argv[2:]
with open(path) as f:
    config = json.load(f)
process = config["process"]
process["terminal"] = False
process["noNewPrivileges"] = True
process["capabilities"] = {kind: [] for kind in ("bounding", "effective", "inheritable", "permitted", "ambient")}
if args:
    process["args"] = args
config["root"]["readonly"] = True
linux = config["linux"]
linux["namespaces"] = [ns for ns in linux["namespaces"] if ns["type"] != "network"]
mounts = [m for m in config["mounts"] if m["destination"] not in ("/tmp", "/workspace")]
for destination in ("/tmp", "/workspace"):
    mounts.append({"destination": destination, "type": "tmpfs", "source": "tmpfs",
                   "options": ["nosuid", "nodev", "mode=1777"]})
config["mounts"] = mounts
with open(path, "w") as f:
    json.dump(config, f, indent=1)
PY
}

# Runs bundle $1 (args $2...; none: the image's entrypoint and cmd) in the foreground and prints
# its stdout; its stderr goes to $work/last.stderr. Returns the container's exit code.
run_container() {
  local bundle="$1" id
  shift
  configure_bundle "${bundle}" "$@"
  id="trajectory-verify-$$-$((checks + RANDOM))"
  containers+=("${id}")
  runc run --bundle "${bundle}" "${id}" </dev/null 2>"${work}/last.stderr"
}

# Asserts that JSON file $1 satisfies the Python expression $2 (the JSON is `c`); $3 says what.
assert_json() {
  python3 - "$1" "$2" <<'PY' || fail "$3 (in $1)"
import json, sys
c = json.load(open(sys.argv[1]))
sys.exit(0 if eval(sys.argv[2]) else 1)
PY
  pass "$3"
}

# The checks every image gets: tag in the archive, config, unpacked runtime config, sizes.
common_checks() {
  local image="$1" name="trajectory-$1" bundle="${work}/$1"
  local ref="${REGISTRY}/${name}:${VERSION}"
  # shellcheck source=images/operator/config.env
  source "images/${image}/config.env"
  echo "${name}:" >&2
  [[ -d ${OUT}/${name} ]] || die "no OCI layout at ${OUT}/${name}: run scripts/images/build.sh first"
  tar -xOf "${OUT}/${name}-${VERSION}.tar" manifest.json >"${work}/archive-manifest.json"
  assert_json "${work}/archive-manifest.json" "c[0]['RepoTags'] == ['${ref}']" \
    "the docker-archive is tagged ${ref}"
  image_config "${name}" >"${work}/${image}-config.json"
  local expected_env
  expected_env="$(printf '%s\n' "${ENV[@]}" | python3 -c 'import json,sys; print(json.dumps(sys.stdin.read().split()))')"
  assert_json "${work}/${image}-config.json" \
    "c['config']['User'] == '${NONROOT_UID}:${NONROOT_UID}' and c['os'] == 'linux'" \
    "config: user ${NONROOT_UID}:${NONROOT_UID}"
  assert_json "${work}/${image}-config.json" \
    "c['config']['Entrypoint'] == ['${ENTRYPOINT[*]}'] and c['config']['Cmd'] == ['${CMD[*]}']" \
    "config: entrypoint ${ENTRYPOINT[*]}, cmd ${CMD[*]}"
  assert_json "${work}/${image}-config.json" "all(e in c['config']['Env'] for e in ${expected_env})" \
    "config: env ${ENV[*]}"
  assert_json "${work}/${image}-config.json" \
    "c['config']['Labels']['org.opencontainers.image.version'] == '${VERSION}'" \
    "config: label org.opencontainers.image.version=${VERSION}"

  umoci unpack --image "${OUT}/${name}:${VERSION}" "${bundle}" >/dev/null
  # The mount points of the pods' emptyDirs, writable for all as an emptyDir is (runc gives a
  # tmpfs the mode of the directory it is mounted on).
  install -d -m 1777 "${bundle}/rootfs/tmp" "${bundle}/rootfs/workspace"
  assert_json "${bundle}/config.json" \
    "c['process']['user']['uid'] == ${NONROOT_UID} and c['process']['user']['gid'] == ${NONROOT_UID}" \
    "unpacked: the runtime runs it as ${NONROOT_UID}:${NONROOT_UID}"
  skopeo inspect --raw "oci:${OUT}/${name}:${VERSION}" >"${work}/${image}-manifest.json"
  python3 - "${work}/${image}-manifest.json" "${bundle}/rootfs" "${name}" <<'PY' >&2
import json, os, sys
manifest = json.load(open(sys.argv[1]))
compressed = sum(layer["size"] for layer in manifest["layers"])
unpacked = 0
for root, dirs, files in os.walk(sys.argv[2]):
    for name in files:
        path = os.path.join(root, name)
        if not os.path.islink(path):
            unpacked += os.path.getsize(path)
print(f"  size: {len(manifest['layers'])} layer(s), {compressed / 1e6:.1f} MB compressed, "
      f"{unpacked / 1e6:.1f} MB unpacked")
PY
}

# Runs `$2 --version` in bundle $1 and checks it prints "NAME VERSION" ($3: how it was found).
check_version() {
  local out name
  name="$(basename "$2")"
  out="$(run_container "$1" "$2" --version)" || fail "$2 --version: $(cat "${work}/last.stderr")"
  [[ ${out} == "${name} ${VERSION}" ]] || fail "$2 --version printed ${out}"
  pass "${name} --version${3:+ ($3)}: ${out}"
}

verify_operator() {
  local bundle="${work}/operator"
  common_checks operator
  check_version "${bundle}" /usr/local/bin/trajectory-operator
  run_container "${bundle}" /usr/local/bin/trajectory-operator crd >"${work}/crd.yaml" ||
    fail "trajectory-operator crd: $(cat "${work}/last.stderr")"
  cmp -s "${work}/crd.yaml" crds/trajectories.dev_trajectoryruns.yaml ||
    fail "the image's \`trajectory-operator crd\` differs from crds/ (build from this commit)"
  pass "trajectory-operator crd prints crds/trajectories.dev_trajectoryruns.yaml"
  [[ ! -e ${bundle}/rootfs/bin/sh && ! -e ${bundle}/rootfs/usr/bin/sh ]] || fail "the operator image has a shell"
  pass "no shell in the image"

  if [[ -z ${KUBECONFIG:-} ]]; then
    echo "  (KUBECONFIG unset: not running the operator against a cluster)" >&2
    return
  fi
  local kubectl="${TRAJ_CLUSTER_KUBECTL:-kubectl}" port namespace="trajectory-verify-$$" id
  "${kubectl}" apply --server-side --force-conflicts -f crds/ >/dev/null
  "${kubectl}" wait --for=condition=Established --timeout=30s crd/trajectoryruns.trajectories.dev >/dev/null
  # The kubeconfig has its credentials embedded (scripts/cluster); the rootfs is writable from
  # outside the container.
  install -D -m 0644 "${KUBECONFIG}" "${bundle}/rootfs/etc/trajectory-verify/kubeconfig"
  chown "${NONROOT_UID}" "${bundle}/rootfs/etc/trajectory-verify/kubeconfig"
  port="$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
  configure_bundle "${bundle}" /usr/local/bin/trajectory-operator run --leader-election=false \
    "--http-addr=127.0.0.1:${port}"
  python3 - "${bundle}/config.json" <<'PY'
import json, sys
config = json.load(open(sys.argv[1]))
config["process"]["env"].append("KUBECONFIG=/etc/trajectory-verify/kubeconfig")
json.dump(config, open(sys.argv[1], "w"), indent=1)
PY
  id="trajectory-verify-$$-operator"
  containers+=("${id}")
  runc run --bundle "${bundle}" "${id}" </dev/null >"${work}/operator.log" 2>&1 &
  local runner=$!
  local ready=""
  for _ in $(seq 1 150); do
    ready="$(python3 - "${port}" <<'PY' 2>/dev/null || true
import sys, urllib.request
print(urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/readyz", timeout=1).read().decode().strip())
PY
    )"
    [[ ${ready} == running ]] && break
    kill -0 "${runner}" 2>/dev/null || break
    sleep 0.2
  done
  [[ ${ready} == running ]] || fail "the operator container did not turn ready; its log: $(tail -n 20 "${work}/operator.log")"
  pass "the operator container connects to ${TRAJ_CLUSTER_API:-the cluster} and /readyz says running"
  "${kubectl}" create namespace "${namespace}" >/dev/null
  "${kubectl}" -n "${namespace}" apply -f - >/dev/null <<EOF
apiVersion: trajectories.dev/v1alpha1
kind: TrajectoryRun
metadata:
  name: image-check
spec:
  dataset: {path: datasets/prompts.jsonl}
  model: {baseUrl: "http://model.invalid:8000/v1", name: check}
  storage:
    volume: {emptyDir: {}}
EOF
  local job=""
  for _ in $(seq 1 150); do
    job="$("${kubectl}" -n "${namespace}" get job image-check-plan -o name 2>/dev/null || true)"
    [[ -n ${job} ]] && break
    sleep 0.2
  done
  local phase
  phase="$("${kubectl}" -n "${namespace}" get trun image-check -o jsonpath='{.status.phase}')"
  "${kubectl}" delete namespace "${namespace}" --wait=false >/dev/null
  [[ -n ${job} ]] || fail "the operator container created no plan Job; its log: $(tail -n 20 "${work}/operator.log")"
  pass "it reconciles a TrajectoryRun: ${job} created, phase ${phase}"
  runc kill "${id}" TERM
  local code=0
  wait "${runner}" || code=$?
  [[ ${code} -eq 0 ]] || fail "the operator container exited ${code} on SIGTERM; its log: $(tail -n 20 "${work}/operator.log")"
  pass "SIGTERM stops it with exit code 0"
}

verify_worker() {
  local bundle="${work}/worker" out
  common_checks worker
  check_version "${bundle}" trajectory-worker "found on PATH, as the Jobs call it"
  run_container "${bundle}" trajectory-worker prompt --help >"${work}/prompt-help.txt" ||
    fail "trajectory-worker prompt --help: $(cat "${work}/last.stderr")"
  grep -q "RUN_FILE" "${work}/prompt-help.txt" || fail "prompt --help does not mention RUN_FILE"
  pass "trajectory-worker prompt --help"
  out="$(run_container "${bundle}" trajectory-worker distributions)" || fail "trajectory-worker distributions"
  grep -q "^terminal_only" <<<"${out}" || fail "distributions lacks terminal_only"
  pass "trajectory-worker distributions lists terminal_only"
  # shellcheck disable=SC2016  # expanded by bash inside the container
  out="$(run_container "${bundle}" bash -c 'cd /workspace && echo "$(id -u):$(id -g)" >who && cat who')" ||
    fail "bash -c in the worker image: $(cat "${work}/last.stderr")"
  [[ ${out} == "${NONROOT_UID}:${NONROOT_UID}" ]] || fail "bash ran as ${out}"
  pass "bash -c runs as ${out} and writes to /workspace"
  out="$(run_container "${bundle}" python3 -c 'import ssl, sys; print(sys.version_info[0], ssl.get_default_verify_paths().cafile)')" ||
    fail "python3 in the worker image: $(cat "${work}/last.stderr")"
  [[ ${out} == "3 /usr/lib/ssl/cert.pem" && -s ${bundle}/rootfs/etc/ssl/certs/ca-certificates.crt ]] ||
    fail "python3 / CA bundle: ${out}"
  pass "python3 runs; the CA bundle is in place"
  if run_container "${bundle}" bash -c 'touch /usr/local/bin/x' >/dev/null; then
    fail "the root filesystem is writable"
  fi
  pass "the root filesystem is read-only (as in the pods)"

  if [[ -z ${MODEL_BASE_URL:-} || -z ${MODEL_NAME:-} ]]; then
    echo "  (MODEL_BASE_URL unset: not running a prompt with the terminal tool)" >&2
    return
  fi
  install -d "${bundle}/rootfs/etc/trajectory-verify"
  cat >"${bundle}/rootfs/etc/trajectory-verify/run.yaml" <<EOF
apiVersion: trajectories.dev/v1alpha1
kind: TrajectoryRun
metadata: {name: image-check}
spec:
  dataset: {path: unused.jsonl}
  model: {baseUrl: "${MODEL_BASE_URL}", name: "${MODEL_NAME}", maxTokens: 96, temperature: 0.0, requestTimeoutSeconds: 60}
  agent: {maxTurns: 2, promptTimeoutSeconds: 180}
  tools: {terminal: {timeoutSeconds: 10}}
EOF
  run_container "${bundle}" trajectory-worker prompt --toolsets terminal --workspace-root /workspace \
    /etc/trajectory-verify/run.yaml "Run echo hello in the terminal." \
    >"${work}/record.json" || fail "trajectory-worker prompt: $(tail -n 20 "${work}/last.stderr")"
  # The small test model answers this prompt with a terminal call at temperature 0 (several other
  # wordings get no call at all); the check is that bash ran in the image and its result was recorded.
  assert_json "${work}/record.json" \
    "c['tool_stats']['terminal']['success'] >= 1 and any(t['from'] == 'tool' and '<tool_response>' in t['value'] for t in c['conversations'])" \
    "a prompt against ${MODEL_BASE_URL} runs the terminal tool (bash) inside the image; its response is recorded"
}

for image in "${images[@]}"; do
  "verify_${image}"
done
echo "${checks} passed, 0 failed" >&2
