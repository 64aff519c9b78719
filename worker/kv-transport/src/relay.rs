//! The KV relay of the `tcp` transport (`rngd-pd relay`): the server, and the
//! client the [`crate::tcp`] transport talks to it with.
//!
//! The relay keeps blobs in memory keyed by `(request key, blob index)`:
//! PUT stores (checking the CRC-32 and the memory cap), GET waits until the
//! blob is there (bounded by the wait in the frame), DEL drops a request,
//! STATS reports counters. Blobs nobody deletes expire after the TTL; those
//! older than the claim window (`--claim-window-s`, at most the TTL) count
//! as stranded until then (STATS `stranded_bytes`). Every
//! connection runs TLS when configured ([`tls`]), then the handshake of
//! [`crate::frame`] (the shared secret), both under its own short deadline and its own cap of sockets in the
//! handshake (over it the oldest is closed), apart from the authenticated
//! connections; failed handshakes are counted and warned of at most once
//! per interval. Every frame must arrive within the read deadline, an idle
//! connection is closed, and authenticated connections, waiting GETs, blobs
//! and bytes are capped (each refusal counted in STATS `rejections`). A malformed or
//! oversize frame closes that connection only. Each relay process
//! has a random epoch; requests that name another epoch (the cache was pushed
//! to an earlier process) get a clear `Restarted` error instead of a wait.
//!
//! - this module: the settings ([`RelayConfig`], [`RelayOptions`]) and
//!   [`launch`] (bind, serve, stop on request);
//! - `server`: [`serve`], the connections and the protocol handling;
//! - `store`: the blobs, the memory cap, the TTL sweep, the waiting GETs;
//! - `preauth`: the sockets in the handshake under their cap, the failed
//!   handshakes, the rate limit of their warnings;
//! - `client`: the pooled client connections of the `tcp` transport;
//! - `tls`: TLS of both sides (keys from the secret or mounted files).
//!
//! Both ends speak [`crate::frame`] and depend on nothing of each other.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use rngd_api::env;

use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::KvError;
use crate::frame::TRANSPORT;

pub(crate) mod client;
pub mod metrics;
mod preauth;
mod server;
mod store;
pub mod tls;

pub use crate::frame::{RelayStats, Secret};
pub use client::authenticate;
pub use server::serve;
use server::serve_relay;
pub use tls::{ClientTls, ServerTls, TlsMode};

/// Longest wait a GET may ask for.
pub const MAX_WAIT: Duration = Duration::from_secs(600);
/// Bytes the memory cap counts per stored blob on top of its body (the
/// bookkeeping), so that a flood of empty PUTs is capped too.
pub const ENTRY_OVERHEAD: u64 = 256;

/// Relay settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RelayConfig {
    /// Address the relay was asked to listen on (informational; [`serve`] takes a bound listener).
    pub listen: String,
    /// Lifetime of a request's blobs that nobody deletes.
    pub ttl: Duration,
    /// Age after which a request's blobs that nobody deleted count as
    /// stranded (STATS `stranded_bytes`); capped at `ttl`.
    pub claim_window: Duration,
    /// Memory cap: bytes of blobs held at once, counting bodies as they
    /// arrive and [`ENTRY_OVERHEAD`] per blob.
    pub max_bytes: u64,
    /// Largest blob accepted in one frame.
    pub max_frame: u64,
    /// The shared secret every connection must prove in the handshake.
    /// `None`: connections are not authenticated (what `--insecure-no-auth`
    /// gives; [`RelayOptions::config`] refuses it otherwise). The default is
    /// `None` for in-process relays of tests and benchmarks.
    pub secret: Option<Secret>,
    /// TLS of every connection ([`tls`]); `None`: plaintext. The default is
    /// `None` for in-process relays of tests and benchmarks;
    /// [`RelayOptions::config`] turns it on whenever it has a key.
    pub tls: Option<ServerTls>,
    /// A frame (header, key, body) must arrive within this of its first
    /// byte; a reply must be written within it too.
    pub read_timeout: Duration,
    /// A new socket must pass the handshake (its AUTH answer arrive and be
    /// checked) within this of being accepted; else it is refused and closed.
    pub handshake_timeout: Duration,
    /// Sockets in the handshake at most, apart from `max_connections`; one
    /// more closes the oldest of them.
    pub max_handshakes: usize,
    /// At most one WARN line per this for failed handshakes and accepts
    /// (the others are counted and summarised in the next line).
    pub warn_interval: Duration,
    /// A connection with no frame arriving and no GET waiting for this long is closed.
    pub idle_timeout: Duration,
    /// Authenticated connections at most (a socket counts once its
    /// handshake has passed); one more is refused with a Capacity error.
    pub max_connections: usize,
    /// GETs waiting at once at most; one more gets a Capacity error.
    pub max_waiters: usize,
    /// Blobs held (or being received) at most; one more PUT gets a Capacity error.
    pub max_entries: usize,
}

