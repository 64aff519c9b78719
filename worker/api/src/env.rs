//! Every environment variable rngd-pd reads. Nothing else in the project spells these names.

/// KV transport name (`shm`, `tcp`, `nixl-ucx`); default `shm`.
pub const AIRM_KV_TRANSPORT: &str = "AIRM_KV_TRANSPORT";
/// Root directory of the `shm` transport; default `/dev/shm/rngd_kv_cluster`.
pub const PD_SHM_ROOT: &str = "PD_SHM_ROOT";
/// Seconds an unread `shm` request lives before the sweeper removes it; default 60.
pub const AIRM_KV_SHM_TTL_S: &str = "AIRM_KV_SHM_TTL_S";
/// Seconds after its publication that KV no decode has claimed (pulled or
/// released) counts as stranded (the `rngd_pd_worker_kv_stranded_bytes` and
/// `rngd_pd_relay_stranded_bytes` gauges; `rngd-pd relay --claim-window-s`);
/// default 5, never more than the transport's TTL.
pub const AIRM_KV_CLAIM_WINDOW_S: &str = "AIRM_KV_CLAIM_WINDOW_S";
/// Slots of the `shm` transport's arena (requests written in place, each
/// slot the size of a full S-wide request); `0` writes every request to a
/// file of its own. Default 8.
pub const AIRM_KV_SHM_SLOTS: &str = "AIRM_KV_SHM_SLOTS";
/// `host:port` of the `tcp` KV relay.
pub const AIRM_KV_TCP_ADDR: &str = "AIRM_KV_TCP_ADDR";
/// Seconds an unread blob lives in the relay; default 60.
pub const AIRM_KV_TCP_TTL_S: &str = "AIRM_KV_TCP_TTL_S";
/// `0` skips CRC-32 checks on the `tcp` transport.
pub const AIRM_KV_TCP_CRC: &str = "AIRM_KV_TCP_CRC";
/// `1` logs size and SHA-256 of every blob the `tcp` transport moves.
pub const AIRM_KV_TCP_LOG: &str = "AIRM_KV_TCP_LOG";
/// Listen address (`host:port`) of `rngd-pd relay`; default `0.0.0.0:7070`.
pub const AIRM_KV_RELAY_LISTEN: &str = "AIRM_KV_RELAY_LISTEN";
/// Memory cap of the relay in bytes (all unread blobs); default 4 GiB.
pub const AIRM_KV_RELAY_MAX_BYTES: &str = "AIRM_KV_RELAY_MAX_BYTES";
/// Largest blob (frame body) the relay accepts, bytes; default 64 MiB.
pub const AIRM_KV_RELAY_MAX_FRAME: &str = "AIRM_KV_RELAY_MAX_FRAME";
/// The relay's metrics listener, `HOST:PORT` (`rngd-pd relay --metrics-listen`).
pub const RNGD_PD_RELAY_METRICS_LISTEN: &str = "RNGD_PD_RELAY_METRICS_LISTEN";
/// Port of the gateway's separate KPI endpoint (`airm_*` gauges); unset = off.
pub const AIRM_METRICS_PORT: &str = "AIRM_METRICS_PORT";
/// Cache directory for models; default `~/.cache/rngd-pd`.
pub const RNGD_PD_CACHE: &str = "RNGD_PD_CACHE";
/// Path of a GGUF model file.
pub const RNGD_PD_MODEL: &str = "RNGD_PD_MODEL";
/// Worker role: `prefill`, `decode` or `solo`.
pub const RNGD_PD_ROLE: &str = "RNGD_PD_ROLE";
/// Worker backend: `cpu`, `rngd` or `atom`.
pub const RNGD_PD_BACKEND: &str = "RNGD_PD_BACKEND";
/// Device ordinal, or `-1` for the card the device plugin allocated.
pub const RNGD_PD_CHIP: &str = "RNGD_PD_CHIP";
/// Listen port of a worker.
pub const RNGD_PD_PORT: &str = "RNGD_PD_PORT";
/// Listen host of a server; default `127.0.0.1`.
pub const RNGD_PD_HOST: &str = "RNGD_PD_HOST";
/// Compiled context length `S`.
pub const RNGD_PD_SEQ_LEN: &str = "RNGD_PD_SEQ_LEN";
/// Decode batch size (streams stepped together).
pub const RNGD_PD_BATCH: &str = "RNGD_PD_BATCH";
/// Node name this worker runs on (for same-node transport choice).
pub const RNGD_PD_NODE: &str = "RNGD_PD_NODE";
/// Path of the kubelet device-plugin checkpoint.
pub const RNGD_PD_KUBELET_CHECKPOINT: &str = "RNGD_PD_KUBELET_CHECKPOINT";
/// UID of this pod (downward API), for device allocation.
pub const POD_UID: &str = "POD_UID";
/// Path of the policy `.wasm` module.
pub const RNGD_PD_POLICY: &str = "RNGD_PD_POLICY";
/// Path of the policy's plugin configuration (JSON).
pub const RNGD_PD_POLICY_CONFIG: &str = "RNGD_PD_POLICY_CONFIG";
/// Bearer token of the admin APIs: the policy's (`GET`/`PUT /admin/policy`,
/// gateway and picker) and the worker's (`POST /reset_prefix_cache`); unset = admin APIs off.
pub const RNGD_PD_ADMIN_TOKEN: &str = "RNGD_PD_ADMIN_TOKEN";
/// Gateway / picker: the policy admin API's own listener `HOST:PORT`
/// (default `127.0.0.1:9903`, loopback).
pub const RNGD_PD_ADMIN_LISTEN: &str = "RNGD_PD_ADMIN_LISTEN";
/// Worker: the admin API's own listener `HOST:PORT` (`POST
/// /reset_prefix_cache`; default `127.0.0.1:9904`, loopback); served only
/// with `RNGD_PD_ADMIN_TOKEN`.
pub const RNGD_PD_WORKER_ADMIN_LISTEN: &str = "RNGD_PD_WORKER_ADMIN_LISTEN";
/// Worker: positions per prefix-cache block (`--block-size`); default 16.
pub const RNGD_PD_BLOCK_SIZE: &str = "RNGD_PD_BLOCK_SIZE";
/// Worker: tokens one engine iteration computes at most, a prefill chunk
/// and the decode step together (`--max-num-batched-tokens`, vLLM's name);
/// default 128.
pub const RNGD_PD_MAX_NUM_BATCHED_TOKENS: &str = "RNGD_PD_MAX_NUM_BATCHED_TOKENS";
/// Worker: the kernel of prefills' projections (`--prefill-projections`:
/// `auto`, `f32` or `int8`); default `auto`.
pub const RNGD_PD_PREFILL_PROJECTIONS: &str = "RNGD_PD_PREFILL_PROJECTIONS";
/// Worker: bytes the prefix cache may hold (`--prefix-cache-bytes`); default 256 MiB.
pub const RNGD_PD_PREFIX_CACHE_BYTES: &str = "RNGD_PD_PREFIX_CACHE_BYTES";
/// Worker: vLLM's `--kv-events-config` JSON (KV-cache events over ZMQ); unset = no events.
pub const RNGD_PD_KV_EVENTS_CONFIG: &str = "RNGD_PD_KV_EVENTS_CONFIG";
/// The API key of the gateway's and the workers' public routes (vLLM's
/// name; `--api-key`): every route but `/health`, `/ready`, `/ping`,
/// `/metrics` and `/version` wants `Authorization: Bearer KEY`. Never logged.
pub const VLLM_API_KEY: &str = "VLLM_API_KEY";
/// The pod's namespace (the downward API's `metadata.namespace`): the
/// default of `--pool-namespace`, as the reference endpoint picker reads it.
pub const NAMESPACE: &str = "NAMESPACE";
/// Path of the endpoints file (gateway and ext-proc).
pub const RNGD_PD_ENDPOINTS: &str = "RNGD_PD_ENDPOINTS";
/// Log line format of every subcommand (`--log-format`): `text` (default) or
/// `json` (one object per line). `rngd-pd up` passes it to its children.
pub const RNGD_PD_LOG_FORMAT: &str = "RNGD_PD_LOG_FORMAT";
/// Set (to anything) to turn colour off in text logs even on a terminal.
pub const NO_COLOR: &str = "NO_COLOR";
/// `tracing` filter, as `RUST_LOG`.
pub const RUST_LOG: &str = "RUST_LOG";
/// Home directory (for the default cache path).
pub const HOME: &str = "HOME";

