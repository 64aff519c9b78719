//! The per-tensor manifest a GGUF file may carry ([`MANIFEST_KEY`]): read it
//! (a weight update reads only the tensors whose digest changed), check a
//! file's extent against it without reading tensor data, and write a copy of
//! a file with it ([`stamp`], `rngd-pd model manifest`; the benchmark builds
//! its changed checkpoints with it).
//!
//! Also the digest of a file's tokenizer metadata, which a weight update
//! compares with the running model's.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use candle_core::Device;
use candle_core::quantized::gguf_file::{self, Content, Value};
use sha2::{Digest, Sha256};

use crate::EngineError;
pub use crate::identity::MANIFEST_KEY;
use crate::identity::{TensorRecord, WeightDigest, parse_sha256, sha256};

fn invalid(path: &Path, reason: String) -> EngineError {
    EngineError::InvalidModel {
        path: path.to_path_buf(),
        reason,
        source: None,
    }
}

/// The file's manifest (tensor name → SHA-256 of its stored bytes), or
/// `None` when it has none. A malformed manifest is an error naming the
/// entry; so is one that does not list exactly the file's tensors.
pub(crate) fn read(
    content: &Content,
    path: &Path,
) -> Result<Option<HashMap<String, [u8; 32]>>, EngineError> {
    let Some(value) = content.metadata.get(MANIFEST_KEY) else {
        return Ok(None);
    };
    let Value::Array(entries) = value else {
        return Err(invalid(
            path,
            format!("metadata key `{MANIFEST_KEY}` is not an array of strings"),
        ));
    };
    let mut out = HashMap::with_capacity(entries.len());
    for e in entries {
        let parsed = match e {
            Value::String(s) => s
                .rsplit_once(':')
                .and_then(|(name, hex)| Some((name.to_string(), parse_sha256(hex)?))),
            _ => None,
        };
        let Some((name, digest)) = parsed else {
            return Err(invalid(
                path,
                format!(
                    "an entry of `{MANIFEST_KEY}` is not \"<tensor name>:<64 hex digits>\": {e:?}"
                ),
            ));
        };
        if !content.tensor_infos.contains_key(&name) {
            return Err(invalid(
                path,
                format!("`{MANIFEST_KEY}` lists tensor `{name}`, which the file does not have"),
            ));
        }
        if out.insert(name.clone(), digest).is_some() {
            return Err(invalid(
                path,
                format!("`{MANIFEST_KEY}` lists tensor `{name}` twice"),
            ));
        }
    }
    if let Some(missing) = content
        .tensor_infos
        .keys()
        .filter(|n| !out.contains_key(*n))
        .min()
    {
        return Err(invalid(
            path,
            format!("`{MANIFEST_KEY}` does not list tensor `{missing}`"),
        ));
    }
    Ok(Some(out))
}

/// Stored bytes of the tensor `name` (from its type and shape).
pub(crate) fn stored_bytes(info: &gguf_file::TensorInfo) -> u64 {
    let elems = info.shape.elem_count();
    let dt = info.ggml_dtype;
    (elems / dt.block_size() * dt.type_size()) as u64
}

/// Checks that every tensor lies inside a file of `len` bytes: a file
/// truncated anywhere is refused before anything is read.
pub(crate) fn check_extent(content: &Content, len: u64, path: &Path) -> Result<(), EngineError> {
    let mut infos: Vec<_> = content.tensor_infos.iter().collect();
    infos.sort_by_key(|(n, _)| n.as_str());
    for (name, info) in infos {
        let end = content.tensor_data_offset + info.offset + stored_bytes(info);
        if end > len {
            return Err(invalid(
                path,
                format!(
                    "the file is truncated: tensor `{name}` ends at byte {end}, the file has {len}"
                ),
            ));
        }
    }
    Ok(())
}

/// The records a file's header and manifest give (no tensor data read).
pub(crate) fn records(content: &Content, manifest: &HashMap<String, [u8; 32]>) -> WeightDigest {
    let mut d = WeightDigest::new();
    for (name, info) in &content.tensor_infos {
        d.insert(
            name,
            TensorRecord {
                dtype: format!("{:?}", info.ggml_dtype),
                dims: info.shape.dims().to_vec(),
                sha256: manifest[name],
            },
        );
    }
    d
}

/// The SHA-256 over the file's `tokenizer.*` metadata (keys in order, each
/// with its value): equal exactly when two files tokenize alike.
pub(crate) fn tokenizer_digest(metadata: &HashMap<String, Value>) -> [u8; 32] {
    let keys: BTreeMap<&String, &Value> = metadata
        .iter()
        .filter(|(k, _)| k.starts_with("tokenizer."))
        .collect();
    let mut h = Sha256::new();
    for (k, v) in keys {
        h.update((k.len() as u64).to_le_bytes());
        h.update(k.as_bytes());
        hash_value(&mut h, v);
    }
    h.finalize().into()
}

