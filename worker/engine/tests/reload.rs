//! Loading another checkpoint into a running CPU engine (`Engine::reload`)
//! on the real model: a delta load (the file has a manifest) reads only the
//! changed tensors and gives the logits, KV and tokens of a fresh load of
//! the new file; a file without a manifest loads whole; a truncated file, a
//! manifest that lies about a changed tensor, another tokenizer or another
//! configuration is refused with the cause.

mod common;

use std::path::{Path, PathBuf};

use candle_core::quantized::gguf_file::{self, Value};
use common::{logprob_params, no_prefix_cache, real_model, same_prefill};
use rngd_engine::cpu::{CpuEngine, CpuEngineOptions};
use rngd_engine::manifest::{stamp, stamp_with};
use rngd_engine::{Engine, SamplingParams};

/// One in a fused Q/K/V projection (the middle part), one in the fused
/// gate/up projection, and the embedding table (the tied output head too).
const CHANGED: [&str; 3] = [
    "blk.2.attn_k.weight",
    "blk.4.ffn_up.weight",
    "token_embd.weight",
];

const PROMPTS: [&str; 3] = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "def fibonacci(n):",
];

fn load(path: &Path) -> std::sync::Arc<CpuEngine> {
    let mut o = CpuEngineOptions::new(path);
    o.batch = 2;
    o.prefix_cache = no_prefix_cache();
    CpuEngine::load(o).expect("loading the model")
}

/// Moves every changed tensor's blocks one place (whole blocks: every value
/// stays one the type can hold).
fn rotate(name: &str, block: usize, bytes: &mut [u8]) {
    if CHANGED.contains(&name) {
        bytes.rotate_left(block);
    }
}

struct Files {
    _dir: tempfile::TempDir,
    base: PathBuf,
    changed: PathBuf,
}

fn files() -> Files {
    let dir = tempfile::tempdir().unwrap();
    let base = dir.path().join("base.gguf");
    let changed = dir.path().join("changed.gguf");
    let b = stamp(&real_model(), &base).unwrap();
    assert!(b.altered.is_empty());
    let c = stamp_with(&real_model(), &changed, |_| {}, rotate).unwrap();
    let mut want: Vec<String> = CHANGED.iter().map(|s| s.to_string()).collect();
    want.sort();
    assert_eq!(c.altered, want);
    assert_ne!(b.weight_version, c.weight_version);
    Files {
        _dir: dir,
        base,
        changed,
    }
}