impl Default for RelayConfig {
    fn default() -> Self {
        RelayConfig {
            listen: "0.0.0.0:7070".into(),
            ttl: Duration::from_secs(60),
            claim_window: crate::config::DEFAULT_CLAIM_WINDOW,
            max_bytes: 4 << 30,
            max_frame: 64 << 20,
            secret: None,
            tls: None,
            read_timeout: Duration::from_secs(10),
            handshake_timeout: Duration::from_secs(2),
            max_handshakes: 128,
            warn_interval: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(60),
            max_connections: 1024,
            max_waiters: 4096,
            max_entries: 65536,
        }
    }
}

/// What `rngd-pd relay` is asked to run, as given (flags or their environment
/// variables); [`RelayOptions::config`] validates it into a [`RelayConfig`].
#[derive(Debug, Clone, PartialEq)]
pub struct RelayOptions {
    /// Listen address, `HOST:PORT`; port 0 picks a free one (the bound
    /// address is in [`Launched::addr`]). Default `0.0.0.0:7070`.
    pub listen: String,
    /// Seconds an unread request's blobs live; must be positive. Default 60.
    pub ttl_s: f64,
    /// Seconds after which a request's blobs nobody deleted count as
    /// stranded (`--claim-window-s`, `AIRM_KV_CLAIM_WINDOW_S`); must be
    /// positive; capped at the TTL. Default 5.
    pub claim_window_s: f64,
    /// Memory cap: bytes of blobs held at once; must be positive. Default
    /// 4 GiB (`4 << 30`).
    pub max_bytes: u64,
    /// Largest blob (frame body) accepted, bytes; must be positive. Default
    /// 64 MiB (`64 << 20`).
    pub max_frame: u64,
    /// File holding the shared secret (`--secret-file`,
    /// `AIRM_KV_TCP_SECRET_FILE`); surrounding whitespace is dropped.
    pub secret_file: Option<PathBuf>,
    /// The shared secret itself (`AIRM_KV_TCP_SECRET`). One of this and
    /// `secret_file` is required unless `insecure_no_auth`.
    pub secret: Option<Secret>,
    /// Run without authentication (`--insecure-no-auth`); logged as a
    /// warning. Default false.
    pub insecure_no_auth: bool,
    /// TLS (`--tls`, `AIRM_KV_TCP_TLS`): `Auto` (the default) keys it with
    /// `tls_cert_file`/`tls_key_file` when given, else with the secret;
    /// `Off` is plaintext.
    pub tls: TlsMode,
    /// PEM certificate chain the relay presents (`--tls-cert-file`,
    /// `AIRM_KV_RELAY_TLS_CERT_FILE`), with `tls_key_file`; instead of the
    /// key derived from the secret.
    pub tls_cert_file: Option<PathBuf>,
    /// PEM private key of `tls_cert_file` (`--tls-key-file`,
    /// `AIRM_KV_RELAY_TLS_KEY_FILE`).
    pub tls_key_file: Option<PathBuf>,
    /// Per-frame read deadline, ms; must be positive. Default 10000.
    pub read_timeout_ms: u64,
    /// Handshake deadline of a new socket, ms; must be positive. Default 2000.
    pub handshake_timeout_ms: u64,
    /// Sockets in the handshake at most (over it the oldest is closed);
    /// must be positive. Default 128.
    pub max_handshakes: usize,
    /// At most one WARN line per this many ms for failed handshakes and
    /// accepts; must be positive. Default 10000.
    pub warn_interval_ms: u64,
    /// Idle timeout of a connection, ms; must be positive. Default 60000.
    pub idle_timeout_ms: u64,
    /// Authenticated connections at most; must be positive. Default 1024.
    pub max_connections: usize,
    /// Waiting GETs at most; must be positive. Default 4096.
    pub max_waiters: usize,
    /// Blobs held at most; must be positive. Default 65536.
    pub max_entries: usize,
}

