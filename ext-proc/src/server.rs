//! The picker's listeners: `ext_proc` gRPC (GIE default 9002), gRPC health
//! (9003; services `liveness`, `readiness` and the ext_proc service name) and
//! Prometheus metrics over HTTP (9090, `GET /metrics`). Port 0 binds a free
//! port; [`RunningServer`] reports the bound addresses. The ext_proc listener
//! is served per connection on single-threaded runtimes of its own
//! ([`GrpcServing`]), off the runtime the rest of the process uses; with
//! [`ServerConfig::tls`] its connections are TLS (ALPN `h2`), the handshake
//! done on the thread that then serves the connection. The health port stays
//! plaintext (kubelet gRPC probes do not speak TLS; the ext_proc port serves
//! the same health services over TLS). Metrics are plain HTTP.

use std::io;
use std::net::SocketAddr;
use std::sync::Arc;

use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::ExternalProcessorServer;
use futures::Stream;
use futures::StreamExt;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, oneshot, watch};
use tokio::task::JoinHandle;
use tokio_stream::wrappers::UnboundedReceiverStream;
use tonic::server::NamedService;
use tonic::transport::server::TcpIncoming;
use tonic_health::ServingStatus;
use tonic_health::pb::health_server::{Health, HealthServer};
use tonic_health::server::HealthReporter;

use crate::ExtProcError;
use crate::picker::Picker;
use crate::processor::{ExtProcService, ProcessorConfig};
use crate::tls::{Conn, ServerTls};

/// GIE's default ext_proc port.
pub const DEFAULT_GRPC_PORT: u16 = 9002;
/// GIE's default gRPC health port.
pub const DEFAULT_HEALTH_PORT: u16 = 9003;
/// GIE's default metrics port.
pub const DEFAULT_METRICS_PORT: u16 = 9090;
/// Health service name for liveness.
pub const LIVENESS: &str = "liveness";
/// Health service name for readiness.
pub const READINESS: &str = "readiness";
/// The ext_proc gRPC service name (also a health service name).
pub const EXT_PROC_SERVICE: &str = <ExternalProcessorServer<ExtProcService> as NamedService>::NAME;

/// Where to listen.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// ext_proc gRPC address.
    pub grpc: SocketAddr,
    /// gRPC health address.
    pub health: SocketAddr,
    /// Metrics address; `None` = no metrics listener.
    pub metrics: Option<SocketAddr>,
    /// State-machine limits.
    pub processor: ProcessorConfig,
    /// More HTTP routes served next to `/metrics` (e.g. the policy admin API).
    pub extra_routes: Option<axum::Router>,
    /// TLS of the ext_proc listener (`crate::tls::TlsChoice::start`); `None` = plaintext.
    pub tls: Option<Arc<ServerTls>>,
}

impl ServerConfig {
    /// gRPC and health listeners on `127.0.0.1:0` (ports picked by the
    /// system, reported by the started server), no metrics listener, default
    /// limits: for tests and benchmarks.
    pub fn loopback() -> Self {
        let any: SocketAddr = ([127, 0, 0, 1], 0).into();
        ServerConfig {
            grpc: any,
            health: any,
            metrics: None,
            processor: ProcessorConfig::default(),
            extra_routes: None,
            tls: None,
        }
    }
}

/// How the ext_proc gRPC listener is served.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GrpcServing {
    /// Every accepted connection is served by one of `n` threads, each with a
    /// single-threaded runtime of its own (0 = one thread per core). Envoy
    /// holds one HTTP/2 connection per worker thread, so each Envoy worker's
    /// streams stay on one picker thread: a message is read, decided and
    /// answered without waking any other thread, and nothing else the
    /// process runs (scraper, file watcher, metrics, admin) shares the thread.
    PerConnection(usize),
    /// On the runtime that calls [`start_with`] (work-stealing across its workers).
    Shared,
}

impl Default for GrpcServing {
    fn default() -> Self {
        GrpcServing::PerConnection(0)
    }
}

