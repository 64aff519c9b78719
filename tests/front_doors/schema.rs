//! The request fields of OpenAI's published API schema (and vLLM's sampling
//! extensions) with a non-default value each and whether this server
//! honours it, for `every_openai_request_field_is_honoured_or_refused_by_name`.

/// Every field of OpenAI's `CreateCompletionRequest` (from the published
/// OpenAI API schema, besides `model` and `prompt`), a non-default value of
/// it, and whether it is honoured (200) or refused with a 400 naming it;
/// then vLLM's sampling extensions.
pub const COMPLETION_SCHEMA: &[(&str, &str, bool)] = &[
    ("best_of", r#""best_of":2"#, false),
    ("echo", r#""echo":true"#, true),
    ("frequency_penalty", r#""frequency_penalty":0.5"#, true),
    ("logit_bias", r#""logit_bias":{"7":3}"#, true),
    ("logprobs", r#""logprobs":2"#, true),
    ("max_tokens", r#""max_tokens":3"#, true),
    ("n", r#""n":2"#, true),
    ("presence_penalty", r#""presence_penalty":0.5"#, true),
    ("seed", r#""seed":5"#, true),
    ("stop", r#""stop":["x"]"#, true),
    ("stream", r#""stream":true"#, true),
    (
        "stream_options",
        r#""stream":true,"stream_options":{"include_usage":true}"#,
        true,
    ),
    ("suffix", r#""suffix":"x""#, false),
    ("temperature", r#""temperature":0.5"#, true),
    ("top_p", r#""top_p":0.5"#, true),
    ("user", r#""user":"u""#, true),
    // vLLM's.
    ("top_k", r#""top_k":5"#, true),
    ("min_p", r#""min_p":0.1"#, true),
    ("repetition_penalty", r#""repetition_penalty":1.1"#, true),
    ("min_tokens", r#""min_tokens":1"#, true),
    ("ignore_eos", r#""ignore_eos":true"#, true),
    ("stop_token_ids", r#""stop_token_ids":[9]"#, true),
    ("prompt_logprobs", r#""prompt_logprobs":1"#, false),
    ("use_beam_search", r#""use_beam_search":true"#, false),
    ("guided_json", r#""guided_json":{}"#, false),
    (
        "response_format",
        r#""response_format":{"type":"json_object"}"#,
        false,
    ),
];

/// The same for OpenAI's `CreateChatCompletionRequest` (besides `model` and
/// `messages`).
pub const CHAT_SCHEMA: &[(&str, &str, bool)] = &[
    (
        "audio",
        r#""audio":{"voice":"alloy","format":"wav"}"#,
        false,
    ),
    ("frequency_penalty", r#""frequency_penalty":0.5"#, true),
    ("function_call", r#""function_call":"auto""#, false),
    ("functions", r#""functions":[{"name":"f"}]"#, false),
    ("logit_bias", r#""logit_bias":{"7":3}"#, true),
    ("logprobs", r#""logprobs":true"#, true),
    (
        "max_completion_tokens",
        r#""max_completion_tokens":3"#,
        true,
    ),
    ("max_tokens", r#""max_tokens":3"#, true),
    ("metadata", r#""metadata":{"k":"v"}"#, false),
    ("modalities", r#""modalities":["text","audio"]"#, false),
    ("n", r#""n":2"#, true),
    (
        "parallel_tool_calls",
        r#""parallel_tool_calls":false"#,
        true,
    ),
    (
        "prediction",
        r#""prediction":{"type":"content","content":"x"}"#,
        false,
    ),
    ("presence_penalty", r#""presence_penalty":0.5"#, true),
    ("prompt_cache_key", r#""prompt_cache_key":"k""#, true),
    ("reasoning_effort", r#""reasoning_effort":"low""#, false),
    (
        "response_format",
        r#""response_format":{"type":"json_object"}"#,
        false,
    ),
    ("safety_identifier", r#""safety_identifier":"s""#, true),
    ("seed", r#""seed":-5"#, true),
    ("service_tier", r#""service_tier":"flex""#, false),
    ("stop", r#""stop":"x""#, true),
    ("store", r#""store":true"#, false),
    ("stream", r#""stream":true"#, true),
    (
        "stream_options",
        r#""stream":true,"stream_options":{"include_usage":true}"#,
        true,
    ),
    ("temperature", r#""temperature":0.5"#, true),
    ("tool_choice", r#""tool_choice":"auto""#, false),
    (
        "tools",
        r#""tools":[{"type":"function","function":{"name":"f"}}]"#,
        false,
    ),
    ("top_logprobs", r#""logprobs":true,"top_logprobs":2"#, true),
    ("top_p", r#""top_p":0.5"#, true),
    ("user", r#""user":"u""#, true),
    ("verbosity", r#""verbosity":"low""#, false),
    ("web_search_options", r#""web_search_options":{}"#, false),
];
