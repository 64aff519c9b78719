//! [`TransportConfig`]: every knob of the transports, read from the environment.

use std::path::PathBuf;
use std::time::Duration;

use rngd_api::env;

use crate::KvError;
use crate::frame::Secret;
use crate::relay::{ClientTls, TlsMode};

/// Default root of the `shm` transport.
pub const DEFAULT_SHM_ROOT: &str = "/dev/shm/rngd_kv_cluster";
/// Default lifetime of an unread request (both transports).
pub const DEFAULT_TTL: Duration = Duration::from_secs(60);
/// Default claim window: KV no decode claimed this long after its
/// publication counts as stranded (a decode claims within milliseconds of
/// the prefill's answer unless its client left or its orchestrator died).
pub const DEFAULT_CLAIM_WINDOW: Duration = Duration::from_secs(5);
/// Default slots of the `shm` arena.
pub const DEFAULT_SHM_SLOTS: usize = 8;
/// Most slots an `shm` arena may have.
pub const MAX_SHM_SLOTS: usize = 256;
/// Default deadline of a `tcp` push, release or STATS.
pub const DEFAULT_TCP_TIMEOUT: Duration = Duration::from_secs(30);
/// Default size of the `nixl-ucx` arena, MiB.
pub const DEFAULT_UCX_POOL_MB: usize = 1024;

/// Configuration of the transports (one struct for all of them).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TransportConfig {
    /// `shm`: directory holding published requests (`PD_SHM_ROOT`).
    pub shm_root: PathBuf,
    /// `shm`: age after which the sweeper removes an unread request (`AIRM_KV_SHM_TTL_S`).
    pub shm_ttl: Duration,
    /// Age after which published KV that no decode has claimed (pulled or
    /// released) counts as stranded (`AIRM_KV_CLAIM_WINDOW_S`, default
    /// [`DEFAULT_CLAIM_WINDOW`]); each transport uses it capped at its TTL
    /// ([`TransportConfig::claim_window_for`]).
    pub claim_window: Duration,
    /// `shm`: slots of the arena that requests are written into in place
    /// (`AIRM_KV_SHM_SLOTS`, default [`DEFAULT_SHM_SLOTS`], at most
    /// [`MAX_SHM_SLOTS`]); `0`: none, every request goes to a file of its own.
    pub shm_slots: usize,
    /// `tcp`: `host:port` of the relay (`AIRM_KV_TCP_ADDR`); required by `tcp`.
    pub tcp_addr: Option<String>,
    /// `tcp`: lifetime of unread blobs in a relay this process starts (`AIRM_KV_TCP_TTL_S`).
    pub tcp_ttl: Duration,
    /// `tcp`: verify CRC-32 (`AIRM_KV_TCP_CRC`, `0` = off).
    pub tcp_crc: bool,
    /// `tcp`: log size and SHA-256 of every blob (`AIRM_KV_TCP_LOG=1`).
    pub tcp_log: bool,
    /// `tcp`: the relay's shared secret (`AIRM_KV_TCP_SECRET_FILE` or
    /// `AIRM_KV_TCP_SECRET`); `None`: no authentication (the relay must run
    /// with `--insecure-no-auth`). From the environment, `None` with a relay
    /// address needs `AIRM_KV_TCP_INSECURE_NO_AUTH=1`. Never shown by `Debug`.
    pub tcp_secret: Option<Secret>,
    /// `tcp`: TLS of the relay connections; `None`: plaintext. From the
    /// environment (`AIRM_KV_TCP_TLS`, default `auto`): the roots of
    /// `AIRM_KV_TCP_TLS_CA_FILE` (for `AIRM_KV_TCP_TLS_SERVER_NAME`) when
    /// set, else the relay key derived from the secret; `off` is plaintext.
    pub tcp_tls: Option<ClientTls>,
    /// `tcp`: deadline of a push, release or STATS (`AIRM_KV_TCP_TIMEOUT_MS`,
    /// default 30 s); also bounds connecting and the handshake.
    pub tcp_timeout: Duration,
    /// `nixl-ucx`: directory of the NIXL runtime (`AIRM_KV_NIXL_LIB_DIR`);
    /// `None`: the installed `nixl-cu12` wheel, found through `python3`.
    pub nixl_lib_dir: Option<PathBuf>,
    /// `nixl-ucx`: NIXL's plugin directory (`AIRM_KV_NIXL_PLUGIN_DIR`);
    /// `None`: `plugins/` in the runtime's directory.
    pub nixl_plugin_dir: Option<PathBuf>,
    /// `nixl-ucx`: size of the registered arena of this process, MiB
    /// (`AIRM_KV_UCX_POOL_MB`, default 1024).
    pub ucx_pool_mb: usize,
    /// `nixl-ucx`: log size and SHA-256 of every blob (`AIRM_KV_UCX_LOG=1`).
    pub ucx_log: bool,
}

