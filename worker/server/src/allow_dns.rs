//! Allowlist entries that name a DNS name instead of addresses
//! (`dns:NAME:PORT` in `--prefill-allow`, `dns:NAME` in
//! `--front-door-allow`): the addresses the name resolves to, refreshed in
//! the background ([`refresh`]), so a list can name "the release's own pods"
//! through a headless Service (the chart's default) instead of whole private
//! ranges.
//!
//! A peer is admitted by the addresses of the last answer; the check and the
//! connection use the same IP (the header's), so the name is never resolved
//! between them. Until the first answer, a name admits nothing (fail
//! closed); a failed lookup keeps the last answer for at most
//! [`STALE_AFTER`], then admits nothing until the name resolves again.

use std::collections::HashSet;
use std::net::IpAddr;
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

/// How often the names are looked up again.
pub const REFRESH_EVERY: Duration = Duration::from_secs(5);

/// The longest one lookup may take.
pub const LOOKUP_TIMEOUT: Duration = Duration::from_secs(2);

/// How long the last answer stands while lookups fail.
pub const STALE_AFTER: Duration = Duration::from_secs(60);

/// Turns a DNS name into addresses (the real one: the system resolver; tests
/// give their own).
#[async_trait::async_trait]
pub trait Resolve: Send + Sync {
    /// The addresses `name` resolves to now.
    async fn resolve(&self, name: &str) -> std::io::Result<Vec<IpAddr>>;
}

/// The system resolver (`getaddrinfo` through tokio: `/etc/resolv.conf`'s
/// search domains apply, as for any client in the pod).
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemResolver;

#[async_trait::async_trait]
impl Resolve for SystemResolver {
    async fn resolve(&self, name: &str) -> std::io::Result<Vec<IpAddr>> {
        Ok(tokio::net::lookup_host((name, 0))
            .await?
            .map(|sa| sa.ip())
            .collect())
    }
}

/// One name and the addresses of its last answer.
#[derive(Debug)]
pub struct DnsName {
    name: String,
    answer: RwLock<Answer>,
}

#[derive(Debug, Default)]
struct Answer {
    ips: HashSet<IpAddr>,
    at: Option<Instant>,
}

// === impl DnsName ===

impl DnsName {
    /// A name with no answer yet (it admits nothing).
    pub fn new(name: String) -> Arc<DnsName> {
        Arc::new(DnsName {
            name,
            answer: RwLock::new(Answer::default()),
        })
    }

    /// The name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Whether `ip` was in the last answer, and that answer is not older
    /// than [`STALE_AFTER`] (an IPv4-mapped IPv6 address counts as its IPv4).
    pub fn contains(&self, ip: IpAddr) -> bool {
        let ip = ip.to_canonical();
        let a = self.answer.read().unwrap_or_else(|p| p.into_inner());
        a.at.is_some_and(|t| t.elapsed() <= STALE_AFTER) && a.ips.contains(&ip)
    }

    fn set(&self, ips: HashSet<IpAddr>) {
        let mut a = self.answer.write().unwrap_or_else(|p| p.into_inner());
        *a = Answer {
            ips,
            at: Some(Instant::now()),
        };
    }
}

impl PartialEq for DnsName {
    fn eq(&self, other: &Self) -> bool {
        self.name == other.name
    }
}

impl Eq for DnsName {}

/// Looks every name up once (each within [`LOOKUP_TIMEOUT`]); a failed
/// lookup keeps the name's last answer (which [`DnsName::contains`] stops
/// trusting after [`STALE_AFTER`]).
pub async fn refresh_once(names: &[Arc<DnsName>], resolver: &dyn Resolve) {
    for n in names {
        match tokio::time::timeout(LOOKUP_TIMEOUT, resolver.resolve(&n.name)).await {
            Ok(Ok(ips)) => n.set(ips.into_iter().collect()),
            Ok(Err(e)) => {
                tracing::warn!(name = %n.name, error = %e, "allowlist name did not resolve")
            }
            Err(_) => tracing::warn!(name = %n.name, "allowlist name lookup timed out"),
        }
    }
}

/// Refreshes `names` every [`REFRESH_EVERY`] until the task is dropped
/// (nothing to do, and no task, when there are none).
pub fn refresh(
    names: Vec<Arc<DnsName>>,
    resolver: Arc<dyn Resolve>,
) -> Option<tokio::task::JoinHandle<()>> {
    if names.is_empty() {
        return None;
    }
    Some(tokio::spawn(async move {
        let mut every = tokio::time::interval(REFRESH_EVERY);
        every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            every.tick().await;
            refresh_once(&names, resolver.as_ref()).await;
        }
    }))
}
