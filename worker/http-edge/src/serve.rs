//! The accept loop with the listener limits of [`crate::Options`]:
//! HTTP/1.1 on hyper with a timer (header-read timeout), an idle keep-alive
//! timeout, a connection cap, `TCP_NODELAY`, a polite close, and the drain
//! on shutdown (the stages are `drain.rs`'s; the loop moves them).

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
use crate::drain::{self, Drain, Stage};
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
/// `shutdown` resolves; then drains: `/ready` answers 503 and new API
/// requests a 503 `shutting_down`, while those in flight get
/// [`Options::shutdown_timeout`] to finish before they are cut. Then it stops
/// accepting and closes every connection ([`Served::done`] resolves after
/// that). Every
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
    let conns = Conns {
        slots: Arc::new(Semaphore::new(options.max_connections)),
        tracker: TaskTracker::new(),
        stop: CancellationToken::new(),
        drain: Drain::new(),
        router,
        options: Arc::new(options),
        budget,
        stats,
    };
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            _ = &mut shutdown => break,
            accepted = accept(&listener) => conns.admit(accepted),
        }
    }
    // Draining: new connections are still accepted (a probe or a client
    // learns the listener drains instead of meeting a refused connection),
    // their API requests refused, until nothing is in flight or the
    // shutdown timeout passes.
    conns.drain.advance(Stage::Draining);
    let inflight = conns.drain.inflight();
    if inflight > 0 {
        tracing::info!(
            inflight,
            timeout_s = conns.options.shutdown_timeout.as_secs_f64(),
            "draining: waiting for the requests in flight"
        );
    }
    let deadline = tokio::time::sleep(conns.options.shutdown_timeout);
    tokio::pin!(deadline);
    loop {
        tokio::select! {
            biased;
            _ = conns.drain.idle() => break,
            _ = &mut deadline => {
                tracing::warn!(
                    inflight = conns.drain.inflight(),
                    "shutdown timeout passed: cutting the requests still in flight"
                );
                conns.drain.advance(Stage::Aborting);
                break;
            }
            accepted = accept(&listener) => conns.admit(accepted),
        }
    }
    drop(listener);
    conns.stop.cancel();
    conns.tracker.close();
    // Every response left is short now (a cut stream's last event, a 503):
    // the connections get the polite close's bound to finish.
    let bound = conns.options.linger_timeout + Duration::from_secs(1);
    if tokio::time::timeout(bound, conns.tracker.wait())
        .await
        .is_err()
    {
        tracing::warn!(
            left = conns.tracker.len(),
            "connections still open after the drain; leaving them"
        );
    }
}

