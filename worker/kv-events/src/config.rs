//! `--kv-events-config`: vLLM's `KVEventsConfig` JSON, parsed into
//! [`KvEventsConfig`] with vLLM's keys and defaults; an unknown key is refused
//! by name.

use serde::Deserialize;

use crate::KvEventsError;

/// vLLM's default PUB endpoint (`tcp://*:5557`: every interface).
pub const DEFAULT_ENDPOINT: &str = "tcp://*:5557";
/// vLLM's default number of batches kept for replay.
pub const DEFAULT_BUFFER_STEPS: usize = 10_000;
/// vLLM's default ZMQ high-water mark of the PUB socket.
pub const DEFAULT_HWM: i32 = 100_000;
/// vLLM's default publish-queue bound (batches waiting for the publisher thread).
pub const DEFAULT_MAX_QUEUE_SIZE: usize = 100_000;

/// Which publisher vLLM's `publisher` key names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PublisherKind {
    /// Events are dropped (vLLM's `NullEventPublisher`).
    Null,
    /// ZMQ PUB (+ ROUTER replay).
    Zmq,
}

/// The KV-event publisher's options: vLLM's `KVEventsConfig`, same keys, same
/// defaults.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KvEventsConfig {
    /// Publish events at all (vLLM's `enable_kv_cache_events`, default false).
    #[serde(default)]
    pub enable_kv_cache_events: bool,
    /// `"zmq"` or `"null"`; unset means `"zmq"` when events are enabled
    /// (vLLM's rule).
    #[serde(default)]
    pub publisher: Option<PublisherKind>,
    /// The PUB socket's endpoint. As in vLLM, an endpoint with `*` or `::`, or
    /// an `ipc://` / `inproc://` one, is bound (`tcp://*:5557` binds every
    /// interface; `tcp://127.0.0.1:*` binds loopback on a free port); any
    /// other (`tcp://host:port`) is connected to.
    #[serde(default = "default_endpoint")]
    pub endpoint: String,
    /// The ROUTER replay socket's endpoint (always bound); none: no replay.
    #[serde(default)]
    pub replay_endpoint: Option<String>,
    /// Batches kept for replay (the oldest is dropped past this), at least 1.
    #[serde(default = "default_buffer_steps")]
    pub buffer_steps: usize,
    /// The PUB socket's ZMQ send high-water mark per subscriber (messages
    /// queued for a slow subscriber before ZMQ drops for it).
    #[serde(default = "default_hwm")]
    pub hwm: i32,
    /// Events waiting for the publisher thread, at most; past this an event
    /// is dropped and counted (the engine never waits).
    #[serde(default = "default_max_queue_size")]
    pub max_queue_size: usize,
    /// The topic frame of every message (subscribers filter on its prefix).
    #[serde(default)]
    pub topic: String,
}

fn default_endpoint() -> String {
    DEFAULT_ENDPOINT.into()
}
fn default_buffer_steps() -> usize {
    DEFAULT_BUFFER_STEPS
}
fn default_hwm() -> i32 {
    DEFAULT_HWM
}
fn default_max_queue_size() -> usize {
    DEFAULT_MAX_QUEUE_SIZE
}

impl Default for KvEventsConfig {
    fn default() -> Self {
        KvEventsConfig {
            enable_kv_cache_events: false,
            publisher: None,
            endpoint: default_endpoint(),
            replay_endpoint: None,
            buffer_steps: DEFAULT_BUFFER_STEPS,
            hwm: DEFAULT_HWM,
            max_queue_size: DEFAULT_MAX_QUEUE_SIZE,
            topic: String::new(),
        }
    }
}

impl KvEventsConfig {
    /// Parses the flag's JSON; unknown keys, wrong types and out-of-range
    /// numbers are refused with the key's name.
    pub fn parse(json: &str) -> Result<Self, KvEventsError> {
        let c: KvEventsConfig =
            serde_json::from_str(json).map_err(|source| KvEventsError::Config {
                message: "--kv-events-config is not a valid KVEventsConfig".into(),
                source: Some(source),
            })?;
        c.check()?;
        Ok(c)
    }

    /// The publisher this configuration asks for (vLLM's rule: disabled or
    /// `"null"` publishes nothing; unset means `"zmq"`).
    pub fn effective_publisher(&self) -> PublisherKind {
        match (self.enable_kv_cache_events, self.publisher) {
            (false, _) => PublisherKind::Null,
            (true, None) => PublisherKind::Zmq,
            (true, Some(p)) => p,
        }
    }

    /// The bounds vLLM's config model enforces.
    pub fn check(&self) -> Result<(), KvEventsError> {
        let bad = |key: &str, why: &str| KvEventsError::Config {
            message: format!("--kv-events-config: {key} {why}"),
            source: None,
        };
        if self.buffer_steps == 0 {
            return Err(bad("buffer_steps", "must be at least 1"));
        }
        if self.hwm < 0 {
            return Err(bad("hwm", "must not be negative"));
        }
        if self.max_queue_size == 0 {
            return Err(bad("max_queue_size", "must be at least 1"));
        }
        if self.endpoint.is_empty() {
            return Err(bad("endpoint", "must not be empty"));
        }
        if self.replay_endpoint.as_deref() == Some("") {
            return Err(bad("replay_endpoint", "must not be empty"));
        }
        Ok(())
    }
}

/// vLLM's rule for the PUB socket: bind when the endpoint has `*` or `::`
/// or is `ipc://` / `inproc://`, connect otherwise.
pub fn binds(endpoint: &str) -> bool {
    endpoint.contains('*')
        || endpoint.contains("::")
        || endpoint.starts_with("ipc://")
        || endpoint.starts_with("inproc://")
}
