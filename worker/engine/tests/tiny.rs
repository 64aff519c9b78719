//! Fast tests on the tiny random-weights model: the same engine code path.

mod common;

use std::time::Duration;

use common::{collect, solo, through_the_wire};
use rngd_engine::tiny;
use rngd_engine::{Engine, EngineError, FinishReason, GenEvent, Prefilled, SamplingParams};

fn prompt(n: usize, salt: u32) -> Vec<u32> {
    (0..n as u32).map(|i| (i * 37 + salt * 11) % 256).collect()
}

#[tokio::test]
async fn pd_split_through_wire_bytes_matches_solo() {
    let a = tiny::engine(128, 1).unwrap();
    for (n, salt) in [(1, 0), (5, 1), (40, 2), (100, 3)] {
        let p = prompt(n, salt);
        let params = SamplingParams {
            max_tokens: 128 - n,
            ..SamplingParams::greedy(0)
        };
        let s = solo(&*a, &p, &params).await.unwrap();
        let pre = a.prefill(&p, &params).await.unwrap();
        assert_eq!(pre.kv.tokens, n);
        assert_eq!(pre.kv.blobs.len(), 4);
        let fresh = tiny::engine(128, 1).unwrap();
        let shipped = Prefilled {
            kv: through_the_wire(&pre.kv),
            ..pre
        };
        let d = collect(fresh.decode(&p, shipped, &params).await.unwrap()).await;
        assert_eq!(d, s, "prompt of {n}");
    }
}

