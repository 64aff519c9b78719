//! Which prefill peers a decode worker may call: [`PrefillAllow`] (the
//! `--prefill-allow` list, [`AllowEntry`] each) and [`PeerAddr`] (the
//! `x-prefiller-host-port` entry it admitted, the only thing the peer client
//! connects to); and which clients may ask a worker for a prefill-only
//! request: [`ClientAllow`] (`--front-door-allow`, by connection IP).
//!
//! Entry syntax (`--prefill-allow`, comma-separated, repeatable):
//!
//! - `HOST:PORT`: an exact DNS name (compared case-insensitively) or IP;
//! - `IPV4/PREFIX:PORT` and `[IPV6]/PREFIX:PORT`: a CIDR block (host bits
//!   are ignored: `10.1.2.3/8` is `10.0.0.0/8`);
//! - `[IPV6]:PORT`: an exact IPv6 address;
//! - `dns:NAME:PORT`: the addresses NAME resolves to, refreshed in the
//!   background (`allow_dns`; the chart names the release's prefill pods
//!   through a headless Service this way).
//!
//! The port is always required and always checked: `*` is not accepted (a
//! pool's workers listen on a known port; name each one).
//!
//! A header entry that is a name is admitted only by an exact `HOST:PORT`
//! entry with that name; an IP only by an exact or CIDR entry of the same
//! family with the same port. Names are never resolved to check a CIDR (the
//! answer may change between the check and the connect).

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::str::FromStr;
use std::sync::Arc;

use crate::allow_dns::DnsName;

/// A `--prefill-allow` entry that does not parse (startup error).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("--prefill-allow entry `{entry}`: {reason}")]
pub struct AllowError {
    /// The entry as given.
    pub entry: String,
    /// Why it does not parse.
    pub reason: String,
}

/// One `--prefill-allow` entry (see the module documentation for the syntax).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AllowEntry {
    /// An exact DNS name (lower case) and port.
    Name {
        /// The name, lower case.
        host: String,
        /// The port.
        port: u16,
    },
    /// A CIDR block (an exact IP is a full-length prefix) and port.
    Net {
        /// The network address (host bits cleared).
        net: IpAddr,
        /// Prefix length (≤ 32 for IPv4, ≤ 128 for IPv6).
        prefix: u8,
        /// The port.
        port: u16,
    },
    /// `dns:NAME:PORT`: an IP in the name's last answer, on this port.
    Dns {
        /// The name and its addresses.
        name: Arc<DnsName>,
        /// The port.
        port: u16,
    },
}

impl AllowEntry {
    /// Whether this entry admits `peer`.
    pub fn admits(&self, peer: &PeerAddr) -> bool {
        match (self, peer) {
            (AllowEntry::Name { host, port }, PeerAddr::Name { host: h, port: p }) => {
                host == h && port == p
            }
            (AllowEntry::Net { net, prefix, port }, PeerAddr::Ip(sa)) => {
                *port == sa.port() && masked(sa.ip(), *prefix) == Some(*net)
            }
            (AllowEntry::Dns { name, port }, PeerAddr::Ip(sa)) => {
                *port == sa.port() && name.contains(sa.ip())
            }
            _ => false,
        }
    }
}

impl fmt::Display for AllowEntry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AllowEntry::Name { host, port } => write!(f, "{host}:{port}"),
            AllowEntry::Dns { name, port } => write!(f, "dns:{}:{port}", name.name()),
            AllowEntry::Net {
                net: IpAddr::V4(a),
                prefix: 32,
                port,
            } => write!(f, "{a}:{port}"),
            AllowEntry::Net {
                net: IpAddr::V6(a),
                prefix: 128,
                port,
            } => write!(f, "[{a}]:{port}"),
            AllowEntry::Net {
                net: IpAddr::V4(a),
                prefix,
                port,
            } => write!(f, "{a}/{prefix}:{port}"),
            AllowEntry::Net {
                net: IpAddr::V6(a),
                prefix,
                port,
            } => write!(f, "[{a}]/{prefix}:{port}"),
        }
    }
}

