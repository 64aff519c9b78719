//! Loading another checkpoint of the running model ([`Engine::reload`] for
//! the CPU engine), beside the engine serving.
//!
//! Both paths first check the new file's header: the same configuration and
//! the same tokenizer metadata as the running model, or a refusal naming
//! the difference.
//!
//! - **Delta**, when the file carries a manifest
//!   ([`crate::identity::MANIFEST_KEY`]): the file's tensors must be the
//!   running model's (names, types, shapes) and must all lie inside the file;
//!   only the tensors whose digest differs from the running one's are read,
//!   each checked against its digest, and the new model shares every other
//!   weight with the running one ([`Model::patched`]: the same bits a fresh
//!   load gives). The version comes from the records, so it is what a
//!   worker loading the file whole computes.
//! - **Full** otherwise: the file loads as at startup, with the engine's
//!   options.
//!
//! And a **variant** of the running engine ([`crate::Engine::variant`]):
//! the same weights (shared, nothing read) with another context length and
//! batch.
//!
//! Nothing here touches the running engine; the caller swaps.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

use candle_core::Device;

use super::{CpuEngine, CpuEngineOptions};
use crate::identity::sha256;
use crate::model::Config;
use crate::tokenizer::Meta;
use crate::{EngineError, Reloaded};

/// What a CPU engine was loaded from and with.
#[derive(Debug, Clone)]
pub(crate) struct Source {
    /// The options of the load (its model file among them).
    pub(crate) opts: CpuEngineOptions,
}

fn invalid(path: &Path, reason: String) -> EngineError {
    EngineError::InvalidModel {
        path: path.to_path_buf(),
        reason,
        source: None,
    }
}

/// Tensors whose records differ between `a` and `b`, by name.
fn changed_between(
    a: &crate::identity::WeightDigest,
    b: &crate::identity::WeightDigest,
) -> Vec<String> {
    let mut names: Vec<String> = a
        .iter()
        .filter(|(n, r)| b.get(n) != Some(*r))
        .map(|(n, _)| n.to_string())
        .chain(
            b.iter()
                .filter(|(n, _)| a.get(n).is_none())
                .map(|(n, _)| n.to_string()),
        )
        .collect();
    names.sort();
    names
}

impl CpuEngine {
    /// See [`crate::Engine::variant`]: the weights shared, the RoPE table
    /// rebuilt for `seq_len` positions, the engine's other options kept.
    pub(crate) fn variant_of(
        &self,
        seq_len: usize,
        max_batch: usize,
    ) -> Result<std::sync::Arc<CpuEngine>, EngineError> {
        let source = self.source.as_ref().ok_or_else(|| {
            EngineError::InvalidRequest(
                "this engine's model was not loaded from a file; it has no variants".into(),
            )
        })?;
        if seq_len == 0 || max_batch == 0 {
            return Err(EngineError::InvalidRequest(
                "seq_len and max_batch must be at least 1".into(),
            ));
        }
        let mut opts = source.opts.clone();
        opts.seq_len = seq_len;
        opts.batch = max_batch;
        let model = self.model.with_max_pos(seq_len)?;
        CpuEngine::start(
            model,
            self.tokenizer.clone(),
            seq_len,
            max_batch,
            &opts.prefix_cache.clone(),
            opts.max_num_batched_tokens,
            Some(Source { opts }),
        )
    }

