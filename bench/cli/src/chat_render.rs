//! `rngd-pd-bench chat-render`: renders chats with the engine's own chat
//! template code, for tests that compare it with other renderers (HF's Jinja).
//!
//! Reads a JSON array of chats on stdin, each an array of `{role, content}`
//! messages, and prints one JSON line per chat: `rendered` (the template's
//! exact output), `prompt` (what the worker tokenizes: `rendered` without a
//! leading BOS text the tokenizer adds itself) and `ids` (the prompt's token
//! ids), or `error` when the template refuses the chat.

use std::io::Read;
use std::path::PathBuf;

use anyhow::Context;
use rngd_engine::tokenizer::{Tokenizer, TokenizerOverrides};

/// Flags.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// GGUF model file, or a directory holding exactly one; default: the cached model.
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Jinja chat template file to use instead of the model's own.
    #[arg(long, value_name = "FILE")]
    pub chat_template: Option<PathBuf>,
}

/// One message on stdin.
#[derive(Debug, serde::Deserialize)]
struct Message {
    role: String,
    content: String,
}

/// Runs the subcommand.
pub fn run(args: Args) -> anyhow::Result<()> {
    let path = rngd_engine::model_fetch::resolve(args.model.as_deref())?;
    let overrides = TokenizerOverrides {
        chat_template: args.chat_template.clone(),
        served_model_name: None,
    };
    let tokenizer = Tokenizer::from_gguf(&path)
        .and_then(|t| t.with_overrides(&overrides))
        .with_context(|| format!("model {}", path.display()))?;
    let mut input = String::new();
    std::io::stdin()
        .read_to_string(&mut input)
        .context("reading the chats from stdin")?;
    let chats: Vec<Vec<Message>> = serde_json::from_str(&input)
        .context("stdin: expected a JSON array of chats, each an array of {role, content}")?;
    for chat in chats {
        let messages: Vec<(String, String)> =
            chat.into_iter().map(|m| (m.role, m.content)).collect();
        let line = match tokenizer.template().render(&messages, &Default::default()) {
            Ok(rendered) => {
                let prompt = tokenizer.chat_prompt(&messages, &Default::default())?;
                let ids = tokenizer.encode(&prompt)?;
                serde_json::json!({ "rendered": rendered, "prompt": prompt, "ids": ids })
            }
            Err(e) => serde_json::json!({ "error": e.to_string() }),
        };
        println!("{line}");
    }
    Ok(())
}
