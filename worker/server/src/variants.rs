//! Compiled variants on a running worker (`POST /switch_variant`, `GET
//! /variants` on the admin listener). A variant is (context length
//! `seq_len`, decode batch `max_batch`); the engine prepares one on the
//! weights it holds (`rngd_engine::Engine::variant`: nothing re-read, the
//! weights shared in memory) and it replaces the serving engine the way new
//! weights do ([`EngineSlot::replace_variant`]: requests in flight finish on
//! the engine they started on). The variant it replaced stays prepared, so
//! switching back is a swap; at most [`MAX_PREPARED`] are kept (the oldest
//! goes first), and all go when the weights change. Each is listed with the
//! KV memory its slots take at most.
//!
//! The worker's `/v1/models` (`max_model_len`), its admission and
//! `rngd_pd_worker_variant_info{seq_len,max_batch}` follow at once; the
//! routers read that metric on their next scrape.

use std::time::Instant;

use rngd_engine::Engine;
use serde::Serialize;
use serde_json::{Map, Value};

use crate::weights::{EngineSlot, UpdateError, WeightUpdater};

/// Prepared variants kept beside the one serving.
pub const MAX_PREPARED: usize = 4;

/// Largest `seq_len` a switch may ask for.
pub const MAX_SEQ_LEN: usize = 1 << 16;

/// Largest `max_batch` a switch may ask for.
pub const MAX_BATCH: usize = 256;

/// One variant in an answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Variant {
    /// Context length.
    pub seq_len: usize,
    /// Decode streams stepped together (`None`: the engine does not say).
    pub max_batch: Option<usize>,
    /// KV memory of its decode slots and its prefills' caches at most (bf16
    /// K and V; a cache is allocated when first used).
    pub kv_cache_bytes: u64,
    /// Whether it serves now.
    pub active: bool,
}

/// The answer to a switch.
#[derive(Debug, Clone, Serialize)]
pub struct SwitchAnswer {
    /// Always true (a failure is an error body).
    pub success: bool,
    /// What happened, for a human.
    pub message: String,
    /// The variant serving now.
    pub seq_len: usize,
    /// Its batch.
    pub max_batch: Option<usize>,
    /// Whether it was prepared before this request (a swap only).
    pub was_prepared: bool,
    /// Prepare (if needed) and swap, ms.
    pub elapsed_ms: f64,
    /// Every variant now: the active one first, then the prepared ones.
    pub variants: Vec<Variant>,
}

fn describe(e: &dyn Engine, active: bool) -> Variant {
    let info = e.info();
    let l = info.kv_layout;
    let per_slot = (l.layers * l.kv_heads * l.head_dim * info.seq_len * 2 * 2) as u64;
    let max_batch = e.max_batch();
    Variant {
        seq_len: info.seq_len,
        max_batch,
        kv_cache_bytes: per_slot * (max_batch.unwrap_or(1) + e.max_prefills()) as u64,
        active,
    }
}

/// The variant serving (`engine`) and those prepared.
pub fn list(engine: &dyn Engine, updater: &WeightUpdater) -> Vec<Variant> {
    let prepared = updater.prepared.lock().unwrap_or_else(|p| p.into_inner());
    std::iter::once(describe(engine, true))
        .chain(prepared.iter().map(|e| describe(&**e, false)))
        .collect()
}

/// Parses `{"seq_len": n, "max_batch": n}`: each optional (default: the
/// serving variant's), at least 1 and at most [`MAX_SEQ_LEN`] /
/// [`MAX_BATCH`]; any other field is refused by name.
fn parse(body: &[u8], current: &Variant) -> Result<(usize, usize), UpdateError> {
    let bad = |param: &str, message: String| UpdateError::BadRequest {
        param: param.into(),
        message,
    };
    let map: Map<String, Value> = serde_json::from_slice(body)
        .map_err(|e| bad("body", format!("the body is not a JSON object: {e}")))?;
    let mut seq_len = current.seq_len;
    let mut batch = current.max_batch;
    for (k, v) in &map {
        let (limit, slot) = match k.as_str() {
            "seq_len" => (MAX_SEQ_LEN, 0),
            "max_batch" => (MAX_BATCH, 1),
            other => {
                return Err(bad(
                    other,
                    format!("{other} is not a field of /switch_variant"),
                ));
            }
        };
        let n = v
            .as_u64()
            .filter(|n| (1..=limit as u64).contains(n))
            .ok_or_else(|| bad(k, format!("{k} must be an integer from 1 to {limit}")))?
            as usize;
        if slot == 0 {
            seq_len = n;
        } else {
            batch = Some(n);
        }
    }
    let batch = batch.ok_or_else(|| {
        bad(
            "max_batch",
            "max_batch is required: the engine does not report its own".into(),
        )
    })?;
    Ok((seq_len, batch))
}

