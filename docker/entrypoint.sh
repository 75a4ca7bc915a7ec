#!/usr/bin/env bash
# Entrypoint of the amp-recipes image: optional Jupyter Lab and SSH services, then your command.
#
#   docker run --gpus all -it -v amp-data:/data amp-recipes                    # a shell
#   docker run --gpus all -d -p 8888:8888 -p 2222:2222 -v amp-data:/data \
#       -e JUPYTER_TOKEN="$(openssl rand -hex 24)" -e SSH_PUBLIC_KEY="$(cat ~/.ssh/id_ed25519.pub)" \
#       amp-recipes --jupyter --ssh
#
# Options (each also as an environment variable):
#   --jupyter   START_JUPYTER=1  Jupyter Lab on JUPYTER_PORT (8888), protected by JUPYTER_TOKEN
#                                (a random one is generated and printed if unset; at least 16 characters)
#   --ssh       START_SSH=1      sshd on SSH_PORT (2222), key-based login only: SSH_PUBLIC_KEY, or
#                                an authorized_keys file in AMP_STATE_DIR (/data/.container)
#   --          end of options; the rest is the command to run
# Without a command: an interactive shell when a terminal is attached, else the services run in
# the foreground until one of them stops.
set -euo pipefail

DATA_DIR=${DATA_DIR:-/data}
STATE_DIR=${AMP_STATE_DIR:-$DATA_DIR/.container}
JUPYTER_PORT=${JUPYTER_PORT:-8888}
SSH_PORT=${SSH_PORT:-2222}
start_jupyter=${START_JUPYTER:-0}
start_ssh=${START_SSH:-0}

usage() { sed -n '2,/^set -euo/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//'; }
fail() { echo "entrypoint: $*" >&2; exit 2; }

while [[ $# -gt 0 ]]; do
    case "$1" in
        --jupyter) start_jupyter=1; shift ;;
        --ssh) start_ssh=1; shift ;;
        -h | --help) usage; exit 0 ;;
        --) shift; break ;;
        -*) fail "unknown option $1 (see --help)" ;;
        *) break ;;
    esac
done

mkdir -p "$STATE_DIR" "${HF_HOME:-$DATA_DIR/huggingface}" "${WANDB_DIR:-$DATA_DIR/wandb}"
services=()

if [[ $start_ssh == 1 ]]; then
    keys=$STATE_DIR/authorized_keys
    if [[ -n ${SSH_PUBLIC_KEY:-} ]]; then
        printf '%s\n' "$SSH_PUBLIC_KEY" >"$keys"
    fi
    [[ -s $keys ]] || fail "--ssh needs a public key: set SSH_PUBLIC_KEY or put an authorized_keys file in $STATE_DIR (password login is disabled)."
    chmod 600 "$keys"
    # Host key kept on the volume: the fingerprint survives a new container.
    [[ -f $STATE_DIR/ssh_host_ed25519_key ]] || ssh-keygen -q -t ed25519 -N '' -f "$STATE_DIR/ssh_host_ed25519_key"
    # sshd as the unprivileged user: it can only log that user in, which is all we need.
    cat >"$STATE_DIR/sshd_config" <<CONFIG
Port $SSH_PORT
HostKey $STATE_DIR/ssh_host_ed25519_key
AuthorizedKeysFile $keys
PasswordAuthentication no
KbdInteractiveAuthentication no
PermitRootLogin no
PidFile $STATE_DIR/sshd.pid
CONFIG
    sshd_bin=$(command -v sshd || echo /usr/sbin/sshd)
    "$sshd_bin" -D -e -f "$STATE_DIR/sshd_config" &
    services+=($!)
    echo "entrypoint: SSH server on port $SSH_PORT (key-based login only)"
fi

if [[ $start_jupyter == 1 ]]; then
    if [[ -z ${JUPYTER_TOKEN:-} ]]; then
        JUPYTER_TOKEN=$(python -c 'import secrets; print(secrets.token_hex(24))')
        echo "entrypoint: generated Jupyter token: $JUPYTER_TOKEN"
    fi
    ((${#JUPYTER_TOKEN} >= 16)) || fail "JUPYTER_TOKEN must be at least 16 characters."
    # The token goes through the environment (jupyter_server reads JUPYTER_TOKEN), never argv,
    # where `ps` would show it.
    JUPYTER_TOKEN=$JUPYTER_TOKEN jupyter lab --ip=0.0.0.0 --port="$JUPYTER_PORT" --no-browser \
        --ServerApp.root_dir=/opt/amp-recipes &
    services+=($!)
    echo "entrypoint: Jupyter Lab on port $JUPYTER_PORT (token required)"
fi

if [[ $# -gt 0 ]]; then
    exec "$@"
fi
if [[ -t 0 ]]; then
    exec bash
fi
if [[ ${#services[@]} -gt 0 ]]; then
    wait -n "${services[@]}" # the container stops when a service does
    exit $?
fi
fail "nothing to do: give a command, attach a terminal (docker run -it), or start --jupyter/--ssh."