/// The started listeners.
#[derive(Debug)]
pub struct RunningServer {
    /// Bound ext_proc address.
    pub grpc_addr: SocketAddr,
    /// Bound health address.
    pub health_addr: SocketAddr,
    /// Bound metrics address.
    pub metrics_addr: Option<SocketAddr>,
    /// Health status control (readiness can be withdrawn).
    pub health: HealthReporter,
    tasks: Vec<JoinHandle<Result<(), ExtProcError>>>,
    /// Stops the per-connection serving threads.
    stop: watch::Sender<bool>,
}

async fn bind(
    what: &'static str,
    addr: SocketAddr,
) -> Result<(TcpListener, SocketAddr), ExtProcError> {
    let err = |source| ExtProcError::Bind { what, addr, source };
    let l = TcpListener::bind(addr).await.map_err(err)?;
    let local = l.local_addr().map_err(err)?;
    Ok((l, local))
}

/// Binds every listener and starts serving ([`GrpcServing::default`]);
/// readiness is SERVING once this returns.
pub async fn start(
    picker: Arc<Picker>,
    config: ServerConfig,
) -> Result<RunningServer, ExtProcError> {
    start_with(picker, config, GrpcServing::default()).await
}

/// The connections of `incoming` as served: plaintext at once, TLS after a
/// handshake each (concurrent, on the calling runtime). Accept and handshake
/// failures are logged and skipped, so the server never sees an error item.
/// The task stops (and drops `incoming`, its listener with it) when the
/// returned stream is dropped.
fn connections<S>(
    incoming: S,
    tls: Option<Arc<ServerTls>>,
) -> UnboundedReceiverStream<io::Result<Conn>>
where
    S: Stream<Item = io::Result<TcpStream>> + Send + 'static,
{
    let (tx, rx) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        let mut incoming = std::pin::pin!(incoming);
        loop {
            // Ends (dropping the listener) as soon as the server is gone.
            let s = tokio::select! {
                () = tx.closed() => return,
                s = incoming.next() => match s {
                    Some(s) => s,
                    None => return,
                },
            };
            let s = match s {
                Ok(s) => s,
                Err(e) => {
                    tracing::warn!(error = %e, "ext_proc connection dropped");
                    continue;
                }
            };
            match &tls {
                None => {
                    let _ = tx.send(Ok(Conn::Plain(s)));
                }
                Some(t) => {
                    let (t, tx) = (Arc::clone(t), tx.clone());
                    tokio::spawn(async move {
                        let peer = s.peer_addr().ok();
                        match Conn::accept(s, Some(&t)).await {
                            Ok(c) => {
                                let _ = tx.send(Ok(c));
                            }
                            Err(e) => {
                                tracing::info!(?peer, error = %e, "ext_proc TLS handshake failed")
                            }
                        }
                    });
                }
            }
        }
    });
    UnboundedReceiverStream::new(rx)
}

