//! Flag groups and parsers several subcommands share, so a meaning has one
//! name and one help text everywhere: the model flags ([`ModelArgs`]), the
//! listener limits ([`ListenerArgs`]), the API key's parser and durations
//! given in seconds.

use std::path::PathBuf;
use std::time::Duration;

use rngd_api::env;

/// The model flags of every subcommand that serves or counts a model
/// (`worker`, `gateway`, `ext-proc`, `up`).
#[derive(Debug, Clone, clap::Args)]
pub struct ModelArgs {
    /// Model file (GGUF), or a directory holding exactly one: the weights a
    /// worker serves, the tokenizer and chat template a front door counts
    /// prompts with (`up` gives its children the same); default: the cached
    /// model (`rngd-pd model fetch`; `up` fetches it if missing).
    #[arg(long, env = env::RNGD_PD_MODEL)]
    pub model: Option<PathBuf>,
    /// Jinja chat template file chats are rendered with instead of the
    /// model's own `tokenizer.chat_template` (give the workers and the front
    /// doors the same file; `up` does).
    #[arg(long, value_name = "FILE")]
    pub chat_template: Option<PathBuf>,
    /// Model name to serve instead of the one from the file's metadata;
    /// repeat for aliases: the first is the name in `/v1/models`, in answers
    /// and in the `model_name` metric label, every one is accepted in
    /// requests; any other `model` is a 404 `model_not_found` (a front door
    /// is given the names its workers serve).
    #[arg(long = "served-model-name", value_name = "NAME")]
    pub served_model_name: Vec<String>,
}

/// The listener limits, one flag name per meaning in every subcommand that
/// serves HTTP (`gateway`, `worker`); the defaults are
/// [`rngd_http_edge::Options`]'s (`docs/gateway.md`, "Listener limits").
#[derive(Debug, Clone, clap::Args)]
pub struct ListenerArgs {
    /// Time a connection has to send a request's complete header block, ms
    /// (from the accept, or from the end of the previous response on a
    /// kept-alive connection); then it is closed.
    #[arg(long, default_value_t = rngd_http_edge::DEFAULT_HEADER_TIMEOUT.as_millis() as u64)]
    pub header_timeout_ms: u64,
    /// Time a kept-alive connection may sit with no request in flight, ms;
    /// then it is closed.
    #[arg(long, default_value_t = rngd_http_edge::DEFAULT_IDLE_TIMEOUT.as_millis() as u64)]
    pub idle_timeout_ms: u64,
    /// Connections served at once per listener; one more is accepted and
    /// closed at once.
    #[arg(long, default_value_t = rngd_http_edge::DEFAULT_MAX_CONNECTIONS)]
    pub max_connections: usize,
    /// Bytes of request bodies being read at once per listener (each body's
    /// Content-Length reserved before it is read); a body that does not fit
    /// is a 503 with `Retry-After` before anything is buffered.
    #[arg(long, default_value_t = rngd_http_edge::DEFAULT_MAX_INFLIGHT_BODY_BYTES)]
    pub max_inflight_body_bytes: usize,
    /// On SIGTERM or Ctrl-C, seconds the requests in flight have to finish
    /// (fractions allowed); meanwhile `/ready` answers 503 and new requests
    /// a 503 `shutting_down`. Then a stream still running ends with an error
    /// event and `data: [DONE]`, a unary request gets a 503. A second signal
    /// exits at once.
    #[arg(long, value_name = "SECONDS", value_parser = seconds,
          default_value_t = rngd_http_edge::DEFAULT_SHUTDOWN_TIMEOUT.as_secs_f64())]
    pub shutdown_timeout: f64,
}

/// A duration in seconds: finite, not negative, at most a day.
pub fn seconds(s: &str) -> Result<f64, String> {
    let v: f64 = s
        .parse()
        .map_err(|_| format!("`{s}` is not a number of seconds"))?;
    if !v.is_finite() || !(0.0..=86_400.0).contains(&v) {
        return Err(format!("`{s}` must be between 0 and 86400 seconds"));
    }
    Ok(v)
}

impl ListenerArgs {
    /// The flags as the edge's options (the polite-close bounds keep their
    /// defaults).
    pub fn options(&self) -> rngd_http_edge::Options {
        rngd_http_edge::Options {
            header_timeout: Duration::from_millis(self.header_timeout_ms),
            idle_timeout: Duration::from_millis(self.idle_timeout_ms),
            max_connections: self.max_connections,
            max_inflight_body_bytes: self.max_inflight_body_bytes,
            shutdown_timeout: Duration::from_secs_f64(self.shutdown_timeout),
            ..rngd_http_edge::Options::default()
        }
    }
}

/// `--api-key`: a usable header value, not empty.
pub fn parse_api_key(s: &str) -> Result<rngd_http_edge::api_key::ApiKey, String> {
    match rngd_http_edge::api_key::ApiKey::parse(s) {
        Ok(Some(k)) => Ok(k),
        Ok(None) => Err("the API key is empty".into()),
        Err(e) => Err(e.into()),
    }
}
