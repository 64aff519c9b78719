//! TEST FAKE: [`EchoEngine`], an [`Engine`] that computes nothing.
//!
//! For other crates' tests and for latency benchmarks of the serving path
//! (gateway, transports) where model compute would only add noise. It is not
//! a model: tokens are the prompt's bytes echoed back cyclically.
//!
//! - `tokenize`: one token per UTF-8 byte (vocabulary 256, no specials);
//! - `prefill`: instant; first token = the prompt's first token; the KV cache
//!   is a small bf16 layout (2 layers, 1 KV head, head_dim 8, S = `seq_len`)
//!   whose bytes are a deterministic function of the prompt, so a decode can
//!   check it received the cache of *its* prompt;
//! - `decode`: checks the cache against the prompt (an [`GenEvent::Error`] if it
//!   does not match), then streams token `i` = `prompt[i % len]` until
//!   `max_tokens` (finish `Length`) or a stop sequence (finish `Stop`);
//!   sampling parameters other than `max_tokens`, `stop` and `logprobs` are
//!   ignored, and asked-for log-probabilities say the echoed token is certain;
//! - with a gate ([`EchoEngine::with_gate`]), each decoded token after the
//!   first waits for one permit the test releases, so a test can check what a
//!   client saw *before* the next token existed (ordering, not wall time).

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use rngd_kv_wire::{Dtype, KvLayout};
use tokio::sync::{Semaphore, mpsc};

use crate::sampling::StopScanner;
use crate::{
    Engine, EngineError, FinishReason, GenEvent, KvCache, ModelInfo, Prefilled, SamplingParams,
    StopReason, TokenLogprobs, check_context,
};

/// The echo engine's `weight_version` unless [`EchoEngine::with_weight_version`]
/// says otherwise.
pub const ECHO_WEIGHT_VERSION: &str = "echo000000000000";

/// TEST FAKE engine: echoes the prompt; see the module docs.
#[derive(Debug)]
pub struct EchoEngine {
    info: ModelInfo,
    token_delay: Duration,
    gate: Option<Arc<Semaphore>>,
    /// What [`Engine::max_batch`] says (8; a variant's own).
    max_batch: usize,
}

impl EchoEngine {
    /// An echo engine named `echo` with context length `seq_len`.
    pub fn new(seq_len: usize) -> Self {
        EchoEngine {
            info: ModelInfo {
                name: "echo".into(),
                seq_len,
                kv_layout: KvLayout {
                    layers: 2,
                    kv_heads: 1,
                    head_dim: 8,
                    seq_len,
                    dtype: Dtype::Bf16,
                },
                vocab_size: 256,
                weight_version: ECHO_WEIGHT_VERSION.into(),
            },
            token_delay: Duration::ZERO,
            gate: None,
            max_batch: 8,
        }
    }

    /// Each decoded token after the first takes one permit of `gate` (the
    /// test adds them with [`Semaphore::add_permits`]) before it is made.
    pub fn with_gate(mut self, gate: Arc<Semaphore>) -> Self {
        self.gate = Some(gate);
        self
    }

    /// Reports `version` as its `weight_version` (a test's stand-in for an
    /// engine loaded with other weights of the same shape).
    pub fn with_weight_version(mut self, version: &str) -> Self {
        self.info.weight_version = version.to_string();
        self
    }

    /// Sleeps this long before each decoded token (default: none).
    pub fn with_token_delay(mut self, delay: Duration) -> Self {
        self.token_delay = delay;
        self
    }

    /// The KV cache the fake "computes" for `prompt`.
    pub fn cache_for(&self, prompt: &[u32]) -> KvCache {
        let layout = self.info.kv_layout;
        let mut h: u32 = 2_166_136_261;
        for t in prompt {
            h = (h ^ t).wrapping_mul(16_777_619);
        }
        let blobs = (0..layout.blob_count())
            .map(|i| {
                let mut b = vec![0u8; layout.blob_bytes()];
                for (j, x) in b.iter_mut().enumerate() {
                    *x = (h.rotate_left((i + j) as u32 % 32) >> 3) as u8 ^ (j as u8);
                }
                Bytes::from(b)
            })
            .collect();
        KvCache {
            layout,
            tokens: prompt.len(),
            // S-wide, unlike the CPU engine: receivers read both versions.
            wire: rngd_kv_wire::WIRE_FULL,
            blobs,
        }
    }
}

/// The fake's log-probabilities: the echoed token is certain (log p = 0),
/// and it is the only alternative listed.
fn certain(id: u32, params: &SamplingParams) -> Option<TokenLogprobs> {
    params.logprobs.map(|n| TokenLogprobs {
        logprob: 0.0,
        top: if n > 0 { vec![(id, 0.0)] } else { Vec::new() },
    })
}

fn stop_reason(finish: FinishReason, stops: &StopScanner) -> Option<StopReason> {
    match finish {
        FinishReason::Stop => stops.matched().map(|m| StopReason::Text(m.into())),
        FinishReason::Length => None,
    }
}

