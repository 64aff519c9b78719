//! Lenient decoding of vLLM's KV-event batches (the message's third frame),
//! as vLLM's consumers do: unknown keys are ignored, optional keys may be
//! missing, and both event forms are read:
//!
//! - the map form vLLM publishes since vllm-project/vllm#42892: each event a
//!   map tagged by `"type"` (`BlockStored`, `BlockRemoved`,
//!   `AllBlocksCleared`);
//! - the older positional form: `["BlockStored", block_hashes,
//!   parent_block_hash, token_ids, block_size, lora_id, medium, lora_name,
//!   …]`, `["BlockRemoved", block_hashes, medium, …]`, `["AllBlocksCleared"]`.
//!
//! The batch is `[ts, [event, …], data_parallel_rank]` (a map with those keys
//! is read too). Block hashes are integers (signed or not) or byte strings
//! (vLLM's `ExternalBlockHash = bytes | int`); they are kept as opaque
//! [`BlockId`]s. One event that cannot be read is reported on its own
//! ([`Batch::events`] holds a `Result` per event); a payload that is not a
//! batch at all is a [`DecodeError`].

use rmpv::Value;

/// An engine's block hash, kept only as an opaque id: an integer hash's 64
/// bits (a negative one two's complement), or a byte-string hash's first 8
/// bytes (big-endian, zero-padded when shorter).
pub type BlockId = u64;

/// Why a payload or an event could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("undecodable KV event batch: {0}")]
pub struct DecodeError(pub String);

/// One KV-cache event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// Full blocks entered the cache, as one chain.
    BlockStored {
        /// The blocks' engine hashes, in chain order.
        block_hashes: Vec<BlockId>,
        /// The engine hash of the first block's parent (`None`: the chain
        /// starts a prompt).
        parent_block_hash: Option<BlockId>,
        /// Their tokens, `block_size` per block.
        token_ids: Vec<u32>,
        /// Tokens per block.
        block_size: u32,
        /// The cache tier (`"GPU"`: the engine's own cache; `None`: not said).
        medium: Option<String>,
        /// A LoRA adapter made these blocks (`lora_id` or `lora_name` set):
        /// their KV is not the base model's for these tokens.
        lora: bool,
        /// `extra_keys` has a non-nil entry other than a root block's salt
        /// (multimodal inputs, a salt that is not on the chain's first
        /// block): the KV depends on more than the tokens and the salt.
        extra_keys: bool,
        /// The cache salt of a chain's first block (`parent_block_hash`
        /// nil, its `extra_keys` entry one string: vLLM's `cache_salt`);
        /// the chain is keyed under it, apart from every other salt's.
        salt: Option<String>,
    },
    /// Blocks left the cache.
    BlockRemoved {
        /// Their engine hashes.
        block_hashes: Vec<BlockId>,
        /// The cache tier.
        medium: Option<String>,
    },
    /// Every block was dropped.
    AllBlocksCleared,
}

/// One decoded batch.
#[derive(Debug, Clone, PartialEq)]
pub struct Batch {
    /// The publisher's timestamp (seconds since the Unix epoch).
    pub ts: f64,
    /// The events in order; one that could not be read is an error in its
    /// place.
    pub events: Vec<Result<Event, DecodeError>>,
    /// The data-parallel rank, when given.
    pub data_parallel_rank: Option<i64>,
}

/// Nesting accepted at most (a batch needs 4: batch, events, event, list).
const MAX_DEPTH: usize = 16;

/// Decodes one payload.
pub fn decode_batch(payload: &[u8]) -> Result<Batch, DecodeError> {
    let mut rd = payload;
    let v = rmpv::decode::read_value_with_max_depth(&mut rd, MAX_DEPTH)
        .map_err(|e| DecodeError(format!("not MessagePack: {e}")))?;
    let (ts, events, rank) = match &v {
        Value::Array(a) if a.len() >= 2 => (&a[0], &a[1], a.get(2)),
        Value::Map(m) => (
            get(m, "ts").unwrap_or(&Value::Nil),
            get(m, "events").ok_or_else(|| DecodeError("a batch map without events".into()))?,
            get(m, "data_parallel_rank"),
        ),
        _ => return Err(DecodeError("not [ts, events, rank]".into())),
    };
    let ts = match ts {
        Value::F64(f) => *f,
        Value::F32(f) => f64::from(*f),
        other => other.as_i64().map(|i| i as f64).unwrap_or(0.0),
    };
    let Value::Array(events) = events else {
        return Err(DecodeError("events is not an array".into()));
    };
    Ok(Batch {
        ts,
        events: events.iter().map(event).collect(),
        data_parallel_rank: rank.and_then(Value::as_i64),
    })
}

