//! The replays of the subscriber thread: one request to an endpoint's ROUTER
//! replay socket (`["", start_seq]` from a DEALER) and its reply stream
//! (`["", seq, payload]` … `["", -1, ""]`) applied in order, each reply
//! waited for at most `replay_timeout`, the whole at most `replay_deadline`;
//! what a success or a failure does to the endpoint's state.

use std::time::{Duration, Instant};

use super::{END_SEQ, ReplayKind, Stream, Subscriber, digest, ms};
use crate::endpoint::Health;

/// The longest single wait inside a replay before the stop flag is looked at.
const REPLAY_SLICE: Duration = Duration::from_millis(50);

impl Subscriber {
    /// Runs one replay to its end marker (or deadline), applying what it
    /// brings in order.
    pub(super) fn replay(&self, s: &mut Stream, kind: ReplayKind) {
        let o = &self.options;
        let started = Instant::now();
        let start = match kind {
            ReplayKind::Rebuild => {
                {
                    let mut idx = self.lock();
                    idx.clear_slot(s.slot);
                    idx.set_health(s.slot, Health::Replaying);
                }
                s.last_seq = None;
                s.recent.clear();
                0
            }
            ReplayKind::Gap => s.last_seq.map_or(0, |l| l + 1),
            // From the last batch applied, which must come back the same: a
            // publisher that restarted (and published fewer batches since)
            // is told apart from one that had nothing to say.
            ReplayKind::Probe => s.last_seq.unwrap_or(0),
        };
        let verify = match kind {
            ReplayKind::Probe => s
                .recent
                .back()
                .copied()
                .filter(|(q, _)| Some(*q) == s.last_seq),
            _ => None,
        };
        let outcome = self.run_replay(s, start, verify, started + o.replay_deadline);
        let now = Instant::now();
        match outcome {
            Ok(()) => {
                self.count(s, |c| &c.replays);
                s.last_heard = now;
                let health = {
                    let mut idx = self.lock();
                    let h = idx.health(s.slot).unwrap_or(Health::Unknown);
                    let h = match h {
                        Health::Replaying | Health::Stale | Health::Unknown => Health::Live,
                        other => other,
                    };
                    idx.set_health(s.slot, h);
                    h
                };
                if health.is_broken() {
                    self.want(s, ReplayKind::Rebuild, now + s.backoff);
                    s.backoff = (s.backoff * 2).min(o.retry_after * 32);
                } else {
                    s.backoff = o.retry_after;
                }
            }
            Err(ReplayError::Restarted(why)) => {
                self.count(s, |c| &c.restarts);
                self.warn(
                    s,
                    "restart",
                    format!(
                        "probe: {why}: publisher restarted; its entries are dropped and rebuilt"
                    ),
                );
                self.reopen_dealer(s);
                self.want(s, ReplayKind::Rebuild, now);
            }
            Err(why) => {
                if self.stopped() {
                    return;
                }
                self.count(s, |c| &c.replay_failures);
                self.reopen_dealer(s);
                let health = match (kind, &why) {
                    (ReplayKind::Probe, ReplayError::NoAnswer(_)) => {
                        self.count(s, |c| &c.stale);
                        Health::Stale
                    }
                    _ => Health::MissedBatches,
                };
                self.set_health(s, health);
                let kind_next = if health == Health::Stale {
                    ReplayKind::Probe
                } else {
                    ReplayKind::Rebuild
                };
                self.want(s, kind_next, now + s.backoff);
                s.backoff = (s.backoff * 2).min(o.retry_after * 32);
                self.warn(
                    s,
                    "replay",
                    format!(
                        "replay from {start} failed: {why}; no cache information ({})",
                        health.as_str()
                    ),
                );
            }
        }
    }

    /// A fresh DEALER, so late replies of the last replay are not read as
    /// the next one's.
    fn reopen_dealer(&self, s: &mut Stream) {
        if let Some(ep) = s.spec.replay_endpoint.clone() {
            s.dealer = None;
            match self.dealer(&ep) {
                Ok(d) => s.dealer = Some(d),
                Err(e) => self.warn(
                    s,
                    "dealer",
                    format!("reopening the replay socket failed: {e}"),
                ),
            }
        }
    }

