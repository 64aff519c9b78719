//! The subscriber thread: one thread for every endpoint. It owns one ZMQ
//! context, per endpoint a SUB socket (topic prefix filter) and a DEALER
//! for the endpoint's ROUTER replay socket, and applies batches in sequence
//! order to the shared [`Index`]:
//!
//! - batch `last + 1`: applied;
//! - a gap (`seq > last + 1`): replay from `last + 1`;
//! - a late join (the first batch seen is not 0) or a new endpoint: clear
//!   and replay from 0 (a rebuild);
//! - the sequence went back and the batch is not one already applied (a
//!   publisher restart): clear and replay from 0;
//! - no batch for `stale_after`: a probe replay from `last + 1`;
//! - a broken endpoint (unknown parent, lost batches, undecodable): a
//!   rebuild after `retry_after`, doubling up to 32× while it fails.
//!
//! Every socket wait has a deadline, and the stop flag is looked at between
//! waits of at most `poll_interval` (a replay: 50 ms slices). The replays
//! themselves are in `stream/replay.rs`.

use std::collections::{HashMap, VecDeque};
use std::hash::{DefaultHasher, Hasher};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, SyncSender, TryRecvError};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::KvIndexError;
use crate::decode::decode_batch;
use crate::endpoint::{EndpointSpec, Health};
use crate::index::Index;
use crate::options::Options;
use crate::stats::add;

mod replay;

/// The replay stream's end marker: sequence -1, as vLLM's `END_SEQ`.
const END_SEQ: [u8; 8] = (-1i64).to_be_bytes();

/// Applied batches remembered (sequence number, payload digest) to tell a
/// batch already applied (a live copy of what a replay brought) from a
/// restarted publisher's.
const RECENT: usize = 4096;

/// A command from the handle.
pub(crate) enum Command {
    /// Replace the endpoint set; the result goes back on the sender.
    SetEndpoints(Vec<EndpointSpec>, SyncSender<Result<(), KvIndexError>>),
    /// Rebuild one endpoint's entries by a replay from 0 (the handle
    /// dropped them already).
    Resync(String),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ReplayKind {
    /// Clear the endpoint's entries and replay from 0.
    Rebuild,
    /// Replay from the next expected sequence number (a gap).
    Gap,
    /// Replay from the next expected sequence number to learn whether a
    /// silent publisher is alive (and catch up if it is).
    Probe,
}

struct Stream {
    spec: EndpointSpec,
    slot: u32,
    sub: zmq::Socket,
    dealer: Option<zmq::Socket>,
    last_seq: Option<u64>,
    recent: VecDeque<(u64, u64)>,
    pending: Option<(ReplayKind, Instant)>,
    backoff: Duration,
    last_heard: Instant,
    warned: HashMap<&'static str, Instant>,
}

/// The thread's state.
pub(crate) struct Subscriber {
    ctx: zmq::Context,
    options: Options,
    index: Arc<Mutex<Index>>,
    stop: Arc<AtomicBool>,
}

fn zerr(what: String) -> impl FnOnce(zmq::Error) -> KvIndexError {
    move |source| KvIndexError::Zmq { what, source }
}

fn ms(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX).max(1)
}

fn digest(payload: &[u8]) -> u64 {
    let mut h = DefaultHasher::new();
    h.write(payload);
    h.finish()
}

impl Subscriber {
    pub(crate) fn new(options: Options, index: Arc<Mutex<Index>>, stop: Arc<AtomicBool>) -> Self {
        Subscriber {
            ctx: zmq::Context::new(),
            options,
            index,
            stop,
        }
    }

    fn lock(&self) -> MutexGuard<'_, Index> {
        self.index.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn stopped(&self) -> bool {
        self.stop.load(Ordering::Relaxed)
    }

