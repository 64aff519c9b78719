//! The HTTP answer of a split request ([`rngd_api::fanout`]) from its parts'
//! HTTP answers: a part's refusal is the request's, whole answers are merged
//! into one JSON body, streams into one SSE stream.
//!
//! A merged stream reads every part at once; a part that fails mid-stream
//! (an error event, or its stream ends without `[DONE]`) ends the merged
//! stream with an error event and `[DONE]`, and the other parts are dropped
//! (their workers see the connection close and cancel). So does a client
//! that goes away.

use axum::body::Body;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use rngd_api::fanout::{Merged, Split, StreamMerge, error_event, merge_whole};
use serde_json::Value;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

/// The most bytes one part's whole answer may have.
const MAX_PART_BYTES: usize = 64 << 20;
/// The most bytes one event of a part's stream may have.
const MAX_EVENT_BYTES: usize = 4 << 20;
/// Events buffered between the parts and the merged stream.
const EVENTS: usize = 64;

/// One answer from the parts' answers (in part order, as `split` made them).
pub async fn merge(split: &Split, parts: Vec<Response>) -> Response {
    if let Some(i) = parts.iter().position(|r| !r.status().is_success()) {
        return parts
            .into_iter()
            .nth(i)
            .unwrap_or_else(|| StatusCode::INTERNAL_SERVER_ERROR.into_response());
    }
    let Some(first) = parts.first() else {
        return StatusCode::INTERNAL_SERVER_ERROR.into_response();
    };
    let mut headers = first.headers().clone();
    headers.remove(header::CONTENT_LENGTH);
    let mut resp = if split.stream {
        merge_streams(split, parts)
    } else {
        match merge_bodies(split, parts).await {
            Ok(v) => {
                headers.insert(
                    header::CONTENT_TYPE,
                    HeaderValue::from_static("application/json"),
                );
                Response::new(Body::from(v.to_string()))
            }
            Err(message) => {
                let body = serde_json::json!({
                    "error": {"message": message, "type": "internal_server_error", "param": null, "code": 502}
                });
                return (StatusCode::BAD_GATEWAY, axum::Json(body)).into_response();
            }
        }
    };
    *resp.headers_mut() = headers;
    resp
}

async fn merge_bodies(split: &Split, parts: Vec<Response>) -> Result<Value, String> {
    let mut answers = Vec::with_capacity(parts.len());
    for (i, r) in parts.into_iter().enumerate() {
        let bytes = axum::body::to_bytes(r.into_body(), MAX_PART_BYTES)
            .await
            .map_err(|e| format!("choice {i}: its answer was not read: {e}"))?;
        answers.push(
            serde_json::from_slice(&bytes)
                .map_err(|e| format!("choice {i}: its answer is not JSON: {e}"))?,
        );
    }
    Ok(merge_whole(split, answers))
}

/// What a part's reader reports.
enum Event {
    Data(usize, String),
    /// The part's body ended (cleanly or not).
    End(usize),
}

fn merge_streams(split: &Split, parts: Vec<Response>) -> Response {
    let (out_tx, out_rx) = mpsc::channel::<Result<Bytes, std::io::Error>>(EVENTS);
    let (ev_tx, mut ev_rx) = mpsc::channel::<Event>(EVENTS);
    let mut readers = tokio::task::JoinSet::new();
    for (i, r) in parts.into_iter().enumerate() {
        readers.spawn(read_part(i, r.into_body(), ev_tx.clone()));
    }
    drop(ev_tx);
    let mut merge = StreamMerge::new(split);
    tokio::spawn(async move {
        // Dropping `readers` (on return) aborts the parts still streaming.
        let _readers = readers;
        let send = |payload: String| {
            let tx = out_tx.clone();
            async move {
                tx.send(Ok(Bytes::from(format!("data: {payload}\n\n"))))
                    .await
                    .is_ok()
            }
        };
        while let Some(ev) = ev_rx.recv().await {
            match ev {
                Event::Data(i, data) => match merge.event(i, &data) {
                    Merged::Send(events) => {
                        for e in events {
                            if !send(e).await {
                                return;
                            }
                        }
                    }
                    Merged::Failed(e) => {
                        let _ = send(e).await;
                        let _ = send("[DONE]".into()).await;
                        return;
                    }
                },
                Event::End(_) if merge.all_done() => break,
                Event::End(i) if !merge.part_done(i) => {
                    let _ = send(error_event(&format!(
                        "choice {i}'s stream ended before its end"
                    )))
                    .await;
                    let _ = send("[DONE]".into()).await;
                    return;
                }
                Event::End(_) => {}
            }
        }
        for e in merge.finish() {
            if !send(e).await {
                return;
            }
        }
    });
    Response::new(Body::from_stream(ReceiverStream::new(out_rx)))
}

