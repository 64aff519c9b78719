//! The accept loop with the listener limits of [`crate::Options`]:
//! HTTP/1.1 on hyper with a timer (header-read timeout), an idle keep-alive
//! timeout, a connection cap, `TCP_NODELAY`, a polite close, graceful
//! shutdown.

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll, ready};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::ConnectInfo;
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Semaphore, watch};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tower::ServiceExt;

use crate::body::BodyBudget;
use crate::{EdgeError, Options};

/// What a listener has done so far (for logs, metrics and tests).
#[derive(Debug, Default)]
pub struct EdgeStats {
    accepted: AtomicU64,
    refused: AtomicU64,
}

impl EdgeStats {
    /// Connections accepted and served.
    pub fn accepted(&self) -> u64 {
        self.accepted.load(Ordering::Relaxed)
    }

    /// Connections over [`Options::max_connections`], closed at once.
    pub fn refused(&self) -> u64 {
        self.refused.load(Ordering::Relaxed)
    }
}

/// A listener being served by [`serve`].
#[derive(Debug)]
pub struct Served {
    /// The bound address.
    pub addr: SocketAddr,
    /// Its counters.
    pub stats: Arc<EdgeStats>,
    /// Its in-flight body budget.
    pub budget: BodyBudget,
    /// Resolves when the listener has stopped and every connection is closed.
    pub done: tokio::task::JoinHandle<()>,
}

/// Serves `router` on `listener` under `options`, in the background, until
/// `shutdown` resolves; then stops accepting, lets open requests finish and
/// closes every connection ([`Served::done`] resolves after that). Every
/// request carries the peer's [`ConnectInfo<SocketAddr>`] and the listener's
/// [`BodyBudget`] in its extensions.
pub fn serve(
    listener: TcpListener,
    router: Router,
    options: Options,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<Served, EdgeError> {
    options.check()?;
    let addr = listener.local_addr().map_err(EdgeError::Address)?;
    let stats = Arc::new(EdgeStats::default());
    let budget = BodyBudget::new(options.max_inflight_body_bytes);
    let done = tokio::spawn(accept_loop(
        listener,
        router,
        options,
        budget.clone(),
        stats.clone(),
        shutdown,
    ));
    Ok(Served {
        addr,
        stats,
        budget,
        done,
    })
}

async fn accept_loop(
    listener: TcpListener,
    router: Router,
    options: Options,
    budget: BodyBudget,
    stats: Arc<EdgeStats>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) {
    let slots = Arc::new(Semaphore::new(options.max_connections));
    let tracker = TaskTracker::new();
    let stop = CancellationToken::new();
    let options = Arc::new(options);
    tokio::pin!(shutdown);
    loop {
        let (stream, remote) = tokio::select! {
            _ = &mut shutdown => break,
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(e) if is_connection_error(&e) => continue,
                Err(e) => {
                    // Out of descriptors or memory: wait instead of spinning.
                    tracing::warn!(error = %e, "accept failed; retrying in 1 s");
                    tokio::time::sleep(Duration::from_secs(1)).await;
                    continue;
                }
            },
        };
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            // Over the cap: closed at once, nothing read or held.
            let n = stats.refused.fetch_add(1, Ordering::Relaxed);
            if n.is_power_of_two() {
                tracing::warn!(
                    refused = n + 1,
                    max_connections = options.max_connections,
                    "connection cap reached: closing new connections"
                );
            }
            drop(stream);
            continue;
        };
        stats.accepted.fetch_add(1, Ordering::Relaxed);
        // Streamed chunks go out at once instead of waiting for the peer's
        // delayed ACK (Nagle).
        let _ = stream.set_nodelay(true);
        tracker.spawn(connection(
            stream,
            remote,
            router.clone(),
            options.clone(),
            budget.clone(),
            stop.clone(),
            slot,
        ));
    }
    drop(listener);
    stop.cancel();
    tracker.close();
    tracker.wait().await;
}

fn is_connection_error(e: &std::io::Error) -> bool {
    use std::io::ErrorKind::*;
    matches!(
        e.kind(),
        ConnectionRefused | ConnectionAborted | ConnectionReset
    )
}

/// Whether a connection has a request in flight, and since when it has not.
#[derive(Debug, Clone, Copy)]
struct Activity {
    busy: usize,
    /// `None` until the first response ends (the first request is bounded
    /// by the header timeout alone).
    idle_since: Option<Instant>,
}

