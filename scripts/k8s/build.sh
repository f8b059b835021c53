#!/usr/bin/env bash
# Build Kubernetes v1.20.2 (kube-apiserver, kube-controller-manager, kube-scheduler, kubelet) from
# Debian bookworm's own source package, with Debian's Go 1.19, and install what a test cluster runs on
# (etcd, containerd, runc, the CNI plugins): nothing is downloaded but Debian's packages.
#
# The binaries are cached outside the checkout, in $TORPOR_K8S_CACHE (default /var/cache/torpor-k8s):
# a fresh machine builds them once (~14 min on 2 cores, ~3.8 GB of scratch space, removed after), every
# later run finds them and only checks the packages. Learnt from ../shared/reference/kubernetes.md.
#
# usage: scripts/k8s/build.sh        (as root)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=../apt-install.sh
source "$here/../apt-install.sh"
cache=${TORPOR_K8S_CACHE:-/var/cache/torpor-k8s}
version=v1.20.2
binaries=(kube-apiserver kube-controller-manager kube-scheduler kubelet)

debian_install k8s-build etcd-server containerd runc containernetworking-plugins busybox-static \
    iptables openssl gcc libc6-dev

if [ -f "$cache/bin/.built-$version" ]; then
    echo "k8s-build: Kubernetes $version is cached in $cache/bin"
    exit 0
fi
echo "k8s-build: building Kubernetes $version from Debian's source into $cache (about 14 minutes)"
debian_install k8s-build golang-1.19-go golang-github-modern-go-reflect2-dev rsync make bc
work=$cache/build
mkdir -p "$work/apt/sources.list.d" "$work/apt/lists/partial" "$cache/bin"
# Debian's source package through a private apt configuration: the machine's own Debian entries with
# deb-src added (copied, not edited)
sources=/etc/apt/sources.list.d/debian.sources
[ -f "$sources" ] || { echo "k8s-build: $sources not found (a Debian bookworm machine is needed)" >&2; exit 1; }
sed 's/^Types: deb$/Types: deb deb-src/' "$sources" > "$work/apt/sources.list.d/debian.sources"
apt_private=(-o Dir::Etc::sourcelist=/dev/null -o "Dir::Etc::sourceparts=$work/apt/sources.list.d"
    -o "Dir::State::Lists=$work/apt/lists")
apt-get "${apt_private[@]}" update -qq
cd "$work"
if [ ! -d kubernetes-1.20.2 ]; then
    apt-get "${apt_private[@]}" source --download-only 'kubernetes=1.20.5+really1.20.2-1.1+deb12u1' 2>&1 \
        | grep -v unsandboxed || true
    tar xzf kubernetes_1.20.5+really1.20.2.orig.tar.gz
fi
cd kubernetes-1.20.2
# the vendored reflect2 v1.0.1 crashes with Go >= 1.18: Debian's v1.0.2 instead
rm -rf vendor/github.com/modern-go/reflect2
cp -r /usr/share/gocode/src/github.com/modern-go/reflect2 vendor/github.com/modern-go/reflect2
# the tarball has no .git to stamp the version from
cat > "$work/version.env" <<'VERSION'
KUBE_GIT_COMMIT='faecb196815e248d3ecfb03c680a4507229c2a56'
KUBE_GIT_TREE_STATE='clean'
KUBE_GIT_VERSION='v1.20.2'
KUBE_GIT_MAJOR='1'
KUBE_GIT_MINOR='20'
VERSION
env -u GOFLAGS -u GO111MODULE -u GOPATH -u GOCACHE \
    PATH=/usr/lib/go-1.19/bin:$PATH HOME="$work/home" KUBE_GIT_VERSION_FILE="$work/version.env" \
    make WHAT="cmd/kube-apiserver cmd/kube-controller-manager cmd/kube-scheduler cmd/kubelet" \
    KUBE_BUILD_PLATFORMS=linux/amd64
for b in "${binaries[@]}"; do cp "_output/bin/$b" "$cache/bin/"; done
cp build/pause/linux/pause.c "$cache/bin/pause.c"  # the pod sandbox's program, built by images.sh
"$cache/bin/kube-apiserver" --version
cd /
rm -rf "$work"
touch "$cache/bin/.built-$version"
echo "k8s-build: done; binaries in $cache/bin"
