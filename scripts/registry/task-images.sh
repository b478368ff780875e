#!/usr/bin/env bash
# Pushes the tests' task images into a registry, as a dataset's per-row images would be there: three
# images made without Docker (crane append and mutate, from files of this machine), each with a
# marker file naming it (/task/marker) and a working directory of its own:
#   REGISTRY/tasks/glibc:1    bash, dash and coreutils from this Debian with their glibc libraries;
#                             WORKDIR /testbed (a SWE-style repository: README.md, add.sh with a
#                             bug, and test_add.sh, which fails until the bug is fixed)
#   REGISTRY/tasks/busybox:1  the node's busybox image (scripts/cluster/node-images.sh), musl-free
#                             static busybox; WORKDIR /work
#   REGISTRY/tasks/noshell:1  no shell and no program at all; WORKDIR /data
#   REGISTRY/tasks/python:1   the glibc image and this Debian's python3 with its standard library
#                             (no tests, no build files): the image of examples/harbor-tasks, whose
#                             verifiers call python3 (python:3.12-slim rewritten to it); WORKDIR /app
# The layers are built once per version of this script and of the host files in them, in
# ${TRAJ_CACHE_DIR}/task-images/<key>/; the pushes (a few MB) are made every time.
#
# Usage: scripts/registry/task-images.sh REGISTRY   (e.g. 127.0.0.1:5000; plain HTTP)
# Environment: TRAJ_CACHE_DIR, TRAJ_CRANE (default: scripts/registry/build.sh --print-path).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
log() { printf '[task-images %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
die() {
	log "ERROR: $*"
	exit 1
}

(($# == 1)) || die "usage: $0 REGISTRY"
REGISTRY="$1"
TRAJ_CACHE_DIR="${TRAJ_CACHE_DIR:-${HOME}/.cache/trajectory-operator}"
CRANE="${TRAJ_CRANE:-$("${HERE}/build.sh" --print-path)}"
BUSYBOX_DIR="$("${HERE}/../cluster/node-images.sh")"

# The programs of the glibc image; each is copied with the libraries ldd names for it.
GLIBC_PROGRAMS=(/bin/bash /bin/dash /bin/ls /bin/cat /bin/mkdir /bin/pwd /bin/echo /bin/env /bin/rm
	/bin/touch /bin/sleep /bin/sed /bin/grep /usr/bin/head /usr/bin/wc)

# The python image's interpreter, its standard library beside it (as Debian lays them out).
PYTHON=/usr/bin/python3
PYTHON_LIB="$("${PYTHON}" -c 'import os, sysconfig; print(os.path.realpath(sysconfig.get_paths()["stdlib"]))')"

key="$({
	cat "${BASH_SOURCE[0]}"
	sha256sum "${GLIBC_PROGRAMS[@]}" "${BUSYBOX_DIR}/busybox.tar" "$(readlink -f "${PYTHON}")"
} | sha256sum | cut -c1-16)"
LAYERS="${TRAJ_CACHE_DIR}/task-images/${key}"

# Under /usr, as on Debian with a merged /usr (/bin, /lib and /lib64 are links into it).
usr_path() {
	case "$1" in
	/usr/*) echo "$1" ;;
	*) echo "/usr$1" ;;
	esac
}

# layer TAR DIR: a reproducible tarball of DIR's contents.
layer() {
	tar --create --file "$1" --directory "$2" --sort=name --numeric-owner --owner=0 --group=0 \
		--mtime=@0 --format=posix --pax-option=exthdr.name=%d/PaxHeaders/%f,delete=atime,delete=ctime .
}

build_layers() {
	local work root program library
	mkdir -p "${TRAJ_CACHE_DIR}/task-images"
	work="$(mktemp -d "${TRAJ_CACHE_DIR}/task-images/.building.XXXXXX")"
	trap 'rm -rf "${work}"' RETURN

	root="${work}/glibc"
	mkdir -p "${root}/usr/bin" "${root}/usr/lib" "${root}/usr/lib64" "${root}/tmp" "${root}/etc" \
		"${root}/task" "${root}/testbed" "${root}/proc" "${root}/sys" "${root}/dev" "${root}/root"
	for link in bin lib lib64 sbin; do
		mkdir -p "${root}/usr/${link}"
		ln -s "usr/${link}" "${root}/${link}"
	done
	chmod 1777 "${root}/tmp"
	for program in "${GLIBC_PROGRAMS[@]}"; do
		install -D -m 0755 "${program}" "${root}$(usr_path "${program}")"
		for library in $(ldd "${program}" | grep -o '/[^ ]*'); do
			[[ -e "${root}$(usr_path "${library}")" ]] ||
				install -D -m 0755 "$(readlink -f "${library}")" "${root}$(usr_path "${library}")"
		done
	done
	ln -s dash "${root}/usr/bin/sh"
	printf 'root:x:0:0:root:/root:/bin/bash\n' >"${root}/etc/passwd"
	printf 'root:x:0:\n' >"${root}/etc/group"
	echo glibc >"${root}/task/marker"
	printf '# testbed\nA repository at /testbed, as in SWE-bench images.\n' >"${root}/testbed/README.md"
	# Its code has a bug that its test finds: the verified-trajectory tests fix it, or not.
	printf '#!/bin/bash\n# Prints the sum of its two arguments.\necho $(($1 - $2))\n' >"${root}/testbed/add.sh"
	printf '#!/bin/bash\ntest "$(bash add.sh 2 3)" = 5\n' >"${root}/testbed/test_add.sh"
	layer "${work}/glibc.tar" "${root}"

	root="${work}/busybox-task"
	mkdir -p "${root}/task" "${root}/work"
	echo busybox >"${root}/task/marker"
	layer "${work}/busybox-task.tar" "${root}"

	root="${work}/python"
	mkdir -p "${root}/usr/bin" "${root}/usr/lib" "${root}/app"
	install -m 0755 "$(readlink -f "${PYTHON}")" "${root}/usr/bin/python3"
	for library in $(ldd "${PYTHON}" | grep -o '/[^ ]*'); do
		install -D -m 0755 "$(readlink -f "${library}")" "${root}$(usr_path "${library}")"
	done
	# The standard library without what a task never runs: its tests, the build files for C
	# extensions, and Debian's site hook (a link into /etc).
	tar --create --directory "$(dirname "${PYTHON_LIB}")" --exclude=__pycache__ --exclude=test \
		--exclude='config-*' --exclude=idlelib --exclude=tkinter --exclude=lib2to3 \
		--exclude=ensurepip --exclude=site-packages --exclude=dist-packages \
		--exclude=sitecustomize.py "$(basename "${PYTHON_LIB}")" | tar --extract --directory "${root}/usr/lib"
	layer "${work}/python.tar" "${root}"

	root="${work}/noshell"
	mkdir -p "${root}/task" "${root}/data" "${root}/tmp"
	chmod 1777 "${root}/tmp"
	echo noshell >"${root}/task/marker"
	layer "${work}/noshell.tar" "${root}"

	touch "${work}/.complete"
	rm -rf "${LAYERS}"
	mv "${work}" "${LAYERS}"
	trap - RETURN
}

[[ -f "${LAYERS}/.complete" ]] || build_layers

crane() {
	"${CRANE}" --insecure "$@" >>"${LAYERS}/push.log" 2>&1 ||
		die "crane $* failed: $(tail -n 3 "${LAYERS}/push.log")"
}
start=${SECONDS}
: >"${LAYERS}/push.log"
ref="${REGISTRY}/tasks/glibc:1"
crane append --new_layer "${LAYERS}/glibc.tar" --new_tag "${ref}"
crane mutate "${ref}" --set-platform linux/amd64 --workdir /testbed --cmd /bin/bash --tag "${ref}"

ref="${REGISTRY}/tasks/busybox:1"
crane push "${BUSYBOX_DIR}/busybox.tar" "${REGISTRY}/tasks/busybox-base:1"
crane append --base "${REGISTRY}/tasks/busybox-base:1" --new_layer "${LAYERS}/busybox-task.tar" \
	--new_tag "${ref}"
crane mutate "${ref}" --workdir /work --tag "${ref}"

ref="${REGISTRY}/tasks/noshell:1"
crane append --new_layer "${LAYERS}/noshell.tar" --new_tag "${ref}"
crane mutate "${ref}" --set-platform linux/amd64 --workdir /data --tag "${ref}"
ref="${REGISTRY}/tasks/python:1"
crane append --base "${REGISTRY}/tasks/glibc:1" --new_layer "${LAYERS}/python.tar" --new_tag "${ref}"
crane mutate "${ref}" --workdir /app --tag "${ref}"
log "pushed tasks/glibc:1, tasks/busybox:1, tasks/noshell:1 and tasks/python:1 to ${REGISTRY} ($((SECONDS - start)) s)"
