//! Where each endpoint holds a prompt's prefix in its KV cache, for the
//! policy's `rngd_pd.prefix_cache` property: the [`PrefixSource`] trait, its
//! real implementation over the KV-event index
//! (`rngd_kv_index::KvIndexer`, `docs/kv-index.md`), and the property text.

use rngd_kv_index::KvIndexer;

/// Answers how many of a prompt's leading tokens an endpoint has cached.
pub trait PrefixSource: Send + Sync {
    /// Cached prompt tokens of `prompt_ids` on `address` (`ip:port`);
    /// `None` when there is no cache information for it (no event stream,
    /// or a stream that is stale, broken or still replaying).
    fn cached(&self, address: &str, prompt_ids: &[u32]) -> Option<usize>;
}

impl PrefixSource for KvIndexer {
    fn cached(&self, address: &str, prompt_ids: &[u32]) -> Option<usize> {
        self.match_prefix(address, prompt_ids)
    }
}

/// The `rngd_pd.prefix_cache` text for `addresses`: `ADDRESS=TOKENS` or
/// `ADDRESS=?` (no information), joined by `,`.
pub fn property<'a>(
    source: &dyn PrefixSource,
    addresses: impl IntoIterator<Item = &'a str>,
    prompt_ids: &[u32],
) -> String {
    let mut out = String::new();
    for a in addresses {
        if !out.is_empty() {
            out.push(',');
        }
        out.push_str(a);
        out.push('=');
        match source.cached(a, prompt_ids) {
            Some(n) => out.push_str(&n.to_string()),
            None => out.push('?'),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Fixed;

    impl PrefixSource for Fixed {
        fn cached(&self, address: &str, prompt_ids: &[u32]) -> Option<usize> {
            match address {
                "a:1" => Some(prompt_ids.len() / 2),
                "b:1" => Some(0),
                _ => None,
            }
        }
    }

    #[test]
    fn property_lists_every_address_with_its_count_or_unknown() {
        let ids = vec![7u32; 64];
        assert_eq!(
            property(&Fixed, ["a:1", "b:1", "c:1"], &ids),
            "a:1=32,b:1=0,c:1=?"
        );
        assert_eq!(property(&Fixed, [], &ids), "");
    }
}
