//! The body readers both ends of the relay protocol use: exactly `n`
//! bytes into a buffer that grows with the bytes ([`read_body`]), into one
//! allocated up front with the CRC-32 computed as they arrive
//! ([`read_body_crc`]), or admitted chunk by chunk against a memory cap
//! ([`read_body_admitted`]).

use bytes::Bytes;
use tokio::io::{AsyncRead, AsyncReadExt};

use super::FIRST_BODY_CHUNK;

/// What [`read_body_admitted`] ended with.
pub(crate) enum Body {
    /// Every byte arrived (and its CRC-32, when asked for).
    Complete(Bytes, Option<u32>),
    /// `admit` refused a chunk: the body was read (`read` bytes) and
    /// discarded up to that point; the rest is still unread.
    Refused {
        /// Bytes consumed from the stream.
        read: usize,
    },
}

/// Reads exactly `n` bytes into a fresh buffer without zero-filling it
/// first; the buffer grows with the bytes (`n` need not be trusted).
pub(crate) async fn read_body<R: AsyncRead + Unpin>(
    rd: &mut R,
    n: usize,
) -> std::io::Result<Bytes> {
    match read_body_admitted(rd, n, false, |_| true).await? {
        Body::Complete(b, _) => Ok(b),
        Body::Refused { .. } => unreachable!("every chunk is admitted"),
    }
}

/// Reads exactly `n` bytes into one buffer of `n` bytes allocated up front
/// (no regrowth), and with `crc` computes the CRC-32 chunk by chunk as the
/// bytes arrive (while they are still in cache). Only for a size the
/// caller has checked (a pulled blob's, against its handle).
pub(crate) async fn read_body_crc<R: AsyncRead + Unpin>(
    rd: &mut R,
    n: usize,
    crc: bool,
) -> std::io::Result<(Bytes, Option<u32>)> {
    match read_into(rd, n, n, crc, |_| true).await? {
        Body::Complete(b, c) => Ok((b, c)),
        Body::Refused { .. } => unreachable!("every chunk is admitted"),
    }
}

/// Reads a body of `n` bytes, calling `admit(k)` for every `k` bytes that
/// arrive before keeping them (the relay counts them against its memory
/// cap there). The buffer grows with the bytes (from [`FIRST_BODY_CHUNK`],
/// doubling, never beyond `n`).
pub(crate) async fn read_body_admitted<R: AsyncRead + Unpin>(
    rd: &mut R,
    n: usize,
    crc: bool,
    admit: impl FnMut(usize) -> bool,
) -> std::io::Result<Body> {
    read_into(rd, n, FIRST_BODY_CHUNK, crc, admit).await
}

/// The body reader: a buffer of `first.min(n)` bytes, doubled whenever full.
async fn read_into<R: AsyncRead + Unpin>(
    rd: &mut R,
    n: usize,
    first: usize,
    crc: bool,
    mut admit: impl FnMut(usize) -> bool,
) -> std::io::Result<Body> {
    let mut buf: Vec<u8> = Vec::new();
    buf.reserve_exact(n.min(first));
    let mut hasher = crc.then(rngd_kv_wire::Crc32::new);
    while buf.len() < n {
        if buf.len() == buf.capacity() {
            let more = buf.len().max(1).min(n - buf.len());
            buf.reserve_exact(more);
        }
        let start = buf.len();
        let room = (buf.capacity() - start).min(n - start);
        let got = (&mut *rd).take(room as u64).read_buf(&mut buf).await?;
        if got == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        if !admit(got) {
            return Ok(Body::Refused { read: buf.len() });
        }
        if let Some(h) = hasher.as_mut() {
            h.update(&buf[start..]);
        }
    }
    Ok(Body::Complete(
        Bytes::from(buf),
        hasher.map(rngd_kv_wire::Crc32::finish),
    ))
}
