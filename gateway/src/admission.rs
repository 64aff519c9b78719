//! Admission control (the concurrency limit and bounded waiting room, 429s):
//! the implementation both front doors share, `rngd_pool::admission`,
//! re-exported under its old path; its refusal becomes
//! [`ApiError::Overloaded`] here.

pub use rngd_pool::admission::{
    Admission, AdmissionNames, AdmissionOptions, BodyReservation, Overload, Overloaded, Slot,
};

use crate::error::ApiError;

impl From<Overloaded> for ApiError {
    fn from(o: Overloaded) -> Self {
        ApiError::Overloaded {
            reason: o.reason,
            max_concurrent: o.max_concurrent,
            retry_after_s: o.retry_after_s,
        }
    }
}
