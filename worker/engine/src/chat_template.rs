//! Chat rendering: turns `(role, content)` messages into the prompt text the
//! model was trained on, ending with the assistant's generation prompt.
//!
//! A model's own Jinja template (GGUF `tokenizer.chat_template`, or a file
//! given with `--chat-template`) is compiled once with `minijinja`, set up the
//! way Hugging Face renders chat templates: `trim_blocks` and `lstrip_blocks`,
//! loop controls (`break`/`continue`), Python string and dict methods
//! (`.strip()`, `.startswith()`, `.split()`, `.items()`, …), and the helpers
//! HF templates call: `raise_exception(msg)`, `strftime_now(fmt)` and a
//! `tojson` filter that writes what Python's `json.dumps` writes. The
//! variables are `messages` (a list of `{role, content}`),
//! `add_generation_prompt` (true unless the request turns it off),
//! `bos_token`, `eos_token`, `tools` / `documents` (none) and the request's
//! `chat_template_kwargs`. With `continue_final_message` the rendered text is
//! cut right after the final message's content
//! (`rngd_api::chat::continue_final`), whatever the renderer.
//!
//! A model without a template is rendered with a fixed fallback: ChatML
//! (`<|im_start|>role\ncontent<|im_end|>\n` …, then `<|im_start|>assistant\n`)
//! when the vocabulary has `<|im_start|>`, otherwise plain `role: content`
//! lines followed by `assistant: `.

use std::path::Path;
use std::sync::Arc;

use minijinja::value::{Kwargs, Value, ValueKind};
use minijinja::{Environment, ErrorKind};

use rngd_api::chat::{TemplateOptions, continue_final};

use crate::EngineError;

mod pyfmt;

/// Where a model's own template lives in a GGUF file.
pub const GGUF_TEMPLATE_KEY: &str = "tokenizer.chat_template";

/// Name of the one template in a renderer's environment.
const TEMPLATE_NAME: &str = "chat_template";

/// The text of the special tokens a template may print.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SpecialTokens {
    /// `bos_token`: the beginning-of-sequence token's text, if the model has one.
    pub bos: Option<String>,
    /// `eos_token`: the end-of-sequence token's text, if the model has one.
    pub eos: Option<String>,
}

#[derive(Clone)]
enum Renderer {
    /// A compiled Jinja template.
    Jinja(Arc<Environment<'static>>),
    /// The ChatML fallback.
    ChatMl,
    /// The plain fallback.
    Plain,
}

/// How chats are rendered into a prompt: a compiled template or a fallback.
#[derive(Clone)]
pub struct ChatTemplate {
    renderer: Renderer,
    origin: String,
    specials: SpecialTokens,
    /// The Jinja source of a compiled template (none for the fallbacks).
    source: Option<Arc<str>>,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("kind", &self.kind())
            .field("origin", &self.origin)
            .finish()
    }
}

/// The error `raise_exception` raises, found again in the render error's chain.
#[derive(Debug)]
struct Raised(String);

impl std::fmt::Display for Raised {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Raised {}

fn load_error(origin: &str, what: String, source: Option<minijinja::Error>) -> EngineError {
    EngineError::Tokenizer {
        message: format!("the chat template ({origin}) {what}"),
        source: source.map(|e| Box::new(e) as Box<dyn std::error::Error + Send + Sync>),
    }
}

impl ChatTemplate {
    /// The renderer of a model: its own template (`template`, the GGUF's
    /// `tokenizer.chat_template`) compiled, or the fallback when it has none
    /// (ChatML if `vocab_has_im_start`, else plain lines).
    pub fn for_model(
        template: Option<&str>,
        specials: SpecialTokens,
        vocab_has_im_start: bool,
    ) -> Result<ChatTemplate, EngineError> {
        match template {
            Some(source) => Self::compile(source, GGUF_TEMPLATE_KEY, specials),
            None => Ok(ChatTemplate {
                renderer: if vocab_has_im_start {
                    Renderer::ChatMl
                } else {
                    Renderer::Plain
                },
                origin: format!("built-in fallback: the model has no {GGUF_TEMPLATE_KEY}"),
                specials,
                source: None,
            }),
        }
    }