/// Marks a request in flight on its connection until dropped (held by the
/// response body).
struct InFlight(Arc<watch::Sender<Activity>>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.send_modify(|a| {
            a.busy -= 1;
            if a.busy == 0 {
                a.idle_since = Some(Instant::now());
            }
        });
    }
}

/// Resolves once the connection has had no request in flight for `idle`.
async fn idle_for(mut rx: watch::Receiver<Activity>, idle: Duration) {
    loop {
        let a = *rx.borrow_and_update();
        match a.idle_since {
            Some(since) if a.busy == 0 => tokio::select! {
                _ = tokio::time::sleep_until(since + idle) => return,
                changed = rx.changed() => if changed.is_err() { return },
            },
            _ => {
                if rx.changed().await.is_err() {
                    return;
                }
            }
        }
    }
}

async fn connection(
    stream: TcpStream,
    remote: SocketAddr,
    router: Router,
    options: Arc<Options>,
    budget: BodyBudget,
    stop: CancellationToken,
    _slot: tokio::sync::OwnedSemaphorePermit,
) {
    let (activity, watch_rx) = watch::channel(Activity {
        busy: 0,
        idle_since: None,
    });
    let activity = Arc::new(activity);
    let service = hyper::service::service_fn(move |req: hyper::Request<Incoming>| {
        let mut req = req.map(Body::new);
        req.extensions_mut().insert(ConnectInfo(remote));
        req.extensions_mut().insert(budget.clone());
        activity.send_modify(|a| a.busy += 1);
        let mark = InFlight(activity.clone());
        let router = router.clone();
        async move {
            let resp = router.oneshot(req).await?;
            Ok::<_, Infallible>(crate::hold_until_sent(resp, mark))
        }
    });
    let io = TokioIo::new(Linger::new(stream, &options));
    let conn = hyper::server::conn::http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(options.header_timeout)
        .serve_connection(io, service);
    tokio::pin!(conn);
    let mut closing = false;
    loop {
        tokio::select! {
            result = conn.as_mut() => {
                if let Err(e) = result {
                    tracing::debug!(%remote, error = %e, "connection ended");
                }
                break;
            }
            _ = stop.cancelled(), if !closing => {
                closing = true;
                conn.as_mut().graceful_shutdown();
            }
            _ = idle_for(watch_rx.clone(), options.idle_timeout), if !closing => {
                closing = true;
                conn.as_mut().graceful_shutdown();
            }
        }
    }
}

/// The socket, closed politely: on shutdown it sends its FIN, then reads and
/// discards what the peer still sends (a request body nobody read), at most
/// [`Options::linger_bytes`] for at most [`Options::linger_timeout`], so the
/// peer reads the answer instead of a reset.
struct Linger {
    stream: TcpStream,
    phase: Phase,
    bytes: usize,
    timeout: Duration,
}

enum Phase {
    Open,
    Draining {
        left: usize,
        until: Pin<Box<tokio::time::Sleep>>,
    },
    Done,
}

impl Linger {
    fn new(stream: TcpStream, options: &Options) -> Self {
        Linger {
            stream,
            phase: Phase::Open,
            bytes: options.linger_bytes,
            timeout: options.linger_timeout,
        }
    }
}

impl AsyncRead for Linger {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.stream).poll_read(cx, buf)
    }
}

impl AsyncWrite for Linger {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        let this = &mut *self;
        loop {
            match &mut this.phase {
                Phase::Open => {
                    if ready!(Pin::new(&mut this.stream).poll_shutdown(cx)).is_err() {
                        this.phase = Phase::Done;
                        continue;
                    }
                    this.phase = Phase::Draining {
                        left: this.bytes,
                        until: Box::pin(tokio::time::sleep(this.timeout)),
                    };
                }
                Phase::Draining { left, until } => {
                    if until.as_mut().poll(cx).is_ready() || *left == 0 {
                        this.phase = Phase::Done;
                        continue;
                    }
                    let mut scratch = [0u8; 16 * 1024];
                    let mut buf = ReadBuf::new(&mut scratch);
                    match ready!(Pin::new(&mut this.stream).poll_read(cx, &mut buf)) {
                        Ok(()) if !buf.filled().is_empty() => {
                            *left = left.saturating_sub(buf.filled().len());
                        }
                        // EOF or an error: the peer is gone.
                        _ => this.phase = Phase::Done,
                    }
                }
                Phase::Done => return Poll::Ready(Ok(())),
            }
        }
    }
}
