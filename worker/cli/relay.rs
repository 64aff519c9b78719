//! `rngd-pd relay`: the KV relay server of the `tcp` transport. The flags
//! live here; the relay is `rngd_kv_transport::relay` ([`RelayOptions`],
//! [`rngd_kv_transport::relay::launch`]). It refuses to start without the
//! shared secret (`--secret-file` / `AIRM_KV_TCP_SECRET`) unless
//! `--insecure-no-auth`.

use std::path::PathBuf;

use axum::response::IntoResponse;
use rngd_api::env;
use rngd_kv_transport::relay::{self, RelayOptions, Secret, TlsMode};

/// Flags of `rngd-pd relay` (each also read from the environment).
#[derive(Debug, Clone, clap::Args)]
pub struct Args {
    /// Listen address, `HOST:PORT` (port 0 picks a free one; the bound address is logged and printed).
    #[arg(long, env = env::AIRM_KV_RELAY_LISTEN, default_value = "0.0.0.0:7070")]
    pub listen: String,
    /// Seconds an unread request's blobs live.
    #[arg(long = "ttl-s", env = env::AIRM_KV_TCP_TTL_S, default_value_t = 60.0)]
    pub ttl_s: f64,
    /// Seconds after which a request's blobs that nobody deleted (no decode
    /// took them) count as stranded (`rngd_pd_relay_stranded_bytes`);
    /// capped at --ttl-s.
    #[arg(long = "claim-window-s", env = env::AIRM_KV_CLAIM_WINDOW_S, default_value_t = 5.0)]
    pub claim_window_s: f64,
    /// Memory cap in bytes.
    #[arg(long = "max-bytes", env = env::AIRM_KV_RELAY_MAX_BYTES, default_value_t = 4 << 30)]
    pub max_bytes: u64,
    /// Largest blob (frame body) accepted, bytes.
    #[arg(long = "max-frame", env = env::AIRM_KV_RELAY_MAX_FRAME, default_value_t = 64 << 20)]
    pub max_frame: u64,
    /// File holding the shared secret every client must prove (at least 16
    /// bytes; surrounding whitespace dropped), e.g. a mounted Kubernetes Secret.
    #[arg(long = "secret-file", env = env::AIRM_KV_TCP_SECRET_FILE, value_name = "PATH")]
    pub secret_file: Option<PathBuf>,
    /// The shared secret itself. Prefer the environment variable or
    /// `--secret-file`: a flag's value shows in the process list. Never printed.
    #[arg(long = "secret", env = env::AIRM_KV_TCP_SECRET, hide_env_values = true, value_name = "SECRET", value_parser = secret_arg)]
    pub secret: Option<Secret>,
    /// Run without authentication (anyone who reaches the port can read and
    /// write KV caches); logged as a warning. Not for production.
    #[arg(long = "insecure-no-auth", env = env::AIRM_KV_TCP_INSECURE_NO_AUTH)]
    pub insecure_no_auth: bool,
    /// TLS of every connection: `auto` keys it with --tls-cert-file and
    /// --tls-key-file when given, else with the shared secret (workers
    /// trust exactly the key derived from it); `off` is plaintext (the
    /// secret still authenticates). Workers must agree (`AIRM_KV_TCP_TLS`).
    #[arg(long, env = env::AIRM_KV_TCP_TLS, default_value = "auto", value_name = "auto|off")]
    pub tls: TlsMode,
    /// PEM certificate chain to present (e.g. cert-manager's `tls.crt`),
    /// instead of the key derived from the secret; workers then need
    /// `AIRM_KV_TCP_TLS_CA_FILE`.
    #[arg(long = "tls-cert-file", env = env::AIRM_KV_RELAY_TLS_CERT_FILE, value_name = "PATH", requires = "tls_key_file")]
    pub tls_cert_file: Option<PathBuf>,
    /// PEM private key of --tls-cert-file.
    #[arg(long = "tls-key-file", env = env::AIRM_KV_RELAY_TLS_KEY_FILE, value_name = "PATH", requires = "tls_cert_file")]
    pub tls_key_file: Option<PathBuf>,
    /// A frame (header, key, body) must arrive within this many ms of its
    /// first byte; else the connection is closed.
    #[arg(long = "read-timeout-ms", env = env::AIRM_KV_RELAY_READ_TIMEOUT_MS, default_value_t = 10_000)]
    pub read_timeout_ms: u64,
    /// A new connection must pass the handshake within this many ms of
    /// being accepted; else it is refused and closed.
    #[arg(long = "handshake-timeout-ms", env = env::AIRM_KV_RELAY_HANDSHAKE_TIMEOUT_MS, default_value_t = 2_000)]
    pub handshake_timeout_ms: u64,
    /// Connections in the handshake at most, apart from --max-connections;
    /// one more closes the oldest of them.
    #[arg(long = "max-handshakes", env = env::AIRM_KV_RELAY_MAX_HANDSHAKES, default_value_t = 128)]
    pub max_handshakes: usize,
    /// At most one warning per this many ms for failed handshakes and
    /// accepts (the others are counted and summarised in the next one).
    #[arg(long = "warn-interval-ms", env = env::AIRM_KV_RELAY_WARN_INTERVAL_MS, default_value_t = 10_000)]
    pub warn_interval_ms: u64,
    /// A connection with no frame and no waiting GET for this many ms is closed.
    #[arg(long = "idle-timeout-ms", env = env::AIRM_KV_RELAY_IDLE_TIMEOUT_MS, default_value_t = 60_000)]
    pub idle_timeout_ms: u64,
    /// Authenticated connections at most (a connection counts once its
    /// handshake passed); more are refused with a capacity error.
    #[arg(long = "max-connections", env = env::AIRM_KV_RELAY_MAX_CONNECTIONS, default_value_t = 1024)]
    pub max_connections: usize,
    /// GETs waiting at once at most; more get a capacity error.
    #[arg(long = "max-waiters", env = env::AIRM_KV_RELAY_MAX_WAITERS, default_value_t = 4096)]
    pub max_waiters: usize,
    /// Blobs held at most; more PUTs get a capacity error.
    #[arg(long = "max-entries", env = env::AIRM_KV_RELAY_MAX_ENTRIES, default_value_t = 65536)]
    pub max_entries: usize,
    /// Serve the relay's figures as Prometheus metrics (`GET /metrics`:
    /// `rngd_pd_relay_*` and `process_*`) on this `HOST:PORT`; unset = no
    /// metrics listener. Port 0 picks one (printed as `relay metrics
    /// listening on ADDR`).
    #[arg(long, env = env::RNGD_PD_RELAY_METRICS_LISTEN, value_name = "HOST:PORT")]
    pub metrics_listen: Option<String>,
    /// Validate the flags and exit: 0 and `ok`, or a clear error.
    #[arg(long)]
    pub check: bool,
}