#[async_trait::async_trait]
impl Engine for EchoEngine {
    fn info(&self) -> &ModelInfo {
        &self.info
    }

    fn max_batch(&self) -> Option<usize> {
        Some(self.max_batch)
    }

    /// The same name and weights, context `seq_len`, ungated.
    fn variant(&self, seq_len: usize, max_batch: usize) -> Result<Arc<dyn Engine>, EngineError> {
        if seq_len == 0 || max_batch == 0 {
            return Err(EngineError::InvalidRequest(
                "seq_len and max_batch must be at least 1".into(),
            ));
        }
        let mut e = EchoEngine::new(seq_len).with_weight_version(&self.info.weight_version);
        e.info.name = self.info.name.clone();
        e.token_delay = self.token_delay;
        e.max_batch = max_batch;
        Ok(Arc::new(e))
    }

    fn tokenize(&self, text: &str) -> Result<Vec<u32>, EngineError> {
        Ok(text.bytes().map(u32::from).collect())
    }

    fn detokenize(&self, ids: &[u32]) -> Result<String, EngineError> {
        let bytes: Vec<u8> = ids.iter().map(|i| *i as u8).collect();
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    }

    /// `role: content` lines; the template options have no effect here.
    fn chat_prompt(
        &self,
        messages: &[(String, String)],
        _opts: &rngd_api::chat::TemplateOptions,
    ) -> Result<String, EngineError> {
        Ok(messages
            .iter()
            .map(|(r, c)| format!("{r}: {c}\n"))
            .collect())
    }

    async fn prefill(
        &self,
        prompt: &[u32],
        params: &SamplingParams,
    ) -> Result<Prefilled, EngineError> {
        if prompt.is_empty() {
            return Err(EngineError::InvalidRequest("the prompt is empty".into()));
        }
        check_context(prompt.len(), params.max_tokens, self.info.seq_len)?;
        let started = Instant::now();
        Ok(Prefilled {
            first_token: prompt[0],
            first_logprobs: certain(prompt[0], params),
            kv: self.cache_for(prompt),
            elapsed: started.elapsed(),
            cached_tokens: 0,
        })
    }

    async fn decode(
        &self,
        prompt: &[u32],
        prefilled: Prefilled,
        params: &SamplingParams,
    ) -> Result<mpsc::Receiver<GenEvent>, EngineError> {
        check_context(prompt.len(), params.max_tokens, self.info.seq_len)?;
        let (tx, rx) = mpsc::channel(params.max_tokens + 2);
        if prefilled.kv != self.cache_for(prompt) {
            let _ = tx.try_send(GenEvent::Error(
                "KV cache does not belong to this prompt".into(),
            ));
            return Ok(rx);
        }
        let prompt = prompt.to_vec();
        let params = params.clone();
        let max = params.max_tokens;
        let cached_tokens = prefilled.cached_tokens;
        let mut stops = StopScanner::new(&params.stop);
        let delay = self.token_delay;
        let gate = self.gate.clone();
        let emit = move |i: usize, stops: &mut StopScanner| {
            let id = prompt[i % prompt.len()];
            let scanned = stops.push(&String::from_utf8_lossy(&[id as u8]));
            (id, scanned)
        };
        let mut finish = FinishReason::Length;
        let mut n = 0;
        if delay.is_zero() && gate.is_none() {
            while n < max {
                let (id, s) = emit(n, &mut stops);
                n += 1;
                let logprobs = certain(id, &params);
                let _ = tx.try_send(GenEvent::Token {
                    id,
                    text: s.text,
                    logprobs,
                });
                if s.stopped {
                    finish = FinishReason::Stop;
                    break;
                }
            }
            let _ = tx.try_send(GenEvent::Done {
                finish_reason: finish,
                completion_tokens: n,
                stop_reason: stop_reason(finish, &stops),
                cached_tokens,
            });
        } else {
            tokio::spawn(async move {
                while n < max {
                    if n > 0
                        && let Some(g) = &gate
                    {
                        match g.acquire().await {
                            Ok(p) => p.forget(),
                            Err(_) => return,
                        }
                    }
                    tokio::time::sleep(delay).await;
                    let (id, s) = emit(n, &mut stops);
                    n += 1;
                    let logprobs = certain(id, &params);
                    let ev = GenEvent::Token {
                        id,
                        text: s.text,
                        logprobs,
                    };
                    if tx.send(ev).await.is_err() {
                        return;
                    }
                    if s.stopped {
                        finish = FinishReason::Stop;
                        break;
                    }
                }
                let _ = tx
                    .send(GenEvent::Done {
                        finish_reason: finish,
                        completion_tokens: n,
                        stop_reason: stop_reason(finish, &stops),
                        cached_tokens,
                    })
                    .await;
            });
        }
        Ok(rx)
    }

    fn waiting(&self) -> usize {
        0
    }

    fn running(&self) -> usize {
        0
    }

    fn kv_usage(&self) -> f64 {
        0.0
    }
}
