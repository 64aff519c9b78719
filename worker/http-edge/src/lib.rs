//! The HTTP edge every rngd-pd HTTP server shares (the gateway's public and
//! KPI listeners, the worker), written once:
//!
//! - [`serve`]: the accept loop with the listener limits of [`Options`]: a
//!   header-read timeout, an idle keep-alive timeout, a connection cap (the
//!   excess accepted and closed at once), `TCP_NODELAY` on every socket, a
//!   polite close after a response that left a body unread (the rest drained,
//!   bounded), and the drain on shutdown (`drain`: readiness 503 at once, new
//!   API requests refused, those in flight given [`Options::shutdown_timeout`]
//!   and then cut with a 503 or an error event and `[DONE]`);
//! - [`read_body`] / [`LimitedBody`]: a request body read under a byte limit
//!   and a deadline, against the listener's in-flight body-byte budget
//!   ([`BodyBudget`], checked before anything is buffered), refused with a
//!   415 when its `Content-Type` is not JSON; the failures are
//!   [`BodyError`], answered with the OpenAI error body;
//! - [`hold_until_sent`]: a response whose body holds a guard (an admission
//!   slot, an engine slot) until it is sent or dropped;
//! - [`shutdown_signal`]: SIGINT / SIGTERM; [`exit_on_next_signal`]: a second
//!   one ends the drain at once;
//! - [`fanout`]: the answer of a request split into single-choice parts
//!   (`n > 1`, prompt lists), merged from the parts' answers;
//! - [`admin`]: the bearer-token guard of every admin listener;
//! - [`api_key`]: the API key of the public listeners (`--api-key`);
//! - [`surface`]: the small routes every server answers alike (`/version`);
//! - [`tls`]: TLS of a listener ([`Options::tls`], the gateway's
//!   `--ssl-certfile` / `--ssl-keyfile`).
//!
//! `docs/gateway.md` ("Listener limits") describes the limits and their
//! defaults.

pub mod admin;
pub mod api_key;
mod body;
mod drain;
pub mod fanout;
mod hold;
mod serve;
pub mod surface;
pub mod tls;

use std::time::Duration;

pub use body::{
    BodyBudget, BodyError, BodyLimits, Buffered, HasBodyLimits, LimitedBody,
    check_json_content_type, read_body,
};
pub use drain::SHUTTING_DOWN;
pub use hold::{Held, hold_until_sent};
pub use serve::{EdgeStats, Served, serve};

/// Default of [`Options::header_timeout`]: 10 s.
pub const DEFAULT_HEADER_TIMEOUT: Duration = Duration::from_secs(10);
/// Default of [`Options::idle_timeout`]: 5 s.
pub const DEFAULT_IDLE_TIMEOUT: Duration = Duration::from_secs(5);
/// Default of [`Options::max_connections`].
pub const DEFAULT_MAX_CONNECTIONS: usize = 4096;
/// Default of [`Options::max_inflight_body_bytes`]: 64 MiB.
pub const DEFAULT_MAX_INFLIGHT_BODY_BYTES: usize = 64 << 20;
/// Default of [`Options::linger_bytes`]: 16 MiB.
pub const DEFAULT_LINGER_BYTES: usize = 16 << 20;
/// Default of [`Options::linger_timeout`]: 5 s.
pub const DEFAULT_LINGER_TIMEOUT: Duration = Duration::from_secs(5);
/// Default of [`Options::shutdown_timeout`]: 30 s (Kubernetes' default grace
/// period; the chart sets the pod's grace above it).
pub const DEFAULT_SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(30);