impl FromStr for AllowEntry {
    type Err = AllowError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let entry = s.trim();
        let err = |reason: &str| AllowError {
            entry: entry.to_string(),
            reason: reason.to_string(),
        };
        if entry.is_empty() {
            return Err(err("empty entry"));
        }
        if entry.chars().any(|c| c.is_whitespace() || c.is_control()) {
            return Err(err("whitespace inside the entry"));
        }
        let (host, port) = entry
            .rsplit_once(':')
            .ok_or_else(|| err("a port is required (HOST:PORT, IP/PREFIX:PORT)"))?;
        if port == "*" {
            return Err(err(
                "`*` is not accepted as a port: name each prefill port (ports are always checked)",
            ));
        }
        let port = parse_port(port).map_err(err)?;
        if let Some(name) = host.strip_prefix("dns:") {
            let name = parse_name(name).map_err(err)?;
            return Ok(AllowEntry::Dns {
                name: DnsName::new(name),
                port,
            });
        }
        if let Some(rest) = host.strip_prefix('[') {
            let (addr, after) = rest
                .split_once(']')
                .ok_or_else(|| err("`[` without a closing `]`"))?;
            let addr = Ipv6Addr::from_str(addr).map_err(|_| err("not an IPv6 address in [...]"))?;
            let prefix = match after {
                "" => 128,
                p => {
                    let p = p
                        .strip_prefix('/')
                        .ok_or_else(|| err("after `]` comes `:PORT` or `/PREFIX:PORT`"))?;
                    parse_prefix(p, 128).map_err(err)?
                }
            };
            return Ok(net_entry(IpAddr::V6(addr), prefix, port));
        }
        if host.contains(':') {
            return Err(err(
                "an IPv6 address is written in brackets: [ADDR]:PORT or [ADDR]/PREFIX:PORT",
            ));
        }
        if let Some((addr, prefix)) = host.split_once('/') {
            let addr = Ipv4Addr::from_str(addr)
                .map_err(|_| err("a CIDR needs an IPv4 address (or [IPv6]) before `/`"))?;
            let prefix = parse_prefix(prefix, 32).map_err(err)?;
            return Ok(net_entry(IpAddr::V4(addr), prefix, port));
        }
        if let Ok(addr) = Ipv4Addr::from_str(host) {
            return Ok(net_entry(IpAddr::V4(addr), 32, port));
        }
        let host = parse_name(host).map_err(err)?;
        Ok(AllowEntry::Name { host, port })
    }
}

fn net_entry(addr: IpAddr, prefix: u8, port: u16) -> AllowEntry {
    AllowEntry::Net {
        net: masked(addr, prefix).unwrap_or(addr),
        prefix,
        port,
    }
}

/// `addr` with the bits after `prefix` cleared (`None` if `prefix` is too long).
fn masked(addr: IpAddr, prefix: u8) -> Option<IpAddr> {
    match addr {
        IpAddr::V4(a) if prefix <= 32 => {
            let mask = u32::MAX.checked_shl(32 - u32::from(prefix)).unwrap_or(0);
            Some(IpAddr::V4(Ipv4Addr::from(u32::from(a) & mask)))
        }
        IpAddr::V6(a) if prefix <= 128 => {
            let mask = u128::MAX.checked_shl(128 - u32::from(prefix)).unwrap_or(0);
            Some(IpAddr::V6(Ipv6Addr::from(u128::from(a) & mask)))
        }
        _ => None,
    }
}

fn parse_port(p: &str) -> Result<u16, &'static str> {
    if p.is_empty() || p.len() > 5 || !p.bytes().all(|b| b.is_ascii_digit()) {
        return Err("the port must be a number 1-65535");
    }
    match p.parse::<u16>() {
        Ok(0) | Err(_) => Err("the port must be a number 1-65535"),
        Ok(n) => Ok(n),
    }
}

