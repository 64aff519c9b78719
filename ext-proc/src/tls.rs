//! TLS of the ext_proc gRPC listener, as the reference endpoint picker serves
//! it (`--secure-serving`, `--cert-path`): the certificate (self-signed at
//! start, or `tls.crt` / `tls.key` from a directory, reloaded when the files
//! change), the rustls server configuration (ALPN `h2`) and the connection
//! type the serving threads hand to tonic (plain TCP or TLS over TCP). The
//! handshake runs on the thread that serves the connection
//! ([`crate::server::GrpcServing`]); a reload takes effect for new connections.

use std::io;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::{Arc, RwLock};
use std::task::{Context, Poll};
use std::time::Duration;

use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use sha2::{Digest, Sha256};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio_rustls::TlsAcceptor;
use tokio_rustls::server::TlsStream;
use tonic::transport::server::{Connected, TcpConnectInfo};

use crate::ExtProcError;

/// Certificate file inside a `--cert-path` directory (PEM, leaf first).
pub const CERT_FILE: &str = "tls.crt";
/// Private key file inside a `--cert-path` directory (PEM, PKCS#8, PKCS#1 or SEC1).
pub const KEY_FILE: &str = "tls.key";
/// Default poll interval of a certificate directory.
pub const DEFAULT_CERT_POLL: Duration = Duration::from_secs(1);
/// How long a client may take to finish the TLS handshake.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// How the ext_proc gRPC listener is secured.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TlsChoice {
    /// Plaintext HTTP/2 (`--secure-serving=false`).
    Plaintext,
    /// TLS with a self-signed certificate generated at start (SANs
    /// `localhost`, `127.0.0.1` and the host name when known); its SHA-256
    /// fingerprint is logged.
    SelfSigned,
    /// TLS with `tls.crt` / `tls.key` of `dir`, re-read every `poll`; a
    /// changed pair that does not load keeps the previous one (logged).
    CertDir {
        /// The directory (e.g. a mounted Kubernetes TLS Secret).
        dir: PathBuf,
        /// Poll interval of the two files.
        poll: Duration,
    },
}

impl TlsChoice {
    /// The flags' meaning: `secure` false = plaintext; else the directory if
    /// given, else self-signed.
    pub fn from_flags(secure: bool, cert_path: Option<PathBuf>, poll: Duration) -> Self {
        match (secure, cert_path) {
            (false, _) => TlsChoice::Plaintext,
            (true, None) => TlsChoice::SelfSigned,
            (true, Some(dir)) => TlsChoice::CertDir { dir, poll },
        }
    }

    /// The server TLS state; `None` for plaintext. A certificate directory
    /// is watched by a task on the calling runtime, stopped when the
    /// returned value is dropped.
    pub fn start(&self) -> Result<Option<Arc<ServerTls>>, ExtProcError> {
        match self {
            TlsChoice::Plaintext => Ok(None),
            TlsChoice::SelfSigned => Ok(Some(ServerTls::self_signed()?)),
            TlsChoice::CertDir { dir, poll } => Ok(Some(ServerTls::from_dir(dir, *poll)?)),
        }
    }
}

/// The current certificate, swapped on reload.
#[derive(Debug)]
struct Holder {
    current: RwLock<Loaded>,
}

#[derive(Debug, Clone)]
struct Loaded {
    key: Arc<CertifiedKey>,
    cert_pem: String,
}

impl ResolvesServerCert for Holder {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(Arc::clone(&self.current.read().ok()?.key))
    }
}

/// The TLS state of a serving picker: the acceptor (shared by every serving
/// thread) and the certificate it presents.
#[derive(Debug)]
pub struct ServerTls {
    holder: Arc<Holder>,
    config: Arc<rustls::ServerConfig>,
    watch: Option<tokio::task::JoinHandle<()>>,
}

impl Drop for ServerTls {
    fn drop(&mut self) {
        if let Some(w) = &self.watch {
            w.abort();
        }
    }
}

fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn tls_err(what: impl Into<String>, e: impl std::fmt::Display) -> ExtProcError {
    ExtProcError::Tls {
        what: what.into(),
        reason: e.to_string(),
    }
}

/// SHA-256 of a DER certificate, `AB:CD:…`.
pub fn fingerprint(der: &[u8]) -> String {
    Sha256::digest(der)
        .iter()
        .map(|b| format!("{b:02X}"))
        .collect::<Vec<_>>()
        .join(":")
}

/// The host name to put in a self-signed certificate (`$HOSTNAME`, else the
/// kernel's), if it is a plausible DNS name.
fn host_name() -> Option<String> {
    let name = std::env::var("HOSTNAME")
        .ok()
        .or_else(|| std::fs::read_to_string("/proc/sys/kernel/hostname").ok())?;
    let name = name.trim().to_ascii_lowercase();
    let ok = !name.is_empty()
        && name.len() <= 253
        && name != "localhost"
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '.');
    ok.then_some(name)
}

/// Parses a PEM certificate chain and key into what rustls presents.
fn load_pair(cert_pem: &[u8], key_pem: &[u8], what: &str) -> Result<Loaded, ExtProcError> {
    let chain = CertificateDer::pem_slice_iter(cert_pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| tls_err(format!("{what}: certificate"), e))?;
    if chain.is_empty() {
        return Err(tls_err(what, "no certificate in the PEM"));
    }
    let key =
        PrivateKeyDer::from_pem_slice(key_pem).map_err(|e| tls_err(format!("{what}: key"), e))?;
    let key = CertifiedKey::from_der(chain, key, &provider()).map_err(|e| tls_err(what, e))?;
    Ok(Loaded {
        key: Arc::new(key),
        cert_pem: String::from_utf8_lossy(cert_pem).into_owned(),
    })
}

impl ServerTls {
    fn with(
        loaded: Loaded,
        watch: Option<tokio::task::JoinHandle<()>>,
    ) -> Result<Self, ExtProcError> {
        let holder = Arc::new(Holder {
            current: RwLock::new(loaded),
        });
        let mut cfg = rustls::ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| tls_err("server config", e))?
            .with_no_client_auth()
            .with_cert_resolver(Arc::clone(&holder) as Arc<dyn ResolvesServerCert>);
        cfg.alpn_protocols = vec![b"h2".to_vec()];
        Ok(ServerTls {
            holder,
            config: Arc::new(cfg),
            watch,
        })
    }

    /// A self-signed certificate for `localhost`, `127.0.0.1` and the host
    /// name; logs its fingerprint (never the key).
    pub fn self_signed() -> Result<Arc<Self>, ExtProcError> {
        let mut names = vec!["localhost".to_string(), "127.0.0.1".to_string()];
        names.extend(host_name());
        let generated = rcgen::generate_simple_self_signed(names.clone())
            .or_else(|_| rcgen::generate_simple_self_signed(names[..2].to_vec()))
            .map_err(|e| tls_err("self-signed certificate", e))?;
        let cert_pem = generated.cert.pem();
        let key_pem = generated.signing_key.serialize_pem();
        let loaded = load_pair(
            cert_pem.as_bytes(),
            key_pem.as_bytes(),
            "self-signed certificate",
        )?;
        tracing::info!(
            sha256 = %fingerprint(generated.cert.der()),
            sans = ?names,
            "ext_proc TLS: self-signed certificate generated"
        );
        Ok(Arc::new(Self::with(loaded, None)?))
    }

    /// `dir/tls.crt` and `dir/tls.key`, re-read every `poll` by a task on
    /// the calling runtime; the first load must succeed.
    pub fn from_dir(dir: &Path, poll: Duration) -> Result<Arc<Self>, ExtProcError> {
        let (crt, key) = (dir.join(CERT_FILE), dir.join(KEY_FILE));
        let read = |p: &Path| {
            std::fs::read(p).map_err(|source| ExtProcError::Read {
                path: p.to_path_buf(),
                source,
            })
        };
        let mut seen = (read(&crt)?, read(&key)?);
        let what = dir.display().to_string();
        let loaded = load_pair(&seen.0, &seen.1, &what)?;
        log_loaded(&what, &loaded, "loaded");
        let mut tls = Self::with(loaded, None)?;
        let holder = Arc::clone(&tls.holder);
        tls.watch = Some(tokio::spawn(async move {
            let mut tick = tokio::time::interval(poll.max(Duration::from_millis(10)));
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                let (Ok(c), Ok(k)) = (std::fs::read(&crt), std::fs::read(&key)) else {
                    continue; // mid-swap or gone: keep serving the current pair
                };
                if (&c, &k) == (&seen.0, &seen.1) {
                    continue;
                }
                match load_pair(&c, &k, &what) {
                    Ok(loaded) => {
                        log_loaded(&what, &loaded, "reloaded");
                        if let Ok(mut cur) = holder.current.write() {
                            *cur = loaded;
                        }
                    }
                    Err(e) => tracing::warn!(
                        error = %e,
                        "ext_proc TLS: the changed certificate pair does not load; keeping the previous one"
                    ),
                }
                seen = (c, k);
            }
        }));
        Ok(Arc::new(tls))
    }

    /// The PEM of the certificate presented to new connections.
    pub fn certificate_pem(&self) -> String {
        self.holder
            .current
            .read()
            .map(|c| c.cert_pem.clone())
            .unwrap_or_default()
    }

    /// The acceptor (handshake with ALPN `h2`, current certificate).
    pub fn acceptor(&self) -> TlsAcceptor {
        TlsAcceptor::from(Arc::clone(&self.config))
    }
}

