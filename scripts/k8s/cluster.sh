#!/usr/bin/env bash
# A real Kubernetes v1.20.2 cluster on this one machine: etcd on loopback, the control plane on the
# first node's address, and NODES kubelet nodes (node1, node2, ...) at 10.254.254.N on a bridge of
# their own, each with a containerd of its own. Pods are on a CNI bridge (10.88.0.0/24) with one
# route, to the node addresses through the host (10.88.0.1), where they reach the apiserver: nothing
# masqueraded, the firewall and forwarding untouched. Images are built locally:
# localhost/pause:3.4 (the sandbox) and localhost/hostusr:1 (an empty usr-merged skeleton that a pod
# fills by mounting the host's /usr). Learnt from ../shared/reference/kubernetes.md.
#
# usage: scripts/k8s/cluster.sh up [NODES]     then: export KUBECONFIG=$TORPOR_K8S_WORK/cp/kubeconfig
#        scripts/k8s/cluster.sh down           stops all of it by pid and undoes the host changes
# Needs the binaries of scripts/k8s/build.sh ($TORPOR_K8S_CACHE/bin). State in $TORPOR_K8S_WORK
# (default /var/tmp/torpor-k8s). As root.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
cache=${TORPOR_K8S_CACHE:-/var/cache/torpor-k8s}
W=${TORPOR_K8S_WORK:-/var/tmp/torpor-k8s}
B=$cache/bin
API_PORT=16443
NODE_NET=10.254.254  # the kubelets' addresses, .1 and .2, on a bridge of their own (no dummy links here)
SYSCTLS="vm.overcommit_memory vm.panic_on_oom kernel.panic kernel.panic_on_oops kernel.keys.root_maxkeys kernel.keys.root_maxbytes"
export KUBECONFIG=$W/cp/kubeconfig

say() { echo "k8s: $*"; }

stop_pid() {  # stop_pid FILE: the process it names, TERM then KILL
    local pid
    pid=$(cat "$1" 2>/dev/null) || return 0
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
    kill -9 "$pid" 2>/dev/null || true
    rm -f "$1"
}