#[tokio::test]
async fn a_corrupted_cache_changes_the_tokens() {
    // The decode really reads the cache: flipping it changes the output.
    let a = tiny::engine(64, 1).unwrap();
    let p = prompt(30, 9);
    let params = SamplingParams::greedy(30);
    let s = solo(&*a, &p, &params).await.unwrap();
    assert!(
        s.ids.len() >= 10,
        "tiny model stopped after {} tokens",
        s.ids.len()
    );
    let pre = a.prefill(&p, &params).await.unwrap();
    let mut kv = through_the_wire(&pre.kv);
    for b in kv.blobs.iter_mut() {
        let mut v = b.to_vec();
        for x in v.iter_mut().skip(1).step_by(2) {
            *x ^= 0x40; // high byte of each bf16: large change
        }
        *b = v.into();
    }
    let d = collect(
        a.decode(&p, Prefilled { kv, ..pre }, &params)
            .await
            .unwrap(),
    )
    .await;
    assert_ne!(d.ids, s.ids);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batch_of_four_gives_the_same_tokens_as_batch_one() {
    let one = tiny::engine(128, 1).unwrap();
    let four = tiny::engine(128, 4).unwrap();
    let params = SamplingParams::greedy(40);
    let prompts: Vec<Vec<u32>> = (0..6).map(|i| prompt(3 + 13 * i, i as u32)).collect();
    let mut expected = Vec::new();
    for p in &prompts {
        expected.push(solo(&*one, p, &params).await.unwrap());
    }
    let handles: Vec<_> = prompts
        .iter()
        .map(|p| {
            let (e, p, params) = (four.clone(), p.clone(), params.clone());
            tokio::spawn(async move { solo(&*e, &p, &params).await.unwrap() })
        })
        .collect();
    for (h, exp) in handles.into_iter().zip(expected) {
        assert_eq!(h.await.unwrap(), exp);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn seeded_sampling_is_the_same_split_or_batched() {
    let one = tiny::engine(128, 1).unwrap();
    let three = tiny::engine(128, 3).unwrap();
    let p = prompt(20, 4);
    let params = SamplingParams {
        max_tokens: 50,
        temperature: 1.5,
        top_k: 50,
        top_p: 0.9,
        seed: 77,
        stop: vec![],
        ..SamplingParams::default()
    };
    let s = solo(&*one, &p, &params).await.unwrap();
    let pre = one.prefill(&p, &params).await.unwrap();
    // Decode the shipped cache while two other streams share the batch.
    let busy: Vec<_> = (0..2)
        .map(|i| {
            let e = three.clone();
            let q = prompt(10 + i, 50 + i as u32);
            tokio::spawn(async move { solo(&*e, &q, &SamplingParams::greedy(60)).await.unwrap() })
        })
        .collect();
    let d = collect(
        three
            .decode(
                &p,
                Prefilled {
                    kv: through_the_wire(&pre.kv),
                    ..pre
                },
                &params,
            )
            .await
            .unwrap(),
    )
    .await;
    for b in busy {
        b.await.unwrap();
    }
    assert_eq!(d, s);
    let g = solo(&*one, &p, &SamplingParams::greedy(50)).await.unwrap();
    assert_ne!(g.ids, s.ids, "temperature 1.5 should differ from greedy");
}

#[tokio::test]
async fn over_length_is_refused_before_any_work() {
    let e = tiny::engine(64, 1).unwrap();
    let p = prompt(60, 0);
    let err = e.prefill(&p, &SamplingParams::greedy(5)).await.unwrap_err();
    let EngineError::ContextLength(m) = err else {
        panic!("{err:?}")
    };
    assert_eq!(m, rngd_api::openai::context_length_message(60, 5, 64));
    let err = e
        .generate(&p, &SamplingParams::greedy(5))
        .await
        .unwrap_err();
    assert!(matches!(err, EngineError::ContextLength(_)));
    // Exactly at the limit is fine.
    let out = solo(&*e, &p, &SamplingParams::greedy(4)).await.unwrap();
    assert_eq!(out.completion_tokens, out.ids.len());
    assert!(out.ids.len() <= 4);
}

#[tokio::test]
async fn max_tokens_and_event_accounting() {
    let e = tiny::engine(64, 2).unwrap();
    let p = prompt(8, 1);
    let out = solo(&*e, &p, &SamplingParams::greedy(10)).await.unwrap();
    assert_eq!(out.completion_tokens, out.ids.len());
    assert_eq!(
        (out.ids.len(), out.finish),
        (10, Some(FinishReason::Length))
    );
    assert_eq!(out.text, e.detokenize(&out.ids).unwrap());
    let zero = solo(&*e, &p, &SamplingParams::greedy(0)).await.unwrap();
    assert_eq!(
        (zero.ids.len(), zero.finish),
        (0, Some(FinishReason::Length))
    );
}

#[tokio::test]
async fn stop_sequences_cut_the_text() {
    let e = tiny::engine(128, 1).unwrap();
    let p = prompt(12, 3);
    let full = solo(&*e, &p, &SamplingParams::greedy(60)).await.unwrap();
    // Pick a stop string from the middle of what the model writes anyway.
    let chars: Vec<char> = full.text.chars().collect();
    assert!(
        chars.len() >= 20,
        "tiny model wrote too little: {:?}",
        full.text
    );
    let stop: String = chars[10..12].iter().collect();
    let cut = full.text.find(&stop).unwrap();
    let params = SamplingParams {
        stop: vec![stop.clone()],
        ..SamplingParams::greedy(60)
    };
    let out = solo(&*e, &p, &params).await.unwrap();
    assert_eq!(out.finish, Some(FinishReason::Stop));
    assert_eq!(out.text, full.text[..cut], "stop {stop:?}");
    assert!(out.ids.len() < full.ids.len());
    assert_eq!(&full.ids[..out.ids.len()], &out.ids[..]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_receiver_cancels_the_stream_and_frees_its_slot() {
    let e = tiny::engine(4096, 1).unwrap();
    let p = prompt(4, 2);
    let mut rx = e.generate(&p, &SamplingParams::greedy(4000)).await.unwrap();
    assert!(matches!(rx.recv().await, Some(GenEvent::Token { .. })));
    // The gauges are published by the scheduler right after admission.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while e.running() != 1 {
        assert!(
            std::time::Instant::now() < deadline,
            "the stream never showed as running"
        );
        tokio::task::yield_now().await;
    }
    // Its blocks of 16 positions over the slot's 256 (vLLM's count).
    assert!(
        e.kv_usage() > 0.0 && e.kv_usage() <= 2.0 / 256.0,
        "{}",
        e.kv_usage()
    );
    // Queue a second stream behind the first (batch 1).
    let second = {
        let e = e.clone();
        let p = p.clone();
        tokio::spawn(async move { solo(&*e, &p, &SamplingParams::greedy(3)).await.unwrap() })
    };
    drop(rx);
    let out = tokio::time::timeout(Duration::from_secs(60), second)
        .await
        .expect("the second stream never got the slot")
        .unwrap();
    assert!(!out.ids.is_empty());
    // Poll the gauges until the scheduler has published the idle state.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while e.running() != 0 || e.waiting() != 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "engine did not go idle"
        );
        tokio::task::yield_now().await;
    }
}

#[tokio::test]
async fn a_foreign_cache_is_refused() {
    let a = tiny::engine(64, 1).unwrap();
    let b = tiny::engine(128, 1).unwrap();
    let p = prompt(5, 0);
    let params = SamplingParams::greedy(4);
    let pre = a.prefill(&p, &params).await.unwrap();
    let err = b.decode(&p, pre.clone(), &params).await.unwrap_err();
    assert!(matches!(err, EngineError::InvalidRequest(_)), "{err:?}");
    let err = a.decode(&p[..4], pre, &params).await.unwrap_err();
    assert!(matches!(err, EngineError::InvalidRequest(_)), "{err:?}");
}

#[test]
fn tiny_tokenizer_round_trips_and_renders_chatml() {
    let t = tiny::tokenizer().unwrap();
    let text = "the theme of the day: 日本 🚀";
    let ids = t.encode(text).unwrap();
    assert!(ids.contains(&258), "the merge Ġthe is used: {ids:?}");
    assert_eq!(t.decode(&ids).unwrap(), text);
    let chat = t
        .chat_prompt(&[("user".into(), "hi".into())], &Default::default())
        .unwrap();
    assert_eq!(
        chat,
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    );
    assert_eq!(t.encode(&chat).unwrap()[0], tiny::TINY_IM_START);
}
