//! `rngd-pd-bench kv`: KV transport throughput against memcpy / raw TCP in the same run.
//!
//! Moves full Llama-3.1-8B S=512 requests (64 × 1 MiB = 67.1 MB) through a
//! transport (handed over on one client as a worker does — written in place
//! into a reserved `shm` slot, pushed elsewhere — pulled on another,
//! released), `--in-flight` at a time, and in the same run measures the
//! baseline on the same bytes: a plain memcpy into fresh memory for `shm`
//! (also a memcpy into reused memory, and the same requests pushed as
//! blobs instead of written in place), a raw loopback TCP stream into
//! fresh memory for `tcp` (with an in-process relay) and `nixl-ucx` (two
//! agents in this process, UCX between them; its descriptors through the same
//! in-process relay), which also measures the `tcp` transport in the same
//! rounds (`ratio_vs_tcp`). With `--prompt-tokens N` each round also moves
//! a prompt of N tokens in the trimmed wire (only its valid positions) on
//! the same transports, next to the S-wide wire. With `--tls` (tcp only) the relay and its
//! clients speak TLS keyed by a shared secret, and the plaintext `tcp`
//! transport (same secret, a second relay) is measured in the same rounds:
//! `ratio_vs_tcp` is then the cost of TLS. Rounds of baseline and
//! transport alternate; the report gives medians over rounds. Gb/s are
//! gigabits (10⁹ bit) of KV payload per second of wall time.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use rngd_kv_transport::nixl::NixlUcxTransport;
use rngd_kv_transport::relay::{self, RelayConfig};
use rngd_kv_transport::tcp::TcpTransport;
use rngd_kv_transport::{
    KvError, KvPayload, KvTransport, Reserved, TransportConfig, conformance, registry,
};
use rngd_kv_wire::sink::fill_from;
use rngd_kv_wire::{KvHandle, KvLayout, SinkShape, WIRE_FULL, WIRE_TRIMMED, WireError};
use serde::Serialize;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// What to run (the flags of `rngd-pd-bench kv`).
#[derive(Debug, Clone)]
pub struct Options {
    /// Transport to measure: `shm`, `tcp` or `nixl-ucx`. Default `shm`.
    pub transport: String,
    /// Requests in flight at once. Default 8.
    pub in_flight: usize,
    /// Requests per round. Default 16.
    pub requests: usize,
    /// Rounds (each: one baseline pass and one transport pass). Default 3.
    pub rounds: usize,
    /// Skip CRC-32 on the tcp transport (as `AIRM_KV_TCP_CRC=0`). Default off.
    pub no_crc: bool,
    /// `tcp` only: TLS on the relay connections (keyed by a shared secret),
    /// with plaintext `tcp` measured in the same rounds. Default off.
    pub tls: bool,
    /// A prompt of this many tokens (1 to S = 512): each round also moves
    /// its cache in the trimmed wire (version 2: only the valid positions)
    /// on the same transports, next to the S-wide wire. Default none.
    pub prompt_tokens: Option<usize>,
    /// The Azure trace CSV (`TIMESTAMP,ContextTokens,GeneratedTokens`): as
    /// `prompt_tokens`, with request `i` of each round taking the prompt
    /// length of row `i` (scaled to S with its generation, as `replay`
    /// does). Not with `prompt_tokens`. Default none.
    pub prompt_trace: Option<PathBuf>,
    /// Print a last line with the report as one JSON object. Default off.
    pub json: bool,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            transport: "shm".into(),
            in_flight: 8,
            requests: 16,
            rounds: 3,
            no_crc: false,
            tls: false,
            prompt_tokens: None,
            prompt_trace: None,
            json: false,
        }
    }
}