    /// Compiles a Jinja chat template. `origin` names where it came from in
    /// errors. A syntax error, or a filter or test that does not exist, is an
    /// error here rather than at the first request.
    pub fn compile(
        source: &str,
        origin: impl Into<String>,
        specials: SpecialTokens,
    ) -> Result<ChatTemplate, EngineError> {
        let origin = origin.into();
        let env = environment(source)
            .map_err(|e| load_error(&origin, "does not compile".into(), Some(e)))?;
        let (filters, tests) = referenced_names(source);
        for name in filters {
            if unknown(&env, &format!("none | {name}"), ErrorKind::UnknownFilter) {
                return Err(load_error(
                    &origin,
                    format!("uses the filter `{name}`, which this renderer does not have"),
                    None,
                ));
            }
        }
        for name in tests {
            if unknown(&env, &format!("none is {name}"), ErrorKind::UnknownTest) {
                return Err(load_error(
                    &origin,
                    format!("uses the test `{name}`, which this renderer does not have"),
                    None,
                ));
            }
        }
        Ok(ChatTemplate {
            renderer: Renderer::Jinja(Arc::new(env)),
            origin,
            specials,
            source: Some(Arc::from(source)),
        })
    }

    /// The same special tokens with the template of a file (`--chat-template FILE`).
    pub fn with_file(&self, path: &Path) -> Result<ChatTemplate, EngineError> {
        let source = std::fs::read_to_string(path).map_err(|source| EngineError::Io {
            context: format!("reading the chat template {}", path.display()),
            source,
        })?;
        Self::compile(
            &source,
            format!("--chat-template {}", path.display()),
            self.specials.clone(),
        )
    }

    /// `jinja` (a compiled template), `chatml` or `plain` (the fallbacks).
    pub fn kind(&self) -> &'static str {
        match self.renderer {
            Renderer::Jinja(_) => "jinja",
            Renderer::ChatMl => "chatml",
            Renderer::Plain => "plain",
        }
    }

    /// Where the template came from (`tokenizer.chat_template`, a file, or the fallback).
    pub fn origin(&self) -> &str {
        &self.origin
    }

    /// The Jinja source of a compiled template; `None` for the fallbacks
    /// (whose [`ChatTemplate::kind`] names them).
    pub fn source(&self) -> Option<&str> {
        self.source.as_deref()
    }

    /// The special tokens the template is given.
    pub fn specials(&self) -> &SpecialTokens {
        &self.specials
    }

    /// Renders `(role, content)` messages as `opts` ask (by default ending
    /// with the assistant generation prompt): exactly the template's output,
    /// cut after the final message with `continue_final_message`. A template
    /// that calls `raise_exception` (roles that do not alternate, …) refuses
    /// the chat with [`EngineError::InvalidRequest`] carrying its message.
    pub fn render(
        &self,
        messages: &[(String, String)],
        opts: &TemplateOptions,
    ) -> Result<String, EngineError> {
        let Some((_, last)) = messages.last() else {
            return Err(EngineError::InvalidRequest(
                "a chat needs at least one message".into(),
            ));
        };
        let text = self.render_all(messages, opts)?;
        if opts.continue_final_message {
            return continue_final(&text, last).map_err(EngineError::InvalidRequest);
        }
        Ok(text)
    }

    fn render_all(
        &self,
        messages: &[(String, String)],
        opts: &TemplateOptions,
    ) -> Result<String, EngineError> {
        match &self.renderer {
            Renderer::Jinja(env) => self.render_jinja(env, messages, opts),
            Renderer::ChatMl => {
                let mut out = String::new();
                for (role, content) in messages {
                    out.push_str("<|im_start|>");
                    out.push_str(role);
                    out.push('\n');
                    out.push_str(content);
                    out.push_str("<|im_end|>\n");
                }
                if opts.add_generation_prompt {
                    out.push_str("<|im_start|>assistant\n");
                }
                Ok(out)
            }
            Renderer::Plain => {
                let mut out = String::new();
                for (role, content) in messages {
                    out.push_str(role);
                    out.push_str(": ");
                    out.push_str(content);
                    out.push('\n');
                }
                if opts.add_generation_prompt {
                    out.push_str("assistant: ");
                }
                Ok(out)
            }
        }
    }