impl Default for TransportConfig {
    fn default() -> Self {
        TransportConfig {
            shm_root: PathBuf::from(DEFAULT_SHM_ROOT),
            shm_ttl: DEFAULT_TTL,
            claim_window: DEFAULT_CLAIM_WINDOW,
            shm_slots: DEFAULT_SHM_SLOTS,
            tcp_addr: None,
            tcp_ttl: DEFAULT_TTL,
            tcp_crc: true,
            tcp_log: false,
            tcp_secret: None,
            tcp_tls: None,
            tcp_timeout: DEFAULT_TCP_TIMEOUT,
            nixl_lib_dir: None,
            nixl_plugin_dir: None,
            ucx_pool_mb: DEFAULT_UCX_POOL_MB,
            ucx_log: false,
        }
    }
}

impl TransportConfig {
    /// The claim window of a transport whose unclaimed KV lives `ttl`: the
    /// configured window, never more than the TTL.
    pub fn claim_window_for(&self, ttl: Duration) -> Duration {
        self.claim_window.min(ttl)
    }

    /// Reads the configuration from the process environment.
    pub fn from_env() -> Result<Self, KvError> {
        Self::from_lookup(env::var)
    }

    /// Reads the configuration through `lookup` (a variable name → its
    /// non-empty value); [`TransportConfig::from_env`] passes the real environment.
    pub fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> Result<Self, KvError> {
        let mut cfg = TransportConfig::default();
        if let Some(root) = lookup(env::PD_SHM_ROOT) {
            cfg.shm_root = PathBuf::from(root);
        }
        if let Some(v) = lookup(env::AIRM_KV_SHM_TTL_S) {
            cfg.shm_ttl = parse_secs(env::AIRM_KV_SHM_TTL_S, &v)?;
        }
        if let Some(v) = lookup(env::AIRM_KV_CLAIM_WINDOW_S) {
            cfg.claim_window = parse_secs(env::AIRM_KV_CLAIM_WINDOW_S, &v)?;
        }
        if let Some(v) = lookup(env::AIRM_KV_SHM_SLOTS) {
            cfg.shm_slots = match v.trim().parse::<usize>() {
                Ok(n) if n <= MAX_SHM_SLOTS => n,
                _ => {
                    return Err(KvError::Config {
                        detail: format!(
                            "{}={v:?}: expected a slot count from 0 to {MAX_SHM_SLOTS}",
                            env::AIRM_KV_SHM_SLOTS
                        ),
                    });
                }
            };
        }
        cfg.tcp_addr = lookup(env::AIRM_KV_TCP_ADDR);
        if let Some(v) = lookup(env::AIRM_KV_TCP_TTL_S) {
            cfg.tcp_ttl = parse_secs(env::AIRM_KV_TCP_TTL_S, &v)?;
        }
        if let Some(v) = lookup(env::AIRM_KV_TCP_CRC) {
            cfg.tcp_crc = parse_flag(env::AIRM_KV_TCP_CRC, &v)?;
        }
        if let Some(v) = lookup(env::AIRM_KV_TCP_LOG) {
            cfg.tcp_log = parse_flag(env::AIRM_KV_TCP_LOG, &v)?;
        }
        if let Some(v) = lookup(env::AIRM_KV_TCP_TIMEOUT_MS) {
            cfg.tcp_timeout = parse_ms(env::AIRM_KV_TCP_TIMEOUT_MS, &v)?;
        }
        cfg.nixl_lib_dir = lookup(env::AIRM_KV_NIXL_LIB_DIR).map(PathBuf::from);
        cfg.nixl_plugin_dir = lookup(env::AIRM_KV_NIXL_PLUGIN_DIR).map(PathBuf::from);
        if let Some(v) = lookup(env::AIRM_KV_UCX_POOL_MB) {
            cfg.ucx_pool_mb = match v.trim().parse::<usize>() {
                Ok(mb) if (1..=1 << 20).contains(&mb) => mb,
                _ => {
                    return Err(KvError::Config {
                        detail: format!(
                            "{}={v:?}: expected a size in MiB (1 to 1048576)",
                            env::AIRM_KV_UCX_POOL_MB
                        ),
                    });
                }
            };
        }
        if let Some(v) = lookup(env::AIRM_KV_UCX_LOG) {
            cfg.ucx_log = parse_flag(env::AIRM_KV_UCX_LOG, &v)?;
        }
        cfg.tcp_secret = match (
            lookup(env::AIRM_KV_TCP_SECRET_FILE),
            lookup(env::AIRM_KV_TCP_SECRET),
        ) {
            (Some(_), Some(_)) => {
                return Err(KvError::Config {
                    detail: format!(
                        "both {} and {} are set: give the relay secret once",
                        env::AIRM_KV_TCP_SECRET_FILE,
                        env::AIRM_KV_TCP_SECRET
                    ),
                });
            }
            (Some(path), None) => Some(Secret::from_file(std::path::Path::new(&path))?),
            (None, Some(text)) => Some(Secret::parse(&text).map_err(|e| KvError::Config {
                detail: format!("{}: {e}", env::AIRM_KV_TCP_SECRET),
            })?),
            (None, None) => None,
        };
        let insecure = match lookup(env::AIRM_KV_TCP_INSECURE_NO_AUTH) {
            Some(v) => parse_flag(env::AIRM_KV_TCP_INSECURE_NO_AUTH, &v)?,
            None => false,
        };
        match (&cfg.tcp_secret, insecure) {
            (None, false) if cfg.tcp_addr.is_some() => {
                return Err(KvError::Config {
                    detail: format!(
                        "the tcp transport needs the relay's shared secret in {} or {} \
                         ({}=1 runs it without authentication)",
                        env::AIRM_KV_TCP_SECRET_FILE,
                        env::AIRM_KV_TCP_SECRET,
                        env::AIRM_KV_TCP_INSECURE_NO_AUTH
                    ),
                });
            }
            (Some(_), true) => {
                return Err(KvError::Config {
                    detail: format!(
                        "{}=1 together with a relay secret: pick one",
                        env::AIRM_KV_TCP_INSECURE_NO_AUTH
                    ),
                });
            }
            (None, true) => {
                tracing::warn!(
                    "tcp transport: relay connections are NOT authenticated ({}=1)",
                    env::AIRM_KV_TCP_INSECURE_NO_AUTH
                );
            }
            _ => {}
        }
        cfg.tcp_tls = client_tls(&lookup, cfg.tcp_secret.as_ref())?;
        Ok(cfg)
    }
}