/// Result of a run (also the `--json` line).
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// Transport measured.
    pub transport: String,
    /// Payload bytes per request.
    pub bytes_per_request: u64,
    /// Requests in flight.
    pub in_flight: usize,
    /// Requests per round.
    pub requests: usize,
    /// Rounds.
    pub rounds: usize,
    /// What the baseline is (`memcpy` or `raw_tcp_loopback`).
    pub baseline: String,
    /// Median over rounds of the transport's throughput, Gb/s.
    pub gbps_median: f64,
    /// Median over rounds of the baseline's throughput, Gb/s.
    pub baseline_gbps_median: f64,
    /// `gbps_median / baseline_gbps_median`.
    pub ratio_vs_baseline: f64,
    /// Median push→pull→release time of one request, ms.
    pub ms_per_request_median: f64,
    /// Median time of one baseline request, ms.
    pub baseline_ms_per_request_median: f64,
    /// Whether CRC-32 was on.
    pub crc: bool,
    /// Every checked request came back byte-exact.
    pub byte_exact: bool,
    /// Whether the measured transport used TLS (`--tls`).
    pub tls: bool,
    /// `nixl-ucx` and `tcp --tls`: median throughput of the plaintext `tcp`
    /// transport measured in the same rounds (same requests), Gb/s.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tcp_gbps_median: Option<f64>,
    /// `--prompt-tokens`: the prompt's valid positions.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt_tokens: Option<usize>,
    /// `--prompt-trace`: the median prompt length of its requests.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub trace_prompt_tokens_median: Option<f64>,
    /// `--prompt-tokens` (`--prompt-trace`: the mean): payload bytes per
    /// request in the trimmed wire.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub trimmed_bytes_per_request: Option<u64>,
    /// `--prompt-tokens`: median push→pull→release time of one request in
    /// the trimmed wire, ms (measured in the same rounds as
    /// `ms_per_request_median`, the S-wide wire).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub trimmed_ms_per_request_median: Option<f64>,
    /// `--prompt-tokens`: `trimmed_ms_per_request_median /
    /// ms_per_request_median`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub trimmed_vs_full_time: Option<f64>,
    /// `nixl-ucx` and `tcp --tls`: `gbps_median / tcp_gbps_median`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ratio_vs_tcp: Option<f64>,
    /// `shm`: median throughput when the same requests are pushed as blobs
    /// (checksummed, then written into the file: the path without a room
    /// written in place), measured in the same rounds, Gb/s.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub push_gbps_median: Option<f64>,
    /// `shm`: `push_gbps_median / baseline_gbps_median`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub push_ratio_vs_baseline: Option<f64>,
    /// `shm`: median throughput of a memcpy into memory already faulted in
    /// and reused (one buffer per request in flight), measured in the same
    /// rounds: the copy alone, without the page faults and frees the
    /// `memcpy` baseline pays, Gb/s.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub warm_memcpy_gbps_median: Option<f64>,
    /// `shm`: `gbps_median / warm_memcpy_gbps_median`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ratio_vs_warm_memcpy: Option<f64>,
}

