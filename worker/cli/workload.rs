//! `rngd-pd workload run FILE`: the ai-rm workload runner. A workload (YAML
//! or JSON, as ai-rm hands it over) names a `kind` (`prefill`, `decode`,
//! `serve`) and its settings; the runner turns it into the command line and
//! environment of the matching `rngd-pd` process and replaces itself with
//! that process (so its exit status and signals are the process's), or, with
//! `--dry-run` / `dry_run: true`, prints `{"argv": [...], "env": {...}}`.
//!
//! | kind | process |
//! |---|---|
//! | `prefill`, `decode` | `rngd-pd worker --role KIND` |
//! | `serve` with `prefill_url` and `decode_url` | `rngd-pd gateway` in front of them |
//! | `serve` without | `rngd-pd up` (the whole local stack, CPU backend) |
//!
//! `docs/workload.md` has a row per key. A key the kind does not use is an
//! error naming it, never ignored.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{Context as _, bail};
use serde::Deserialize;

/// `rngd-pd workload ...`.
#[derive(Debug, clap::Subcommand)]
pub enum Command {
    /// Start the process a workload file describes.
    Run(RunArgs),
}

/// `rngd-pd workload run`.
#[derive(Debug, clap::Args)]
pub struct RunArgs {
    /// The workload (YAML, or JSON when it ends in `.json`).
    pub file: PathBuf,
    /// Print `{"argv": [...], "env": {...}}` instead of starting it.
    #[arg(long)]
    pub dry_run: bool,
}

/// Default of `kv_transport`.
const DEFAULT_KV_TRANSPORT: &str = "shm";
/// Default of `port`.
const DEFAULT_PORT: u16 = 8000;
/// Default of `seq_len`.
const DEFAULT_SEQ_LEN: u32 = 256;
/// Default of `host`.
const DEFAULT_HOST: &str = "127.0.0.1";

/// What a workload runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Kind {
    /// A prefill worker.
    Prefill,
    /// A decode worker.
    Decode,
    /// A front door (a gateway, or the whole local stack).
    Serve,
}

// === impl Kind ===

impl Kind {
    /// The name as a workload spells it.
    fn as_str(self) -> &'static str {
        match self {
            Kind::Prefill => "prefill",
            Kind::Decode => "decode",
            Kind::Serve => "serve",
        }
    }
}

/// A workload as ai-rm hands it over.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Workload {
    /// What to run.
    pub kind: Kind,
    /// The model (a GGUF file or a directory holding one); default: the
    /// model cache.
    #[serde(default)]
    pub model: Option<String>,
    /// The KV transport (`shm`, `tcp`, `nixl-ucx`); default `shm`.
    #[serde(default)]
    pub kv_transport: Option<String>,
    /// The listen port; default 8000.
    #[serde(default)]
    pub port: Option<u16>,
    /// The listen host; default 127.0.0.1 (listeners bind narrowly unless
    /// told otherwise).
    #[serde(default)]
    pub host: Option<String>,
    /// The compiled context length; default 256.
    #[serde(default)]
    pub seq_len: Option<u32>,
    /// The engine backend (`cpu`, `rngd`, `atom`); workers only (`serve`
    /// without URLs runs the CPU backend).
    #[serde(default)]
    pub backend: Option<String>,
    /// `serve`: the prefill worker's URL (with `decode_url`).
    #[serde(default)]
    pub prefill_url: Option<String>,
    /// `serve`: the decode worker's URL (with `prefill_url`).
    #[serde(default)]
    pub decode_url: Option<String>,
    /// `serve`: the port of the `airm_*` KPI endpoint.
    #[serde(default)]
    pub metrics_port: Option<u16>,
    /// `decode`: the batch width (the worker's `--batch`).
    #[serde(default)]
    pub batch_hint: Option<usize>,
    /// More arguments, appended.
    #[serde(default)]
    pub args: Vec<String>,
    /// More environment variables for the process.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Print the command instead of running it.
    #[serde(default)]
    pub dry_run: bool,
}

