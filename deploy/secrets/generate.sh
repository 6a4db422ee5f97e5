#!/bin/sh
# Makes the Secrets' contents that deploy/base/kustomization.yaml's secretGenerator reads:
#
#   deploy/secrets/generate.sh [DIR]     DIR: deploy/base/secrets (git-ignored) unless given
#
#   DIR/gateway/gateway.key{,_secret}    the gateways' CURVE key pair (tierserve keys generate)
#   DIR/worker/worker.key{,_secret}      the workers' CURVE key pair, shared by every worker pod
#   DIR/gateway.env                      TIERSERVE_GATEWAY__CACHE_SALT_SECRET (one for every gateway,
#                                        so prefix caches are shared) and the API key's SHA-256
#   DIR/api-key                          the API key itself, for your clients: it never enters the cluster
#
# Needs the tierserve command (make bootstrap: .venv/bin/tierserve; or set TIERSERVE=...). Never
# overwrites: remove DIR to make new secrets, then kubectl apply -k again (the pods roll).
set -eu
out=${1:-$(dirname "$0")/../base/secrets}
tierserve=${TIERSERVE:-tierserve}
if [ -e "$out/gateway.env" ]; then
    echo "generate.sh: $out/gateway.env exists; remove $out to make new secrets" >&2
    exit 1
fi
mkdir -p "$out"
"$tierserve" keys generate "$out/gateway" --name gateway
"$tierserve" keys generate "$out/worker" --name worker
random_hex() { head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n'; }
api_key="ts-$(random_hex)"
umask 077
printf '%s\n' "$api_key" > "$out/api-key"
{
    echo "TIERSERVE_GATEWAY__CACHE_SALT_SECRET=$(random_hex)"
    echo "TIERSERVE_TENANTS__0__API_KEY_SHA256=[\"$(printf %s "$api_key" | sha256sum | cut -d' ' -f1)\"]"
} > "$out/gateway.env"
echo "secrets in $out; the API key for clients is in $out/api-key"
