#!/usr/bin/env bash
# Make the webhook's serving certificate (a CA of its own, 2 years), store it as the Secret
# torpor-system/torpor-webhook-tls, and write the CA into webhook.yaml's caBundle.
# usage: deploy/kubernetes/make-certificate.sh        (kubectl pointed at the cluster; needs openssl)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
name=torpor-webhook.torpor-system.svc
openssl req -x509 -newkey rsa:2048 -nodes -days 730 -subj /CN=torpor-webhook-ca \
    -keyout "$tmp/ca.key" -out "$tmp/ca.crt" 2>/dev/null
openssl req -newkey rsa:2048 -nodes -subj "/CN=$name" -keyout "$tmp/tls.key" -out "$tmp/tls.csr" 2>/dev/null
printf 'subjectAltName=DNS:%s,DNS:torpor-webhook.torpor-system\n' "$name" > "$tmp/ext"
openssl x509 -req -in "$tmp/tls.csr" -CA "$tmp/ca.crt" -CAkey "$tmp/ca.key" -CAcreateserial -days 730 \
    -extfile "$tmp/ext" -out "$tmp/tls.crt" 2>/dev/null
kubectl get namespace torpor-system >/dev/null 2>&1 || kubectl create namespace torpor-system
kubectl -n torpor-system create secret tls torpor-webhook-tls --cert "$tmp/tls.crt" --key "$tmp/tls.key" \
    --dry-run=client -o yaml | kubectl apply -f -
bundle=$(base64 -w0 < "$tmp/ca.crt")
sed -i "s#caBundle: .*#caBundle: $bundle  \# make-certificate.sh writes the CA here#" "$here/webhook.yaml"
echo "make-certificate: Secret torpor-system/torpor-webhook-tls made; caBundle written to $here/webhook.yaml"