/// The process a workload starts.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Launch {
    /// Its command line, the program first.
    pub argv: Vec<String>,
    /// The variables set for it (on top of the runner's environment).
    pub env: BTreeMap<String, String>,
}

/// Reads a workload file.
pub fn load(path: &Path) -> anyhow::Result<Workload> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read the workload {}", path.display()))?;
    let json = path.extension().is_some_and(|e| e == "json");
    let w = if json {
        serde_json::from_str(&text).map_err(anyhow::Error::from)
    } else {
        serde_saphyr::from_str(&text).map_err(|e| anyhow::anyhow!("{e}"))
    };
    w.with_context(|| format!("the workload {} is not valid", path.display()))
}

/// The process `w` starts, `program` being this binary.
pub fn launch(w: &Workload, program: &str) -> anyhow::Result<Launch> {
    let unused = |key: &str, set: bool, why: &str| -> anyhow::Result<()> {
        if set {
            bail!("`{key}` is not used by kind {}: {why}", w.kind.as_str());
        }
        Ok(())
    };
    let transport = w
        .kv_transport
        .clone()
        .unwrap_or_else(|| DEFAULT_KV_TRANSPORT.into());
    rngd_kv_transport::registry::check_name(&transport)
        .map_err(|e| anyhow::anyhow!("`kv_transport`: {e}"))?;
    let port = w.port.unwrap_or(DEFAULT_PORT).to_string();
    let host = w.host.clone().unwrap_or_else(|| DEFAULT_HOST.into());
    let seq_len = w.seq_len.unwrap_or(DEFAULT_SEQ_LEN).to_string();
    let mut argv = vec![program.to_string()];
    let mut add = |a: &[&str]| argv.extend(a.iter().map(|s| s.to_string()));
    match w.kind {
        Kind::Prefill | Kind::Decode => {
            let role = w.kind.as_str();
            unused(
                "prefill_url",
                w.prefill_url.is_some(),
                "a worker is told its peers per request",
            )?;
            unused(
                "decode_url",
                w.decode_url.is_some(),
                "a worker is told its peers per request",
            )?;
            unused(
                "metrics_port",
                w.metrics_port.is_some(),
                "a worker serves /metrics on its own port",
            )?;
            if w.kind == Kind::Prefill {
                unused(
                    "batch_hint",
                    w.batch_hint.is_some(),
                    "it comes from the decode side",
                )?;
            }
            add(&["worker", "--role", role, "--host", &host, "--port", &port]);
            add(&["--seq-len", &seq_len, "--kv-transport", &transport]);
            if let Some(b) = &w.backend {
                add(&["--backend", b]);
            }
            if let Some(b) = w.batch_hint {
                add(&["--batch", &b.to_string()]);
            }
        }
        Kind::Serve => {
            unused(
                "batch_hint",
                w.batch_hint.is_some(),
                "it comes from the decode workload",
            )?;
            match (&w.prefill_url, &w.decode_url) {
                (Some(p), Some(d)) => {
                    unused("backend", w.backend.is_some(), "the workers run the engine")?;
                    for (key, url) in [("prefill_url", p), ("decode_url", d)] {
                        check_url(key, url)?;
                    }
                    add(&["gateway", "--listen", &format!("{host}:{port}")]);
                    add(&["--prefill", p, "--decode", d, "--seq-len", &seq_len]);
                    add(&["--worker-transport", &transport]);
                }
                (None, None) => {
                    if w.backend.as_deref().is_some_and(|b| b != "cpu") {
                        bail!(
                            "`backend`: kind serve without prefill_url/decode_url runs the local stack, which has the CPU backend only"
                        );
                    }
                    add(&["up", "--host", &host, "--port", &port]);
                    add(&["--max-model-len", &seq_len, "--kv-transport", &transport]);
                }
                _ => bail!("kind serve takes both `prefill_url` and `decode_url`, or neither"),
            }
            if let Some(m) = w.metrics_port {
                add(&["--metrics-port", &m.to_string()]);
            }
        }
    }
    if let Some(m) = &w.model {
        add(&["--model", m]);
    }
    argv.extend(w.args.iter().cloned());
    let mut env = w.env.clone();
    env.insert(rngd_api::env::AIRM_KV_TRANSPORT.into(), transport);
    Ok(Launch { argv, env })
}

