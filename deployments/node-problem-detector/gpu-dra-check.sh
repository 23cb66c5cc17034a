#!/bin/sh
# A node-problem-detector custom plugin check (exit 0 OK, 1 problem): asks the GPU DRA
# kubelet plugin's root-only status socket for /status, with curl only (no gpu-dra on
# the host). Prints `OK` or `UNHEALTHY: <first problem>`, the condition's message.
# GPU_DRA_STATUS_SOCKET overrides the socket (default: the standard data directory).
socket=${GPU_DRA_STATUS_SOCKET:-/var/lib/kubelet/plugins/gpu.example.com/status.sock}
if ! status=$(curl -sS --fail --max-time 10 --unix-socket "$socket" http://localhost/status 2>&1); then
  echo "UNHEALTHY: the plugin does not answer on $socket: $status"
  exit 1
fi
case $status in
  *'"healthy": true'*) echo "OK"; exit 0 ;;
esac
first=$(printf '%s\n' "$status" | sed -n '/"problems": \[/{n;s/^ *"//;s/",\{0,1\}$//;p;q;}')
echo "UNHEALTHY: ${first:-see gpu-dra status}"
exit 1
