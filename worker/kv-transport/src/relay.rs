//! The KV relay of the `tcp` transport (`rngd-pd relay`): the server, and the
//! client the [`crate::tcp`] transport talks to it with.
//!
//! The relay keeps blobs in memory keyed by `(request key, blob index)`:
//! PUT stores (checking the CRC-32 and the memory cap), GET waits until the
//! blob is there (bounded by the wait in the frame), DEL drops a request,
//! STATS reports counters. Blobs nobody deletes expire after the TTL. A
//! malformed or oversize frame closes that connection only. Each relay process
//! has a random epoch; requests that name another epoch (the cache was pushed
//! to an earlier process) get a clear `Restarted` error instead of a wait.
//!
//! - this module: the settings ([`RelayConfig`], [`RelayOptions`]) and
//!   [`launch`] (bind, serve, stop on request);
//! - `server`: [`serve`], the connections and the protocol handling;
//! - `store`: the blobs, the memory cap, the TTL sweep, the waiting GETs;
//! - `client`: the pooled client connections of the `tcp` transport.
//!
//! Both ends speak [`crate::frame`] and depend on nothing of each other.

use std::net::SocketAddr;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::KvError;
use crate::frame::TRANSPORT;

pub(crate) mod client;
mod server;
mod store;

pub use crate::frame::RelayStats;
pub use server::serve;

/// Longest wait a GET may ask for.
pub const MAX_WAIT: Duration = Duration::from_secs(600);

/// Relay settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RelayConfig {
    /// Address the relay was asked to listen on (informational; [`serve`] takes a bound listener).
    pub listen: String,
    /// Lifetime of a request's blobs that nobody deletes.
    pub ttl: Duration,
    /// Memory cap: bytes of blobs held at once.
    pub max_bytes: u64,
    /// Largest blob accepted in one frame.
    pub max_frame: u64,
}

impl Default for RelayConfig {
    fn default() -> Self {
        RelayConfig {
            listen: "0.0.0.0:7070".into(),
            ttl: Duration::from_secs(60),
            max_bytes: 4 << 30,
            max_frame: 64 << 20,
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
    /// Memory cap: bytes of blobs held at once; must be positive. Default
    /// 4 GiB (`4 << 30`).
    pub max_bytes: u64,
    /// Largest blob (frame body) accepted, bytes; must be positive. Default
    /// 64 MiB (`64 << 20`).
    pub max_frame: u64,
}

impl Default for RelayOptions {
    fn default() -> Self {
        RelayOptions {
            listen: "0.0.0.0:7070".into(),
            ttl_s: 60.0,
            max_bytes: 4 << 30,
            max_frame: 64 << 20,
        }
    }
}

impl RelayOptions {
    /// The [`RelayConfig`] these options describe.
    pub fn config(&self) -> Result<RelayConfig, KvError> {
        let ttl = crate::config::parse_secs("--ttl-s", &self.ttl_s.to_string())?;
        if self.max_frame == 0 || self.max_bytes == 0 {
            return Err(KvError::Config {
                detail: "--max-bytes and --max-frame must be positive".into(),
            });
        }
        Ok(RelayConfig {
            listen: self.listen.clone(),
            ttl,
            max_bytes: self.max_bytes,
            max_frame: self.max_frame,
        })
    }
}

/// A relay started by [`launch`]: serving until [`Launched::shutdown`].
#[derive(Debug)]
pub struct Launched {
    /// The bound address (the real port when `listen` asked for port 0).
    pub addr: SocketAddr,
    stop: CancellationToken,
    task: tokio::task::JoinHandle<Result<(), KvError>>,
}

// === impl Launched ===

impl Launched {
    /// Asks the relay to stop: it closes every connection; [`Launched::join`]
    /// returns once they are all gone.
    pub fn shutdown(&self) {
        self.stop.cancel();
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
    tracing::info!(%addr, ttl = ?cfg.ttl, max_bytes = cfg.max_bytes, max_frame = cfg.max_frame, "KV relay listening");
    let stop = CancellationToken::new();
    let task = tokio::spawn(serve(listener, cfg, stop.clone().cancelled_owned()));
    Ok(Launched { addr, stop, task })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_options_are_the_default_config() {
        assert_eq!(
            RelayOptions::default().config().unwrap(),
            RelayConfig::default()
        );
    }

    #[test]
    fn options_are_validated() {
        let bad = |o: RelayOptions| o.config().unwrap_err().to_string();
        let ttl = bad(RelayOptions {
            ttl_s: 0.0,
            ..RelayOptions::default()
        });
        assert!(ttl.contains("--ttl-s"), "{ttl}");
        let cap = bad(RelayOptions {
            max_frame: 0,
            ..RelayOptions::default()
        });
        assert!(cap.contains("--max-bytes and --max-frame"), "{cap}");
    }
}