fn get<'a>(m: &'a [(Value, Value)], key: &str) -> Option<&'a Value> {
    m.iter()
        .find(|(k, _)| k.as_str() == Some(key))
        .map(|(_, v)| v)
}

fn bad(what: &str) -> DecodeError {
    DecodeError(what.into())
}

fn event(v: &Value) -> Result<Event, DecodeError> {
    match v {
        Value::Map(m) => {
            let tag = get(m, "type")
                .and_then(Value::as_str)
                .ok_or_else(|| bad("an event map without a type"))?;
            let field = |k: &str| get(m, k);
            from_fields(tag, field)
        }
        Value::Array(a) => {
            let tag = a
                .first()
                .and_then(Value::as_str)
                .ok_or_else(|| bad("a positional event without its tag"))?;
            let order: &[&str] = match tag {
                "BlockStored" => &[
                    "block_hashes",
                    "parent_block_hash",
                    "token_ids",
                    "block_size",
                    "lora_id",
                    "medium",
                    "lora_name",
                    "extra_keys",
                ],
                "BlockRemoved" => &["block_hashes", "medium"],
                _ => &[],
            };
            let field = |k: &str| {
                order
                    .iter()
                    .position(|o| *o == k)
                    .and_then(|i| a.get(i + 1))
            };
            from_fields(tag, field)
        }
        _ => Err(bad("an event is neither a map nor an array")),
    }
}

fn from_fields<'a>(
    tag: &str,
    field: impl Fn(&str) -> Option<&'a Value>,
) -> Result<Event, DecodeError> {
    let nil = |k: &str| field(k).is_none_or(Value::is_nil);
    match tag {
        "BlockStored" => {
            let block_hashes = ids(field("block_hashes"))?;
            let parent_block_hash = match field("parent_block_hash") {
                None | Some(Value::Nil) => None,
                Some(v) => Some(id(v).ok_or_else(|| bad("parent_block_hash is not a hash"))?),
            };
            let token_ids = match field("token_ids") {
                Some(Value::Array(a)) => a
                    .iter()
                    .map(|t| t.as_u64().and_then(|t| u32::try_from(t).ok()))
                    .collect::<Option<Vec<u32>>>()
                    .ok_or_else(|| bad("token_ids holds a non-token"))?,
                _ => return Err(bad("BlockStored without token_ids")),
            };
            let block_size = field("block_size")
                .and_then(Value::as_u64)
                .and_then(|b| u32::try_from(b).ok())
                .filter(|&b| b > 0)
                .ok_or_else(|| bad("BlockStored without a positive block_size"))?;
            // Per block, nil or a tuple of keys. A chain's first block
            // with one string alone carries the request's cache salt.
            let (extra_keys, salt) = match field("extra_keys") {
                Some(Value::Array(a)) => {
                    let salt = match (parent_block_hash, a.first()) {
                        (None, Some(Value::Array(keys))) => match keys.as_slice() {
                            [Value::String(s)] => s.as_str().map(str::to_string),
                            _ => None,
                        },
                        _ => None,
                    };
                    let skip = usize::from(salt.is_some());
                    (a.iter().skip(skip).any(|k| !k.is_nil()), salt)
                }
                None | Some(Value::Nil) => (false, None),
                Some(_) => (true, None),
            };
            Ok(Event::BlockStored {
                block_hashes,
                parent_block_hash,
                token_ids,
                block_size,
                medium: medium(field("medium")),
                lora: !nil("lora_id") || !nil("lora_name"),
                extra_keys,
                salt,
            })
        }
        "BlockRemoved" => Ok(Event::BlockRemoved {
            block_hashes: ids(field("block_hashes"))?,
            medium: medium(field("medium")),
        }),
        "AllBlocksCleared" => Ok(Event::AllBlocksCleared),
        other => Err(DecodeError(format!("unknown event type {other:?}"))),
    }
}

fn medium(v: Option<&Value>) -> Option<String> {
    v.and_then(Value::as_str).map(str::to_owned)
}

fn ids(v: Option<&Value>) -> Result<Vec<BlockId>, DecodeError> {
    match v {
        Some(Value::Array(a)) => a
            .iter()
            .map(id)
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| bad("block_hashes holds a non-hash")),
        _ => Err(bad("an event without block_hashes")),
    }
}

