#!/usr/bin/env bash
# CI, before the tests: what the Docker driver's tests and the end-to-end
# tests need on a fresh Debian 12 machine, as root. Installs Docker, busybox,
# bubblewrap and mmdebstrap from Debian (only what is missing), starts
# dockerd unless an engine already answers, and builds the images locally
# (no registry is reachable). Safe to run again, with or without a running
# engine. TRELLIS_IMAGES picks the images (default "base debian"; the
# debian one, with a compiler, takes 30-90 s to build the first time).
set -euo pipefail
cd "$(dirname "$0")/.."

need=()
command -v dockerd >/dev/null || need+=(docker.io)
# The static busybox, not the dynamic one: it goes into the image alone.
dpkg -s busybox-static >/dev/null 2>&1 || need+=(busybox-static)
command -v bwrap >/dev/null || need+=(bubblewrap)
images="${TRELLIS_IMAGES:-base debian}"
if [[ " $images " == *" debian "* ]]; then
	command -v mmdebstrap >/dev/null || need+=(mmdebstrap)
fi
if ((${#need[@]})); then
	echo "--- apt-get install ${need[*]}"
	export DEBIAN_FRONTEND=noninteractive
	apt-get update -qq
	apt-get install -y -qq "${need[@]}"
fi

if ! docker info >/dev/null 2>&1; then
	log="${DOCKERD_LOG:-/var/log/dockerd.log}"
	echo "--- starting dockerd (log: $log)"
	# No systemd on a CI runner: run the daemon in the background, detached
	# from this shell so it outlives the script.
	nohup dockerd >"$log" 2>&1 </dev/null &
	for _ in $(seq 60); do
		docker info >/dev/null 2>&1 && break
		sleep 1
	done
	if ! docker info >/dev/null 2>&1; then
		echo "dockerd did not come up within 60 s; its log:" >&2
		tail -n 50 "$log" >&2
		exit 1
	fi
fi
echo "--- docker $(docker version --format '{{.Server.Version}}')"

# shellcheck disable=SC2086 # a list of targets
host/images/build.sh $images
