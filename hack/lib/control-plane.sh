# shellcheck shell=bash
# The control plane: PKI, kubeconfigs, etcd, kube-apiserver, kube-controller-manager
# and kube-scheduler, all on 127.0.0.1, all state under $RUN_DIR.

# --- PKI (openssl, one cluster CA plus a front-proxy CA) ---------------------------
# ECDSA P-256 keys: generating them takes milliseconds where RSA takes seconds on a
# busy 2-core machine, and every Kubernetes component and Python's ssl accept them.

pki_ca() { # <basename> <CN>
  openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days 3650 -sha256 \
    -keyout "$PKI_DIR/$1.key" -out "$PKI_DIR/$1.crt" -subj "/CN=$2" \
    -addext "basicConstraints=critical,CA:TRUE" \
    -addext "keyUsage=critical,keyCertSign,cRLSign,digitalSignature" 2>/dev/null
}

# pki_cert <ca basename> <basename> <subject> <extensions, \n separated>
# Exposed for hack/lib/node.sh (kubelet client/serving certificates).
pki_cert() {
  local ca=$1 name=$2 subject=$3 ext=$4
  openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -sha256 -keyout "$PKI_DIR/$name.key" \
    -out "$PKI_DIR/$name.csr" -subj "$subject" 2>/dev/null
  openssl x509 -req -sha256 -in "$PKI_DIR/$name.csr" -CA "$PKI_DIR/$ca.crt" \
    -CAkey "$PKI_DIR/$ca.key" -CAcreateserial -days 3650 -out "$PKI_DIR/$name.crt" \
    -extfile <(printf '%b\n' "$ext") 2>/dev/null
  rm -f "$PKI_DIR/$name.csr"
}

PKI_CLIENT_EXT='basicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature\nextendedKeyUsage=clientAuth'

