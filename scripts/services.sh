# Installs (from Debian's packages) and starts, on loopback, the servers the tests talk to, when
# they are not already answering. Sourced by scripts/test; every function is idempotent.

log() { printf 'services: %s\n' "$*" >&2; }

apt_install() {
  if [ "$(id -u)" -ne 0 ]; then
    log "need root to install $* (or start it yourself and set its URL)"; return 1
  fi
  if [ -z "${APT_UPDATED:-}" ]; then
    DEBIAN_FRONTEND=noninteractive apt-get update -qq >/dev/null
    APT_UPDATED=1
  fi
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@" >/dev/null
}

port_open() { (exec 3<>"/dev/tcp/$1/$2") 2>/dev/null; }

wait_port() {
  local host=$1 port=$2 name=$3
  for _ in $(seq 1 60); do
    port_open "$host" "$port" && return 0
    sleep 0.5
  done
  log "$name did not start listening on $host:$port"; return 1
}

ensure_postgres() {
  if port_open 127.0.0.1 5432; then return 0; fi
  command -v pg_ctlcluster >/dev/null 2>&1 || { log "installing postgresql"; apt_install postgresql; }
  local version
  version=$(ls /etc/postgresql | sort -V | tail -n 1)
  if [ -z "$version" ]; then
    version=$(ls /usr/lib/postgresql | sort -V | tail -n 1)
    pg_createcluster "$version" main >/dev/null
  fi
  log "starting postgresql $version"
  # The package may have started it already; the port check below tells whether it runs.
  pg_ctlcluster --skip-systemctl-redirect "$version" main start || true
  wait_port 127.0.0.1 5432 postgresql
  # A fresh cluster asks for a password on TCP: give the superuser the one the tests use.
  su postgres -c "psql -qc \"ALTER USER postgres PASSWORD 'postgres'\"" >/dev/null
}

# The wrong-password test needs one role that must authenticate even where loopback is trusted:
# a scram rule for it alone, ahead of the others.
ensure_postgres_password_rule() {
  local hba
  hba=$(su postgres -c "psql -Atc 'show hba_file'") || return 1
  if ! grep -q 'leader_password_test' "$hba"; then
    log "adding a password rule for role leader_password_test to $hba"
    sed -i '1i host all leader_password_test 127.0.0.1/32 scram-sha-256\nhost all leader_password_test ::1/128 scram-sha-256' "$hba"
    su postgres -c "psql -qAtc 'SELECT pg_reload_conf()'" >/dev/null
  fi
}

# PgBouncer from Debian's packages in front of the loopback Postgres, in transaction pooling
# mode, as managed poolers offer it: each transaction gets whichever server session is free, so
# a statement prepared on one session is missing on the next, and a LISTEN hears nothing. On
# port 6432, clients trusted on loopback as user postgres; scripts/test runs the table lock's
# tests through it (PGBOUNCER_URL).
PGBOUNCER_PORT=6432
ensure_pgbouncer() {
  if port_open 127.0.0.1 "$PGBOUNCER_PORT"; then
    # Ours, or one that serves the test databases as user postgres all the same.
    psql -qAt "postgres://postgres:postgres@127.0.0.1:${PGBOUNCER_PORT}/postgres" -c 'SELECT 1' >/dev/null 2>&1 \
      || { log "something on 127.0.0.1:$PGBOUNCER_PORT is not a PgBouncer in front of the loopback Postgres: stop it, or set PGBOUNCER_URL"; return 1; }
    return 0
  fi
  if ! command -v pgbouncer >/dev/null 2>&1; then
    log "installing pgbouncer"
    apt_install pgbouncer
    # Where systemd runs, the package starts its own (session mode, no databases) on our port.
    if command -v systemctl >/dev/null 2>&1; then
      systemctl disable --now pgbouncer >/dev/null 2>&1 || true
    fi
  fi
  local dir
  dir=$(mktemp -d /tmp/leader-pgbouncer.XXXXXX)
  cat > "$dir/pgbouncer.ini" <<EOF
[databases]
* = host=127.0.0.1 port=5432
[pgbouncer]
listen_addr = 127.0.0.1
listen_port = $PGBOUNCER_PORT
unix_socket_dir =
auth_type = trust
auth_file = $dir/users.txt
pool_mode = transaction
logfile = $dir/pgbouncer.log
pidfile = $dir/pgbouncer.pid
EOF
  # The password is the one PgBouncer logs in to Postgres with.
  printf '"postgres" "postgres"\n' > "$dir/users.txt"
  chown -R postgres "$dir"
  log "starting pgbouncer (transaction pooling) on 127.0.0.1:$PGBOUNCER_PORT (config in $dir)"
  # PgBouncer refuses to run as root.
  su postgres -s /bin/sh -c "pgbouncer -d '$dir/pgbouncer.ini'"
  wait_port 127.0.0.1 "$PGBOUNCER_PORT" pgbouncer
}