    /// The thread's loop, until the handle is dropped.
    pub(crate) fn run(self, rx: Receiver<Command>) {
        let mut streams: Vec<Stream> = Vec::new();
        while !self.stopped() {
            loop {
                match rx.try_recv() {
                    Ok(cmd) => self.command(&mut streams, cmd),
                    Err(TryRecvError::Empty) => break,
                    Err(TryRecvError::Disconnected) => return,
                }
            }
            if streams.is_empty() {
                match rx.recv_timeout(self.options.poll_interval) {
                    Ok(cmd) => self.command(&mut streams, cmd),
                    Err(RecvTimeoutError::Timeout) => {}
                    Err(RecvTimeoutError::Disconnected) => return,
                }
                continue;
            }
            let ready: Vec<usize> = {
                let mut items: Vec<zmq::PollItem<'_>> = streams
                    .iter()
                    .map(|s| s.sub.as_poll_item(zmq::POLLIN))
                    .collect();
                match zmq::poll(&mut items, ms(self.options.poll_interval)) {
                    Ok(_) => items
                        .iter()
                        .enumerate()
                        .filter(|(_, i)| i.is_readable())
                        .map(|(k, _)| k)
                        .collect(),
                    Err(e) => {
                        tracing::warn!(error = %e, "KV index: polling the SUB sockets failed");
                        std::thread::sleep(self.options.poll_interval);
                        Vec::new()
                    }
                }
            };
            for k in ready {
                let s = &mut streams[k];
                for _ in 0..self.options.max_batches_per_turn {
                    match s.sub.recv_multipart(zmq::DONTWAIT) {
                        Ok(frames) => self.live(s, frames),
                        Err(zmq::Error::EAGAIN) => break,
                        Err(e) => {
                            self.warn(s, "recv", format!("reading the SUB socket failed: {e}"));
                            break;
                        }
                    }
                }
            }
            for s in &mut streams {
                if self.stopped() {
                    break;
                }
                self.maintain(s);
            }
        }
    }

    fn command(&self, streams: &mut Vec<Stream>, cmd: Command) {
        let (list, reply) = match cmd {
            Command::SetEndpoints(list, reply) => (list, reply),
            Command::Resync(id) => {
                if let Some(s) = streams.iter_mut().find(|s| s.spec.id == id)
                    && !self.want(s, ReplayKind::Rebuild, Instant::now())
                {
                    // No replay socket: nothing rebuilds it but the
                    // publisher's next AllBlocksCleared.
                    self.set_health(s, Health::MissedBatches);
                }
                return;
            }
        };
        let mut first_err = None;
        let wanted: HashMap<&str, &EndpointSpec> =
            list.iter().map(|e| (e.id.as_str(), e)).collect();
        streams.retain(|s| {
            let keep = wanted.get(s.spec.id.as_str()) == Some(&&s.spec);
            if !keep {
                self.lock().remove_endpoint(&s.spec.id);
                tracing::info!(endpoint = %s.spec.id, "KV index: endpoint removed");
            }
            keep
        });
        for spec in &list {
            if streams.iter().any(|s| s.spec.id == spec.id) {
                continue;
            }
            match self.open(spec) {
                Ok(s) => {
                    tracing::info!(endpoint = %spec.id, pub_endpoint = %spec.endpoint, replay = ?spec.replay_endpoint, topic = %spec.topic, "KV index: subscribed");
                    streams.push(s);
                }
                Err(e) => {
                    tracing::warn!(endpoint = %spec.id, error = %e, "KV index: subscribing failed");
                    first_err.get_or_insert(e);
                }
            }
        }
        let _ = reply.try_send(first_err.map_or(Ok(()), Err));
    }

