#!/usr/bin/env bash
# Builds the Docker driver's images locally, with no image registry.
#
#   host/images/build.sh [--force] [base] [debian]     (default: base)
#
# base    trellis-base:latest, ~2 MB: Debian's statically linked busybox (sh,
#         sha256sum, sed, grep, tar, ...) plus /tmp, /work and /etc/passwd,
#         imported with `docker import`. The driver's default template.
# debian  trellis-debian:latest, ~250 MB: a Debian 12 minbase with gcc, the C
#         library headers and make, built by mmdebstrap (about 30 s with a
#         Debian mirror reachable), for workloads that compile programs.
#
# Idempotent and fast when an image exists: each image carries a label with
# a hash of its recipe (this script, and the busybox binary for base), and
# the build is skipped when the label matches. --force rebuilds anyway.
# TRELLIS_BASE_IMAGE, TRELLIS_DEBIAN_IMAGE and TRELLIS_DEBIAN_MIRROR
# override the names and the mirror.
set -euo pipefail

force=0
targets=()
for arg in "$@"; do
	case "$arg" in
	--force) force=1 ;;
	base | debian) targets+=("$arg") ;;
	*)
		echo "usage: $0 [--force] [base] [debian]" >&2
		exit 2
		;;
	esac
done
((${#targets[@]})) || targets=(base)

# up_to_date IMAGE RECIPE: whether IMAGE exists, built from RECIPE.
up_to_date() {
	local current
	current="$(docker image inspect "$1" \
		--format '{{ index .Config.Labels "trellis.recipe" }}' 2>/dev/null || true)"
	[[ "$force" == 0 && "$current" == "$2" ]]
}

# import IMAGE RECIPE [--change ...]: imports a root filesystem tar from
# stdin as IMAGE, then removes the image it replaces (unless in use).
import() {
	local image="$1" recipe="$2" previous
	shift 2
	previous="$(docker image inspect "$image" --format '{{.Id}}' 2>/dev/null || true)"
	docker import \
		--change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
		--change 'ENV HOME=/root' \
		--change 'WORKDIR /work' \
		--change 'CMD ["/bin/sh"]' \
		--change "LABEL trellis.base=1 trellis.recipe=$recipe" \
		"$@" - "$image" >/dev/null
	if [[ -n "$previous" ]]; then docker rmi "$previous" >/dev/null 2>&1 || true; fi
	echo "build.sh: built $image ($recipe)"
}

build_base() {
	local image="${TRELLIS_BASE_IMAGE:-trellis-base:latest}" busybox recipe
	busybox="$(command -v busybox || true)"
	if [[ -z "$busybox" ]] || ! "$busybox" --list >/dev/null 2>&1; then
		echo "build.sh: busybox not found (apt-get install busybox-static)" >&2
		exit 1
	fi
	# A dynamically linked busybox would need the host's libc in the image.
	if ldd "$busybox" >/dev/null 2>&1; then
		echo "build.sh: $busybox is not static (apt-get install busybox-static)" >&2
		exit 1
	fi
	recipe="$(cat "$0" "$busybox" | sha256sum | cut -c1-16)"
	if up_to_date "$image" "$recipe"; then
		echo "build.sh: $image is up to date ($recipe)"
		return
	fi

	local root="$stage/base"
	mkdir -p "$root"/{bin,sbin,usr/bin,usr/sbin,etc,tmp,work,root,proc,sys,dev,run,var/tmp}
	chmod 1777 "$root/tmp" "$root/var/tmp"
	install -m 0755 "$busybox" "$root/bin/busybox"
	# `busybox --install -s` would point every link at the host path of this
	# staging copy; links made here point at /bin/busybox inside the image.
	"$busybox" --list-full | while read -r applet; do
		[[ -e "$root/$applet" ]] || ln -s /bin/busybox "$root/$applet"
	done
	cat >"$root/etc/passwd" <<'PASSWD'
root:x:0:0:root:/root:/bin/sh
nobody:x:65534:65534:nobody:/nonexistent:/bin/false
PASSWD
	cat >"$root/etc/group" <<'GROUP'
root:x:0:
nogroup:x:65534:
GROUP
	# The layer is reproducible: same busybox, same bytes, same layer digest
	# on every host. Snapshots leave out the template's layers (the
	# restoring host has them), which works only when the hosts' base
	# layers are identical. Files belong to root whoever builds the image.
	tar --sort=name --mtime=@0 --format=gnu --numeric-owner --owner=0 \
		--group=0 -C "$root" -cf - . | import "$image" "$recipe"
}

build_debian() {
	local image="${TRELLIS_DEBIAN_IMAGE:-trellis-debian:latest}" recipe
	local mirror="${TRELLIS_DEBIAN_MIRROR:-http://deb.debian.org/debian}"
	recipe="$( (cat "$0" && echo "debian $mirror") | sha256sum | cut -c1-16)"
	if up_to_date "$image" "$recipe"; then
		echo "build.sh: $image is up to date ($recipe)"
		return
	fi
	if ! command -v mmdebstrap >/dev/null; then
		echo "build.sh: mmdebstrap not found (apt-get install mmdebstrap)" >&2
		exit 1
	fi
	# mmdebstrap, not debootstrap: it installs with apt (parallel downloads)
	# and writes the tarball to stdout, no staging directory. Docs,
	# man pages and translations are left out; the package lists are
	# removed by mmdebstrap itself. The layer is not reproducible across
	# hosts (the mirror moves), so thin snapshots of it restore only on
	# engines that share the same build.
	SOURCE_DATE_EPOCH=0 mmdebstrap --quiet --variant=minbase \
		--include=gcc,libc6-dev,make \
		--dpkgopt='path-exclude=/usr/share/doc/*' \
		--dpkgopt='path-exclude=/usr/share/man/*' \
		--dpkgopt='path-exclude=/usr/share/info/*' \
		--dpkgopt='path-exclude=/usr/share/locale/*' \
		--customize-hook='mkdir -p "$1/work"' \
		bookworm - "$mirror" | import "$image" "$recipe"
}

stage="$(mktemp -d)"
trap 'rm -rf "$stage"' EXIT
umask 022
for target in "${targets[@]}"; do "build_$target"; done
