//! TLS of a public listener (the gateway's `--ssl-certfile` /
//! `--ssl-keyfile`, vLLM's flag names): a PEM certificate chain and private
//! key loaded once at start into a rustls server configuration offering
//! HTTP/1.1 over ALPN. The handshake runs on the connection's own task,
//! bounded by [`crate::Options::header_timeout`], under the connection cap.

use std::path::Path;
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

use crate::EdgeError;

/// A listener's TLS configuration (cheap to clone; equal when it is the
/// same loaded configuration).
#[derive(Clone)]
pub struct ServerTls {
    config: Arc<rustls::ServerConfig>,
    /// Where it came from, for logs and errors.
    origin: String,
}

// === impl ServerTls ===

impl ServerTls {
    /// Loads a PEM certificate chain (leaf first) and its PEM private key
    /// (PKCS#8, PKCS#1 or SEC1). A missing file, an empty chain, a key that
    /// does not parse or does not match the certificate is an error naming
    /// the file.
    pub fn from_pem_files(cert: &Path, key: &Path) -> Result<ServerTls, EdgeError> {
        let read =
            |p: &Path| std::fs::read(p).map_err(|e| tls_err(format!("reading {}", p.display()), e));
        let (cert_pem, key_pem) = (read(cert)?, read(key)?);
        let chain = CertificateDer::pem_slice_iter(&cert_pem)
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| tls_err(cert.display().to_string(), e))?;
        if chain.is_empty() {
            return Err(tls_err(
                cert.display().to_string(),
                "no PEM certificate in the file",
            ));
        }
        let key_der = PrivateKeyDer::from_pem_slice(&key_pem)
            .map_err(|e| tls_err(key.display().to_string(), e))?;
        Self::from_der(
            chain,
            key_der,
            format!("{} + {}", cert.display(), key.display()),
        )
    }

    /// A configuration from a DER chain and key (`origin` names them).
    pub fn from_der(
        chain: Vec<CertificateDer<'static>>,
        key: PrivateKeyDer<'static>,
        origin: String,
    ) -> Result<ServerTls, EdgeError> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut config = rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| tls_err(origin.clone(), e))?
            .with_no_client_auth()
            .with_single_cert(chain, key)
            .map_err(|e| tls_err(origin.clone(), e))?;
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(ServerTls {
            config: Arc::new(config),
            origin,
        })
    }

    /// The acceptor of a connection.
    pub(crate) fn acceptor(&self) -> tokio_rustls::TlsAcceptor {
        tokio_rustls::TlsAcceptor::from(self.config.clone())
    }

    /// Where the certificate and key came from.
    pub fn origin(&self) -> &str {
        &self.origin
    }
}

fn tls_err(
    context: String,
    source: impl Into<Box<dyn std::error::Error + Send + Sync>>,
) -> EdgeError {
    EdgeError::Tls {
        context,
        source: source.into(),
    }
}

impl PartialEq for ServerTls {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.config, &other.config)
    }
}

impl Eq for ServerTls {}

impl std::fmt::Debug for ServerTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerTls")
            .field("origin", &self.origin)
            .finish_non_exhaustive()
    }
}
