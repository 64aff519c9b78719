//! A chat request as the completion request the worker serves: parsed and
//! checked with the shared rules (`rngd_api::rules`, as the gateway and the
//! picker do), rendered with the engine's own chat template (the one the front
//! doors count tokens with), `max_tokens` defaulting to the rest of the
//! context (`rngd_api::chat::to_completion`).

use rngd_api::chat::to_completion;
use rngd_api::models::ServedModels;
use rngd_api::openai::{ChatCompletionRequest, CompletionRequest};
use rngd_api::rules;
use rngd_engine::Engine;

use crate::error::ApiError;

/// Parses, checks and renders a chat body for `engine`; a chat naming a
/// model not in `served` is refused before it is rendered.
pub(super) fn render(
    engine: &dyn Engine,
    served: &ServedModels,
    body: &[u8],
) -> Result<CompletionRequest, ApiError> {
    let chat: ChatCompletionRequest = rules::parse_body(body)?;
    rules::check_chat(&chat)?;
    served.check(&chat.model)?;
    let messages = rules::chat_messages(&chat)?;
    // As the front doors: a prompt the template or tokenizer refuses is a 400.
    let tokenize =
        |e: rngd_engine::EngineError| ApiError::BadRequest(format!("tokenizing the prompt: {e}"));
    let opts = rngd_api::chat::TemplateOptions::of(&chat);
    let prompt = engine.chat_prompt(&messages, &opts).map_err(tokenize)?;
    // Never tokenized past the context (a chat too long is the 400 at once).
    let prompt_tokens = super::text_ids(engine, &prompt).map_err(tokenize)??.len();
    let seq_len = u32::try_from(engine.info().seq_len).unwrap_or(u32::MAX);
    Ok(to_completion(&chat, prompt, prompt_tokens, Some(seq_len)))
}