control_plane() {
    local r=$W/cp
    mkdir -p "$r/pki"
    if [ ! -f "$r/pki/apiserver.crt" ]; then
        (cd "$r/pki"
         openssl req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.crt -days 3650 -subj /CN=torpor-test-ca 2>/dev/null
         openssl req -newkey rsa:2048 -nodes -keyout admin.key -out admin.csr -subj /O=system:masters/CN=admin 2>/dev/null
         openssl x509 -req -in admin.csr -CA ca.crt -CAkey ca.key -CAcreateserial -out admin.crt -days 3650 2>/dev/null
         openssl genrsa -out sa.key 2048 2>/dev/null && openssl rsa -in sa.key -pubout -out sa.pub 2>/dev/null
         # the apiserver's own certificate, from the same CA that pods trust (their service account's ca.crt)
         openssl req -newkey rsa:2048 -nodes -keyout apiserver.key -out apiserver.csr -subj /CN=kube-apiserver 2>/dev/null
         printf 'subjectAltName=IP:%s.1,IP:127.0.0.1,IP:10.96.0.1,DNS:kubernetes.default.svc,DNS:localhost\n' "$NODE_NET" > apiserver.ext
         openssl x509 -req -in apiserver.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days 3650 \
             -extfile apiserver.ext -out apiserver.crt 2>/dev/null)
    fi
    cat > "$r/kubeconfig" <<KC
apiVersion: v1
kind: Config
clusters: [{name: t, cluster: {server: "https://$NODE_NET.1:$API_PORT", certificate-authority: $r/pki/ca.crt}}]
users: [{name: admin, user: {client-certificate: $r/pki/admin.crt, client-key: $r/pki/admin.key}}]
contexts: [{name: t, context: {cluster: t, user: admin, namespace: default}}]
current-context: t
KC
    local etcd_client=$((API_PORT + 1)) etcd_peer=$((API_PORT + 2))
    /usr/bin/etcd --data-dir "$r/etcd" --listen-client-urls "http://127.0.0.1:$etcd_client" \
        --advertise-client-urls "http://127.0.0.1:$etcd_client" --listen-peer-urls "http://127.0.0.1:$etcd_peer" \
        --initial-advertise-peer-urls "http://127.0.0.1:$etcd_peer" --initial-cluster "default=http://127.0.0.1:$etcd_peer" \
        --unsafe-no-fsync --log-level warn --logger zap > "$r/etcd.log" 2>&1 &
    echo $! > "$r/etcd.pid"
    # on the first node's address: the pods reach it there too (their events), the host as well
    "$B/kube-apiserver" --etcd-servers="http://127.0.0.1:$etcd_client" --bind-address="$NODE_NET.1" \
        --advertise-address="$NODE_NET.1" --secure-port="$API_PORT" --insecure-port=0 \
        --tls-cert-file="$r/pki/apiserver.crt" --tls-private-key-file="$r/pki/apiserver.key" \
        --client-ca-file="$r/pki/ca.crt" --authorization-mode=RBAC \
        --service-account-issuer=https://kubernetes.default.svc.cluster.local \
        --service-account-key-file="$r/pki/sa.pub" --service-account-signing-key-file="$r/pki/sa.key" \
        --service-cluster-ip-range=10.96.0.0/24 --endpoint-reconciler-type=none --allow-privileged=true \
        --kubelet-preferred-address-types=InternalIP > "$r/apiserver.log" 2>&1 &
    echo $! > "$r/apiserver.pid"
    for _ in $(seq 600); do
        curl -sf --cacert "$r/pki/ca.crt" --cert "$r/pki/admin.crt" --key "$r/pki/admin.key" \
            "https://$NODE_NET.1:$API_PORT/readyz" >/dev/null 2>&1 && break
        kill -0 "$(cat "$r/apiserver.pid")" || { tail -20 "$r/apiserver.log" >&2; exit 1; }
        sleep 0.1
    done
    "$B/kube-controller-manager" --kubeconfig="$r/kubeconfig" --authentication-kubeconfig="$r/kubeconfig" \
        --authorization-kubeconfig="$r/kubeconfig" --bind-address=127.0.0.1 --port=0 \
        --secure-port=$((API_PORT + 3)) --cert-dir="$r/certs-kcm" --leader-elect=false \
        --service-account-private-key-file="$r/pki/sa.key" --root-ca-file="$r/pki/ca.crt" \
        --use-service-account-credentials=false --controllers='*' > "$r/kcm.log" 2>&1 &
    echo $! > "$r/kcm.pid"
    "$B/kube-scheduler" --kubeconfig="$r/kubeconfig" --authentication-kubeconfig="$r/kubeconfig" \
        --authorization-kubeconfig="$r/kubeconfig" --bind-address=127.0.0.1 --port=0 \
        --secure-port=$((API_PORT + 4)) --cert-dir="$r/certs-sched" --leader-elect=false > "$r/scheduler.log" 2>&1 &
    echo $! > "$r/scheduler.pid"
    say "control plane up"
}

containerd_config() {  # containerd_config N: node N's containerd, apart from every other's
    cat <<TOML
version = 2
root = "$W/node$1/containerd"
state = "/run/torpor-k8s/containerd$1"
[grpc]
  address = "/run/torpor-k8s/containerd$1/containerd.sock"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "localhost/pause:3.4"
  enable_selinux = false
  # root here lacks CAP_SYS_RESOURCE: a negative oom_score_adj (pause gets -998) fails runc's init
  restrict_oom_score_adj = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
        Root = "/run/torpor-k8s/runc$1"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "$W/cni"
TOML
}

images() {  # built once, imported into every node's containerd
    local o=$W/images
    if [ ! -f "$o/hostusr.tar" ]; then
        rm -rf "$o/rootfs" && mkdir -p "$o/rootfs/pause" "$o/rootfs/hostusr"
        gcc -Os -Wall -static -DVERSION=v3.4-torpor -o "$o/rootfs/pause/pause" "$B/pause.c"
        python3 "$here/mkimage.py" localhost/pause:3.4 "$o/rootfs/pause" "$o/pause.tar" --entrypoint '["/pause"]'
        local h=$o/rootfs/hostusr
        mkdir -p "$h"/{etc,tmp,proc,sys,dev,run,root,var/tmp,usr}
        chmod 1777 "$h/tmp" "$h/var/tmp"
        printf 'root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/bin/false\n' > "$h/etc/passwd"
        printf 'root:x:0:\nnogroup:x:65534:\n' > "$h/etc/group"
        for d in bin lib lib64 sbin; do ln -s "usr/$d" "$h/$d"; done
        python3 "$here/mkimage.py" localhost/hostusr:1 "$h" "$o/hostusr.tar" --cmd '["/bin/sh"]'
    fi
    for n in $(seq "$1"); do
        for i in pause hostusr; do
            ctr -a "/run/torpor-k8s/containerd$n/containerd.sock" -n k8s.io images import "$o/$i.tar" >/dev/null
        done
    done
}