/// Serves accepted connections on `threads` single-threaded runtimes, round robin.
/// Returns the accept loop's task; the threads stop when `stop` turns true.
fn serve_per_connection<H: Health>(
    listener: TcpListener,
    threads: usize,
    svc: ExtProcService,
    health: HealthServer<H>,
    tls: Option<Arc<ServerTls>>,
    stop: watch::Receiver<bool>,
) -> Result<JoinHandle<Result<(), ExtProcError>>, ExtProcError> {
    let threads = if threads == 0 {
        std::thread::available_parallelism().map_or(1, usize::from)
    } else {
        threads
    };
    let mut lanes = Vec::with_capacity(threads);
    let mut done = Vec::with_capacity(threads);
    for i in 0..threads {
        let (tx, rx) = mpsc::unbounded_channel::<std::net::TcpStream>();
        let (result_tx, result_rx) = oneshot::channel();
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|source| ExtProcError::Runtime { source })?;
        let (svc, health, mut stop, tls) = (svc.clone(), health.clone(), stop.clone(), tls.clone());
        std::thread::Builder::new()
            .name(format!("ext-proc-grpc-{i}"))
            .spawn(move || {
                let r = rt.block_on(async move {
                    // Registered with this thread's reactor: converted here.
                    let incoming = UnboundedReceiverStream::new(rx).map(|s| {
                        s.set_nonblocking(true)?;
                        TcpStream::from_std(s)
                    });
                    let incoming = connections(incoming, tls);
                    tonic::transport::Server::builder()
                        .add_service(
                            ExternalProcessorServer::new(svc)
                                .max_decoding_message_size(16 * 1024 * 1024),
                        )
                        .add_service(health)
                        .serve_with_incoming_shutdown(incoming, async move {
                            let _ = stop.wait_for(|s| *s).await;
                        })
                        .await
                });
                let _ = result_tx.send(r);
            })
            .map_err(|source| ExtProcError::Runtime { source })?;
        lanes.push(tx);
        done.push(result_rx);
    }
    let mut stop_accepting = stop;
    Ok(tokio::spawn(async move {
        let mut next = 0usize;
        let mut done = futures::future::select_all(done);
        loop {
            tokio::select! {
                // The stop first: once told, a serving thread that ended
                // (one with no stream open ends at once) is the drain, not
                // a failure, and must not end the wait for the others.
                biased;
                () = async { let _ = stop_accepting.wait_for(|s| *s).await; } => {
                    // Told to stop: no new connection; each serving thread
                    // finishes its open streams (tonic's graceful stop),
                    // then ends. The caller bounds this wait.
                    drop(lanes);
                    let _ = futures::future::join_all(done.into_inner()).await;
                    return Ok(());
                }
                (r, _, rest) = &mut done => {
                    if *stop_accepting.borrow() {
                        // Told to stop while this thread ended: wait for
                        // the others' streams too.
                        drop(lanes);
                        let _ = futures::future::join_all(rest).await;
                        return Ok(());
                    }
                    // A serving thread ended on its own: report why.
                    return match r {
                        Ok(Ok(())) => Ok(()),
                        Ok(Err(source)) => Err(ExtProcError::Serve { what: "grpc", source }),
                        Err(_) => Err(ExtProcError::Runtime {
                            source: std::io::Error::other("grpc serving thread panicked"),
                        }),
                    };
                }
                accepted = listener.accept() => {
                    let stream = match accepted {
                        Ok((s, _)) => s,
                        Err(e) => {
                            // Out of descriptors and the like: do not spin on the error.
                            tracing::warn!(error = %e, "ext_proc accept failed");
                            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
                            continue;
                        }
                    };
                    let _ = stream.set_nodelay(true);
                    let stream = match stream.into_std() {
                        Ok(s) => s,
                        Err(e) => {
                            tracing::warn!(error = %e, "ext_proc connection dropped");
                            continue;
                        }
                    };
                    let lane = next % lanes.len();
                    tracing::debug!(peer = ?stream.peer_addr().ok(), lane, "ext_proc connection");
                    let _ = lanes[lane].send(stream);
                    next = next.wrapping_add(1);
                }
            }
        }
    }))
}

