//! Chat as a completion, both ways: a chat request rendered into the
//! completion request the workers serve ([`to_completion`], with the chat
//! `max_tokens` default), and a completion answer turned back into the
//! OpenAI chat format ([`ChatCompletionResponse::from_completion`] for a whole
//! body, [`ChatChunker`] for a stream). The gateway and the workers both build
//! their chat answers with these, so the two give the same bodies and chunks.

use crate::openai::CompletionRequest;
use crate::openai::{
    ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionRequest,
    ChatCompletionResponse, ChatDelta, ChatLogprobs, ChatResponseMessage, ChoiceLogprobs,
    CompletionResponse, Prompt, Usage,
};

/// `object` of a chat answer.
pub const CHAT_OBJECT: &str = "chat.completion";

/// `object` of a streamed chat chunk.
pub const CHUNK_OBJECT: &str = "chat.completion.chunk";

/// The role of every answer.
pub const ASSISTANT: &str = "assistant";

/// The variables a chat template is given by the server, which
/// `chat_template_kwargs` may not replace (a 400 naming the key).
pub const RESERVED_TEMPLATE_VARIABLES: &[&str] = &[
    "messages",
    "add_generation_prompt",
    "continue_final_message",
    "tools",
    "documents",
    "bos_token",
    "eos_token",
    "chat_template",
];

/// How a chat is rendered with the model's template: vLLM's
/// `add_generation_prompt`, `continue_final_message` and
/// `chat_template_kwargs`. The default is vLLM's (a generation prompt, the
/// final message closed, no extra variables).
#[derive(Debug, Clone, PartialEq)]
pub struct TemplateOptions {
    /// The template's `add_generation_prompt`.
    pub add_generation_prompt: bool,
    /// Cut the rendered text right after the final message's content, so
    /// the model continues that message ([`continue_final`]).
    pub continue_final_message: bool,
    /// More template variables.
    pub kwargs: serde_json::Map<String, serde_json::Value>,
}

impl Default for TemplateOptions {
    fn default() -> Self {
        TemplateOptions {
            add_generation_prompt: true,
            continue_final_message: false,
            kwargs: serde_json::Map::new(),
        }
    }
}

// === impl TemplateOptions ===

impl TemplateOptions {
    /// The options a chat request asks for (unset fields at vLLM's defaults).
    pub fn of(req: &ChatCompletionRequest) -> Self {
        TemplateOptions {
            add_generation_prompt: req.add_generation_prompt.unwrap_or(true),
            continue_final_message: req.continue_final_message.unwrap_or(false),
            kwargs: req.chat_template_kwargs.clone().unwrap_or_default(),
        }
    }
}

/// `continue_final_message`: the rendered chat cut right after the last
/// place the final message's content (trimmed) appears, so nothing the
/// template closes a message with follows it. The content's own trailing
/// whitespace is kept when the template kept it. An error when the template
/// did not print the content (it rewrote or dropped it).
pub fn continue_final(rendered: &str, final_content: &str) -> Result<String, String> {
    let trimmed = final_content.trim();
    let Some(at) = rendered.rfind(trimmed) else {
        return Err(
            "continue_final_message: the final message does not appear in the rendered chat".into(),
        );
    };
    let lead_trimmed = final_content.trim_start();
    let end = if rendered[at..].starts_with(lead_trimmed) {
        at + lead_trimmed.len()
    } else {
        at + trimmed.len()
    };
    Ok(rendered[..end].to_string())
}

/// The tokens a chat asks to generate at most: `max_completion_tokens`,
/// else `max_tokens` (the precedence of OpenAI and vLLM, and of every door
/// and the policy); `None` when it names neither.
pub fn requested_max_tokens(req: &ChatCompletionRequest) -> Option<u32> {
    req.max_completion_tokens.or(req.sampling.max_tokens)
}

/// Tokens a chat may generate: `max_completion_tokens`, else `max_tokens`,
/// else until the context is full (`seq_len - prompt_tokens`, at least 1;
/// OpenAI's chat default), or the completion default when `seq_len` is unknown.
pub fn max_tokens(req: &ChatCompletionRequest, prompt_tokens: usize, seq_len: Option<u32>) -> u32 {
    match (requested_max_tokens(req), seq_len) {
        (Some(m), _) => m,
        (None, Some(s)) => (s as usize).saturating_sub(prompt_tokens).max(1) as u32,
        (None, None) => crate::openai::DEFAULT_MAX_TOKENS,
    }
}

