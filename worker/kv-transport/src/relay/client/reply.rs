//! Reading the relay's replies on the client side: one reply header (and an
//! ERR reply's message), and the [`KvError`] each ERR code stands for,
//! telling apart the errors that leave the connection usable from those
//! after which the relay closes it.

use std::io;
use std::time::Instant;

use rngd_kv_wire::WireError;
use tokio::io::{AsyncRead, AsyncReadExt};

use super::lost;
use crate::KvError;
use crate::frame::{ErrCode, HEADER_LEN, Header, Op, TRANSPORT as NAME, read_body};

/// Reads one reply header (an ERR's message too). The outer error is the
/// connection failing (or an ERR after which the relay closes it); the
/// inner one is an ERR reply that leaves the connection usable.
pub(super) async fn read_reply<R: AsyncRead + Unpin>(
    rd: &mut R,
    peer: &str,
    request_id: &str,
    waited_since: Instant,
) -> Result<Result<Header, KvError>, KvError> {
    let mut hb = [0u8; HEADER_LEN];
    rd.read_exact(&mut hb).await.map_err(|e| {
        if e.kind() == io::ErrorKind::UnexpectedEof {
            lost(peer, "the relay closed the connection", e)
        } else {
            lost(peer, "read failed", e)
        }
    })?;
    let h = Header::decode(&hb).map_err(|e| KvError::Protocol {
        transport: NAME,
        peer: peer.to_string(),
        detail: e.to_string(),
    })?;
    match h.op {
        Op::Ok => Ok(Ok(h)),
        Op::Err => {
            let body = read_body(rd, h.body_len.min(64 * 1024) as usize)
                .await
                .map_err(|e| lost(peer, "read failed", e))?;
            let msg = String::from_utf8_lossy(&body).into_owned();
            let code = ErrCode::from_u32(h.arg);
            let err = reply_error(code, h, msg, peer, request_id, waited_since);
            if code.closes() {
                Err(err)
            } else {
                Ok(Err(err))
            }
        }
        other => Err(KvError::Protocol {
            transport: NAME,
            peer: peer.to_string(),
            detail: format!("unexpected op {other:?} in a reply"),
        }),
    }
}

/// The error an ERR reply stands for.
pub(super) fn reply_error(
    code: ErrCode,
    h: Header,
    msg: String,
    peer: &str,
    request_id: &str,
    waited_since: Instant,
) -> KvError {
    let peer = peer.to_string();
    match code {
        ErrCode::NotFound => KvError::NotFound {
            transport: NAME,
            request_id: request_id.to_string(),
            waited: waited_since.elapsed(),
        },
        ErrCode::Crc => KvError::Crc {
            transport: NAME,
            request_id: request_id.to_string(),
            source: WireError::Crc {
                index: h.index as usize,
                expected: 0,
                actual: h.crc32,
            },
        },
        ErrCode::Capacity => KvError::Capacity {
            transport: NAME,
            detail: msg,
            source: None,
        },
        ErrCode::BadRequest | ErrCode::TooLarge => KvError::BadRequest {
            transport: NAME,
            detail: msg,
        },
        ErrCode::Restarted => KvError::ConnectionLost {
            transport: NAME,
            peer,
            detail: msg,
            source: None,
        },
        ErrCode::ShuttingDown => KvError::ConnectionLost {
            transport: NAME,
            peer,
            detail: msg.clone(),
            source: Some(io::Error::new(io::ErrorKind::ConnectionAborted, msg)),
        },
        ErrCode::Unauthorized => KvError::Unauthorized {
            transport: NAME,
            peer,
            detail: format!("the relay refused the handshake: {msg}"),
        },
        // The relay closed an idle pooled connection (or found us too slow):
        // a dead connection, worth one retry on a fresh one.
        ErrCode::Timeout => KvError::ConnectionLost {
            transport: NAME,
            peer,
            detail: format!("the relay closed the connection: {msg}"),
            source: Some(io::Error::new(io::ErrorKind::TimedOut, msg)),
        },
        ErrCode::Malformed => KvError::Protocol {
            transport: NAME,
            peer,
            detail: msg,
        },
    }
}
