//! TLS of the relay's connections (rustls over ring, TLS 1.3 only): where
//! the keys come from, the rustls configurations of both sides, and the
//! boxed stream halves every connection is read and written through (plain
//! or TLS alike).
//!
//! Two sources of keys:
//! - **the deployment's shared secret** (the default whenever a secret is
//!   configured): the relay's Ed25519 key is derived from the secret
//!   ([`Secret::derive`] with its own label), and it presents the bare
//!   public key (RFC 7250 raw public keys); a client derives the same key
//!   and accepts exactly that one. Nothing else to distribute, and nobody
//!   without the secret can stand in for the relay.
//! - **a mounted certificate** (e.g. cert-manager's `tls.crt`/`tls.key` on
//!   the relay, `ca.crt` on the workers): ordinary WebPKI verification of
//!   the relay's name against the given roots.
//!
//! Either way the frame handshake (the shared-secret MACs) still runs
//! inside TLS, so the client is authenticated as before. No session tickets
//! and no resumption: connections are pooled and long-lived.

use std::fmt;
use std::io;
use std::path::Path;
use std::sync::Arc;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::{CryptoProvider, WebPkiSupportedAlgorithms};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{
    CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer, ServerName, SubjectPublicKeyInfoDer,
    UnixTime,
};
use rustls::sign::CertifiedKey;
use rustls::{DigitallySignedStruct, SignatureScheme};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;

use crate::KvError;
use crate::frame::Secret;

/// The label under which the relay's TLS key is derived from the secret
/// (no other use of the secret shares it).
const KEY_LABEL: &[u8] = b"rngd-pd kv relay tls ed25519 key v1";
/// The name a client asks for when the key comes from the secret (not
/// checked: the key itself is pinned; SNI is not sent).
const SECRET_NAME: &str = "rngd-pd-relay";
/// PKCS#8 v1 prefix of an Ed25519 private key (RFC 8410), before its
/// 32-byte seed.
const ED25519_PKCS8_PREFIX: [u8; 16] = [
    0x30, 0x2e, 0x02, 0x01, 0x00, 0x30, 0x05, 0x06, 0x03, 0x2b, 0x65, 0x70, 0x04, 0x22, 0x04, 0x20,
];

/// The read half of a relay connection, plain or TLS.
pub(crate) type BoxRead = Box<dyn AsyncRead + Send + Sync + Unpin>;
/// The write half of a relay connection, plain or TLS.
pub(crate) type BoxWrite = Box<dyn AsyncWrite + Send + Sync + Unpin>;

/// Splits a plain connection into boxed halves.
pub(crate) fn split_plain(stream: TcpStream) -> (BoxRead, BoxWrite) {
    let (rd, wr) = stream.into_split();
    (Box::new(rd), Box::new(wr))
}

/// Splits a TLS connection into boxed halves.
fn split_tls<S: AsyncRead + AsyncWrite + Send + Sync + Unpin + 'static>(
    s: S,
) -> (BoxRead, BoxWrite) {
    let (rd, wr) = tokio::io::split(s);
    (Box::new(rd), Box::new(wr))
}

fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn config_err(detail: String) -> KvError {
    KvError::Config { detail }
}

/// The relay's Ed25519 key derived from `secret`, as rustls takes it, and
/// its public key (SubjectPublicKeyInfo, DER).
fn secret_key(secret: &Secret) -> Result<(Arc<dyn rustls::sign::SigningKey>, Vec<u8>), KvError> {
    let seed = secret.derive(KEY_LABEL);
    let mut pkcs8 = ED25519_PKCS8_PREFIX.to_vec();
    pkcs8.extend_from_slice(&seed);
    let key = provider()
        .key_provider
        .load_private_key(PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(pkcs8)))
        .map_err(|e| config_err(format!("deriving the relay's TLS key: {e}")))?;
    let spki = key
        .public_key()
        .ok_or_else(|| config_err("the derived TLS key has no public key".into()))?
        .as_ref()
        .to_vec();
    Ok((key, spki))
}

// === impl TlsMode ===

/// Whether a relay or a relay client uses TLS (`--tls` of `rngd-pd relay`,
/// `AIRM_KV_TCP_TLS` of a worker).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum TlsMode {
    /// TLS whenever there is something to key it with: mounted files if
    /// given, else the shared secret; plaintext only without either (which
    /// needs `--insecure-no-auth`).
    #[default]
    Auto,
    /// Plaintext even with a secret (the secret still authenticates): for a
    /// relay reached only over a trusted link, where the TLS cost is not
    /// worth paying (docs/kv-wire.md measures it).
    Off,
}

