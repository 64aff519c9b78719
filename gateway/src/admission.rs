//! Admission control: at most `max_concurrent` requests are served at once
//! (from the policy call to the end of the response stream); up to
//! `max_queued` more wait, each at most `queue_timeout`, for a slot. A request
//! beyond the queue, or whose wait runs out, is answered 429 with
//! `Retry-After` at once — never an unbounded wait, never a 5xx for load.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use prometheus::{Gauge, IntCounterVec, Registry};
use rngd_telemetry::names;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::error::{ApiError, GatewayError};

/// Why a request was not admitted (the `reason` label).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Overload {
    /// The waiting room was full.
    QueueFull,
    /// It waited `queue_timeout` without a slot.
    QueueTimeout,
}

impl Overload {
    /// Label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Overload::QueueFull => "queue_full",
            Overload::QueueTimeout => "queue_timeout",
        }
    }
}

/// The slots and the waiting room.
pub struct Admission {
    slots: Arc<Semaphore>,
    max_queued: usize,
    queued: AtomicUsize,
    queue_timeout: Duration,
    in_flight: Gauge,
    waiting: Gauge,
    rejected: IntCounterVec,
    max_concurrent: usize,
}

impl std::fmt::Debug for Admission {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Admission")
            .field("max_concurrent", &self.max_concurrent)
            .field("max_queued", &self.max_queued)
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

impl Admission {
    /// `max_concurrent` slots (at least 1), `max_queued` waiting places,
    /// metrics in `registry`.
    pub fn new(
        max_concurrent: usize,
        max_queued: usize,
        queue_timeout: Duration,
        registry: &Registry,
    ) -> Result<Self, GatewayError> {
        let max_concurrent = max_concurrent.max(1);
        Ok(Admission {
            slots: Arc::new(Semaphore::new(max_concurrent)),
            max_queued,
            queued: AtomicUsize::new(0),
            queue_timeout,
            in_flight: rngd_telemetry::gauge(
                registry,
                names::GATEWAY_IN_FLIGHT,
                "Requests being served (policy call to the end of the response)",
            )?,
            waiting: rngd_telemetry::gauge(
                registry,
                names::GATEWAY_QUEUED,
                "Requests waiting for a serving slot",
            )?,
            rejected: rngd_telemetry::counter_vec(
                registry,
                names::GATEWAY_OVERLOAD_REJECTIONS_TOTAL,
                "Requests answered 429 for load, by reason (queue_full, queue_timeout)",
                &["reason"],
            )?,
            max_concurrent,
        })
    }

    /// A slot now, or after a bounded wait, or a 429.
    pub async fn admit(&self) -> Result<Slot, ApiError> {
        let permit = match Arc::clone(&self.slots).try_acquire_owned() {
            Ok(p) => p,
            Err(_) => {
                // Take a waiting place, if one is free.
                let prev = self.queued.fetch_add(1, Ordering::AcqRel);
                if prev >= self.max_queued {
                    self.queued.fetch_sub(1, Ordering::AcqRel);
                    return Err(self.reject(Overload::QueueFull));
                }
                self.waiting.inc();
                let got = tokio::time::timeout(
                    self.queue_timeout,
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

    fn reject(&self, why: Overload) -> ApiError {
        self.rejected.with_label_values(&[why.as_str()]).inc();
        ApiError::Overloaded {
            reason: why,
            max_concurrent: self.max_concurrent,
            retry_after_s: self.queue_timeout.as_secs().clamp(1, 60),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn slots_then_a_bounded_queue_then_429() {
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
        match a.admit().await {
            Err(ApiError::Overloaded {
                reason: Overload::QueueFull,
                ..
            }) => {}
            other => panic!("{other:?}"),
        }
        // A slot frees: the waiter gets it.
        drop(s1);
        let _s3 = waiter
            .await
            .unwrap()
            .expect("the waiter gets the freed slot");
        // Nothing frees now: a new waiter times out.
        match a.admit().await {
            Err(ApiError::Overloaded {
                reason: Overload::QueueTimeout,
                ..
            }) => {}
            other => panic!("{other:?}"),
        }
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
    }
}