impl Default for RelayOptions {
    fn default() -> Self {
        let d = RelayConfig::default();
        RelayOptions {
            listen: d.listen,
            ttl_s: d.ttl.as_secs_f64(),
            claim_window_s: d.claim_window.as_secs_f64(),
            max_bytes: d.max_bytes,
            max_frame: d.max_frame,
            secret_file: None,
            secret: None,
            insecure_no_auth: false,
            tls: TlsMode::Auto,
            tls_cert_file: None,
            tls_key_file: None,
            read_timeout_ms: d.read_timeout.as_millis() as u64,
            handshake_timeout_ms: d.handshake_timeout.as_millis() as u64,
            max_handshakes: d.max_handshakes,
            warn_interval_ms: d.warn_interval.as_millis() as u64,
            idle_timeout_ms: d.idle_timeout.as_millis() as u64,
            max_connections: d.max_connections,
            max_waiters: d.max_waiters,
            max_entries: d.max_entries,
        }
    }
}

impl RelayOptions {
    /// The [`RelayConfig`] these options describe. Reads `secret_file`.
    /// Without a secret this is an error unless `insecure_no_auth`.
    pub fn config(&self) -> Result<RelayConfig, KvError> {
        let ttl = Duration::try_from_secs_f64(self.ttl_s)
            .ok()
            .filter(|t| !t.is_zero())
            .ok_or_else(|| KvError::Config {
                detail: format!(
                    "--ttl-s={}: expected a positive number of seconds",
                    self.ttl_s
                ),
            })?;
        let claim_window = Duration::try_from_secs_f64(self.claim_window_s)
            .ok()
            .filter(|t| !t.is_zero())
            .ok_or_else(|| KvError::Config {
                detail: format!(
                    "--claim-window-s={}: expected a positive number of seconds",
                    self.claim_window_s
                ),
            })?
            .min(ttl);
        let positive = |what: &str, ok: bool| {
            if ok {
                Ok(())
            } else {
                Err(KvError::Config {
                    detail: format!("{what} must be positive"),
                })
            }
        };
        positive(
            "--max-bytes and --max-frame",
            self.max_frame != 0 && self.max_bytes != 0,
        )?;
        positive(
            "--read-timeout-ms and --idle-timeout-ms",
            self.read_timeout_ms != 0 && self.idle_timeout_ms != 0,
        )?;
        positive(
            "--handshake-timeout-ms and --warn-interval-ms",
            self.handshake_timeout_ms != 0 && self.warn_interval_ms != 0,
        )?;
        positive(
            "--max-connections, --max-handshakes, --max-waiters and --max-entries",
            self.max_connections != 0
                && self.max_handshakes != 0
                && self.max_waiters != 0
                && self.max_entries != 0,
        )?;
        let secret = match (&self.secret_file, &self.secret) {
            (Some(_), Some(_)) => {
                return Err(KvError::Config {
                    detail: format!(
                        "both --secret-file ({}) and {} are set: give the relay secret once",
                        env::AIRM_KV_TCP_SECRET_FILE,
                        env::AIRM_KV_TCP_SECRET
                    ),
                });
            }
            (Some(path), None) => Some(Secret::from_file(path)?),
            (None, Some(s)) => {
                s.check()?;
                Some(s.clone())
            }
            (None, None) => None,
        };
        match (&secret, self.insecure_no_auth) {
            (None, false) => {
                return Err(KvError::Config {
                    detail: format!(
                        "the relay needs a shared secret: --secret-file ({}) or {}; \
                         --insecure-no-auth runs it without authentication",
                        env::AIRM_KV_TCP_SECRET_FILE,
                        env::AIRM_KV_TCP_SECRET
                    ),
                });
            }
            (Some(_), true) => {
                return Err(KvError::Config {
                    detail: "--insecure-no-auth together with a secret: pick one".into(),
                });
            }
            _ => {}
        }
        let tls = server_tls(self, secret.as_ref())?;
        Ok(RelayConfig {
            listen: self.listen.clone(),
            ttl,
            claim_window,
            max_bytes: self.max_bytes,
            max_frame: self.max_frame,
            secret,
            tls,
            read_timeout: Duration::from_millis(self.read_timeout_ms),
            handshake_timeout: Duration::from_millis(self.handshake_timeout_ms),
            max_handshakes: self.max_handshakes,
            warn_interval: Duration::from_millis(self.warn_interval_ms),
            idle_timeout: Duration::from_millis(self.idle_timeout_ms),
            max_connections: self.max_connections,
            max_waiters: self.max_waiters,
            max_entries: self.max_entries,
        })
    }
}