impl std::str::FromStr for TlsMode {
    type Err = KvError;

    fn from_str(s: &str) -> Result<TlsMode, KvError> {
        match s.trim() {
            "auto" | "on" | "1" => Ok(TlsMode::Auto),
            "off" | "0" => Ok(TlsMode::Off),
            other => Err(config_err(format!(
                "relay TLS {other:?}: expected `auto` (TLS keyed by the certificate files \
                 or the shared secret) or `off`"
            ))),
        }
    }
}

// === impl ServerTls ===

/// The relay's TLS (cheap to clone).
#[derive(Clone)]
pub struct ServerTls {
    acceptor: tokio_rustls::TlsAcceptor,
    /// Where the key came from, for logs.
    origin: String,
    /// What it presents (the public key, or the certificate chain, DER):
    /// two configurations are equal when they present the same.
    presents: Vec<u8>,
}

impl fmt::Debug for ServerTls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ServerTls")
            .field("origin", &self.origin)
            .finish_non_exhaustive()
    }
}

impl PartialEq for ServerTls {
    fn eq(&self, other: &ServerTls) -> bool {
        self.origin == other.origin && self.presents == other.presents
    }
}

impl Eq for ServerTls {}

impl ServerTls {
    /// TLS with the key derived from the deployment's shared secret,
    /// presented as a raw public key.
    pub fn from_secret(secret: &Secret) -> Result<ServerTls, KvError> {
        let (key, spki) = secret_key(secret)?;
        let presents = spki.clone();
        let certified = CertifiedKey::new(vec![CertificateDer::from(spki)], key);
        let resolver = rustls::server::AlwaysResolvesServerRawPublicKeys::new(Arc::new(certified));
        let config = server_builder()?
            .with_no_client_auth()
            .with_cert_resolver(Arc::new(resolver));
        Ok(Self::finish(
            config,
            "the key derived from the shared secret",
            presents,
        ))
    }

    /// TLS with a mounted PEM certificate chain (leaf first) and its PEM
    /// private key. Errors name the file, never its contents.
    pub fn from_pem_files(cert: &Path, key: &Path) -> Result<ServerTls, KvError> {
        let chain = read_certs(cert)?;
        let presents = chain.iter().flat_map(|c| c.as_ref().to_vec()).collect();
        let key_pem = read_file(key)?;
        let key_der = PrivateKeyDer::from_pem_slice(&key_pem).map_err(|e| {
            config_err(format!("{}: no usable PEM private key: {e}", key.display()))
        })?;
        let config = server_builder()?
            .with_no_client_auth()
            .with_single_cert(chain, key_der)
            .map_err(|e| {
                config_err(format!(
                    "{} and {}: the key does not fit the certificate: {e}",
                    cert.display(),
                    key.display()
                ))
            })?;
        Ok(Self::finish(
            config,
            &format!("the certificate {}", cert.display()),
            presents,
        ))
    }

    fn finish(mut config: rustls::ServerConfig, origin: &str, presents: Vec<u8>) -> ServerTls {
        config.send_tls13_tickets = 0;
        config.session_storage = Arc::new(rustls::server::NoServerSessionStorage {});
        ServerTls {
            acceptor: tokio_rustls::TlsAcceptor::from(Arc::new(config)),
            origin: origin.to_string(),
            presents,
        }
    }

    /// Where the key came from (for the start-up log).
    pub fn origin(&self) -> &str {
        &self.origin
    }

    /// The server side of the TLS handshake on an accepted socket.
    pub(crate) async fn accept(&self, stream: TcpStream) -> io::Result<(BoxRead, BoxWrite)> {
        let tls = self.acceptor.accept(stream).await?;
        Ok(split_tls(tls))
    }
}

fn server_builder()
-> Result<rustls::ConfigBuilder<rustls::ServerConfig, rustls::WantsVerifier>, KvError> {
    rustls::ServerConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(|e| config_err(format!("the relay's TLS configuration: {e}")))
}

fn client_builder()
-> Result<rustls::ConfigBuilder<rustls::ClientConfig, rustls::WantsVerifier>, KvError> {
    rustls::ClientConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(|e| config_err(format!("the relay client's TLS configuration: {e}")))
}