/// Feeds one metadata value to `h`: a type tag, then its bytes (strings
/// and arrays length-prefixed), so different values never feed alike.
fn hash_value(h: &mut Sha256, v: &Value) {
    let (tag, bytes): (u8, [u8; 8]) = match v {
        Value::U8(x) => (0, u64::from(*x).to_le_bytes()),
        Value::I8(x) => (1, i64::from(*x).to_le_bytes()),
        Value::U16(x) => (2, u64::from(*x).to_le_bytes()),
        Value::I16(x) => (3, i64::from(*x).to_le_bytes()),
        Value::U32(x) => (4, u64::from(*x).to_le_bytes()),
        Value::I32(x) => (5, i64::from(*x).to_le_bytes()),
        Value::U64(x) => (6, x.to_le_bytes()),
        Value::I64(x) => (7, x.to_le_bytes()),
        Value::F32(x) => (8, u64::from(x.to_bits()).to_le_bytes()),
        Value::F64(x) => (9, x.to_bits().to_le_bytes()),
        Value::Bool(x) => (10, u64::from(*x).to_le_bytes()),
        Value::String(s) => {
            h.update([11]);
            h.update((s.len() as u64).to_le_bytes());
            h.update(s.as_bytes());
            return;
        }
        Value::Array(items) => {
            h.update([12]);
            h.update((items.len() as u64).to_le_bytes());
            for i in items {
                hash_value(h, i);
            }
            return;
        }
    };
    h.update([tag]);
    h.update(bytes);
}

/// What [`stamp`] wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stamped {
    /// Tensors written (each listed in the manifest).
    pub tensors: usize,
    /// Tensors whose bytes `alter` changed.
    pub altered: Vec<String>,
    /// The file's `weight_version` (what a worker loading it shows).
    pub weight_version: String,
}

/// Writes `dst`: `src`'s metadata and tensors with a manifest of the bytes
/// written (an existing manifest is replaced).
pub fn stamp(src: &Path, dst: &Path) -> Result<Stamped, EngineError> {
    stamp_with(src, dst, |_| {}, |_, _, _| {})
}

/// [`stamp`] with edits: `meta` may change the metadata, and each tensor's
/// bytes pass through `alter(name, block_bytes, bytes)` (`block_bytes` is
/// the size of one block of its storage type, so moving whole blocks keeps
/// every value valid).
pub fn stamp_with(
    src: &Path,
    dst: &Path,
    meta: impl FnOnce(&mut HashMap<String, Value>),
    mut alter: impl FnMut(&str, usize, &mut [u8]),
) -> Result<Stamped, EngineError> {
    let (mut content, mut file) = crate::tokenizer::read_gguf_header(src)?;
    meta(&mut content.metadata);
    let bad = |reason: String, e: candle_core::Error| EngineError::InvalidModel {
        path: src.to_path_buf(),
        reason,
        source: Some(Box::new(e)),
    };
    let mut names: Vec<&String> = content.tensor_infos.keys().collect();
    names.sort();
    let mut tensors = Vec::with_capacity(names.len());
    let mut entries = Vec::with_capacity(names.len());
    let mut digest = WeightDigest::new();
    let mut altered = Vec::new();
    for name in names {
        let info = &content.tensor_infos[name];
        let q = content
            .tensor(&mut file, name, &Device::Cpu)
            .map_err(|e| bad(format!("reading tensor `{name}`"), e))?;
        let mut bytes = q
            .data()
            .map_err(|e| bad(format!("reading tensor `{name}`"), e))?
            .into_owned();
        let before = sha256(&bytes);
        alter(name, info.ggml_dtype.type_size(), &mut bytes);
        let after = sha256(&bytes);
        if after != before {
            altered.push(name.clone());
        }
        let dims = info.shape.dims().to_vec();
        digest.insert(
            name,
            TensorRecord {
                dtype: format!("{:?}", info.ggml_dtype),
                dims: dims.clone(),
                sha256: after,
            },
        );
        let hex: String = after.iter().map(|b| format!("{b:02x}")).collect();
        entries.push(Value::String(format!("{name}:{hex}")));
        let q = candle_core::quantized::ggml_file::qtensor_from_ggml(
            info.ggml_dtype,
            &bytes,
            dims,
            &Device::Cpu,
        )
        .map_err(|e| bad(format!("rebuilding tensor `{name}`"), e))?;
        tensors.push((name.clone(), q));
    }
    let manifest = Value::Array(entries);
    let mut meta: Vec<(&str, &Value)> = content
        .metadata
        .iter()
        .filter(|(k, _)| k.as_str() != MANIFEST_KEY)
        .map(|(k, v)| (k.as_str(), v))
        .collect();
    meta.sort_by_key(|(k, _)| *k);
    meta.push((MANIFEST_KEY, &manifest));
    let io = |context: String| move |source: std::io::Error| EngineError::Io { context, source };
    let out = std::fs::File::create(dst).map_err(io(format!("creating {}", dst.display())))?;
    let mut out = std::io::BufWriter::new(out);
    let refs: Vec<(&str, &candle_core::quantized::QTensor)> =
        tensors.iter().map(|(n, q)| (n.as_str(), q)).collect();
    gguf_file::write(&mut out, &meta, &refs).map_err(|e| EngineError::InvalidModel {
        path: dst.to_path_buf(),
        reason: "writing the file".into(),
        source: Some(Box::new(e)),
    })?;
    use std::io::Write;
    out.flush()
        .map_err(io(format!("writing {}", dst.display())))?;
    Ok(Stamped {
        tensors: tensors.len(),
        altered,
        weight_version: digest.finish(),
    })
}