/// Reads `name`, treating an empty value as unset.
pub fn var(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.is_empty())
}

/// Worker: how long a decode waits for the KV pull, ms; default 30000.
pub const RNGD_PD_KV_PULL_TIMEOUT_MS: &str = "RNGD_PD_KV_PULL_TIMEOUT_MS";
/// Worker: what a decode worker serving `x-prefiller-host-port` does when it cannot load the KV: `recompute` (default) or `fail`.
pub const RNGD_PD_KV_LOAD_FAILURE_POLICY: &str = "RNGD_PD_KV_LOAD_FAILURE_POLICY";
/// Gateway: what it does when the decode worker cannot load a handoff's KV: `recompute` (default) or `fail`.
pub const RNGD_PD_GATEWAY_KV_LOAD_FAILURE_POLICY: &str = "RNGD_PD_GATEWAY_KV_LOAD_FAILURE_POLICY";
/// Worker: how long a decode worker waits for its prefill peer (`x-prefiller-host-port`), ms; default 120000.
pub const RNGD_PD_PREFILL_TIMEOUT_MS: &str = "RNGD_PD_PREFILL_TIMEOUT_MS";
/// Worker: the prefill peers `x-prefiller-host-port` may name, comma-separated
/// (`HOST:PORT`, `IP/PREFIX:PORT`, `[IPV6]/PREFIX:PORT`; ports required);
/// default empty: the header is refused.
pub const RNGD_PD_PREFILL_ALLOW: &str = "RNGD_PD_PREFILL_ALLOW";
/// Worker: the clients (connection IPs, `IP` or `IP/PREFIX`, comma-separated)
/// that may send prefill-only requests (`do_remote_decode`); default loopback.
pub const RNGD_PD_FRONT_DOOR_ALLOW: &str = "RNGD_PD_FRONT_DOOR_ALLOW";
/// Worker: largest request body, bytes (default 2 MiB).
pub const RNGD_PD_WORKER_BODY_LIMIT: &str = "RNGD_PD_WORKER_BODY_LIMIT";
/// Worker: CPU threads of the `cpu` backend; default: all cores.
pub const RNGD_PD_THREADS: &str = "RNGD_PD_THREADS";

