//! Weight updates on a running worker (`POST /update_weights_from_disk` on
//! the admin listener, SGLang's name and fields; `GET /weight_info`): a new
//! engine is loaded beside the one serving, from a GGUF file in the worker's
//! weights directory, and replaces it only once it loaded whole and serves
//! the same names, KV layout and vocabulary. Anything else (a path outside
//! the directory, an unreadable or truncated file, another architecture or
//! vocabulary) is refused with the cause and the old weights keep serving:
//! the update is transactional. Requests admitted before the swap finish on
//! the engine they started on; later ones get the new one
//! ([`EngineSlot::replace_engine`], the worker state's).
//!
//! A file with a per-tensor manifest (`rngd_pd.tensor_sha256`,
//! `rngd-pd model manifest` writes one) loads by delta: only the tensors
//! whose digest differs from the running weights' are read, each checked,
//! and the new engine shares every other weight with the old one. A file
//! without one is read whole (`rngd_engine::Engine::reload`). The answer
//! says which (`mode`), what changed and the bytes read.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use rngd_engine::{Engine, EngineError, Reloaded};
use serde::Serialize;
use serde_json::{Map, Value};

/// Where the serving engine lives (the worker's state implements it).
pub trait EngineSlot: Send + Sync {
    /// The engine serving new requests, once loaded.
    fn engine(&self) -> Option<Arc<dyn Engine>>;
    /// Makes `engine` serve new requests if it is the same model; returns
    /// the one it replaced, or why not.
    fn replace_engine(&self, engine: Arc<dyn Engine>) -> Result<Arc<dyn Engine>, String>;
    /// Makes `engine`, a variant of the same weights (another context
    /// length or batch), serve new requests; returns the one it replaced.
    fn replace_variant(&self, engine: Arc<dyn Engine>) -> Result<Arc<dyn Engine>, String>;
}

/// Loads a model file into a new engine with the worker's engine options.
pub trait EngineLoader: Send + Sync {
    /// A new engine on `model` (blocking: called off the async runtime).
    fn load(&self, model: &Path) -> Result<Arc<dyn Engine>, EngineError>;
    /// A new engine on `model`, another checkpoint of `current`'s model
    /// (blocking). By default a fresh [`EngineLoader::load`], which reads the
    /// whole file and cannot tell what changed.
    fn reload(&self, current: &Arc<dyn Engine>, model: &Path) -> Result<Reloaded, EngineError> {
        let _ = current;
        Ok(Reloaded {
            engine: self.load(model)?,
            tensors_changed: Vec::new(),
            bytes_read: std::fs::metadata(model).map(|m| m.len()).unwrap_or(0),
            delta: false,
        })
    }
}

/// The CPU engine's loader: the worker's options with another model file.
#[derive(Debug, Clone)]
pub struct CpuLoader(pub rngd_engine::cpu::CpuEngineOptions);

impl EngineLoader for CpuLoader {
    fn load(&self, model: &Path) -> Result<Arc<dyn Engine>, EngineError> {
        let mut opts = self.0.clone();
        opts.model_path = model.to_path_buf();
        let engine: Arc<dyn Engine> = rngd_engine::cpu::CpuEngine::load(opts)?;
        Ok(engine)
    }

    /// The running engine derives the next (a delta load when the file has
    /// a manifest), keeping its own options.
    fn reload(&self, current: &Arc<dyn Engine>, model: &Path) -> Result<Reloaded, EngineError> {
        current.reload(model)
    }
}

/// What a worker can reload and from where.
pub struct WeightUpdater {
    loader: Arc<dyn EngineLoader>,
    /// The only directory whose `.gguf` files an update may name (canonical).
    dir: PathBuf,
    /// One update or variant switch at a time.
    pub(crate) busy: tokio::sync::Mutex<()>,
    /// Prepared variants other than the one serving
    /// ([`crate::variants`]); dropped when the weights change.
    pub(crate) prepared: std::sync::Mutex<Vec<Arc<dyn Engine>>>,
    /// The name of the file serving now (the `root` of `/v1/models`), as
    /// it was given (a symbolic link's own name).
    current: std::sync::Mutex<String>,
}

impl std::fmt::Debug for WeightUpdater {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WeightUpdater")
            .field("dir", &self.dir)
            .finish_non_exhaustive()
    }
}

