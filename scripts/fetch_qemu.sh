#!/bin/sh
# fetch_qemu.sh DIR: QEMU's x86-64 user-mode emulator (Debian's qemu-user-static, one static binary)
# unpacked into DIR/qemu-x86_64, for the emulated-CPU tests (tests/worker/test_emulated_cpu.py).
# `apt-get download` needs no root, only apt's package lists; as root it refreshes them once when the
# package is not listed. It never installs anything into the system. Fails soft: where the binary
# cannot be had, it says why and exits 0, and the tests that need it skip with the same reason.
set -u
dir=$1
mkdir -p "$dir"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
say() { echo "fetch_qemu: $*" >&2; }

if ! command -v apt-get >/dev/null 2>&1 || ! command -v dpkg-deb >/dev/null 2>&1; then
	say "no apt-get / dpkg-deb (not Debian): the emulated-CPU tests will skip"
	exit 0
fi
say "fetching qemu-user-static from Debian's registry into $dir (about 60 MB, once)"
if ! (cd "$work" && apt-get download -q qemu-user-static >"$work/log" 2>&1); then
	if [ "$(id -u)" = 0 ]; then
		say "not in apt's package lists: apt-get update, then again"
		apt-get update -q >"$work/log" 2>&1 || true
		(cd "$work" && apt-get download -q qemu-user-static >"$work/log" 2>&1)
	fi
fi
deb=$(ls "$work"/qemu-user-static_*.deb 2>/dev/null | head -n 1)
if [ -z "$deb" ]; then
	say "could not download qemu-user-static (apt-get said: $(tail -n 1 "$work/log")): the emulated-CPU tests will skip"
	exit 0
fi
dpkg-deb -x "$deb" "$work/x" && cp "$work/x/usr/bin/qemu-x86_64-static" "$dir/qemu-x86_64.part" \
	&& mv "$dir/qemu-x86_64.part" "$dir/qemu-x86_64" \
	&& say "$("$dir/qemu-x86_64" --version | head -n 1) in $dir" \
	|| say "could not unpack $deb: the emulated-CPU tests will skip"
exit 0