/// Takes any text: the length is checked by [`RelayOptions::config`], so
/// that no parse error prints the value.
fn secret_arg(text: &str) -> Result<Secret, std::convert::Infallible> {
    Ok(Secret::from_text(text))
}

impl From<Args> for RelayOptions {
    fn from(a: Args) -> RelayOptions {
        RelayOptions {
            listen: a.listen,
            ttl_s: a.ttl_s,
            claim_window_s: a.claim_window_s,
            max_bytes: a.max_bytes,
            max_frame: a.max_frame,
            secret_file: a.secret_file,
            secret: a.secret,
            insecure_no_auth: a.insecure_no_auth,
            tls: a.tls,
            tls_cert_file: a.tls_cert_file,
            tls_key_file: a.tls_key_file,
            read_timeout_ms: a.read_timeout_ms,
            handshake_timeout_ms: a.handshake_timeout_ms,
            max_handshakes: a.max_handshakes,
            warn_interval_ms: a.warn_interval_ms,
            idle_timeout_ms: a.idle_timeout_ms,
            max_connections: a.max_connections,
            max_waiters: a.max_waiters,
            max_entries: a.max_entries,
        }
    }
}

/// Serves `figures` on `GET /metrics` at `addr` until `stop` is cancelled;
/// the bound address.
async fn serve_metrics(
    addr: &str,
    figures: relay::Figures,
    stop: std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>,
) -> anyhow::Result<(std::net::SocketAddr, tokio::task::JoinHandle<()>)> {
    use axum::routing::get;
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|e| anyhow::anyhow!("--metrics-listen {addr}: {e}"))?;
    let page = move || {
        let figures = figures.clone();
        async move {
            match figures.metrics_page() {
                Ok(text) => (
                    [(
                        axum::http::header::CONTENT_TYPE,
                        rngd_telemetry::CONTENT_TYPE,
                    )],
                    text,
                )
                    .into_response(),
                Err(e) => {
                    (axum::http::StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response()
                }
            }
        }
    };
    let router = axum::Router::new().route("/metrics", get(page));
    let served = rngd_http_edge::serve(listener, router, rngd_http_edge::Options::default(), stop)?;
    Ok((served.addr, served.done))
}

