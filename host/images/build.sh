#!/usr/bin/env bash
# Builds the Docker driver's base image, trellis-base:latest, with no image
# registry: a root filesystem of Debian's statically linked busybox (sh,
# sha256sum, sed, grep, tar, ...) plus /tmp, /work and /etc/passwd, imported
# with `docker import`. No compiler: see host/images/README.md.
#
# Idempotent and fast when the image exists: the image carries a label with
# a hash of this script and of the busybox binary, and the build is skipped
# when the label matches. TRELLIS_BASE_IMAGE overrides the name; --force
# rebuilds anyway.
set -euo pipefail

image="${TRELLIS_BASE_IMAGE:-trellis-base:latest}"
force=0
[[ "${1:-}" == "--force" ]] && force=1

busybox="$(command -v busybox || true)"
if [[ -z "$busybox" ]] || ! "$busybox" --list >/dev/null 2>&1; then
	echo "build.sh: busybox not found (apt-get install busybox-static)" >&2
	exit 1
fi
# A dynamically linked busybox would need the host's libc inside the image.
if ldd "$busybox" >/dev/null 2>&1; then
	echo "build.sh: $busybox is not static (apt-get install busybox-static)" >&2
	exit 1
fi

recipe="$(cat "$0" "$busybox" | sha256sum | cut -c1-16)"
current="$(docker image inspect "$image" \
	--format '{{ index .Config.Labels "trellis.recipe" }}' 2>/dev/null || true)"
previous="$(docker image inspect "$image" --format '{{.Id}}' 2>/dev/null || true)"
if [[ "$force" == 0 && "$current" == "$recipe" ]]; then
	echo "build.sh: $image is up to date ($recipe)"
	exit 0
fi

umask 022
stage="$(mktemp -d)"
trap 'rm -rf "$stage"' EXIT
root="$stage/root"
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

# The layer is reproducible: same busybox, same bytes, same layer digest on
# every host. Snapshots leave out the template's layers (the restoring host
# has them), which only works when the hosts' base layers are identical.
# Files belong to root inside the image whoever builds it.
tar --sort=name --mtime=@0 --format=gnu --numeric-owner --owner=0 --group=0 \
	-C "$root" -cf - . |
	docker import \
		--change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
		--change 'ENV HOME=/root' \
		--change 'WORKDIR /work' \
		--change 'CMD ["/bin/sh"]' \
		--change "LABEL trellis.base=1 trellis.recipe=$recipe" \
		- "$image" >/dev/null
# The image this one replaces, unless containers still use it.
if [[ -n "$previous" ]]; then docker rmi "$previous" >/dev/null 2>&1 || true; fi
echo "build.sh: built $image ($recipe)"
