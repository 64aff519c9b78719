//! Transports selected by name.
//!
//! A new transport is added by appending its name to [`KNOWN`] and one arm
//! to [`by_name`]. `nixl-ucx` is there with the `nixl` feature.

use std::sync::Arc;

use rngd_api::env;

use crate::{KvError, KvTransport, TransportConfig, shm::ShmTransport, tcp::TcpTransport};

/// Names of the transports this build can create.
#[cfg(feature = "nixl")]
pub const KNOWN: &[&str] = &["shm", "tcp", "nixl-ucx"];
/// Names of the transports this build can create.
#[cfg(not(feature = "nixl"))]
pub const KNOWN: &[&str] = &["shm", "tcp"];

/// Default transport when `AIRM_KV_TRANSPORT` is unset.
pub const DEFAULT: &str = "shm";

/// Creates the transport named by `AIRM_KV_TRANSPORT` (default `shm`),
/// configured from the environment ([`TransportConfig::from_env`]).
pub fn from_env() -> Result<Arc<dyn KvTransport>, KvError> {
    let name = env::var(env::AIRM_KV_TRANSPORT).unwrap_or_else(|| DEFAULT.to_string());
    by_name(&name, &TransportConfig::from_env()?)
}

/// Creates the transport `name` with `cfg`. An unknown name is an error that
/// lists [`KNOWN`].
///
/// `shm` starts its TTL sweeper when called inside a tokio runtime. Each
/// call makes a new transport with its own connection pool (`tcp`) and
/// sweeper (`shm`): create one per process and share the `Arc`.
pub fn by_name(name: &str, cfg: &TransportConfig) -> Result<Arc<dyn KvTransport>, KvError> {
    match name.trim() {
        "shm" => Ok(Arc::new(ShmTransport::new(cfg)?)),
        "tcp" => Ok(Arc::new(TcpTransport::new(cfg)?)),
        #[cfg(feature = "nixl")]
        "nixl-ucx" => Ok(Arc::new(crate::nixl::NixlUcxTransport::new(cfg)?)),
        other => Err(KvError::UnknownTransport {
            name: other.to_string(),
            known: KNOWN.join(", "),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_name_lists_known_ones() {
        let err = by_name("carrier-pigeon", &TransportConfig::default())
            .err()
            .expect("unknown name must fail");
        let msg = err.to_string();
        assert!(
            msg.contains("carrier-pigeon") && msg.contains("shm, tcp"),
            "{msg}"
        );
    }

    #[test]
    fn tcp_needs_an_address() {
        let err = by_name("tcp", &TransportConfig::default())
            .err()
            .expect("tcp without address must fail");
        assert!(err.to_string().contains("AIRM_KV_TCP_ADDR"), "{err}");
    }
}
