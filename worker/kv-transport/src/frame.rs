//! The relay protocol: length-prefixed binary frames over TCP, the
//! authentication handshake that opens every connection, and the frame
//! parser both ends use.
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
//! | 24     | 4    | arg: GET wait in ms; error code in an ERR reply; HELLO flags |
//! | 28     | 4    | reserved, 0                                         |
//! | 32     | 8    | body_len                                            |
//! | 40     | 8    | epoch: requests: expected relay epoch (0 = any); replies: the relay's |
//!
//! Requests are answered in any order (match them by `seq`); an ERR reply's
//! body is a UTF-8 message; a STATS reply's body is JSON [`RelayStats`].
//!
//! **Handshake.** Before any request the relay and the client prove to each
//! other that they hold the same [`Secret`]:
//!
//! 1. relay → client: HELLO, body = a random 32-byte relay nonce `Nr`; `arg`
//!    bit 0 ([`HELLO_AUTH`]) says the relay checks the secret.
//! 2. client → relay: AUTH, body = a random 32-byte client nonce `Nc`, then
//!    `HMAC-SHA256(secret, Nr ‖ Nc ‖ "rngd-pd relay v1 client")` (zeros
//!    without a secret).
//! 3. relay → client: OK, body = `HMAC-SHA256(secret, Nr ‖ Nc ‖ "rngd-pd
//!    relay v1 server")` (empty from a relay without a secret); or ERR
//!    [`ErrCode::Unauthorized`] with a fixed message, and the relay closes
//!    the connection.
//!
//! The relay compares in constant time; the client refuses a relay that does
//! not prove the secret (or proves none) before it sends any request. The
//! nonces make every exchange unique (no replay), the direction strings keep
//! one side's proof from being reflected as the other's. The handshake
//! authenticates the ends; it does not encrypt the frames that follow.
//!
//! Both ends of the protocol build on this module and on nothing of each
//! other: the relay server ([`crate::relay`]) and its client
//! ([`crate::tcp`]). Besides the header it holds what they share: the
//! [`RelayStats`] body, the socket buffer size, the secret and its MACs
//! (in `frame/auth.rs`, re-exported here), and the readers
//! ([`read_request_head`], [`read_frame`], the body readers of
//! `frame/body.rs`).

use std::collections::BTreeMap;

use bytes::Bytes;
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncRead, AsyncReadExt};

use crate::MAX_KEY_LEN;

mod auth;
mod body;

pub use auth::{AUTH_BODY_LEN, HELLO_AUTH, MAC_LEN, NONCE_LEN, Secret, nonce};
pub(crate) use body::{Body, read_body, read_body_admitted, read_body_crc};

/// The transport this protocol belongs to; errors of both ends name it.
pub const TRANSPORT: &str = "tcp";
/// Buffer size for frame headers and small bodies. Small on purpose: a body
/// at least this large bypasses the buffer and goes straight between the
/// socket and the blob's own memory, so blobs are not copied twice.
pub(crate) const IO_BUF: usize = 8 * 1024;
/// A body buffer starts at most this large and doubles as bytes arrive, so
/// a header that announces a large body costs memory only once the body's
/// bytes are actually there.
pub const FIRST_BODY_CHUNK: usize = 64 * 1024;

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
    /// Handshake, relay → client: body = the relay nonce, `arg` = [`HELLO_AUTH`] flags.
    Hello = 5,
    /// Handshake, client → relay: body = client nonce ‖ client MAC ([`AUTH_BODY_LEN`] bytes).
    Auth = 6,
    /// Success reply (GET: body = blob; AUTH: body = the relay's MAC).
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
            5 => Op::Hello,
            6 => Op::Auth,
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
    /// A relay cap is reached (memory, entries, waiting GETs, connections).
    Capacity = 3,
    /// Unusable request that leaves the connection usable.
    BadRequest = 4,
    /// The request names an epoch of an earlier relay process: its blobs are gone.
    Restarted = 5,
    /// The body exceeds the relay's maximum frame; the connection is closed.
    TooLarge = 6,
    /// Not a frame of this protocol (or a key that fails validation); the
    /// connection is closed.
    Malformed = 7,
    /// The relay is shutting down.
    ShuttingDown = 8,
    /// The handshake failed (wrong, missing or late answer); the connection is closed.
    Unauthorized = 9,
    /// A frame did not arrive within the relay's read deadline, or the
    /// connection was idle too long; the connection is closed.
    Timeout = 10,
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
            9 => ErrCode::Unauthorized,
            10 => ErrCode::Timeout,
            _ => ErrCode::Malformed,
        }
    }

    /// Whether the relay closes the connection after an ERR with this code.
    pub fn closes(self) -> bool {
        matches!(
            self,
            ErrCode::TooLarge
                | ErrCode::Malformed
                | ErrCode::ShuttingDown
                | ErrCode::Unauthorized
                | ErrCode::Timeout
        )
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
    /// GET wait (ms), ERR code or HELLO flags.
    pub arg: u32,
    /// Length of the body.
    pub body_len: u64,
    /// Relay epoch.
    pub epoch: u64,
}

