//! One decoding stream of the CPU engine: what it was asked for, the tokens
//! it has seen (for the penalties), and how each sampled token becomes
//! events — stop tokens, stop sequences, held-back text, the finish.

use tokio::sync::mpsc;

use crate::sampling::{History, Sampled, StopScanner};
use crate::tokenizer::{StreamDecoder, Tokenizer};
use crate::{FinishReason, GenEvent, SamplingParams, StopReason, TokenLogprobs};

/// A token event held while its text may still change.
type Pending = (u32, String, Option<TokenLogprobs>);

/// One decoding stream in a slot.
pub(super) struct Stream {
    tx: mpsc::Sender<GenEvent>,
    /// What the request asked for.
    pub(super) params: SamplingParams,
    /// Prompt and output, as the penalties see them.
    pub(super) history: History,
    /// Token to feed next.
    pub(super) last: u32,
    /// The tokens whose KV is in the stream's cache, in order (the prompt,
    /// then each token fed); empty when the prompt was not kept.
    pub(super) seq: Vec<u32>,
    /// Prompt tokens the prefill read from the prefix cache.
    cached_tokens: usize,
    /// Tokens sampled so far (the next one has this index).
    pub(super) sampled: u64,
    /// Token events sent or pending.
    emitted: usize,
    decoder: StreamDecoder,
    stops: StopScanner,
    pending: Option<Pending>,
}

impl Stream {
    /// A stream after `prompt` that will first feed `first`.
    pub(super) fn new(
        tx: mpsc::Sender<GenEvent>,
        params: SamplingParams,
        prompt: Vec<u32>,
        first: u32,
        cached_tokens: usize,
        tok: &Tokenizer,
    ) -> Self {
        let decoder = StreamDecoder::keeping_special(!params.skip_special_tokens);
        Stream {
            tx,
            history: History::new(&prompt, &params, tok.stop_ids()),
            seq: prompt,
            cached_tokens,
            stops: StopScanner::new(&params.stop),
            last: first,
            // A continued generation counts what it produced before (the
            // first token, sampled by the prefill, is token `resumed`).
            sampled: params.resumed as u64,
            emitted: params.resumed,
            params,
            decoder,
            pending: None,
        }
    }

    /// Whether the receiver is gone.
    pub(super) fn is_closed(&self) -> bool {
        self.tx.is_closed()
    }

    /// Sends an event; false if the receiver is gone.
    pub(super) fn send(&self, ev: GenEvent) -> bool {
        self.tx.try_send(ev).is_ok()
    }

    /// Handles a sampled token; returns false when the stream is over (finished or cancelled).
    pub(super) fn on_token(&mut self, tok: &Tokenizer, s: Sampled) -> bool {
        let Sampled { id, logprobs } = s;
        self.sampled += 1;
        self.last = id;
        if !self.params.ignore_eos && tok.stop_ids().contains(&id) {
            return self.finish(FinishReason::Stop, None);
        }
        if self.params.stop_token_ids.contains(&id) {
            return self.finish(FinishReason::Stop, Some(StopReason::Token(id)));
        }
        self.history.push(id);
        let piece = self.decoder.push(tok, id);
        let scanned = self.stops.push(&piece);
        let mut text = scanned.text;
        if let Some((pid, mut ptext, plp)) = self.pending.take() {
            ptext.push_str(&text);
            text = String::new();
            if !self.send(GenEvent::Token {
                id: pid,
                text: ptext,
                logprobs: plp,
            }) {
                return false;
            }
        }
        self.emitted += 1;
        if scanned.stopped {
            if !self.send(GenEvent::Token { id, text, logprobs }) {
                return false;
            }
            let matched = self.stops.matched().map(|m| StopReason::Text(m.into()));
            return self.finish(FinishReason::Stop, matched);
        }
        if self.decoder.is_holding() || self.stops.is_holding() {
            self.pending = Some((id, text, logprobs));
        } else if !self.send(GenEvent::Token { id, text, logprobs }) {
            return false;
        }
        if self.emitted >= self.params.max_tokens {
            return self.finish(FinishReason::Length, None);
        }
        true
    }

    /// Flushes held text and sends `Done`. Always returns false (the stream is over).
    pub(super) fn finish(&mut self, reason: FinishReason, stop: Option<StopReason>) -> bool {
        let tail = self.decoder.finish();
        let scanned = self.stops.push(&tail);
        let mut text = scanned.text;
        let (mut reason, mut stop) = (reason, stop);
        if scanned.stopped {
            reason = FinishReason::Stop;
            stop = self.stops.matched().map(|m| StopReason::Text(m.into()));
        } else {
            text.push_str(&self.stops.finish());
        }
        if let Some((pid, mut ptext, plp)) = self.pending.take() {
            ptext.push_str(&text);
            self.send(GenEvent::Token {
                id: pid,
                text: ptext,
                logprobs: plp,
            });
        }
        self.send(GenEvent::Done {
            finish_reason: reason,
            completion_tokens: self.emitted,
            stop_reason: stop,
            cached_tokens: self.cached_tokens,
        });
        false
    }
}
