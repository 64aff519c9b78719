//! Unforgeable KV handles. A prefill worker names each cache it pushes with a
//! fresh 128-bit random key ([`new_kv_key`], never derived from a client's
//! request id) and signs what it hands out: the handle, the first token, the
//! prompt's token ids (as SHA-256), an expiry and the [`Claims`] (the seed
//! the decode continues with, the first token's log-probabilities, the
//! prefix-cache hit and the `weight_version` of the weights that made the KV),
//! with HMAC-SHA256 under a key
//! derived from the deployment's KV secret ([`HandleSigner`]). A decode worker
//! pulls nothing before [`HandleSigner::verify`] and [`check_shape`] pass: a
//! handle it cannot verify, an expired one, a prompt that is not the one
//! signed, or blobs that do not match its model's layout are refused (400),
//! nothing pulled and nothing deleted.
//!
//! The message signed is the canonical JSON of [`Signed`] after a domain
//! prefix; both sides run this code, so the encoding is fixed by it.
//!
//! A handle is good for one decode: [`UsedHandles`] (in [`used`]) remembers
//! the handles a decode worker consumed or released, so a second decode of
//! one is refused at once.

mod used;

pub use used::{USED_HANDLES_CAP, Used, UsedHandles};

use std::fmt;

use ring::hmac;
use ring::rand::{SecureRandom, SystemRandom};
use rngd_api::pd::TokenLogprobs;
use rngd_kv_wire::{KvHandle, KvLayout};
use serde::Serialize;

/// Domain prefix of the signed message.
const DOMAIN: &[u8] = b"rngd-pd kv handle v1\n";
/// Label of the handle key derived from the deployment secret (the relay's
/// handshake uses the secret under another label).
const KEY_LABEL: &[u8] = b"rngd-pd kv handle key v1";
/// Clock difference between two workers tolerated on expiry, ms.
pub const CLOCK_SKEW_MS: u64 = 5_000;

/// Why a handle is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HandleError {
    /// No signature where one is required.
    #[error(
        "kv_handle_signature is missing: this worker accepts only handles signed by a prefill worker of its deployment"
    )]
    Unsigned,
    /// The signature does not verify (forged, altered, another deployment's).
    #[error(
        "kv_handle_signature does not verify: the handle, first_token or prompt_token_ids are not the ones the prefill worker signed"
    )]
    BadSignature,
    /// The handle's time is over.
    #[error("the kv_handle expired {ago_ms} ms ago")]
    Expired {
        /// How long ago, ms.
        ago_ms: u64,
    },
    /// The handle does not describe this model's cache.
    #[error("the kv_handle does not match this worker's model: {0}")]
    Shape(String),
    /// The request asks for log-probabilities the prefill did not send.
    #[error(
        "the request asks for logprobs but kv_transfer_params carries no first_token_logprobs (the prefill was asked without them)"
    )]
    NoFirstLogprobs,
}

/// What the prefill decided about sampling, signed with the handle so a
/// decode continues exactly where it left off.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Claims<'a> {
    /// The seed of the request's random stream.
    pub seed: Option<u64>,
    /// The first token's log-probabilities.
    pub first_token_logprobs: Option<&'a TokenLogprobs>,
    /// Prompt tokens the prefill found in its prefix cache.
    pub cached_tokens: Option<u32>,
    /// The `weight_version` of the engine that computed the KV.
    pub weight_version: Option<&'a str>,
}

/// A fresh sampling seed from the system generator (a request without
/// `seed` gets one, so two such requests draw different streams).
pub fn random_seed() -> u64 {
    let mut b = [0u8; 8];
    // The system RNG failing is not recoverable.
    SystemRandom::new()
        .fill(&mut b)
        .expect("the system random number generator works");
    u64::from_le_bytes(b)
}

/// A fresh KV key: 128 random bits as 32 lower-case hex digits.
pub fn new_kv_key() -> String {
    random_hex(16)
}

/// `n` random bytes from the system generator, as lower-case hex (e.g. a
/// deployment secret `rngd-pd up` makes for its children).
pub fn random_hex(n: usize) -> String {
    let mut b = vec![0u8; n];
    // The system RNG failing is not recoverable.
    SystemRandom::new()
        .fill(&mut b)
        .expect("the system random number generator works");
    hex(&b)
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex(s: &str) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) || s.len() > 128 {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok())
        .collect()
}

/// What is signed (the claims only when present: a handle without them
/// signs as before they existed).
#[derive(Serialize)]
struct Signed<'a> {
    handle: &'a KvHandle,
    first_token: u32,
    prompt_sha256: String,
    expires_ms: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    seed: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    first_token_logprobs: Option<&'a TokenLogprobs>,
    #[serde(skip_serializing_if = "Option::is_none")]
    cached_tokens: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    weight_version: Option<&'a str>,
}