make_pki() {
  if [[ -f $PKI_DIR/.complete ]]; then
    progress "PKI: reusing $PKI_DIR"
    return
  fi
  rm -rf "$PKI_DIR"
  mkdir -p "$PKI_DIR"
  chmod 700 "$PKI_DIR"
  pki_ca ca gpu-dra-local-ca
  pki_ca front-proxy-ca gpu-dra-local-front-proxy-ca
  pki_cert ca apiserver /CN=kube-apiserver \
    "basicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature\nextendedKeyUsage=serverAuth\nsubjectAltName=IP:127.0.0.1,DNS:localhost,IP:$FIRST_SERVICE_IP,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local"
  pki_cert ca admin "/O=system:masters/CN=kubernetes-admin" "$PKI_CLIENT_EXT"
  pki_cert ca kube-controller-manager /CN=system:kube-controller-manager "$PKI_CLIENT_EXT"
  pki_cert ca kube-scheduler /CN=system:kube-scheduler "$PKI_CLIENT_EXT"
  pki_cert ca apiserver-kubelet-client "/O=system:masters/CN=kube-apiserver-kubelet-client" "$PKI_CLIENT_EXT"
  pki_cert front-proxy-ca front-proxy-client /CN=front-proxy-client "$PKI_CLIENT_EXT"
  # Service-account token signing key pair (pod-bound tokens carry the node name/uid:
  # ServiceAccountTokenPodNodeInfo is GA in 1.37).
  openssl ecparam -name prime256v1 -genkey -noout -out "$PKI_DIR/sa.key" 2>/dev/null
  openssl ec -in "$PKI_DIR/sa.key" -pubout -out "$PKI_DIR/sa.pub" 2>/dev/null
  chmod 600 "$PKI_DIR"/*.key
  touch "$PKI_DIR/.complete"
  progress "PKI: CA, serving, client, front-proxy and service-account keys in $PKI_DIR"
}

# write_kubeconfig <file> <user> <cert basename>   (certificates embedded)
# Exposed for hack/lib/node.sh.
write_kubeconfig() {
  local file=$1 user=$2 cert=$3 tmp
  tmp=$(mktemp "$file.XXXXXX")
  cat >"$tmp" <<KCFG
apiVersion: v1
kind: Config
clusters:
- name: gpu-dra-local
  cluster:
    server: https://127.0.0.1:$API_PORT
    certificate-authority-data: $(base64 -w0 "$PKI_DIR/ca.crt")
users:
- name: $user
  user:
    client-certificate-data: $(base64 -w0 "$PKI_DIR/$cert.crt")
    client-key-data: $(base64 -w0 "$PKI_DIR/$cert.key")
contexts:
- name: $user@gpu-dra-local
  context:
    cluster: gpu-dra-local
    user: $user
current-context: $user@gpu-dra-local
KCFG
  chmod 600 "$tmp"
  mv -f "$tmp" "$file"
}

make_kubeconfigs() {
  mkdir -p "$KUBECONFIG_DIR"
  write_kubeconfig "$KUBECONFIG_FILE" kubernetes-admin admin
  write_kubeconfig "$KUBECONFIG_DIR/kube-controller-manager.kubeconfig" system:kube-controller-manager kube-controller-manager
  write_kubeconfig "$KUBECONFIG_DIR/kube-scheduler.kubeconfig" system:kube-scheduler kube-scheduler
}

# --- components ---------------------------------------------------------------------

start_etcd() {
  start_component etcd "$BIN_DIR/etcd" \
    --name=gpu-dra-local \
    --data-dir="$RUN_DIR/etcd" \
    --listen-client-urls="http://127.0.0.1:$ETCD_PORT" \
    --advertise-client-urls="http://127.0.0.1:$ETCD_PORT" \
    --listen-peer-urls="http://127.0.0.1:$ETCD_PEER_PORT" \
    --initial-advertise-peer-urls="http://127.0.0.1:$ETCD_PEER_PORT" \
    --initial-cluster="gpu-dra-local=http://127.0.0.1:$ETCD_PEER_PORT" \
    --unsafe-no-fsync \
    --log-level=warn
}

etcd_healthy() {
  curl -sf --max-time 2 "http://127.0.0.1:$ETCD_PORT/health" | grep -q '"health":"true"'
}

start_apiserver() {
  local reconciler=lease
  [[ $API_ADVERTISE_ADDRESS == 127.* ]] && reconciler=none
  start_component kube-apiserver "$BIN_DIR/kube-apiserver" \
    --etcd-servers="http://127.0.0.1:$ETCD_PORT" \
    --bind-address=127.0.0.1 \
    --advertise-address="$API_ADVERTISE_ADDRESS" \
    --endpoint-reconciler-type="$reconciler" \
    --secure-port="$API_PORT" \
    --tls-cert-file="$PKI_DIR/apiserver.crt" \
    --tls-private-key-file="$PKI_DIR/apiserver.key" \
    --client-ca-file="$PKI_DIR/ca.crt" \
    --kubelet-client-certificate="$PKI_DIR/apiserver-kubelet-client.crt" \
    --kubelet-client-key="$PKI_DIR/apiserver-kubelet-client.key" \
    --kubelet-preferred-address-types=InternalIP,Hostname \
    --requestheader-client-ca-file="$PKI_DIR/front-proxy-ca.crt" \
    --requestheader-allowed-names=front-proxy-client \
    --requestheader-username-headers=X-Remote-User \
    --requestheader-group-headers=X-Remote-Group \
    --requestheader-extra-headers-prefix=X-Remote-Extra- \
    --proxy-client-cert-file="$PKI_DIR/front-proxy-client.crt" \
    --proxy-client-key-file="$PKI_DIR/front-proxy-client.key" \
    --service-account-issuer="$SA_ISSUER" \
    --service-account-key-file="$PKI_DIR/sa.pub" \
    --service-account-signing-key-file="$PKI_DIR/sa.key" \
    --service-cluster-ip-range="$SERVICE_CIDR" \
    --authorization-mode=Node,RBAC \
    --enable-admission-plugins=NodeRestriction,ValidatingAdmissionPolicy,ValidatingAdmissionWebhook,MutatingAdmissionWebhook \
    --allow-privileged=true \
    --feature-gates="$FEATURE_GATES" \
    --runtime-config="$RUNTIME_CONFIG" \
    --profiling=false \
    --v=1
}

apiserver_ready() {
  curl -sf --max-time 3 --cacert "$PKI_DIR/ca.crt" "https://127.0.0.1:$API_PORT/readyz" | grep -qx ok
}

# Without a kubelet, a fake Node never renews its Lease: the node-lifecycle controller
# would taint it unreachable and evict its pods. With the real node (GPU_DRA_WITH_NODE=1)
# every controller runs. The device-taint-eviction-controller is part of '*' (DRADeviceTaints).
kcm_controllers() {
  if [[ -n ${GPU_DRA_KCM_CONTROLLERS:-} ]]; then
    printf '%s' "$GPU_DRA_KCM_CONTROLLERS"
  elif [[ ${GPU_DRA_WITH_NODE:-0} == 1 ]]; then
    printf '*'
  else
    printf '*,-node-lifecycle-controller'
  fi
}

start_controller_manager() {
  local kc=$KUBECONFIG_DIR/kube-controller-manager.kubeconfig
  start_component kube-controller-manager "$BIN_DIR/kube-controller-manager" \
    --kubeconfig="$kc" \
    --authentication-kubeconfig="$kc" \
    --authorization-kubeconfig="$kc" \
    --bind-address=127.0.0.1 \
    --secure-port="$KCM_PORT" \
    --cert-dir="$RUN_DIR/kube-controller-manager" \
    --leader-elect=false \
    --controllers="$(kcm_controllers)" \
    --use-service-account-credentials=true \
    --service-account-private-key-file="$PKI_DIR/sa.key" \
    --root-ca-file="$PKI_DIR/ca.crt" \
    --cluster-signing-cert-file="$PKI_DIR/ca.crt" \
    --cluster-signing-key-file="$PKI_DIR/ca.key" \
    --service-cluster-ip-range="$SERVICE_CIDR" \
    --feature-gates="$FEATURE_GATES" \
    --profiling=false \
    --v=1
}

start_scheduler() {
  local kc=$KUBECONFIG_DIR/kube-scheduler.kubeconfig
  start_component kube-scheduler "$BIN_DIR/kube-scheduler" \
    --kubeconfig="$kc" \
    --authentication-kubeconfig="$kc" \
    --authorization-kubeconfig="$kc" \
    --bind-address=127.0.0.1 \
    --secure-port="$SCHEDULER_PORT" \
    --cert-dir="$RUN_DIR/kube-scheduler" \
    --leader-elect=false \
    --feature-gates="$FEATURE_GATES" \
    --profiling=false \
    --v=1
}

component_healthz() { # <port>
  curl -skf --max-time 3 "https://127.0.0.1:$1/healthz" | grep -qx ok
}

# --- up / down / status ---------------------------------------------------------------

control_plane_running() {
  local c
  for c in "${CONTROL_PLANE_COMPONENTS[@]}"; do component_running "$c" || return 1; done
  [[ -f $KUBECONFIG_FILE ]] && apiserver_ready
}

component_port() {
  case $1 in
    etcd) printf '%s' "$ETCD_PORT" ;;
    kube-apiserver) printf '%s' "$API_PORT" ;;
    kube-controller-manager) printf '%s' "$KCM_PORT" ;;
    kube-scheduler) printf '%s' "$SCHEDULER_PORT" ;;
  esac
}

check_ports_free() {
  local p var busy=()
  for var in GPU_DRA_ETCD_PORT:$ETCD_PORT GPU_DRA_ETCD_PEER_PORT:$ETCD_PEER_PORT \
    GPU_DRA_API_PORT:$API_PORT GPU_DRA_KCM_PORT:$KCM_PORT GPU_DRA_SCHEDULER_PORT:$SCHEDULER_PORT; do
    p=${var#*:}
    port_in_use "$p" && busy+=("127.0.0.1:$p (${var%%:*})")
  done
  ((${#busy[@]} == 0)) || die "ports already in use by another process: ${busy[*]}; choose others through those variables"
}

# On a failed `up`, stop what this invocation started (logs stay in $LOG_DIR).
UP_STARTED=()
on_up_exit() {
  local rc=$?
  if ((rc != 0)) && ((${#UP_STARTED[@]} > 0)); then
    printf 'local-cluster: up failed; stopping what it started (logs kept in %s)\n' "$LOG_DIR" >&2
    local i
    for ((i = ${#UP_STARTED[@]} - 1; i >= 0; i--)); do stop_component "${UP_STARTED[i]}"; done
  fi
  exit "$rc"
}

up_control_plane() {
  if control_plane_running; then
    progress "control plane already running (run dir $RUN_DIR, https://127.0.0.1:$API_PORT)"
    return
  fi
  # Partial state from an earlier run (a component died): stop what is left, keep the
  # PKI and etcd data, start again.
  down_control_plane
  check_ports_free
  mkdir -p "$RUN_DIR" "$LOG_DIR" "$PID_DIR"
  touch "$RUN_MARKER"
  {
    printf 'GPU_DRA_API_PORT=%s\nGPU_DRA_ETCD_PORT=%s\nGPU_DRA_ETCD_PEER_PORT=%s\n' "$API_PORT" "$ETCD_PORT" "$ETCD_PEER_PORT"
    printf 'GPU_DRA_KCM_PORT=%s\nGPU_DRA_SCHEDULER_PORT=%s\n' "$KCM_PORT" "$SCHEDULER_PORT"
  } >"$RUN_DIR/ports.env"
  make_pki
  make_kubeconfigs

  trap on_up_exit EXIT
  start_etcd; UP_STARTED+=(etcd)
  wait_for 30 "etcd healthy on 127.0.0.1:$ETCD_PORT" etcd etcd_healthy
  start_apiserver; UP_STARTED+=(kube-apiserver)
  wait_for "$UP_TIMEOUT" "kube-apiserver ready on https://127.0.0.1:$API_PORT" kube-apiserver apiserver_ready
  start_controller_manager; UP_STARTED+=(kube-controller-manager)
  start_scheduler; UP_STARTED+=(kube-scheduler)
  wait_for 60 "kube-controller-manager healthy on :$KCM_PORT" kube-controller-manager component_healthz "$KCM_PORT"
  wait_for 60 "kube-scheduler healthy on :$SCHEDULER_PORT" kube-scheduler component_healthz "$SCHEDULER_PORT"
  # Pods need the default ServiceAccount (serviceaccount-controller) in their namespace.
  wait_for 60 "ServiceAccount default/default created" kube-controller-manager \
    kubectl_admin get serviceaccount default --namespace default
  trap - EXIT
  progress "control plane up: KUBECONFIG=$KUBECONFIG_FILE"
}

down_control_plane() {
  # Clients of the apiserver first (together), then the apiserver, then etcd.
  stop_component kube-scheduler kube-controller-manager
  stop_component kube-apiserver
  stop_component etcd
}

status_control_plane() {
  local c pid ok=0 state
  for c in "${CONTROL_PLANE_COMPONENTS[@]}"; do
    if component_running "$c"; then
      pid=$(component_pid "$c"); state="running (pid $pid)"
    else
      state="not running"; ok=1
    fi
    printf '  %-24s %-22s port %-6s log %s\n' "$c" "$state" "$(component_port "$c")" "$LOG_DIR/$c.log"
  done
  if apiserver_ready; then
    printf '  %-24s https://127.0.0.1:%s/readyz ok\n' apiserver "$API_PORT"
  else
    printf '  %-24s https://127.0.0.1:%s/readyz not ready\n' apiserver "$API_PORT"; ok=1
  fi
  return "$ok"
}