kubelet() {  # kubelet N
    local d=$W/node$1 ip=$NODE_NET.$1 extra=()
    mkdir -p "$d/root" "$d/pki"
    if [ "$1" != 1 ]; then  # a cgroup root of its own: a kubelet kills the pods it finds that it does not know
        for c in cpu cpuacct cpuset memory devices freezer blkio pids systemd; do
            [ -d "/sys/fs/cgroup/$c" ] && mkdir -p "/sys/fs/cgroup/$c/node$1"
        done
        cat /sys/fs/cgroup/cpuset/cpuset.cpus > "/sys/fs/cgroup/cpuset/node$1/cpuset.cpus"
        cat /sys/fs/cgroup/cpuset/cpuset.mems > "/sys/fs/cgroup/cpuset/node$1/cpuset.mems"
        extra=(--cgroup-root="/node$1")
    fi
    cat > "$d/config.yaml" <<YAML
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
address: $ip
port: 10250
readOnlyPort: 0
healthzPort: 0
authentication: {anonymous: {enabled: true}, webhook: {enabled: false}, x509: {clientCAFile: $W/cp/pki/ca.crt}}
authorization: {mode: AlwaysAllow}
cgroupDriver: cgroupfs
failSwapOn: false
makeIPTablesUtilChains: false
clusterDomain: cluster.local
resolvConf: /etc/resolv.conf
serializeImagePulls: false
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
evictionHard: {memory.available: 100Mi, nodefs.available: 1%, imagefs.available: 1%, nodefs.inodesFree: 1%}
YAML
    "$B/kubelet" --config="$d/config.yaml" --kubeconfig="$W/cp/kubeconfig" --container-runtime=remote \
        --container-runtime-endpoint="unix:///run/torpor-k8s/containerd$1/containerd.sock" \
        --runtime-request-timeout=5m --pod-infra-container-image=localhost/pause:3.4 \
        --hostname-override="node$1" --node-ip="$ip" --root-dir="$d/root" --cert-dir="$d/pki" \
        "${extra[@]}" --v=2 > "$d/kubelet.log" 2>&1 &
    echo $! > "$d/kubelet.pid"
}

up() {
    local nodes=${1:-2}
    [ -x "$B/kubelet" ] || { echo "k8s: no Kubernetes in $B: run scripts/k8s/build.sh first" >&2; exit 1; }
    [ ! -f "$W/cp/apiserver.pid" ] || { echo "k8s: a cluster is up already in $W ('$0 down' first)" >&2; exit 1; }
    rm -rf "$W/cp/etcd" "$W"/node*/root "$W/cni-ipam"
    mkdir -p "$W/cni" /run/torpor-k8s
    cat > "$W/cni/10-torpor-test.conflist" <<CNI
{"cniVersion": "0.4.0", "name": "torpor-test", "plugins": [
  {"type": "bridge", "bridge": "cni0", "isGateway": true, "ipMasq": false, "hairpinMode": true,
   "ipam": {"type": "host-local", "ranges": [[{"subnet": "10.88.0.0/24"}]], "dataDir": "$W/cni-ipam",
            "routes": [{"dst": "$NODE_NET.0/24"}]}},
  {"type": "loopback"}]}
CNI
    # the kubelet rewrites these at start: kept to be put back by 'down'
    [ -f "$W/sysctl.saved" ] || for k in $SYSCTLS; do echo "$k=$(sysctl -n "$k")"; done > "$W/sysctl.saved"
    if ! ip link show k8snodes0 >/dev/null 2>&1; then
        ip link add k8snodes0 type bridge
        for n in $(seq "$nodes"); do ip addr add "$NODE_NET.$n/32" dev k8snodes0; done
        ip link set k8snodes0 up
    fi
    control_plane
    for n in $(seq "$nodes"); do
        mkdir -p "$W/node$n"
        containerd_config "$n" > "$W/node$n/containerd.toml"
        containerd --config "$W/node$n/containerd.toml" > "$W/node$n/containerd.log" 2>&1 &
        echo $! > "$W/node$n/containerd.pid"
    done
    for n in $(seq "$nodes"); do
        for _ in $(seq 100); do ctr -a "/run/torpor-k8s/containerd$n/containerd.sock" version >/dev/null 2>&1 && break; sleep 0.1; done
    done
    images "$nodes"
    for n in $(seq "$nodes"); do kubelet "$n"; done
    for n in $(seq "$nodes"); do
        for _ in $(seq 240); do kubectl get node "node$n" >/dev/null 2>&1 && break; sleep 0.5; done
        kubectl wait --for=condition=Ready "node/node$n" --timeout=120s >/dev/null
    done
    for _ in $(seq 120); do kubectl get serviceaccount default >/dev/null 2>&1 && break; sleep 0.5; done
    say "$nodes node(s) Ready; KUBECONFIG=$KUBECONFIG"
}

