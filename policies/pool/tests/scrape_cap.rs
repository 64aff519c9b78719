//! Fault row: an endpoint whose `/metrics` is huge (256 MiB, streamed without
//! a length, and one announcing it in `Content-Length`). The scraper reads at
//! most its cap (4 MiB by default), fails the scrape (counted), marks the
//! endpoint unhealthy, and the process's RSS grows by less than 32 MB; a
//! normal endpoint beside it stays healthy.

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::response::IntoResponse;
use axum::routing::get;
use rngd_policy_core::Role;
use rngd_pool::scrape::DEFAULT_MAX_SCRAPE_BYTES;
use rngd_pool::source::local_endpoint;
use rngd_pool::{EndpointSource, HttpFetcher, ScrapedEndpoints, StaticEndpoints};

const PAGE: &str = "vllm:num_requests_waiting 1\nvllm:num_requests_running 2\n";
const HUGE: usize = 256 << 20;

fn rss() -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = s.lines().find(|l| l.starts_with("VmRSS:")).unwrap();
    line.split_whitespace()
        .nth(1)
        .unwrap()
        .parse::<u64>()
        .unwrap()
        * 1024
}

/// A comment line repeated: a valid page, just far too long.
fn huge_stream() -> Body {
    let chunk = axum::body::Bytes::from(format!("# {}\n", "x".repeat(64 * 1024 - 3)));
    let n = HUGE / chunk.len();
    Body::from_stream(futures::stream::iter(
        (0..n).map(move |_| Ok::<_, std::io::Error>(chunk.clone())),
    ))
}

async fn serve(app: Router) -> String {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap().to_string();
    tokio::spawn(async move { axum::serve(l, app).await.unwrap() });
    addr
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_huge_metrics_page_fails_the_scrape_within_the_cap() {
    let normal = serve(Router::new().route("/metrics", get(|| async { PAGE }))).await;
    let streamed = serve(Router::new().route("/metrics", get(|| async { huge_stream() }))).await;
    let announced = serve(Router::new().route(
        "/metrics",
        get(|| async {
            let mut r = huge_stream().into_response();
            r.headers_mut()
                .insert("content-length", HUGE.to_string().parse().unwrap());
            r
        }),
    ))
    .await;
    let eps = [&normal, &streamed, &announced]
        .iter()
        .map(|a| local_endpoint(a.to_string(), Role::Solo, 512, &[]))
        .collect();
    let failures = prometheus::IntCounter::new("f", "f").unwrap();
    let table = ScrapedEndpoints::new(
        StaticEndpoints::new(eps),
        Arc::new(HttpFetcher::new(Duration::from_secs(30)).unwrap()),
        Duration::from_secs(60),
        Some(failures.clone()),
    );
    let before = rss();
    for _ in 0..3 {
        table.scrape_all().await;
    }
    let grown = rss().saturating_sub(before);
    assert_eq!(failures.get(), 6, "two huge pages, three rounds");
    for a in [&streamed, &announced] {
        let e = table.scrape_one(a).await.unwrap_err().to_string();
        assert!(e.contains(&DEFAULT_MAX_SCRAPE_BYTES.to_string()), "{e}");
    }
    let snap = table.snapshot();
    let healthy = |a: &str| snap.iter().find(|e| e.address == a).unwrap().healthy;
    assert!(healthy(&normal));
    assert!(!healthy(&streamed) && !healthy(&announced));
    assert!(
        grown < 32 << 20,
        "RSS grew {grown} bytes over 6 huge scrapes"
    );
    // A smaller cap is honoured too.
    let small = HttpFetcher::new(Duration::from_secs(5))
        .unwrap()
        .with_max_body(16);
    use rngd_pool::MetricsFetcher;
    assert!(small.fetch(&normal).await.is_err());
    assert!(
        HttpFetcher::new(Duration::from_secs(5))
            .unwrap()
            .fetch(&normal)
            .await
            .is_ok()
    );
}