fn message(
    handle: &KvHandle,
    first_token: u32,
    prompt: &[u32],
    expires_ms: u64,
    claims: &Claims<'_>,
) -> Vec<u8> {
    let mut ids = Vec::with_capacity(prompt.len() * 4);
    for t in prompt {
        ids.extend_from_slice(&t.to_le_bytes());
    }
    let digest = ring::digest::digest(&ring::digest::SHA256, &ids);
    let signed = Signed {
        handle,
        first_token,
        prompt_sha256: hex(digest.as_ref()),
        expires_ms,
        seed: claims.seed,
        first_token_logprobs: claims.first_token_logprobs,
        cached_tokens: claims.cached_tokens,
        weight_version: claims.weight_version,
    };
    let mut m = DOMAIN.to_vec();
    // Serializing plain structs, strings and numbers cannot fail.
    m.extend(serde_json::to_vec(&signed).expect("serializable"));
    m
}

// === impl HandleSigner ===

/// Signs and verifies handles with the deployment's key.
#[derive(Clone)]
pub struct HandleSigner {
    key: hmac::Key,
}

impl fmt::Debug for HandleSigner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("HandleSigner(<key redacted>)")
    }
}

impl HandleSigner {
    /// The signer of a deployment whose KV secret is `secret`.
    pub fn new(secret: &[u8]) -> Self {
        let master = hmac::Key::new(hmac::HMAC_SHA256, secret);
        let derived = hmac::sign(&master, KEY_LABEL);
        HandleSigner {
            key: hmac::Key::new(hmac::HMAC_SHA256, derived.as_ref()),
        }
    }

    /// The signature (hex) of a handle with its first token and prompt, valid
    /// until `expires_ms` (Unix ms).
    pub fn sign(
        &self,
        handle: &KvHandle,
        first_token: u32,
        prompt: &[u32],
        expires_ms: u64,
    ) -> String {
        self.sign_with(handle, first_token, prompt, expires_ms, &Claims::default())
    }

    /// [`HandleSigner::sign`] with the sampling claims.
    pub fn sign_with(
        &self,
        handle: &KvHandle,
        first_token: u32,
        prompt: &[u32],
        expires_ms: u64,
        claims: &Claims<'_>,
    ) -> String {
        let m = message(handle, first_token, prompt, expires_ms, claims);
        hex(hmac::sign(&self.key, &m).as_ref())
    }

    /// Checks a signature (constant time) and the expiry against `now_ms`.
    pub fn verify(
        &self,
        handle: &KvHandle,
        first_token: u32,
        prompt: &[u32],
        expires_ms: u64,
        signature: &str,
        now_ms: u64,
    ) -> Result<(), HandleError> {
        self.verify_with(
            handle,
            first_token,
            prompt,
            expires_ms,
            &Claims::default(),
            signature,
            now_ms,
        )
    }

    /// [`HandleSigner::verify`] with the sampling claims.
    #[allow(clippy::too_many_arguments)]
    pub fn verify_with(
        &self,
        handle: &KvHandle,
        first_token: u32,
        prompt: &[u32],
        expires_ms: u64,
        claims: &Claims<'_>,
        signature: &str,
        now_ms: u64,
    ) -> Result<(), HandleError> {
        let tag = unhex(signature).ok_or(HandleError::BadSignature)?;
        let m = message(handle, first_token, prompt, expires_ms, claims);
        hmac::verify(&self.key, &m, &tag).map_err(|_| HandleError::BadSignature)?;
        if now_ms > expires_ms.saturating_add(CLOCK_SKEW_MS) {
            return Err(HandleError::Expired {
                ago_ms: now_ms - expires_ms,
            });
        }
        Ok(())
    }
}

/// How a worker treats handles.
#[derive(Debug, Clone)]
pub enum KvAuth {
    /// Sign what it pushes, refuse what it cannot verify.
    Signed(HandleSigner),
    /// No deployment secret was configured and `AIRM_KV_TCP_INSECURE_NO_AUTH=1`
    /// says so explicitly: handles are neither signed nor checked (their shape
    /// still is). For a single trusted host only.
    Insecure,
    /// No KV secret: PD requests are refused (a solo worker serving whole
    /// requests needs none).
    Off,
}

