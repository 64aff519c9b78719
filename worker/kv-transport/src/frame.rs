//! The relay protocol: length-prefixed binary frames over TCP.
//!
//! Every frame is a fixed 48-byte header (little-endian), then `key_len` bytes
//! of key (requests only), then `body_len` bytes of body:
//!
//! | offset | size | field                                               |
//! |-------:|-----:|-----------------------------------------------------|
//! | 0      | 4    | magic `RKVT`                                        |
//! | 4      | 1    | version (1)                                         |
//! | 5      | 1    | op ([`Op`])                                         |
//! | 6      | 1    | flags ([`FLAG_CRC`]: `crc32` is set and checked)     |
//! | 7      | 1    | reserved, 0                                         |
//! | 8      | 4    | seq: echoed in the response (pipelining)            |
//! | 12     | 2    | key_len (≤ [`crate::MAX_KEY_LEN`])                  |
//! | 14     | 2    | reserved, 0                                         |
//! | 16     | 4    | blob index                                          |
//! | 20     | 4    | CRC-32 of the body (PUT, GET reply)                 |
//! | 24     | 4    | arg: GET wait in ms; error code in an ERR reply     |
//! | 28     | 4    | reserved, 0                                         |
//! | 32     | 8    | body_len                                            |
//! | 40     | 8    | epoch: requests: expected relay epoch (0 = any); replies: the relay's |
//!
//! Requests are answered in any order (match them by `seq`); an ERR reply's
//! body is a UTF-8 message; a STATS reply's body is JSON [`RelayStats`].
//!
//! Both ends of the protocol build on this module and on nothing of each
//! other: the relay server ([`crate::relay`]) and its client
//! ([`crate::tcp`]). Besides the header it holds what they share: the
//! [`RelayStats`] body, the socket buffer size and the body readers.

use bytes::{Bytes, BytesMut};
use serde::{Deserialize, Serialize};
use tokio::io::AsyncReadExt;

/// The transport this protocol belongs to; errors of both ends name it.
pub const TRANSPORT: &str = "tcp";
/// Buffer size for frame headers and small bodies. Small on purpose: a body
/// at least this large bypasses the buffer and goes straight between the
/// socket and the blob's own memory, so blobs are not copied twice.
pub(crate) const IO_BUF: usize = 8 * 1024;

/// Frame magic.
pub const MAGIC: [u8; 4] = *b"RKVT";
/// Protocol version.
pub const VERSION: u8 = 1;
/// Bytes in a header.
pub const HEADER_LEN: usize = 48;
/// Flag: the frame carries a CRC-32 that the receiver checks.
pub const FLAG_CRC: u8 = 1;

/// Frame operations.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Op {
    /// Store blob `index` of `key` (body = blob).
    Put = 1,
    /// Fetch blob `index` of `key`, waiting up to `arg` ms for it to arrive.
    Get = 2,
    /// Drop every blob of `key`.
    Del = 3,
    /// Relay counters (reply body = JSON [`RelayStats`]).
    Stats = 4,
    /// Success reply (GET: body = blob).
    Ok = 0x81,
    /// Error reply (`arg` = [`ErrCode`], body = message).
    Err = 0x82,
}

impl Op {
    fn from_u8(v: u8) -> Option<Op> {
        Some(match v {
            1 => Op::Put,
            2 => Op::Get,
            3 => Op::Del,
            4 => Op::Stats,
            0x81 => Op::Ok,
            0x82 => Op::Err,
            _ => return None,
        })
    }
}

/// Error codes in an ERR reply.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum ErrCode {
    /// The blob did not arrive within the wait.
    NotFound = 1,
    /// The body does not match the CRC-32 in the header (`crc32` = what the relay computed).
    Crc = 2,
    /// The relay's memory cap is reached.
    Capacity = 3,
    /// Bad key or other unusable request.
    BadRequest = 4,
    /// The request names an epoch of an earlier relay process: its blobs are gone.
    Restarted = 5,
    /// The body exceeds the relay's maximum frame; the connection is closed.
    TooLarge = 6,
    /// Not a frame of this protocol; the connection is closed.
    Malformed = 7,
    /// The relay is shutting down.
    ShuttingDown = 8,
}

impl ErrCode {
    /// Decodes a code; unknown codes become `Malformed`.
    pub fn from_u32(v: u32) -> ErrCode {
        match v {
            1 => ErrCode::NotFound,
            2 => ErrCode::Crc,
            3 => ErrCode::Capacity,
            4 => ErrCode::BadRequest,
            5 => ErrCode::Restarted,
            6 => ErrCode::TooLarge,
            8 => ErrCode::ShuttingDown,
            _ => ErrCode::Malformed,
        }
    }
}

/// A decoded header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    /// Operation.
    pub op: Op,
    /// Flags.
    pub flags: u8,
    /// Request sequence number, echoed in the reply.
    pub seq: u32,
    /// Length of the key that follows the header.
    pub key_len: u16,
    /// Blob index.
    pub index: u32,
    /// CRC-32 of the body.
    pub crc32: u32,
    /// GET wait (ms) or ERR code.
    pub arg: u32,
    /// Length of the body.
    pub body_len: u64,
    /// Relay epoch.
    pub epoch: u64,
}

