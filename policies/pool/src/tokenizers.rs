//! The door's tokenizer held against each endpoint's: [`TokenizerCheck`].
//!
//! A door tokenizes prompts for routing (the prefix index's block hashes)
//! and sends the ids upstream with its tokenizer's digest
//! (`tokenized_prompt`). A worker whose tokenizer differs ignores those ids
//! and tokenizes the text itself, and the door's prefix predictions for it
//! are of ids it never sees. This check makes that visible at the door: each
//! endpoint's digest, read by the scrape from `rngd_pd_worker_tokenizer_info`
//! ([`crate::load`]), is exported beside the door's own
//! (`rngd_pd_router_tokenizer_info{endpoint, digest}`, the door's as
//! `endpoint="self"`), with a gauge per endpoint that is 1 while they differ
//! (`rngd_pd_router_tokenizer_mismatch{endpoint}`) and a warning the first
//! time an endpoint is seen differing. Such an endpoint gets no prefix-cache
//! credit in a pick (`crate::pick`): its predictions are meaningless.
//!
//! It follows the source's digest changes ([`EndpointSource::tokenizer_changes`])
//! at each pick and each render of the door's `/metrics`, at the cost of one
//! atomic read when nothing changed.

use std::collections::{HashMap, HashSet};
use std::sync::Mutex;

use prometheus::GaugeVec;
use rngd_policy_core::Endpoint;
use rngd_telemetry::names;

use crate::{EndpointSource, PoolError};

/// The `endpoint` label of the door's own tokenizer.
pub const SELF_ENDPOINT: &str = "self";

/// What was seen at the last follow.
#[derive(Debug, Default)]
struct Seen {
    /// The source's change count then (`None`: never followed).
    changes: Option<u64>,
    /// Each endpoint's digest as exported.
    digests: HashMap<String, String>,
    /// Endpoints whose digest differs from the door's.
    mismatched: HashSet<String>,
}

/// The door's tokenizer digest and every endpoint's (see the module docs).
#[derive(Debug)]
pub struct TokenizerCheck {
    own: Option<String>,
    info: GaugeVec,
    mismatch: GaugeVec,
    seen: Mutex<Seen>,
}

fn metric_err(name: &'static str) -> impl Fn(prometheus::Error) -> PoolError {
    move |e| PoolError::Config(format!("metric {name}: {e}"))
}

impl TokenizerCheck {
    /// A check for a door whose tokenizer has the digest `own` (`None`: a
    /// door without one; endpoints are exported, none counts as differing).
    pub fn new(own: Option<String>) -> Result<Self, PoolError> {
        let info = GaugeVec::new(
            prometheus::Opts::new(
                names::ROUTER_TOKENIZER_INFO,
                "Tokenizer digests: the door's own (endpoint=\"self\") and each endpoint's as scraped.",
            ),
            &["endpoint", "digest"],
        )
        .map_err(metric_err(names::ROUTER_TOKENIZER_INFO))?;
        let mismatch = GaugeVec::new(
            prometheus::Opts::new(
                names::ROUTER_TOKENIZER_MISMATCH,
                "1 while the endpoint's tokenizer digest differs from the door's, else 0.",
            ),
            &["endpoint"],
        )
        .map_err(metric_err(names::ROUTER_TOKENIZER_MISMATCH))?;
        if let Some(d) = &own {
            info.with_label_values(&[SELF_ENDPOINT, d]).set(1.0);
        }
        Ok(TokenizerCheck {
            own,
            info,
            mismatch,
            seen: Mutex::default(),
        })
    }

    /// Registers the gauges in `r`.
    pub fn register(&self, r: &prometheus::Registry) -> Result<(), PoolError> {
        r.register(Box::new(self.info.clone()))
            .map_err(metric_err(names::ROUTER_TOKENIZER_INFO))?;
        r.register(Box::new(self.mismatch.clone()))
            .map_err(metric_err(names::ROUTER_TOKENIZER_MISMATCH))
    }

    /// The door's own digest.
    pub fn own(&self) -> Option<&str> {
        self.own.as_deref()
    }