fn check_url(key: &str, url: &str) -> anyhow::Result<()> {
    let ok = url
        .strip_prefix("http://")
        .or_else(|| url.strip_prefix("https://"))
        .is_some_and(|rest| !rest.is_empty() && !rest.contains(char::is_whitespace));
    if !ok {
        bail!("`{key}`: `{url}` is not an http(s) URL");
    }
    Ok(())
}

/// Runs `rngd-pd workload ...`: prints the launch, or becomes the process.
pub fn run(cmd: Command) -> anyhow::Result<()> {
    let Command::Run(a) = cmd;
    let w = load(&a.file)?;
    let program = std::env::current_exe()
        .context("cannot find this binary's path")?
        .to_string_lossy()
        .into_owned();
    let l = launch(&w, &program)?;
    if a.dry_run || w.dry_run {
        println!("{}", serde_json::to_string(&l)?);
        return Ok(());
    }
    use std::os::unix::process::CommandExt as _;
    let err = std::process::Command::new(&l.argv[0])
        .args(&l.argv[1..])
        .envs(&l.env)
        .exec();
    Err(anyhow::Error::from(err).context(format!("cannot start {}", l.argv[0])))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn yaml(s: &str) -> Workload {
        serde_saphyr::from_str(s).unwrap()
    }

    #[test]
    fn each_kind_gets_its_documented_command_line() {
        let l = launch(
            &yaml("kind: decode\nmodel: /m.gguf\nbatch_hint: 4\nargs: [--threads, '2']\nenv: {RUST_LOG: debug}\n"),
            "rngd-pd",
        )
        .unwrap();
        assert_eq!(
            l.argv.join(" "),
            "rngd-pd worker --role decode --host 127.0.0.1 --port 8000 --seq-len 256 --kv-transport shm --batch 4 --model /m.gguf --threads 2"
        );
        assert_eq!(l.env["RUST_LOG"], "debug");
        assert_eq!(l.env["AIRM_KV_TRANSPORT"], "shm");
        let g = launch(
            &yaml("kind: serve\nprefill_url: http://p:8000\ndecode_url: http://d:8000\nmetrics_port: 9100\nkv_transport: tcp\n"),
            "x",
        )
        .unwrap();
        assert_eq!(
            g.argv.join(" "),
            "x gateway --listen 127.0.0.1:8000 --prefill http://p:8000 --decode http://d:8000 --seq-len 256 --worker-transport tcp --metrics-port 9100"
        );
        let up = launch(&yaml("kind: serve\nport: 9000\nseq_len: 512\n"), "x").unwrap();
        assert_eq!(
            up.argv.join(" "),
            "x up --host 127.0.0.1 --port 9000 --max-model-len 512 --kv-transport shm"
        );
    }

    #[test]
    fn a_key_the_kind_does_not_use_is_named() {
        for (w, key) in [
            ("kind: prefill\nbatch_hint: 2\n", "batch_hint"),
            ("kind: decode\nmetrics_port: 9\n", "metrics_port"),
            ("kind: decode\nprefill_url: http://p\n", "prefill_url"),
            ("kind: serve\nprefill_url: http://p\n", "decode_url"),
            ("kind: serve\nbackend: rngd\n", "backend"),
            (
                "kind: serve\nprefill_url: ftp://p\ndecode_url: http://d\n",
                "prefill_url",
            ),
            (
                "kind: prefill\nkv_transport: carrier-pigeon\n",
                "kv_transport",
            ),
        ] {
            let e = launch(&yaml(w), "x").unwrap_err().to_string();
            assert!(e.contains(key), "{w}: {e}");
        }
        assert!(serde_saphyr::from_str::<Workload>("kind: serve\nprot: 1\n").is_err());
        assert!(serde_saphyr::from_str::<Workload>("kind: train\n").is_err());
    }
}
