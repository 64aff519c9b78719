//! [`RequestState`]: one request as a policy guest sees it through the
//! proxy-wasm ABI (headers with the guest's edits, body, properties, a local
//! response) and the decision read back out of it. The wasm host's hostcalls
//! and a native in-process run of a module (the benchmark's baseline) share
//! these semantics.

use std::sync::Arc;

use rngd_api::headers;
use rngd_policy_core::{Decision, LocalResponse, Route};

use crate::codes::status;
use crate::map::decode_map;
use crate::{PolicyError, PolicyRequest};

/// The request the guest is looking at, and what it did to it.
#[derive(Default)]
pub struct RequestState {
    /// Request headers as the host passed them (never edited: the guest's
    /// edits live in `set` and `removed`, see [`RequestState::header`]).
    pub(crate) headers: Vec<(String, String)>,
    /// Request body.
    pub(crate) body: Vec<u8>,
    /// `rngd_pd.endpoints` JSON.
    pub(crate) endpoints: Option<Arc<str>>,
    /// `rngd_pd.endpoints_version`.
    pub(crate) endpoints_version: Option<Arc<str>>,
    /// `rngd_pd.prompt_tokens`.
    pub(crate) prompt_tokens: Option<String>,
    /// `rngd_pd.prefix_cache`.
    pub(crate) prefix_cache: Option<String>,
    /// Headers the guest set, replaced or added, in order (lowercase names).
    pub(crate) set: Vec<(String, String)>,
    /// Names of passed headers the guest removed (lowercase).
    pub(crate) removed: Vec<String>,
    /// A local response the guest sent.
    pub(crate) local: Option<rngd_policy_core::LocalResponse>,
}

/// One property a guest can read (`proxy_get_property`): its path (tokens
/// joined by NUL) and where its value comes from. Adding a property is one
/// row of [`PROPERTIES`] and, if it is new data, one field of
/// [`PolicyRequest`] copied in [`RequestState::begin`].
pub(crate) struct PropertyRow {
    /// The NUL-joined path.
    pub(crate) path: &'static [u8],
    /// Its value for the request the guest is looking at; `None` = absent.
    pub(crate) value: fn(&RequestState) -> Option<&[u8]>,
}

/// Every property the host serves (documented in `docs/policy-abi.md`).
pub(crate) const PROPERTIES: &[PropertyRow] = &[
    PropertyRow {
        path: rngd_policy_core::PROP_ENDPOINTS_PATH,
        value: |s| s.endpoints.as_deref().map(str::as_bytes),
    },
    PropertyRow {
        path: rngd_policy_core::PROP_ENDPOINTS_VERSION_PATH,
        value: |s| s.endpoints_version.as_deref().map(str::as_bytes),
    },
    PropertyRow {
        path: rngd_policy_core::PROP_PROMPT_TOKENS_PATH,
        value: |s| s.prompt_tokens.as_deref().map(str::as_bytes),
    },
    PropertyRow {
        path: rngd_policy_core::PROP_PREFIX_CACHE_PATH,
        value: |s| s.prefix_cache.as_deref().map(str::as_bytes),
    },
    PropertyRow {
        path: b"plugin_name",
        value: |_| Some(b"rngd-pd-policy".as_slice()),
    },
];

impl RequestState {
    /// The value of header `key` as the guest sees it: what it set, else the
    /// passed header unless it removed it.
    pub fn header(&self, key: &str) -> Option<&str> {
        if let Some((_, v)) = self.set.iter().find(|(k, _)| k.eq_ignore_ascii_case(key)) {
            return Some(v);
        }
        if self.is_removed(key) {
            return None;
        }
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(key))
            .map(|(_, v)| v.as_str())
    }

    pub(crate) fn is_removed(&self, key: &str) -> bool {
        self.removed.iter().any(|k| k.eq_ignore_ascii_case(key))
    }

    /// Every header as the guest sees it: passed ones it neither removed nor
    /// set, then the ones it set.
    pub fn view(&self) -> Vec<(String, String)> {
        let mut out: Vec<(String, String)> = self
            .headers
            .iter()
            .filter(|(k, _)| {
                !self.is_removed(k) && !self.set.iter().any(|(s, _)| s.eq_ignore_ascii_case(k))
            })
            .cloned()
            .collect();
        out.extend(self.set.iter().cloned());
        out
    }

    /// Sets header `key` (`add`: appends `, value` to its current value).
    pub fn set_header(&mut self, key: &str, value: &str, add: bool) {
        let old = if add { self.header(key) } else { None };
        let joined;
        let value = match old {
            Some(old) if !old.is_empty() => {
                joined = format!("{old},{value}");
                joined.as_str()
            }
            _ => value,
        };
        self.removed.retain(|k| !k.eq_ignore_ascii_case(key));
        match self
            .set
            .iter_mut()
            .find(|(k, _)| k.eq_ignore_ascii_case(key))
        {
            Some(slot) => {
                slot.1.clear();
                slot.1.push_str(value);
            }
            None => self.set.push((key.to_ascii_lowercase(), value.to_string())),
        }
    }

    /// Removes header `key`.
    pub fn remove_header(&mut self, key: &str) {
        self.set.retain(|(k, _)| !k.eq_ignore_ascii_case(key));
        if !self.is_removed(key)
            && self
                .headers
                .iter()
                .any(|(k, _)| k.eq_ignore_ascii_case(key))
        {
            self.removed.push(key.to_ascii_lowercase());
        }
    }
}