/// Switches the serving engine to the variant the body asks for: a
/// prepared one, or one prepared now from the serving engine's weights.
pub async fn switch(
    state: &dyn EngineSlot,
    updater: &WeightUpdater,
    body: &[u8],
) -> Result<SwitchAnswer, UpdateError> {
    let Some(current) = state.engine() else {
        return Err(UpdateError::NotReady);
    };
    let (seq_len, batch) = parse(body, &describe(&*current, true))?;
    let Ok(_one) = updater.busy.try_lock() else {
        return Err(UpdateError::Busy);
    };
    // The serving engine may have changed while the body was read.
    let Some(current) = state.engine() else {
        return Err(UpdateError::NotReady);
    };
    let started = Instant::now();
    let same = |e: &dyn Engine| e.info().seq_len == seq_len && e.max_batch() == Some(batch);
    if same(&*current) {
        return Ok(answer(
            &*current,
            updater,
            true,
            started,
            "already serving".into(),
        ));
    }
    let found = {
        let mut prepared = updater.prepared.lock().unwrap_or_else(|p| p.into_inner());
        prepared
            .iter()
            .position(|e| same(&**e))
            .map(|i| prepared.remove(i))
    };
    let was_prepared = found.is_some();
    let engine = match found {
        Some(e) => e,
        None => {
            let c = current.clone();
            tokio::task::spawn_blocking(move || c.variant(seq_len, batch))
                .await
                .map_err(|e| UpdateError::Task(e.to_string()))?
                .map_err(UpdateError::Variant)?
        }
    };
    let old = match state.replace_variant(engine.clone()) {
        Ok(old) => old,
        Err(why) => {
            tokio::task::spawn_blocking(move || drop(engine));
            return Err(UpdateError::Incompatible(why));
        }
    };
    let evicted = {
        let mut prepared = updater.prepared.lock().unwrap_or_else(|p| p.into_inner());
        prepared.push(old.clone());
        let over = prepared.len().saturating_sub(MAX_PREPARED);
        prepared.drain(..over).collect::<Vec<_>>()
    };
    let before = describe(&*old, false);
    tokio::task::spawn_blocking(move || drop((old, evicted)));
    let message = format!(
        "serving seq_len {seq_len}, max_batch {batch} (was seq_len {}, max_batch {:?}; {})",
        before.seq_len,
        before.max_batch,
        if was_prepared {
            "prepared before"
        } else {
            "prepared now"
        }
    );
    let a = answer(&*engine, updater, was_prepared, started, message);
    tracing::info!(
        seq_len,
        max_batch = batch,
        was_prepared,
        elapsed_ms = a.elapsed_ms,
        "variant switched"
    );
    Ok(a)
}

fn answer(
    engine: &dyn Engine,
    updater: &WeightUpdater,
    was_prepared: bool,
    started: Instant,
    message: String,
) -> SwitchAnswer {
    SwitchAnswer {
        success: true,
        message,
        seq_len: engine.info().seq_len,
        max_batch: engine.max_batch(),
        was_prepared,
        elapsed_ms: started.elapsed().as_secs_f64() * 1e3,
        variants: list(engine, updater),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_body_is_checked_field_by_field() {
        let cur = Variant {
            seq_len: 512,
            max_batch: Some(8),
            kv_cache_bytes: 0,
            active: true,
        };
        assert_eq!(parse(b"{}", &cur).unwrap(), (512, 8));
        assert_eq!(parse(br#"{"seq_len": 256}"#, &cur).unwrap(), (256, 8));
        assert_eq!(
            parse(br#"{"seq_len": 1024, "max_batch": 2}"#, &cur).unwrap(),
            (1024, 2)
        );
        for (body, param) in [
            (&br#"{"seq_len": 0}"#[..], "seq_len"),
            (br#"{"seq_len": -3}"#, "seq_len"),
            (br#"{"seq_len": 1.5}"#, "seq_len"),
            (br#"{"seq_len": "256"}"#, "seq_len"),
            (br#"{"seq_len": 70000}"#, "seq_len"),
            (br#"{"max_batch": 0}"#, "max_batch"),
            (br#"{"max_batch": 257}"#, "max_batch"),
            (br#"{"batch": 2}"#, "batch"),
            (b"[]", "body"),
        ] {
            match parse(body, &cur) {
                Err(UpdateError::BadRequest { param: p, .. }) => assert_eq!(p, param),
                r => panic!("{}: {r:?}", String::from_utf8_lossy(body)),
            }
        }
        let unknown = Variant {
            max_batch: None,
            ..cur
        };
        assert!(parse(br#"{"seq_len": 256}"#, &unknown).is_err());
    }
}
