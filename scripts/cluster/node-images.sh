#!/usr/bin/env bash
# Builds the real node's two small images without a daemon or a registry, from Debian's static busybox
# (package busybox-static), once per busybox version and version of this script:
#   ${TRAJ_CACHE_DIR}/node-images/<key>/busybox.tar   docker-archive, tag NODE_BUSYBOX_IMAGE: /bin/busybox,
#                                                    its applets as symlinks in /bin, cmd /bin/sh
#   ${TRAJ_CACHE_DIR}/node-images/<key>/pause.tar     docker-archive, tag NODE_PAUSE_IMAGE: the same layer,
#                                                    entrypoint `/bin/sleep infinity` (containerd's sandbox
#                                                    image; containerd stops it with SIGKILL)
# Prints the directory holding them. up.sh --real-node imports them into containerd's k8s.io namespace;
# pods use them with imagePullPolicy IfNotPresent (or Never).
#
# Usage: scripts/cluster/node-images.sh
set -euo pipefail

# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/lib.sh"

for tool in umoci skopeo; do
	command -v "${tool}" >/dev/null || die "${tool} is missing: run scripts/cluster/install-node.sh"
done
[[ -x /bin/busybox ]] || die "/bin/busybox is missing: run scripts/cluster/install-node.sh (package busybox-static)"

busybox_version="$(dpkg-query -W -f='${Version}' busybox-static)"
key="$({
	echo "${busybox_version}" "${NODE_BUSYBOX_IMAGE}" "${NODE_PAUSE_IMAGE}"
	cat "${BASH_SOURCE[0]}"
} | sha256sum | cut -c1-16)"
final="${TRAJ_CACHE_DIR}/node-images/${key}"
if [[ -f "${final}/.complete" ]]; then
	log "node images cached in ${final}"
	echo "${final}"
	exit 0
fi

mkdir -p "${TRAJ_CACHE_DIR}/node-images"
work="$(mktemp -d "${TRAJ_CACHE_DIR}/node-images/.building.XXXXXX")"
trap 'rm -rf "${work}"' EXIT
start=${SECONDS}
log "building ${NODE_BUSYBOX_IMAGE} and ${NODE_PAUSE_IMAGE} from busybox-static ${busybox_version}"

# The layer: busybox and a symlink per applet, /tmp, an /etc/passwd with root and nonroot (65532).
root="${work}/rootfs"
mkdir -p "${root}/bin" "${root}/etc" "${root}/tmp" "${root}/proc" "${root}/sys" "${root}/dev"
chmod 1777 "${root}/tmp"
install -m 0755 /bin/busybox "${root}/bin/busybox"
for applet in $(/bin/busybox --list); do
	[[ "${applet}" == busybox ]] || ln -s busybox "${root}/bin/${applet}"
done
printf 'root:x:0:0:root:/root:/bin/sh\nnonroot:x:65532:65532:nonroot:/home/nonroot:/bin/sh\n' >"${root}/etc/passwd"
printf 'root:x:0:\nnonroot:x:65532:\n' >"${root}/etc/group"
mkdir -p "${root}/usr/share/doc/busybox-static"
cp /usr/share/doc/busybox-static/copyright "${root}/usr/share/doc/busybox-static/" 2>/dev/null || true
tar --create --file "${work}/layer.tar" --directory "${root}" --sort=name --numeric-owner --owner=0 --group=0 \
	--mtime=@0 --format=posix --pax-option=exthdr.name=%d/PaxHeaders/%f,delete=atime,delete=ctime .

# image NAME REF CONFIG...: an OCI layout with the layer and the umoci config flags, as a docker-archive.
image() {
	local name="$1" ref="$2" layout="${work}/${1}-oci"
	shift 2
	{
		umoci init --layout "${layout}"
		umoci new --image "${layout}:latest"
		umoci raw add-layer --image "${layout}:latest" "${work}/layer.tar"
		umoci config --image "${layout}:latest" --architecture amd64 --os linux --author trajectory-operator "$@"
		skopeo --insecure-policy copy --quiet "oci:${layout}:latest" "docker-archive:${work}/out/${name}.tar:${ref}"
	} >>"${work}/build.log" 2>&1 || {
		tail -n 20 "${work}/build.log" >&2
		die "building image ${ref} failed"
	}
}
mkdir -p "${work}/out"
image busybox "${NODE_BUSYBOX_IMAGE}" --config.cmd /bin/sh
image pause "${NODE_PAUSE_IMAGE}" --config.entrypoint /bin/sleep --config.cmd infinity
touch "${work}/out/.complete"
rm -rf "${final}"
mv "${work}/out" "${final}"
log "node images built in ${final} ($((SECONDS - start)) s)"
echo "${final}"
