//! The `nixl` transport (RNGD → ATOM over NIXL's HETERO_NPU backend): its
//! name, its route table as a plan step, and the plain refusal this build
//! gives when a worker asks for it.
//!
//! What runs here: [`plan`], which decides for a (source, destination) pair
//! of memory kinds whether the transport has a route and what it would
//! register, or refuses with the reason. What does not: moving bytes. That
//! needs RNGD device memory exported as a dmabuf, ATOM device memory
//! registered with NIXL and NIXL's HETERO_NPU backend plugin; this build has
//! no NPU runtime and its NIXL (the PyPI wheel) ships no HETERO_NPU backend,
//! so the registry answers `nixl` with [`refusal`].

use std::fmt;

use crate::KvError;

/// Registry name of the transport.
pub const NAME: &str = "nixl";

/// Where a buffer of the route lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DeviceKind {
    /// FuriosaAI RNGD device memory (the prefill card).
    Rngd,
    /// Rebellions ATOM device memory (the decode card).
    Atom,
    /// Host DRAM.
    Host,
    /// A dmabuf: RNGD device memory exported as a dmabuf file descriptor,
    /// which the importing side registers with NIXL.
    Dmabuf,
}

impl DeviceKind {
    /// Every kind, in the order of the route table.
    pub const ALL: [DeviceKind; 4] = [
        DeviceKind::Rngd,
        DeviceKind::Atom,
        DeviceKind::Host,
        DeviceKind::Dmabuf,
    ];

    /// Lower-case name (`rngd`, `atom`, `host`, `dmabuf`).
    pub fn as_str(self) -> &'static str {
        match self {
            DeviceKind::Rngd => "rngd",
            DeviceKind::Atom => "atom",
            DeviceKind::Host => "host",
            DeviceKind::Dmabuf => "dmabuf",
        }
    }
}

impl fmt::Display for DeviceKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// An accepted route: which pair, and what each end registers with NIXL.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Route {
    /// Where the bytes are read from.
    pub src: DeviceKind,
    /// Where they are written to.
    pub dst: DeviceKind,
    /// The source buffer as NIXL would see it.
    pub src_buffer: &'static str,
    /// The destination buffer as NIXL would see it.
    pub dst_buffer: &'static str,
}

/// Why a pair has no route. Each is the cause of a [`RouteError`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    /// rngd → rngd.
    #[error(
        "both ends are RNGD cards; HETERO_NPU pairs an RNGD prefill card with an ATOM decode card, and an RNGD-to-RNGD copy is not a prefill-to-decode handoff"
    )]
    RngdToRngd,
    /// rngd → atom.
    #[error(
        "no direct RNGD-to-ATOM device path: the bytes leave RNGD as a dmabuf export (rngd→dmabuf) or through host memory (rngd→host)"
    )]
    RngdToAtom,
    /// atom → anything.
    #[error(
        "ATOM is the decode side: it only receives KV caches, so no route starts from ATOM device memory"
    )]
    FromAtom,
    /// host → host.
    #[error(
        "both ends are host memory: that is the shm, tcp and nixl-ucx transports' job, not HETERO_NPU's"
    )]
    HostToHost,
    /// host → atom and host → dmabuf.
    #[error("host memory is loaded only onto RNGD (host→rngd) by this transport")]
    HostToOther,
    /// dmabuf → anything.
    #[error(
        "a dmabuf is the export of RNGD memory a route writes through, not a source: plan from rngd"
    )]
    FromDmabuf,
}

/// A pair refused at plan.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("transport `nixl`: route {src}→{dst} refused at plan")]
pub struct RouteError {
    /// Source asked for.
    pub src: DeviceKind,
    /// Destination asked for.
    pub dst: DeviceKind,
    /// Why.
    #[source]
    pub reason: Refusal,
}

/// What the RNGD side registers: its device memory exported as a dmabuf.
const RNGD_DMABUF: &str = "RNGD device memory exported as a dmabuf, registered with NIXL";
/// What a host end registers.
const HOST_DRAM: &str = "host DRAM registered with NIXL";

