# Sourced before `ray start` on every node of cluster.yaml and deploy/onprem.yaml: Ray Serve then
# takes HTTP through its HAProxy ingress, which answers 408 and closes a connection that has not
# sent a request's headers within SHARDYARD_HEADER_TIMEOUT_S seconds (15 by default), where Serve's
# default proxy waits for them without end (docs/serving.md says what else it brings). Every node
# needs it: the Serve controller reads it on the head, each replica on its own node.
#
# With it, each replica takes HTTP on its node's own port (30000-31000) from the HAProxy of any
# node, so a Serve config for the cluster binds every interface (serve_apps/cluster.yaml).

export RAY_SERVE_ENABLE_HA_PROXY=1
export RAY_SERVE_HAPROXY_TIMEOUT_CLIENT_S="${SHARDYARD_HEADER_TIMEOUT_S:-15}"

# HAProxy's files (its admin socket is mode 666) in a directory only this user can enter, not
# Ray's default /tmp/haproxy-serve. Short: HAProxy takes socket paths of 97 characters at most,
# and Ray puts each node's files under the node's 56-character id.
haproxy_files="${SHARDYARD_HAPROXY_FILES:-/tmp/haproxy-$(id -u)}"
mkdir -p -m 700 "$haproxy_files"
if [ ! -O "$haproxy_files" ]; then
    echo "serve-ingress.sh: $haproxy_files belongs to another user; remove it and start Ray again" >&2
    return 1
fi
chmod 700 "$haproxy_files"
export RAY_SERVE_HAPROXY_SERVER_STATE_BASE="$haproxy_files"
export RAY_SERVE_HAPROXY_CONFIG_FILE_LOC="$haproxy_files/haproxy.cfg"
export RAY_SERVE_HAPROXY_SOCKET_PATH="$haproxy_files/admin.sock"
export RAY_SERVE_HAPROXY_SERVER_STATE_FILE="$haproxy_files/server-state"
export RAY_SERVE_HAPROXY_METRICS_SOCKET_PATH="$haproxy_files/metrics.sock"

# Ray's template binds HAProxy's stats page and Prometheus exporter on every interface: HAProxy
# runs through shardyard's launcher, which binds those two to the loopback interface
# (platform/shardyard/serve/app/haproxy_loopback.py). Scrape the exporter from the node itself.
RAY_SERVE_HAPROXY_BINARY_PATH="$(python3 -m shardyard.serve.app.haproxy_loopback --write "$haproxy_files")" || return 1
export RAY_SERVE_HAPROXY_BINARY_PATH