/// [`start`] with an explicit way of serving the ext_proc listener.
pub async fn start_with(
    picker: Arc<Picker>,
    config: ServerConfig,
    grpc_serving: GrpcServing,
) -> Result<RunningServer, ExtProcError> {
    let (grpc_l, grpc_addr) = bind("grpc", config.grpc).await?;
    let (health_l, health_addr) = bind("health", config.health).await?;
    let metrics_bound = match config.metrics {
        Some(a) => Some(bind("metrics", a).await?),
        None => None,
    };
    let metrics_addr = metrics_bound.as_ref().map(|(_, a)| *a);

    let (reporter, health_svc) = tonic_health::server::health_reporter();
    for name in ["", LIVENESS, READINESS, EXT_PROC_SERVICE] {
        reporter
            .set_service_status(name, ServingStatus::Serving)
            .await;
    }

    let mut tasks = Vec::new();
    let svc = ExtProcService::new(Arc::clone(&picker), config.processor);
    let grpc_health = health_svc.clone();
    let (stop, stop_rx) = watch::channel(false);
    match grpc_serving {
        GrpcServing::PerConnection(n) => {
            tasks.push(serve_per_connection(
                grpc_l,
                n,
                svc,
                grpc_health,
                config.tls.clone(),
                stop_rx,
            )?);
        }
        GrpcServing::Shared => {
            let incoming = connections(
                TcpIncoming::from(grpc_l).with_nodelay(Some(true)),
                config.tls.clone(),
            );
            let mut stop_shared = stop.subscribe();
            tasks.push(tokio::spawn(async move {
                tonic::transport::Server::builder()
                    .add_service(
                        ExternalProcessorServer::new(svc)
                            .max_decoding_message_size(16 * 1024 * 1024),
                    )
                    .add_service(grpc_health)
                    .serve_with_incoming_shutdown(incoming, async move {
                        let _ = stop_shared.wait_for(|s| *s).await;
                    })
                    .await
                    .map_err(|source| ExtProcError::Serve {
                        what: "grpc",
                        source,
                    })
            }));
        }
    }
    tasks.push(tokio::spawn(async move {
        tonic::transport::Server::builder()
            .add_service(health_svc)
            .serve_with_incoming(TcpIncoming::from(health_l).with_nodelay(Some(true)))
            .await
            .map_err(|source| ExtProcError::Serve {
                what: "health",
                source,
            })
    }));
    if let Some((l, _)) = metrics_bound {
        let metrics = picker.metrics().clone();
        let for_metrics = Arc::clone(&picker);
        let mut app = axum::Router::new().route(
            "/metrics",
            axum::routing::get(move || {
                let m = metrics.clone();
                // The endpoints' tokenizer digests as last scraped, even
                // before a pick.
                for_metrics.pool().follow_tokenizers();
                async move {
                    (
                        [(
                            axum::http::header::CONTENT_TYPE,
                            rngd_telemetry::CONTENT_TYPE,
                        )],
                        m.render(),
                    )
                }
            }),
        );
        if let Some(extra) = config.extra_routes {
            app = app.merge(extra);
        }
        // Under the listener limits every rngd-pd HTTP listener has
        // (`rngd_http_edge`: header and idle timeouts, connection cap).
        let mut stop_metrics = stop.subscribe();
        let served =
            rngd_http_edge::serve(l, app, rngd_http_edge::Options::default(), async move {
                let _ = stop_metrics.wait_for(|s| *s).await;
            })
            .map_err(|source| ExtProcError::ServeMetrics {
                source: std::io::Error::other(source),
            })?;
        tasks.push(tokio::spawn(async move {
            served.done.await.map_err(|e| ExtProcError::ServeMetrics {
                source: std::io::Error::other(e),
            })
        }));
    }
    let secure = config.tls.is_some();
    tracing::info!(%grpc_addr, %health_addr, ?metrics_addr, tls = secure, "endpoint picker serving");
    Ok(RunningServer {
        grpc_addr,
        health_addr,
        metrics_addr,
        health: reporter,
        tasks,
        stop,
    })
}

impl RunningServer {
    /// Waits until a listener stops (an error, or all of them ended); the
    /// listeners are left as they are (a caller that gives up waiting can
    /// still [`RunningServer::drain`]).
    pub async fn wait(&mut self) -> Result<(), ExtProcError> {
        if self.tasks.is_empty() {
            return Ok(());
        }
        let (first, _, _) = futures::future::select_all(self.tasks.iter_mut()).await;
        self.abort();
        match first {
            Ok(r) => r,
            Err(source) => Err(ExtProcError::Task { source }),
        }
    }

    /// Stops serving the way a rolling update wants: readiness (and the
    /// overall and ext_proc health services) turn NOT_SERVING at once while
    /// liveness stays SERVING; no new ext_proc connection is taken; the
    /// streams in flight (each one request Envoy is processing) get
    /// `timeout` to end; then everything stops. Returns whether every
    /// stream ended in time.
    pub async fn drain(mut self, timeout: std::time::Duration) -> bool {
        for name in ["", READINESS, EXT_PROC_SERVICE] {
            self.health
                .set_service_status(name, ServingStatus::NotServing)
                .await;
        }
        let _ = self.stop.send(true);
        // The ext_proc listener is the first task (see `start_with`).
        let drained = match self.tasks.first_mut() {
            Some(grpc) => tokio::time::timeout(timeout, grpc).await.is_ok(),
            None => true,
        };
        if !drained {
            tracing::warn!(
                timeout_s = timeout.as_secs_f64(),
                "shutdown timeout passed with ext_proc streams open: closing them"
            );
        }
        self.abort();
        drained
    }

    /// Stops every listener (serving threads finish their open connections gracefully).
    pub fn abort(&self) {
        let _ = self.stop.send(true);
        for t in &self.tasks {
            t.abort();
        }
    }
}

impl Drop for RunningServer {
    fn drop(&mut self) {
        self.abort();
    }
}
