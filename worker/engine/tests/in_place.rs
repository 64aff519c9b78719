//! A prefill written in place (`Engine::prefill_into`) into a sink: the same
//! first token and the same wire bytes as a prefill whose cache comes back
//! as blobs, every blob sealed with the CRC-32 of its bytes; a sink of the
//! wrong shape is refused before any work; the default (a backend that
//! copies its blobs in) says the same.

mod common;

use common::{byte_prompt, logprob_params};
use rngd_engine::tiny;
use std::sync::mpsc::{Receiver, Sender};

use rngd_engine::{Engine, KvSink, SinkShape};
use rngd_kv_wire::sink::VecSink;
use rngd_kv_wire::{WIRE_FULL, WIRE_TRIMMED, crc32};

const S: usize = 128;

/// A sink that hands what was written in it back when the engine drops it.
struct Kept(VecSink, Sender<VecSink>);

impl KvSink for Kept {
    fn shape(&self) -> SinkShape {
        self.0.shape()
    }
    fn blob_mut(&mut self, i: usize) -> &mut [u8] {
        self.0.blob_mut(i)
    }
    fn seal(&mut self, i: usize, crc: u32) {
        self.0.seal(i, crc)
    }
}

impl Drop for Kept {
    fn drop(&mut self) {
        let _ = self.1.send(self.0.clone());
    }
}

fn kept(room: VecSink) -> (Box<dyn KvSink>, Receiver<VecSink>) {
    let (tx, rx) = std::sync::mpsc::channel();
    (Box::new(Kept(room, tx)), rx)
}

#[tokio::test]
async fn a_cache_written_in_place_equals_the_exported_blobs() {
    let e = tiny::engine(S, 2).unwrap();
    let p = logprob_params(1);
    for n in [1, 9, S / 2, S - 2] {
        let prompt = byte_prompt(n, 3);
        let exported = e.prefill(&prompt, &p).await.unwrap();
        let shape = SinkShape {
            layout: e.info().kv_layout,
            tokens: n,
            wire: WIRE_TRIMMED,
        };
        let mut sink = Box::new(VecSink::new(shape).unwrap());
        sink.blobs[0][0] = 0xAA; // stale bytes in the room are overwritten
        let (sink, written) = kept(*sink);
        let placed = e.prefill_into(&prompt, &p, sink).await.unwrap();
        let written = written.recv().unwrap();
        assert_eq!(placed.first_token, exported.first_token, "n = {n}");
        assert_eq!(placed.first_logprobs, exported.first_logprobs, "n = {n}");
        assert!(placed.kv.blobs.is_empty(), "the answer carries no blobs");
        assert_eq!((placed.kv.tokens, placed.kv.wire), (n, WIRE_TRIMMED));
        assert_eq!(exported.kv.blobs.len(), written.blobs.len());
        for (i, (want, got)) in exported.kv.blobs.iter().zip(&written.blobs).enumerate() {
            assert_eq!(&want[..], &got[..], "n = {n}, blob {i}");
            assert_eq!(
                written.crcs[i],
                Some(crc32(got)),
                "n = {n}, blob {i} sealed"
            );
        }
    }
}

#[tokio::test]
async fn a_sink_of_another_shape_is_refused_before_the_prefill() {
    let e = tiny::engine(S, 2).unwrap();
    let prompt = byte_prompt(10, 1);
    let shape = SinkShape {
        layout: e.info().kv_layout,
        tokens: 11,
        wire: WIRE_TRIMMED,
    };
    let err = e
        .prefill_into(
            &prompt,
            &logprob_params(1),
            Box::new(VecSink::new(shape).unwrap()),
        )
        .await
        .unwrap_err();
    assert!(err.to_string().contains("does not fit"), "{err}");
}

#[tokio::test]
async fn the_s_wide_wire_in_place_is_padded_with_zeros() {
    let e = tiny::engine(S, 2).unwrap();
    let p = logprob_params(1);
    // A long prompt first leaves stale values past the next one's positions.
    e.prefill(&byte_prompt(S - 2, 7), &p).await.unwrap();
    let prompt = byte_prompt(5, 2);
    let exported = e.prefill(&prompt, &p).await.unwrap();
    let shape = SinkShape {
        layout: e.info().kv_layout,
        tokens: 5,
        wire: WIRE_FULL,
    };
    let mut room = VecSink::new(shape).unwrap();
    for b in &mut room.blobs {
        b.fill(0x5A);
    }
    let (sink, written) = kept(room);
    e.prefill_into(&prompt, &p, sink).await.unwrap();
    let written = written.recv().unwrap();
    let layout = e.info().kv_layout;
    for (i, got) in written.blobs.iter().enumerate() {
        assert_eq!(got.len(), layout.blob_bytes(), "blob {i} is S-wide");
        assert_eq!(written.crcs[i], Some(crc32(got)));
        // Valid positions as the trimmed export has them, zeros elsewhere.
        let (_, kind) = rngd_kv_wire::KvLayout::blob_of(i);
        let mut at = 0;
        let mut valid = vec![false; got.len()];
        for r in layout.wire_rows(kind, 5) {
            let n = 2 * r.len();
            assert_eq!(
                &got[2 * r.start..2 * r.end],
                &exported.kv.blobs[i][at..at + n]
            );
            valid[2 * r.start..2 * r.end]
                .iter_mut()
                .for_each(|v| *v = true);
            at += n;
        }
        assert!(
            got.iter().zip(&valid).all(|(b, v)| *v || *b == 0),
            "blob {i}: padding is zero"
        );
    }
}

#[tokio::test]
async fn the_default_copies_the_blobs_in_and_seals_them() {
    let e = rngd_engine::fake::EchoEngine::new(S);
    let p = logprob_params(1);
    let prompt = byte_prompt(12, 4);
    let exported = e.prefill(&prompt, &p).await.unwrap();
    let shape = SinkShape {
        layout: exported.kv.layout,
        tokens: exported.kv.tokens,
        wire: exported.kv.wire,
    };
    let (sink, written) = kept(VecSink::new(shape).unwrap());
    let placed = e.prefill_into(&prompt, &p, sink).await.unwrap();
    let written = written.recv().unwrap();
    assert_eq!(placed.first_token, exported.first_token);
    assert!(placed.kv.blobs.is_empty());
    for (i, (want, got)) in exported.kv.blobs.iter().zip(&written.blobs).enumerate() {
        assert_eq!(&want[..], &got[..], "blob {i}");
        assert_eq!(written.crcs[i], Some(crc32(got)), "blob {i}");
    }
    // A sink in another wire version than the backend's cache is refused.
    let other = SinkShape {
        wire: if shape.wire == WIRE_FULL {
            WIRE_TRIMMED
        } else {
            WIRE_FULL
        },
        ..shape
    };
    let err = e
        .prefill_into(&prompt, &p, Box::new(VecSink::new(other).unwrap()))
        .await
        .unwrap_err();
    assert!(err.to_string().contains("wire"), "{err}");
}
