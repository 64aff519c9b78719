//! The relay handshake's shared secret ([`Secret`]) and what it computes:
//! the client's and the relay's HMAC-SHA256 over the two nonces, their
//! constant-time checks, keys derived for other uses, and the handshake
//! constants and random nonces. The handshake itself is described in the
//! [`crate::frame`] module docs; everything here is re-exported there.

use std::path::Path;
use std::sync::Arc;

use ring::hmac;

use super::TRANSPORT;
use crate::KvError;

/// HELLO `arg` bit: the relay checks the shared secret.
pub const HELLO_AUTH: u32 = 1;
/// Bytes of each handshake nonce.
pub const NONCE_LEN: usize = 32;
/// Bytes of each handshake MAC (HMAC-SHA256).
pub const MAC_LEN: usize = 32;
/// Body of an AUTH frame: the client nonce, then the client's MAC.
pub const AUTH_BODY_LEN: usize = NONCE_LEN + MAC_LEN;
/// What the client's MAC covers after the nonces.
const CLIENT_CONTEXT: &[u8] = b"rngd-pd relay v1 client";
/// What the relay's MAC covers after the nonces.
const SERVER_CONTEXT: &[u8] = b"rngd-pd relay v1 server";

/// The shared secret of the relay and its clients. Its bytes never show in
/// `Debug` output, logs or error messages.
#[derive(Clone)]
pub struct Secret(Arc<[u8]>);

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(<redacted>)")
    }
}

impl PartialEq for Secret {
    /// Constant-time in the contents (lengths are not secret).
    fn eq(&self, other: &Secret) -> bool {
        self.0.len() == other.0.len()
            && self
                .0
                .iter()
                .zip(other.0.iter())
                .fold(0u8, |acc, (a, b)| acc | (a ^ b))
                == 0
    }
}

impl Eq for Secret {}

impl std::str::FromStr for Secret {
    type Err = KvError;

    /// [`Secret::parse`].
    fn from_str(s: &str) -> Result<Secret, KvError> {
        Secret::parse(s)
    }
}

// === impl Secret ===

impl Secret {
    /// Fewest bytes a secret may have.
    pub const MIN_LEN: usize = 16;

    /// A secret from its bytes, exactly as given; at least [`Secret::MIN_LEN`] of them.
    pub fn new(bytes: impl Into<Vec<u8>>) -> Result<Secret, KvError> {
        let s = Secret(bytes.into().into());
        s.check()?;
        Ok(s)
    }

    /// A secret from text (an environment variable): surrounding whitespace
    /// (a trailing newline) is dropped; then checked as [`Secret::new`].
    pub fn parse(text: &str) -> Result<Secret, KvError> {
        let s = Secret::from_text(text);
        s.check()?;
        Ok(s)
    }

    /// Like [`Secret::parse`] without the length check, for a command-line
    /// parser (whose errors would print the value): whoever uses it checks
    /// with [`Secret::check`] (as [`crate::relay::RelayOptions::config`] does).
    pub fn from_text(text: &str) -> Secret {
        Secret(text.trim().as_bytes().into())
    }

    /// Checks the length rule of [`Secret::new`] (the error tells the
    /// length, never the bytes).
    pub fn check(&self) -> Result<(), KvError> {
        if self.0.len() < Self::MIN_LEN {
            return Err(KvError::Config {
                detail: format!(
                    "the relay secret has {} bytes; it needs at least {} (e.g. 32 random bytes, hex)",
                    self.0.len(),
                    Self::MIN_LEN
                ),
            });
        }
        Ok(())
    }

    /// A secret from a file (a mounted Kubernetes Secret): its contents
    /// without surrounding whitespace. Errors name the path, never the contents.
    pub fn from_file(path: &Path) -> Result<Secret, KvError> {
        let bytes = std::fs::read(path).map_err(|source| KvError::Io {
            transport: TRANSPORT,
            context: format!("reading the relay secret file {}", path.display()),
            source,
        })?;
        let trimmed = bytes.trim_ascii();
        Secret::new(trimmed).map_err(|e| KvError::Config {
            detail: format!("secret file {}: {e}", path.display()),
        })
    }

    fn key(&self) -> hmac::Key {
        hmac::Key::new(hmac::HMAC_SHA256, &self.0)
    }