down() {
    if [ -f "$W/cp/apiserver.pid" ]; then
        timeout 90 kubectl delete pods --all --all-namespaces --grace-period=1 --wait=true >/dev/null 2>&1 || true
    fi
    for d in "$W"/node*/; do stop_pid "$d/kubelet.pid"; done
    for d in "$W"/node*/; do
        [ -f "$d/containerd.pid" ] || continue
        local n s
        n=$(basename "$d"); n=${n#node}; s=/run/torpor-k8s/containerd$n/containerd.sock
        for t in $(ctr -a "$s" -n k8s.io tasks ls -q 2>/dev/null); do ctr -a "$s" -n k8s.io tasks kill -s KILL "$t" >/dev/null 2>&1 || true; done
        sleep 1
        for t in $(ctr -a "$s" -n k8s.io tasks ls -q 2>/dev/null); do ctr -a "$s" -n k8s.io tasks rm -f "$t" >/dev/null 2>&1 || true; done
        for c in $(ctr -a "$s" -n k8s.io containers ls -q 2>/dev/null); do ctr -a "$s" -n k8s.io containers rm "$c" >/dev/null 2>&1 || true; done
        stop_pid "$d/containerd.pid"
    done
    for p in scheduler kcm apiserver etcd; do stop_pid "$W/cp/$p.pid"; done
    # what the sandboxes left: mounts, network namespaces, cgroups, links
    mount | awk '{print $3}' | grep -E "^(/run/torpor-k8s|/run/netns/cni-|$W)" | sort -r | xargs -r -n1 umount -l 2>/dev/null || true
    rm -f /run/netns/cni-* 2>/dev/null || true
    rm -rf /run/torpor-k8s
    for c in cpu cpuacct cpuset memory devices freezer blkio pids systemd unified; do
        for top in /sys/fs/cgroup/$c/kubepods /sys/fs/cgroup/$c/node[0-9]*; do
            [ -d "$top" ] && find "$top" -depth -type d -exec rmdir {} \; 2>/dev/null || true
        done
    done
    ip link del cni0 2>/dev/null || true
    ip link del k8snodes0 2>/dev/null || true
    if [ -f "$W/sysctl.saved" ]; then
        while IFS== read -r k v; do sysctl -q -w "$k=$v" || true; done < "$W/sysctl.saved"
        rm -f "$W/sysctl.saved"
    fi
    # the pod logs of the tests' namespaces (tpt-*: tests/kube/test_cluster.py), not anyone else's
    rm -rf /var/log/pods/tpt-* /var/log/containers/*_tpt-* 2>/dev/null || true
    rm -rf "$W"/node*/containerd "$W"/node*/root 2>/dev/null || true
    say "down"
}

case ${1:-} in
    up) up "${2:-2}" ;;
    down) down ;;
    *) echo "usage: $0 up [NODES] | down" >&2; exit 2 ;;
esac
