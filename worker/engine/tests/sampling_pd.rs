//! The logit processors and log-probabilities across a prefill/decode
//! split: a prefill on one engine and a decode of its exported cache on a
//! fresh one give exactly the tokens, log-probabilities and finish of a solo
//! run, with every processor on (tiny model, same code path as a GGUF).

mod common;

use common::{collect, solo, through_the_wire};
use rngd_engine::tiny::{self, TINY_IM_END};
use rngd_engine::{Engine, GenEvent, Prefilled, SamplingParams, StopReason, TokenLogprobs};

fn prompt(n: usize) -> Vec<u32> {
    (0..n as u32).map(|i| (i * 37 + 11) % 256).collect()
}

/// Every event's (id, logprobs) and the finish of a stream.
async fn events(
    mut rx: tokio::sync::mpsc::Receiver<GenEvent>,
) -> (Vec<(u32, Option<TokenLogprobs>)>, Option<StopReason>) {
    let mut out = Vec::new();
    let mut stop = None;
    while let Some(ev) = rx.recv().await {
        match ev {
            GenEvent::Token { id, logprobs, .. } => out.push((id, logprobs)),
            GenEvent::Done { stop_reason, .. } => stop = stop_reason,
            GenEvent::Error(e) => panic!("{e}"),
        }
    }
    (out, stop)
}

#[tokio::test]
async fn every_processor_and_the_logprobs_survive_the_split() {
    let a = tiny::engine(128, 1).unwrap();
    let p = prompt(20);
    let params = SamplingParams {
        max_tokens: 40,
        temperature: 0.8,
        top_k: 30,
        top_p: 0.95,
        min_p: 0.01,
        seed: 5,
        presence_penalty: 0.5,
        frequency_penalty: 0.3,
        repetition_penalty: 1.3,
        logit_bias: vec![(101, 2.0), (TINY_IM_END, -5.0)],
        min_tokens: 5,
        logprobs: Some(3),
        ..SamplingParams::default()
    };
    let whole = events(a.generate(&p, &params).await.unwrap()).await;
    let pre = a.prefill(&p, &params).await.unwrap();
    assert!(pre.first_logprobs.is_some());
    let fresh = tiny::engine(128, 1).unwrap();
    let shipped = Prefilled {
        kv: through_the_wire(&pre.kv),
        ..pre
    };
    let split = events(fresh.decode(&p, shipped, &params).await.unwrap()).await;
    assert_eq!(split, whole);
    assert_eq!(whole.0.len(), 40);
    for (id, lp) in &whole.0 {
        let lp = lp.as_ref().expect("every token has logprobs");
        assert_eq!(lp.top.len(), 3);
        assert!(lp.logprob <= 0.0 && lp.top.windows(2).all(|w| w[0].1 >= w[1].1));
        // The top list is of the raw distribution: a listed chosen token has its own value.
        if let Some((_, l)) = lp.top.iter().find(|(t, _)| t == id) {
            assert_eq!(*l, lp.logprob);
        }
    }
    // The penalties change the text (same seed, penalties off).
    let plain = SamplingParams {
        presence_penalty: 0.0,
        frequency_penalty: 0.0,
        repetition_penalty: 1.0,
        ..params.clone()
    };
    let other = events(a.generate(&p, &plain).await.unwrap()).await;
    assert_ne!(
        other.0.iter().map(|e| e.0).collect::<Vec<_>>(),
        whole.0.iter().map(|e| e.0).collect::<Vec<_>>()
    );
}

#[tokio::test]
async fn stop_token_ids_ignore_eos_and_min_tokens() {
    let a = tiny::engine(128, 1).unwrap();
    let p = prompt(8);
    let greedy = SamplingParams::greedy(30);
    let base = solo(&*a, &p, &greedy).await.unwrap();
    // A stop token id: the stream ends before it (not emitted), stop_reason names it.
    let at = 4;
    let stop_id = base.ids[at];
    let first_at = base.ids.iter().position(|t| *t == stop_id).unwrap();
    let cut = SamplingParams {
        stop_token_ids: vec![stop_id],
        ..greedy.clone()
    };
    let (ev, stop) = events(a.generate(&p, &cut).await.unwrap()).await;
    assert_eq!(stop, Some(StopReason::Token(stop_id)));
    assert_eq!(
        ev.iter().map(|e| e.0).collect::<Vec<_>>(),
        base.ids[..first_at]
    );
    // min_tokens masks it until enough tokens were generated.
    let late = SamplingParams {
        min_tokens: first_at + 1,
        ..cut.clone()
    };
    let out = collect(a.generate(&p, &late).await.unwrap()).await;
    assert!(out.ids.len() > first_at, "{:?}", out.ids);
    assert!(!out.ids.contains(&stop_id) || out.ids.len() == 30);
    // ignore_eos with a bias towards EOS: EOS is emitted and the stream runs
    // to max_tokens; without ignore_eos it stops at once.
    let eos = SamplingParams {
        logit_bias: vec![(TINY_IM_END, 100.0)],
        ..greedy.clone()
    };
    let out = collect(a.generate(&p, &eos).await.unwrap()).await;
    assert_eq!(out.completion_tokens, 0);
    let ignoring = SamplingParams {
        ignore_eos: true,
        ..eos
    };
    let out = collect(a.generate(&p, &ignoring).await.unwrap()).await;
    assert_eq!(out.ids, vec![TINY_IM_END; 30]);
}
