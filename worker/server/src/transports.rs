//! The KV transports a worker can use, created on first use by name.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use rngd_kv_transport::{KvError, KvTransport, TransportConfig};

/// Creates a transport by name (environment edge: shared memory, sockets).
pub trait TransportFactory: Send + Sync + 'static {
    /// The transport `name`.
    fn create(&self, name: &str) -> Result<Arc<dyn KvTransport>, KvError>;
}

/// The real factory: [`rngd_kv_transport::registry::by_name`] with one configuration.
#[derive(Debug, Clone)]
pub struct RegistryFactory {
    /// Configuration passed to every transport.
    pub config: TransportConfig,
}

impl TransportFactory for RegistryFactory {
    fn create(&self, name: &str) -> Result<Arc<dyn KvTransport>, KvError> {
        rngd_kv_transport::registry::by_name(name, &self.config)
    }
}

/// A fixed set of transport instances, looked up by [`KvTransport::name`] (tests, in-process use).
pub struct FixedFactory(Vec<Arc<dyn KvTransport>>);

impl TransportFactory for FixedFactory {
    fn create(&self, name: &str) -> Result<Arc<dyn KvTransport>, KvError> {
        self.0
            .iter()
            .find(|t| t.name() == name)
            .cloned()
            .ok_or_else(|| KvError::UnknownTransport {
                name: name.to_string(),
                known: self
                    .0
                    .iter()
                    .map(|t| t.name())
                    .collect::<Vec<_>>()
                    .join(", "),
            })
    }
}

/// The transports of one worker: a default name, a factory, and the instances made so far.
pub struct Transports {
    default: String,
    factory: Box<dyn TransportFactory>,
    made: Mutex<HashMap<String, Arc<dyn KvTransport>>>,
}

impl std::fmt::Debug for Transports {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Transports")
            .field("default", &self.default)
            .finish_non_exhaustive()
    }
}

impl Transports {
    /// Transports made by `factory`, `default` when a request names none.
    pub fn new(default: impl Into<String>, factory: impl TransportFactory) -> Self {
        Transports {
            default: default.into(),
            factory: Box::new(factory),
            made: Mutex::new(HashMap::new()),
        }
    }

    /// The registry's transports configured from the environment.
    pub fn from_env(default: impl Into<String>) -> Result<Self, KvError> {
        Ok(Self::new(
            default,
            RegistryFactory {
                config: TransportConfig::from_env()?,
            },
        ))
    }

    /// A fixed set of instances; the default is the first one's name.
    pub fn fixed(transports: Vec<Arc<dyn KvTransport>>) -> Self {
        let default = transports
            .first()
            .map(|t| t.name())
            .unwrap_or("shm")
            .to_string();
        Self::new(default, FixedFactory(transports))
    }

    /// Name used when a request names none.
    pub fn default_name(&self) -> &str {
        &self.default
    }

    /// The instances made so far (nothing is created).
    pub fn made(&self) -> Vec<Arc<dyn KvTransport>> {
        let made = self.made.lock().unwrap_or_else(|p| p.into_inner());
        made.values().cloned().collect()
    }

    /// The transport `name` (or the default), created on first use.
    pub fn get(&self, name: Option<&str>) -> Result<Arc<dyn KvTransport>, KvError> {
        let name = name
            .map(str::trim)
            .filter(|n| !n.is_empty())
            .unwrap_or(&self.default);
        let mut made = self.made.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(t) = made.get(name) {
            return Ok(t.clone());
        }
        let t = self.factory.create(name)?;
        made.insert(name.to_string(), t.clone());
        Ok(t)
    }
}
