#!/usr/bin/env bash
# Provision CRIU >= 4.2 for torpor without touching the machine's apt configuration.
#
# Debian 12's criu 3.17 and Debian 13's 4.1.1 do not work on this kernel (see DESIGN.md), so unless a
# `criu` on PATH is new enough and passes `criu check`, this downloads criu and the libraries it needs
# from Debian unstable/trixie with a private apt sources list, unpacks them into one folder and writes a
# wrapper that starts criu through that folder's own dynamic loader.
#
# It also builds torpor's rlimit shim (criu-rlimits.c beside this script, with gcc) into
# PREFIX/lib/torpor-criu-rlimits.so; the wrapper preloads it into every criu run when it is there. It lets
# root without CAP_SYS_RESOURCE dump processes of another user (see docs/security.md); without gcc it is
# skipped with a warning and such dumps fail as before ('torpor doctor' says so).
#
# usage: install-criu.sh PREFIX      (the wrapper lands in PREFIX/bin/criu, the files in PREFIX/criu-root)
set -euo pipefail

prefix=${1:?usage: install-criu.sh PREFIX}
mkdir -p "$prefix/bin" "$prefix/lib"
prefix=$(cd "$prefix" && pwd)
wrapper="$prefix/bin/criu"
root="$prefix/criu-root"
shim="$prefix/lib/torpor-criu-rlimits.so"
shim_source="$(cd "$(dirname "$0")" && pwd)/criu-rlimits.c"
min_major=4 min_minor=2