fn log_loaded(what: &str, loaded: &Loaded, how: &str) {
    let sha = loaded
        .key
        .cert
        .first()
        .map(|c| fingerprint(c))
        .unwrap_or_default();
    tracing::info!(dir = what, sha256 = %sha, "ext_proc TLS: certificate {how}");
}

/// One served ext_proc connection: plain TCP or TLS over TCP.
#[derive(Debug)]
pub enum Conn {
    /// Plaintext HTTP/2.
    Plain(TcpStream),
    /// HTTP/2 over TLS (the handshake done).
    Tls(Box<TlsStream<TcpStream>>),
}

impl Conn {
    /// `stream` as served: as is without TLS, else after the handshake
    /// (bounded by [`HANDSHAKE_TIMEOUT`]).
    pub async fn accept(stream: TcpStream, tls: Option<&ServerTls>) -> io::Result<Self> {
        match tls {
            None => Ok(Conn::Plain(stream)),
            Some(t) => {
                let s = tokio::time::timeout(HANDSHAKE_TIMEOUT, t.acceptor().accept(stream))
                    .await
                    .map_err(|_| {
                        io::Error::new(io::ErrorKind::TimedOut, "TLS handshake timed out")
                    })??;
                Ok(Conn::Tls(Box::new(s)))
            }
        }
    }
}

impl Connected for Conn {
    type ConnectInfo = TcpConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        match self {
            Conn::Plain(s) => s.connect_info(),
            Conn::Tls(s) => s.get_ref().0.connect_info(),
        }
    }
}

impl AsyncRead for Conn {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Conn::Plain(s) => Pin::new(s).poll_read(cx, buf),
            Conn::Tls(s) => Pin::new(s.as_mut()).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for Conn {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Conn::Plain(s) => Pin::new(s).poll_write(cx, buf),
            Conn::Tls(s) => Pin::new(s.as_mut()).poll_write(cx, buf),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Conn::Plain(s) => Pin::new(s).poll_write_vectored(cx, bufs),
            Conn::Tls(s) => Pin::new(s.as_mut()).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            Conn::Plain(s) => s.is_write_vectored(),
            Conn::Tls(s) => s.is_write_vectored(),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Conn::Plain(s) => Pin::new(s).poll_flush(cx),
            Conn::Tls(s) => Pin::new(s.as_mut()).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Conn::Plain(s) => Pin::new(s).poll_shutdown(cx),
            Conn::Tls(s) => Pin::new(s.as_mut()).poll_shutdown(cx),
        }
    }
}
