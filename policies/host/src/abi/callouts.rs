//! Callouts the sandbox does not offer: HTTP and gRPC calls, their status,
//! and foreign functions. Each answers `BadArgument` (starting one) or
//! `NotFound` (acting on one, which cannot exist).

use super::{Cx, ENV, Hostcall, R};
use crate::codes::status;

/// The callout hostcalls.
pub(super) const HOSTCALLS: &[Hostcall] = hostcalls![ENV =>
    proxy_http_call,
    proxy_grpc_call,
    proxy_grpc_stream,
    proxy_grpc_send,
    proxy_grpc_cancel,
    proxy_grpc_close,
    proxy_get_status,
    proxy_call_foreign_function,
];

#[expect(clippy::too_many_arguments, reason = "the ABI's signature")]
fn proxy_http_call(
    _: Cx<'_>,
    _: u32,
    _: u32,
    _: u32,
    _: u32,
    _: u32,
    _: u32,
    _: u32,
    _: u32,
    _: u32,
    _: u32,
) -> R {
    Ok(status::BAD_ARGUMENT)
}

#[expect(clippy::too_many_arguments, reason = "the ABI's signature")]
fn proxy_grpc_call(
    _: Cx<'_>,
    _: u32,
    _: u32,
    _: u32,
    _: u32,
    _: u32,
    _: u32,
    _: u32,
    _: u32,
    _: u32,
    _: u32,
    _: u32,
    _: u32,
) -> R {
    Ok(status::BAD_ARGUMENT)
}

#[expect(clippy::too_many_arguments, reason = "the ABI's signature")]
fn proxy_grpc_stream(
    _: Cx<'_>,
    _: u32,
    _: u32,
    _: u32,
    _: u32,
    _: u32,
    _: u32,
    _: u32,
    _: u32,
    _: u32,
) -> R {
    Ok(status::BAD_ARGUMENT)
}

fn proxy_grpc_send(_: Cx<'_>, _: u32, _: u32, _: u32, _: u32) -> R {
    Ok(status::NOT_FOUND)
}

fn proxy_grpc_cancel(_: Cx<'_>, _: u32) -> R {
    Ok(status::NOT_FOUND)
}

fn proxy_grpc_close(_: Cx<'_>, _: u32) -> R {
    Ok(status::NOT_FOUND)
}

fn proxy_get_status(_: Cx<'_>, _: u32, _: u32, _: u32) -> R {
    Ok(status::NOT_FOUND)
}

fn proxy_call_foreign_function(_: Cx<'_>, _: u32, _: u32, _: u32, _: u32, _: u32, _: u32) -> R {
    Ok(status::NOT_FOUND)
}
