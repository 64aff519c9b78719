//! What a `nixl-ucx` push publishes in the relay (the [`Descriptor`]: agent,
//! metadata, address, length, slot, CRC-32 per blob) and what its handle's
//! `location` says about it (the relay's `host:port#epoch`, and the
//! descriptor's length, CRC-32 and SHA-256). The handle is signed by the
//! prefill worker, so a descriptor whose SHA-256 is not the one in the
//! location is refused: the relay cannot swap it.

use rngd_kv_wire::BlobMeta;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// Version of the descriptor format.
pub const VERSION: u32 = 1;
/// Prefix of the relay keys holding descriptors.
pub const RELAY_PREFIX: &str = "nixl.";
/// Prefix of the notification that frees a slot: `free <key> <slot> <nonce>`.
pub const FREE_NOTIF: &str = "rngd-kv-free";

/// One pushed request as the decode side needs it to READ it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Descriptor {
    /// Format version ([`VERSION`]).
    pub v: u32,
    /// The prefill agent's name.
    pub agent: String,
    /// The prefill agent's NIXL metadata, hex.
    pub metadata: String,
    /// Address of the slot in the prefill agent's registered arena.
    pub addr: u64,
    /// Bytes in the slot: the blobs back to back, in wire order.
    pub len: u64,
    /// Slot number on the prefill side.
    pub slot: u64,
    /// Random tag of the slot (a notification must name it to free it).
    pub nonce: u64,
    /// Size and CRC-32 of every blob.
    pub blobs: Vec<BlobMeta>,
}

/// What a handle's location says: where the descriptor is and what it is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Location {
    /// The relay's `host:port#epoch` (as the `tcp` transport writes it).
    pub relay: String,
    /// Length of the descriptor, bytes.
    pub len: u64,
    /// CRC-32 of the descriptor (0 with relay CRCs off).
    pub crc32: u32,
    /// SHA-256 of the descriptor, hex.
    pub sha256: String,
}

impl Location {
    /// `relay#epoch#len.crc.sha256`.
    pub fn encode(&self) -> String {
        format!(
            "{}#{}.{:08x}.{}",
            self.relay, self.len, self.crc32, self.sha256
        )
    }

    /// Parses [`Location::encode`]'s form.
    pub fn parse(s: &str) -> Option<Location> {
        let (relay, tail) = s.rsplit_once('#')?;
        let mut parts = tail.split('.');
        let len = parts.next()?.parse().ok()?;
        let crc32 = u32::from_str_radix(parts.next()?, 16).ok()?;
        let sha256 = parts.next()?.to_string();
        if parts.next().is_some()
            || sha256.len() != 64
            || !sha256.bytes().all(|b| b.is_ascii_hexdigit())
            || !relay.contains('#')
        {
            return None;
        }
        Some(Location {
            relay: relay.to_string(),
            len,
            crc32,
            sha256,
        })
    }
}

/// SHA-256 of `b`, lower-case hex.
pub fn sha256_hex(b: &[u8]) -> String {
    hex(&Sha256::digest(b))
}

/// Lower-case hex.
pub fn hex(b: &[u8]) -> String {
    let mut s = String::with_capacity(b.len() * 2);
    for x in b {
        s.push_str(&format!("{x:02x}"));
    }
    s
}

/// Parses lower- or upper-case hex.
pub fn unhex(s: &str) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok())
        .collect()
}

/// The notification that frees slot `slot` (tag `nonce`) of `key`.
pub fn free_notif(key: &str, slot: u64, nonce: u64) -> String {
    format!("{FREE_NOTIF} {key} {slot} {nonce:016x}")
}

/// Parses [`free_notif`]'s form.
pub fn parse_free_notif(msg: &str) -> Option<(&str, u64, u64)> {
    let mut it = msg.split(' ');
    if it.next()? != FREE_NOTIF {
        return None;
    }
    let key = it.next()?;
    let slot = it.next()?.parse().ok()?;
    let nonce = u64::from_str_radix(it.next()?, 16).ok()?;
    it.next().is_none().then_some((key, slot, nonce))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn locations_and_notifications_round_trip() {
        let loc = Location {
            relay: "10.0.0.1:7070#00000000000000ff".into(),
            len: 1234,
            crc32: 0xdead_beef,
            sha256: sha256_hex(b"x"),
        };
        assert_eq!(Location::parse(&loc.encode()), Some(loc.clone()));
        assert_eq!(
            Location::parse("10.0.0.1:7070#00ff"),
            None,
            "a tcp location"
        );
        assert_eq!(Location::parse(&format!("{}0", loc.encode())), None);
        let n = free_notif("k-1", 7, 0xabc);
        assert_eq!(parse_free_notif(&n), Some(("k-1", 7, 0xabc)));
        assert_eq!(parse_free_notif("rngd-kv-free k 7"), None);
        assert_eq!(unhex(&hex(&[0, 1, 254, 255])), Some(vec![0, 1, 254, 255]));
        assert_eq!(unhex("abc"), None);
    }
}