/// The completion request a chat becomes: `prompt` is the chat rendered with
/// the model's template (`prompt_tokens` long), `max_tokens` is set by
/// [`max_tokens`], `logprobs: true` + `top_logprobs: N` become
/// `chat_logprobs: N` (the answer's log-probabilities in the chat format),
/// every other sampling and streaming field is the chat's.
pub fn to_completion(
    req: &ChatCompletionRequest,
    prompt: String,
    prompt_tokens: usize,
    seq_len: Option<u32>,
) -> CompletionRequest {
    let mut sampling = req.sampling.clone();
    sampling.max_tokens = Some(max_tokens(req, prompt_tokens, seq_len));
    CompletionRequest {
        model: req.model.clone(),
        prompt: Prompt::Text(prompt),
        sampling,
        logprobs: None,
        echo: None,
        chat_logprobs: (req.logprobs == Some(true)).then(|| req.top_logprobs.unwrap_or(0)),
        kv_transfer_params: None,
        tokenized_prompt: None,
    }
}

/// A completion choice's log-probabilities as a chat's (the chat format is
/// what a chat's completion asks for; the legacy format has no place there).
fn chat_logprobs(l: Option<ChoiceLogprobs>) -> Option<ChatLogprobs> {
    match l {
        Some(ChoiceLogprobs::Chat(c)) => Some(c),
        Some(ChoiceLogprobs::Completion(_)) | None => None,
    }
}

impl ChatCompletionResponse {
    /// The chat answer of a completion answer: its first choice's text as the
    /// assistant message with its `finish_reason`; `id`, `model`, `created`,
    /// `usage` (zero when absent) and `timings` carried over.
    pub fn from_completion(c: CompletionResponse) -> Self {
        let choice = c.choices.into_iter().next();
        let (content, finish_reason, logprobs, stop_reason) = match choice {
            Some(ch) => (
                ch.text,
                ch.finish_reason,
                chat_logprobs(ch.logprobs),
                ch.stop_reason,
            ),
            None => (String::new(), None, None, None),
        };
        ChatCompletionResponse {
            id: c.id,
            object: CHAT_OBJECT.into(),
            created: c.created,
            model: c.model,
            choices: vec![ChatChoice {
                index: 0,
                message: ChatResponseMessage {
                    role: ASSISTANT.into(),
                    content,
                },
                logprobs,
                finish_reason,
                stop_reason,
            }],
            usage: c.usage.unwrap_or_default(),
            timings: c.timings,
        }
    }
}

/// Turns a completion stream's chunks into chat chunks: before the first
/// choice a chunk with `delta.role = "assistant"`, then a content delta per
/// chunk with text, the `finish_reason` on the chunk that carries it, and the
/// usage chunk (no choices) when the client asked for it.
#[derive(Debug, Clone)]
pub struct ChatChunker {
    id: String,
    model: String,
    created: u64,
    include_usage: bool,
    role_sent: bool,
}

impl ChatChunker {
    /// A chunker whose chunks carry `id`, `model` and `created`;
    /// `include_usage`: pass usage chunks on (`stream_options.include_usage`).
    pub fn new(id: String, model: String, created: u64, include_usage: bool) -> Self {
        ChatChunker {
            id,
            model,
            created,
            include_usage,
            role_sent: false,
        }
    }

    fn chunk(&self, choices: Vec<ChatChunkChoice>, usage: Option<Usage>) -> ChatCompletionChunk {
        ChatCompletionChunk {
            id: self.id.clone(),
            object: CHUNK_OBJECT.into(),
            created: self.created,
            model: self.model.clone(),
            choices,
            usage,
        }
    }