    fn render_jinja(
        &self,
        env: &Environment<'static>,
        messages: &[(String, String)],
        opts: &TemplateOptions,
    ) -> Result<String, EngineError> {
        let list: Vec<Value> = messages
            .iter()
            .map(|(role, content)| {
                Value::from_iter([
                    ("role", Value::from(role.as_str())),
                    ("content", Value::from(content.as_str())),
                ])
            })
            .collect();
        let mut ctx: Vec<(&str, Value)> = vec![
            ("messages", Value::from(list)),
            (
                "add_generation_prompt",
                Value::from(opts.add_generation_prompt),
            ),
            ("tools", Value::from(())),
            ("documents", Value::from(())),
        ];
        if let Some(b) = &self.specials.bos {
            ctx.push(("bos_token", Value::from(b.as_str())));
        }
        if let Some(e) = &self.specials.eos {
            ctx.push(("eos_token", Value::from(e.as_str())));
        }
        // The request's own variables; the rules refused any that would
        // replace one above.
        let mut ctx: Vec<(String, Value)> =
            ctx.into_iter().map(|(k, v)| (k.to_string(), v)).collect();
        for (k, v) in &opts.kwargs {
            if !ctx.iter().any(|(name, _)| name == k) {
                ctx.push((k.clone(), Value::from_serialize(v)));
            }
        }
        let ctx = Value::from_iter(ctx);
        let template = env
            .get_template(TEMPLATE_NAME)
            .map_err(|e| EngineError::Other(format!("the compiled chat template is gone: {e}")))?;
        template.render(ctx).map_err(|e| {
            let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(&e);
            while let Some(c) = cause {
                if let Some(Raised(msg)) = c.downcast_ref::<Raised>() {
                    return EngineError::InvalidRequest(format!(
                        "the chat template refused this chat: {msg}"
                    ));
                }
                cause = c.source();
            }
            EngineError::InvalidRequest(format!(
                "the chat template ({}) failed on this chat: {e}",
                self.origin
            ))
        })
    }
}

/// The environment HF templates expect, with `source` added.
fn environment(source: &str) -> Result<Environment<'static>, minijinja::Error> {
    let mut env = Environment::new();
    env.set_trim_blocks(true);
    env.set_lstrip_blocks(true);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_function(
        "raise_exception",
        |msg: String| -> Result<Value, minijinja::Error> {
            Err(
                minijinja::Error::new(ErrorKind::InvalidOperation, "raise_exception")
                    .with_source(Raised(msg)),
            )
        },
    );
    env.add_function(
        "strftime_now",
        |fmt: String| -> Result<String, minijinja::Error> {
            let now = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_secs() as i64)
                .unwrap_or(0);
            pyfmt::strftime(&fmt, now)
                .map_err(|m| minijinja::Error::new(ErrorKind::InvalidOperation, m))
        },
    );
    env.add_filter("tojson", tojson);
    env.add_template_owned(TEMPLATE_NAME, source.to_string())?;
    Ok(env)
}

/// `x | tojson(indent=N, sort_keys=B, separators=(a, b))`: Python's
/// `json.dumps(x, ensure_ascii=False, …)`.
fn tojson(value: Value, kwargs: Kwargs) -> Result<Value, minijinja::Error> {
    let indent: Option<Value> = kwargs.get("indent")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    let separators: Option<Value> = kwargs.get("separators")?;
    let ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    kwargs.assert_all_used()?;
    let indent = match indent {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) => match v.kind() {
            ValueKind::Number => Some(" ".repeat(usize::try_from(v).unwrap_or(0))),
            ValueKind::String => Some(v.as_str().unwrap_or_default().to_string()),
            _ => {
                return Err(minijinja::Error::new(
                    ErrorKind::InvalidOperation,
                    "tojson: indent must be a number or a string",
                ));
            }
        },
    };
    let separators = match separators {
        Some(v) if !v.is_none() => {
            let item = v.get_item_by_index(0).ok().zip(v.get_item_by_index(1).ok());
            match item {
                Some((a, b)) if a.as_str().is_some() && b.as_str().is_some() => Some((
                    a.as_str().unwrap_or_default().to_string(),
                    b.as_str().unwrap_or_default().to_string(),
                )),
                _ => {
                    return Err(minijinja::Error::new(
                        ErrorKind::InvalidOperation,
                        "tojson: separators must be two strings",
                    ));
                }
            }
        }
        _ => None,
    };
    let opts = pyfmt::JsonOptions {
        indent,
        separators,
        sort_keys: sort_keys.unwrap_or(false),
        ensure_ascii: ensure_ascii.unwrap_or(false),
    };
    let out = pyfmt::dumps(&value, &opts)?;
    Ok(Value::from_safe_string(out))
}

