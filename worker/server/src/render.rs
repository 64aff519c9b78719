//! vLLM's render and tokenizer endpoints, for routers that need a prompt's
//! token ids before they pick a worker (llm-d's precise prefix-cache scorer,
//! Dynamo's router): see `docs/engine.md`, "Render endpoints".
//!
//! - `POST /v1/completions/render` → a list of vLLM `GenerateRequest`s (one
//!   per prompt: `request_id`, `token_ids`, `features`, `sampling_params`,
//!   `model`, `stream`, `stream_options`, `cache_salt`, `priority`,
//!   `kv_transfer_params`);
//! - `POST /v1/chat/completions/render` → one `GenerateRequest`;
//! - `POST /tokenize` (`{"model","prompt"}` or `{"model","messages"}`) →
//!   `{"count","max_model_len","tokens","token_strs"}`;
//! - `POST /detokenize` (`{"model","tokens"}`) → `{"prompt"}`.
//!
//! A `model` that is not served is the serving path's 404 (optional on the
//! tokenizer routes, checked when given).
//!
//! The ids are those the serving path prefills: the body is parsed with the
//! same rules, a chat rendered with the engine's template, and the prompt
//! turned into ids by the completion path's own [`prompt_ids`] (bounded by
//! the context before the whole text is tokenized); the context check is the
//! serving path's [`sampling`]. Bodies are bounded as the completion
//! endpoints' (`--body-limit`, `--body-timeout`); nothing here takes an engine
//! slot (tokenizing runs on the blocking pool).

use std::sync::Arc;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{Extensions, HeaderMap};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use rngd_api::models::ServedModels;
use rngd_api::openai::{ChatCompletionRequest, CompletionRequest, Prompt};
use rngd_api::rules::{self, RuleError};
use rngd_engine::{Engine, SamplingParams};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use crate::completions::{check_vocab, client_seed, prompt_ids, sampling};
use crate::error::ApiError;
use crate::state::WorkerState;

/// The render and tokenizer routes.
pub(crate) fn routes() -> Router<WorkerState> {
    Router::new()
        .route("/v1/completions/render", post(render_completion))
        .route("/v1/chat/completions/render", post(render_chat))
        .route("/tokenize", post(tokenize))
        .route("/detokenize", post(detokenize))
}

async fn render_completion(
    State(state): State<WorkerState>,
    ext: Extensions,
    headers: HeaderMap,
    body: Body,
) -> Response {
    answer(async {
        let (engine, served, body) = start(&state, &headers, &ext, body).await?;
        // A prompt list is one `GenerateRequest` per prompt, `n` in each.
        let Some(split) = rngd_api::fanout::split(&body, false)? else {
            return Ok(json!([render_one(&engine, served, body).await?]));
        };
        let mut out = Vec::with_capacity(split.prompts);
        for part in split.parts.iter().step_by(split.n) {
            let mut g = render_one(&engine, Arc::clone(&served), Bytes::from(part.clone())).await?;
            g["sampling_params"]["n"] = json!(split.n);
            out.push(g);
        }
        Ok(Value::Array(out))
    })
    .await
}

/// One completion prompt's `GenerateRequest`.
async fn render_one(
    engine: &Arc<dyn Engine>,
    served: Arc<ServedModels>,
    body: Bytes,
) -> Result<Value, ApiError> {
    let req: CompletionRequest = blocking(move || {
        let req: CompletionRequest = rules::parse_body(&body)?;
        rules::check_completion(&req)?;
        served.check(&req.model)?;
        Ok(req)
    })
    .await?;
    let ids = prompt_ids(engine, &req.prompt).await?;
    let params = sampling(&req, &ids, engine.info(), client_seed(&req).unwrap_or(0))?;
    Ok(generate_request("cmpl", &req, ids, &params))
}

async fn render_chat(
    State(state): State<WorkerState>,
    ext: Extensions,
    headers: HeaderMap,
    body: Body,
) -> Response {
    answer(async {
        let (engine, served, body) = start(&state, &headers, &ext, body).await?;
        let split = rngd_api::fanout::split(&body, true)?;
        let body = match &split {
            Some(s) => Bytes::from(s.parts[0].clone()),
            None => body,
        };
        let (req, ids) = chat_ids(&engine, served, body).await?;
        let params = sampling(&req, &ids, engine.info(), client_seed(&req).unwrap_or(0))?;
        let mut g = generate_request("chatcmpl", &req, ids, &params);
        if let Some(s) = split {
            g["sampling_params"]["n"] = json!(s.n);
        }
        Ok(g)
    })
    .await
}

