//! Admission control both front doors share (the gateway and the endpoint
//! picker): at most `max_concurrent` requests are served at once; up to
//! `max_queued` more wait, each at most `queue_timeout`, for a slot; a request
//! beyond the queue, or whose wait runs out, is refused at once with
//! [`Overloaded`] (each door answers it 429 with `Retry-After`) — never an
//! unbounded wait, never a 5xx for load. Next to the slots, a global budget of
//! request body bytes in flight ([`Admission::reserve_body`]), checked before
//! a byte is buffered: a door reserves the declared `Content-Length` up
//! front, or grows its reservation chunk by chunk, and a reservation past
//! the budget is refused the same way.
//!
//! This module depends on no door's error type: [`Overloaded`] is its own
//! error, which each door maps to its wire in one place.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use prometheus::{Gauge, IntCounterVec, Registry};
use rngd_telemetry::{TelemetryError, names};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// Largest request body a front door buffers by default, bytes (1 MiB): the
/// default of both doors' `--body-limit`, and at the picker also the
/// policy's own body cap.
pub const DEFAULT_MAX_BODY_BYTES: usize = 1 << 20;
/// Default [`AdmissionOptions::max_concurrent`].
pub const DEFAULT_MAX_CONCURRENT: usize = 256;
/// Default [`AdmissionOptions::max_queued`].
pub const DEFAULT_MAX_QUEUED: usize = 1024;
/// Default [`AdmissionOptions::queue_timeout`].
pub const DEFAULT_QUEUE_TIMEOUT: Duration = Duration::from_secs(5);
/// Default [`AdmissionOptions::max_inflight_body_bytes`] (64 MiB: 64 bodies
/// at the default body limit).
pub const DEFAULT_MAX_INFLIGHT_BODY_BYTES: usize = 64 << 20;

/// The limits of one door's admission.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AdmissionOptions {
    /// Requests served at once (at least 1).
    pub max_concurrent: usize,
    /// Requests that may wait for a slot beyond those; more are refused at once.
    pub max_queued: usize,
    /// Longest wait for a slot; then the request is refused.
    pub queue_timeout: Duration,
    /// Request body bytes all requests together may hold or have reserved;
    /// a reservation past it is refused (`usize::MAX` = no budget).
    pub max_inflight_body_bytes: usize,
}

impl Default for AdmissionOptions {
    fn default() -> Self {
        AdmissionOptions {
            max_concurrent: DEFAULT_MAX_CONCURRENT,
            max_queued: DEFAULT_MAX_QUEUED,
            queue_timeout: DEFAULT_QUEUE_TIMEOUT,
            max_inflight_body_bytes: DEFAULT_MAX_INFLIGHT_BODY_BYTES,
        }
    }
}

/// The metric names one door's admission registers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AdmissionNames {
    /// Requests holding a slot (gauge).
    pub in_flight: &'static str,
    /// Requests waiting for a slot (gauge).
    pub queued: &'static str,
    /// Refusals by `reason` (counter).
    pub rejections: &'static str,
    /// Body bytes reserved (gauge); `None` = not exported.
    pub body_bytes: Option<&'static str>,
}

impl AdmissionNames {
    /// The gateway's names (`rngd_pd_gateway_*`).
    pub const GATEWAY: AdmissionNames = AdmissionNames {
        in_flight: names::GATEWAY_IN_FLIGHT,
        queued: names::GATEWAY_QUEUED,
        rejections: names::GATEWAY_OVERLOAD_REJECTIONS_TOTAL,
        body_bytes: None,
    };
    /// The endpoint picker's names (`rngd_pd_epp_*`).
    pub const PICKER: AdmissionNames = AdmissionNames {
        in_flight: names::EPP_IN_FLIGHT,
        queued: names::EPP_QUEUED,
        rejections: names::EPP_OVERLOAD_REJECTIONS_TOTAL,
        body_bytes: Some(names::EPP_BODY_BYTES_IN_FLIGHT),
    };
}