fn id(v: &Value) -> Option<BlockId> {
    match v {
        Value::Integer(i) => i.as_u64().or_else(|| i.as_i64().map(|x| x as u64)),
        Value::Binary(b) => {
            let mut first = [0u8; 8];
            let n = b.len().min(8);
            first[..n].copy_from_slice(&b[..n]);
            Some(u64::from_be_bytes(first))
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn enc(v: &Value) -> Vec<u8> {
        let mut out = Vec::new();
        rmpv::encode::write_value(&mut out, v).unwrap();
        out
    }

    fn s(x: &str) -> Value {
        Value::from(x)
    }

    #[test]
    fn the_map_form_with_unknown_keys_and_the_positional_form_decode_alike() {
        let map = Value::Map(vec![
            (s("type"), s("BlockStored")),
            (
                s("block_hashes"),
                Value::Array(vec![Value::from(-5i64), Value::from(7u64)]),
            ),
            (s("parent_block_hash"), Value::Nil),
            (
                s("token_ids"),
                Value::Array((1..=4).map(Value::from).collect()),
            ),
            (s("block_size"), Value::from(2)),
            (s("lora_id"), Value::Nil),
            (s("medium"), s("GPU")),
            (s("lora_name"), Value::Nil),
            (s("some_future_key"), Value::from(1)),
        ]);
        let pos = Value::Array(vec![
            s("BlockStored"),
            Value::Array(vec![Value::from(-5i64), Value::from(7u64)]),
            Value::Nil,
            Value::Array((1..=4).map(Value::from).collect()),
            Value::from(2),
            Value::Nil,
            s("GPU"),
        ]);
        let want = Event::BlockStored {
            block_hashes: vec![(-5i64) as u64, 7],
            parent_block_hash: None,
            token_ids: vec![1, 2, 3, 4],
            block_size: 2,
            medium: Some("GPU".into()),
            lora: false,
            extra_keys: false,
            salt: None,
        };
        for e in [map, pos] {
            let b = decode_batch(&enc(&Value::Array(vec![
                Value::F64(1.5),
                Value::Array(vec![e]),
                Value::from(0),
            ])))
            .unwrap();
            assert_eq!(b.ts, 1.5);
            assert_eq!(b.data_parallel_rank, Some(0));
            assert_eq!(b.events, vec![Ok(want.clone())]);
        }
    }

    #[test]
    fn removed_cleared_bytes_hashes_and_bad_events() {
        let events = Value::Array(vec![
            Value::Map(vec![
                (s("type"), s("BlockRemoved")),
                (
                    s("block_hashes"),
                    Value::Array(vec![Value::Binary(vec![0, 0, 0, 0, 0, 0, 1, 2, 99])]),
                ),
            ]),
            Value::Map(vec![(s("type"), s("AllBlocksCleared"))]),
            Value::Map(vec![(s("type"), s("SomethingNew"))]),
            Value::from(3),
        ]);
        let b = decode_batch(&enc(&Value::Array(vec![Value::F64(0.0), events]))).unwrap();
        assert_eq!(
            b.events[0],
            Ok(Event::BlockRemoved {
                block_hashes: vec![0x0102],
                medium: None
            })
        );
        assert_eq!(b.events[1], Ok(Event::AllBlocksCleared));
        assert!(b.events[2].is_err() && b.events[3].is_err());
        assert_eq!(b.data_parallel_rank, None);
        assert!(decode_batch(b"\xc1").is_err());
        assert!(decode_batch(&enc(&Value::from(1))).is_err());
    }

    #[test]
    fn the_publishers_own_bytes_decode() {
        // docs/engine.md, "KV events": one batch, byte for byte as msgspec writes it.
        let hex = "93cb3ff800000000000091 88a474797065ab426c6f636b53746f726564ac626c6f636b5f686173686573 9101b1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f696473920102aa626c6f636b5f73697a6502a76c6f72615f6964c0a66d656469756da3475055a96c6f72615f6e616d65c000";
        let hex: String = hex.split_whitespace().collect();
        let bytes: Vec<u8> = (0..hex.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap())
            .collect();
        let b = decode_batch(&bytes).unwrap();
        assert_eq!(
            b.events,
            vec![Ok(Event::BlockStored {
                block_hashes: vec![1],
                parent_block_hash: None,
                token_ids: vec![1, 2],
                block_size: 2,
                medium: Some("GPU".into()),
                lora: false,
                extra_keys: false,
                salt: None,
            })]
        );
    }
}