fn parse_prefix(p: &str, max: u8) -> Result<u8, &'static str> {
    if p.is_empty() || p.len() > 3 || !p.bytes().all(|b| b.is_ascii_digit()) {
        return Err("the prefix length must be a number");
    }
    match p.parse::<u8>() {
        Ok(n) if n <= max => Ok(n),
        _ if max == 32 => Err("an IPv4 prefix length is at most 32"),
        _ => Err("an IPv6 prefix length is at most 128"),
    }
}

/// A DNS name: labels of `[A-Za-z0-9-]` (1-63 bytes, no leading or trailing
/// `-`), at most 253 bytes, lower-cased. A name whose last label is numeric
/// (or `0x…`) is refused: URL parsers read `127.1` or `0x7f000001` as IPv4
/// addresses, which would bypass the IP rules.
fn parse_name(host: &str) -> Result<String, &'static str> {
    const BAD: &str = "not a host name or IP address (no scheme, path, query, userinfo or `*`)";
    if host.is_empty() || host.len() > 253 {
        return Err(BAD);
    }
    let labels: Vec<&str> = host.split('.').collect();
    for l in &labels {
        let ok = !l.is_empty()
            && l.len() <= 63
            && l.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
            && !l.starts_with('-')
            && !l.ends_with('-');
        if !ok {
            return Err(BAD);
        }
    }
    let last = labels[labels.len() - 1].to_ascii_lowercase();
    if last.bytes().all(|b| b.is_ascii_digit())
        || (last.starts_with("0x") && last[2..].bytes().all(|b| b.is_ascii_hexdigit()))
    {
        return Err("looks numeric but is not a dotted-quad IPv4 address");
    }
    Ok(host.to_ascii_lowercase())
}

/// A prefill peer address taken from `x-prefiller-host-port` and admitted by
/// the allowlist. Its [`fmt::Display`] is the canonical `host:port` the peer
/// client connects to (never the raw header text).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PeerAddr {
    /// A DNS name (lower case) and port.
    Name {
        /// The name.
        host: String,
        /// The port.
        port: u16,
    },
    /// An IP address and port.
    Ip(SocketAddr),
}

impl PeerAddr {
    /// Parses one header entry: `NAME:PORT`, `IPV4:PORT` or `[IPV6]:PORT`,
    /// nothing else (no scheme, path, query, fragment, userinfo, whitespace).
    /// The error is the reason.
    pub fn parse(entry: &str) -> Result<PeerAddr, &'static str> {
        if entry.chars().any(|c| c.is_whitespace() || c.is_control()) {
            return Err("whitespace inside the entry");
        }
        let (host, port) = entry
            .rsplit_once(':')
            .ok_or("not HOST:PORT (a port is required)")?;
        let port = parse_port(port)?;
        if let Some(v6) = host.strip_prefix('[').and_then(|h| h.strip_suffix(']')) {
            let a = Ipv6Addr::from_str(v6).map_err(|_| "not an IPv6 address in [...]")?;
            return Ok(PeerAddr::Ip(SocketAddr::new(IpAddr::V6(a), port)));
        }
        if let Ok(a) = Ipv4Addr::from_str(host) {
            return Ok(PeerAddr::Ip(SocketAddr::new(IpAddr::V4(a), port)));
        }
        Ok(PeerAddr::Name {
            host: parse_name(host)?,
            port,
        })
    }
}

impl fmt::Display for PeerAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PeerAddr::Name { host, port } => write!(f, "{host}:{port}"),
            PeerAddr::Ip(sa) => write!(f, "{sa}"),
        }
    }
}

