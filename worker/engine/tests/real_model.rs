//! Tests on the real model (SmolLM2-135M-Instruct Q4_1 by default).
//! They FAIL with a message naming `rngd-pd model fetch` when it is absent.

mod common;

use std::sync::Arc;

use common::{collect, real_model, solo, through_the_wire};
use rngd_engine::cpu::{CpuEngine, CpuEngineOptions};
use rngd_engine::{Engine, EngineError, FinishReason, Prefilled, SamplingParams};

fn load(batch: usize) -> Arc<CpuEngine> {
    let mut opts = CpuEngineOptions::new(real_model());
    opts.batch = batch;
    CpuEngine::load(opts).expect("loading the real model")
}

/// Open-ended prompts of increasing length (6 to ~470 tokens) that keep the model writing.
fn prompts(engine: &CpuEngine) -> Vec<Vec<u32>> {
    let mut out = Vec::new();
    out.push(engine.tokenize("def fibonacci(n):").unwrap());
    out.push(
        engine
            .tokenize("Here is a list of the 50 states of the United States:\n1. Alabama\n2.")
            .unwrap(),
    );
    let chat = engine
        .chat_prompt(
            &[(
                "user".into(),
                "Write a long story about a dragon who learns to bake bread.".into(),
            )],
            &Default::default(),
        )
        .unwrap();
    out.push(engine.tokenize(&chat).unwrap());
    let code = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\n";
    out.push(
        engine
            .tokenize(&format!("{}def mul(a, b):", code.repeat(8)))
            .unwrap(),
    );
    let para = "Rust is a systems programming language focused on safety, speed and concurrency. \
        It achieves memory safety without a garbage collector by using a borrow checker. ";
    let mut long = engine.tokenize(&para.repeat(20)).unwrap();
    long.truncate(455);
    long.extend(
        engine
            .tokenize("\n\nHere are ten reasons to learn Rust:\n1.")
            .unwrap(),
    );
    out.push(long);
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pd_split_matches_a_single_instance_on_the_real_model() {
    let solo_engine = load(1);
    let params = SamplingParams::greedy(32);
    let prompts = prompts(&solo_engine);
    let lens: Vec<usize> = prompts.iter().map(Vec::len).collect();
    assert!(
        lens.iter().min().copied().unwrap() <= 8 && lens.iter().max().copied().unwrap() >= 460,
        "prompt lengths {lens:?}"
    );
    let mut solo_out = Vec::new();
    for p in &prompts {
        solo_out.push(solo(&*solo_engine, p, &params).await.unwrap());
    }
    drop(solo_engine);

    // Prefill on one instance, ship the bf16 bytes, decode on a fresh one.
    let prefill_engine = load(1);
    let mut shipped = Vec::new();
    for p in &prompts {
        let pre = prefill_engine.prefill(p, &params).await.unwrap();
        shipped.push(Prefilled {
            first_token: pre.first_token,
            first_logprobs: pre.first_logprobs.clone(),
            kv: through_the_wire(&pre.kv),
            elapsed: pre.elapsed,
            cached_tokens: pre.cached_tokens,
        });
    }
    drop(prefill_engine);
    let decode_engine = load(1);
    for ((p, pre), expected) in prompts.iter().zip(shipped).zip(&solo_out) {
        let got = collect(decode_engine.decode(p, pre, &params).await.unwrap()).await;
        assert_eq!(
            got.ids,
            expected.ids,
            "prompt of {} tokens diverged",
            p.len()
        );
        assert_eq!(got.text, expected.text);
    }
    for (p, o) in prompts.iter().zip(&solo_out) {
        eprintln!("{} tokens -> {:?} ({:?})", p.len(), o.text, o.finish);
        assert_eq!(o.ids.len(), 32, "every prompt should generate 32 tokens");
        assert_eq!(o.finish, Some(FinishReason::Length));
    }
    // The model really answers: the list of states goes on.
    assert!(
        solo_out[1].text.contains("Arkansas"),
        "unexpected continuation {:?}",
        solo_out[1].text
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batched_decode_matches_batch_one_on_the_real_model() {
    let one = load(1);
    let four = load(4);
    let params = SamplingParams::greedy(24);
    let prompts = prompts(&one);
    let prompts = &prompts[..4];
    let mut expected = Vec::new();
    for p in prompts {
        expected.push(solo(&*one, p, &params).await.unwrap());
    }
    let mut handles = Vec::new();
    for p in prompts {
        let e = four.clone();
        let p = p.clone();
        let params = params.clone();
        handles.push(tokio::spawn(async move {
            solo(&*e, &p, &params).await.unwrap()
        }));
    }
    for (h, exp) in handles.into_iter().zip(expected) {
        assert_eq!(h.await.unwrap(), exp);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sampling_with_a_seed_is_the_same_split_or_not() {
    let a = load(2);
    let p = a.tokenize("Once upon a time").unwrap();
    let params = SamplingParams {
        max_tokens: 32,
        temperature: 0.9,
        top_k: 40,
        top_p: 0.95,
        seed: 1234,
        stop: vec![],
        ..SamplingParams::default()
    };
    let s = solo(&*a, &p, &params).await.unwrap();
    let pre = a.prefill(&p, &params).await.unwrap();
    let b = load(1);
    let pre = Prefilled {
        kv: through_the_wire(&pre.kv),
        ..pre
    };
    let d = collect(b.decode(&p, pre, &params).await.unwrap()).await;
    assert_eq!(d, s);
    let other = solo(
        &*a,
        &p,
        &SamplingParams {
            seed: 99,
            ..params.clone()
        },
    )
    .await
    .unwrap();
    assert_ne!(
        other.ids, s.ids,
        "a different seed should change the sample"
    );
}

#[tokio::test]
async fn over_length_requests_are_refused_with_the_numbers() {
    let e = load(1);
    let prompt = vec![100u32; 500];
    let err = e
        .prefill(&prompt, &SamplingParams::greedy(13))
        .await
        .unwrap_err();
    match err {
        EngineError::ContextLength(m) => {
            assert!(
                m.contains("500") && m.contains("13") && m.contains("513") && m.contains("512"),
                "{m}"
            );
        }
        e => panic!("expected ContextLength, got {e:?}"),
    }
}

#[test]
fn an_invalid_gguf_is_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("bad.gguf");
    std::fs::write(&bad, b"this is not a gguf file at all").unwrap();
    let err = CpuEngine::load(CpuEngineOptions::new(&bad)).unwrap_err();
    let msg = err.to_string();
    assert!(matches!(err, EngineError::InvalidModel { .. }), "{err:?}");
    assert!(msg.contains("bad.gguf") && msg.contains("GGUF"), "{msg}");
    let missing = dir.path().join("missing.gguf");
    let msg = CpuEngine::load(CpuEngineOptions::new(&missing))
        .unwrap_err()
        .to_string();
    assert!(
        msg.contains("rngd-pd model fetch") && msg.contains("--model PATH"),
        "{msg}"
    );
}
