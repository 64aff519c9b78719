//! The model names a server answers to, owned once for every door: the
//! check that refuses any other `model` (404 `model_not_found`, naming the
//! served ones) and the `GET /v1/models` list that shows them.
//!
//! The first name is the one answers carry (`--served-model-name`, else the
//! model file's own); the others are aliases a client may also send, as
//! vLLM's repeated `--served-model-name` allows.

use crate::openai::{ErrorBody, Model, ModelList, ModelPermission};

/// Longest client model name echoed back in an error, in characters.
pub const MAX_ECHOED_MODEL_CHARS: usize = 200;

/// The names a server serves its one model under.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServedModels {
    /// Primary name first, then the aliases; no duplicates, none empty.
    names: Vec<String>,
}

/// A request named a model this server does not serve (404).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("the model '{model}' does not exist")]
pub struct ModelNotFound {
    /// The name as sent, cut to [`MAX_ECHOED_MODEL_CHARS`] characters.
    pub model: String,
    /// What this server serves, primary first.
    pub served: Vec<String>,
}

// === impl ServedModels ===

impl ServedModels {
    /// `primary` and `aliases`, dropping empty names and repeats (the
    /// primary wins over an alias of the same spelling).
    pub fn new(primary: impl Into<String>, aliases: impl IntoIterator<Item = String>) -> Self {
        let mut names: Vec<String> = Vec::new();
        for n in std::iter::once(primary.into()).chain(aliases) {
            if !n.is_empty() && !names.contains(&n) {
                names.push(n);
            }
        }
        ServedModels { names }
    }

    /// The name answers carry.
    pub fn primary(&self) -> &str {
        self.names.first().map_or("", String::as_str)
    }

    /// Every name served, primary first.
    pub fn names(&self) -> &[String] {
        &self.names
    }

    /// Whether `model` is served (exact match, as vLLM compares).
    pub fn serves(&self, model: &str) -> bool {
        self.names.iter().any(|n| n == model)
    }

    /// `Ok` when `model` is served, else the 404 naming what is.
    pub fn check(&self, model: &str) -> Result<(), ModelNotFound> {
        if self.serves(model) {
            return Ok(());
        }
        Err(ModelNotFound {
            model: model.chars().take(MAX_ECHOED_MODEL_CHARS).collect(),
            served: self.names.clone(),
        })
    }

    /// The `GET /v1/models` body: one entry per served name, each with the
    /// model's `root` (the file it was loaded from, or the primary name when
    /// the server has no file of its own), `parent` null, the compiled
    /// context as `max_model_len`, and one read-only permission.
    pub fn list(&self, root: &str, max_model_len: u32, created: u64) -> ModelList {
        let data = self
            .names
            .iter()
            .map(|id| Model {
                id: id.clone(),
                object: "model".into(),
                created,
                owned_by: "rngd-pd".into(),
                root: Some(if root.is_empty() {
                    self.primary().to_string()
                } else {
                    root.to_string()
                }),
                parent: None,
                max_model_len: Some(max_model_len),
                weight_version: None,
                tokenizer_digest: None,
                permission: vec![ModelPermission::read_only(id, created)],
            })
            .collect();
        ModelList {
            object: "list".into(),
            data,
        }
    }
}

/// The aliases every door accepts besides the primary name, derived the same
/// way at each from the same flags: the `--served-model-name` values after
/// the first; with none given, the model file's stem (the name a client who
/// knows the file would send).
pub fn aliases(served_model_name: &[String], model_file: Option<&std::path::Path>) -> Vec<String> {
    if served_model_name.is_empty() {
        model_file
            .and_then(|p| p.file_stem())
            .and_then(|s| s.to_str())
            .map(String::from)
            .into_iter()
            .collect()
    } else {
        served_model_name[1..].to_vec()
    }
}

/// The `root` shown in `/v1/models`: the model file's name, never its
/// directory (a public route does not reveal the server's paths).
pub fn root(model_file: &std::path::Path) -> String {
    model_file
        .file_name()
        .and_then(|s| s.to_str())
        .map(String::from)
        .unwrap_or_default()
}

// === impl ModelNotFound ===

impl ModelNotFound {
    /// The HTTP status every door answers with.
    pub const STATUS: u16 = 404;
}

/// The 404 body every door sends: code `model_not_found`, param `model`,
/// and the served names in the message.
impl From<&ModelNotFound> for ErrorBody {
    fn from(e: &ModelNotFound) -> Self {
        ErrorBody::new(
            ErrorBody::kind_for_status(ModelNotFound::STATUS),
            format!(
                "The model '{}' does not exist; this server serves: {}",
                e.model,
                e.served.join(", ")
            ),
        )
        .with_param("model")
        .with_code("model_not_found")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn primary_and_aliases_are_served_nothing_else() {
        let s = ServedModels::new("smol", ["alias".to_string(), "smol".into(), String::new()]);
        assert_eq!(s.names(), ["smol", "alias"]);
        assert_eq!(s.primary(), "smol");
        assert!(s.check("smol").is_ok());
        assert!(s.check("alias").is_ok());
        let e = s.check("Smol").unwrap_err();
        assert_eq!(e.served, ["smol", "alias"]);
        let body = ErrorBody::from(&e);
        assert_eq!(body.error.code.as_deref(), Some("model_not_found"));
        assert_eq!(body.error.param.as_deref(), Some("model"));
        assert_eq!(body.error.kind, "not_found_error");
        assert!(
            body.error.message.contains("'Smol'"),
            "{}",
            body.error.message
        );
        assert!(
            body.error.message.ends_with("smol, alias"),
            "{}",
            body.error.message
        );
    }

    #[test]
    fn aliases_are_the_extra_names_or_else_the_file_stem() {
        let file = std::path::Path::new("/models/Smol.Q4_1.gguf");
        assert_eq!(aliases(&[], Some(file)), ["Smol.Q4_1"]);
        assert!(aliases(&[], None).is_empty());
        let flags = ["a".to_string(), "b".into()];
        assert_eq!(aliases(&flags, Some(file)), ["b"]);
        assert_eq!(root(file), "Smol.Q4_1.gguf");
    }

    #[test]
    fn a_long_name_is_cut_in_the_error() {
        let s = ServedModels::new("m", []);
        let e = s.check(&"x".repeat(10_000)).unwrap_err();
        assert_eq!(e.model.chars().count(), MAX_ECHOED_MODEL_CHARS);
    }

    #[test]
    fn the_list_has_one_entry_per_name_with_vllm_fields() {
        let s = ServedModels::new("smol", ["alias".to_string()]);
        let list = s.list("/models/smol.gguf", 512, 7);
        let v = serde_json::to_value(&list).unwrap();
        assert_eq!(v["object"], "list");
        assert_eq!(v["data"].as_array().unwrap().len(), 2);
        for (entry, id) in v["data"].as_array().unwrap().iter().zip(["smol", "alias"]) {
            assert_eq!(entry["id"], id);
            assert_eq!(entry["root"], "/models/smol.gguf");
            assert!(entry["parent"].is_null(), "{entry}");
            assert_eq!(entry["max_model_len"], 512);
            assert_eq!(entry["permission"][0]["object"], "model_permission");
            assert_eq!(entry["permission"][0]["allow_sampling"], true);
            assert_eq!(entry["permission"][0]["allow_fine_tuning"], false);
        }
        assert_eq!(s.list("", 512, 7).data[1].root.as_deref(), Some("smol"));
    }
}