version_ok() {  # version_ok CRIU_COMMAND...
    local v
    v=$("$@" --version 2>/dev/null | sed -n 's/^Version: *//p') || return 1
    [ -n "$v" ] || return 1
    local major=${v%%.*} rest=${v#*.}
    local minor=${rest%%.*}
    [ "$major" -gt "$min_major" ] || { [ "$major" -eq "$min_major" ] && [ "$minor" -ge "$min_minor" ]; }
}

usable() { version_ok "$@" && "$@" check >/dev/null 2>&1; }

build_shim() {
    if ! command -v gcc >/dev/null; then
        [ -e "$shim" ] && return 0  # built before: it still works
        echo "criu: warning: no gcc, so no rlimit shim: jobs with processes of another user cannot be" \
            "checkpointed where root lacks CAP_SYS_RESOURCE (install gcc and run this again)" >&2
        return 0
    fi
    if [ -e "$shim" ] && [ "$shim" -nt "$shim_source" ]; then return 0; fi
    if gcc -O2 -Wall -Wextra -shared -fPIC -o "$shim.new" "$shim_source" -ldl; then
        mv "$shim.new" "$shim"
        echo "criu: built torpor's rlimit shim at $shim"
    else
        echo "criu: warning: the rlimit shim did not build; see the errors above" >&2
        rm -f "$shim.new" "$shim"
    fi
}

# the wrapper for the private copy; it takes the shim only when it is there when criu starts
write_private_wrapper() {
    cat >"$wrapper.new" <<WRAP
#!/bin/sh
# criu from a private folder, started through that folder's own loader (written by install-criu.sh);
# torpor's rlimit shim is preloaded into criu alone (not into what criu runs) when it was built
R="$root"
S="$shim"
L="\$R/usr/lib/x86_64-linux-gnu"
if [ -r "\$S" ]; then
    exec "\$L/ld-linux-x86-64.so.2" --preload "\$S" --library-path "\$L:\$R/lib/x86_64-linux-gnu" "\$R/usr/sbin/criu" "\$@"
fi
exec "\$L/ld-linux-x86-64.so.2" --library-path "\$L:\$R/lib/x86_64-linux-gnu" "\$R/usr/sbin/criu" "\$@"
WRAP
    chmod +x "$wrapper.new"
    mv "$wrapper.new" "$wrapper"
}

# the wrapper for a criu of the machine's own (LD_PRELOAD: the scripts criu runs get the shim too,
# where it changes nothing, see criu-rlimits.c)
write_system_wrapper() {  # write_system_wrapper CRIU
    cat >"$wrapper.new" <<WRAP
#!/bin/sh
# the machine's criu, with torpor's rlimit shim preloaded when it was built (written by install-criu.sh)
S="$shim"
if [ -r "\$S" ]; then LD_PRELOAD="\$S\${LD_PRELOAD:+:\$LD_PRELOAD}"; export LD_PRELOAD; fi
exec "$1" "\$@"
WRAP
    chmod +x "$wrapper.new"
    mv "$wrapper.new" "$wrapper"
}

# the wrapper works, with the shim if it loads there, or else without it
wrapper_works() {
    usable "$wrapper" && return 0
    [ -e "$shim" ] || return 1
    rm -f "$shim"
    usable "$wrapper" || return 1
    echo "criu: warning: criu does not start with the rlimit shim, so it was removed: jobs with" \
        "processes of another user cannot be checkpointed where root lacks CAP_SYS_RESOURCE" >&2
}

build_shim

if [ -x "$root/usr/sbin/criu" ]; then
    write_private_wrapper
    if wrapper_works; then
        echo "criu: $("$wrapper" --version | sed -n 's/^Version: *//p') already installed at $wrapper"
        exit 0
    fi
fi

system_criu=$(PATH=/usr/local/sbin:/usr/sbin:/sbin:$PATH command -v criu || true)
if [ -n "$system_criu" ] && [ "$system_criu" != "$wrapper" ] && usable "$system_criu"; then
    write_system_wrapper "$system_criu"
    wrapper_works || { echo "criu: $wrapper does not start $system_criu" >&2; exit 1; }
    echo "criu: using $system_criu ($("$system_criu" --version | sed -n 's/^Version: *//p'))"
    exit 0
fi

echo "criu: installing a private CRIU >= $min_major.$min_minor from Debian unstable into $root"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/lists/partial" "$work/archives/partial" "$work/debs"
keyring=/usr/share/keyrings/debian-archive-keyring.gpg
cat >"$work/sources.list" <<LIST
deb [signed-by=$keyring] http://deb.debian.org/debian sid main
deb [signed-by=$keyring] http://deb.debian.org/debian trixie main
LIST
# Pin sid for criu and its own libraries, trixie for the rest (matching what was tested here).
cat >"$work/preferences" <<PREF
Package: *
Pin: release n=trixie
Pin-Priority: 600

Package: criu libcompel1 libnet9 libnl-3-200
Pin: release n=sid
Pin-Priority: 700
PREF
apt_opts=(
    -o "Dir::Etc::SourceList=$work/sources.list"
    -o "Dir::Etc::SourceParts=/dev/null"
    -o "Dir::Etc::Preferences=$work/preferences"
    -o "Dir::Etc::PreferencesParts=/dev/null"
    -o "Dir::State::Lists=$work/lists"
    -o "Dir::Cache::Archives=$work/archives"
    -o "Dir::Cache::pkgcache="
    -o "Dir::Cache::srcpkgcache="
    -o "APT::Architecture=amd64"
    -o "Debug::NoLocking=1"
    -q
)
apt-get "${apt_opts[@]}" update >"$work/update.log" 2>&1 || { cat "$work/update.log" >&2; exit 1; }
packages=(criu libcompel1 libnet9 libnl-3-200
    libc6 libgnutls30t64 libnftables1 libnettle8t64 libhogweed6t64 libp11-kit0 libunistring5
    libidn2-0 libtasn1-6 libgmp10 libzstd1 libprotobuf-c1 libbsd0 libuuid1 libmd0 libjansson4 libmnl0
    libnftnl11 libxtables12 libedit2 libtinfo6 libbz2-1.0 libgcc-s1 libffi8)
(cd "$work/debs" && apt-get "${apt_opts[@]}" download "${packages[@]}") >"$work/download.log" 2>&1 \
    || { cat "$work/download.log" >&2; exit 1; }
rm -rf "$root.new"
mkdir -p "$root.new"
for deb in "$work"/debs/*.deb; do dpkg -x "$deb" "$root.new"; done
rm -rf "$root"
mv "$root.new" "$root"

write_private_wrapper

if ! wrapper_works; then
    echo "criu: the private copy does not pass 'criu check' on this machine:" >&2
    "$wrapper" check >&2 || true
    exit 1
fi
echo "criu: $("$wrapper" --version | sed -n 's/^Version: *//p') installed at $wrapper"
