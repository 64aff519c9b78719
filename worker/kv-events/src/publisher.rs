//! The ZMQ publisher: a background thread owns a PUB socket (three frames
//! per batch: topic, 8-byte big-endian sequence number, MessagePack payload)
//! and an optional ROUTER replay socket, as vLLM's `ZmqEventPublisher`.
//!
//! The engine's thread only pushes events into a bounded queue
//! ([`KvEventPublisher::stored`] and friends, never blocking: a full queue
//! drops the event and counts it). The thread closes a batch at each
//! [`KvEventPublisher::end_step`] (one engine step's events), or when no
//! event came for a few milliseconds (a producer that does not mark its
//! steps), numbers it, publishes it and keeps it in a ring of `buffer_steps`
//! batches for replay.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, SyncSender, TrySendError, sync_channel};
use std::thread::JoinHandle;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::KvEventsError;
use crate::config::{KvEventsConfig, binds};
use crate::encode::{KvEvent, KvEventBatch, MEDIUM_GPU};

/// The replay stream's end marker: sequence -1 (8 bytes, big-endian,
/// two's complement) with an empty payload, as vLLM's `END_SEQ`.
pub const END_SEQ: [u8; 8] = (-1i64).to_be_bytes();

/// How long the publisher thread waits for events before it looks at the
/// replay socket again (the longest a replay request waits to be served),
/// and the quiet time that closes a batch without an `end_step`.
const POLL: Duration = Duration::from_millis(5);

/// Events taken into one batch at most (a larger backlog spans batches).
const MAX_BATCH_EVENTS: usize = 4096;

enum Item {
    Event(KvEvent),
    /// The end of an engine step: what is queued before it is one batch.
    EndStep,
}

/// Counters of a publisher.
#[derive(Debug, Default)]
pub struct PublisherStats {
    /// Batches published.
    pub batches: AtomicU64,
    /// Events published.
    pub events: AtomicU64,
    /// Events dropped because the queue was full.
    pub dropped_events: AtomicU64,
    /// Replay requests served.
    pub replays: AtomicU64,
}

/// A running publisher. Dropping it stops the thread after it has sent what
/// was queued.
pub struct KvEventPublisher {
    tx: Option<SyncSender<Item>>,
    thread: Option<JoinHandle<()>>,
    stats: Arc<PublisherStats>,
    endpoint: String,
    replay_endpoint: Option<String>,
    medium: String,
}

impl std::fmt::Debug for KvEventPublisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvEventPublisher")
            .field("endpoint", &self.endpoint)
            .field("replay_endpoint", &self.replay_endpoint)
            .finish_non_exhaustive()
    }
}