/// Gateway: listen address `host:port`; default `127.0.0.1:8000`.
pub const RNGD_PD_GATEWAY_LISTEN: &str = "RNGD_PD_GATEWAY_LISTEN";
/// Gateway: largest request body, bytes; default 1 MiB.
pub const RNGD_PD_BODY_LIMIT: &str = "RNGD_PD_BODY_LIMIT";
/// Gateway: prefill call timeout, ms; default 120000.
pub const RNGD_PD_GATEWAY_PREFILL_TIMEOUT_MS: &str = "RNGD_PD_GATEWAY_PREFILL_TIMEOUT_MS";
/// Gateway: decode call timeout (to the first byte when streaming), ms; default 600000.
pub const RNGD_PD_GATEWAY_DECODE_TIMEOUT_MS: &str = "RNGD_PD_GATEWAY_DECODE_TIMEOUT_MS";

/// Policy host: `1` writes `/tmp/perf-<pid>.map` so `perf` names the functions
/// of compiled policy modules (profiling only); default off.
pub const RNGD_PD_POLICY_PERFMAP: &str = "RNGD_PD_POLICY_PERFMAP";

/// Set by `rngd-pd up` on the processes it starts: its own pid. A process
/// started with it stops (SIGTERM) when that parent dies, even by SIGKILL,
/// and exits at once if the parent is already gone (Linux).
pub const RNGD_PD_UP_PARENT: &str = "RNGD_PD_UP_PARENT";