/// A chat body as the chat endpoint serves it: the completion request it
/// becomes and the prompt's ids.
async fn chat_ids(
    engine: &Arc<dyn Engine>,
    served: Arc<ServedModels>,
    body: Bytes,
) -> Result<(CompletionRequest, Vec<u32>), ApiError> {
    let e = Arc::clone(engine);
    let (chat, prompt) = blocking(move || {
        let chat: ChatCompletionRequest = rules::parse_body(&body)?;
        rules::check_chat(&chat)?;
        served.check(&chat.model)?;
        let messages = rules::chat_messages(&chat)?;
        let opts = rngd_api::chat::TemplateOptions::of(&chat);
        let prompt = e
            .chat_prompt(&messages, &opts)
            .map_err(|e| ApiError::BadRequest(format!("tokenizing the prompt: {e}")))?;
        Ok((chat, prompt))
    })
    .await?;
    let ids = prompt_ids(engine, &Prompt::Text(prompt.clone())).await?;
    let seq_len = u32::try_from(engine.info().seq_len).unwrap_or(u32::MAX);
    let req = rngd_api::chat::to_completion(&chat, prompt, ids.len(), Some(seq_len));
    Ok((req, ids))
}

/// vLLM's `GenerateRequest` for a rendered prompt.
fn generate_request(
    prefix: &str,
    req: &CompletionRequest,
    ids: Vec<u32>,
    p: &SamplingParams,
) -> Value {
    let f = &req.sampling;
    let stream_options = match (&f.stream_options, f.stream) {
        (Some(o), true) => serde_json::to_value(o).unwrap_or(Value::Null),
        _ => Value::Null,
    };
    json!({
        "request_id": format!("{prefix}-{}", crate::request_id(&HeaderMap::new())),
        "token_ids": ids,
        "features": null,
        "sampling_params": {
            "n": 1,
            "presence_penalty": p.presence_penalty,
            "frequency_penalty": p.frequency_penalty,
            "repetition_penalty": p.repetition_penalty,
            "temperature": p.temperature,
            "top_p": p.top_p,
            "top_k": p.top_k,
            "min_p": p.min_p,
            "seed": f.seed,
            "stop": p.stop,
            "stop_token_ids": p.stop_token_ids,
            "ignore_eos": p.ignore_eos,
            "max_tokens": p.max_tokens,
            "min_tokens": p.min_tokens,
            "logprobs": p.logprobs,
            "skip_special_tokens": p.skip_special_tokens,
            "spaces_between_special_tokens": f.spaces_between_special_tokens.unwrap_or(true),
        },
        "model": req.model,
        "stream": f.stream,
        "stream_options": stream_options,
        "cache_salt": f.cache_salt,
        "priority": 0,
        "kv_transfer_params": null,
    })
}

/// `POST /tokenize`'s body: vLLM's `TokenizeCompletionRequest` or
/// `TokenizeChatRequest`. The chat's template options are the chat
/// endpoint's; `add_special_tokens` and `return_token_strs` other than
/// vLLM's defaults are refused by name.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct TokenizeBody {
    model: Option<String>,
    prompt: Option<String>,
    messages: Option<Value>,
    add_special_tokens: Option<bool>,
    add_generation_prompt: Option<bool>,
    continue_final_message: Option<bool>,
    chat_template_kwargs: Option<Value>,
    return_token_strs: Option<bool>,
}

#[derive(Serialize)]
struct TokenizeResponse {
    count: usize,
    max_model_len: usize,
    tokens: Vec<u32>,
    token_strs: Option<Vec<String>>,
}