    fn run_replay(
        &self,
        s: &mut Stream,
        start: u64,
        mut verify: Option<(u64, u64)>,
        deadline: Instant,
    ) -> Result<(), ReplayError> {
        let o = &self.options;
        let Some(d) = s.dealer.as_ref() else {
            return Err(ReplayError::NoAnswer("no replay socket".into()));
        };
        let start_bytes = start.to_be_bytes();
        let req: [&[u8]; 2] = [b"", &start_bytes];
        d.send_multipart(req, 0)
            .map_err(|e| ReplayError::NoAnswer(format!("sending the request: {e}")))?;
        loop {
            let msg_deadline = (Instant::now() + o.replay_timeout).min(deadline);
            let frames = loop {
                if self.stopped() {
                    return Err(ReplayError::NoAnswer("stopping".into()));
                }
                let now = Instant::now();
                if now >= msg_deadline {
                    return Err(ReplayError::NoAnswer(if now >= deadline {
                        format!("not finished within {:?}", o.replay_deadline)
                    } else {
                        format!("no reply within {:?}", o.replay_timeout)
                    }));
                }
                let Some(d) = s.dealer.as_ref() else {
                    return Err(ReplayError::NoAnswer("no replay socket".into()));
                };
                let wait = (msg_deadline - now).min(REPLAY_SLICE);
                match d.poll(zmq::POLLIN, ms(wait)) {
                    Ok(n) if n > 0 => match d.recv_multipart(0) {
                        Ok(f) => break f,
                        Err(e) => {
                            return Err(ReplayError::NoAnswer(format!("reading a reply: {e}")));
                        }
                    },
                    Ok(_) => {}
                    Err(e) => return Err(ReplayError::NoAnswer(format!("polling: {e}"))),
                }
            };
            let [delim, seq, payload] = frames.as_slice() else {
                return Err(ReplayError::Bad(format!(
                    "a reply of {} frames (want 3)",
                    frames.len()
                )));
            };
            if !delim.is_empty() {
                return Err(ReplayError::Bad(
                    "a reply without the empty delimiter".into(),
                ));
            }
            let Ok(seq) = <[u8; 8]>::try_from(seq.as_slice()) else {
                return Err(ReplayError::Bad("a sequence frame not 8 bytes long".into()));
            };
            if let Some((q, h)) = verify.take() {
                let same = seq != END_SEQ && u64::from_be_bytes(seq) == q && digest(payload) == h;
                if !same {
                    return Err(ReplayError::Restarted(format!(
                        "batch {q} did not come back the same"
                    )));
                }
                continue;
            }
            if seq == END_SEQ {
                return Ok(());
            }
            let seq = u64::from_be_bytes(seq);
            let expected = s.last_seq.map_or(0, |l| l + 1);
            if seq < expected {
                continue;
            }
            if seq > expected {
                // Apply what there is, but the history is not whole: drain
                // to the end marker, then report.
                let missing =
                    format!("batches {expected}..{seq} are no longer held by the publisher");
                self.apply(s, seq, payload, true);
                self.drain(s, deadline)?;
                return Err(ReplayError::Lost(missing));
            }
            self.apply(s, seq, payload, true);
        }
    }

    /// Applies the rest of a replay after a hole (each in order), up to its
    /// end marker.
    fn drain(&self, s: &mut Stream, deadline: Instant) -> Result<(), ReplayError> {
        loop {
            let now = Instant::now();
            if now >= deadline || self.stopped() {
                return Err(ReplayError::NoAnswer("not finished in time".into()));
            }
            let Some(d) = s.dealer.as_ref() else {
                return Err(ReplayError::NoAnswer("no replay socket".into()));
            };
            let wait = (deadline - now).min(self.options.replay_timeout);
            match d.poll(zmq::POLLIN, ms(wait)) {
                Ok(n) if n > 0 => {}
                _ => return Err(ReplayError::NoAnswer("no reply in time".into())),
            }
            let frames = d
                .recv_multipart(0)
                .map_err(|e| ReplayError::NoAnswer(format!("reading a reply: {e}")))?;
            let [_, seq, payload] = frames.as_slice() else {
                return Err(ReplayError::Bad("a malformed reply".into()));
            };
            if seq.as_slice() == END_SEQ {
                return Ok(());
            }
            let Ok(seq) = <[u8; 8]>::try_from(seq.as_slice()) else {
                return Err(ReplayError::Bad("a sequence frame not 8 bytes long".into()));
            };
            let seq = u64::from_be_bytes(seq);
            if s.last_seq.is_none_or(|l| seq > l) {
                self.apply(s, seq, payload, true);
            }
        }
    }
}

/// Why a replay failed.
#[derive(Debug)]
enum ReplayError {
    /// No (complete) answer in time.
    NoAnswer(String),
    /// A reply that is not `["", seq, payload]`.
    Bad(String),
    /// The publisher no longer holds batches that were needed.
    Lost(String),
    /// The publisher does not hold the last batch applied as it was: it
    /// restarted.
    Restarted(String),
}

impl std::fmt::Display for ReplayError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ReplayError::NoAnswer(m)
            | ReplayError::Bad(m)
            | ReplayError::Lost(m)
            | ReplayError::Restarted(m) => f.write_str(m),
        }
    }
}
