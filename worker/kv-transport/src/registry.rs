//! Transports selected by name.
//!
//! A new transport is added by appending its name to [`KNOWN`] and one arm
//! to [`by_name`]. `nixl-ucx` is there with the `nixl` feature. A name this
//! build knows but cannot run (`nixl`, see [`crate::nixl_route`]) is in
//! [`REFUSED`]: [`by_name`] and [`check_name`] refuse it with the reason, not
//! as an unknown name.

use std::sync::Arc;

use rngd_api::env;

use crate::{KvError, KvTransport, TransportConfig, shm::ShmTransport, tcp::TcpTransport};

/// Names of the transports this build can create.
#[cfg(feature = "nixl")]
pub const KNOWN: &[&str] = &["shm", "tcp", "nixl-ucx"];
/// Names of the transports this build can create.
#[cfg(not(feature = "nixl"))]
pub const KNOWN: &[&str] = &["shm", "tcp"];

/// Names this build knows but cannot create: [`by_name`] refuses each with
/// [`KvError::NotInThisBuild`], saying what it would need.
pub const REFUSED: &[&str] = &[crate::nixl_route::NAME];

/// Default transport when `AIRM_KV_TRANSPORT` is unset.
pub const DEFAULT: &str = "shm";

/// Creates the transport named by `AIRM_KV_TRANSPORT` (default `shm`),
/// configured from the environment ([`TransportConfig::from_env`]).
pub fn from_env() -> Result<Arc<dyn KvTransport>, KvError> {
    let name = env::var(env::AIRM_KV_TRANSPORT).unwrap_or_else(|| DEFAULT.to_string());
    by_name(&name, &TransportConfig::from_env()?)
}

/// Whether `name` is a transport name at all: one this build creates
/// ([`KNOWN`]) or one it knows and refuses ([`REFUSED`]).
pub fn is_known(name: &str) -> bool {
    let name = name.trim();
    KNOWN.contains(&name) || REFUSED.contains(&name)
}

/// Checks a transport name without creating anything (what `--check` and
/// `rngd-pd up` validate flags with): `Ok` for [`KNOWN`], the same refusal
/// as [`by_name`] for [`REFUSED`], [`KvError::UnknownTransport`] otherwise.
pub fn check_name(name: &str) -> Result<(), KvError> {
    match name.trim() {
        n if KNOWN.contains(&n) => Ok(()),
        crate::nixl_route::NAME => Err(crate::nixl_route::refusal(KNOWN)),
        other => Err(unknown(other)),
    }
}

fn unknown(name: &str) -> KvError {
    KvError::UnknownTransport {
        name: name.to_string(),
        known: KNOWN.join(", "),
    }
}

/// Creates the transport `name` with `cfg`. An unknown name is an error that
/// lists [`KNOWN`]; a [`REFUSED`] one is [`KvError::NotInThisBuild`].
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
        crate::nixl_route::NAME => Err(crate::nixl_route::refusal(KNOWN)),
        other => Err(unknown(other)),
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
    fn nixl_is_known_and_refused_plainly() {
        assert!(is_known("nixl") && is_known(" nixl "));
        assert!(!KNOWN.contains(&"nixl"), "this build cannot create it");
        for err in [
            by_name("nixl", &TransportConfig::default())
                .err()
                .expect("nixl must be refused"),
            check_name("nixl").expect_err("nixl must be refused"),
        ] {
            assert!(
                matches!(
                    err,
                    KvError::NotInThisBuild {
                        transport: "nixl",
                        ..
                    }
                ),
                "{err}"
            );
            let msg = err.to_string();
            assert!(
                msg.contains("HETERO_NPU")
                    && msg.contains("dmabuf")
                    && msg.contains("ATOM device memory")
                    && !msg.contains("unknown"),
                "{msg}"
            );
        }
    }

    #[test]
    fn check_name_accepts_known_and_rejects_unknown() {
        for name in KNOWN {
            check_name(name).unwrap();
            assert!(is_known(name));
        }
        assert!(!is_known("carrier-pigeon"));
        assert!(matches!(
            check_name("carrier-pigeon"),
            Err(KvError::UnknownTransport { .. })
        ));
    }

    #[test]
    fn tcp_needs_an_address() {
        let err = by_name("tcp", &TransportConfig::default())
            .err()
            .expect("tcp without address must fail");
        assert!(err.to_string().contains("AIRM_KV_TCP_ADDR"), "{err}");
    }
}
