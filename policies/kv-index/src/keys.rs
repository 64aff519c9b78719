//! The router's block keys: a chain hash over token ids, independent of the
//! engine's own block hashes (which stay opaque ids).
//!
//! Block `i`'s key is the first 8 bytes (little-endian u64) of
//! SHA-256(key of block `i-1` as 8 bytes little-endian ‖ block `i`'s token
//! ids, each u32 little-endian); block 0's parent is [`ROOT_KEY`]. Equal keys
//! mean equal token prefixes (up to a 2⁻⁶⁴ collision), whatever engine
//! published them.

use sha2::{Digest, Sha256};

/// The parent key of a prompt's first block: the bytes `rngd-kvi`, read as a
/// little-endian u64.
pub const ROOT_KEY: u64 = u64::from_le_bytes(*b"rngd-kvi");

/// The key of a block whose parent's key is `parent` and whose tokens are
/// `tokens`.
pub fn chain_key(parent: u64, tokens: &[u32]) -> u64 {
    let mut h = Sha256::new();
    h.update(parent.to_le_bytes());
    for t in tokens {
        h.update(t.to_le_bytes());
    }
    let d = h.finalize();
    let mut first = [0u8; 8];
    first.copy_from_slice(&d[..8]);
    u64::from_le_bytes(first)
}

/// The parent key of the first block of a prompt sent with vLLM's
/// `cache_salt` `salt`: SHA-256 of `rngd-kvi-salt`, the salt's length (u64
/// little-endian) and its bytes, first 8 bytes little-endian. Two salts
/// (and a salt and none) root disjoint key chains, so a salted prompt
/// matches only blocks stored under its own salt.
pub fn salted_root(salt: &str) -> u64 {
    let mut h = Sha256::new();
    h.update(b"rngd-kvi-salt");
    h.update((salt.len() as u64).to_le_bytes());
    h.update(salt.as_bytes());
    let d = h.finalize();
    let mut first = [0u8; 8];
    first.copy_from_slice(&d[..8]);
    u64::from_le_bytes(first)
}

/// The root key of a prompt: [`ROOT_KEY`], or [`salted_root`] of its salt.
pub fn root_key(salt: Option<&str>) -> u64 {
    salt.map_or(ROOT_KEY, salted_root)
}

/// The keys of every full block of `tokens` in blocks of `block_size`, from
/// token 0 (a partial last block has no key). Empty when `block_size` is 0.
pub fn block_keys(block_size: usize, tokens: &[u32]) -> Vec<u64> {
    salted_block_keys(block_size, tokens, None)
}

/// [`block_keys`] of a prompt sent with `salt` (vLLM's `cache_salt`).
pub fn salted_block_keys(block_size: usize, tokens: &[u32], salt: Option<&str>) -> Vec<u64> {
    if block_size == 0 {
        return Vec::new();
    }
    let mut parent = root_key(salt);
    tokens
        .chunks_exact(block_size)
        .map(|block| {
            parent = chain_key(parent, block);
            parent
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_chain_from_the_root_and_ignore_a_partial_block() {
        let k = block_keys(2, &[1, 2, 3, 4, 5]);
        assert_eq!(k.len(), 2);
        assert_eq!(k[0], chain_key(ROOT_KEY, &[1, 2]));
        assert_eq!(k[1], chain_key(k[0], &[3, 4]));
        assert!(block_keys(0, &[1, 2]).is_empty());
        assert!(block_keys(4, &[1, 2]).is_empty());
    }

    #[test]
    fn salts_root_disjoint_chains() {
        let t = [1, 2, 3, 4];
        let (none, a, b) = (
            salted_block_keys(2, &t, None),
            salted_block_keys(2, &t, Some("a")),
            salted_block_keys(2, &t, Some("b")),
        );
        assert_eq!(none, block_keys(2, &t));
        assert_eq!(a[0], chain_key(salted_root("a"), &[1, 2]));
        assert_eq!(a[1], chain_key(a[0], &[3, 4]));
        for (x, y) in [(&none, &a), (&none, &b), (&a, &b)] {
            assert!(x.iter().all(|k| !y.contains(k)), "{x:?} {y:?}");
        }
        assert_ne!(salted_root(""), ROOT_KEY);
    }

    #[test]
    fn a_key_depends_on_every_token_and_on_the_whole_prefix() {
        let a = block_keys(2, &[1, 2, 3, 4]);
        let b = block_keys(2, &[1, 9, 3, 4]);
        assert_ne!(a[0], b[0]);
        assert_ne!(a[1], b[1], "same block tokens, other prefix: other key");
        // Token order matters, and the block boundary is part of the key.
        assert_ne!(chain_key(ROOT_KEY, &[1, 2]), chain_key(ROOT_KEY, &[2, 1]));
        assert_ne!(
            block_keys(2, &[1, 2, 3, 4])[1],
            block_keys(4, &[1, 2, 3, 4])[0]
        );
    }

    #[test]
    fn the_scheme_is_sha256_of_the_parent_and_the_tokens_little_endian() {
        let mut bytes = ROOT_KEY.to_le_bytes().to_vec();
        bytes.extend_from_slice(&7u32.to_le_bytes());
        bytes.extend_from_slice(&70_000u32.to_le_bytes());
        let d = Sha256::digest(&bytes);
        let want = u64::from_le_bytes(d[..8].try_into().unwrap());
        assert_eq!(chain_key(ROOT_KEY, &[7, 70_000]), want);
    }
}