impl KvEventPublisher {
    /// Binds (or connects) the sockets now, so a bad endpoint fails at
    /// startup, and starts the publisher thread. `None` when the
    /// configuration publishes nothing (disabled or `"null"`).
    pub fn start(config: &KvEventsConfig) -> Result<Option<Self>, KvEventsError> {
        config.check()?;
        if config.effective_publisher() == crate::config::PublisherKind::Null {
            return Ok(None);
        }
        let ctx = zmq::Context::new();
        let zerr = |what: String| move |source: zmq::Error| KvEventsError::Zmq { what, source };
        let publ = ctx
            .socket(zmq::PUB)
            .map_err(zerr("creating the PUB socket".into()))?;
        publ.set_sndhwm(config.hwm)
            .map_err(zerr("setting the PUB high-water mark".into()))?;
        publ.set_linger(1000)
            .map_err(zerr("setting the PUB linger".into()))?;
        // libzmq takes `[ipv6]` endpoints only with IPv6 on.
        publ.set_ipv6(config.endpoint.contains('['))
            .map_err(zerr("enabling IPv6".into()))?;
        let endpoint = if binds(&config.endpoint) {
            publ.bind(&config.endpoint)
                .map_err(zerr(format!("binding {}", config.endpoint)))?;
            last_endpoint(&publ).unwrap_or_else(|| config.endpoint.clone())
        } else {
            publ.connect(&config.endpoint)
                .map_err(zerr(format!("connecting to {}", config.endpoint)))?;
            config.endpoint.clone()
        };
        let (replay, replay_endpoint) = match &config.replay_endpoint {
            None => (None, None),
            Some(ep) => {
                let r = ctx
                    .socket(zmq::ROUTER)
                    .map_err(zerr("creating the ROUTER replay socket".into()))?;
                // A whole buffer fits in one reply stream (libzmq's default
                // of 1000 would drop the rest of a long replay).
                let hwm = i32::try_from(config.buffer_steps.saturating_add(1)).unwrap_or(i32::MAX);
                r.set_sndhwm(hwm)
                    .map_err(zerr("setting the replay high-water mark".into()))?;
                r.set_linger(0)
                    .map_err(zerr("setting the replay linger".into()))?;
                r.set_ipv6(ep.contains('['))
                    .map_err(zerr("enabling IPv6".into()))?;
                r.bind(ep).map_err(zerr(format!("binding {ep}")))?;
                let bound = last_endpoint(&r).unwrap_or_else(|| ep.clone());
                (Some(r), Some(bound))
            }
        };
        let (tx, rx) = sync_channel(config.max_queue_size);
        let stats = Arc::new(PublisherStats::default());
        let worker = Worker {
            publ,
            replay,
            topic: config.topic.clone().into_bytes(),
            buffer: VecDeque::with_capacity(config.buffer_steps.min(1024)),
            buffer_steps: config.buffer_steps,
            next_seq: 0,
            stats: Arc::clone(&stats),
        };
        let thread = std::thread::Builder::new()
            .name("kv-events".into())
            .spawn(move || worker.run(rx))
            .map_err(|source| KvEventsError::Thread { source })?;
        tracing::info!(endpoint = %endpoint, replay_endpoint = ?replay_endpoint, topic = %config.topic, "publishing KV events");
        Ok(Some(KvEventPublisher {
            tx: Some(tx),
            thread: Some(thread),
            stats,
            endpoint,
            replay_endpoint,
            medium: MEDIUM_GPU.into(),
        }))
    }

    /// The PUB endpoint (the bound address when it was bound: a `*` port
    /// resolved, a `*` host shown as `0.0.0.0`).
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// The bound replay endpoint, when there is one.
    pub fn replay_endpoint(&self) -> Option<&str> {
        self.replay_endpoint.as_deref()
    }

    /// The counters.
    pub fn stats(&self) -> &PublisherStats {
        &self.stats
    }

    /// Blocks entered the cache (one chain; `token_ids` holds `block_size`
    /// tokens per block).
    pub fn stored(
        &self,
        block_hashes: Vec<u64>,
        parent_block_hash: Option<u64>,
        token_ids: Vec<u32>,
        block_size: u32,
    ) {
        self.stored_salted(block_hashes, parent_block_hash, token_ids, block_size, None);
    }

    /// [`KvEventPublisher::stored`] of a chain that starts a prompt sent
    /// with vLLM's `cache_salt` `salt` (published in the first block's
    /// `extra_keys`, as vLLM does).
    pub fn stored_salted(
        &self,
        block_hashes: Vec<u64>,
        parent_block_hash: Option<u64>,
        token_ids: Vec<u32>,
        block_size: u32,
        salt: Option<String>,
    ) {
        self.push(Item::Event(KvEvent::BlockStored {
            block_hashes,
            parent_block_hash,
            token_ids,
            block_size,
            medium: Some(self.medium.clone()),
            salt,
        }));
    }

    /// Blocks left the cache.
    pub fn removed(&self, block_hashes: Vec<u64>) {
        self.push(Item::Event(KvEvent::BlockRemoved {
            block_hashes,
            medium: Some(self.medium.clone()),
        }));
    }

    /// Every block was dropped.
    pub fn all_cleared(&self) {
        self.push(Item::Event(KvEvent::AllBlocksCleared));
    }

    /// Closes the current batch: the events pushed before this call are
    /// published as one batch (what the thread has not sent yet).
    pub fn end_step(&self) {
        self.push(Item::EndStep);
    }

    fn push(&self, item: Item) {
        let Some(tx) = &self.tx else { return };
        match tx.try_send(item) {
            Ok(()) => {}
            Err(TrySendError::Full(Item::Event(_))) => {
                let n = self.stats.dropped_events.fetch_add(1, Ordering::Relaxed);
                if n.is_power_of_two() {
                    tracing::warn!(dropped = n + 1, "KV event queue full: events dropped");
                }
            }
            Err(TrySendError::Full(Item::EndStep)) => {}
            Err(TrySendError::Disconnected(_)) => {}
        }
    }