/// The relay's TLS from the options' `tls`, certificate files and the secret.
fn server_tls(opts: &RelayOptions, secret: Option<&Secret>) -> Result<Option<ServerTls>, KvError> {
    let files = match (&opts.tls_cert_file, &opts.tls_key_file) {
        (Some(cert), Some(key)) => Some((cert, key)),
        (None, None) => None,
        _ => {
            return Err(KvError::Config {
                detail: "--tls-cert-file and --tls-key-file go together".into(),
            });
        }
    };
    match (opts.tls, files, secret) {
        (TlsMode::Off, Some(_), _) => Err(KvError::Config {
            detail: "--tls off together with --tls-cert-file: pick one".into(),
        }),
        (TlsMode::Off, None, _) | (TlsMode::Auto, None, None) => Ok(None),
        (TlsMode::Auto, Some((cert, key)), _) => ServerTls::from_pem_files(cert, key).map(Some),
        (TlsMode::Auto, None, Some(secret)) => ServerTls::from_secret(secret).map(Some),
    }
}

/// A relay started by [`launch`]: serving until [`Launched::shutdown`].
pub struct Launched {
    /// The bound address (the real port when `listen` asked for port 0).
    pub addr: SocketAddr,
    stop: CancellationToken,
    task: tokio::task::JoinHandle<Result<(), KvError>>,
    relay: std::sync::Arc<store::Relay>,
}

// === impl Launched ===

impl std::fmt::Debug for Launched {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Launched")
            .field("addr", &self.addr)
            .finish_non_exhaustive()
    }
}

impl Launched {
    /// Asks the relay to stop: it closes every connection; [`Launched::join`]
    /// returns once they are all gone.
    pub fn shutdown(&self) {
        self.stop.cancel();
    }

    /// A handle on the relay's figures that outlives this value's
    /// [`Launched::join`] (for a metrics listener).
    pub fn figures(&self) -> Figures {
        Figures(self.relay.clone())
    }

    /// Waits until the relay has stopped (after [`Launched::shutdown`]).
    pub async fn join(self) -> Result<(), KvError> {
        match self.task.await {
            Ok(r) => r,
            // A panic in the relay is the caller's panic, as if it had run
            // the relay itself.
            Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
            Err(e) => Err(KvError::Io {
                transport: TRANSPORT,
                context: "the relay task was cancelled".into(),
                source: std::io::Error::other(e),
            }),
        }
    }
}

/// The figures of a running relay (see [`Launched::figures`]).
#[derive(Clone)]
pub struct Figures(std::sync::Arc<store::Relay>);

impl std::fmt::Debug for Figures {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Figures").finish_non_exhaustive()
    }
}

impl Figures {
    /// What a STATS request answers now.
    pub fn stats(&self) -> RelayStats {
        self.0.stats()
    }

    /// The Prometheus page of [`Figures::stats`] ([`metrics::render`]).
    pub fn metrics_page(&self) -> Result<String, rngd_telemetry::TelemetryError> {
        metrics::render(&self.0.stats(), self.0.cfg.max_bytes)
    }
}

