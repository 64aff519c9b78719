//! Property tests of the relay's frame parser ([`frame::read_frame`], the
//! reader the relay runs on every connection): on arbitrary bytes, and on
//! well-formed headers with arbitrary fields and tails, it never panics,
//! never allocates more than the frame limit (nor much more than the bytes
//! that actually arrived), and always ends in frames or a clean error;
//! valid frames come back exactly as written, and a cut stream ends in
//! `Truncated`, never in a wrong frame.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

use proptest::prelude::*;
use rngd_kv_transport::frame::{self, FIRST_BODY_CHUNK, FrameError, HEADER_LEN, Header, Op};

/// The system allocator, noting the largest single allocation while a
/// thread has tracking on.
struct Tracking;

thread_local! {
    static TRACKING: Cell<bool> = const { Cell::new(false) };
    static LARGEST: Cell<usize> = const { Cell::new(0) };
}

fn note(size: usize) {
    let _ = TRACKING.try_with(|on| {
        if on.get() {
            let _ = LARGEST.try_with(|m| m.set(m.get().max(size)));
        }
    });
}

// SAFETY: every call is passed through to `System` unchanged; the
// bookkeeping only reads and writes thread-local `Cell`s of plain integers
// (const-initialised, no destructor, so no allocation or re-entrance).
unsafe impl GlobalAlloc for Tracking {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        note(layout.size());
        // SAFETY: the caller's contract for `alloc`, forwarded as is.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        note(layout.size());
        // SAFETY: the caller's contract for `alloc_zeroed`, forwarded as is.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        note(new_size);
        // SAFETY: the caller's contract for `realloc`, forwarded as is.
        unsafe { System.realloc(ptr, layout, new_size) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: the caller's contract for `dealloc`, forwarded as is.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static ALLOC: Tracking = Tracking;

/// What parsing a whole stream gave.
#[derive(Debug)]
struct Parsed {
    frames: Vec<frame::Frame>,
    /// The error it ended with (`None`: a clean end of stream).
    error: Option<FrameError>,
    /// Largest single allocation while parsing.
    largest: usize,
}

/// Parses frames from `input` until the end or an error, like the relay does.
fn parse(input: &[u8], max_frame: u64) -> Parsed {
    let mut rd = input;
    let mut frames = Vec::new();
    LARGEST.with(|m| m.set(0));
    TRACKING.with(|t| t.set(true));
    let error = futures::executor::block_on(async {
        loop {
            match frame::read_frame(&mut rd, max_frame).await {
                Ok(Some(f)) => frames.push(f),
                Ok(None) => return None,
                Err(e) => return Some(e),
            }
        }
    });
    TRACKING.with(|t| t.set(false));
    Parsed {
        frames,
        error,
        largest: LARGEST.with(|m| m.get()),
    }
}

/// The allocation bounds every parse must keep.
fn check_bounds(p: &Parsed, input_len: usize, max_frame: u64) -> Result<(), TestCaseError> {
    prop_assert!(
        p.largest as u64 <= max_frame.max(HEADER_LEN as u64 + 256),
        "allocated {} with a frame limit of {max_frame}",
        p.largest
    );
    prop_assert!(
        p.largest <= FIRST_BODY_CHUNK.max(2 * input_len),
        "allocated {} for {input_len} bytes of input",
        p.largest
    );
    for f in &p.frames {
        prop_assert!(f.body.len() as u64 <= max_frame);
        prop_assert!(f.key.len() <= rngd_kv_transport::MAX_KEY_LEN);
    }
    prop_assert!(p.frames.len() <= input_len / HEADER_LEN);
    Ok(())
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        Just(Op::Put),
        Just(Op::Get),
        Just(Op::Del),
        Just(Op::Stats),
        Just(Op::Hello),
        Just(Op::Auth),
        Just(Op::Ok),
        Just(Op::Err),
    ]
}

/// Body lengths: small, around the limits, and huge.
fn body_len() -> impl Strategy<Value = u64> {
    prop_oneof![
        0u64..2048,
        Just(64),
        (1u64 << 20) - 2..(1u64 << 20) + 2,
        any::<u64>(),
    ]
}

/// A valid request key.
fn key() -> impl Strategy<Value = String> {
    "[A-Za-z0-9_-][A-Za-z0-9._~-]{0,127}"
}

/// A valid request frame and its bytes.
fn valid_frame() -> impl Strategy<Value = (Header, String, Vec<u8>)> {
    (
        prop_oneof![Just(Op::Put), Just(Op::Get), Just(Op::Del), Just(Op::Stats)],
        key(),
        proptest::collection::vec(any::<u8>(), 0..3000),
        any::<(u32, u32, u32, u32, u64, u8)>(),
    )
        .prop_map(|(op, key, body, (seq, index, crc32, arg, epoch, flags))| {
            let key = if op == Op::Stats { String::new() } else { key };
            let body = if op == Op::Put { body } else { Vec::new() };
            let h = Header {
                op,
                flags,
                seq,
                key_len: key.len() as u16,
                index,
                crc32,
                arg,
                body_len: body.len() as u64,
                epoch,
            };
            (h, key, body)
        })
}

fn encode(frames: &[(Header, String, Vec<u8>)]) -> Vec<u8> {
    let mut out = Vec::new();
    for (h, k, b) in frames {
        out.extend_from_slice(&h.encode());
        out.extend_from_slice(k.as_bytes());
        out.extend_from_slice(b);
    }
    out
}

proptest! {
    #[test]
    fn arbitrary_bytes_end_cleanly(
        input in proptest::collection::vec(any::<u8>(), 0..4096),
        max_frame in 4096u64..(16 << 20),
    ) {
        let p = parse(&input, max_frame);
        check_bounds(&p, input.len(), max_frame)?;
        if input.is_empty() {
            prop_assert!(p.error.is_none() && p.frames.is_empty());
        }
    }

    #[test]
    fn a_wellformed_header_with_any_fields_and_tail_ends_cleanly(
        op in op(),
        key_len in 0u16..300,
        body_len in body_len(),
        fields in any::<(u8, u32, u32, u32, u32, u64)>(),
        tail in proptest::collection::vec(any::<u8>(), 0..4096),
        max_frame in 4096u64..(16 << 20),
    ) {
        let (flags, seq, index, crc32, arg, epoch) = fields;
        let h = Header { op, flags, seq, key_len, index, crc32, arg, body_len, epoch };
        let mut input = h.encode().to_vec();
        input.extend_from_slice(&tail);
        let p = parse(&input, max_frame);
        check_bounds(&p, input.len(), max_frame)?;
        if let Some(first) = p.frames.first() {
            // Accepted only as the request it says it is, with exactly its bytes.
            prop_assert_eq!(first.header, h);
            prop_assert!(matches!(op, Op::Put | Op::Get | Op::Del | Op::Stats | Op::Auth));
            prop_assert!(body_len <= frame::max_request_body(op, max_frame));
            let start = HEADER_LEN + key_len as usize;
            prop_assert_eq!(first.key.as_bytes(), &input[HEADER_LEN..start]);
            prop_assert_eq!(&first.body[..], &input[start..start + body_len as usize]);
        } else {
            prop_assert!(p.error.is_some(), "a header alone is no clean end");
        }
    }

    #[test]
    fn a_put_announcing_a_large_body_allocates_only_as_its_bytes_arrive(
        key in key(),
        body_len in body_len(),
        sent in proptest::collection::vec(any::<u8>(), 0..8192),
        max_frame in 4096u64..(64 << 20),
    ) {
        let mut h = Header::new(Op::Put, 1);
        h.key_len = key.len() as u16;
        h.body_len = body_len;
        let mut input = h.encode().to_vec();
        input.extend_from_slice(key.as_bytes());
        input.extend_from_slice(&sent);
        let p = parse(&input, max_frame);
        check_bounds(&p, input.len(), max_frame)?;
        if body_len > max_frame {
            let is_too_large = matches!(p.error, Some(FrameError::TooLarge { .. }));
            prop_assert!(is_too_large, "{:?}", p.error);
        } else if body_len as usize > sent.len() {
            prop_assert!(p.frames.is_empty());
            let is_truncated = matches!(p.error, Some(FrameError::Truncated));
            prop_assert!(is_truncated, "{:?}", p.error);
        } else {
            prop_assert_eq!(&p.frames[0].body[..], &sent[..body_len as usize]);
        }
    }

    #[test]
    fn valid_frames_round_trip_and_cut_streams_end_in_truncated(
        frames in proptest::collection::vec(valid_frame(), 1..6),
        cut in any::<proptest::sample::Index>(),
    ) {
        let input = encode(&frames);
        let max_frame = 1 << 20;
        let p = parse(&input, max_frame);
        check_bounds(&p, input.len(), max_frame)?;
        prop_assert!(p.error.is_none(), "{:?}", p.error);
        prop_assert_eq!(p.frames.len(), frames.len());
        for (got, (h, k, b)) in p.frames.iter().zip(&frames) {
            prop_assert_eq!(got.header, *h);
            prop_assert_eq!(&got.key, k);
            prop_assert_eq!(&got.body[..], &b[..]);
        }
        // Cut anywhere: the whole frames before the cut, then Truncated
        // (or a clean end exactly at a frame boundary).
        let at = cut.index(input.len());
        let p = parse(&input[..at], max_frame);
        check_bounds(&p, at, max_frame)?;
        let mut boundary = 0;
        let mut whole = 0;
        for (_, k, b) in &frames {
            let len = HEADER_LEN + k.len() + b.len();
            if boundary + len > at {
                break;
            }
            boundary += len;
            whole += 1;
        }
        prop_assert_eq!(p.frames.len(), whole);
        if boundary == at {
            prop_assert!(p.error.is_none(), "{:?}", p.error);
        } else {
            prop_assert!(matches!(p.error, Some(FrameError::Truncated)), "{:?}", p.error);
        }
    }
}