fn read_file(path: &Path) -> Result<Vec<u8>, KvError> {
    std::fs::read(path).map_err(|e| config_err(format!("reading {}: {e}", path.display())))
}

fn read_certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, KvError> {
    let pem = read_file(path)?;
    let certs = CertificateDer::pem_slice_iter(&pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| config_err(format!("{}: {e}", path.display())))?;
    if certs.is_empty() {
        return Err(config_err(format!(
            "{}: no PEM certificate in the file",
            path.display()
        )));
    }
    Ok(certs)
}

// === impl ClientTls ===

/// A relay client's TLS (cheap to clone).
#[derive(Clone)]
pub struct ClientTls {
    connector: tokio_rustls::TlsConnector,
    /// The name to verify (`None`: the host of the relay address).
    name: Option<ServerName<'static>>,
    /// Where the trust came from, for logs.
    origin: String,
    /// What it trusts (the pinned public key, or the roots, DER): two
    /// configurations are equal when they trust the same for one name.
    trusts: Vec<u8>,
}

impl fmt::Debug for ClientTls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ClientTls")
            .field("origin", &self.origin)
            .finish_non_exhaustive()
    }
}

impl PartialEq for ClientTls {
    fn eq(&self, other: &ClientTls) -> bool {
        self.origin == other.origin && self.trusts == other.trusts && self.name == other.name
    }
}

impl Eq for ClientTls {}

impl ClientTls {
    /// Trusts exactly the relay key derived from `secret`.
    pub fn from_secret(secret: &Secret) -> Result<ClientTls, KvError> {
        let (_, spki) = secret_key(secret)?;
        let trusts = spki.clone();
        let verifier = PinnedKey {
            spki,
            algorithms: provider().signature_verification_algorithms,
        };
        let mut config = client_builder()?
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(verifier))
            .with_no_client_auth();
        config.enable_sni = false;
        config.resumption = rustls::client::Resumption::disabled();
        Ok(ClientTls {
            connector: tokio_rustls::TlsConnector::from(Arc::new(config)),
            name: Some(ServerName::try_from(SECRET_NAME).expect("a valid DNS name")),
            origin: "the key derived from the shared secret".into(),
            trusts,
        })
    }

    /// Trusts relays whose certificate chains to a root in the PEM file
    /// `ca`, for `name` (`None`: the host of the relay address).
    pub fn from_ca_file(ca: &Path, name: Option<&str>) -> Result<ClientTls, KvError> {
        let mut roots = rustls::RootCertStore::empty();
        let certs = read_certs(ca)?;
        let trusts = certs.iter().flat_map(|c| c.as_ref().to_vec()).collect();
        for cert in certs {
            roots
                .add(cert)
                .map_err(|e| config_err(format!("{}: {e}", ca.display())))?;
        }
        let name = name
            .map(|n| {
                ServerName::try_from(n.to_string())
                    .map_err(|e| config_err(format!("relay TLS server name {n:?}: {e}")))
            })
            .transpose()?;
        let mut config = client_builder()?
            .with_root_certificates(roots)
            .with_no_client_auth();
        config.resumption = rustls::client::Resumption::disabled();
        Ok(ClientTls {
            connector: tokio_rustls::TlsConnector::from(Arc::new(config)),
            name,
            origin: format!("the roots in {}", ca.display()),
            trusts,
        })
    }

    /// The client side of the TLS handshake with the relay at `addr`
    /// (`host:port`) on a connected socket.
    pub(crate) async fn connect(
        &self,
        addr: &str,
        stream: TcpStream,
    ) -> io::Result<(BoxRead, BoxWrite)> {
        let name = match &self.name {
            Some(n) => n.clone(),
            None => ServerName::try_from(host_of(addr).to_string())
                .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?,
        };
        let tls = self.connector.connect(name, stream).await?;
        Ok(split_tls(tls))
    }
}

/// The host part of `host:port` (brackets of an IPv6 literal dropped).
fn host_of(addr: &str) -> &str {
    let host = match addr.rsplit_once(':') {
        Some((h, port)) if port.bytes().all(|b| b.is_ascii_digit()) => h,
        _ => addr,
    };
    host.trim_start_matches('[').trim_end_matches(']')
}