    /// The client's handshake MAC over the two nonces.
    pub fn client_mac(&self, relay_nonce: &[u8], client_nonce: &[u8]) -> [u8; MAC_LEN] {
        mac(&self.key(), relay_nonce, client_nonce, CLIENT_CONTEXT)
    }

    /// The relay's handshake MAC over the two nonces.
    pub fn server_mac(&self, relay_nonce: &[u8], client_nonce: &[u8]) -> [u8; MAC_LEN] {
        mac(&self.key(), relay_nonce, client_nonce, SERVER_CONTEXT)
    }

    /// Checks a client's MAC in constant time.
    pub fn verify_client(&self, relay_nonce: &[u8], client_nonce: &[u8], tag: &[u8]) -> bool {
        verify(&self.key(), relay_nonce, client_nonce, CLIENT_CONTEXT, tag)
    }

    /// Checks the relay's MAC in constant time.
    pub fn verify_server(&self, relay_nonce: &[u8], client_nonce: &[u8], tag: &[u8]) -> bool {
        verify(&self.key(), relay_nonce, client_nonce, SERVER_CONTEXT, tag)
    }

    /// A key for another use of the deployment secret (the workers' KV handle
    /// signatures): HMAC-SHA256 of `label` under the secret, so no two uses
    /// share a key and the secret itself never leaves this type.
    pub fn derive(&self, label: &[u8]) -> [u8; MAC_LEN] {
        let tag = hmac::sign(&self.key(), label);
        let mut out = [0u8; MAC_LEN];
        out.copy_from_slice(&tag.as_ref()[..MAC_LEN]);
        out
    }
}

fn mac_input(relay_nonce: &[u8], client_nonce: &[u8], context: &[u8]) -> Vec<u8> {
    [relay_nonce, client_nonce, context].concat()
}

fn mac(key: &hmac::Key, nr: &[u8], nc: &[u8], context: &[u8]) -> [u8; MAC_LEN] {
    let tag = hmac::sign(key, &mac_input(nr, nc, context));
    tag.as_ref().try_into().expect("HMAC-SHA256 is 32 bytes")
}

fn verify(key: &hmac::Key, nr: &[u8], nc: &[u8], context: &[u8], tag: &[u8]) -> bool {
    hmac::verify(key, &mac_input(nr, nc, context), tag).is_ok()
}

/// A fresh random handshake nonce (from the operating system's CSPRNG).
pub fn nonce() -> [u8; NONCE_LEN] {
    use ring::rand::SecureRandom;
    let mut n = [0u8; NONCE_LEN];
    ring::rand::SystemRandom::new()
        .fill(&mut n)
        .expect("the OS random number generator failed");
    n
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn macs_depend_on_secret_nonces_and_direction() {
        let s = Secret::new(*b"0123456789abcdef").unwrap();
        let other = Secret::new(*b"0123456789abcdeX").unwrap();
        let (nr, nc) = (nonce(), nonce());
        assert_ne!(nr, nc, "nonces are random");
        let c = s.client_mac(&nr, &nc);
        assert!(s.verify_client(&nr, &nc, &c));
        assert!(!other.verify_client(&nr, &nc, &c), "another secret");
        assert!(!s.verify_client(&nc, &nr, &c), "other nonces");
        assert!(!s.verify_server(&nr, &nc, &c), "reflected");
        assert!(s.verify_server(&nr, &nc, &s.server_mac(&nr, &nc)));
        assert!(!s.verify_client(&nr, &nc, &[0u8; MAC_LEN]));
    }

    #[test]
    fn secrets_are_redacted_and_checked() {
        let s = Secret::parse("  supersecretvalue-1234\n").unwrap();
        assert_eq!(s, Secret::new(*b"supersecretvalue-1234").unwrap());
        assert!(!format!("{s:?}").contains("supersecret"));
        let short = Secret::parse("short").unwrap_err().to_string();
        assert!(short.contains("at least 16"), "{short}");
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("secret");
        std::fs::write(&path, "file-secret-0123456789\n").unwrap();
        assert_eq!(
            Secret::from_file(&path).unwrap(),
            Secret::new(*b"file-secret-0123456789").unwrap()
        );
        let missing = Secret::from_file(&dir.path().join("nope"))
            .unwrap_err()
            .to_string();
        assert!(missing.contains("nope"), "{missing}");
    }
}