/// Why no entry of an `x-prefiller-host-port` header was used.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PickError {
    /// This worker's allowlist is empty: it orchestrates no prefill at all.
    NoneAllowed,
    /// No entry is well formed and allowed, and this one (the first
    /// malformed entry, shortened) is not `host:port`.
    Malformed {
        /// The entry (at most [`ECHO_MAX`] characters).
        entry: String,
        /// Why.
        reason: &'static str,
    },
    /// Every entry is well formed and none is in the allowlist.
    NotAllowed {
        /// The first refused entry, canonical.
        first: String,
        /// How many entries were refused.
        count: usize,
    },
}

/// How much of a client's header entry an error message repeats.
pub const ECHO_MAX: usize = 80;

/// The `--prefill-allow` list. Empty (the default) admits nothing: a request
/// with `x-prefiller-host-port` is refused.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PrefillAllow {
    entries: Vec<AllowEntry>,
}

impl PrefillAllow {
    /// A list of parsed entries.
    pub fn new(entries: Vec<AllowEntry>) -> Self {
        PrefillAllow { entries }
    }

    /// The entries.
    pub fn entries(&self) -> &[AllowEntry] {
        &self.entries
    }

    /// Whether nothing is admitted.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The `dns:` entries' names, for the refresher.
    pub fn dns_names(&self) -> Vec<Arc<DnsName>> {
        self.entries
            .iter()
            .filter_map(|e| match e {
                AllowEntry::Dns { name, .. } => Some(name.clone()),
                _ => None,
            })
            .collect()
    }

    /// Whether some entry admits `peer`.
    pub fn admits(&self, peer: &PeerAddr) -> bool {
        self.entries.iter().any(|e| e.admits(peer))
    }

    /// The peer of an `x-prefiller-host-port` value (llm-d sends a
    /// comma-separated list): the first entry, in order, that is well formed
    /// and admitted. Malformed and refused entries are skipped; when none is
    /// left, the error says why (a malformed entry first).
    pub fn pick(&self, header: &str) -> Result<PeerAddr, PickError> {
        if self.is_empty() {
            return Err(PickError::NoneAllowed);
        }
        let mut malformed = None;
        let (mut first, mut count) = (None, 0usize);
        for raw in header.split(',') {
            let e = raw.trim();
            if e.is_empty() {
                continue;
            }
            match PeerAddr::parse(e) {
                Ok(p) if self.admits(&p) => return Ok(p),
                Ok(p) => {
                    count += 1;
                    first.get_or_insert_with(|| p.to_string());
                }
                Err(reason) => {
                    malformed.get_or_insert_with(|| PickError::Malformed {
                        entry: e.chars().take(ECHO_MAX).collect(),
                        reason,
                    });
                }
            }
        }
        Err(match (malformed, first) {
            (Some(m), _) => m,
            (None, Some(first)) => PickError::NotAllowed { first, count },
            (None, None) => PickError::Malformed {
                entry: String::new(),
                reason: "no entry",
            },
        })
    }
}

impl FromStr for PrefillAllow {
    type Err = AllowError;

    /// A comma-separated list of entries (empty string: the empty list).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        s.split(',')
            .filter(|e| !e.trim().is_empty())
            .map(AllowEntry::from_str)
            .collect::<Result<Vec<_>, _>>()
            .map(PrefillAllow::new)
    }
}

impl fmt::Display for PrefillAllow {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, e) in self.entries.iter().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            write!(f, "{e}")?;
        }
        Ok(())
    }
}

// === impl ClientAllow ===

/// Which clients, by the IP address of their connection, may send a
/// prefill-only request (`do_remote_decode`): the front doors (gateway,
/// Envoy) and the decode workers (`--front-door-allow`, comma-separated `IP`
/// or `IP/PREFIX` entries, IPv6 in brackets or bare, or `dns:NAME`: the
/// addresses NAME resolves to). The default is loopback.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientAllow {
    nets: Vec<(IpAddr, u8)>,
    /// `dns:NAME` entries: the addresses of each name's last answer.
    names: Vec<Arc<DnsName>>,
}