/// The plan step: the route from `src` to `dst`, or the reason there is none.
///
/// Accepted: rngd→dmabuf, rngd→host, host→rngd. Refused: rngd→rngd,
/// rngd→atom, atom→anything, host→host, host→atom, host→dmabuf,
/// dmabuf→anything. Planning moves no bytes and touches no device.
pub fn plan(src: DeviceKind, dst: DeviceKind) -> Result<Route, RouteError> {
    use DeviceKind::*;
    let route = |src_buffer, dst_buffer| {
        Ok(Route {
            src,
            dst,
            src_buffer,
            dst_buffer,
        })
    };
    let refuse = |reason| Err(RouteError { src, dst, reason });
    match (src, dst) {
        (Rngd, Dmabuf) => route(
            RNGD_DMABUF,
            "the dmabuf imported by the decode side (ATOM device memory registered with NIXL)",
        ),
        (Rngd, Host) => route(RNGD_DMABUF, HOST_DRAM),
        (Host, Rngd) => route(HOST_DRAM, RNGD_DMABUF),
        (Rngd, Rngd) => refuse(Refusal::RngdToRngd),
        (Rngd, Atom) => refuse(Refusal::RngdToAtom),
        (Atom, _) => refuse(Refusal::FromAtom),
        (Host, Host) => refuse(Refusal::HostToHost),
        (Host, Atom | Dmabuf) => refuse(Refusal::HostToOther),
        (Dmabuf, _) => refuse(Refusal::FromDmabuf),
    }
}

/// What a worker asked to use `nixl` gets, at startup or per request: the
/// name is known, but this build cannot move bytes over it; `runnable` are
/// the transports it can run (the registry's list).
pub fn refusal(runnable: &[&str]) -> KvError {
    KvError::NotInThisBuild {
        transport: NAME,
        detail: format!(
            "it is RNGD → ATOM over NIXL's HETERO_NPU backend and needs that backend's plugin, \
             RNGD device memory exported as a dmabuf and ATOM device memory registered with NIXL; \
             this build has no NPU runtime and its NIXL (the PyPI wheel) ships no HETERO_NPU \
             backend. Transports this build can run: {}",
            runnable.join(", ")
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::DeviceKind::*;
    use super::*;

    #[test]
    fn accepted_routes() {
        for (src, dst) in [(Rngd, Dmabuf), (Rngd, Host), (Host, Rngd)] {
            let r = plan(src, dst).unwrap_or_else(|e| panic!("{src}→{dst}: {e}"));
            assert_eq!((r.src, r.dst), (src, dst));
            assert!(!r.src_buffer.is_empty() && !r.dst_buffer.is_empty());
        }
        assert!(plan(Rngd, Dmabuf).unwrap().src_buffer.contains("dmabuf"));
        assert!(plan(Rngd, Host).unwrap().dst_buffer.contains("host"));
        assert!(plan(Host, Rngd).unwrap().src_buffer.contains("host"));
    }

    #[test]
    fn refused_routes_name_their_reason() {
        let rows = [
            (Rngd, Rngd, Refusal::RngdToRngd, "RNGD"),
            (Rngd, Atom, Refusal::RngdToAtom, "dmabuf"),
            (Atom, Rngd, Refusal::FromAtom, "decode side"),
            (Atom, Atom, Refusal::FromAtom, "decode side"),
            (Atom, Host, Refusal::FromAtom, "decode side"),
            (Atom, Dmabuf, Refusal::FromAtom, "decode side"),
            (Host, Host, Refusal::HostToHost, "host memory"),
            (Host, Atom, Refusal::HostToOther, "host→rngd"),
            (Host, Dmabuf, Refusal::HostToOther, "host→rngd"),
            (Dmabuf, Rngd, Refusal::FromDmabuf, "not a source"),
            (Dmabuf, Atom, Refusal::FromDmabuf, "not a source"),
            (Dmabuf, Host, Refusal::FromDmabuf, "not a source"),
            (Dmabuf, Dmabuf, Refusal::FromDmabuf, "not a source"),
        ];
        for (src, dst, reason, says) in rows {
            let err = plan(src, dst).expect_err(&format!("{src}→{dst} must be refused"));
            assert_eq!(err, RouteError { src, dst, reason });
            let msg = err.to_string();
            assert!(msg.contains(&format!("{src}→{dst}")), "{msg}");
            let cause = std::error::Error::source(&err)
                .expect("a reason")
                .to_string();
            assert!(cause.contains(says), "{src}→{dst}: {cause}");
        }
    }

    #[test]
    fn the_table_covers_every_pair() {
        let mut accepted = Vec::new();
        for src in DeviceKind::ALL {
            for dst in DeviceKind::ALL {
                if plan(src, dst).is_ok() {
                    accepted.push((src, dst));
                }
            }
        }
        assert_eq!(accepted, [(Rngd, Host), (Rngd, Dmabuf), (Host, Rngd)]);
    }

    #[test]
    fn refusal_names_the_backend_and_the_buffers() {
        let err = refusal(&["shm", "tcp"]);
        assert_eq!(err.transport(), Some(NAME));
        let msg = err.to_string();
        for needed in [
            "Transports this build can run: shm, tcp",
            "`nixl`",
            "HETERO_NPU",
            "RNGD device memory exported as a dmabuf",
            "ATOM device memory registered with NIXL",
            "cannot move bytes",
        ] {
            assert!(msg.contains(needed), "missing {needed:?}: {msg}");
        }
        assert!(!msg.contains("unknown"), "{msg}");
    }
}