    /// See [`crate::Engine::reload`] and the module docs.
    pub(crate) fn reload_from(&self, path: &Path) -> Result<Reloaded, EngineError> {
        let source = self.source.as_ref().ok_or_else(|| {
            EngineError::InvalidRequest(
                "this engine's model was not loaded from a file; it cannot load other weights"
                    .into(),
            )
        })?;
        let started = Instant::now();
        let (content, mut file) = crate::tokenizer::read_gguf_header(path)?;
        let running = &self.model;
        let mut cfg = Config::from_meta(&Meta {
            map: &content.metadata,
            path,
        })?;
        cfg.vocab = running.cfg.vocab;
        if cfg != running.cfg {
            return Err(invalid(
                path,
                format!(
                    "its configuration {cfg:?} is not the running model's {:?}",
                    running.cfg
                ),
            ));
        }
        if crate::manifest::tokenizer_digest(&content.metadata) != running.tokenizer_digest {
            return Err(invalid(
                path,
                "its tokenizer (the `tokenizer.*` metadata) is not the running model's".into(),
            ));
        }
        let Some(manifest) = crate::manifest::read(&content, path)? else {
            drop(file);
            return self.reload_whole(source, path, started);
        };
        let len = file
            .get_ref()
            .metadata()
            .map_err(|source| EngineError::Io {
                context: format!("reading the size of {}", path.display()),
                source,
            })?
            .len();
        crate::manifest::check_extent(&content, len, path)?;
        let records = crate::manifest::records(&content, &manifest);
        for (name, r) in records.iter() {
            match running.tensors.get(name) {
                None => {
                    return Err(invalid(
                        path,
                        format!(
                            "tensor `{name}` is not in the running model (a file with a manifest must have the running model's tensors, types and shapes; one without loads whole)"
                        ),
                    ));
                }
                Some(old) if old.dtype != r.dtype || old.dims != r.dims => {
                    return Err(invalid(
                        path,
                        format!(
                            "tensor `{name}` is {} {:?} here, {} {:?} in the running model (a file with a manifest must keep every tensor's type and shape; one without loads whole)",
                            r.dtype, r.dims, old.dtype, old.dims
                        ),
                    ));
                }
                Some(_) => {}
            }
        }
        if let Some((missing, _)) = running
            .tensors
            .iter()
            .find(|(n, _)| records.get(n).is_none())
        {
            return Err(invalid(
                path,
                format!("tensor `{missing}` of the running model is missing"),
            ));
        }
        let changed = changed_between(&running.tensors, &records);
        let mut bytes_read = content.tensor_data_offset;
        let mut tensors = HashMap::with_capacity(changed.len());
        for name in &changed {
            let err = |what: &str, e: candle_core::Error| EngineError::InvalidModel {
                path: path.to_path_buf(),
                reason: format!("{what} tensor `{name}`"),
                source: Some(Box::new(e)),
            };
            let q = content
                .tensor(&mut file, name, &Device::Cpu)
                .map_err(|e| err("reading", e))?;
            let bytes = q.data().map_err(|e| err("reading", e))?;
            bytes_read += bytes.len() as u64;
            if sha256(&bytes) != manifest[name] {
                return Err(invalid(
                    path,
                    format!("the bytes of tensor `{name}` do not match its manifest digest"),
                ));
            }
            let t = q
                .dequantize(&Device::Cpu)
                .map_err(|e| err("dequantizing", e))?;
            tensors.insert(name.clone(), t);
        }
        let mut model = running.patched(&tensors).map_err(|e| match e {
            EngineError::Other(reason) => invalid(path, reason),
            e => e,
        })?;
        model.weight_version = records.finish();
        model.tensors = records;
        let mut opts = source.opts.clone();
        opts.model_path = path.to_path_buf();
        tracing::info!(
            model = %path.display(),
            weight_version = %model.weight_version,
            tensors_changed = changed.len(),
            bytes_read,
            load_ms = started.elapsed().as_millis() as u64,
            "CPU engine loaded by delta"
        );
        let engine = CpuEngine::start(
            model,
            self.tokenizer.clone(),
            opts.seq_len,
            opts.batch,
            &opts.prefix_cache.clone(),
            opts.max_num_batched_tokens,
            Some(Source { opts }),
        )?;
        Ok(Reloaded {
            engine,
            tensors_changed: changed,
            bytes_read,
            delta: true,
        })
    }

    /// The whole file, loaded as at startup; it must be the same model.
    fn reload_whole(
        &self,
        source: &Source,
        path: &Path,
        started: Instant,
    ) -> Result<Reloaded, EngineError> {
        let mut opts = source.opts.clone();
        opts.model_path = PathBuf::from(path);
        let engine = CpuEngine::load(opts)?;
        if engine.model.cfg != self.model.cfg {
            return Err(invalid(
                path,
                format!(
                    "its configuration {:?} is not the running model's {:?}",
                    engine.model.cfg, self.model.cfg
                ),
            ));
        }
        let changed = changed_between(&self.model.tensors, &engine.model.tensors);
        let bytes_read = std::fs::metadata(path).map(|m| m.len()).unwrap_or(0);
        tracing::info!(
            model = %path.display(),
            tensors_changed = changed.len(),
            bytes_read,
            load_ms = started.elapsed().as_millis() as u64,
            "CPU engine reloaded whole"
        );
        Ok(Reloaded {
            engine,
            tensors_changed: changed,
            bytes_read,
            delta: false,
        })
    }
}