# MariaDB from Debian's packages; the tests connect over TCP as root without a password, as this
# machine's own server allows (a fresh install lets root in through its Unix socket only).
ensure_mariadb() {
  if ! port_open 127.0.0.1 3306; then
    command -v mariadbd >/dev/null 2>&1 || { log "installing mariadb-server"; apt_install mariadb-server; }
    log "starting mariadb"
    mkdir -p /run/mysqld && chown mysql:mysql /run/mysqld 2>/dev/null || true
    service mariadb start >/dev/null 2>&1 \
      || (setsid mysqld_safe --bind-address=127.0.0.1 >/dev/null 2>&1 &)
    wait_port 127.0.0.1 3306 mariadb
  fi
  if ! mariadb -uroot -h127.0.0.1 -e 'SELECT 1' >/dev/null 2>&1; then
    log "letting root in over TCP without a password"
    mariadb -uroot -e "ALTER USER root@localhost IDENTIFIED VIA mysql_native_password USING PASSWORD('') OR unix_socket" >/dev/null
  fi
  # The database the tests use when MYSQL_URL names none of its own.
  mariadb -uroot -h127.0.0.1 -e 'CREATE DATABASE IF NOT EXISTS test'
}

# NATS with JetStream (the tests' key-value buckets live in it), from Debian's package.
ensure_nats() {
  if port_open 127.0.0.1 4222; then return 0; fi
  command -v nats-server >/dev/null 2>&1 || { log "installing nats-server"; apt_install nats-server; }
  log "starting nats-server with JetStream"
  mkdir -p /var/lib/nats-leader-tests
  (setsid nats-server -a 127.0.0.1 -p 4222 -js -sd /var/lib/nats-leader-tests \
    >/var/log/nats-leader-tests.log 2>&1 &)
  wait_port 127.0.0.1 4222 nats-server
}

# Deletes the stream of key-value bucket $1 on the loopback NATS server, speaking the client
# protocol itself (no NATS command-line tool is needed): best effort.
delete_nats_bucket() {
  (
    exec 3<>/dev/tcp/127.0.0.1/4222 || exit 0
    printf 'CONNECT {"verbose":false,"pedantic":false}\r\nPUB $JS.API.STREAM.DELETE.KV_%s 0\r\n\r\nPING\r\n' "$1" >&3
    timeout 2 head -c 1024 <&3 >/dev/null || true
  ) 2>/dev/null || true
}

ensure_redis() {
  if port_open 127.0.0.1 6379; then return 0; fi
  command -v redis-server >/dev/null 2>&1 || { log "installing redis-server"; apt_install redis-server; }
  log "starting redis"
  mkdir -p /var/lib/redis /var/log/redis
  redis-server --daemonize yes --bind 127.0.0.1 --port 6379 --save "" --appendonly no \
    --dir /var/lib/redis --logfile /var/log/redis/leader-tests.log
  wait_port 127.0.0.1 6379 redis
}

# etcd-client compiles its protocol with protoc, which needs the well-known types as well.
ensure_protoc() {
  if [ -n "${PROTOC:-}" ]; then return 0; fi
  if command -v protoc >/dev/null 2>&1 && [ -f /usr/include/google/protobuf/descriptor.proto ]; then
    return 0
  fi
  log "installing protobuf-compiler and libprotobuf-dev"
  apt_install protobuf-compiler libprotobuf-dev
}