impl ClientAllow {
    /// `127.0.0.0/8` and `::1`.
    pub fn loopback() -> Self {
        ClientAllow {
            nets: vec![
                (IpAddr::V4(Ipv4Addr::new(127, 0, 0, 0)), 8),
                (IpAddr::V6(Ipv6Addr::LOCALHOST), 128),
            ],
            names: Vec::new(),
        }
    }

    /// The `dns:` entries' names, for the refresher.
    pub fn dns_names(&self) -> Vec<Arc<DnsName>> {
        self.names.clone()
    }

    /// Whether a connection from `ip` is admitted (an IPv4-mapped IPv6
    /// address counts as its IPv4 address).
    pub fn admits(&self, ip: IpAddr) -> bool {
        let ip = ip.to_canonical();
        self.nets
            .iter()
            .any(|(net, prefix)| masked(ip, *prefix) == Some(*net))
            || self.names.iter().any(|n| n.contains(ip))
    }
}

impl FromStr for ClientAllow {
    type Err = AllowError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let mut nets = Vec::new();
        let mut names = Vec::new();
        for raw in s.split(',').map(str::trim).filter(|e| !e.is_empty()) {
            let err = |reason: &str| AllowError {
                entry: raw.to_string(),
                reason: reason.to_string(),
            };
            if let Some(name) = raw.strip_prefix("dns:") {
                names.push(DnsName::new(parse_name(name).map_err(err)?));
                continue;
            }
            let (addr, prefix) = match raw.split_once('/') {
                Some((a, p)) => (
                    a,
                    Some(
                        p.parse::<u8>()
                            .map_err(|_| err("the prefix is not a number"))?,
                    ),
                ),
                None => (raw, None),
            };
            let addr = addr.trim_start_matches('[').trim_end_matches(']');
            let ip = IpAddr::from_str(addr)
                .map_err(|_| err("not an IP address (IP or IP/PREFIX; no port, no name)"))?;
            let max = if ip.is_ipv4() { 32 } else { 128 };
            let prefix = prefix.unwrap_or(max);
            if prefix > max {
                return Err(err("prefix longer than the address"));
            }
            let net = masked(ip, prefix).ok_or_else(|| err("bad prefix"))?;
            nets.push((net, prefix));
        }
        Ok(ClientAllow { nets, names })
    }
}

