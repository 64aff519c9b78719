//! The gateway with the REAL default policy module (`pd_default.wasm`, built by
//! `policies/build.sh`) in front of REAL in-process workers (`rngd_worker`)
//! running the fake instant engine over an in-memory KV transport; and the
//! `rngd-pd gateway` binary itself.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rngd_engine::fake::EchoEngine;
use rngd_gateway::GatewayConfig;
use rngd_gateway::launch::{
    LaunchOptions, PolicyChoice, ScrapeOptions, SourceChoice, TokenizerChoice,
};
use rngd_kv_transport::fake::MemoryTransport;
use rngd_kv_transport::{KvError, KvTransport};
use rngd_policy_core::Role;
use rngd_pool::source as endpoints;
use rngd_worker::{TransportFactory, Transports, WorkerConfig};
use serde_json::{Value, json};

fn policy_module() -> std::path::PathBuf {
    rngd_policy_host::built_module("pd_default", "wasm32-unknown-unknown")
}

/// Every transport name resolves to the one shared in-memory transport.
struct Shared(Arc<MemoryTransport>);

impl TransportFactory for Shared {
    fn create(&self, _name: &str) -> Result<Arc<dyn KvTransport>, KvError> {
        Ok(self.0.clone())
    }
}

struct Stack {
    url: String,
    prefill: rngd_worker::RunningWorker,
    decode: rngd_worker::RunningWorker,
    kv: Arc<MemoryTransport>,
    _gateway: rngd_gateway::launch::Launched,
}

async fn stack(token_delay: Duration) -> Stack {
    let kv = Arc::new(MemoryTransport::new());
    let mut workers = Vec::new();
    for role in [rngd_worker::Role::Prefill, rngd_worker::Role::Decode] {
        let engine = Arc::new(EchoEngine::new(512).with_token_delay(token_delay));
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let transports = Transports::new("memory", Shared(kv.clone()));
        workers.push(
            rngd_worker::serve(
                l,
                engine,
                transports,
                WorkerConfig::new(role).with_kv_secret(b"test-kv-secret-0123456789abcdef"),
            )
            .await
            .unwrap(),
        );
    }
    let decode = workers.pop().unwrap();
    let prefill = workers.pop().unwrap();
    let gateway = rngd_gateway::launch::launch(LaunchOptions {
        listen: "127.0.0.1:0".into(),
        kpi_listen: None,
        endpoints: SourceChoice::Static(vec![
            endpoints::local_endpoint(
                prefill.addr.to_string(),
                Role::Prefill,
                512,
                &["memory".into()],
            ),
            endpoints::local_endpoint(
                decode.addr.to_string(),
                Role::Decode,
                512,
                &["memory".into()],
            ),
        ]),
        policy: PolicyChoice::Wasm {
            module: policy_module(),
            config: serde_json::to_vec(&json!({"same_node_transport": "memory"})).unwrap(),
            limits: Default::default(),
            watch_every: None,
        },
        admin_token: None,
        admin_listen: "127.0.0.1:0".parse().unwrap(),
        tokenizer: TokenizerChoice::Custom(Arc::new(rngd_pool::prompt::ByteCounter)),
        config: GatewayConfig::default(),
        scrape: ScrapeOptions {
            every: Some(Duration::from_millis(50)),
            stale_after: Duration::from_secs(2),
            ..ScrapeOptions::default()
        },
        cache: None,
    })
    .await
    .unwrap();
    assert!(
        gateway.wait_ready(Duration::from_secs(10)).await,
        "workers not healthy after 10 s of scraping"
    );
    Stack {
        url: format!("http://{}", gateway.addr),
        prefill,
        decode,
        kv,
        _gateway: gateway,
    }
}