/// The header's length plus the stored bytes of `names`, from the file.
fn expected_bytes(path: &Path, names: &[&str]) -> u64 {
    let mut f = std::fs::File::open(path).unwrap();
    let c = gguf_file::Content::read(&mut f).unwrap();
    names
        .iter()
        .map(|n| {
            let i = &c.tensor_infos[*n];
            (i.shape.elem_count() / i.ggml_dtype.block_size() * i.ggml_dtype.type_size()) as u64
        })
        .sum::<u64>()
        + c.tensor_data_offset
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delta_load_reads_only_changed_tensors_and_equals_a_fresh_load() {
    let f = files();
    let running = load(&f.base);
    // The stamped copy holds the original's bytes: the same version.
    assert_eq!(
        running.info().weight_version,
        load(&real_model()).info().weight_version
    );
    let fresh = load(&f.changed);
    let r = running.reload(&f.changed).unwrap();
    assert!(r.delta);
    let mut names: Vec<&str> = CHANGED.to_vec();
    names.sort();
    assert_eq!(r.tensors_changed, names);
    assert_eq!(r.bytes_read, expected_bytes(&f.changed, &CHANGED));
    assert!(r.bytes_read < std::fs::metadata(&f.changed).unwrap().len() / 2);
    let new = r.engine;
    assert_eq!(new.info().weight_version, fresh.info().weight_version);
    assert_ne!(new.info().weight_version, running.info().weight_version);
    let mut differs = false;
    for p in PROMPTS {
        let ids = fresh.tokenize(p).unwrap();
        let a = new.prefill(&ids, &logprob_params(1)).await.unwrap();
        let b = fresh.prefill(&ids, &logprob_params(1)).await.unwrap();
        same_prefill(&a, &b, p);
        let old = running.prefill(&ids, &logprob_params(1)).await.unwrap();
        differs |= old.first_logprobs != b.first_logprobs;
        let g = SamplingParams::greedy(12);
        assert_eq!(
            common::solo(&*new, &ids, &g).await.unwrap(),
            common::solo(&*fresh, &ids, &g).await.unwrap(),
            "{p}"
        );
    }
    assert!(differs, "the changed tensors change what the model says");
    // Another delta on the derived engine, back to the base weights.
    let back = new.reload(&f.base).unwrap();
    assert!(back.delta);
    assert_eq!(back.tensors_changed, names);
    assert_eq!(
        back.engine.info().weight_version,
        running.info().weight_version
    );
    let ids = fresh.tokenize(PROMPTS[0]).unwrap();
    same_prefill(
        &back.engine.prefill(&ids, &logprob_params(1)).await.unwrap(),
        &running.prefill(&ids, &logprob_params(1)).await.unwrap(),
        "back to the base weights",
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_file_without_a_manifest_loads_whole_and_bad_files_are_refused() {
    let f = files();
    let running = load(&f.base);
    let whole = running.reload(&real_model()).unwrap();
    assert!(!whole.delta);
    assert!(whole.tensors_changed.is_empty());
    assert_eq!(
        whole.bytes_read,
        std::fs::metadata(real_model()).unwrap().len()
    );
    assert_eq!(
        whole.engine.info().weight_version,
        running.info().weight_version
    );

    let dir = f._dir.path();
    let err = |p: &Path| match running.reload(p) {
        Ok(_) => panic!("{} loaded", p.display()),
        Err(e) => format!("{e}"),
    };
    // Truncated past the header: refused before a tensor is read.
    let cut = dir.join("cut.gguf");
    let bytes = std::fs::read(&f.changed).unwrap();
    std::fs::write(&cut, &bytes[..bytes.len() * 2 / 3]).unwrap();
    let e = err(&cut);
    assert!(e.contains("truncated"), "{e}");

    // A changed tensor whose bytes are not those its manifest entry names.
    let lying = dir.join("lying.gguf");
    let mut c = std::fs::File::open(&f.changed).unwrap();
    let content = gguf_file::Content::read(&mut c).unwrap();
    let info = &content.tensor_infos[CHANGED[0]];
    let at = (content.tensor_data_offset + info.offset) as usize;
    let mut b = bytes.clone();
    b[at + 3] ^= 0x01;
    std::fs::write(&lying, &b).unwrap();
    let e = err(&lying);
    assert!(
        e.contains(CHANGED[0]) && e.contains("manifest digest"),
        "{e}"
    );

    // Another tokenizer (one token renamed), another configuration.
    let other_tok = dir.join("other-tokenizer.gguf");
    stamp_with(
        &f.base,
        &other_tok,
        |m| {
            if let Some(Value::Array(tokens)) = m.get_mut("tokenizer.ggml.tokens") {
                tokens[1000] = Value::String("renamed".into());
            }
        },
        |_, _, _| {},
    )
    .unwrap();
    let e = err(&other_tok);
    assert!(e.contains("tokenizer"), "{e}");
    let other_cfg = dir.join("other-config.gguf");
    stamp_with(
        &f.base,
        &other_cfg,
        |m| {
            m.insert("llama.rope.freq_base".into(), Value::F32(500000.0));
        },
        |_, _, _| {},
    )
    .unwrap();
    let e = err(&other_cfg);
    assert!(e.contains("configuration"), "{e}");

    // The running engine still answers with its own weights.
    let ids = running.tokenize(PROMPTS[0]).unwrap();
    same_prefill(
        &running.prefill(&ids, &logprob_params(1)).await.unwrap(),
        &load(&f.base)
            .prefill(&ids, &logprob_params(1))
            .await
            .unwrap(),
        "after the refusals",
    );
}

/// A variant (another context length and batch) shares the weights, reads
/// nothing, and computes what an engine started with that variant does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_variant_equals_a_fresh_start_with_it() {
    let running = load(&real_model());
    let fresh = |seq_len: usize, batch: usize| {
        let mut o = CpuEngineOptions::new(real_model());
        o.seq_len = seq_len;
        o.batch = batch;
        o.prefix_cache = no_prefix_cache();
        CpuEngine::load(o).unwrap()
    };
    let long = "The tide came in over the flats, slow and grey, and the birds rose. ".repeat(40);
    for (seq_len, batch) in [(256, 1), (1024, 4)] {
        let v = running.variant(seq_len, batch).unwrap();
        let f = fresh(seq_len, batch);
        assert_eq!(v.info().seq_len, seq_len);
        assert_eq!(v.max_batch(), Some(batch));
        assert_eq!(v.info().kv_layout, f.info().kv_layout);
        assert_eq!(v.info().weight_version, running.info().weight_version);
        for p in PROMPTS {
            let ids = f.tokenize(p).unwrap();
            same_prefill(
                &v.prefill(&ids, &logprob_params(1)).await.unwrap(),
                &f.prefill(&ids, &logprob_params(1)).await.unwrap(),
                &format!("{p} at S = {seq_len}"),
            );
        }
        // Past the default 512 only the longer variant takes the prompt.
        let ids = f.tokenize(&long).unwrap();
        assert!(ids.len() > 600 && ids.len() < 1000, "{}", ids.len());
        let g = SamplingParams::greedy(8);
        if seq_len > ids.len() + 8 {
            assert_eq!(
                common::solo(&*v, &ids, &g).await.unwrap(),
                common::solo(&*f, &ids, &g).await.unwrap()
            );
            assert!(common::solo(&*running, &ids, &g).await.is_err());
        } else {
            assert!(common::solo(&*v, &ids, &g).await.is_err());
        }
    }
}