impl fmt::Display for ClientAllow {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, (net, prefix)) in self.nets.iter().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            write!(f, "{net}/{prefix}")?;
        }
        for (i, n) in self.names.iter().enumerate() {
            if i > 0 || !self.nets.is_empty() {
                f.write_str(",")?;
            }
            write!(f, "dns:{}", n.name())?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod client_allow_tests {
    use super::*;

    #[test]
    fn loopback_by_default_and_cidrs_when_given() {
        let lo = ClientAllow::loopback();
        assert!(lo.admits("127.0.0.1".parse().unwrap()));
        assert!(lo.admits("127.9.9.9".parse().unwrap()));
        assert!(lo.admits("::1".parse().unwrap()));
        assert!(lo.admits("::ffff:127.0.0.1".parse().unwrap()));
        assert!(!lo.admits("10.0.0.1".parse().unwrap()));
        let pods: ClientAllow = "10.244.0.0/16, 192.168.1.7, [fd00::]/8".parse().unwrap();
        assert!(pods.admits("10.244.3.4".parse().unwrap()));
        assert!(!pods.admits("10.245.0.1".parse().unwrap()));
        assert!(pods.admits("192.168.1.7".parse().unwrap()));
        assert!(!pods.admits("192.168.1.8".parse().unwrap()));
        assert!(pods.admits("fd12::1".parse().unwrap()));
        assert!(!pods.admits("127.0.0.1".parse().unwrap()));
        assert_eq!(pods.to_string(), "10.244.0.0/16,192.168.1.7/32,fd00::/8");
        for bad in ["10.0.0.0/33", "worker-0", "10.0.0.1:8000", "10.0.0.0/x"] {
            assert!(bad.parse::<ClientAllow>().is_err(), "{bad}");
        }
        assert!(
            !"".parse::<ClientAllow>()
                .unwrap()
                .admits("127.0.0.1".parse().unwrap())
        );
    }
}

#[cfg(test)]
mod dns_tests {
    use std::sync::Mutex;

    use super::*;
    use crate::allow_dns::{Resolve, refresh_once};

    /// Answers what the test set, or fails.
    struct Fake(Mutex<Option<Vec<IpAddr>>>);

    #[async_trait::async_trait]
    impl Resolve for Fake {
        async fn resolve(&self, _: &str) -> std::io::Result<Vec<IpAddr>> {
            self.0
                .lock()
                .unwrap()
                .clone()
                .ok_or_else(|| std::io::Error::other("NXDOMAIN"))
        }
    }

    fn ips(list: &[&str]) -> Option<Vec<IpAddr>> {
        Some(list.iter().map(|s| s.parse().unwrap()).collect())
    }

    #[tokio::test]
    async fn dns_entries_admit_the_last_answer_only() {
        let allow: PrefillAllow = "dns:Prefill-Peers.ns.svc:8000,10.9.0.0/16:8000"
            .parse()
            .unwrap();
        assert_eq!(
            allow.to_string(),
            "dns:prefill-peers.ns.svc:8000,10.9.0.0/16:8000"
        );
        let clients: ClientAllow = "dns:gateway-peers.ns.svc,127.0.0.1".parse().unwrap();
        assert_eq!(clients.to_string(), "127.0.0.1/32,dns:gateway-peers.ns.svc");
        let peer = |s: &str| PeerAddr::parse(s).unwrap();
        // No answer yet: the name admits nothing (the CIDR still does).
        assert!(!allow.admits(&peer("10.1.2.3:8000")));
        assert!(allow.admits(&peer("10.9.1.1:8000")));
        let fake = Fake(Mutex::new(ips(&["10.1.2.3", "10.1.2.4"])));
        let mut names = allow.dns_names();
        names.extend(clients.dns_names());
        refresh_once(&names, &fake).await;
        assert!(allow.admits(&peer("10.1.2.3:8000")));
        assert!(allow.admits(&peer("10.1.2.4:8000")));
        assert!(!allow.admits(&peer("10.1.2.3:9000")), "the port is checked");
        assert!(!allow.admits(&peer("10.1.2.5:8000")));
        assert!(
            !allow.admits(&peer("prefill-peers.ns.svc:8000")),
            "names in headers are not resolved"
        );
        assert!(clients.admits("10.1.2.3".parse().unwrap()));
        assert!(clients.admits("::ffff:10.1.2.4".parse().unwrap()));
        assert!(!clients.admits("10.1.2.5".parse().unwrap()));
        // A pod replaced: the old address is no longer admitted.
        *fake.0.lock().unwrap() = ips(&["10.1.2.9"]);
        refresh_once(&names, &fake).await;
        assert!(!allow.admits(&peer("10.1.2.3:8000")));
        assert!(allow.admits(&peer("10.1.2.9:8000")));
        // A failed lookup keeps the last answer (for a bounded time).
        *fake.0.lock().unwrap() = None;
        refresh_once(&names, &fake).await;
        assert!(allow.admits(&peer("10.1.2.9:8000")));
        // An empty answer admits nothing.
        *fake.0.lock().unwrap() = ips(&[]);
        refresh_once(&names, &fake).await;
        assert!(!allow.admits(&peer("10.1.2.9:8000")));
        for bad in ["dns:foo:0", "dns:-bad-:8000", "dns::8000", "dns:a/b:8000"] {
            assert!(bad.parse::<PrefillAllow>().is_err(), "{bad}");
        }
        for bad in ["dns:", "dns:a_b", "dns:10.0.0.1:80"] {
            assert!(bad.parse::<ClientAllow>().is_err(), "{bad}");
        }
    }
}