/// The `tcp` client's TLS from `AIRM_KV_TCP_TLS`, its CA file and name, and
/// the secret.
fn client_tls(
    lookup: &impl Fn(&str) -> Option<String>,
    secret: Option<&Secret>,
) -> Result<Option<ClientTls>, KvError> {
    let mode = match lookup(env::AIRM_KV_TCP_TLS) {
        Some(v) => v.parse::<TlsMode>().map_err(|e| KvError::Config {
            detail: format!("{}: {e}", env::AIRM_KV_TCP_TLS),
        })?,
        None => TlsMode::Auto,
    };
    let ca = lookup(env::AIRM_KV_TCP_TLS_CA_FILE);
    let name = lookup(env::AIRM_KV_TCP_TLS_SERVER_NAME);
    if name.is_some() && ca.is_none() {
        return Err(KvError::Config {
            detail: format!(
                "{} without {}: a server name is checked only against a CA",
                env::AIRM_KV_TCP_TLS_SERVER_NAME,
                env::AIRM_KV_TCP_TLS_CA_FILE
            ),
        });
    }
    match (mode, ca, secret) {
        (TlsMode::Off, Some(_), _) => Err(KvError::Config {
            detail: format!(
                "{}=off together with {}: pick one",
                env::AIRM_KV_TCP_TLS,
                env::AIRM_KV_TCP_TLS_CA_FILE
            ),
        }),
        (TlsMode::Off, None, _) | (TlsMode::Auto, None, None) => Ok(None),
        (TlsMode::Auto, Some(ca), _) => {
            ClientTls::from_ca_file(std::path::Path::new(&ca), name.as_deref()).map(Some)
        }
        (TlsMode::Auto, None, Some(secret)) => ClientTls::from_secret(secret).map(Some),
    }
}