/// Checks a handle against the model's layout before anything is pulled: the
/// layout itself, the blob count, the token count, the wire version (one
/// this build reads) and every blob's length in it. A trimmed handle (wire
/// version 2: only its valid positions travel) from a worker compiled for
/// another context length is accepted when its tokens fit this one's: its
/// blobs do not depend on `seq_len` (variants, `/switch_variant`).
pub fn check_shape(
    handle: &KvHandle,
    layout: &KvLayout,
    prompt_len: usize,
) -> Result<(), HandleError> {
    let other_context = KvLayout {
        seq_len: layout.seq_len,
        ..handle.layout
    } == *layout
        && handle.wire == rngd_kv_wire::WIRE_TRIMMED;
    if handle.layout != *layout && !other_context {
        return Err(HandleError::Shape(format!(
            "layout {:?}, this model's is {layout:?}",
            handle.layout
        )));
    }
    if handle.blobs.len() != layout.blob_count() {
        return Err(HandleError::Shape(format!(
            "{} blobs, the layout has {}",
            handle.blobs.len(),
            layout.blob_count()
        )));
    }
    if handle.tokens != prompt_len || handle.tokens == 0 || handle.tokens > layout.seq_len {
        return Err(HandleError::Shape(format!(
            "the handle covers {} tokens, the prompt has {prompt_len} (context {})",
            handle.tokens, layout.seq_len
        )));
    }
    // A version this build does not know is refused, never guessed at.
    let want = layout
        .wire_blob_bytes(handle.wire, handle.tokens)
        .map_err(|e| HandleError::Shape(e.to_string()))? as u64;
    if let Some((i, b)) = handle.blobs.iter().enumerate().find(|(_, b)| b.len != want) {
        return Err(HandleError::Shape(format!(
            "blob {i} has {} bytes, wire version {} of the layout has {want} for {} tokens",
            b.len, handle.wire, handle.tokens
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use rngd_kv_wire::{BlobMeta, Dtype};

    fn layout() -> KvLayout {
        KvLayout {
            layers: 2,
            kv_heads: 1,
            head_dim: 4,
            seq_len: 8,
            dtype: Dtype::Bf16,
        }
    }

    fn handle() -> KvHandle {
        let l = layout();
        KvHandle {
            request_id: new_kv_key(),
            transport: "shm".into(),
            location: "/dev/shm/x".into(),
            layout: l,
            tokens: 3,
            wire: rngd_kv_wire::WIRE_FULL,
            blobs: vec![
                BlobMeta {
                    len: l.blob_bytes() as u64,
                    crc32: 7
                };
                l.blob_count()
            ],
        }
    }

    #[test]
    fn a_trimmed_handle_of_another_context_length_fits_when_its_tokens_do() {
        let l = layout();
        let trimmed = |seq_len: usize, tokens: usize| {
            let mut h = handle();
            h.layout.seq_len = seq_len;
            h.wire = rngd_kv_wire::WIRE_TRIMMED;
            h.tokens = tokens;
            let len = h.layout.wire_blob_bytes(h.wire, tokens).unwrap() as u64;
            h.blobs.iter_mut().for_each(|b| b.len = len);
            h
        };
        check_shape(&trimmed(8, 3), &l, 3).unwrap();
        check_shape(&trimmed(4, 3), &l, 3).unwrap();
        check_shape(&trimmed(64, 3), &l, 3).unwrap();
        // More tokens than this context holds.
        assert!(check_shape(&trimmed(64, 9), &l, 9).is_err());
        // The full wire's blobs are S wide: only this layout's.
        let mut full = handle();
        full.layout.seq_len = 16;
        full.blobs
            .iter_mut()
            .for_each(|b| b.len = full.layout.blob_bytes() as u64);
        assert!(check_shape(&full, &l, 3).is_err());
        // Another dimension: refused whatever the wire.
        let mut heads = trimmed(8, 3);
        heads.layout.kv_heads = 2;
        assert!(check_shape(&heads, &l, 3).is_err());
    }

    #[test]
    fn kv_keys_are_128_random_bits() {
        let a = new_kv_key();
        let b = new_kv_key();
        assert_eq!(a.len(), 32);
        assert!(a.bytes().all(|c| c.is_ascii_hexdigit()));
        assert_ne!(a, b);
    }

    #[test]
    fn a_signed_handle_verifies_and_any_change_breaks_it() {
        let s = HandleSigner::new(b"deployment-secret-0123456789");
        let h = handle();
        let prompt = [1, 2, 3];
        let sig = s.sign(&h, 42, &prompt, 10_000);
        s.verify(&h, 42, &prompt, 10_000, &sig, 9_000).unwrap();

        let mut other_key = h.clone();
        other_key.request_id = new_kv_key();
        let mut more_blobs = h.clone();
        more_blobs.blobs.push(more_blobs.blobs[0]);
        let mut moved = h.clone();
        moved.location = "/tmp/elsewhere".into();
        for (what, hh, first, p, exp) in [
            ("key", &other_key, 42, &prompt[..], 10_000),
            ("blobs", &more_blobs, 42, &prompt[..], 10_000),
            ("location", &moved, 42, &prompt[..], 10_000),
            ("first token", &h, 43, &prompt[..], 10_000),
            ("prompt", &h, 42, &[1, 2, 4][..], 10_000),
            ("expiry", &h, 42, &prompt[..], 99_000),
        ] {
            assert_eq!(
                s.verify(hh, first, p, exp, &sig, 9_000),
                Err(HandleError::BadSignature),
                "{what}"
            );
        }
        let other = HandleSigner::new(b"another-deployment-secret-xyz");
        assert_eq!(
            other.verify(&h, 42, &prompt, 10_000, &sig, 9_000),
            Err(HandleError::BadSignature)
        );
        for junk in ["", "zz", &sig[..sig.len() - 2], &"a".repeat(1000)] {
            assert_eq!(
                s.verify(&h, 42, &prompt, 10_000, junk, 9_000),
                Err(HandleError::BadSignature)
            );
        }
    }

    #[test]
    fn the_claims_are_signed_too() {
        let s = HandleSigner::new(b"deployment-secret-0123456789");
        let h = handle();
        let lp = TokenLogprobs {
            logprob: -0.5,
            top: vec![(3, -0.5), (9, -1.25)],
        };
        let claims = Claims {
            seed: Some(u64::MAX),
            first_token_logprobs: Some(&lp),
            cached_tokens: Some(32),
            weight_version: Some("0123456789abcdef"),
        };
        let sig = s.sign_with(&h, 3, &[1, 2, 3], 10_000, &claims);
        s.verify_with(&h, 3, &[1, 2, 3], 10_000, &claims, &sig, 9_000)
            .unwrap();
        let other_lp = TokenLogprobs {
            logprob: -0.25,
            ..lp.clone()
        };
        for changed in [
            Claims {
                seed: Some(1),
                ..claims
            },
            Claims {
                first_token_logprobs: Some(&other_lp),
                ..claims
            },
            Claims {
                cached_tokens: Some(48),
                ..claims
            },
            Claims {
                weight_version: Some("0123456789abcdee"),
                ..claims
            },
            Claims {
                weight_version: None,
                ..claims
            },
            Claims::default(),
        ] {
            assert_eq!(
                s.verify_with(&h, 3, &[1, 2, 3], 10_000, &changed, &sig, 9_000),
                Err(HandleError::BadSignature)
            );
        }
        // Without claims, a signature is the one `sign` makes.
        assert_eq!(
            s.sign_with(&h, 3, &[1], 5, &Claims::default()),
            s.sign(&h, 3, &[1], 5)
        );
        assert_ne!(random_seed(), random_seed());
    }

    #[test]
    fn an_expired_handle_is_refused_after_the_skew() {
        let s = HandleSigner::new(b"deployment-secret-0123456789");
        let h = handle();
        let sig = s.sign(&h, 1, &[1, 2, 3], 10_000);
        s.verify(&h, 1, &[1, 2, 3], 10_000, &sig, 10_000 + CLOCK_SKEW_MS)
            .unwrap();
        assert!(matches!(
            s.verify(&h, 1, &[1, 2, 3], 10_000, &sig, 10_001 + CLOCK_SKEW_MS),
            Err(HandleError::Expired { .. })
        ));
    }

    #[test]
    fn handles_that_do_not_fit_the_model_are_refused() {
        let l = layout();
        check_shape(&handle(), &l, 3).unwrap();
        let mut many = handle();
        many.blobs = vec![many.blobs[0]; 100_000];
        let mut big = handle();
        big.blobs[1].len = 1 << 40;
        let mut long = handle();
        long.tokens = 9;
        let mut other = handle();
        other.layout.layers = 3;
        // The trimmed wire: 3 tokens × 4 dims × 1 head × 2 bytes per blob.
        let mut trimmed = handle();
        trimmed.wire = rngd_kv_wire::WIRE_TRIMMED;
        for b in &mut trimmed.blobs {
            b.len = 24;
        }
        check_shape(&trimmed, &l, 3).unwrap();
        let mut unknown = trimmed.clone();
        unknown.wire = 7;
        // S-wide lengths under the trimmed label do not fit.
        let mut mislabelled = handle();
        mislabelled.wire = rngd_kv_wire::WIRE_TRIMMED;
        for (h, n, needle) in [
            (unknown, 3, "wire version 7"),
            (mislabelled, 3, "wire version 2 of the layout has 24"),
            (many, 3, "100000 blobs"),
            (big, 3, "blob 1 has"),
            (long.clone(), 9, "covers 9"),
            (handle(), 4, "prompt has 4"),
            (other, 3, "layout"),
        ] {
            match check_shape(&h, &l, n) {
                Err(HandleError::Shape(m)) => assert!(m.contains(needle), "{m}"),
                r => panic!("{needle}: {r:?}"),
            }
        }
    }
}