# etcd on loopback, its data in a temporary directory, when none answers on 127.0.0.1:2379.
# The fault campaign freezes a file-lock holder inside an operation by injecting SIGSTOP at a
# system call (strace).
ensure_strace() {
  if command -v strace >/dev/null 2>&1; then return 0; fi
  log "installing strace"
  apt_install strace
}

# openssl makes the private CA and certificates of the MySQL TLS tests.
ensure_openssl() {
  if command -v openssl >/dev/null 2>&1; then return 0; fi
  log "installing openssl"
  apt_install openssl
}

# libfaketime steps the wall clock of the `leader` processes in the clock tests.
ensure_faketime() {
  if command -v faketime >/dev/null 2>&1; then return 0; fi
  log "installing faketime"
  apt_install faketime
}

ensure_etcd() {
  if port_open 127.0.0.1 2379; then return 0; fi
  command -v etcd >/dev/null 2>&1 || { log "installing etcd-server"; apt_install etcd-server; }
  local data
  data=$(mktemp -d /tmp/leader-etcd.XXXXXX)
  log "starting etcd (data in $data)"
  # ETCD_UNSUPPORTED_ARCH lets etcd 3.4 run on arm64 too.
  ETCD_UNSUPPORTED_ARCH="${ETCD_UNSUPPORTED_ARCH:-arm64}" setsid nohup etcd --name leader-tests \
    --data-dir "$data" \
    --listen-client-urls http://127.0.0.1:2379 --advertise-client-urls http://127.0.0.1:2379 \
    --listen-peer-urls http://127.0.0.1:2380 --initial-advertise-peer-urls http://127.0.0.1:2380 \
    --initial-cluster leader-tests=http://127.0.0.1:2380 \
    >"$data/etcd.log" 2>&1 < /dev/null &
  wait_port 127.0.0.1 2379 etcd
}

# A three-member etcd cluster on loopback, as users run etcd so that one member can fail: client
# ports 22379, 22381 and 22383 (peers on the next port up), data in temporary directories.
# scripts/test runs the etcd tests on it (ETCD_CLUSTER_ENDPOINTS).
ETCD_CLUSTER_PORTS=(22379 22381 22383)
ETCD_CLUSTER_ENDPOINTS_DEFAULT="http://127.0.0.1:22379,http://127.0.0.1:22381,http://127.0.0.1:22383"

ensure_etcd_cluster() {
  local port all_up=1
  for port in "${ETCD_CLUSTER_PORTS[@]}"; do
    port_open 127.0.0.1 "$port" || all_up=0
  done
  if [ "$all_up" = 1 ]; then return 0; fi
  command -v etcd >/dev/null 2>&1 || { log "installing etcd-server"; apt_install etcd-server; }
  local initial="" i
  for i in 0 1 2; do
    initial+="${initial:+,}cluster-m$i=http://127.0.0.1:$((ETCD_CLUSTER_PORTS[i] + 1))"
  done
  local token="leader-tests-$(date +%s)-$$"
  for i in 0 1 2; do
    port=${ETCD_CLUSTER_PORTS[i]}
    if port_open 127.0.0.1 "$port"; then continue; fi
    local data
    data=$(mktemp -d "/tmp/leader-etcd-cluster-m$i.XXXXXX")
    log "starting etcd cluster member m$i on 127.0.0.1:$port (data in $data)"
    ETCD_UNSUPPORTED_ARCH="${ETCD_UNSUPPORTED_ARCH:-arm64}" setsid nohup etcd --name "cluster-m$i" \
      --data-dir "$data" \
      --listen-client-urls "http://127.0.0.1:$port" --advertise-client-urls "http://127.0.0.1:$port" \
      --listen-peer-urls "http://127.0.0.1:$((port + 1))" \
      --initial-advertise-peer-urls "http://127.0.0.1:$((port + 1))" \
      --initial-cluster "$initial" --initial-cluster-token "$token" --initial-cluster-state new \
      >"$data/etcd.log" 2>&1 < /dev/null &
  done
  for port in "${ETCD_CLUSTER_PORTS[@]}"; do
    wait_port 127.0.0.1 "$port" "etcd cluster member"
  done
  # Members listen before they have elected a leader: wait for one (/health says so).
  for _ in $(seq 1 60); do
    if curl -sf "http://127.0.0.1:${ETCD_CLUSTER_PORTS[0]}/health" | grep -q '"health":"true"'; then
      return 0
    fi
    sleep 0.5
  done
  log "the etcd cluster elected no leader"; return 1
}

