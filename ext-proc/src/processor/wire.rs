//! The Envoy `ext_proc` messages the state machine reads and writes: request
//! headers as pairs, the subset hint from filter metadata, the route's header
//! mutation and `envoy.lb` dynamic metadata, immediate responses, streamed
//! body chunks.

use std::collections::HashMap;

use envoy_types::pb::envoy::config::core::v3::header_value_option::HeaderAppendAction;
use envoy_types::pb::envoy::config::core::v3::{HeaderValue, HeaderValueOption, Metadata};
use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    BodyMutation, BodyResponse, CommonResponse, HeaderMutation, HeadersResponse, HttpHeaders,
    ImmediateResponse, ProcessingResponse, StreamedBodyResponse, body_mutation,
    processing_response,
};
use envoy_types::pb::envoy::r#type::v3::HttpStatus;
use envoy_types::pb::google::protobuf::{Struct, Value, value::Kind};
use rngd_api::headers;
use rngd_policy_core::{LocalResponse, Route};

use super::SUBSET_HINT_NAMESPACE;
use crate::picker::route_headers;

pub(super) fn header_pairs(h: &HttpHeaders) -> Vec<(String, String)> {
    h.headers
        .as_ref()
        .map(|m| {
            m.headers
                .iter()
                .map(|hv| {
                    let v = if hv.raw_value.is_empty() {
                        hv.value.clone()
                    } else {
                        String::from_utf8_lossy(&hv.raw_value).into_owned()
                    };
                    (hv.key.to_ascii_lowercase(), v)
                })
                .collect()
        })
        .unwrap_or_default()
}

pub(super) fn subset_from_metadata(md: &Metadata) -> Option<Vec<String>> {
    let ns = md.filter_metadata.get(SUBSET_HINT_NAMESPACE)?;
    let v = ns.fields.get(headers::ENVOY_LB_SUBSET_HINT)?;
    Some(match &v.kind {
        Some(Kind::ListValue(list)) => list
            .values
            .iter()
            .filter_map(|v| match &v.kind {
                Some(Kind::StringValue(s)) => Some(s.trim().to_string()),
                _ => None,
            })
            .filter(|s| !s.is_empty())
            .collect(),
        Some(Kind::StringValue(s)) => split_list(s),
        _ => Vec::new(),
    })
}

pub(super) fn split_list(s: &str) -> Vec<String> {
    s.split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(str::to_string)
        .collect()
}

pub(super) fn set_header(key: &str, value: &str) -> HeaderValueOption {
    HeaderValueOption {
        header: Some(HeaderValue {
            key: key.to_string(),
            value: String::new(),
            raw_value: value.as_bytes().to_vec(),
        }),
        append_action: HeaderAppendAction::OverwriteIfExistsOrAdd as i32,
        ..Default::default()
    }
}

pub(super) fn lb_metadata(destination: &str) -> Struct {
    let mut inner = HashMap::new();
    inner.insert(
        headers::DESTINATION_ENDPOINT.to_string(),
        Value {
            kind: Some(Kind::StringValue(destination.to_string())),
        },
    );
    let mut outer = HashMap::new();
    outer.insert(
        headers::ENVOY_LB_NAMESPACE.to_string(),
        Value {
            kind: Some(Kind::StructValue(Struct { fields: inner })),
        },
    );
    Struct { fields: outer }
}

/// The immediate response for a local answer.
pub fn immediate(local: &LocalResponse) -> ProcessingResponse {
    let set_headers = local
        .headers
        .iter()
        .map(|(k, v)| set_header(k, v))
        .collect();
    ProcessingResponse {
        response: Some(processing_response::Response::ImmediateResponse(
            ImmediateResponse {
                status: Some(HttpStatus {
                    code: i32::from(local.status),
                }),
                headers: Some(HeaderMutation {
                    set_headers,
                    remove_headers: vec![],
                }),
                body: local.body.clone(),
                grpc_status: None,
                details: format!("rngd_pd_epp_{}", local.status),
            },
        )),
        ..Default::default()
    }
}

/// The route's header mutation: its headers set (overwriting a client's),
/// `content-length` when the body was re-sent, and every steering header
/// the route does not set removed — the fixed names, and any
/// `x-gateway-destination-endpoint*` the client sent (`client`), so what
/// Envoy forwards carries only the pick's.
pub(super) fn route_mutation(
    route: &Route,
    content_length: Option<usize>,
    client: &[(String, String)],
) -> HeaderMutation {
    let hdrs = route_headers(route);
    let mut set_headers: Vec<HeaderValueOption> =
        hdrs.iter().map(|(k, v)| set_header(k, v)).collect();
    if let Some(n) = content_length {
        set_headers.push(set_header("content-length", &n.to_string()));
    }
    let fixed = [
        headers::DESTINATION_ENDPOINT_SUBSET,
        headers::PREFILLER_HOST_PORT,
        headers::KV_TRANSPORT,
    ];
    let sent = client
        .iter()
        .map(|(k, _)| k.as_str())
        .filter(|k| rngd_pool::pick::is_steering_header(k));
    let mut remove_headers: Vec<String> = Vec::new();
    for name in fixed.into_iter().chain(sent) {
        let name = name.to_ascii_lowercase();
        if !hdrs.iter().any(|(k, _)| *k == name) && !remove_headers.contains(&name) {
            remove_headers.push(name);
        }
    }
    HeaderMutation {
        set_headers,
        remove_headers,
    }
}

/// The response-headers answer: the route's reason added for the client
/// (`x-rngd-pd-route-reason`), when the policy gave one.
pub(super) fn response_headers(reason: Option<&str>) -> HeadersResponse {
    HeadersResponse {
        response: reason.map(|r| CommonResponse {
            header_mutation: Some(HeaderMutation {
                set_headers: vec![set_header(headers::ROUTE_REASON, r)],
                remove_headers: vec![],
            }),
            ..Default::default()
        }),
    }
}

pub(super) fn routed_common(
    route: &Route,
    content_length: Option<usize>,
    client: &[(String, String)],
) -> CommonResponse {
    CommonResponse {
        header_mutation: Some(route_mutation(route, content_length, client)),
        clear_route_cache: true,
        ..Default::default()
    }
}

pub(super) fn request_headers_response(common: CommonResponse) -> processing_response::Response {
    processing_response::Response::RequestHeaders(HeadersResponse {
        response: Some(common),
    })
}

pub(super) fn streamed_body(
    body: Vec<u8>,
    end_of_stream: bool,
    request: bool,
) -> ProcessingResponse {
    let br = BodyResponse {
        response: Some(CommonResponse {
            body_mutation: Some(BodyMutation {
                mutation: Some(body_mutation::Mutation::StreamedResponse(
                    StreamedBodyResponse {
                        body,
                        end_of_stream,
                        ..Default::default()
                    },
                )),
            }),
            ..Default::default()
        }),
    };
    ProcessingResponse {
        response: Some(if request {
            processing_response::Response::RequestBody(br)
        } else {
            processing_response::Response::ResponseBody(br)
        }),
        ..Default::default()
    }
}

pub(super) fn mode_of(v: i32) -> BodySendMode {
    BodySendMode::try_from(v).unwrap_or(BodySendMode::FullDuplexStreamed)
}