/// The metrics of one door's admission, registered once (an [`Admission`]
/// built later records into them).
#[derive(Debug, Clone)]
pub struct AdmissionMetrics {
    in_flight: Gauge,
    queued: Gauge,
    rejections: IntCounterVec,
    body_bytes: Option<Gauge>,
}

impl AdmissionMetrics {
    /// Registers the metrics `names` in `registry`.
    pub fn register(names: AdmissionNames, registry: &Registry) -> Result<Self, TelemetryError> {
        Ok(AdmissionMetrics {
            in_flight: rngd_telemetry::gauge(
                registry,
                names.in_flight,
                "Requests holding a serving slot",
            )?,
            queued: rngd_telemetry::gauge(
                registry,
                names.queued,
                "Requests waiting for a serving slot",
            )?,
            rejections: rngd_telemetry::counter_vec(
                registry,
                names.rejections,
                "Requests answered 429 for load, by reason (queue_full, queue_timeout, body_budget)",
                &["reason"],
            )?,
            body_bytes: match names.body_bytes {
                Some(n) => Some(rngd_telemetry::gauge(
                    registry,
                    n,
                    "Request body bytes held or reserved by requests in flight",
                )?),
                None => None,
            },
        })
    }
}

/// Why a request was not admitted (the `reason` label).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Overload {
    /// The waiting room was full.
    QueueFull,
    /// It waited `queue_timeout` without a slot.
    QueueTimeout,
    /// Its body would have taken the bytes in flight past the budget.
    BodyBudget,
}

impl Overload {
    /// Label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Overload::QueueFull => "queue_full",
            Overload::QueueTimeout => "queue_timeout",
            Overload::BodyBudget => "body_budget",
        }
    }
}

/// A request refused for load: each door answers 429 with `Retry-After`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the server is at capacity ({}); retry after {retry_after_s} s", .reason.as_str())]
pub struct Overloaded {
    /// Which limit refused it.
    pub reason: Overload,
    /// The concurrency limit.
    pub max_concurrent: usize,
    /// Seconds to wait before retrying (`Retry-After`).
    pub retry_after_s: u64,
}

/// The slots, the waiting room and the body budget of one door.
pub struct Admission {
    slots: Arc<Semaphore>,
    opts: AdmissionOptions,
    queued: AtomicUsize,
    body: Arc<BodyBytes>,
    in_flight: Gauge,
    waiting: Gauge,
    rejected: IntCounterVec,
}

impl std::fmt::Debug for Admission {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Admission")
            .field("opts", &self.opts)
            .finish_non_exhaustive()
    }
}

/// A served request's slot; dropping it frees the slot.
#[derive(Debug)]
pub struct Slot {
    _permit: OwnedSemaphorePermit,
    in_flight: Gauge,
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.in_flight.dec();
    }
}

/// The body bytes reserved by every request together.
#[derive(Debug)]
struct BodyBytes {
    used: AtomicUsize,
    max: usize,
    gauge: Option<Gauge>,
}

impl BodyBytes {
    fn add(&self, n: usize) -> bool {
        let mut cur = self.used.load(Ordering::Acquire);
        loop {
            let Some(next) = cur.checked_add(n).filter(|t| *t <= self.max) else {
                return false;
            };
            match self
                .used
                .compare_exchange_weak(cur, next, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => break,
                Err(seen) => cur = seen,
            }
        }
        if let Some(g) = &self.gauge {
            g.add(n as f64);
        }
        true
    }

    fn sub(&self, n: usize) {
        self.used.fetch_sub(n, Ordering::AcqRel);
        if let Some(g) = &self.gauge {
            g.sub(n as f64);
        }
    }
}

/// Body bytes reserved for one request; dropping it returns them.
#[derive(Debug)]
pub struct BodyReservation {
    bytes: usize,
    budget: Arc<BodyBytes>,
}