# An S3 API server on loopback for the object storage lock: moto's, from PyPI (pinned), which
# keeps If-Match / If-None-Match on PutObject (412 on a lost precondition) and If-None-Match on
# GetObject (304). scripts/s3-server runs it one request at a time: moto checks a precondition
# and writes in two steps on a thread per request, so two conditional writes on one ETag could
# both succeed (its opening comment cites the code). Its data is in memory: a restart empties it.
MOTO_VERSION="${MOTO_VERSION:-5.2.1}"
S3_PORT=9000
S3_SERVER="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/s3-server"

ensure_moto_installed() {
  if python3 -c 'import moto.server, werkzeug' >/dev/null 2>&1; then return 0; fi
  command -v python3 >/dev/null 2>&1 || { log "installing python3-pip"; apt_install python3 python3-pip python3-venv; }
  log "installing moto[server]==${MOTO_VERSION} from PyPI"
  python3 -m pip install --quiet --disable-pip-version-check "moto[server]==${MOTO_VERSION}" \
    || python3 -m pip install --quiet --break-system-packages "moto[server]==${MOTO_VERSION}"
  python3 -c 'import moto.server, werkzeug' >/dev/null 2>&1 || { log "python3 cannot import moto after installing it"; return 1; }
}

# True when the server on the S3 port is scripts/s3-server (its answers carry the marker).
s3_is_serial() {
  curl -s -I "http://127.0.0.1:${S3_PORT}/" 2>/dev/null | grep -qi '^x-leader-s3-server: serial'
}

ensure_s3() {
  if port_open 127.0.0.1 "$S3_PORT"; then
    if s3_is_serial; then return 0; fi
    # A plain moto_server an earlier version of this script started: replace it, since the
    # tests must not pass or fail on its races. Anything else on the port is not ours.
    if pkill -f "moto_server -H 127.0.0.1 -p ${S3_PORT}" >/dev/null 2>&1; then
      log "replacing the plain moto_server on 127.0.0.1:${S3_PORT} with scripts/s3-server"
      for _ in $(seq 1 50); do port_open 127.0.0.1 "$S3_PORT" || break; sleep 0.1; done
    else
      log "127.0.0.1:${S3_PORT} is taken by a server that is not scripts/s3-server; stop it first"
      return 1
    fi
  fi
  ensure_moto_installed
  log "starting moto's S3 server (scripts/s3-server) on 127.0.0.1:${S3_PORT}"
  setsid nohup python3 "$S3_SERVER" -H 127.0.0.1 -p "$S3_PORT" >/tmp/leader-moto.log 2>&1 < /dev/null &
  wait_port 127.0.0.1 "$S3_PORT" moto
}

# Azurite, Microsoft's Azure Storage emulator, from the npm registry (pinned: 3.35.0 is the last
# release that runs on Node.js 20), for the object storage lock's `az://` tests: its blob
# service alone on loopback, with the well-known development account (devstoreaccount1), data
# in a temporary directory. It keeps If-Match / If-None-Match on writes and reads as Azure does.
AZURITE_VERSION="${AZURITE_VERSION:-3.35.0}"
AZURITE_PORT=10000