/// Whether evaluating `expr` fails with `kind` (an unknown filter or test).
fn unknown(env: &Environment<'static>, expr: &str, kind: ErrorKind) -> bool {
    match env.compile_expression(expr) {
        Ok(e) => matches!(e.eval(()), Err(err) if err.kind() == kind),
        Err(_) => false,
    }
}

/// The filter and test names a template's tags use (`x | name`,
/// `{% filter name %}`, `x is [not] name`), string literals and comments skipped.
fn referenced_names(source: &str) -> (Vec<String>, Vec<String>) {
    let mut filters = Vec::new();
    let mut tests = Vec::new();
    let mut rest = source;
    while let Some(at) = rest.find('{') {
        let tail = &rest[at..];
        let close = if tail.starts_with("{{") {
            "}}"
        } else if tail.starts_with("{%") {
            "%}"
        } else if tail.starts_with("{#") {
            rest = tail.find("#}").map_or("", |e| &tail[e + 2..]);
            continue;
        } else {
            rest = &tail[1..];
            continue;
        };
        let (mut tokens, after) = tag_tokens(&tail[2..], close);
        rest = after;
        // Whitespace control (`{%-`, `{%+`) is not part of the tag's words.
        if matches!(tokens.first().map(String::as_str), Some("-" | "+")) {
            tokens.remove(0);
        }
        if close == "%}" && tokens.first().map(String::as_str) == Some("raw") {
            rest = rest.find("endraw").map_or("", |e| &rest[e..]);
            continue;
        }
        if close == "%}"
            && tokens.first().map(String::as_str) == Some("filter")
            && let Some(n) = tokens.get(1).filter(|t| is_ident(t))
        {
            filters.push(n.clone());
        }
        for (i, t) in tokens.iter().enumerate() {
            if t == "|" {
                if let Some(n) = tokens.get(i + 1).filter(|t| is_ident(t)) {
                    filters.push(n.clone());
                }
            } else if t == "is" {
                let mut j = i + 1;
                if tokens.get(j).map(String::as_str) == Some("not") {
                    j += 1;
                }
                if let Some(n) = tokens.get(j).filter(|t| is_ident(t)) {
                    tests.push(n.clone());
                }
            }
        }
    }
    filters.sort();
    filters.dedup();
    tests.sort();
    tests.dedup();
    (filters, tests)
}

fn is_ident(t: &str) -> bool {
    t.chars()
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
}

/// The tokens of one tag up to `close` (outside strings): identifiers,
/// numbers, single punctuation characters, strings as `"`. Returns the rest
/// of the source after the tag.
fn tag_tokens<'a>(body: &'a str, close: &str) -> (Vec<String>, &'a str) {
    let mut tokens = Vec::new();
    let mut chars = body.char_indices().peekable();
    while let Some((i, c)) = chars.next() {
        if body[i..].starts_with(close) {
            return (tokens, &body[i + close.len()..]);
        }
        if c == '\'' || c == '"' {
            let mut escaped = false;
            for (_, d) in chars.by_ref() {
                if escaped {
                    escaped = false;
                } else if d == '\\' {
                    escaped = true;
                } else if d == c {
                    break;
                }
            }
            tokens.push("\"".into());
        } else if c.is_ascii_alphanumeric() || c == '_' {
            let mut end = i + c.len_utf8();
            while let Some(&(j, d)) = chars.peek() {
                if d.is_ascii_alphanumeric() || d == '_' {
                    end = j + d.len_utf8();
                    chars.next();
                } else {
                    break;
                }
            }
            tokens.push(body[i..end].to_string());
        } else if !c.is_whitespace() {
            tokens.push(c.to_string());
        }
    }
    (tokens, "")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_in_tags_are_found_and_strings_skipped() {
        let (f, t) = referenced_names(
            "{{ x | trim }}{% if y is not defined %}'| nope'{% endif %}\
             {{ '| also not' ~ z|tojson(indent=2) }}{# | comment #}{% filter upper %}a{% endfilter %}\
             {%- filter lower -%}b{% endfilter %}{%- raw %}{{ x | not_a_use }}{% endraw %}",
        );
        assert_eq!(f, ["lower", "tojson", "trim", "upper"]);
        assert_eq!(t, ["defined"]);
    }
}