    /// The chat chunks (none, one or several) for one completion chunk. A
    /// chunk with choices and usage (`continuous_usage_stats`) gives chat
    /// chunks that each carry the usage so far (the role chunk: none
    /// generated yet); usage alone is the usage chunk.
    pub fn push(&mut self, chunk: &CompletionResponse) -> Vec<ChatCompletionChunk> {
        let mut out = Vec::new();
        let running = chunk.usage.filter(|_| self.include_usage);
        if let Some(choice) = chunk.choices.first() {
            if !self.role_sent {
                self.role_sent = true;
                out.push(self.chunk(
                    vec![ChatChunkChoice {
                        index: 0,
                        delta: ChatDelta {
                            role: Some(ASSISTANT.into()),
                            content: Some(String::new()),
                        },
                        logprobs: None,
                        finish_reason: None,
                        stop_reason: None,
                    }],
                    running.map(|u| Usage::new(u.prompt_tokens, 0)),
                ));
            }
            let logprobs = chat_logprobs(choice.logprobs.clone());
            if !choice.text.is_empty() || choice.finish_reason.is_some() || logprobs.is_some() {
                out.push(self.chunk(
                    vec![ChatChunkChoice {
                        index: 0,
                        delta: ChatDelta {
                            role: None,
                            content: (!choice.text.is_empty()).then(|| choice.text.clone()),
                        },
                        logprobs,
                        finish_reason: choice.finish_reason.clone(),
                        stop_reason: choice.stop_reason.clone(),
                    }],
                    running,
                ));
            }
            return out;
        }
        if let Some(u) = running {
            out.push(self.chunk(Vec::new(), Some(u)));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::openai::{CompletionChoice, SamplingFields, Timings};

    fn completion(text: &str, finish: Option<&str>, usage: Option<Usage>) -> CompletionResponse {
        CompletionResponse {
            id: "chatcmpl-1".into(),
            object: "text_completion".into(),
            created: 7,
            model: "m".into(),
            choices: vec![CompletionChoice {
                index: 0,
                text: text.into(),
                logprobs: None,
                finish_reason: finish.map(String::from),
                stop_reason: None,
                token_ids: Some(vec![1]),
            }],
            usage,
            kv_transfer_params: None,
            timings: Some(Timings::default()),
        }
    }

    #[test]
    fn a_whole_answer_becomes_an_assistant_message() {
        let c = ChatCompletionResponse::from_completion(completion(
            "hi",
            Some("stop"),
            Some(Usage::new(3, 2)),
        ));
        assert_eq!(
            (c.id.as_str(), c.object.as_str()),
            ("chatcmpl-1", CHAT_OBJECT)
        );
        assert_eq!(c.choices[0].message.role, ASSISTANT);
        assert_eq!(c.choices[0].message.content, "hi");
        assert_eq!(c.choices[0].finish_reason.as_deref(), Some("stop"));
        assert_eq!(c.usage, Usage::new(3, 2));
        assert!(c.timings.is_some());
    }

    #[test]
    fn a_stream_gets_the_role_first_then_deltas_finish_and_usage() {
        let mut k = ChatChunker::new("chatcmpl-1".into(), "m".into(), 7, true);
        let a = k.push(&completion("a", None, None));
        assert_eq!(a.len(), 2);
        assert_eq!(a[0].choices[0].delta.role.as_deref(), Some(ASSISTANT));
        assert_eq!(a[1].choices[0].delta.content.as_deref(), Some("a"));
        let b = k.push(&completion("b", None, None));
        assert_eq!(b.len(), 1);
        assert_eq!(b[0].choices[0].delta.role, None);
        let fin = k.push(&completion("", Some("length"), None));
        assert_eq!(fin[0].choices[0].delta.content, None);
        assert_eq!(fin[0].choices[0].finish_reason.as_deref(), Some("length"));
        let mut usage = completion("", None, Some(Usage::new(1, 2)));
        usage.choices.clear();
        let u = k.push(&usage);
        assert!(u[0].choices.is_empty());
        assert_eq!(u[0].usage, Some(Usage::new(1, 2)));
        assert!(
            a.iter()
                .chain(&b)
                .chain(&fin)
                .chain(&u)
                .all(|c| c.object == CHUNK_OBJECT && c.id == "chatcmpl-1")
        );
        let mut quiet = ChatChunker::new("x".into(), "m".into(), 7, false);
        assert!(quiet.push(&usage).is_empty());
    }

    #[test]
    fn continue_final_cuts_after_the_last_message() {
        let r = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nOnce upon<|im_end|>\n";
        assert_eq!(
            continue_final(r, "Once upon").unwrap(),
            "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nOnce upon"
        );
        // Trailing space the template trimmed is not invented; kept when kept.
        assert!(
            continue_final(r, "Once upon ")
                .unwrap()
                .ends_with("Once upon")
        );
        assert!(
            continue_final("a: x y \n", "x y ")
                .unwrap()
                .ends_with("x y ")
        );
        // The last occurrence is the one cut at.
        assert_eq!(continue_final("hi hi!", "hi").unwrap(), "hi hi");
        assert!(continue_final(r, "never printed").is_err());
    }

    #[test]
    fn template_options_default_to_vllm() {
        let d = TemplateOptions::default();
        assert!(d.add_generation_prompt && !d.continue_final_message && d.kwargs.is_empty());
    }

    #[test]
    fn max_tokens_defaults_to_the_rest_of_the_context() {
        let mut req = ChatCompletionRequest {
            model: "m".into(),
            messages: Vec::new(),
            max_completion_tokens: None,
            logprobs: None,
            top_logprobs: None,
            add_generation_prompt: None,
            continue_final_message: None,
            chat_template_kwargs: None,
            sampling: SamplingFields::default(),
        };
        assert_eq!(max_tokens(&req, 9, Some(100)), 91);
        assert_eq!(max_tokens(&req, 200, Some(100)), 1);
        assert_eq!(max_tokens(&req, 9, None), crate::openai::DEFAULT_MAX_TOKENS);
        req.sampling.max_tokens = Some(5);
        assert_eq!(max_tokens(&req, 9, Some(100)), 5);
        req.max_completion_tokens = Some(4);
        let c = to_completion(&req, "user: hi\n".into(), 9, Some(100));
        assert_eq!(c.sampling.max_tokens, Some(4));
        assert_eq!(c.prompt, Prompt::Text("user: hi\n".into()));
        assert_eq!(c.kv_transfer_params, None);
    }
}