ensure_azurite() {
  if port_open 127.0.0.1 "$AZURITE_PORT"; then return 0; fi
  if ! command -v azurite-blob >/dev/null 2>&1; then
    command -v npm >/dev/null 2>&1 || { log "installing nodejs and npm"; apt_install nodejs npm; }
    log "installing azurite@${AZURITE_VERSION} from the npm registry"
    npm install --global --silent --no-audit --no-fund "azurite@${AZURITE_VERSION}" >/dev/null
  fi
  local data
  data=$(mktemp -d /tmp/leader-azurite.XXXXXX)
  log "starting Azurite's blob service on 127.0.0.1:${AZURITE_PORT} (data in $data)"
  setsid nohup azurite-blob --blobHost 127.0.0.1 --blobPort "$AZURITE_PORT" --location "$data" \
    --skipApiVersionCheck --silent >"$data/azurite.log" 2>&1 < /dev/null &
  wait_port 127.0.0.1 "$AZURITE_PORT" azurite
}

# Fresh places for one test run, so that nothing an earlier run left can make it pass: an empty
# Postgres database, an emptied Redis database number, an etcd key prefix nobody used, a new S3
# bucket. Exports DATABASE_URL (and PGBOUNCER_URL, to the same database), REDIS_URL,
# ETCD_PREFIX and S3_BUCKET for what the caller did not
# set, and
# FRESH_DATABASE for drop_fresh_targets.
fresh_test_targets() {
  local tag
  tag="$(date +%s)_$$_${RANDOM}"
  if [ -z "${DATABASE_URL:-}" ]; then
    FRESH_DATABASE="leader_test_${tag}"
    psql -qAt "postgres://postgres:postgres@127.0.0.1:5432/postgres" -c "CREATE DATABASE ${FRESH_DATABASE}" >/dev/null
    export DATABASE_URL="postgres://postgres:postgres@127.0.0.1:5432/${FRESH_DATABASE}"
    log "tests use the new database ${FRESH_DATABASE}"
    if [ -z "${PGBOUNCER_URL:-}" ]; then
      export PGBOUNCER_URL="postgres://postgres:postgres@127.0.0.1:${PGBOUNCER_PORT}/${FRESH_DATABASE}"
    fi
  fi
  if [ -z "${MYSQL_URL:-}" ]; then
    FRESH_MYSQL_DATABASE="leader_test_${tag}"
    mariadb -uroot -h127.0.0.1 -e "CREATE DATABASE ${FRESH_MYSQL_DATABASE}"
    export MYSQL_URL="mysql://root@127.0.0.1:3306/${FRESH_MYSQL_DATABASE}"
    log "tests use the new MySQL database ${FRESH_MYSQL_DATABASE}"
  fi
  if [ -z "${NATS_BUCKET:-}" ] && [ -z "${NATS_URL:-}" ]; then
    FRESH_NATS_BUCKET="leader_test_${tag}"
    export NATS_BUCKET="${FRESH_NATS_BUCKET}"
    log "tests use the new NATS bucket ${NATS_BUCKET}"
  fi
  if [ -z "${REDIS_URL:-}" ]; then
    local db=$((1 + RANDOM % 15))
    redis-cli -h 127.0.0.1 -p 6379 -n "$db" FLUSHDB >/dev/null
    export REDIS_URL="redis://127.0.0.1:6379/${db}"
    log "tests use Redis database ${db}, emptied"
  fi
  if [ -z "${ETCD_PREFIX:-}" ]; then
    export ETCD_PREFIX="leader-test-${tag}/"
    log "tests use the etcd prefix ${ETCD_PREFIX}"
  fi
  if [ -z "${ZOOKEEPER_CHROOT:-}" ]; then
    # The tests create it: a chroot is the operator's, and a missing one an error.
    export ZOOKEEPER_CHROOT="/leader-test-${tag}"
    log "tests use the new ZooKeeper chroot ${ZOOKEEPER_CHROOT}"
  fi
  if [ -z "${S3_BUCKET:-}" ] && [ -z "${S3_ENDPOINT:-}" ]; then
    export S3_BUCKET="leader-test-${tag//_/-}"
    # moto checks no signature: an unsigned CreateBucket is enough.
    curl -sf -X PUT "http://127.0.0.1:${S3_PORT}/${S3_BUCKET}" >/dev/null \
      || { log "could not create the bucket ${S3_BUCKET} on 127.0.0.1:${S3_PORT}"; return 1; }
    log "tests use the new S3 bucket ${S3_BUCKET}"
  fi
}

