//! `rngd-pd-bench weights`: how long a running worker takes to serve new
//! weights by a delta update, against restarting it on the new file, in one
//! run of interleaved rounds (these machines are shared and noisy: only the
//! ratio within a run is a figure).
//!
//! - **Checkpoints**: from the model file (SmolLM2-135M by default), a copy
//!   with a per-tensor manifest (`base.gguf`) and, for each `k` in
//!   `1..=tensors.len()`, a copy with the first `k` of `tensors` altered
//!   (their blocks moved by one place; every value stays valid) and its
//!   manifest (`changed-k.gguf`), written with `rngd_engine::manifest`.
//! - **Update**: one long-lived solo worker on `base.gguf` with an admin
//!   listener. Timed: `POST /update_weights_from_disk` of `changed-k.gguf`
//!   (a delta: only the `k` tensors are read), then a greedy one-token
//!   completion, until its answer. Then (untimed) back to `base.gguf`.
//! - **Restart**: a new worker process started on `changed-k.gguf`; timed
//!   from the spawn until the same one-token completion answers, then it
//!   stops. A worker restarted in place would also stop the old one first;
//!   that time is not counted.
//! - **Checks**: the updated worker's `weight_version` equals the restarted
//!   one's, and so does the token; the answer's `bytes_read` and
//!   `tensors_changed` are reported.
//! - **Variant swap**: on the same long-lived worker, `POST /switch_variant`
//!   to (`variant_seq_len`, `variant_max_batch`), prepared once before the
//!   rounds, timed until it answers (the variant serves) and until a
//!   one-token completion after it answers; against a worker started with
//!   `--seq-len`/`--batch` of that variant, timed until it prints its
//!   listening line (it serves) and until the same completion answers.
//!   Each round switches back (untimed).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use rngd_bench_replay::{up, worker};
use serde::Serialize;
use serde_json::{Value, json};

/// The admin token variable the worker reads.
const ADMIN_TOKEN_ENV: &str = "RNGD_PD_ADMIN_TOKEN";