    /// Sends what is queued and stops the thread.
    pub fn shutdown(mut self) {
        self.stop();
    }

    fn stop(&mut self) {
        self.tx.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for KvEventPublisher {
    fn drop(&mut self) {
        self.stop();
    }
}

fn last_endpoint(s: &zmq::Socket) -> Option<String> {
    s.get_last_endpoint().ok().and_then(|r| r.ok())
}

struct Worker {
    publ: zmq::Socket,
    replay: Option<zmq::Socket>,
    topic: Vec<u8>,
    buffer: VecDeque<(u64, Vec<u8>)>,
    buffer_steps: usize,
    next_seq: u64,
    stats: Arc<PublisherStats>,
}

impl Worker {
    fn run(mut self, rx: Receiver<Item>) {
        let mut pending: Vec<KvEvent> = Vec::new();
        loop {
            self.serve_replay();
            match rx.recv_timeout(POLL) {
                Ok(Item::Event(e)) => {
                    pending.push(e);
                    if pending.len() >= MAX_BATCH_EVENTS {
                        self.publish(std::mem::take(&mut pending));
                    }
                }
                // The end of a step, or a producer quiet for `POLL` (one that
                // never marks its steps): what is pending is one batch.
                Ok(Item::EndStep) | Err(RecvTimeoutError::Timeout) => {
                    if !pending.is_empty() {
                        self.publish(std::mem::take(&mut pending));
                    }
                }
                Err(RecvTimeoutError::Disconnected) => break,
            }
        }
        if !pending.is_empty() {
            self.publish(pending);
        }
    }

    fn publish(&mut self, events: Vec<KvEvent>) {
        let ts = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs_f64())
            .unwrap_or(0.0);
        let n = events.len() as u64;
        let payload = KvEventBatch {
            ts,
            events,
            data_parallel_rank: Some(0),
        }
        .encode();
        let seq = self.next_seq;
        self.next_seq += 1;
        let seq_bytes = seq.to_be_bytes();
        let frames: [&[u8]; 3] = [&self.topic, &seq_bytes, &payload];
        if let Err(e) = self.publ.send_multipart(frames, 0) {
            tracing::warn!(seq, error = %e, "publishing a KV event batch failed");
        }
        self.stats.batches.fetch_add(1, Ordering::Relaxed);
        self.stats.events.fetch_add(n, Ordering::Relaxed);
        if self.buffer.len() == self.buffer_steps {
            self.buffer.pop_front();
        }
        self.buffer.push_back((seq, payload));
    }

    /// Serves every waiting replay request: `[identity, "", start_seq]` gets
    /// `[identity, "", seq, payload]` for each buffered batch from
    /// `start_seq` on, then `[identity, "", -1, ""]`.
    fn serve_replay(&mut self) {
        let Some(r) = &self.replay else { return };
        loop {
            match r.poll(zmq::POLLIN, 0) {
                Ok(n) if n > 0 => {}
                _ => return,
            }
            let frames = match r.recv_multipart(0) {
                Ok(f) => f,
                Err(e) => {
                    tracing::warn!(error = %e, "reading a replay request failed");
                    return;
                }
            };
            // vLLM answers only [identity, empty delimiter, start_seq].
            let [id, _, start] = frames.as_slice() else {
                tracing::warn!(frames = frames.len(), "invalid replay request");
                continue;
            };
            let start = start
                .iter()
                .fold(0u128, |acc, &b| (acc << 8) | u128::from(b));
            self.stats.replays.fetch_add(1, Ordering::Relaxed);
            for (seq, payload) in &self.buffer {
                if u128::from(*seq) >= start {
                    let seq_bytes = seq.to_be_bytes();
                    let frames: [&[u8]; 4] = [id, b"", &seq_bytes, payload];
                    if let Err(e) = r.send_multipart(frames, 0) {
                        tracing::warn!(error = %e, "replay send failed");
                        break;
                    }
                }
            }
            let end: [&[u8]; 4] = [id, b"", &END_SEQ, b""];
            if let Err(e) = r.send_multipart(end, 0) {
                tracing::warn!(error = %e, "replay end marker send failed");
            }
        }
    }
}
