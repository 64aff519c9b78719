//! The guard of every admin listener (the policy admin API, the worker's
//! admin API): the bearer token ([`AdminToken`], only its SHA-256 digest
//! kept, compared in constant time) and the lockout after repeated failures
//! ([`AdminGuard`]). Written once so both admin APIs check a token the same
//! way; each keeps its own routes and counts the refusals in its own metrics.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use rngd_api::openai::ErrorBody;

/// The admin bearer token. Only its SHA-256 digest is kept; `Debug` shows
/// neither.
#[derive(Clone)]
pub struct AdminToken {
    digest: [u8; 32],
}

impl std::fmt::Debug for AdminToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("AdminToken(<redacted>)")
    }
}

// === impl AdminToken ===

impl AdminToken {
    /// The token `token`; `None` when it is empty (no admin API).
    pub fn new(token: &str) -> Option<AdminToken> {
        (!token.is_empty()).then(|| AdminToken {
            digest: digest(token.as_bytes()),
        })
    }

    /// Whether `given` is the token: the SHA-256 digests of both are
    /// compared without an early exit, so the time taken says nothing about
    /// how much of `given` matched (nor about the token's length).
    pub fn matches(&self, given: &[u8]) -> bool {
        same_digest(&digest(given), &self.digest)
    }
}

fn digest(bytes: &[u8]) -> [u8; 32] {
    use sha2::Digest;
    sha2::Sha256::digest(bytes).into()
}

/// Constant-time equality of two digests.
fn same_digest(a: &[u8; 32], b: &[u8; 32]) -> bool {
    let diff = a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y));
    // Keeps the compiler from turning the fold into an early-exit compare.
    std::hint::black_box(diff) == 0
}

/// How many failed attempts lock an admin API, and for how long.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LockoutOptions {
    /// Failed attempts (missing or wrong token) within `failure_window`
    /// after which every request is answered 429 for `lockout`. Default 10.
    pub max_failures: u32,
    /// The window of `max_failures`. Default 60 s.
    pub failure_window: Duration,
    /// How long requests are answered 429 once `max_failures` is reached
    /// (the token is not even checked then). Default 30 s.
    pub lockout: Duration,
}

impl Default for LockoutOptions {
    fn default() -> Self {
        LockoutOptions {
            max_failures: 10,
            failure_window: Duration::from_secs(60),
            lockout: Duration::from_secs(30),
        }
    }
}

/// Why a request was refused by an [`AdminGuard`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// The API is locked after repeated failures; try again after this long.
    Throttled {
        /// Until the lockout ends.
        retry_after: Duration,
    },
    /// The token was missing or wrong.
    Unauthorized {
        /// This failure started a lockout.
        locked_out: bool,
    },
}

// === impl Refusal ===

impl Refusal {
    /// The answer: 429 with `Retry-After`, or 401 with
    /// `WWW-Authenticate: Bearer`; `api` names the API in the message.
    pub fn into_response(self, api: &str) -> Response {
        match self {
            Refusal::Throttled { retry_after } => {
                let mut resp = error(
                    StatusCode::TOO_MANY_REQUESTS,
                    format!("too many failed {api} attempts; try again later"),
                );
                let secs = retry_after.as_secs().max(1);
                if let Ok(v) = HeaderValue::from_str(&secs.to_string()) {
                    resp.headers_mut().insert(header::RETRY_AFTER, v);
                }
                resp
            }
            Refusal::Unauthorized { .. } => {
                let mut resp = error(
                    StatusCode::UNAUTHORIZED,
                    format!("a valid bearer token is required for the {api}"),
                );
                resp.headers_mut()
                    .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
                resp
            }
        }
    }
}

/// An OpenAI-style error answer with `status`.
fn error(status: StatusCode, message: impl Into<String>) -> Response {
    let body = ErrorBody::new(ErrorBody::kind_for_status(status.as_u16()), message);
    (status, axum::Json(body)).into_response()
}

/// Failed attempts and the lockout they caused.
#[derive(Default)]
struct Throttle {
    failures: VecDeque<Instant>,
    locked_until: Option<Instant>,
}

/// The token check of one admin API, with its lockout (one per API: an
/// admin API is one operator's, so the limit is global, not per client).
#[derive(Clone)]
pub struct AdminGuard {
    token: AdminToken,
    options: LockoutOptions,
    throttle: Arc<Mutex<Throttle>>,
}

