//! Admission control (the concurrency limit and bounded waiting room, 429s):
//! the implementation both front doors share, `rngd_pool::admission`,
//! re-exported under its old path. Its refusal becomes
//! [`crate::error::ApiError::Overloaded`] in the error module.

pub use rngd_pool::admission::{
    Admission, AdmissionNames, AdmissionOptions, BodyReservation, Overload, Overloaded, Slot,
};