/// Runs the relay until Ctrl-C / SIGTERM: binds `--listen`, prints
/// `relay listening on ADDR` to stdout, serves.
pub async fn run(args: Args) -> anyhow::Result<()> {
    if args.check {
        if let Some(m) = &args.metrics_listen {
            m.parse::<std::net::SocketAddr>()
                .map_err(|e| anyhow::anyhow!("--metrics-listen {m}: {e}"))?;
        }
        let opts = RelayOptions::from(args);
        opts.config()?;
        opts.listen
            .parse::<std::net::SocketAddr>()
            .map_err(|e| anyhow::anyhow!("--listen {}: {e}", opts.listen))?;
        println!("ok");
        return Ok(());
    }
    let metrics_listen = args.metrics_listen.clone();
    let launched = relay::launch(args.into()).await?;
    let (metrics_stop, metrics_stopped) = tokio::sync::oneshot::channel::<()>();
    let metrics = match &metrics_listen {
        Some(addr) => {
            let stopped = async move {
                let _ = metrics_stopped.await;
            };
            Some(serve_metrics(addr, launched.figures(), Box::pin(stopped)).await?)
        }
        None => None,
    };
    // Installed before the ready lines: a signal right after them is handled.
    let stop = rngd_http_edge::shutdown_signal();
    // The metrics line first: readers stop at the listening line.
    if let Some((addr, _)) = &metrics {
        println!("relay metrics listening on {addr}");
    }
    println!("relay listening on {}", launched.addr);
    stop.await;
    launched.shutdown();
    let _ = metrics_stop.send(());
    if let Some((_, done)) = metrics {
        let _ = done.await;
    }
    launched.join().await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use clap::Parser;

    use super::*;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: Args,
    }

    /// Moved from `worker/kv-transport/tests/tcp.rs` with the flags.
    #[test]
    fn relay_args_read_flags_and_env_names() {
        let cli = Cli::try_parse_from([
            "relay",
            "--listen",
            "127.0.0.1:9999",
            "--ttl-s",
            "2.5",
            "--max-bytes",
            "1000",
            "--max-frame",
            "100",
            "--insecure-no-auth",
            "--read-timeout-ms",
            "1500",
            "--idle-timeout-ms",
            "2500",
            "--max-connections",
            "7",
            "--max-waiters",
            "8",
            "--max-entries",
            "9",
            "--handshake-timeout-ms",
            "300",
            "--max-handshakes",
            "5",
            "--warn-interval-ms",
            "700",
        ])
        .unwrap();
        let cfg = RelayOptions::from(cli.args).config().unwrap();
        assert_eq!(cfg.listen, "127.0.0.1:9999");
        assert_eq!(cfg.ttl, Duration::from_millis(2500));
        assert_eq!((cfg.max_bytes, cfg.max_frame), (1000, 100));
        assert_eq!(cfg.secret, None);
        assert_eq!(
            (cfg.read_timeout, cfg.idle_timeout),
            (Duration::from_millis(1500), Duration::from_millis(2500))
        );
        assert_eq!(
            (cfg.max_connections, cfg.max_waiters, cfg.max_entries),
            (7, 8, 9)
        );
        assert_eq!(
            (cfg.handshake_timeout, cfg.max_handshakes, cfg.warn_interval),
            (Duration::from_millis(300), 5, Duration::from_millis(700))
        );
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("secret");
        std::fs::write(&path, "cli-relay-secret-0123456789\n").unwrap();
        let cli = Cli::try_parse_from(["relay", "--secret-file", path.to_str().unwrap()]).unwrap();
        let cfg = RelayOptions::from(cli.args).config().unwrap();
        assert_eq!(
            cfg.secret,
            Some(Secret::parse("cli-relay-secret-0123456789").unwrap())
        );
        assert!(cfg.tls.is_some(), "TLS keyed by the secret by default");
        let off = Cli::try_parse_from([
            "relay",
            "--secret-file",
            path.to_str().unwrap(),
            "--tls",
            "off",
        ])
        .unwrap();
        assert!(RelayOptions::from(off.args).config().unwrap().tls.is_none());
        assert!(Cli::try_parse_from(["relay", "--tls", "maybe"]).is_err());
        assert!(
            Cli::try_parse_from(["relay", "--tls-cert-file", "/x.crt"]).is_err(),
            "a certificate needs its key"
        );
        let cli = Cli::try_parse_from(["relay", "--secret", "hunter2"]).unwrap();
        let err = RelayOptions::from(cli.args)
            .config()
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("at least 16") && !err.contains("hunter2"),
            "a short secret is refused without being shown: {err}"
        );
        let cli = Cli::try_parse_from(["relay", "--ttl-s", "0", "--insecure-no-auth"]).unwrap();
        assert!(
            RelayOptions::from(cli.args).config().is_err(),
            "a zero TTL is rejected"
        );
    }

    #[test]
    fn flag_defaults_are_the_library_defaults() {
        // Only meaningful without the variables set (as in the test runs).
        let vars = [
            env::AIRM_KV_RELAY_LISTEN,
            env::AIRM_KV_TCP_TTL_S,
            env::AIRM_KV_RELAY_MAX_BYTES,
            env::AIRM_KV_RELAY_MAX_FRAME,
            env::AIRM_KV_TCP_SECRET_FILE,
            env::AIRM_KV_TCP_SECRET,
            env::AIRM_KV_TCP_INSECURE_NO_AUTH,
            env::AIRM_KV_TCP_TLS,
            env::AIRM_KV_RELAY_TLS_CERT_FILE,
            env::AIRM_KV_RELAY_TLS_KEY_FILE,
            env::AIRM_KV_RELAY_READ_TIMEOUT_MS,
            env::AIRM_KV_RELAY_IDLE_TIMEOUT_MS,
            env::AIRM_KV_RELAY_MAX_CONNECTIONS,
            env::AIRM_KV_RELAY_MAX_WAITERS,
            env::AIRM_KV_RELAY_MAX_ENTRIES,
            env::AIRM_KV_RELAY_HANDSHAKE_TIMEOUT_MS,
            env::AIRM_KV_RELAY_MAX_HANDSHAKES,
            env::AIRM_KV_RELAY_WARN_INTERVAL_MS,
        ];
        if vars.iter().any(|v| std::env::var_os(v).is_some()) {
            return;
        }
        let opts: RelayOptions = Cli::parse_from(["relay"]).args.into();
        assert_eq!(opts, RelayOptions::default());
        let err = opts.config().unwrap_err().to_string();
        assert!(
            err.contains("--insecure-no-auth"),
            "no secret, no start: {err}"
        );
    }

    #[test]
    fn the_secret_is_hidden_from_help_and_debug() {
        use clap::CommandFactory;
        let help = Cli::command().render_long_help().to_string();
        assert!(help.contains("--secret-file") && help.contains("--insecure-no-auth"));
        let cli = Cli::try_parse_from(["relay", "--secret", "visible-only-in-ps-0123"]).unwrap();
        let shown = format!("{:?} {:?}", cli.args, RelayOptions::from(cli.args.clone()));
        assert!(!shown.contains("visible-only"), "{shown}");
    }
}