    /// Brings the gauges up to the endpoints' digests in `snapshot` as
    /// `endpoints` last scraped them, warning once for each endpoint that
    /// starts to differ from the door. One atomic read when no digest
    /// changed since the last call.
    pub fn follow(&self, endpoints: &dyn EndpointSource, snapshot: &[Endpoint]) {
        let changes = endpoints.tokenizer_changes();
        let mut seen = self.seen.lock().unwrap_or_else(|p| p.into_inner());
        if seen.changes == Some(changes) {
            return;
        }
        seen.changes = Some(changes);
        let mut now: HashMap<String, String> = HashMap::new();
        for e in snapshot {
            if let Some(d) = endpoints.tokenizer_digest_of(&e.address) {
                now.insert(e.address.clone(), d);
            }
        }
        // Series of endpoints gone, or whose digest changed.
        let old = std::mem::take(&mut seen.digests);
        for (addr, d) in &old {
            if now.get(addr) != Some(d) {
                let _ = self.info.remove_label_values(&[addr, d]);
            }
            if !now.contains_key(addr) {
                let _ = self.mismatch.remove_label_values(&[addr]);
                seen.mismatched.remove(addr);
            }
        }
        for (addr, d) in &now {
            self.info.with_label_values(&[addr, d]).set(1.0);
            let differs = self.own.as_deref().is_some_and(|own| own != d);
            self.mismatch
                .with_label_values(&[addr])
                .set(if differs { 1.0 } else { 0.0 });
            if differs {
                if seen.mismatched.insert(addr.clone()) {
                    tracing::warn!(
                        endpoint = %addr,
                        endpoint_digest = %d,
                        door_digest = self.own.as_deref().unwrap_or_default(),
                        "the endpoint's tokenizer differs from this door's: it tokenizes prompts itself and gets no prefix-cache credit in routing; give the door the workers' model file"
                    );
                }
            } else if seen.mismatched.remove(addr) {
                tracing::info!(endpoint = %addr, "the endpoint's tokenizer is the door's again");
            }
        }
        seen.digests = now;
    }

    /// Whether any endpoint's digest differed at the last follow.
    pub fn any_mismatch(&self) -> bool {
        !self
            .seen
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .mismatched
            .is_empty()
    }

    /// Whether the endpoint at `address` differed at the last follow.
    pub fn is_mismatched(&self, address: &str) -> bool {
        self.seen
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .mismatched
            .contains(address)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU64, Ordering};

    /// A source whose digests the test sets.
    #[derive(Default)]
    struct Digests {
        map: Mutex<HashMap<String, String>>,
        changes: AtomicU64,
    }

    impl Digests {
        fn set(&self, addr: &str, d: Option<&str>) {
            let mut m = self.map.lock().unwrap();
            match d {
                Some(d) => m.insert(addr.into(), d.into()),
                None => m.remove(addr),
            };
            self.changes.fetch_add(1, Ordering::AcqRel);
        }
    }

    impl EndpointSource for Digests {
        fn snapshot(&self) -> std::sync::Arc<[Endpoint]> {
            ["a:1", "b:2"]
                .map(|a| {
                    crate::source::local_endpoint(a.into(), rngd_policy_core::Role::Solo, 512, &[])
                })
                .to_vec()
                .into()
        }
        fn tokenizer_changes(&self) -> u64 {
            self.changes.load(Ordering::Acquire)
        }
        fn tokenizer_digest_of(&self, address: &str) -> Option<String> {
            self.map.lock().unwrap().get(address).cloned()
        }
    }

    fn page(r: &prometheus::Registry) -> String {
        rngd_telemetry::render(r)
    }

    #[test]
    fn each_endpoints_digest_is_exported_beside_the_doors() {
        let check = TokenizerCheck::new(Some("00000000000000aa".into())).unwrap();
        let r = prometheus::Registry::new();
        check.register(&r).unwrap();
        let src = Digests::default();
        let snap = src.snapshot();
        src.set("a:1", Some("00000000000000aa"));
        src.set("b:2", Some("00000000000000bb"));
        check.follow(&src, &snap);
        let text = page(&r);
        for want in [
            "rngd_pd_router_tokenizer_info{digest=\"00000000000000aa\",endpoint=\"self\"} 1",
            "rngd_pd_router_tokenizer_info{digest=\"00000000000000aa\",endpoint=\"a:1\"} 1",
            "rngd_pd_router_tokenizer_info{digest=\"00000000000000bb\",endpoint=\"b:2\"} 1",
            "rngd_pd_router_tokenizer_mismatch{endpoint=\"a:1\"} 0",
            "rngd_pd_router_tokenizer_mismatch{endpoint=\"b:2\"} 1",
        ] {
            assert!(text.contains(want), "{want} not in\n{text}");
        }
        assert!(check.is_mismatched("b:2") && !check.is_mismatched("a:1"));
        assert!(check.any_mismatch());
        // b's worker restarts with the door's tokenizer; a's leaves.
        src.set("b:2", Some("00000000000000aa"));
        src.set("a:1", None);
        check.follow(&src, &snap);
        let text = page(&r);
        assert!(!text.contains("00000000000000bb"), "{text}");
        assert!(!text.contains("endpoint=\"a:1\""), "{text}");
        assert!(text.contains("rngd_pd_router_tokenizer_mismatch{endpoint=\"b:2\"} 0"));
        assert!(!check.any_mismatch());
    }

    #[test]
    fn a_door_without_a_digest_counts_no_endpoint_as_differing() {
        let check = TokenizerCheck::new(None).unwrap();
        let src = Digests::default();
        src.set("a:1", Some("00000000000000bb"));
        check.follow(&src, &src.snapshot());
        assert!(!check.any_mismatch());
    }
}