/// The limits of one listener.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Options {
    /// Time a connection has to deliver a request's complete header block:
    /// from the accept for the first request; on a kept-alive connection
    /// from the end of the previous response. Then the connection is closed
    /// (no response). Default 10 s.
    pub header_timeout: Duration,
    /// Time a kept-alive connection may sit with no request in flight before
    /// it is closed (at most [`Options::header_timeout`] in effect, as that
    /// runs from the end of each response too). Default 5 s.
    pub idle_timeout: Duration,
    /// Connections served at once; a connection beyond them is accepted and
    /// closed at once (the client sees the connection closed before any
    /// response). Default 4096.
    pub max_connections: usize,
    /// Bytes of request bodies being read at once on this listener (each
    /// body's `Content-Length` is reserved before it is read, a chunked body
    /// grows its reservation chunk by chunk). A body that does not fit is
    /// refused before it is buffered: 503 with `Retry-After`. Default 64 MiB.
    pub max_inflight_body_bytes: usize,
    /// After a response that left the request body unread (413, 408, 503),
    /// the connection is closed politely: bytes still arriving are read and
    /// discarded, at most this many, so the client reads the answer instead
    /// of a reset. Default 16 MiB.
    pub linger_bytes: usize,
    /// ... and for at most this long. Default 5 s.
    pub linger_timeout: Duration,
    /// Once told to stop, the time the API requests in flight have to
    /// finish; meanwhile `/ready` answers 503 and new API requests get a 503
    /// `shutting_down`. What is still in flight after it is cut: a 503, or
    /// an error event and `data: [DONE]` on a stream. Zero cuts at once.
    /// Default 30 s.
    pub shutdown_timeout: Duration,
    /// TLS on this listener (`None`, the default: plain HTTP). A client has
    /// [`Options::header_timeout`] to finish the handshake.
    pub tls: Option<tls::ServerTls>,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            header_timeout: DEFAULT_HEADER_TIMEOUT,
            idle_timeout: DEFAULT_IDLE_TIMEOUT,
            max_connections: DEFAULT_MAX_CONNECTIONS,
            max_inflight_body_bytes: DEFAULT_MAX_INFLIGHT_BODY_BYTES,
            linger_bytes: DEFAULT_LINGER_BYTES,
            linger_timeout: DEFAULT_LINGER_TIMEOUT,
            shutdown_timeout: DEFAULT_SHUTDOWN_TIMEOUT,
            tls: None,
        }
    }
}

/// Errors of the edge outside a request.
#[derive(Debug, thiserror::Error)]
pub enum EdgeError {
    /// An option that cannot work.
    #[error("listener options: {0}")]
    Options(String),
    /// Reading the listener's bound address failed.
    #[error("listener address")]
    Address(#[source] std::io::Error),
    /// The TLS certificate or key could not be loaded.
    #[error("TLS: {context}")]
    Tls {
        /// The file or step that failed.
        context: String,
        /// Why.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
}

impl Options {
    /// Checks the options: every timeout and cap must be above zero.
    pub fn check(&self) -> Result<(), EdgeError> {
        let zero = [
            ("header timeout", self.header_timeout.is_zero()),
            ("idle timeout", self.idle_timeout.is_zero()),
            ("max connections", self.max_connections == 0),
            (
                "max in-flight body bytes",
                self.max_inflight_body_bytes == 0,
            ),
        ];
        match zero.iter().find(|(_, z)| *z) {
            Some((name, _)) => Err(EdgeError::Options(format!("{name} must be above 0"))),
            None => Ok(()),
        }
    }
}

/// Resolves on Ctrl-C (SIGINT) or SIGTERM. The handlers are installed when
/// this is *called* (in a tokio runtime), not when the future is first
/// polled: call it before printing a ready line, so a signal sent right
/// after that line stops the server cleanly instead of killing it.
pub fn shutdown_signal() -> impl std::future::Future<Output = ()> + Send + 'static {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        let int = signal(SignalKind::interrupt());
        let term = signal(SignalKind::terminate());
        async move {
            match (int, term) {
                (Ok(mut int), Ok(mut term)) => {
                    tokio::select! {
                        _ = int.recv() => {}
                        _ = term.recv() => {}
                    }
                }
                (Ok(mut one), Err(_)) | (Err(_), Ok(mut one)) => {
                    one.recv().await;
                }
                // No handler could be installed: the default actions stop
                // the process.
                (Err(_), Err(_)) => std::future::pending::<()>().await,
            }
        }
    }
    #[cfg(not(unix))]
    {
        async {
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}

/// After the first signal (see [`shutdown_signal`]): a second SIGINT or
/// SIGTERM exits the process at once (status 130), for an operator who will
/// not wait for the drain. Call it in a tokio runtime right after the first
/// signal resolved.
pub fn exit_on_next_signal() {
    let next = shutdown_signal();
    tokio::spawn(async move {
        next.await;
        eprintln!("second signal: exiting without waiting for the drain");
        std::process::exit(130);
    });
}