impl BodyReservation {
    /// Bytes reserved.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Grows the reservation to `total` bytes (no-op when it already holds
    /// that many); `false` (nothing changed) when the budget has no room.
    pub fn grow_to(&mut self, total: usize) -> bool {
        if total <= self.bytes {
            return true;
        }
        if !self.budget.add(total - self.bytes) {
            return false;
        }
        self.bytes = total;
        true
    }
}

impl Drop for BodyReservation {
    fn drop(&mut self) {
        self.budget.sub(self.bytes);
    }
}

impl Admission {
    /// The gateway's admission (its `rngd_pd_gateway_*` metrics, no body
    /// budget): `max_concurrent` slots (at least 1), `max_queued` waiting
    /// places, metrics in `registry`.
    pub fn new(
        max_concurrent: usize,
        max_queued: usize,
        queue_timeout: Duration,
        registry: &Registry,
    ) -> Result<Self, TelemetryError> {
        let opts = AdmissionOptions {
            max_concurrent,
            max_queued,
            queue_timeout,
            max_inflight_body_bytes: usize::MAX,
        };
        Self::with_names(opts, AdmissionNames::GATEWAY, registry)
    }

    /// An admission with `opts`, its metrics registered under `names` in `registry`.
    pub fn with_names(
        opts: AdmissionOptions,
        names: AdmissionNames,
        registry: &Registry,
    ) -> Result<Self, TelemetryError> {
        Ok(Self::with_metrics(
            opts,
            AdmissionMetrics::register(names, registry)?,
        ))
    }

    /// An admission with `opts` recording into `metrics` (registered before).
    pub fn with_metrics(opts: AdmissionOptions, metrics: AdmissionMetrics) -> Self {
        let opts = AdmissionOptions {
            max_concurrent: opts.max_concurrent.max(1),
            ..opts
        };
        Admission {
            slots: Arc::new(Semaphore::new(opts.max_concurrent)),
            queued: AtomicUsize::new(0),
            body: Arc::new(BodyBytes {
                used: AtomicUsize::new(0),
                max: opts.max_inflight_body_bytes,
                gauge: metrics.body_bytes,
            }),
            in_flight: metrics.in_flight,
            waiting: metrics.queued,
            rejected: metrics.rejections,
            opts,
        }
    }

    /// The limits.
    pub fn options(&self) -> AdmissionOptions {
        self.opts
    }

    /// A slot now, or after a bounded wait, or [`Overloaded`].
    pub async fn admit(&self) -> Result<Slot, Overloaded> {
        let permit = match Arc::clone(&self.slots).try_acquire_owned() {
            Ok(p) => p,
            Err(_) => {
                // Take a waiting place, if one is free.
                let prev = self.queued.fetch_add(1, Ordering::AcqRel);
                if prev >= self.opts.max_queued {
                    self.queued.fetch_sub(1, Ordering::AcqRel);
                    return Err(self.reject(Overload::QueueFull));
                }
                self.waiting.inc();
                let got = tokio::time::timeout(
                    self.opts.queue_timeout,
                    Arc::clone(&self.slots).acquire_owned(),
                )
                .await;
                self.queued.fetch_sub(1, Ordering::AcqRel);
                self.waiting.dec();
                match got {
                    Ok(Ok(p)) => p,
                    // The semaphore is never closed; a timeout is the other case.
                    _ => return Err(self.reject(Overload::QueueTimeout)),
                }
            }
        };
        self.in_flight.inc();
        Ok(Slot {
            _permit: permit,
            in_flight: self.in_flight.clone(),
        })
    }

    /// Reserves `bytes` of the body budget before they are buffered (grow it
    /// with [`BodyReservation::grow_to`], refused with [`Admission::over_budget`]).
    pub fn reserve_body(&self, bytes: usize) -> Result<BodyReservation, Overloaded> {
        if !self.body.add(bytes) {
            return Err(self.reject(Overload::BodyBudget));
        }
        Ok(BodyReservation {
            bytes,
            budget: Arc::clone(&self.body),
        })
    }