/// Why an update was refused (the old weights still serve).
#[derive(Debug, thiserror::Error)]
pub enum UpdateError {
    /// A malformed request; `param` names the field.
    #[error("{message}")]
    BadRequest {
        /// The field at fault.
        param: String,
        /// What is wrong.
        message: String,
    },
    /// Another update is loading.
    #[error("another weight update is in progress; retry when it answers")]
    Busy,
    /// No model is loaded yet.
    #[error("the model is still loading")]
    NotReady,
    /// The file did not load; the old weights keep serving.
    #[error("the new weights did not load, the old ones keep serving")]
    Load(#[source] EngineError),
    /// It loaded but is another model.
    #[error("{0}; the old weights keep serving")]
    Incompatible(String),
    /// The loading task died.
    #[error("the loading task failed: {0}")]
    Task(String),
    /// The engine could not prepare the variant; the old one serves.
    #[error("the variant could not be prepared, the current one keeps serving")]
    Variant(#[source] EngineError),
}

/// The answer to a successful update.
#[derive(Debug, Clone, Serialize)]
pub struct UpdateAnswer {
    /// Always true (a failure is an error body).
    pub success: bool,
    /// What happened, for a human.
    pub message: String,
    /// The weights serving now.
    pub weight_version: String,
    /// The weights they replaced.
    pub previous_weight_version: String,
    /// `delta` (only the changed tensors were read) or `full`.
    pub mode: &'static str,
    /// How many tensors differ from the old weights (type, shape or bytes).
    pub tensors_changed: usize,
    /// Their names, in order.
    pub changed_tensors: Vec<String>,
    /// Bytes read from disk: the header and the changed tensors for a
    /// delta, the whole file otherwise.
    pub bytes_read: u64,
    /// Load and swap, ms.
    pub elapsed_ms: f64,
}

/// `GET /weight_info`.
#[derive(Debug, Clone, Serialize)]
pub struct WeightInfo {
    /// The served model name.
    pub model_name: String,
    /// The weights serving now.
    pub weight_version: String,
    /// The file they came from (its name, never its directory).
    pub model_file: String,
}

fn file_name(p: &Path) -> String {
    p.file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default()
}

// === impl WeightUpdater ===

impl WeightUpdater {
    /// Updates from `.gguf` files in `dir` (the directory of `current`, the
    /// file serving now, when `None`) through `loader`.
    pub fn new(
        loader: Arc<dyn EngineLoader>,
        current: &Path,
        dir: Option<&Path>,
    ) -> std::io::Result<Self> {
        let dir = match dir {
            Some(d) => d.canonicalize()?,
            None => current
                .canonicalize()?
                .parent()
                .map(Path::to_path_buf)
                .unwrap_or_else(|| PathBuf::from("/")),
        };
        let current = rngd_api::models::root(current);
        Ok(WeightUpdater {
            loader,
            dir,
            busy: tokio::sync::Mutex::new(()),
            prepared: std::sync::Mutex::new(Vec::new()),
            current: std::sync::Mutex::new(current),
        })
    }

    /// The name of the file serving now.
    pub fn current_file(&self) -> String {
        self.current
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// The file `model_path` names, if it is a regular `.gguf` file inside
    /// the weights directory (symbolic links resolved first).
    fn admit(&self, model_path: &str) -> Result<PathBuf, UpdateError> {
        let bad = |message: String| UpdateError::BadRequest {
            param: "model_path".into(),
            message,
        };
        let raw = Path::new(model_path);
        let joined = if raw.is_absolute() {
            raw.to_path_buf()
        } else {
            self.dir.join(raw)
        };
        let outside = || {
            bad(format!(
                "model_path must name a .gguf file in the worker's weights directory ({})",
                self.dir.display()
            ))
        };
        let real = joined.canonicalize().map_err(|e| {
            if e.kind() == std::io::ErrorKind::NotFound {
                bad(format!("model_path {model_path:?} does not exist"))
            } else {
                outside()
            }
        })?;
        if !real.starts_with(&self.dir)
            || real.extension().and_then(|e| e.to_str()) != Some("gguf")
            || !real.is_file()
        {
            return Err(outside());
        }
        Ok(real)
    }
}

/// Parses the body: `model_path` (string, required), `abort_all_requests`
/// (false; true is refused: in-flight requests always finish on the weights
/// they started with). Any other field is refused by name.
fn parse(body: &[u8]) -> Result<String, UpdateError> {
    let bad = |param: &str, message: String| UpdateError::BadRequest {
        param: param.into(),
        message,
    };
    let map: Map<String, Value> = serde_json::from_slice(body)
        .map_err(|e| bad("body", format!("the body is not a JSON object: {e}")))?;
    let mut path = None;
    for (k, v) in &map {
        match (k.as_str(), v) {
            ("model_path", Value::String(s)) if !s.is_empty() => path = Some(s.clone()),
            ("model_path", _) => {
                return Err(bad(
                    "model_path",
                    "model_path must be a non-empty string".into(),
                ));
            }
            ("abort_all_requests", Value::Bool(false)) => {}
            ("abort_all_requests", Value::Bool(true)) => {
                return Err(bad(
                    "abort_all_requests",
                    "abort_all_requests is not supported: requests in flight finish on the weights they started with".into(),
                ));
            }
            ("abort_all_requests", _) => {
                return Err(bad(
                    "abort_all_requests",
                    "abort_all_requests must be a boolean".into(),
                ));
            }
            (other, _) => {
                return Err(bad(
                    other,
                    format!("{other} is not a field of /update_weights_from_disk"),
                ));
            }
        }
    }
    path.ok_or_else(|| bad("model_path", "model_path is required".into()))
}

/// Loads the file a request body names and, if it loads and is the same
/// model, makes it serve. The old weights serve until then, and on any error.
pub async fn update(
    state: &dyn EngineSlot,
    updater: &WeightUpdater,
    body: &[u8],
) -> Result<UpdateAnswer, UpdateError> {
    let model_path = parse(body)?;
    let path = updater.admit(&model_path)?;
    let Ok(_one) = updater.busy.try_lock() else {
        return Err(UpdateError::Busy);
    };
    let Some(current) = state.engine() else {
        return Err(UpdateError::NotReady);
    };
    let started = Instant::now();
    let loader = updater.loader.clone();
    let p = path.clone();
    let reloaded = tokio::task::spawn_blocking(move || loader.reload(&current, &p))
        .await
        .map_err(|e| UpdateError::Task(e.to_string()))?
        .map_err(UpdateError::Load)?;
    let Reloaded {
        engine,
        tensors_changed,
        bytes_read,
        delta,
    } = reloaded;
    let new_version = engine.info().weight_version.clone();
    let old = match state.replace_engine(engine.clone()) {
        Ok(old) => old,
        Err(why) => {
            // The rejected engine's scheduler stops off the runtime.
            tokio::task::spawn_blocking(move || drop(engine));
            return Err(UpdateError::Incompatible(why));
        }
    };
    let previous = old.info().weight_version.clone();
    let mode = if delta { "delta" } else { "full" };
    // The old engine is dropped once its last request finishes (each holds
    // it); this reference goes now, off the runtime (its scheduler is
    // joined), with the variants prepared on the old weights.
    let stale = std::mem::take(&mut *updater.prepared.lock().unwrap_or_else(|p| p.into_inner()));
    tokio::task::spawn_blocking(move || drop((old, stale)));
    *updater.current.lock().unwrap_or_else(|p| p.into_inner()) =
        rngd_api::models::root(Path::new(&model_path));
    let elapsed_ms = started.elapsed().as_secs_f64() * 1e3;
    tracing::info!(
        file = %file_name(&path),
        weight_version = %new_version,
        previous_weight_version = %previous,
        mode,
        tensors_changed = tensors_changed.len(),
        bytes_read,
        elapsed_ms,
        "weights updated"
    );
    Ok(UpdateAnswer {
        success: true,
        message: format!(
            "weights updated from {} ({previous} -> {new_version}; {mode}: {} tensors changed, {bytes_read} bytes read)",
            file_name(&path),
            tensors_changed.len()
        ),
        weight_version: new_version,
        previous_weight_version: previous,
        mode,
        tensors_changed: tensors_changed.len(),
        changed_tensors: tensors_changed,
        bytes_read,
        elapsed_ms,
    })
}

/// The weights `engine` serves, loaded from `model_file`.
pub fn info(engine: &dyn Engine, model_file: String) -> WeightInfo {
    WeightInfo {
        model_name: engine.info().name.clone(),
        weight_version: engine.info().weight_version.clone(),
        model_file,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_body_is_checked_field_by_field() {
        assert_eq!(parse(br#"{"model_path": "a.gguf"}"#).unwrap(), "a.gguf");
        assert_eq!(
            parse(br#"{"model_path": "a.gguf", "abort_all_requests": false}"#).unwrap(),
            "a.gguf"
        );
        for (body, param) in [
            (&br#"{}"#[..], "model_path"),
            (br#"{"model_path": ""}"#, "model_path"),
            (br#"{"model_path": 3}"#, "model_path"),
            (
                br#"{"model_path": "a.gguf", "abort_all_requests": true}"#,
                "abort_all_requests",
            ),
            (
                br#"{"model_path": "a.gguf", "abort_all_requests": "no"}"#,
                "abort_all_requests",
            ),
            (
                br#"{"model_path": "a.gguf", "load_format": "auto"}"#,
                "load_format",
            ),
            (b"[1]", "body"),
            (b"not json", "body"),
        ] {
            match parse(body) {
                Err(UpdateError::BadRequest { param: p, .. }) => assert_eq!(p, param),
                r => panic!("{}: {r:?}", String::from_utf8_lossy(body)),
            }
        }
    }
}
