//! Where each endpoint holds a prompt's prefix in its KV cache, for the
//! policy's `rngd_pd.prefix_cache` property: the [`PrefixSource`] seam the
//! picker asks (its real implementation is [`crate::cache::PrefixCache`],
//! over the KV-event index; `docs/kv-index.md`), and the property text.

use rngd_policy_core::Route;

/// Answers how many of a prompt's leading tokens an endpoint has cached,
/// and hears which endpoints a prompt was routed to.
pub trait PrefixSource: Send + Sync {
    /// Cached prompt tokens of `prompt_ids` on each of `addresses`
    /// (`ip:port`), in order; `None` where there is no cache information
    /// (no event stream, or one that is stale, broken or still replaying).
    /// A prompt sent with vLLM's `cache_salt` `salt` matches only what was
    /// cached under the same salt; one without, only unsalted blocks.
    fn cached_all(
        &self,
        addresses: &[&str],
        prompt_ids: &[u32],
        salt: Option<&str>,
    ) -> Vec<Option<usize>>;

    /// Whether it has anything to say (an endpoint with a stream, or
    /// estimates); when not, the policy gets no property at all.
    fn active(&self) -> bool {
        true
    }

    /// The picker routed `prompt_ids` along `route` (the source may
    /// remember it until the endpoints' events confirm it). Default: nothing.
    fn routed(&self, _route: &Route, _prompt_ids: &[u32], _salt: Option<&str>) {}

    /// The engine at `address` did not serve what this source predicted
    /// (`crate::predicted`): drop what it holds for it at once (no cache
    /// information until it is rebuilt) and rebuild it. `true` when there
    /// was something to drop. Default: nothing to drop.
    fn resync(&self, _address: &str) -> bool {
        false
    }
}

/// The `rngd_pd.prefix_cache` text of `counts` (one per address, in order,
/// as [`PrefixSource::cached_all`] answers).
pub fn property_of(addresses: &[&str], counts: &[Option<usize>]) -> String {
    let mut out = String::new();
    for (a, n) in addresses.iter().zip(counts) {
        if !out.is_empty() {
            out.push(',');
        }
        out.push_str(a);
        out.push('=');
        match n {
            Some(n) => out.push_str(&n.to_string()),
            None => out.push('?'),
        }
    }
    out
}

/// The `rngd_pd.prefix_cache` text for `addresses`: `ADDRESS=TOKENS` or
/// `ADDRESS=?` (no information), joined by `,`.
pub fn property(source: &dyn PrefixSource, addresses: &[&str], prompt_ids: &[u32]) -> String {
    property_of(addresses, &source.cached_all(addresses, prompt_ids, None))
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Fixed;

    impl PrefixSource for Fixed {
        fn cached_all(
            &self,
            addresses: &[&str],
            prompt_ids: &[u32],
            _salt: Option<&str>,
        ) -> Vec<Option<usize>> {
            addresses
                .iter()
                .map(|a| match *a {
                    "a:1" => Some(prompt_ids.len() / 2),
                    "b:1" => Some(0),
                    _ => None,
                })
                .collect()
        }
    }

    #[test]
    fn property_lists_every_address_with_its_count_or_unknown() {
        let ids = vec![7u32; 64];
        assert_eq!(
            property(&Fixed, &["a:1", "b:1", "c:1"], &ids),
            "a:1=32,b:1=0,c:1=?"
        );
        assert_eq!(property(&Fixed, &[], &ids), "");
    }
}