    /// The refusal of a reservation that could not grow (counted).
    pub fn over_budget(&self) -> Overloaded {
        self.reject(Overload::BodyBudget)
    }

    /// Body bytes reserved now.
    pub fn body_bytes_in_flight(&self) -> usize {
        self.body.used.load(Ordering::Acquire)
    }

    fn reject(&self, why: Overload) -> Overloaded {
        self.rejected.with_label_values(&[why.as_str()]).inc();
        Overloaded {
            reason: why,
            max_concurrent: self.opts.max_concurrent,
            retry_after_s: self.opts.queue_timeout.as_secs().clamp(1, 60),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn slots_then_a_bounded_queue_then_refusal() {
        let r = Registry::new();
        let a = Arc::new(Admission::new(2, 1, Duration::from_millis(50), &r).unwrap());
        let s1 = a.admit().await.unwrap();
        let _s2 = a.admit().await.unwrap();
        // The third waits (the queue has one place); the fourth is refused at once.
        let a3 = Arc::clone(&a);
        let waiter = tokio::spawn(async move { a3.admit().await });
        while a.queued.load(Ordering::Acquire) == 0 {
            tokio::task::yield_now().await;
        }
        let e = a.admit().await.unwrap_err();
        assert_eq!(e.reason, Overload::QueueFull);
        assert_eq!(e.max_concurrent, 2);
        assert_eq!(e.retry_after_s, 1);
        // A slot frees: the waiter gets it.
        drop(s1);
        let _s3 = waiter
            .await
            .unwrap()
            .expect("the waiter gets the freed slot");
        // Nothing frees now: a new waiter times out.
        assert_eq!(a.admit().await.unwrap_err().reason, Overload::QueueTimeout);
        let text = rngd_telemetry::render(&r);
        assert!(
            text.contains("rngd_pd_gateway_overload_rejections_total{reason=\"queue_full\"} 1"),
            "{text}"
        );
        assert!(
            text.contains("rngd_pd_gateway_overload_rejections_total{reason=\"queue_timeout\"} 1"),
            "{text}"
        );
        assert!(text.contains("rngd_pd_gateway_queued 0"), "{text}");
        assert!(text.contains("rngd_pd_gateway_in_flight 2"), "{text}");
    }

    #[test]
    fn body_budget_is_reserved_grown_and_returned() {
        let r = Registry::new();
        let opts = AdmissionOptions {
            max_inflight_body_bytes: 100,
            ..Default::default()
        };
        let a = Admission::with_names(opts, AdmissionNames::PICKER, &r).unwrap();
        let mut one = a.reserve_body(60).unwrap();
        // 60 + 50 > 100: refused, nothing taken.
        assert_eq!(a.reserve_body(50).unwrap_err().reason, Overload::BodyBudget);
        assert_eq!(a.body_bytes_in_flight(), 60);
        let mut two = a.reserve_body(0).unwrap();
        assert!(two.grow_to(40));
        assert!(!two.grow_to(41), "past the budget");
        assert_eq!(two.bytes(), 40);
        assert!(one.grow_to(10), "shrinking is a no-op");
        assert_eq!(one.bytes(), 60);
        let text = rngd_telemetry::render(&r);
        assert!(
            text.contains("rngd_pd_epp_body_bytes_in_flight 100"),
            "{text}"
        );
        assert!(
            text.contains("rngd_pd_epp_overload_rejections_total{reason=\"body_budget\"} 1"),
            "{text}"
        );
        drop(one);
        drop(two);
        assert_eq!(a.body_bytes_in_flight(), 0);
        assert!(rngd_telemetry::render(&r).contains("rngd_pd_epp_body_bytes_in_flight 0"));
        // The whole budget is usable again; one byte more is not.
        let _all = a.reserve_body(100).unwrap();
        assert!(a.reserve_body(1).is_err());
    }
}