impl std::fmt::Debug for AdminGuard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AdminGuard")
            .field("token", &self.token)
            .field("options", &self.options)
            .finish_non_exhaustive()
    }
}

// === impl AdminGuard ===

impl AdminGuard {
    /// A guard admitting `token`.
    pub fn new(token: AdminToken, options: LockoutOptions) -> AdminGuard {
        AdminGuard {
            token,
            options,
            throttle: Arc::default(),
        }
    }

    /// Checks `Authorization: Bearer TOKEN`, counting failures: `Ok` lets the
    /// request in; while locked out every request is refused without the
    /// token being looked at.
    pub fn check(&self, headers: &HeaderMap) -> Result<(), Refusal> {
        let now = Instant::now();
        let mut th = self
            .throttle
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(until) = th.locked_until {
            if now < until {
                return Err(Refusal::Throttled {
                    retry_after: until.duration_since(now),
                });
            }
            th.locked_until = None;
        }
        let given = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.as_bytes().strip_prefix(b"Bearer "))
            .unwrap_or_default();
        if self.token.matches(given) {
            th.failures.clear();
            return Ok(());
        }
        let opts = &self.options;
        let max = opts.max_failures.max(1) as usize;
        th.failures.push_back(now);
        while th.failures.len() > max {
            th.failures.pop_front();
        }
        let first = th.failures.front().copied().unwrap_or(now);
        let locked_out =
            th.failures.len() >= max && now.duration_since(first) <= opts.failure_window;
        if locked_out {
            th.failures.clear();
            th.locked_until = Some(now + opts.lockout);
        }
        Err(Refusal::Unauthorized { locked_out })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_comparison_is_exact_and_redacted() {
        let t = AdminToken::new("s3cret").unwrap();
        assert!(t.matches(b"s3cret"));
        for wrong in [&b""[..], b"s3cre", b"s3cret ", b"S3cret", b"s3cres", b"x"] {
            assert!(!t.matches(wrong), "{wrong:?}");
        }
        assert!(AdminToken::new("").is_none());
        let g = AdminGuard::new(t.clone(), LockoutOptions::default());
        let shown = format!("{t:?} {g:?}");
        assert!(!shown.contains("s3cret"), "{shown}");
        assert!(shown.contains("redacted"), "{shown}");
    }

    #[test]
    fn digests_compare_without_early_exit() {
        // Equal digests, one differing in the first byte, one in the last:
        // same_digest looks at every byte either way (the fold has no branch).
        let a = [7u8; 32];
        let mut first = a;
        first[0] ^= 1;
        let mut last = a;
        last[31] ^= 0x80;
        assert!(same_digest(&a, &a));
        assert!(!same_digest(&a, &first));
        assert!(!same_digest(&a, &last));
    }

    fn bearer(t: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(
            header::AUTHORIZATION,
            HeaderValue::from_str(&format!("Bearer {t}")).unwrap(),
        );
        h
    }

    #[test]
    fn repeated_failures_lock_even_the_right_token_out() {
        let g = AdminGuard::new(
            AdminToken::new("tok").unwrap(),
            LockoutOptions {
                max_failures: 3,
                failure_window: Duration::from_secs(60),
                lockout: Duration::from_secs(30),
            },
        );
        assert_eq!(g.check(&bearer("tok")), Ok(()));
        assert_eq!(
            g.check(&HeaderMap::new()),
            Err(Refusal::Unauthorized { locked_out: false })
        );
        assert_eq!(
            g.check(&bearer("x")),
            Err(Refusal::Unauthorized { locked_out: false })
        );
        assert_eq!(
            g.check(&bearer("y")),
            Err(Refusal::Unauthorized { locked_out: true })
        );
        match g.check(&bearer("tok")) {
            Err(Refusal::Throttled { retry_after }) => {
                assert!(retry_after > Duration::from_secs(25), "{retry_after:?}")
            }
            other => panic!("{other:?}"),
        }
        let resp = Refusal::Throttled {
            retry_after: Duration::from_millis(10),
        }
        .into_response("worker admin API");
        assert_eq!(resp.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(resp.headers()[header::RETRY_AFTER], "1");
        let resp = Refusal::Unauthorized { locked_out: false }.into_response("worker admin API");
        assert_eq!(resp.status(), StatusCode::UNAUTHORIZED);
        assert_eq!(resp.headers()[header::WWW_AUTHENTICATE], "Bearer");
    }
}