fn counter(text: &str, name: &str) -> f64 {
    text.lines()
        .filter(|l| l.starts_with(name) && l[name.len()..].starts_with([' ', '{']))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

async fn metrics(w: &rngd_worker::RunningWorker) -> String {
    reqwest::get(format!("{}/metrics", w.url()))
        .await
        .unwrap()
        .text()
        .await
        .unwrap()
}

const LONG: &str =
    "a prompt that is long enough, in bytes, to be disaggregated by the default policy";

#[tokio::test]
async fn real_policy_disaggregates_long_prompts_and_matches_a_solo_run() {
    let s = stack(Duration::ZERO).await;
    let body = json!({"model": "echo", "prompt": LONG, "max_tokens": 12, "temperature": 0});
    let via: Value = reqwest::Client::new()
        .post(format!("{}/v1/completions", s.url))
        .json(&body)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert!(via["error"].is_null(), "{via}");
    // The decode worker alone (it prefills locally) is the single-worker reference.
    let solo: Value = reqwest::Client::new()
        .post(format!("{}/v1/completions", s.decode.url()))
        .json(&body)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(
        via["choices"][0]["token_ids"],
        solo["choices"][0]["token_ids"]
    );
    assert_eq!(via["choices"][0]["text"], solo["choices"][0]["text"]);
    assert_eq!(
        counter(&metrics(&s.prefill).await, "rngd_pd_worker_prefills_total"),
        1.0
    );
    assert_eq!(
        counter(&metrics(&s.decode).await, "rngd_pd_worker_kv_loads_total"),
        1.0
    );
    assert_eq!(s.kv.held(), 0, "KV left in the transport");
    assert!(via["timings"]["kv_transfer_ms"].as_f64().is_some(), "{via}");
}

#[tokio::test]
async fn real_policy_refuses_over_length_with_the_numbers() {
    let s = stack(Duration::ZERO).await;
    let prompt = "x".repeat(500);
    let r = reqwest::Client::new()
        .post(format!("{}/v1/completions", s.url))
        .json(&json!({"model": "echo", "prompt": prompt, "max_tokens": 100}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    let v: Value = r.json().await.unwrap();
    let m = v["error"]["message"].as_str().unwrap();
    assert!(
        m.contains("500") && m.contains("100") && m.contains("600") && m.contains("512"),
        "{m}"
    );
    assert_eq!(v["error"]["code"], rngd_api::openai::CONTEXT_LENGTH_CODE);
    assert_eq!(
        counter(&metrics(&s.prefill).await, "rngd_pd_worker_prefills_total"),
        0.0
    );
}

#[tokio::test]
async fn disconnect_mid_stream_cancels_decode_and_frees_the_kv() {
    let s = stack(Duration::from_millis(20)).await;
    let r = reqwest::Client::new()
        .post(format!("{}/v1/completions", s.url))
        .json(&json!({"model": "echo", "prompt": LONG, "max_tokens": 300, "stream": true}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let mut r = r;
    let first = r.chunk().await.unwrap().expect("stream ended at once");
    assert!(first.starts_with(b"data: "), "{first:?}");
    drop(r);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let running = counter(&metrics(&s.decode).await, "vllm:num_requests_running");
        if running == 0.0 && s.kv.held() == 0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "after disconnect: running {running}, KV held {}",
            s.kv.held()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The binary: flags, printed address, health, models, and an error body.
#[tokio::test]
async fn gateway_binary_serves() {
    let model =
        rngd_engine::model_fetch::resolve(None).expect("model missing: run `rngd-pd model fetch`");
    let engine = Arc::new(EchoEngine::new(512));
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let worker = rngd_worker::serve(
        l,
        engine,
        Transports::new("memory", Shared(Arc::new(MemoryTransport::new()))),
        rngd_worker::WorkerConfig::new(rngd_worker::Role::Decode)
            .with_kv_secret(b"test-kv-secret-0123456789abcdef"),
    )
    .await
    .unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_rngd-pd"))
        .args([
            "gateway",
            "--listen",
            "127.0.0.1:0",
            "--metrics-port",
            "0",
            "--decode",
        ])
        .arg(worker.url())
        .arg("--policy")
        .arg(policy_module())
        .arg("--model")
        .arg(&model)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut kpi = None;
    let url = loop {
        let line = lines
            .next()
            .expect("gateway exited before printing its address")
            .unwrap();
        if let Some(k) = line.strip_prefix("rngd-pd gateway kpi metrics on ") {
            kpi = Some(k.to_string());
        }
        if let Some(u) = line.strip_prefix("rngd-pd gateway listening on ") {
            break u.to_string();
        }
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    while !reqwest::get(format!("{url}/health"))
        .await
        .is_ok_and(|r| r.status() == reqwest::StatusCode::OK)
    {
        assert!(Instant::now() < deadline, "gateway never healthy");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let models: Value = reqwest::get(format!("{url}/v1/models"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let name = models["data"][0]["id"].as_str().unwrap().to_string();
    assert!(!name.is_empty());
    let r = reqwest::Client::new()
        .post(format!("{url}/v1/completions"))
        .json(&json!({"model": "not-served", "prompt": "hi"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404);
    let kpi = kpi.expect("no KPI line printed");
    let text = reqwest::get(kpi).await.unwrap().text().await.unwrap();
    assert!(text.contains("airm_ttft_p90_ms"), "{text}");
    child.kill().unwrap();
    child.wait().unwrap();
}

#[tokio::test]
async fn the_admin_api_is_on_its_own_loopback_listener_and_always_authenticated() {
    let gateway = rngd_gateway::launch::launch(LaunchOptions {
        listen: "127.0.0.1:0".into(),
        kpi_listen: None,
        endpoints: SourceChoice::Static(vec![endpoints::local_endpoint(
            "127.0.0.1:9".into(),
            Role::Solo,
            512,
            &["memory".into()],
        )]),
        policy: PolicyChoice::Wasm {
            module: policy_module(),
            config: Vec::new(),
            limits: Default::default(),
            watch_every: None,
        },
        admin_token: Some("s3cret-admin-token".into()),
        admin_listen: "127.0.0.1:0".parse().unwrap(),
        tokenizer: TokenizerChoice::Custom(Arc::new(rngd_pool::prompt::ByteCounter)),
        config: GatewayConfig::default(),
        scrape: ScrapeOptions {
            every: None,
            stale_after: Duration::from_secs(2),
            ..ScrapeOptions::default()
        },
        cache: None,
    })
    .await
    .unwrap();
    let admin = gateway.admin_addr.expect("an admin listener");
    assert!(admin.ip().is_loopback());
    assert_ne!(admin, gateway.addr);
    let c = reqwest::Client::new();
    // Not on the public listener.
    let r = c
        .get(format!("http://{}/admin/policy", gateway.addr))
        .bearer_auth("s3cret-admin-token")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404);
    let url = format!("http://{admin}/admin/policy");
    assert_eq!(
        c.get(&url).send().await.unwrap().status(),
        401,
        "GET needs the token"
    );
    assert_eq!(
        c.get(&url)
            .bearer_auth("wrong")
            .send()
            .await
            .unwrap()
            .status(),
        401
    );
    let r = c
        .get(&url)
        .bearer_auth("s3cret-admin-token")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let v: Value = r.json().await.unwrap();
    assert!(v.to_string().contains("sha256"), "{v}");
}