    fn open(&self, spec: &EndpointSpec) -> Result<Stream, KvIndexError> {
        let o = &self.options;
        let sub = self
            .ctx
            .socket(zmq::SUB)
            .map_err(zerr("creating a SUB socket".into()))?;
        sub.set_rcvhwm(o.rcv_hwm)
            .map_err(zerr("setting the SUB high-water mark".into()))?;
        sub.set_maxmsgsize(o.max_message_bytes)
            .map_err(zerr("setting the SUB message size bound".into()))?;
        sub.set_linger(0)
            .map_err(zerr("setting the SUB linger".into()))?;
        sub.set_ipv6(spec.endpoint.contains('['))
            .map_err(zerr("enabling IPv6".into()))?;
        sub.set_subscribe(spec.topic.as_bytes())
            .map_err(zerr("subscribing".into()))?;
        sub.connect(&spec.endpoint)
            .map_err(zerr(format!("connecting to {}", spec.endpoint)))?;
        let dealer = match &spec.replay_endpoint {
            Some(r) => Some(self.dealer(r)?),
            None => None,
        };
        let slot = self.lock().add_endpoint(&spec.id);
        let now = Instant::now();
        Ok(Stream {
            spec: spec.clone(),
            slot,
            sub,
            pending: dealer.as_ref().map(|_| (ReplayKind::Rebuild, now)),
            dealer,
            last_seq: None,
            recent: VecDeque::new(),
            backoff: o.retry_after,
            last_heard: now,
            warned: HashMap::new(),
        })
    }

    fn dealer(&self, endpoint: &str) -> Result<zmq::Socket, KvIndexError> {
        let o = &self.options;
        let d = self
            .ctx
            .socket(zmq::DEALER)
            .map_err(zerr("creating a DEALER socket".into()))?;
        d.set_rcvhwm(o.rcv_hwm)
            .map_err(zerr("setting the replay high-water mark".into()))?;
        d.set_maxmsgsize(o.max_message_bytes)
            .map_err(zerr("setting the replay message size bound".into()))?;
        d.set_linger(0)
            .map_err(zerr("setting the replay linger".into()))?;
        d.set_sndtimeo(ms(o.replay_timeout) as i32)
            .map_err(zerr("setting the replay send timeout".into()))?;
        d.set_ipv6(endpoint.contains('['))
            .map_err(zerr("enabling IPv6".into()))?;
        d.connect(endpoint)
            .map_err(zerr(format!("connecting to {endpoint}")))?;
        Ok(d)
    }

    /// Logs one kind of warning for one endpoint at most once per
    /// `log_interval`.
    fn warn(&self, s: &mut Stream, kind: &'static str, msg: String) {
        let now = Instant::now();
        let due = s
            .warned
            .get(kind)
            .is_none_or(|t| now.duration_since(*t) >= self.options.log_interval);
        if due {
            s.warned.insert(kind, now);
            tracing::warn!(endpoint = %s.spec.id, kind, "KV index: {msg}");
        }
    }

    fn count(&self, s: &Stream, f: fn(&crate::stats::Counters) -> &std::sync::atomic::AtomicU64) {
        let idx = self.lock();
        if let Some(c) = idx.counters(s.slot) {
            add(f(c), 1);
        }
        add(f(idx.total_counters()), 1);
    }

    fn set_health(&self, s: &Stream, h: Health) {
        self.lock().set_health(s.slot, h);
    }

    fn health(&self, s: &Stream) -> Health {
        self.lock().health(s.slot).unwrap_or(Health::Unknown)
    }

    /// Schedules a replay; false without a replay socket.
    fn want(&self, s: &mut Stream, kind: ReplayKind, at: Instant) -> bool {
        if s.dealer.is_none() {
            return false;
        }
        s.pending = Some((kind, at));
        true
    }