/// Why a header could not be decoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    /// The first four bytes are not `RKVT`.
    #[error("bad magic {0:02x?}")]
    BadMagic([u8; 4]),
    /// A version this build does not speak.
    #[error("unsupported protocol version {0}")]
    BadVersion(u8),
    /// An unknown operation.
    #[error("unknown op {0:#x}")]
    BadOp(u8),
}

impl Header {
    /// A request or reply header with everything else zero.
    pub fn new(op: Op, seq: u32) -> Header {
        Header {
            op,
            flags: 0,
            seq,
            key_len: 0,
            index: 0,
            crc32: 0,
            arg: 0,
            body_len: 0,
            epoch: 0,
        }
    }

    /// Encodes the header.
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0..4].copy_from_slice(&MAGIC);
        b[4] = VERSION;
        b[5] = self.op as u8;
        b[6] = self.flags;
        b[8..12].copy_from_slice(&self.seq.to_le_bytes());
        b[12..14].copy_from_slice(&self.key_len.to_le_bytes());
        b[16..20].copy_from_slice(&self.index.to_le_bytes());
        b[20..24].copy_from_slice(&self.crc32.to_le_bytes());
        b[24..28].copy_from_slice(&self.arg.to_le_bytes());
        b[32..40].copy_from_slice(&self.body_len.to_le_bytes());
        b[40..48].copy_from_slice(&self.epoch.to_le_bytes());
        b
    }

    /// Decodes a header.
    pub fn decode(b: &[u8; HEADER_LEN]) -> Result<Header, FrameError> {
        let magic: [u8; 4] = b[0..4].try_into().expect("4 bytes");
        if magic != MAGIC {
            return Err(FrameError::BadMagic(magic));
        }
        if b[4] != VERSION {
            return Err(FrameError::BadVersion(b[4]));
        }
        let op = Op::from_u8(b[5]).ok_or(FrameError::BadOp(b[5]))?;
        let u32_at = |o: usize| u32::from_le_bytes(b[o..o + 4].try_into().expect("4 bytes"));
        let u64_at = |o: usize| u64::from_le_bytes(b[o..o + 8].try_into().expect("8 bytes"));
        Ok(Header {
            op,
            flags: b[6],
            seq: u32_at(8),
            key_len: u16::from_le_bytes([b[12], b[13]]),
            index: u32_at(16),
            crc32: u32_at(20),
            arg: u32_at(24),
            body_len: u64_at(32),
            epoch: u64_at(40),
        })
    }
}

/// Relay counters (the STATS reply).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RelayStats {
    /// This relay process's epoch.
    pub epoch: u64,
    /// Requests with at least one blob held.
    pub keys: usize,
    /// Blobs held.
    pub blobs: usize,
    /// Bytes held (and reserved by PUTs being received).
    pub bytes: u64,
    /// GETs waiting for a blob.
    pub waiters: usize,
    /// Open client connections.
    pub connections: usize,
    /// PUT bodies being received right now.
    pub puts_in_progress: usize,
    /// Requests expired by the TTL so far.
    pub expired: u64,
}

/// Reads exactly `n` bytes into a fresh buffer without zero-filling it first.
pub(crate) async fn read_body<R: tokio::io::AsyncRead + Unpin>(
    rd: &mut R,
    n: usize,
) -> std::io::Result<Bytes> {
    Ok(read_body_crc(rd, n, false).await?.0)
}

/// Like [`read_body`], and with `crc` computes the CRC-32 chunk by chunk as
/// the bytes arrive (while they are still in cache).
pub(crate) async fn read_body_crc<R: tokio::io::AsyncRead + Unpin>(
    rd: &mut R,
    n: usize,
    crc: bool,
) -> std::io::Result<(Bytes, Option<u32>)> {
    let mut buf = BytesMut::with_capacity(n);
    let mut hasher = crc.then(rngd_kv_wire::Crc32::new);
    while buf.len() < n {
        let start = buf.len();
        let want = n - start;
        let got = (&mut *rd).take(want as u64).read_buf(&mut buf).await?;
        if got == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        if let Some(h) = hasher.as_mut() {
            h.update(&buf[start..]);
        }
    }
    Ok((buf.freeze(), hasher.map(rngd_kv_wire::Crc32::finish)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_round_trips() {
        let h = Header {
            op: Op::Put,
            flags: FLAG_CRC,
            seq: 7,
            key_len: 12,
            index: 63,
            crc32: 0xdead_beef,
            arg: 1500,
            body_len: 1 << 20,
            epoch: 0x0123_4567_89ab_cdef,
        };
        assert_eq!(Header::decode(&h.encode()), Ok(h));
        let mut bad = h.encode();
        bad[0] = b'X';
        assert!(matches!(Header::decode(&bad), Err(FrameError::BadMagic(_))));
        let mut bad = h.encode();
        bad[4] = 9;
        assert_eq!(Header::decode(&bad), Err(FrameError::BadVersion(9)));
        let mut bad = h.encode();
        bad[5] = 0x42;
        assert_eq!(Header::decode(&bad), Err(FrameError::BadOp(0x42)));
    }
}