/// Shared secret of the `tcp` KV relay and its clients (at least 16 bytes;
/// surrounding whitespace dropped). Never logged.
pub const AIRM_KV_TCP_SECRET: &str = "AIRM_KV_TCP_SECRET";
/// File holding the shared secret of the `tcp` KV relay (instead of
/// `AIRM_KV_TCP_SECRET`; e.g. a mounted Kubernetes Secret).
pub const AIRM_KV_TCP_SECRET_FILE: &str = "AIRM_KV_TCP_SECRET_FILE";
/// `1`: the relay and the `tcp` transport run without the shared secret
/// (not for production); default off: without a secret they refuse to start.
pub const AIRM_KV_TCP_INSECURE_NO_AUTH: &str = "AIRM_KV_TCP_INSECURE_NO_AUTH";
/// TLS of the `tcp` transport's relay connections, on the relay and its
/// clients alike: `auto` (default: keyed by the mounted certificate files
/// if given, else by the shared secret) or `off` (plaintext; the secret
/// still authenticates). Both ends must agree.
pub const AIRM_KV_TCP_TLS: &str = "AIRM_KV_TCP_TLS";
/// A `tcp` client: PEM roots that sign the relay's mounted certificate
/// (instead of trusting the key derived from the shared secret).
pub const AIRM_KV_TCP_TLS_CA_FILE: &str = "AIRM_KV_TCP_TLS_CA_FILE";
/// A `tcp` client with `AIRM_KV_TCP_TLS_CA_FILE`: the name the relay's
/// certificate must carry; default the host of `AIRM_KV_TCP_ADDR`.
pub const AIRM_KV_TCP_TLS_SERVER_NAME: &str = "AIRM_KV_TCP_TLS_SERVER_NAME";
/// Relay: PEM certificate chain it presents (with
/// `AIRM_KV_RELAY_TLS_KEY_FILE`) instead of the key derived from the secret.
pub const AIRM_KV_RELAY_TLS_CERT_FILE: &str = "AIRM_KV_RELAY_TLS_CERT_FILE";
/// Relay: PEM private key of `AIRM_KV_RELAY_TLS_CERT_FILE`.
pub const AIRM_KV_RELAY_TLS_KEY_FILE: &str = "AIRM_KV_RELAY_TLS_KEY_FILE";
/// Deadline of a `tcp` push, release or STATS (and of connecting), ms; default 30000.
pub const AIRM_KV_TCP_TIMEOUT_MS: &str = "AIRM_KV_TCP_TIMEOUT_MS";
/// Relay: a frame must arrive within this of its first byte, ms; default 10000.
pub const AIRM_KV_RELAY_READ_TIMEOUT_MS: &str = "AIRM_KV_RELAY_READ_TIMEOUT_MS";
/// Relay: idle connections are closed after this, ms; default 60000.
pub const AIRM_KV_RELAY_IDLE_TIMEOUT_MS: &str = "AIRM_KV_RELAY_IDLE_TIMEOUT_MS";
/// Relay: open connections at most; default 1024.
pub const AIRM_KV_RELAY_MAX_CONNECTIONS: &str = "AIRM_KV_RELAY_MAX_CONNECTIONS";
/// Relay: GETs waiting at once at most; default 4096.
pub const AIRM_KV_RELAY_MAX_WAITERS: &str = "AIRM_KV_RELAY_MAX_WAITERS";
/// Relay: blobs held at most; default 65536.
pub const AIRM_KV_RELAY_MAX_ENTRIES: &str = "AIRM_KV_RELAY_MAX_ENTRIES";
/// Relay: a new socket must pass the handshake within this, ms; default 2000.
pub const AIRM_KV_RELAY_HANDSHAKE_TIMEOUT_MS: &str = "AIRM_KV_RELAY_HANDSHAKE_TIMEOUT_MS";
/// Relay: sockets in the handshake at most (over it the oldest is closed); default 128.
pub const AIRM_KV_RELAY_MAX_HANDSHAKES: &str = "AIRM_KV_RELAY_MAX_HANDSHAKES";
/// Relay: at most one warning of failed handshakes per this, ms; default 10000.
pub const AIRM_KV_RELAY_WARN_INTERVAL_MS: &str = "AIRM_KV_RELAY_WARN_INTERVAL_MS";
/// `nixl-ucx`: directory holding the NIXL runtime (`libnixl_capi.so`, with
/// `plugins/` beside it); default: the installed `nixl-cu12` wheel.
pub const AIRM_KV_NIXL_LIB_DIR: &str = "AIRM_KV_NIXL_LIB_DIR";
/// `nixl-ucx`: NIXL's plugin directory; default `plugins/` in the runtime's directory.
pub const AIRM_KV_NIXL_PLUGIN_DIR: &str = "AIRM_KV_NIXL_PLUGIN_DIR";
/// `nixl-ucx`: size of the registered host arena per process, MiB; default 1024.
pub const AIRM_KV_UCX_POOL_MB: &str = "AIRM_KV_UCX_POOL_MB";
/// `1`: the `nixl-ucx` transport logs size and SHA-256 of every blob.
pub const AIRM_KV_UCX_LOG: &str = "AIRM_KV_UCX_LOG";