    /// One live message.
    fn live(&self, s: &mut Stream, frames: Vec<Vec<u8>>) {
        let now = Instant::now();
        let [_, seq, payload] = frames.as_slice() else {
            self.count(s, |c| &c.undecodable);
            let n = frames.len();
            self.warn(s, "frames", format!("a message of {n} frames (want 3)"));
            return;
        };
        let Ok(seq) = <[u8; 8]>::try_from(seq.as_slice()) else {
            self.count(s, |c| &c.undecodable);
            self.warn(s, "frames", "a sequence frame not 8 bytes long".into());
            return;
        };
        let seq = u64::from_be_bytes(seq);
        s.last_heard = now;
        if matches!(s.pending, Some((ReplayKind::Rebuild, _))) {
            return; // the rebuild brings it
        }
        match s.last_seq {
            None if seq == 0 => self.apply(s, seq, payload, false),
            None => {
                self.count(s, |c| &c.gaps);
                if !self.want(s, ReplayKind::Rebuild, now) {
                    self.warn(s, "gap", format!("joined at batch {seq} and there is no replay socket: no cache information until AllBlocksCleared"));
                    self.set_health(s, Health::MissedBatches);
                    self.apply(s, seq, payload, false);
                }
            }
            Some(last) if seq == last.wrapping_add(1) => self.apply(s, seq, payload, false),
            Some(last) if seq > last => {
                if matches!(s.pending, Some((ReplayKind::Gap, _))) {
                    return;
                }
                self.count(s, |c| &c.gaps);
                if !self.want(s, ReplayKind::Gap, now) {
                    self.warn(s, "gap", format!("batches {}..{seq} lost and there is no replay socket: no cache information until AllBlocksCleared", last + 1));
                    self.set_health(s, Health::MissedBatches);
                    self.apply(s, seq, payload, false);
                }
            }
            Some(last) => {
                let d = digest(payload);
                if s.recent.iter().any(|&(q, h)| q == seq && h == d) {
                    return; // already applied (a replay brought it first)
                }
                self.count(s, |c| &c.restarts);
                self.warn(s, "restart", format!("the sequence went back from {last} to {seq}: publisher restarted; its entries are dropped"));
                self.lock().clear_slot(s.slot);
                s.last_seq = None;
                s.recent.clear();
                if !self.want(s, ReplayKind::Rebuild, now) {
                    if seq == 0 {
                        self.set_health(s, Health::Unknown);
                    } else {
                        self.set_health(s, Health::MissedBatches);
                    }
                    self.apply(s, seq, payload, false);
                }
            }
        }
    }

    /// Applies one batch in order.
    fn apply(&self, s: &mut Stream, seq: u64, payload: &[u8], in_replay: bool) {
        let now = Instant::now();
        let health = match decode_batch(payload) {
            Ok(batch) => {
                let (applied, health) = {
                    let mut idx = self.lock();
                    let a = idx.apply_batch(s.slot, &batch, now);
                    (a, idx.health(s.slot).unwrap_or(Health::Unknown))
                };
                if applied.unknown_parents > 0 {
                    self.warn(s, "unknown_parent", format!("batch {seq}: a stored chain's parent hash was never stored: no cache information until a replay rebuilds the endpoint"));
                }
                if applied.undecodable > 0 {
                    self.warn(
                        s,
                        "undecodable_event",
                        format!(
                            "batch {seq}: {} events could not be decoded and were skipped",
                            applied.undecodable
                        ),
                    );
                }
                health
            }
            Err(e) => {
                self.count(s, |c| &c.undecodable);
                self.set_health(s, Health::Undecodable);
                self.warn(s, "undecodable", format!("batch {seq}: {e}: no cache information until a replay rebuilds the endpoint"));
                Health::Undecodable
            }
        };
        s.last_seq = Some(seq);
        if s.recent.len() == RECENT {
            s.recent.pop_front();
        }
        s.recent.push_back((seq, digest(payload)));
        if !in_replay && health.is_broken() && s.pending.is_none() {
            self.want(s, ReplayKind::Rebuild, now + s.backoff);
        }
    }

    /// Deadlines: a due replay, a silent stream, a broken endpoint.
    fn maintain(&self, s: &mut Stream) {
        let now = Instant::now();
        if let Some((kind, due)) = s.pending {
            if now >= due {
                s.pending = None;
                self.replay(s, kind);
            }
            return;
        }
        let health = self.health(s);
        let silent = now.duration_since(s.last_heard) >= self.options.stale_after;
        if health.is_broken() {
            self.want(s, ReplayKind::Rebuild, now + s.backoff);
        } else if health == Health::Live && silent {
            if !self.want(s, ReplayKind::Probe, now) {
                self.count(s, |c| &c.stale);
                self.set_health(s, Health::Stale);
                let secs = self.options.stale_after.as_secs_f64();
                self.warn(
                    s,
                    "stale",
                    format!("no batch for {secs} s: no cache information until one comes"),
                );
            }
        } else if health == Health::Stale {
            self.want(s, ReplayKind::Probe, now + s.backoff);
        }
    }
}