/// Errors of the benchmark.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The options do not make a run.
    #[error("options: {0}")]
    Options(String),
    /// Building the checkpoints failed.
    #[error("building the checkpoints")]
    Checkpoint(#[source] rngd_engine::EngineError),
    /// A temporary directory could not be made.
    #[error("temporary directory: {0}")]
    Temp(#[source] std::io::Error),
    /// Starting or stopping a worker failed.
    #[error(transparent)]
    Worker(#[from] rngd_bench_replay::Error),
    /// A request failed (what, and the answer).
    #[error("{what}: {detail}")]
    Request {
        /// Which request.
        what: String,
        /// Status and body, or the transport error.
        detail: String,
    },
    /// The update and the restart disagree.
    #[error("the updated worker differs from the restarted one: {0}")]
    Mismatch(String),
    /// Building the HTTP client failed.
    #[error("http client")]
    Client(#[source] reqwest::Error),
}

/// How to run (`rngd-pd-bench weights` flags set these).
#[derive(Debug, Clone)]
pub struct Options {
    /// The model file; default: the cached default model.
    pub model: Option<PathBuf>,
    /// The rngd-pd binary; default: $RNGD_PD_BIN, then the build's.
    pub rngd_pd: Option<PathBuf>,
    /// Extra arguments of every started worker.
    pub worker_args: Vec<String>,
    /// `--seq-len` of the workers.
    pub seq_len: u32,
    /// Tensors altered: `changed-k` alters the first `k`.
    pub tensors: Vec<String>,
    /// Interleaved rounds (one update and one restart per `k` each).
    pub rounds: usize,
    /// How long a worker may take to load, seconds.
    pub worker_timeout_s: f64,
    /// Deadline of each request, seconds.
    pub request_timeout_s: f64,
    /// Context length of the variant swapped to.
    pub variant_seq_len: u32,
    /// Batch of the variant swapped to.
    pub variant_max_batch: u32,
    /// Print only the JSON line.
    pub json: bool,
}

impl Default for Options {
    /// Three weight matrices of different layers, 3 rounds, S = 512.
    fn default() -> Self {
        Options {
            model: None,
            rngd_pd: None,
            worker_args: Vec::new(),
            seq_len: 512,
            tensors: vec![
                "blk.0.attn_q.weight".into(),
                "blk.10.ffn_down.weight".into(),
                "blk.20.ffn_up.weight".into(),
            ],
            rounds: 3,
            worker_timeout_s: 600.0,
            request_timeout_s: 120.0,
            variant_seq_len: 1024,
            variant_max_batch: 4,
            json: false,
        }
    }
}

/// One `k`: medians over the rounds.
#[derive(Debug, Clone, Serialize)]
pub struct Row {
    /// Tensors changed.
    pub k: usize,
    /// Update + first token, seconds (median).
    pub update_s: f64,
    /// Restart + first token, seconds (median).
    pub restart_s: f64,
    /// Median over rounds of update / restart (same round).
    pub ratio: f64,
    /// Every round's (update, restart), seconds.
    pub samples: Vec<(f64, f64)>,
    /// The update answer's `mode` (`delta` expected).
    pub mode: String,
    /// The update answer's `tensors_changed`.
    pub tensors_changed: u64,
    /// The update answer's `bytes_read`.
    pub bytes_read: u64,
    /// The new file's size.
    pub file_bytes: u64,
}

/// The variant swap: medians over the rounds.
#[derive(Debug, Clone, Serialize)]
pub struct VariantRow {
    /// The variant's context length.
    pub seq_len: u32,
    /// Its batch.
    pub max_batch: u32,
    /// Swap until the variant serves (the admin answer), seconds (median).
    pub swap_s: f64,
    /// Restart with the variant until it serves (its listening line),
    /// seconds (median).
    pub restart_s: f64,
    /// Median over rounds of swap / restart.
    pub ratio: f64,
    /// Swap + a one-token completion, seconds (median).
    pub swap_first_token_s: f64,
    /// Restart + the same completion, seconds (median).
    pub restart_first_token_s: f64,
    /// Median over rounds of the two.
    pub ratio_first_token: f64,
    /// Every round's (swap, restart, swap + token, restart + token), seconds.
    pub samples: Vec<(f64, f64, f64, f64)>,
    /// Whether every timed swap found the variant prepared.
    pub prepared: bool,
}

/// The run's result.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// `weights`.
    pub bench: &'static str,
    /// The model file.
    pub model: String,
    /// Rounds.
    pub rounds: usize,
    /// One row per `k`.
    pub rows: Vec<Row>,
    /// The swap to a prepared variant.
    pub variant: VariantRow,
}

impl Report {
    /// One JSON line.
    pub fn json_line(&self) -> String {
        serde_json::to_string(self).unwrap_or_default()
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

/// Runs and prints the JSON line.
pub async fn run(opts: Options) -> Result<Report, Error> {
    let r = launch(opts).await?;
    println!("{}", r.json_line());
    Ok(r)
}

/// The checkpoints in `dir`: `base.gguf`, then `changed-k.gguf` per `k`.
pub fn checkpoints(model: &Path, dir: &Path, tensors: &[String]) -> Result<Vec<PathBuf>, Error> {
    rngd_engine::manifest::stamp(model, &dir.join("base.gguf")).map_err(Error::Checkpoint)?;
    let mut out = Vec::new();
    for k in 1..=tensors.len() {
        let path = dir.join(format!("changed-{k}.gguf"));
        let s = rngd_engine::manifest::stamp_with(
            model,
            &path,
            |_| {},
            |name, block, bytes| {
                if tensors[..k].iter().any(|t| t == name) {
                    bytes.rotate_left(block);
                }
            },
        )
        .map_err(Error::Checkpoint)?;
        if s.altered.len() != k {
            return Err(Error::Options(format!(
                "altered {:?}, wanted the first {k} of {tensors:?} (a name that is not a tensor of the model?)",
                s.altered
            )));
        }
        out.push(path);
    }
    Ok(out)
}

/// The one-token greedy completion; its text.
async fn first_token(
    client: &reqwest::Client,
    base: &str,
    timeout: Duration,
) -> Result<String, Error> {
    let body = json!({
        "model": SERVED_MODEL,
        "prompt": "The lighthouse keeper climbed the stairs and",
        "max_tokens": 1,
        "temperature": 0,
    });
    let v = post(
        client,
        &format!("{base}/v1/completions"),
        &body,
        None,
        timeout,
        "completion",
    )
    .await?;
    Ok(v["choices"][0]["text"]
        .as_str()
        .unwrap_or_default()
        .to_string())
}

/// `--served-model-name` of every worker this benchmark starts.
const SERVED_MODEL: &str = "bench-weights";

async fn post(
    client: &reqwest::Client,
    url: &str,
    body: &Value,
    token: Option<&str>,
    timeout: Duration,
    what: &str,
) -> Result<Value, Error> {
    let mut req = client.post(url).json(body).timeout(timeout);
    if let Some(t) = token {
        req = req.bearer_auth(t);
    }
    let fail = |detail: String| Error::Request {
        what: what.to_string(),
        detail,
    };
    let r = req.send().await.map_err(|e| fail(e.to_string()))?;
    let status = r.status();
    let text = r.text().await.map_err(|e| fail(e.to_string()))?;
    if !status.is_success() {
        return Err(fail(format!("{status}: {text}")));
    }
    serde_json::from_str(&text).map_err(|e| fail(format!("{e}: {text}")))
}

async fn version(client: &reqwest::Client, base: &str) -> Option<String> {
    let v: Value = client
        .get(format!("{base}/v1/models"))
        .timeout(Duration::from_secs(10))
        .send()
        .await
        .ok()?
        .json()
        .await
        .ok()?;
    v["data"][0]["weight_version"].as_str().map(str::to_string)
}

/// Runs the benchmark and returns its report without printing it.
pub async fn launch(opts: Options) -> Result<Report, Error> {
    if opts.rounds == 0 || opts.tensors.is_empty() {
        return Err(Error::Options(
            "--rounds and --tensors need at least one".into(),
        ));
    }
    let model = match &opts.model {
        Some(m) => m.clone(),
        None => rngd_engine::model_fetch::resolve(None).map_err(Error::Checkpoint)?,
    };
    let bin = up::locate(opts.rngd_pd.as_deref())?;
    let dir = tempfile::tempdir().map_err(Error::Temp)?;
    let say = |m: String| {
        if !opts.json {
            eprintln!("weights: {m}");
        }
    };
    say(format!("writing {} checkpoints", opts.tensors.len() + 1));
    let changed = checkpoints(&model, dir.path(), &opts.tensors)?;
    let token = format!(
        "bench-{:x}",
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0)
    );
    let env = [(ADMIN_TOKEN_ENV.to_string(), token.clone())];
    let load_timeout = Duration::from_secs_f64(opts.worker_timeout_s);
    let req_timeout = Duration::from_secs_f64(opts.request_timeout_s);
    let with_model = |p: &Path, admin: bool| {
        let mut a = vec![
            "--model".to_string(),
            p.display().to_string(),
            "--served-model-name".to_string(),
            SERVED_MODEL.to_string(),
        ];
        if admin {
            a.extend(["--admin-listen".to_string(), "127.0.0.1:0".to_string()]);
        }
        a.extend(opts.worker_args.iter().cloned());
        a
    };
    let client = reqwest::Client::builder().build().map_err(Error::Client)?;
    let long = worker::start_with_env(
        &bin,
        opts.seq_len,
        &with_model(&dir.path().join("base.gguf"), true),
        &env,
        load_timeout,
    )
    .await?;
    let result = async {
        let admin = long
            .admin_url
            .clone()
            .ok_or_else(|| Error::Options("the worker printed no admin address".into()))?;
        first_token(&client, &long.url, req_timeout).await?;
        let mut samples = vec![Vec::new(); changed.len()];
        let mut answers = vec![Value::Null; changed.len()];
        for round in 0..opts.rounds {
            for (i, file) in changed.iter().enumerate() {
                let k = i + 1;
                say(format!("round {round}, k = {k}: restart"));
                let t0 = Instant::now();
                let w = worker::start(&bin, opts.seq_len, &with_model(file, false), load_timeout)
                    .await?;
                let fresh = first_token(&client, &w.url, req_timeout).await;
                let restart = t0.elapsed().as_secs_f64();
                let fresh_version = version(&client, &w.url).await;
                if let Err(e) = w.stop(Duration::from_secs(30)).await {
                    eprintln!("weights: {e}");
                }
                let fresh = fresh?;
                say(format!("round {round}, k = {k}: update"));
                let name = file.file_name().map(|n| n.to_string_lossy().into_owned());
                let t0 = Instant::now();
                let answer = post(
                    &client,
                    &format!("{admin}/update_weights_from_disk"),
                    &json!({ "model_path": name }),
                    Some(&token),
                    req_timeout,
                    "update",
                )
                .await?;
                let updated = first_token(&client, &long.url, req_timeout).await?;
                let update = t0.elapsed().as_secs_f64();
                let v = version(&client, &long.url).await;
                if v != fresh_version || updated != fresh {
                    return Err(Error::Mismatch(format!(
                        "k = {k}: version {v:?} vs {fresh_version:?}, token {updated:?} vs {fresh:?}"
                    )));
                }
                post(
                    &client,
                    &format!("{admin}/update_weights_from_disk"),
                    &json!({ "model_path": "base.gguf" }),
                    Some(&token),
                    req_timeout,
                    "update back",
                )
                .await?;
                samples[i].push((update, restart));
                answers[i] = answer;
            }
        }
        // The variant: prepared once, then swapped to in each round.
        let admin_post = |path: &'static str, body: Value| {
            let (client, admin, token) = (&client, &admin, &token);
            async move {
                post(
                    client,
                    &format!("{admin}{path}"),
                    &body,
                    Some(token),
                    req_timeout,
                    path,
                )
                .await
            }
        };
        let vs = json!({"seq_len": opts.variant_seq_len, "max_batch": opts.variant_max_batch});
        let back = admin_post("/switch_variant", vs.clone()).await?;
        let home = back["variants"]
            .as_array()
            .and_then(|v| v.iter().find(|x| x["active"] == false))
            .cloned()
            .ok_or_else(|| Error::Mismatch(format!("no previous variant in {back}")))?;
        let home = json!({"seq_len": home["seq_len"], "max_batch": home["max_batch"]});
        admin_post("/switch_variant", home.clone()).await?;
        let mut vsamples = Vec::new();
        let mut all_prepared = true;
        let restart_args = {
            let mut a = with_model(&dir.path().join("base.gguf"), false);
            a.extend(["--batch".to_string(), opts.variant_max_batch.to_string()]);
            a
        };
        for round in 0..opts.rounds {
            say(format!("round {round}: variant restart"));
            let t0 = Instant::now();
            let w = worker::start(&bin, opts.variant_seq_len, &restart_args, load_timeout).await?;
            let ready = t0.elapsed().as_secs_f64();
            let fresh = first_token(&client, &w.url, req_timeout).await;
            let restart = t0.elapsed().as_secs_f64();
            if let Err(e) = w.stop(Duration::from_secs(30)).await {
                eprintln!("weights: {e}");
            }
            let fresh = fresh?;
            say(format!("round {round}: variant swap"));
            let t0 = Instant::now();
            let a = admin_post("/switch_variant", vs.clone()).await?;
            let swapped_at = t0.elapsed().as_secs_f64();
            let swapped = first_token(&client, &long.url, req_timeout).await?;
            let swap = t0.elapsed().as_secs_f64();
            all_prepared &= a["was_prepared"] == true;
            if swapped != fresh {
                return Err(Error::Mismatch(format!(
                    "variant: token {swapped:?} vs {fresh:?}"
                )));
            }
            admin_post("/switch_variant", home.clone()).await?;
            vsamples.push((swapped_at, ready, swap, restart));
        }
        let variant = VariantRow {
            seq_len: opts.variant_seq_len,
            max_batch: opts.variant_max_batch,
            swap_s: median(vsamples.iter().map(|x| x.0).collect()),
            restart_s: median(vsamples.iter().map(|x| x.1).collect()),
            ratio: median(vsamples.iter().map(|x| x.0 / x.1).collect()),
            swap_first_token_s: median(vsamples.iter().map(|x| x.2).collect()),
            restart_first_token_s: median(vsamples.iter().map(|x| x.3).collect()),
            ratio_first_token: median(vsamples.iter().map(|x| x.2 / x.3).collect()),
            samples: vsamples,
            prepared: all_prepared,
        };
        let rows = samples
            .into_iter()
            .zip(answers)
            .zip(&changed)
            .enumerate()
            .map(|(i, ((s, a), file))| Row {
                k: i + 1,
                update_s: median(s.iter().map(|x| x.0).collect()),
                restart_s: median(s.iter().map(|x| x.1).collect()),
                ratio: median(s.iter().map(|x| x.0 / x.1).collect()),
                samples: s,
                mode: a["mode"].as_str().unwrap_or_default().to_string(),
                tensors_changed: a["tensors_changed"].as_u64().unwrap_or(0),
                bytes_read: a["bytes_read"].as_u64().unwrap_or(0),
                file_bytes: std::fs::metadata(file).map(|m| m.len()).unwrap_or(0),
            })
            .collect();
        Ok(Report {
            bench: "weights",
            model: model.display().to_string(),
            rounds: opts.rounds,
            rows,
            variant,
        })
    }
    .await;
    if let Err(e) = long.stop(Duration::from_secs(30)).await {
        eprintln!("weights: {e}");
    }
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn medians() {
        assert_eq!(median(vec![3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(vec![4.0, 1.0, 2.0, 3.0]), 2.5);
        assert!(median(Vec::new()).is_nan());
    }
}