/// What a failed TLS handshake with the relay means to the client, from
/// rustls's error inside the I/O error.
pub(crate) fn client_failure(e: &io::Error) -> TlsFailure {
    let Some(inner) = e.get_ref().and_then(|i| i.downcast_ref::<rustls::Error>()) else {
        return TlsFailure::Io;
    };
    match inner {
        rustls::Error::InvalidCertificate(_) | rustls::Error::AlertReceived(_) => {
            TlsFailure::Untrusted
        }
        rustls::Error::InvalidMessage(_) | rustls::Error::InappropriateHandshakeMessage { .. } => {
            TlsFailure::NotTls
        }
        _ => TlsFailure::Io,
    }
}

/// The kinds of [`client_failure`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum TlsFailure {
    /// The relay's key or certificate is not the trusted one (or the relay
    /// refused ours): an authentication failure.
    Untrusted,
    /// The relay did not answer in TLS (it runs without it).
    NotTls,
    /// The connection failed or closed during the handshake.
    Io,
}

// === impl PinnedKey ===

/// Accepts exactly one raw public key (the one derived from the secret).
#[derive(Debug)]
struct PinnedKey {
    spki: Vec<u8>,
    algorithms: WebPkiSupportedAlgorithms,
}

impl ServerCertVerifier for PinnedKey {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        _name: &ServerName<'_>,
        _ocsp: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        if intermediates.is_empty() && end_entity.as_ref() == self.spki.as_slice() {
            Ok(ServerCertVerified::assertion())
        } else {
            Err(rustls::Error::InvalidCertificate(
                rustls::CertificateError::ApplicationVerificationFailure,
            ))
        }
    }

    fn verify_tls12_signature(
        &self,
        _message: &[u8],
        _cert: &CertificateDer<'_>,
        _dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        // Only TLS 1.3 is offered; a TLS 1.2 signature is a misbehaving peer.
        Err(rustls::Error::PeerIncompatible(
            rustls::PeerIncompatible::Tls12NotOffered,
        ))
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature_with_raw_key(
            message,
            &SubjectPublicKeyInfoDer::from(cert.as_ref()),
            dss,
            &self.algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.algorithms.supported_schemes()
    }

    fn requires_raw_public_keys(&self) -> bool {
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_derived_key_depends_on_the_secret_only() {
        let a = Secret::new(*b"relay-secret-0123456789").unwrap();
        let b = Secret::new(*b"relay-secret-0123456780").unwrap();
        let (_, spki_a) = secret_key(&a).unwrap();
        let (_, again) = secret_key(&a).unwrap();
        let (_, spki_b) = secret_key(&b).unwrap();
        assert_eq!(spki_a, again);
        assert_ne!(spki_a, spki_b);
        // An Ed25519 SubjectPublicKeyInfo: 12 bytes of header, 32 of key.
        assert_eq!(spki_a.len(), 44);
        assert!(!format!("{:?}", ClientTls::from_secret(&a).unwrap()).contains("relay-secret"));
        // Equal when they trust or present the same key, whatever the origin.
        assert_eq!(
            ClientTls::from_secret(&a).unwrap(),
            ClientTls::from_secret(&a).unwrap()
        );
        assert_ne!(
            ClientTls::from_secret(&a).unwrap(),
            ClientTls::from_secret(&b).unwrap()
        );
        assert_eq!(
            ServerTls::from_secret(&a).unwrap(),
            ServerTls::from_secret(&a).unwrap()
        );
        assert_ne!(
            ServerTls::from_secret(&a).unwrap(),
            ServerTls::from_secret(&b).unwrap()
        );
    }

    #[test]
    fn the_host_of_an_address() {
        assert_eq!(host_of("relay.ns.svc:7070"), "relay.ns.svc");
        assert_eq!(host_of("[::1]:7070"), "::1");
        assert_eq!(host_of("10.0.0.1:7070"), "10.0.0.1");
        assert_eq!(host_of("relay"), "relay");
    }

    #[test]
    fn missing_or_empty_pem_files_name_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let empty = dir.path().join("empty.pem");
        std::fs::write(&empty, "nothing here\n").unwrap();
        let e = ClientTls::from_ca_file(&empty, None)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("empty.pem") && e.contains("no PEM certificate"),
            "{e}"
        );
        let e = ServerTls::from_pem_files(&dir.path().join("nope.crt"), &empty)
            .unwrap_err()
            .to_string();
        assert!(e.contains("nope.crt"), "{e}");
    }
}