/// One accept, with the connection-level failures skipped and the others
/// (out of descriptors or memory) waited out instead of spun on.
async fn accept(listener: &TcpListener) -> (TcpStream, SocketAddr) {
    loop {
        match listener.accept().await {
            Ok(a) => return a,
            Err(e) if is_connection_error(&e) => continue,
            Err(e) => {
                tracing::warn!(error = %e, "accept failed; retrying in 1 s");
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        }
    }
}

/// What every connection of one listener shares (cheap to clone).
#[derive(Clone)]
struct Conns {
    slots: Arc<Semaphore>,
    tracker: TaskTracker,
    stop: CancellationToken,
    drain: Drain,
    router: Router,
    options: Arc<Options>,
    budget: BodyBudget,
    stats: Arc<EdgeStats>,
}

// === impl Conns ===

impl Conns {
    /// Serves one accepted connection in the background, or closes it at
    /// once when the connection cap is reached.
    fn admit(&self, (stream, remote): (TcpStream, SocketAddr)) {
        let Ok(slot) = self.slots.clone().try_acquire_owned() else {
            // Over the cap: closed at once, nothing read or held.
            let n = self.stats.refused.fetch_add(1, Ordering::Relaxed);
            if n.is_power_of_two() {
                tracing::warn!(
                    refused = n + 1,
                    max_connections = self.options.max_connections,
                    "connection cap reached: closing new connections"
                );
            }
            drop(stream);
            return;
        };
        self.stats.accepted.fetch_add(1, Ordering::Relaxed);
        // Streamed chunks go out at once instead of waiting for the peer's
        // delayed ACK (Nagle).
        let _ = stream.set_nodelay(true);
        self.tracker
            .spawn(connection(stream, remote, self.clone(), slot));
    }
}

fn is_connection_error(e: &std::io::Error) -> bool {
    use std::io::ErrorKind::*;
    matches!(
        e.kind(),
        ConnectionRefused | ConnectionAborted | ConnectionReset
    )
}

/// A request's answer, boxed so plain and TLS connections share one
/// service type.
type Answer = Pin<Box<dyn Future<Output = Result<axum::response::Response, Infallible>> + Send>>;

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
    conns: Conns,
    _slot: tokio::sync::OwnedSemaphorePermit,
) {
    let Conns {
        router,
        options,
        budget,
        drain,
        stop,
        ..
    } = conns;
    let (activity, watch_rx) = watch::channel(Activity {
        busy: 0,
        idle_since: None,
    });
    let activity = Arc::new(activity);
    let service = move |req: hyper::Request<Incoming>| {
        let mut req = req.map(Body::new);
        req.extensions_mut().insert(ConnectInfo(remote));
        req.extensions_mut().insert(budget.clone());
        activity.send_modify(|a| a.busy += 1);
        let mark = InFlight(activity.clone());
        let router = router.clone();
        let drain = drain.clone();
        let answer: Answer = Box::pin(async move {
            let path = req.uri().path();
            if drain.stage() != Stage::Serving
                && let Some(refused) = drain::refusal(path)
            {
                return Ok::<_, Infallible>(crate::hold_until_sent(refused, mark));
            }
            if crate::api_key::OPEN_PATHS.contains(&path) {
                let resp = router.oneshot(req).await?;
                return Ok(crate::hold_until_sent(resp, mark));
            }
            // An API request: counted until its answer is sent, cut if the
            // drain's deadline passes first.
            let ticket = drain.enter();
            let resp = tokio::select! {
                biased;
                resp = router.oneshot(req) => resp?,
                _ = drain.aborting() => drain::cut_short(),
            };
            let resp = if drain::is_event_stream(&resp) {
                resp.map(|b| Body::new(drain::CutOnAbort::new(b, &drain)))
            } else {
                resp
            };
            Ok(crate::hold_until_sent(resp, (mark, ticket)))
        });
        answer
    };
    let Some(tls) = &options.tls else {
        let io = TokioIo::new(Linger::new(stream, &options));
        return run(io, service, &options, &stop, watch_rx, remote).await;
    };
    // The handshake, bounded like a request's header block (a client that
    // never finishes it holds a connection slot no longer than that).
    let handshake = tokio::time::timeout(options.header_timeout, tls.acceptor().accept(stream));
    let stream = tokio::select! {
        r = handshake => match r {
            Ok(Ok(s)) => s,
            Ok(Err(e)) => {
                tracing::debug!(%remote, error = %e, "TLS handshake failed");
                return;
            }
            Err(_) => {
                tracing::debug!(%remote, "TLS handshake timed out");
                return;
            }
        },
        _ = stop.cancelled() => return,
    };
    let io = TokioIo::new(Linger::new(stream, &options));
    run(io, service, &options, &stop, watch_rx, remote).await
}

/// Serves HTTP/1.1 on one connection (plain or TLS) until it ends, closing
/// it gracefully when the listener stops or it sits idle too long.
async fn run<I, F>(
    io: TokioIo<I>,
    service: F,
    options: &Options,
    stop: &CancellationToken,
    watch_rx: watch::Receiver<Activity>,
    remote: SocketAddr,
) where
    I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    F: Fn(hyper::Request<Incoming>) -> Answer + Send + 'static,
{
    let conn = hyper::server::conn::http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(options.header_timeout)
        .serve_connection(io, hyper::service::service_fn(service));
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
struct Linger<S> {
    stream: S,
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

impl<S> Linger<S> {
    fn new(stream: S, options: &Options) -> Self {
        Linger {
            stream,
            phase: Phase::Open,
            bytes: options.linger_bytes,
            timeout: options.linger_timeout,
        }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Linger<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.stream).poll_read(cx, buf)
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> AsyncWrite for Linger<S> {
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
