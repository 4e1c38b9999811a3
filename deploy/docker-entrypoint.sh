#!/bin/sh
# The container's entrypoint: `inferd "$@"`, with the secrets it finds mounted added to the command line.
#
#   serve | gateway : the API keys. A keys file (`inferd keys create`) at $INFERD_KEYS_FILE
#                     (default /run/secrets/inferd_keys) -> --keys FILE; else a single key at $INFERD_API_KEY_FILE
#                     (default /run/secrets/inferd_api_key) -> --api-key-file FILE; else $INFERD_API_KEY, which
#                     inferd reads itself. Without any of them `--host 0.0.0.0` is refused (inferd/cli/server.py).
#   worker | gateway: the workers' shared secret at $INFERD_WORKER_SECRET_FILE
#                     (default /run/secrets/inferd_worker_secret) -> --worker-secret-file FILE; else
#                     $INFERD_WORKER_SECRET, which inferd reads itself.
#
# A flag the command line already has is never added again (the caller chose). /run/secrets/NAME is where
# `docker run --secret` / compose secrets appear; Kubernetes manifests pass the flags themselves.
set -eu

keys_file="${INFERD_KEYS_FILE:-/run/secrets/inferd_keys}"
api_key_file="${INFERD_API_KEY_FILE:-/run/secrets/inferd_api_key}"
worker_secret_file="${INFERD_WORKER_SECRET_FILE:-/run/secrets/inferd_worker_secret}"

has_flag() {  # has_flag PREFIX ARGS...: does any argument start with PREFIX?
    prefix="$1"
    shift
    for arg in "$@"; do
        case "$arg" in "$prefix"*) return 0 ;; esac
    done
    return 1
}

command="${1:-}"
case "$command" in
    serve | gateway)
        if ! has_flag --keys "$@" && ! has_flag --api-key "$@"; then
            if [ -f "$keys_file" ]; then
                set -- "$@" --keys "$keys_file"
            elif [ -f "$api_key_file" ]; then
                set -- "$@" --api-key-file "$api_key_file"
            fi
        fi
        ;;
esac
case "$command" in
    worker | gateway)
        if ! has_flag --worker-secret "$@" && [ -f "$worker_secret_file" ]; then
            set -- "$@" --worker-secret-file "$worker_secret_file"
        fi
        ;;
esac

exec inferd "$@"