/// Errors of the benchmark.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A transport operation failed.
    #[error("transport: {0}")]
    Transport(#[from] KvError),
    /// Local I/O (temporary directory, baseline sockets) failed.
    #[error("{context}")]
    Io {
        /// What was being done.
        context: String,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// Bad flags.
    #[error("invalid arguments: {0}")]
    Args(String),
    /// A benchmark task panicked or was cancelled.
    #[error("benchmark task failed: {0}")]
    Task(#[from] tokio::task::JoinError),
    /// Blobs that do not fit the room reserved for them.
    #[error("wire: {0}")]
    Wire(#[from] WireError),
}

fn io(context: &str) -> impl FnOnce(std::io::Error) -> Error + '_ {
    move |source| Error::Io {
        context: context.to_string(),
        source,
    }
}

fn median(v: &mut [f64]) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// One pass: total wall time and per-request latencies.
struct Pass {
    wall: Duration,
    latencies_ms: Vec<f64>,
}

impl Pass {
    fn gbps(&self, bytes: u64, requests: usize) -> f64 {
        (bytes as f64 * requests as f64 * 8.0) / self.wall.as_secs_f64() / 1e9
    }
}

/// Runs `requests` jobs, `in_flight` at a time; `job(i)` returns its latency.
async fn drive<F, Fut>(requests: usize, in_flight: usize, job: F) -> Result<Pass, Error>
where
    F: Fn(usize) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = Result<(), Error>> + Send,
{
    let job = Arc::new(job);
    let next = Arc::new(AtomicUsize::new(0));
    let started = Instant::now();
    let mut workers = Vec::new();
    for _ in 0..in_flight {
        let (job, next) = (job.clone(), next.clone());
        workers.push(tokio::spawn(async move {
            let mut lat = Vec::new();
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= requests {
                    return Ok::<_, Error>(lat);
                }
                let t = Instant::now();
                job(i).await?;
                lat.push(t.elapsed().as_secs_f64() * 1e3);
            }
        }));
    }
    let mut latencies_ms = Vec::new();
    for w in workers {
        latencies_ms.extend(w.await??);
    }
    Ok(Pass {
        wall: started.elapsed(),
        latencies_ms,
    })
}

/// The memcpy baseline: copy every blob into fresh memory.
async fn memcpy_pass(
    blobs: Arc<Vec<Bytes>>,
    requests: usize,
    in_flight: usize,
) -> Result<Pass, Error> {
    drive(requests, in_flight, move |_| {
        let blobs = blobs.clone();
        async move {
            tokio::task::spawn_blocking(move || {
                let total: usize = blobs.iter().map(|b| b.len()).sum();
                let mut dst = Vec::<u8>::with_capacity(total);
                for b in blobs.iter() {
                    dst.extend_from_slice(b);
                }
                std::hint::black_box(&dst);
            })
            .await?;
            Ok(())
        }
    })
    .await
}

/// The second memcpy baseline: copy every blob into memory already
/// faulted in and reused request after request (one buffer per request in
/// flight), as the `shm` slots are: the cost of the copy alone.
async fn warm_memcpy_pass(
    blobs: Arc<Vec<Bytes>>,
    buffers: Arc<Vec<std::sync::Mutex<Vec<u8>>>>,
    requests: usize,
    in_flight: usize,
) -> Result<Pass, Error> {
    drive(requests, in_flight, move |i| {
        let (blobs, buffers) = (blobs.clone(), buffers.clone());
        async move {
            tokio::task::spawn_blocking(move || {
                // At most `in_flight` jobs run: one of the buffers is free.
                let mut k = i % buffers.len();
                let mut dst = loop {
                    if let Ok(b) = buffers[k].try_lock() {
                        break b;
                    }
                    k = (k + 1) % buffers.len();
                };
                let mut at = 0;
                for b in blobs.iter() {
                    dst[at..at + b.len()].copy_from_slice(b);
                    at += b.len();
                }
                std::hint::black_box(&*dst);
            })
            .await?;
            Ok(())
        }
    })
    .await
}

/// The raw TCP baseline: stream every blob over a loopback connection into
/// fresh memory on the other side, which acknowledges with one byte.
async fn raw_tcp_pass(
    blobs: Arc<Vec<Bytes>>,
    requests: usize,
    in_flight: usize,
) -> Result<Pass, Error> {
    let total: usize = blobs.iter().map(|b| b.len()).sum();
    let listener = TcpListener::bind("127.0.0.1:0")
        .await
        .map_err(io("binding the raw TCP sink"))?;
    let addr = listener.local_addr().map_err(io("sink address"))?;
    let sink = tokio::spawn(async move {
        loop {
            let Ok((mut s, _)) = listener.accept().await else {
                return;
            };
            let _ = s.set_nodelay(true);
            tokio::spawn(async move {
                loop {
                    let mut buf = BytesMut::with_capacity(total);
                    while buf.len() < total {
                        match s.read_buf(&mut buf).await {
                            Ok(0) | Err(_) => return,
                            Ok(_) => {}
                        }
                    }
                    std::hint::black_box(&buf);
                    if s.write_all(&[1]).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    // One connection per in-flight slot, opened before timing starts.
    let mut conns = Vec::new();
    for _ in 0..in_flight {
        let s = TcpStream::connect(addr)
            .await
            .map_err(io("connecting to the sink"))?;
        let _ = s.set_nodelay(true);
        conns.push(tokio::sync::Mutex::new(s));
    }
    let conns = Arc::new(conns);
    let pass = drive(requests, in_flight, move |i| {
        let (blobs, conns) = (blobs.clone(), conns.clone());
        async move {
            // Worker k always finds a free connection: at most `in_flight` jobs run.
            let mut s = loop {
                if let Some(s) = conns.iter().find_map(|c| c.try_lock().ok()) {
                    break s;
                }
                tokio::task::yield_now().await;
            };
            let _ = i;
            for b in blobs.iter() {
                s.write_all(b).await.map_err(io("raw TCP write"))?;
            }
            let mut ack = [0u8; 1];
            s.read_exact(&mut ack).await.map_err(io("raw TCP ack"))?;
            Ok(())
        }
    })
    .await;
    sink.abort();
    pass
}

/// How a request is handed to the pushing transport.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Handover {
    /// As the worker does: written in place into the room the transport
    /// reserves (`shm`: one copy, checksummed in the same pass), pushed
    /// where it reserves none.
    InPlace,
    /// Always pushed as blobs (`shm`: the blobs are checksummed, then
    /// written into the file).
    Push,
}

/// Hands `payload` to `a` the way `how` says; returns its handle.
async fn hand_over(
    a: &Arc<dyn KvTransport>,
    payload: KvPayload,
    how: Handover,
) -> Result<KvHandle, Error> {
    if how == Handover::InPlace {
        let shape = SinkShape {
            layout: payload.layout,
            tokens: payload.tokens,
            wire: payload.wire,
        };
        if let Some(Reserved { mut sink, slot }) = a.reserve(&payload.request_id, shape).await? {
            let blobs = payload.blobs;
            // The producer's copy; the sink goes (unmapped) with the task.
            tokio::task::spawn_blocking(move || fill_from(sink.as_mut(), &blobs)).await??;
            return Ok(slot.publish().await?);
        }
    }
    Ok(a.push(payload).await?)
}

/// One transport pass: hand over on `a` (`how`), pull on `b`, release. The
/// first request of each round is compared with the source after the pass.
async fn transport_pass(
    a: Arc<dyn KvTransport>,
    b: Arc<dyn KvTransport>,
    blobs: Arc<Vec<Bytes>>,
    requests: usize,
    in_flight: usize,
    round: (usize, Handover),
) -> Result<(Pass, bool), Error> {
    let layout = KvLayout::LLAMA31_8B_S512;
    wire_pass(
        a,
        b,
        blobs,
        (Arc::new(vec![layout.seq_len]), WIRE_FULL),
        requests,
        in_flight,
        round,
    )
    .await
}

/// The blobs of a request of `tokens` valid positions in wire version
/// `wire`: the S-wide `full` blobs, or (trimmed) the start of each, as long
/// as the trimmed wire's blobs are (no copy).
fn request_blobs(full: &[Bytes], tokens: usize, wire: u32) -> Vec<Bytes> {
    let layout = KvLayout::LLAMA31_8B_S512;
    match layout.wire_blob_bytes(wire, tokens) {
        Ok(len) if wire == WIRE_TRIMMED => full.iter().map(|b| b.slice(..len)).collect(),
        _ => full.to_vec(),
    }
}

/// [`transport_pass`] in wire version `wire`, request `i` with
/// `tokens[i % tokens.len()]` valid positions.
async fn wire_pass(
    a: Arc<dyn KvTransport>,
    b: Arc<dyn KvTransport>,
    blobs: Arc<Vec<Bytes>>,
    (tokens, wire): (Arc<Vec<usize>>, u32),
    requests: usize,
    in_flight: usize,
    (round, how): (usize, Handover),
) -> Result<(Pass, bool), Error> {
    let sample = Arc::new(std::sync::Mutex::new(None::<Vec<Bytes>>));
    let s2 = sample.clone();
    let src = blobs.clone();
    let lengths = tokens.clone();
    let pass = drive(requests, in_flight, move |i| {
        let (a, b, blobs, sample) = (a.clone(), b.clone(), src.clone(), s2.clone());
        let n = lengths[i % lengths.len()];
        async move {
            let payload = KvPayload {
                request_id: format!("bench-{}-{round}-{i}", std::process::id()),
                layout: KvLayout::LLAMA31_8B_S512,
                tokens: n,
                wire,
                blobs: request_blobs(&blobs, n, wire),
            };
            let handle = hand_over(&a, payload, how).await?;
            let got = b.pull(&handle, Duration::from_secs(60)).await?;
            b.release(&handle).await?;
            if i == 0 {
                *sample.lock().expect("sample lock") = Some(got);
            }
            Ok(())
        }
    })
    .await?;
    let got = sample.lock().expect("sample lock").take();
    let want = request_blobs(&blobs, tokens[0], wire);
    let exact = got.is_some_and(|g| g == want);
    Ok((pass, exact))
}

/// The prompt lengths of the first `requests` rows of the Azure trace at
/// `path`, scaled to `seq_len` with their generation (as `replay` sends them).
fn trace_lengths(
    path: &std::path::Path,
    requests: usize,
    seq_len: usize,
) -> Result<Vec<usize>, Error> {
    let text = std::fs::read_to_string(path).map_err(|source| Error::Io {
        context: format!("reading the trace {}", path.display()),
        source,
    })?;
    let rows = rngd_bench_replay::trace::parse(&text)
        .map_err(|e| Error::Args(format!("--prompt-trace {}: {e}", path.display())))?;
    if rows.is_empty() {
        return Err(Error::Args(format!(
            "--prompt-trace {}: no rows",
            path.display()
        )));
    }
    Ok(rows
        .iter()
        .take(requests)
        .map(|r| {
            let budget = u32::try_from(seq_len).unwrap_or(u32::MAX);
            rngd_bench_replay::trace::scale(r.context_tokens, r.generated_tokens, budget).0 as usize
        })
        .collect())
}

/// A pushing and a pulling client.
type Pair = (Arc<dyn KvTransport>, Arc<dyn KvTransport>);

/// Runs the benchmark and prints human lines (and with `--json` a last JSON line).
pub async fn run(args: Options) -> Result<Report, Error> {
    if args.in_flight == 0 || args.requests == 0 || args.rounds == 0 {
        return Err(Error::Args(
            "--in-flight, --requests and --rounds must be positive".into(),
        ));
    }
    if args.tls && args.transport != "tcp" {
        return Err(Error::Args(
            "--tls measures the tcp transport (its relay connections)".into(),
        ));
    }
    let layout = KvLayout::LLAMA31_8B_S512;
    if let Some(n) = args.prompt_tokens
        && !(1..=layout.seq_len).contains(&n)
    {
        return Err(Error::Args(format!(
            "--prompt-tokens {n}: between 1 and S = {}",
            layout.seq_len
        )));
    }
    // The prompt lengths of the trimmed-wire passes: one, or the trace's.
    let trimmed: Option<Arc<Vec<usize>>> = match (args.prompt_tokens, &args.prompt_trace) {
        (Some(_), Some(_)) => {
            return Err(Error::Args(
                "--prompt-tokens or --prompt-trace, not both".into(),
            ));
        }
        (Some(n), None) => Some(Arc::new(vec![n])),
        (None, Some(path)) => Some(Arc::new(trace_lengths(
            path,
            args.requests,
            layout.seq_len,
        )?)),
        (None, None) => None,
    };
    let blobs: Arc<Vec<Bytes>> = Arc::new(conformance::full_request("bench-source", 7).blobs);
    let bytes_per_request = layout.request_bytes() as u64;
    let shm_dir;
    let mut relay_stop = None;
    let mut plain_relay_stop = None;
    // With nixl-ucx: a tcp pair on the same relay, measured in the same rounds.
    let mut tcp_too: Option<Pair> = None;
    let (a, b, baseline): (Arc<dyn KvTransport>, Arc<dyn KvTransport>, &str) =
        match args.transport.as_str() {
            "shm" => {
                shm_dir = tempfile::Builder::new()
                    .prefix("rngd_kv_bench")
                    .tempdir_in("/dev/shm")
                    .map_err(io("creating a bench directory in /dev/shm"))?;
                let cfg = TransportConfig {
                    shm_root: PathBuf::from(shm_dir.path()),
                    ..TransportConfig::default()
                };
                (
                    registry::by_name("shm", &cfg)?,
                    registry::by_name("shm", &cfg)?,
                    "memcpy",
                )
            }
            "tcp" | "nixl-ucx" => {
                let listener = TcpListener::bind("127.0.0.1:0")
                    .await
                    .map_err(io("binding the relay"))?;
                let addr = listener.local_addr().map_err(io("relay address"))?;
                let (tx, rx) = tokio::sync::oneshot::channel::<()>();
                let secret = relay::Secret::parse("bench-kv-relay-secret-0123456789")?;
                let cfg = RelayConfig {
                    listen: addr.to_string(),
                    max_bytes: (args.in_flight as u64 + 2) * bytes_per_request,
                    secret: args.tls.then(|| secret.clone()),
                    tls: if args.tls {
                        Some(relay::ServerTls::from_secret(&secret)?)
                    } else {
                        None
                    },
                    ..RelayConfig::default()
                };
                if args.tls {
                    // The plaintext relay of the same-run comparison.
                    let plain = TcpListener::bind("127.0.0.1:0")
                        .await
                        .map_err(io("binding the plaintext relay"))?;
                    let plain_addr = plain.local_addr().map_err(io("relay address"))?;
                    let plain_cfg = RelayConfig {
                        tls: None,
                        ..cfg.clone()
                    };
                    let (ptx, prx) = tokio::sync::oneshot::channel::<()>();
                    let ptask = tokio::spawn(relay::serve(plain, plain_cfg, async {
                        let _ = prx.await;
                    }));
                    plain_relay_stop = Some((ptx, ptask));
                    let ccfg = TransportConfig {
                        tcp_crc: !args.no_crc,
                        tcp_secret: Some(secret.clone()),
                        ..TransportConfig::default()
                    };
                    tcp_too = Some((
                        Arc::new(TcpTransport::connect_to(plain_addr.to_string(), &ccfg)),
                        Arc::new(TcpTransport::connect_to(plain_addr.to_string(), &ccfg)),
                    ));
                }
                let task = tokio::spawn(relay::serve(listener, cfg, async {
                    let _ = rx.await;
                }));
                relay_stop = Some((tx, task));
                let cfg = TransportConfig {
                    tcp_secret: args.tls.then(|| secret.clone()),
                    tcp_tls: if args.tls {
                        Some(relay::ClientTls::from_secret(&secret)?)
                    } else {
                        None
                    },
                    tcp_addr: Some(addr.to_string()),
                    tcp_crc: !args.no_crc,
                    // Room for every request in flight (pushed and being read).
                    ucx_pool_mb: ((args.in_flight as u64 + 2) * bytes_per_request).div_ceil(1 << 20)
                        as usize,
                    ..TransportConfig::default()
                };
                let tcp_pair = || -> Pair {
                    (
                        Arc::new(TcpTransport::connect_to(addr.to_string(), &cfg)),
                        Arc::new(TcpTransport::connect_to(addr.to_string(), &cfg)),
                    )
                };
                if args.transport == "tcp" {
                    let (a, b) = tcp_pair();
                    (a, b, "raw_tcp_loopback")
                } else {
                    tcp_too = Some(tcp_pair());
                    (
                        Arc::new(NixlUcxTransport::with_relay(addr.to_string(), &cfg)?),
                        Arc::new(NixlUcxTransport::with_relay(addr.to_string(), &cfg)?),
                        "raw_tcp_loopback",
                    )
                }
            }
            other => {
                return Err(Error::Args(format!(
                    "--transport {other}: this benchmark measures shm, tcp or nixl-ucx"
                )));
            }
        };
    println!(
        "bench kv: transport {} vs {baseline}, {} requests × {:.1} MB ({} blobs), {} in flight, {} rounds",
        args.transport,
        args.requests,
        bytes_per_request as f64 / 1e6,
        layout.blob_count(),
        args.in_flight,
        args.rounds
    );
    let (mut t_gbps, mut b_gbps, mut t_lat, mut b_lat) = (vec![], vec![], vec![], vec![]);
    let mut byte_exact = true;
    let mut tcp_gbps = vec![];
    let mut push_gbps = vec![];
    let mut trimmed_lat = vec![];
    // Warm-up: one request each way (page cache, connections, allocator).
    let warm = (usize::MAX, Handover::InPlace);
    let _ = transport_pass(a.clone(), b.clone(), blobs.clone(), 1, 1, warm).await?;
    if let Some((ta, tb)) = &tcp_too {
        let _ = transport_pass(ta.clone(), tb.clone(), blobs.clone(), 1, 1, warm).await?;
    }
    // shm: the warm memcpy baseline's buffers, faulted in before timing.
    let warm_buffers: Arc<Vec<std::sync::Mutex<Vec<u8>>>> = Arc::new(
        (0..if args.transport == "shm" {
            args.in_flight
        } else {
            0
        })
            .map(|_| std::sync::Mutex::new(vec![1u8; bytes_per_request as usize]))
            .collect(),
    );
    let mut warm_gbps = vec![];
    for round in 0..args.rounds {
        if args.transport == "shm" {
            let w = warm_memcpy_pass(
                blobs.clone(),
                warm_buffers.clone(),
                args.requests,
                args.in_flight,
            )
            .await?;
            let g = w.gbps(bytes_per_request, args.requests);
            println!("round {round}: memcpy into reused memory {g:.2} Gb/s");
            warm_gbps.push(g);
        }
        let base = if args.transport == "shm" {
            memcpy_pass(blobs.clone(), args.requests, args.in_flight).await?
        } else {
            raw_tcp_pass(blobs.clone(), args.requests, args.in_flight).await?
        };
        let (pass, exact) = transport_pass(
            a.clone(),
            b.clone(),
            blobs.clone(),
            args.requests,
            args.in_flight,
            (round, Handover::InPlace),
        )
        .await?;
        byte_exact &= exact;
        if args.transport == "shm" {
            let (pp, pexact) = transport_pass(
                a.clone(),
                b.clone(),
                blobs.clone(),
                args.requests,
                args.in_flight,
                (round, Handover::Push),
            )
            .await?;
            byte_exact &= pexact;
            let g = pp.gbps(bytes_per_request, args.requests);
            println!("round {round}: shm pushed as blobs (same requests) {g:.2} Gb/s");
            push_gbps.push(g);
        }
        if let Some((ta, tb)) = &tcp_too {
            let (tp, texact) = transport_pass(
                ta.clone(),
                tb.clone(),
                blobs.clone(),
                args.requests,
                args.in_flight,
                (round, Handover::InPlace),
            )
            .await?;
            byte_exact &= texact;
            let g = tp.gbps(bytes_per_request, args.requests);
            println!("round {round}: plaintext tcp (same requests) {g:.2} Gb/s");
            tcp_gbps.push(g);
        }
        let (tg, bg) = (
            pass.gbps(bytes_per_request, args.requests),
            base.gbps(bytes_per_request, args.requests),
        );
        println!(
            "round {round}: {} {tg:.2} Gb/s ({:.1} ms/request), {baseline} {bg:.2} Gb/s ({:.1} ms/request), ratio {:.2}, byte-exact {exact}",
            args.transport,
            median(&mut pass.latencies_ms.clone()),
            median(&mut base.latencies_ms.clone()),
            tg / bg
        );
        if let Some(lengths) = &trimmed {
            let (tp, texact) = wire_pass(
                a.clone(),
                b.clone(),
                blobs.clone(),
                (lengths.clone(), WIRE_TRIMMED),
                args.requests,
                args.in_flight,
                (round, Handover::InPlace),
            )
            .await?;
            byte_exact &= texact;
            println!(
                "round {round}: {} trimmed wire {:.1} ms/request",
                args.transport,
                median(&mut tp.latencies_ms.clone())
            );
            trimmed_lat.extend(tp.latencies_ms);
        }
        t_gbps.push(tg);
        b_gbps.push(bg);
        t_lat.extend(pass.latencies_ms);
        b_lat.extend(base.latencies_ms);
    }
    for (tx, task) in relay_stop.into_iter().chain(plain_relay_stop) {
        let _ = tx.send(());
        task.await??;
    }
    let gbps_median = median(&mut t_gbps);
    let baseline_gbps_median = median(&mut b_gbps);
    let tcp_gbps_median = tcp_too.is_some().then(|| median(&mut tcp_gbps));
    let push_gbps_median = (!push_gbps.is_empty()).then(|| median(&mut push_gbps));
    let warm_memcpy_gbps_median = (!warm_gbps.is_empty()).then(|| median(&mut warm_gbps));
    let ms_per_request_median = median(&mut t_lat);
    let trimmed_ms = trimmed.as_ref().map(|_| median(&mut trimmed_lat));
    let report = Report {
        transport: args.transport.clone(),
        bytes_per_request,
        in_flight: args.in_flight,
        requests: args.requests,
        rounds: args.rounds,
        baseline: baseline.into(),
        gbps_median,
        baseline_gbps_median,
        ratio_vs_baseline: gbps_median / baseline_gbps_median,
        ms_per_request_median,
        baseline_ms_per_request_median: median(&mut b_lat),
        crc: args.transport == "shm" || !args.no_crc,
        byte_exact,
        tls: args.tls,
        prompt_tokens: args.prompt_tokens,
        trace_prompt_tokens_median: args.prompt_trace.as_ref().and(trimmed.as_ref()).map(|l| {
            let mut l: Vec<f64> = l.iter().map(|&n| n as f64).collect();
            median(&mut l)
        }),
        trimmed_bytes_per_request: trimmed.as_ref().map(|l| {
            let used = (0..args.requests).map(|i| l[i % l.len()]);
            let total: u64 = used
                .map(|n| {
                    (layout.wire_blob_bytes(WIRE_TRIMMED, n).unwrap_or(0) * layout.blob_count())
                        as u64
                })
                .sum();
            total / args.requests as u64
        }),
        trimmed_ms_per_request_median: trimmed_ms,
        trimmed_vs_full_time: trimmed_ms.map(|t| t / ms_per_request_median),
        tcp_gbps_median,
        ratio_vs_tcp: tcp_gbps_median.map(|t| gbps_median / t),
        push_gbps_median,
        push_ratio_vs_baseline: push_gbps_median.map(|p| p / baseline_gbps_median),
        warm_memcpy_gbps_median,
        ratio_vs_warm_memcpy: warm_memcpy_gbps_median.map(|w| gbps_median / w),
    };
    if let (Some(r), Some(bytes)) = (
        report.trimmed_vs_full_time,
        report.trimmed_bytes_per_request,
    ) {
        let what = match (report.prompt_tokens, report.trace_prompt_tokens_median) {
            (Some(n), _) => format!("{n} tokens"),
            (None, Some(m)) => format!("trace prompts, median {m} tokens"),
            _ => String::new(),
        };
        println!(
            "trimmed wire ({what}): {:.1} MB/request ({:.3}x the S-wide bytes), {r:.2}x the S-wide time in the same rounds",
            bytes as f64 / 1e6,
            bytes as f64 / report.bytes_per_request as f64
        );
    }
    if let (Some(w), Some(r), Some(p)) = (
        report.warm_memcpy_gbps_median,
        report.ratio_vs_warm_memcpy,
        report.push_ratio_vs_baseline,
    ) {
        println!(
            "shm: {r:.2}x a memcpy into reused memory ({w:.2} Gb/s); pushed as blobs instead of written in place: {p:.2}x memcpy"
        );
    }
    if let Some(r) = report.ratio_vs_tcp {
        println!(
            "{}: {:.2}x the plaintext tcp transport ({:.2} Gb/s) in the same run",
            if report.tls {
                "tcp over TLS"
            } else {
                report.transport.as_str()
            },
            r,
            tcp_gbps_median.unwrap_or(0.0)
        );
    }
    println!(
        "{}: {:.2} Gb/s median, {baseline} {:.2} Gb/s, ratio {:.2}, {:.1} ms/request median, byte-exact {}",
        report.transport,
        report.gbps_median,
        report.baseline_gbps_median,
        report.ratio_vs_baseline,
        report.ms_per_request_median,
        report.byte_exact
    );
    if args.json {
        println!(
            "{}",
            serde_json::to_string(&report).expect("report serializes")
        );
    }
    Ok(report)
}