drop_fresh_targets() {
  if [ -n "${FRESH_NATS_BUCKET:-}" ]; then
    delete_nats_bucket "${FRESH_NATS_BUCKET}"
  fi
  if [ -n "${FRESH_MYSQL_DATABASE:-}" ]; then
    mariadb -uroot -h127.0.0.1 -e "DROP DATABASE IF EXISTS ${FRESH_MYSQL_DATABASE}" >/dev/null 2>&1 || true
  fi
  if [ -n "${FRESH_DATABASE:-}" ]; then
    psql -qAt "postgres://postgres:postgres@127.0.0.1:5432/postgres" \
      -c "DROP DATABASE IF EXISTS ${FRESH_DATABASE} WITH (FORCE)" >/dev/null 2>&1 || true
  fi
}

# A three-server ZooKeeper ensemble on loopback, from Debian's zookeeperd (3.8), as users run
# ZooKeeper so that one server can fail: client ports 22181-22183, quorum ports 22888-22890,
# election ports 23888-23890, data in temporary directories. The servers keep ZooKeeper's
# defaults (tickTime 2000 ms, so sessions of 4 to 40 s) and answer the srvr and ruok
# four-letter words (the fault tests ask which server leads). scripts/test runs the ZooKeeper
# tests on it (ZOOKEEPER_ENSEMBLE).
ZOOKEEPER_PORTS=(22181 22182 22183)
ZOOKEEPER_ENSEMBLE_DEFAULT="127.0.0.1:22181,127.0.0.1:22182,127.0.0.1:22183"

# Starts ZooKeeper server $1 (1 to 3) of the loopback ensemble in data directory $2.
start_zookeeper_server() {
  local id=$1 data=$2
  local i servers=""
  for i in 1 2 3; do
    servers+="server.$i=127.0.0.1:$((22887 + i)):$((23887 + i))"$'\n'
  done
  cat >"$data/zoo.cfg" <<CFG
tickTime=2000
initLimit=10
syncLimit=5
dataDir=$data
clientPortAddress=127.0.0.1
clientPort=$((22180 + id))
admin.enableServer=false
4lw.commands.whitelist=srvr,ruok,stat
standaloneEnabled=false
$servers
CFG
  echo "$id" >"$data/myid"
  setsid nohup java -Xmx256m -cp /usr/share/java/zookeeper.jar:/usr/share/java/slf4j-simple.jar \
    org.apache.zookeeper.server.quorum.QuorumPeerMain "$data/zoo.cfg" \
    >"$data/zookeeper.log" 2>&1 </dev/null &
  echo $! >"$data/pid"
}

# Whether the loopback ensemble has a quorum: a server that is part of one says its mode.
zookeeper_serving() {
  local port=$1 answer
  answer=$( (exec 3<>"/dev/tcp/127.0.0.1/$port" && printf srvr >&3 && timeout 2 cat <&3) 2>/dev/null) || return 1
  grep -qE '^Mode: (leader|follower)' <<<"$answer"
}

ensure_zookeeper_ensemble() {
  local port all_up=1
  for port in "${ZOOKEEPER_PORTS[@]}"; do
    zookeeper_serving "$port" || all_up=0
  done
  if [ "$all_up" = 1 ]; then return 0; fi
  [ -f /usr/share/java/zookeeper.jar ] || { log "installing zookeeperd"; apt_install zookeeperd; }
  local i data
  for i in 1 2 3; do
    port=${ZOOKEEPER_PORTS[i - 1]}
    if port_open 127.0.0.1 "$port"; then continue; fi
    data=$(mktemp -d "/tmp/leader-zookeeper-$i.XXXXXX")
    log "starting ZooKeeper server $i on 127.0.0.1:$port (data in $data)"
    start_zookeeper_server "$i" "$data"
  done
  for _ in $(seq 1 120); do
    all_up=1
    for port in "${ZOOKEEPER_PORTS[@]}"; do
      zookeeper_serving "$port" || all_up=0
    done
    if [ "$all_up" = 1 ]; then return 0; fi
    sleep 0.5
  done
  log "the ZooKeeper ensemble formed no quorum"; return 1
}