async fn tokenize(
    State(state): State<WorkerState>,
    ext: Extensions,
    headers: HeaderMap,
    body: Body,
) -> Response {
    answer(async {
        let (engine, served, body) = start(&state, &headers, &ext, body).await?;
        let b: TokenizeBody = parse(&body)?;
        // `model` may be left out; when given it must be served.
        if let Some(m) = &b.model {
            served.check(m)?;
        }
        let refuse = |param: &'static str, what: &str| -> ApiError {
            RuleError::param(
                param,
                format!("{param}: {what} is not supported by this worker"),
            )
            .into()
        };
        if b.return_token_strs == Some(true) {
            return Err(refuse("return_token_strs", "true"));
        }
        let ids = match (&b.prompt, &b.messages) {
            (Some(prompt), None) => {
                if b.add_special_tokens == Some(false) {
                    return Err(refuse("add_special_tokens", "false"));
                }
                for (set, name) in [
                    (b.add_generation_prompt.is_some(), "add_generation_prompt"),
                    (b.continue_final_message.is_some(), "continue_final_message"),
                    (b.chat_template_kwargs.is_some(), "chat_template_kwargs"),
                ] {
                    if set {
                        return Err(RuleError::param(
                            name,
                            format!("{name} goes with messages, not prompt"),
                        )
                        .into());
                    }
                }
                prompt_ids(&engine, &Prompt::Text(prompt.clone())).await?
            }
            (None, Some(messages)) => {
                if b.add_special_tokens == Some(true) {
                    return Err(refuse("add_special_tokens", "true with messages"));
                }
                // The chat endpoint's own path: the same rules, the same template.
                let mut chat = json!({
                    "model": b.model.clone().unwrap_or_else(|| engine.info().name.clone()),
                    "messages": messages,
                });
                for (name, v) in [
                    (
                        "add_generation_prompt",
                        b.add_generation_prompt.map(Value::from),
                    ),
                    (
                        "continue_final_message",
                        b.continue_final_message.map(Value::from),
                    ),
                    ("chat_template_kwargs", b.chat_template_kwargs.clone()),
                ] {
                    if let Some(v) = v {
                        chat[name] = v;
                    }
                }
                let bytes = Bytes::from(
                    serde_json::to_vec(&chat).map_err(|e| ApiError::Internal(e.to_string()))?,
                );
                chat_ids(&engine, served, bytes).await?.1
            }
            (Some(_), Some(_)) => {
                return Err(RuleError::param(
                    "messages",
                    "send either prompt or messages, not both",
                )
                .into());
            }
            (None, None) => {
                return Err(RuleError::param(
                    "prompt",
                    "the request has neither prompt nor messages",
                )
                .into());
            }
        };
        Ok(serde_json::to_value(TokenizeResponse {
            count: ids.len(),
            max_model_len: engine.info().seq_len,
            tokens: ids,
            token_strs: None,
        })
        .unwrap_or(Value::Null))
    })
    .await
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct DetokenizeBody {
    model: Option<String>,
    tokens: Vec<u32>,
}

async fn detokenize(
    State(state): State<WorkerState>,
    ext: Extensions,
    headers: HeaderMap,
    body: Body,
) -> Response {
    answer(async {
        let (engine, served, body) = start(&state, &headers, &ext, body).await?;
        let b: DetokenizeBody = parse(&body)?;
        if let Some(m) = &b.model {
            served.check(m)?;
        }
        check_vocab(&b.tokens, engine.info().vocab_size)
            .map_err(|e| RuleError::param("tokens", e.to_string()))?;
        let e = Arc::clone(&engine);
        let prompt = blocking(move || e.detokenize(&b.tokens).map_err(ApiError::from)).await?;
        Ok(json!({ "prompt": prompt }))
    })
    .await
}

/// A tokenizer body: JSON, known fields only (an unknown one is named).
fn parse<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    serde_json::from_slice(body).map_err(|e| {
        let msg = e.to_string();
        let field = msg
            .strip_prefix("unknown field `")
            .and_then(|r| r.split('`').next())
            .map(str::to_string);
        let mut err = RuleError::param("body", format!("invalid request: {msg}"));
        if let Some(f) = field {
            err.param = None;
            err.field = Some(f);
            err.code = Some("unknown_parameter");
        }
        ApiError::from(err)
    })
}

/// The engine (503 while loading) and the body within the completion
/// endpoints' size (413) and time (408) limits and the listener's body budget
/// (503): the completion path's own reader.
/// The engine, the names it is served under, and the body read within the
/// worker's limits.
async fn start(
    state: &WorkerState,
    headers: &HeaderMap,
    ext: &Extensions,
    body: Body,
) -> Result<(Arc<dyn Engine>, Arc<ServedModels>, Bytes), ApiError> {
    let engine = state.engine().ok_or(ApiError::NotReady)?;
    let served = state.served().ok_or(ApiError::NotReady)?.clone();
    let body = crate::completions::read_body(state, headers, ext, body).await?;
    Ok((engine, served, body.bytes().clone()))
}

/// CPU work (parsing up to `body_limit` bytes, templates) off the async threads.
async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, ApiError> + Send + 'static,
) -> Result<T, ApiError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| ApiError::Internal(format!("render task: {e}")))?
}

async fn answer(f: impl std::future::Future<Output = Result<Value, ApiError>>) -> Response {
    match f.await {
        Ok(v) => axum::Json(v).into_response(),
        Err(e) => e.into_response(),
    }
}