impl RequestState {
    /// Lends `req` to the state for one decision: its headers and body are
    /// swapped in (not copied), the prompt token count is written out, and
    /// what a previous guest did is cleared. [`RequestState::finish`] hands
    /// them back. The snapshot properties are set apart
    /// ([`RequestState::set_snapshot`]), since they change rarely.
    pub fn begin(&mut self, req: &mut PolicyRequest) {
        std::mem::swap(&mut self.headers, &mut req.headers);
        std::mem::swap(&mut self.body, &mut req.body);
        match req.prompt_tokens {
            Some(n) => set_decimal(self.prompt_tokens.get_or_insert_with(String::new), n),
            None => self.prompt_tokens = None,
        }
        std::mem::swap(&mut self.prefix_cache, &mut req.prefix_cache);
        self.set.clear();
        self.removed.clear();
        self.local = None;
    }

    /// Sets `rngd_pd.endpoints` (JSON) and `rngd_pd.endpoints_version`.
    pub fn set_snapshot(&mut self, json: Option<Arc<str>>, version: Option<Arc<str>>) {
        self.endpoints = json;
        self.endpoints_version = version;
    }

    /// Hands the lent headers and body back to `req` and reads the decision
    /// out of what the guest did: a local response, or the headers it set
    /// (which move into the decision).
    pub fn finish(&mut self, req: &mut PolicyRequest) -> Result<Decision, PolicyError> {
        std::mem::swap(&mut self.headers, &mut req.headers);
        std::mem::swap(&mut self.body, &mut req.body);
        std::mem::swap(&mut self.prefix_cache, &mut req.prefix_cache);
        self.decision()
    }

    /// The request body.
    pub fn body(&self) -> &[u8] {
        &self.body
    }

    /// The value of a property by its NUL-joined path, `None` if unknown or absent.
    pub fn property_at(&self, path: &[u8]) -> Option<&[u8]> {
        PROPERTIES
            .iter()
            .find(|row| row.path == path)
            .and_then(|row| (row.value)(self))
    }

    /// Records a local response (`proxy_send_local_response`): `headers` in
    /// the ABI's map encoding. Errors are ABI status codes.
    pub fn send_local_response(
        &mut self,
        code: u32,
        body: Vec<u8>,
        headers: &[u8],
    ) -> Result<(), u32> {
        let headers = decode_map(headers).ok_or(status::BAD_ARGUMENT)?;
        let status_code = u16::try_from(code).map_err(|_| status::BAD_ARGUMENT)?;
        if !(200..=599).contains(&status_code) {
            return Err(status::BAD_ARGUMENT);
        }
        self.local = Some(LocalResponse {
            status: status_code,
            body,
            headers,
        });
        Ok(())
    }

    /// Whether the guest sent a local response.
    pub fn has_local_response(&self) -> bool {
        self.local.is_some()
    }

    fn decision(&mut self) -> Result<Decision, PolicyError> {
        if let Some(local) = self.local.take() {
            return Ok(Decision::Reject(local));
        }
        let get = |set: &[(String, String)], name: &str| {
            set.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone())
        };
        let Some(decode) = get(&self.set, headers::DESTINATION_ENDPOINT) else {
            return Err(PolicyError::NoDecision {
                detail: format!(
                    "neither {} was set nor a local response sent (headers set: {:?})",
                    headers::DESTINATION_ENDPOINT,
                    self.set.iter().map(|(k, _)| k.as_str()).collect::<Vec<_>>()
                ),
            });
        };
        Ok(Decision::Route(Route {
            decode,
            prefill: get(&self.set, headers::PREFILLER_HOST_PORT),
            kv_transport: get(&self.set, headers::KV_TRANSPORT),
            headers: std::mem::take(&mut self.set),
        }))
    }
}

/// Writes `n` in decimal into `s` (no formatting machinery on the hot path).
fn set_decimal(s: &mut String, mut n: usize) {
    let mut digits = [0u8; 20];
    let mut i = digits.len();
    loop {
        i -= 1;
        digits[i] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    s.clear();
    s.extend(digits[i..].iter().map(|&d| char::from(d)));
}

#[cfg(test)]
mod tests {
    use super::set_decimal;

    #[test]
    fn decimal_matches_display() {
        let mut s = String::from("stale");
        for n in [0, 7, 10, 99, 210, 4096, 1_000_000, usize::MAX] {
            set_decimal(&mut s, n);
            assert_eq!(s, n.to_string());
        }
    }
}
