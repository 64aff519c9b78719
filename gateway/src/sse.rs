//! A minimal server-sent-events reader for the workers' streams: splits a byte
//! stream into events and yields each event's `data` (multi-line data joined
//! with `\n`; comments and other fields ignored).

use bytes::{Bytes, BytesMut};

/// Incremental SSE parser.
#[derive(Debug, Default)]
pub struct SseParser {
    buf: BytesMut,
}

/// Upper bound on one buffered event (a worker chunk is a few hundred bytes).
pub const MAX_EVENT_BYTES: usize = 4 << 20;

/// An event larger than [`MAX_EVENT_BYTES`].
#[derive(Debug, thiserror::Error)]
#[error("server-sent event larger than {MAX_EVENT_BYTES} bytes")]
pub struct EventTooLarge;

impl SseParser {
    /// A parser with an empty buffer.
    pub fn new() -> Self {
        Self::default()
    }

    /// Feeds bytes; returns the `data` of every event they complete.
    pub fn push(&mut self, chunk: &Bytes) -> Result<Vec<String>, EventTooLarge> {
        self.buf.extend_from_slice(chunk);
        let mut out = Vec::new();
        while let Some((end, sep)) = find_boundary(&self.buf) {
            let event = self.buf.split_to(end + sep);
            if let Some(data) = event_data(&event[..end]) {
                out.push(data);
            }
        }
        if self.buf.len() > MAX_EVENT_BYTES {
            return Err(EventTooLarge);
        }
        Ok(out)
    }

    /// The `data` of a final event not terminated by a blank line, if any.
    pub fn finish(&mut self) -> Option<String> {
        let rest = std::mem::take(&mut self.buf);
        event_data(&rest)
    }
}

fn find_boundary(buf: &[u8]) -> Option<(usize, usize)> {
    let mut i = 0;
    while i < buf.len() {
        if buf[i] == b'\n' {
            if buf.get(i + 1) == Some(&b'\n') {
                return Some((i, 2));
            }
            if buf.get(i + 1) == Some(&b'\r') && buf.get(i + 2) == Some(&b'\n') {
                return Some((i, 3));
            }
        }
        i += 1;
    }
    None
}

fn event_data(event: &[u8]) -> Option<String> {
    let text = String::from_utf8_lossy(event);
    let mut data: Option<String> = None;
    for line in text.split('\n') {
        let line = line.strip_suffix('\r').unwrap_or(line);
        if let Some(v) = line.strip_prefix("data:") {
            let v = v.strip_prefix(' ').unwrap_or(v);
            match &mut data {
                Some(d) => {
                    d.push('\n');
                    d.push_str(v);
                }
                None => data = Some(v.to_string()),
            }
        }
    }
    data
}

/// Encodes one SSE event carrying `data`.
pub fn encode(data: &str) -> Bytes {
    let mut out = String::with_capacity(data.len() + 8);
    for line in data.split('\n') {
        out.push_str("data: ");
        out.push_str(line);
        out.push('\n');
    }
    out.push('\n');
    Bytes::from(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_split_across_chunks() {
        let mut p = SseParser::new();
        assert!(
            p.push(&Bytes::from_static(b"data: {\"a\""))
                .unwrap()
                .is_empty()
        );
        let ev = p
            .push(&Bytes::from_static(
                b":1}\n\n: comment\n\ndata: [DONE]\r\n\r\ndata: x",
            ))
            .unwrap();
        assert_eq!(ev, vec!["{\"a\":1}".to_string(), "[DONE]".to_string()]);
        assert_eq!(p.finish().as_deref(), Some("x"));
    }

    #[test]
    fn multiline_data_round_trips() {
        let mut p = SseParser::new();
        let ev = p.push(&encode("l1\nl2")).unwrap();
        assert_eq!(ev, vec!["l1\nl2".to_string()]);
    }
}