/// Reads one part's SSE body, sending each event's `data:` payload.
async fn read_part(i: usize, body: Body, tx: mpsc::Sender<Event>) {
    use http_body_util::BodyExt as _;
    let mut body = body;
    let mut buf: Vec<u8> = Vec::new();
    'frames: while let Some(frame) = body.frame().await {
        let Ok(frame) = frame else { break };
        let Ok(data) = frame.into_data() else {
            continue;
        };
        buf.extend_from_slice(&data);
        while let Some(end) = buf.windows(2).position(|w| w == b"\n\n") {
            let event: Vec<u8> = buf.drain(..end + 2).collect();
            let text = String::from_utf8_lossy(&event);
            for line in text.lines() {
                if let Some(d) = line.strip_prefix("data:") {
                    let d = d.strip_prefix(' ').unwrap_or(d).to_string();
                    if tx.send(Event::Data(i, d)).await.is_err() {
                        return;
                    }
                }
            }
        }
        if buf.len() > MAX_EVENT_BYTES {
            break 'frames;
        }
    }
    let _ = tx.send(Event::End(i)).await;
}

#[cfg(test)]
mod tests {
    use super::*;
    use rngd_api::fanout::split;

    fn sse(events: &[&str]) -> Response {
        let body: String = events.iter().map(|e| format!("data: {e}\n\n")).collect();
        // Split the body mid-event to exercise reassembly.
        let (a, b) = body.split_at(body.len() / 2);
        let chunks: Vec<Result<Bytes, std::io::Error>> = vec![
            Ok(Bytes::from(a.to_string())),
            Ok(Bytes::from(b.to_string())),
        ];
        Response::new(Body::from_stream(tokio_stream::iter(chunks)))
    }

    async fn events(r: Response) -> Vec<String> {
        let b = axum::body::to_bytes(r.into_body(), 1 << 20).await.unwrap();
        String::from_utf8(b.to_vec())
            .unwrap()
            .split("\n\n")
            .filter(|e| !e.is_empty())
            .map(|e| e.strip_prefix("data: ").unwrap().to_string())
            .collect()
    }

    fn chunk(text: &str) -> String {
        serde_json::json!({"id": "c", "object": "text_completion", "created": 1, "model": "m",
                           "choices": [{"index": 0, "text": text, "finish_reason": null}]})
        .to_string()
    }

    #[tokio::test]
    async fn streams_merge_into_one_with_every_choice_and_one_done() {
        let s = split(br#"{"prompt":"a","n":2,"stream":true}"#, false)
            .unwrap()
            .unwrap();
        let parts = vec![
            sse(&[&chunk("x"), &chunk("y"), "[DONE]"]),
            sse(&[&chunk("z"), "[DONE]"]),
        ];
        let ev = events(merge(&s, parts).await).await;
        assert_eq!(ev.last().map(String::as_str), Some("[DONE]"));
        let mut by_index: Vec<(u64, String)> = ev[..ev.len() - 1]
            .iter()
            .map(|e| {
                let v: Value = serde_json::from_str(e).unwrap();
                (
                    v["choices"][0]["index"].as_u64().unwrap(),
                    v["choices"][0]["text"].as_str().unwrap().to_string(),
                )
            })
            .collect();
        by_index.sort();
        assert_eq!(
            by_index,
            [(0, "x".into()), (0, "y".into()), (1, "z".into())]
        );
    }

    #[tokio::test]
    async fn a_part_cut_short_ends_the_stream_with_an_error() {
        let s = split(br#"{"prompt":"a","n":2,"stream":true}"#, false)
            .unwrap()
            .unwrap();
        let parts = vec![sse(&[&chunk("x"), "[DONE]"]), sse(&[&chunk("z")])];
        let ev = events(merge(&s, parts).await).await;
        assert_eq!(ev.last().map(String::as_str), Some("[DONE]"));
        let err: Value = serde_json::from_str(&ev[ev.len() - 2]).unwrap();
        assert!(
            err["error"]["message"]
                .as_str()
                .unwrap()
                .contains("choice 1")
        );
    }

    #[tokio::test]
    async fn a_refused_part_is_the_answer() {
        let s = split(br#"{"prompt":["a","b"]}"#, false).unwrap().unwrap();
        let ok = Response::new(Body::from(chunk("x")));
        let refused = (StatusCode::TOO_MANY_REQUESTS, "busy").into_response();
        let r = merge(&s, vec![ok, refused]).await;
        assert_eq!(r.status(), StatusCode::TOO_MANY_REQUESTS);
    }

    #[tokio::test]
    async fn whole_answers_merge() {
        let s = split(br#"{"prompt":["a","b"]}"#, false).unwrap().unwrap();
        let r = merge(
            &s,
            vec![
                Response::new(Body::from(chunk("x"))),
                Response::new(Body::from(chunk("y"))),
            ],
        )
        .await;
        assert_eq!(r.status(), StatusCode::OK);
        let b = axum::body::to_bytes(r.into_body(), 1 << 20).await.unwrap();
        let v: Value = serde_json::from_slice(&b).unwrap();
        assert_eq!(v["choices"][1]["text"], "y");
        assert_eq!(v["choices"][1]["index"], 1);
    }
}