/// Parses a positive number of seconds (fractions allowed).
pub(crate) fn parse_secs(name: &str, v: &str) -> Result<Duration, KvError> {
    // Negative, NaN, infinite or too large for a `Duration`: refused, never
    // a panic.
    match v
        .trim()
        .parse::<f64>()
        .ok()
        .and_then(|s| Duration::try_from_secs_f64(s).ok())
    {
        Some(d) if !d.is_zero() => Ok(d),
        _ => Err(KvError::Config {
            detail: format!("{name}={v:?}: expected a positive number of seconds"),
        }),
    }
}

/// Parses a positive number of milliseconds.
pub(crate) fn parse_ms(name: &str, v: &str) -> Result<Duration, KvError> {
    match v.trim().parse::<u64>() {
        Ok(ms) if ms > 0 => Ok(Duration::from_millis(ms)),
        _ => Err(KvError::Config {
            detail: format!("{name}={v:?}: expected a positive number of milliseconds"),
        }),
    }
}

/// Parses `0/1/true/false/yes/no/on/off`.
pub(crate) fn parse_flag(name: &str, v: &str) -> Result<bool, KvError> {
    match v.trim().to_ascii_lowercase().as_str() {
        "1" | "true" | "yes" | "on" => Ok(true),
        "0" | "false" | "no" | "off" => Ok(false),
        _ => Err(KvError::Config {
            detail: format!("{name}={v:?}: expected 0 or 1"),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    #[test]
    fn defaults_and_overrides() {
        let cfg = TransportConfig::from_lookup(|_| None).unwrap();
        assert_eq!(cfg, TransportConfig::default());
        assert_eq!(cfg.shm_root, PathBuf::from("/dev/shm/rngd_kv_cluster"));
        let vars: HashMap<&str, &str> = [
            (env::PD_SHM_ROOT, "/tmp/x"),
            (env::AIRM_KV_SHM_TTL_S, "2.5"),
            (env::AIRM_KV_SHM_SLOTS, "3"),
            (env::AIRM_KV_CLAIM_WINDOW_S, "0.5"),
            (env::AIRM_KV_TCP_ADDR, "10.0.0.1:7000"),
            (env::AIRM_KV_TCP_TTL_S, "5"),
            (env::AIRM_KV_TCP_CRC, "0"),
            (env::AIRM_KV_TCP_LOG, "1"),
            (env::AIRM_KV_TCP_SECRET, "worker-secret-0123456789\n"),
            (env::AIRM_KV_TCP_TIMEOUT_MS, "1500"),
            (env::AIRM_KV_NIXL_LIB_DIR, "/opt/nixl/lib"),
            (env::AIRM_KV_UCX_POOL_MB, "64"),
            (env::AIRM_KV_UCX_LOG, "1"),
        ]
        .into();
        let cfg = TransportConfig::from_lookup(|k| vars.get(k).map(|v| v.to_string())).unwrap();
        assert_eq!(cfg.shm_root, PathBuf::from("/tmp/x"));
        assert_eq!(cfg.shm_ttl, Duration::from_millis(2500));
        assert_eq!(cfg.shm_slots, 3);
        assert_eq!(cfg.claim_window, Duration::from_millis(500));
        assert_eq!(
            TransportConfig::default().claim_window_for(Duration::from_secs(2)),
            Duration::from_secs(2),
            "never more than the TTL"
        );
        for bad in ["-1", "257", "many"] {
            let err = TransportConfig::from_lookup(|k| {
                (k == env::AIRM_KV_SHM_SLOTS).then(|| bad.to_string())
            })
            .unwrap_err();
            assert!(err.to_string().contains("AIRM_KV_SHM_SLOTS"), "{err}");
        }
        assert_eq!(cfg.tcp_addr.as_deref(), Some("10.0.0.1:7000"));
        assert_eq!(cfg.tcp_ttl, Duration::from_secs(5));
        assert!(!cfg.tcp_crc);
        assert!(cfg.tcp_log);
        assert_eq!(
            cfg.tcp_secret,
            Some(Secret::new(*b"worker-secret-0123456789").unwrap())
        );
        assert_eq!(cfg.tcp_timeout, Duration::from_millis(1500));
        assert_eq!(cfg.nixl_lib_dir, Some(PathBuf::from("/opt/nixl/lib")));
        assert_eq!(cfg.nixl_plugin_dir, None);
        assert_eq!((cfg.ucx_pool_mb, cfg.ucx_log), (64, true));
        assert!(!format!("{cfg:?}").contains("worker-secret"), "{cfg:?}");
    }

    #[test]
    fn a_relay_address_needs_a_secret_or_the_explicit_insecure_flag() {
        let with = |vars: &[(&str, &str)]| {
            let vars: HashMap<&str, &str> = vars.iter().copied().collect();
            TransportConfig::from_lookup(|k| vars.get(k).map(|v| v.to_string()))
        };
        let addr = (env::AIRM_KV_TCP_ADDR, "10.0.0.1:7000");
        let err = with(&[addr]).unwrap_err().to_string();
        assert!(
            err.contains(env::AIRM_KV_TCP_SECRET)
                && err.contains(env::AIRM_KV_TCP_INSECURE_NO_AUTH),
            "{err}"
        );
        let cfg = with(&[addr, (env::AIRM_KV_TCP_INSECURE_NO_AUTH, "1")]).unwrap();
        assert_eq!(cfg.tcp_secret, None);
        // No relay address (an shm-only worker): nothing to authenticate.
        assert_eq!(with(&[]).unwrap().tcp_secret, None);
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("secret");
        std::fs::write(&path, "file-secret-0123456789").unwrap();
        let path = path.to_str().unwrap();
        let cfg = with(&[addr, (env::AIRM_KV_TCP_SECRET_FILE, path)]).unwrap();
        assert_eq!(
            cfg.tcp_secret,
            Some(Secret::new(*b"file-secret-0123456789").unwrap())
        );
        let both = with(&[
            addr,
            (env::AIRM_KV_TCP_SECRET_FILE, path),
            (env::AIRM_KV_TCP_SECRET, "worker-secret-0123456789"),
        ])
        .unwrap_err()
        .to_string();
        assert!(both.contains("once"), "{both}");
        let short = with(&[addr, (env::AIRM_KV_TCP_SECRET, "hunter2")])
            .unwrap_err()
            .to_string();
        assert!(
            short.contains(env::AIRM_KV_TCP_SECRET) && !short.contains("hunter2"),
            "{short}"
        );
    }

    #[test]
    fn tls_follows_the_secret_unless_turned_off_or_given_a_ca() {
        let with = |vars: &[(&str, &str)]| {
            let vars: HashMap<&str, &str> = vars.iter().copied().collect();
            TransportConfig::from_lookup(|k| vars.get(k).map(|v| v.to_string()))
        };
        let addr = (env::AIRM_KV_TCP_ADDR, "relay.ns.svc:7070");
        let secret = (env::AIRM_KV_TCP_SECRET, "worker-secret-0123456789");
        let s = Secret::parse(secret.1).unwrap();
        let keyed = with(&[addr, secret]).unwrap().tcp_tls;
        assert_eq!(keyed, Some(ClientTls::from_secret(&s).unwrap()));
        let off = with(&[addr, secret, (env::AIRM_KV_TCP_TLS, "off")]).unwrap();
        assert_eq!(off.tcp_tls, None);
        let insecure = with(&[addr, (env::AIRM_KV_TCP_INSECURE_NO_AUTH, "1")]).unwrap();
        assert_eq!(insecure.tcp_tls, None, "nothing to key it with");
        let bad = with(&[addr, secret, (env::AIRM_KV_TCP_TLS, "maybe")])
            .unwrap_err()
            .to_string();
        assert!(bad.contains(env::AIRM_KV_TCP_TLS), "{bad}");
        let name_alone = with(&[addr, secret, (env::AIRM_KV_TCP_TLS_SERVER_NAME, "relay")])
            .unwrap_err()
            .to_string();
        assert!(
            name_alone.contains(env::AIRM_KV_TCP_TLS_CA_FILE),
            "{name_alone}"
        );
        let dir = tempfile::tempdir().unwrap();
        let ca = dir.path().join("ca.crt");
        let c = rcgen::generate_simple_self_signed(vec!["relay".to_string()]).unwrap();
        std::fs::write(&ca, c.cert.pem()).unwrap();
        let ca = ca.to_str().unwrap();
        let by_ca = with(&[addr, secret, (env::AIRM_KV_TCP_TLS_CA_FILE, ca)]).unwrap();
        assert_ne!(by_ca.tcp_tls, keyed);
        assert!(format!("{:?}", by_ca.tcp_tls).contains("ca.crt"));
        let both = with(&[
            addr,
            secret,
            (env::AIRM_KV_TCP_TLS, "off"),
            (env::AIRM_KV_TCP_TLS_CA_FILE, ca),
        ])
        .unwrap_err()
        .to_string();
        assert!(both.contains("pick one"), "{both}");
    }

    #[test]
    fn bad_values_name_the_variable() {
        // Negative, not a number, too large for a duration, rounding to zero.
        for v in ["-3", "NaN", "inf", "1e300", "1e-12"] {
            let err = TransportConfig::from_lookup(|k| {
                (k == env::AIRM_KV_SHM_TTL_S).then(|| v.to_string())
            })
            .unwrap_err();
            assert!(
                err.to_string().contains(env::AIRM_KV_SHM_TTL_S),
                "{v}: {err}"
            );
        }
        let err =
            TransportConfig::from_lookup(|k| (k == env::AIRM_KV_TCP_CRC).then(|| "maybe".into()))
                .unwrap_err();
        assert!(err.to_string().contains(env::AIRM_KV_TCP_CRC), "{err}");
        let err =
            TransportConfig::from_lookup(|k| (k == env::AIRM_KV_UCX_POOL_MB).then(|| "0".into()))
                .unwrap_err();
        assert!(err.to_string().contains(env::AIRM_KV_UCX_POOL_MB), "{err}");
    }
}