/// Validates `opts`, binds `opts.listen` and serves on a task of the current
/// runtime until [`Launched::shutdown`].
pub async fn launch(opts: RelayOptions) -> Result<Launched, KvError> {
    let cfg = opts.config()?;
    let listener = TcpListener::bind(&cfg.listen)
        .await
        .map_err(|source| KvError::Io {
            transport: TRANSPORT,
            context: format!("binding relay to {}", cfg.listen),
            source,
        })?;
    let addr = listener.local_addr().map_err(|source| KvError::Io {
        transport: TRANSPORT,
        context: "reading the relay's bound address".into(),
        source,
    })?;
    tracing::info!(
        %addr,
        ttl = ?cfg.ttl,
        max_bytes = cfg.max_bytes,
        max_frame = cfg.max_frame,
        authenticated = cfg.secret.is_some(),
        tls = cfg.tls.as_ref().map_or("off", |t| t.origin()),
        read_timeout = ?cfg.read_timeout,
        handshake_timeout = ?cfg.handshake_timeout,
        max_handshakes = cfg.max_handshakes,
        warn_interval = ?cfg.warn_interval,
        idle_timeout = ?cfg.idle_timeout,
        max_connections = cfg.max_connections,
        max_waiters = cfg.max_waiters,
        max_entries = cfg.max_entries,
        "KV relay listening"
    );
    let stop = CancellationToken::new();
    let relay = std::sync::Arc::new(store::Relay::new(cfg));
    let task = tokio::spawn(serve_relay(
        listener,
        relay.clone(),
        stop.clone().cancelled_owned(),
    ));
    Ok(Launched {
        addr,
        stop,
        task,
        relay,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn insecure() -> RelayOptions {
        RelayOptions {
            insecure_no_auth: true,
            ..RelayOptions::default()
        }
    }

    #[test]
    fn default_options_are_the_default_config() {
        assert_eq!(insecure().config().unwrap(), RelayConfig::default());
    }

    #[test]
    fn options_are_validated() {
        let bad = |o: RelayOptions| o.config().unwrap_err().to_string();
        for ttl_s in [0.0, -1.0, f64::NAN, f64::INFINITY, 1e300] {
            let ttl = bad(RelayOptions {
                ttl_s,
                ..insecure()
            });
            assert!(ttl.contains("--ttl-s"), "{ttl_s}: {ttl}");
        }
        let cap = bad(RelayOptions {
            max_frame: 0,
            ..insecure()
        });
        assert!(cap.contains("--max-bytes and --max-frame"), "{cap}");
        let t = bad(RelayOptions {
            read_timeout_ms: 0,
            ..insecure()
        });
        assert!(t.contains("--read-timeout-ms"), "{t}");
        let c = bad(RelayOptions {
            max_waiters: 0,
            ..insecure()
        });
        assert!(c.contains("--max-waiters"), "{c}");
        let h = bad(RelayOptions {
            max_handshakes: 0,
            ..insecure()
        });
        assert!(h.contains("--max-handshakes"), "{h}");
        let d = bad(RelayOptions {
            handshake_timeout_ms: 0,
            ..insecure()
        });
        assert!(d.contains("--handshake-timeout-ms"), "{d}");
        let w = bad(RelayOptions {
            warn_interval_ms: 0,
            ..insecure()
        });
        assert!(w.contains("--warn-interval-ms"), "{w}");
    }

    #[test]
    fn a_secret_is_required_unless_insecure() {
        let err = RelayOptions::default().config().unwrap_err().to_string();
        assert!(
            err.contains("--secret-file") && err.contains("--insecure-no-auth"),
            "{err}"
        );
        let secret = Secret::parse("relay-secret-0123456789").unwrap();
        let cfg = RelayOptions {
            secret: Some(secret.clone()),
            ..RelayOptions::default()
        }
        .config()
        .unwrap();
        assert_eq!(cfg.secret, Some(secret.clone()));
        let both = RelayOptions {
            secret: Some(secret.clone()),
            ..insecure()
        }
        .config()
        .unwrap_err()
        .to_string();
        assert!(both.contains("pick one"), "{both}");
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s");
        std::fs::write(&path, "relay-secret-0123456789\n").unwrap();
        let cfg = RelayOptions {
            secret_file: Some(path.clone()),
            ..RelayOptions::default()
        }
        .config()
        .unwrap();
        assert_eq!(cfg.secret, Some(secret.clone()));
        let twice = RelayOptions {
            secret_file: Some(path),
            secret: Some(secret),
            ..RelayOptions::default()
        }
        .config()
        .unwrap_err()
        .to_string();
        assert!(twice.contains("once"), "{twice}");
        let shown = format!("{cfg:?}");
        assert!(!shown.contains("relay-secret"), "{shown}");
    }
}
