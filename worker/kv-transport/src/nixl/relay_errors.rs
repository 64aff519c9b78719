//! Errors of the relay client (which names itself `tcp`) restated as
//! `nixl-ucx`'s: the descriptors of `nixl-ucx` go through the relay, and a
//! caller must see which transport failed.

use crate::KvError;

use super::NAME;

/// An error of the relay client (named `tcp`) as this transport's.
pub(super) fn rename(e: KvError, request_id: &str) -> KvError {
    let t = NAME;
    match e {
        KvError::NotFound { waited, .. } => KvError::NotFound {
            transport: t,
            request_id: request_id.to_string(),
            waited,
        },
        KvError::Crc { source, .. } => KvError::Crc {
            transport: t,
            request_id: request_id.to_string(),
            source,
        },
        KvError::Io {
            context, source, ..
        } => KvError::Io {
            transport: t,
            context: format!("KV relay: {context}"),
            source,
        },
        KvError::ConnectionLost {
            peer,
            detail,
            source,
            ..
        } => KvError::ConnectionLost {
            transport: t,
            peer,
            detail: format!("KV relay (descriptors): {detail}"),
            source,
        },
        KvError::Capacity { detail, source, .. } => KvError::Capacity {
            transport: t,
            detail: format!("KV relay: {detail}"),
            source,
        },
        KvError::BadRequest { detail, .. } => KvError::BadRequest {
            transport: t,
            detail,
        },
        KvError::Protocol { peer, detail, .. } => KvError::Protocol {
            transport: t,
            peer,
            detail,
        },
        KvError::Unauthorized { peer, detail, .. } => KvError::Unauthorized {
            transport: t,
            peer,
            detail,
        },
        KvError::Timeout {
            peer, op, after, ..
        } => KvError::Timeout {
            transport: t,
            peer,
            op,
            after,
        },
        other => other,
    }
}