/// Why a frame could not be read. Every one of these ends the connection:
/// the reader never tries to resynchronise on a broken stream.
#[derive(Debug, thiserror::Error)]
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
    /// A reply op (OK, ERR, HELLO) where a request belongs.
    #[error("{0:?} is not a request")]
    NotARequest(Op),
    /// A key longer than [`crate::MAX_KEY_LEN`].
    #[error("key of {0} bytes exceeds {MAX_KEY_LEN}")]
    KeyTooLong(u16),
    /// A key that is not what [`crate::sanitize_key`] makes (empty for an op
    /// that needs one, present for one that takes none, or bytes outside
    /// `[A-Za-z0-9._~-]`, or a leading `.`).
    #[error("invalid key for {op:?}: {reason}")]
    BadKey {
        /// The frame's op.
        op: Op,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// A body larger than the reader accepts for this op.
    #[error("frame body of {len} bytes exceeds the maximum of {max} for {op:?}")]
    TooLarge {
        /// The frame's op.
        op: Op,
        /// `body_len` of the header.
        len: u64,
        /// The limit.
        max: u64,
    },
    /// The stream ended inside a frame.
    #[error("the connection closed inside a frame")]
    Truncated,
    /// Reading failed.
    #[error("read failed")]
    Io(#[source] std::io::Error),
}

impl FrameError {
    /// The ERR code a relay answers this error with (before closing).
    pub fn code(&self) -> ErrCode {
        match self {
            FrameError::TooLarge { max, .. } if *max > 0 => ErrCode::TooLarge,
            _ => ErrCode::Malformed,
        }
    }
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

    /// Decodes a header (magic, version and op checked; nothing else).
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

/// Whether `op` is a request that names a key (PUT, GET, DEL).
fn needs_key(op: Op) -> bool {
    matches!(op, Op::Put | Op::Get | Op::Del)
}

/// Checks a request key against what [`crate::sanitize_key`] produces.
pub fn validate_key(op: Op, key: &[u8]) -> Result<(), FrameError> {
    let bad = |reason| Err(FrameError::BadKey { op, reason });
    if !needs_key(op) {
        return if key.is_empty() {
            Ok(())
        } else {
            bad("this op takes no key")
        };
    }
    if key.is_empty() {
        return bad("empty key");
    }
    if key.len() > MAX_KEY_LEN {
        return bad("too long");
    }
    if key[0] == b'.' {
        return bad("leading `.`");
    }
    if !key
        .iter()
        .all(|&c| c.is_ascii_alphanumeric() || matches!(c, b'.' | b'_' | b'-' | b'~'))
    {
        return bad("bytes outside [A-Za-z0-9._~-]");
    }
    Ok(())
}

/// The largest body a request with `op` may carry, given the relay's
/// maximum frame: PUT up to `max_frame`, AUTH exactly its fixed size, the
/// others none.
pub fn max_request_body(op: Op, max_frame: u64) -> u64 {
    match op {
        Op::Put => max_frame,
        Op::Auth => AUTH_BODY_LEN as u64,
        _ => 0,
    }
}

/// Reads one request's header and key and validates them: magic, version,
/// op (a request's), key length and characters, and `body_len` against
/// [`max_request_body`]. The body is left unread. `Ok(None)`: the stream
/// ended cleanly before the frame's first byte.
///
/// Nothing is allocated beyond the key (at most [`crate::MAX_KEY_LEN`] bytes).
pub async fn read_request_head<R: AsyncRead + Unpin>(
    rd: &mut R,
    max_frame: u64,
) -> Result<Option<(Header, String)>, FrameError> {
    let mut hb = [0u8; HEADER_LEN];
    let mut got = 0;
    while got < HEADER_LEN {
        match rd.read(&mut hb[got..]).await {
            Ok(0) if got == 0 => return Ok(None),
            Ok(0) => return Err(FrameError::Truncated),
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(FrameError::Io(e)),
        }
    }
    let h = Header::decode(&hb)?;
    if matches!(h.op, Op::Ok | Op::Err | Op::Hello) {
        return Err(FrameError::NotARequest(h.op));
    }
    if h.key_len as usize > MAX_KEY_LEN {
        return Err(FrameError::KeyTooLong(h.key_len));
    }
    let max = max_request_body(h.op, max_frame);
    if h.body_len > max || (h.op == Op::Auth && h.body_len != max) {
        return Err(FrameError::TooLarge {
            op: h.op,
            len: h.body_len,
            max,
        });
    }
    let mut kb = [0u8; MAX_KEY_LEN];
    let kb = &mut kb[..h.key_len as usize];
    rd.read_exact(kb).await.map_err(eof_is_truncated)?;
    validate_key(h.op, kb)?;
    // Validated as ASCII above.
    let key = String::from_utf8(kb.to_vec()).expect("validated ASCII");
    Ok(Some((h, key)))
}

/// One complete request frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frame {
    /// The header.
    pub header: Header,
    /// The key (empty for STATS and AUTH).
    pub key: String,
    /// The body.
    pub body: Bytes,
}

/// Reads one whole request frame ([`read_request_head`], then the body).
/// `Ok(None)`: clean end of stream. The body buffer grows as its bytes
/// arrive (from [`FIRST_BODY_CHUNK`], doubling, never beyond `body_len`), so
/// a header announcing a large body allocates little until the bytes come.
pub async fn read_frame<R: AsyncRead + Unpin>(
    rd: &mut R,
    max_frame: u64,
) -> Result<Option<Frame>, FrameError> {
    let Some((header, key)) = read_request_head(rd, max_frame).await? else {
        return Ok(None);
    };
    let body = match read_body_admitted(rd, header.body_len as usize, false, |_| true).await {
        Ok(Body::Complete(b, _)) => b,
        Ok(Body::Refused { .. }) => unreachable!("every chunk is admitted"),
        Err(e) => return Err(eof_is_truncated(e)),
    };
    Ok(Some(Frame { header, key, body }))
}

fn eof_is_truncated(e: std::io::Error) -> FrameError {
    if e.kind() == std::io::ErrorKind::UnexpectedEof {
        FrameError::Truncated
    } else {
        FrameError::Io(e)
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
    /// Bytes counted against the memory cap: blobs held, bytes of PUT
    /// bodies received so far, and a fixed overhead per blob.
    pub bytes: u64,
    /// GETs waiting for a blob.
    pub waiters: usize,
    /// Open authenticated connections (the ones still in the handshake are
    /// `handshakes`).
    pub connections: usize,
    /// Sockets that have not passed the handshake yet (under the relay's
    /// pre-auth cap). Absent from older relays.
    #[serde(default)]
    pub handshakes: usize,
    /// Sockets that failed the handshake so far, by reason (`refused`,
    /// `timeout`, `evicted`): the counter
    /// `rngd_pd_relay_handshake_failures_total`. Absent from older relays.
    #[serde(default)]
    pub handshake_failures: BTreeMap<String, u64>,
    /// Warnings of failed handshakes and accepts the relay's log rate limit
    /// held back so far (counted in `handshake_failures` and summarised in
    /// the next warning). Absent from older relays.
    #[serde(default)]
    pub warnings_held_back: u64,
    /// PUT bodies being received right now.
    pub puts_in_progress: usize,
    /// Requests expired by the TTL so far.
    pub expired: u64,
    /// Bytes of blobs older than the claim window that nobody deleted (no
    /// decode pulled and released them), as of the last TTL sweep: the
    /// gauge `rngd_pd_relay_stranded_bytes`. Absent from older relays.
    #[serde(default)]
    pub stranded_bytes: u64,
    /// Refusals and forced closes so far, by reason (a labelled counter;
    /// reasons in `docs/kv-wire.md`). Absent from older relays.
    #[serde(default)]
    pub rejections: BTreeMap<String, u64>,
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
        assert_eq!(Header::decode(&h.encode()).unwrap(), h);
        let mut bad = h.encode();
        bad[0] = b'X';
        assert!(matches!(Header::decode(&bad), Err(FrameError::BadMagic(_))));
        let mut bad = h.encode();
        bad[4] = 9;
        assert!(matches!(
            Header::decode(&bad),
            Err(FrameError::BadVersion(9))
        ));
        let mut bad = h.encode();
        bad[5] = 0x42;
        assert!(matches!(Header::decode(&bad), Err(FrameError::BadOp(0x42))));
    }

    #[test]
    fn keys_are_validated_like_sanitize_key_makes_them() {
        for id in ["req-1", "a/b", "../../x", &"y".repeat(500), "ü"] {
            let key = crate::sanitize_key("tcp", id).unwrap();
            validate_key(Op::Put, key.as_bytes()).unwrap();
        }
        for bad in [&b""[..], b".x", b"a/b", b"a b", b"\xff"] {
            assert!(validate_key(Op::Get, bad).is_err(), "{bad:?}");
        }
        assert!(validate_key(Op::Stats, b"").is_ok());
        assert!(validate_key(Op::Stats, b"k").is_err());
    }
}
