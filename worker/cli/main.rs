//! `rngd-pd`: the serving binary (workers, relay, gateway, endpoint picker,
//! the local stack, model and policy tools). Each subcommand lives in its own
//! module, which parses flags and calls into the library crate that owns the
//! work. Benchmarks are not here: they live in the `rngd-pd-bench` binary
//! (`bench/cli`), so this one links no harness.

mod ext_proc;
mod flags;
mod gateway;
mod kv;
mod model;
mod policy;
mod pool;
mod relay;
mod up;
mod worker;
mod workload;

use clap::{Parser, Subcommand};

/// Prefill/decode-disaggregated LLM serving.
#[derive(Debug, Parser)]
#[command(name = "rngd-pd", version, about)]
struct Cli {
    /// Log lines on stderr: `text`, coloured only on a terminal (and
    /// without `NO_COLOR`), or `json`, one object per line with the span's
    /// fields (for log collectors). `up` gives its children the same.
    #[arg(long, global = true, value_enum, env = rngd_api::env::RNGD_PD_LOG_FORMAT, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
    #[command(subcommand)]
    command: Command,
}

/// `--log-format`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line.
    Json,
}

// === impl LogFormat ===

impl LogFormat {
    /// The flag's value, as a child is given it.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            LogFormat::Text => "text",
            LogFormat::Json => "json",
        }
    }
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run a worker sidecar (prefill, decode or solo).
    Worker(worker::Args),
    /// Run the KV relay server of the `tcp` transport.
    Relay(relay::Args),
    /// Run the OpenAI-compatible gateway.
    Gateway(Box<gateway::Args>),
    /// Run the Envoy ext_proc endpoint picker.
    ExtProc(ext_proc::Args),
    /// Bring up the whole local stack on the CPU backend.
    Up(up::Args),
    /// KV-transport chores on a node (the shm root).
    #[command(subcommand)]
    Kv(kv::Command),
    /// Manage models.
    #[command(subcommand)]
    Model(model::Command),
    /// Work with policy modules.
    #[command(subcommand)]
    Policy(policy::Command),
    /// Run an ai-rm workload (prefill, decode or serve) from its file.
    #[command(subcommand)]
    Workload(workload::Command),
}

fn init_tracing(format: LogFormat) {
    use std::io::IsTerminal as _;
    let filter = tracing_subscriber::EnvFilter::try_from_env(rngd_api::env::RUST_LOG)
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let fmt = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Text => {
            // No escape codes in files and pipes.
            let ansi = std::io::stderr().is_terminal()
                && std::env::var_os(rngd_api::env::NO_COLOR).is_none();
            fmt.with_ansi(ansi).init()
        }
        LogFormat::Json => fmt.json().with_current_span(true).init(),
    }
}

/// A process started by `rngd-pd up` stops when `up` dies, however it dies:
/// the kernel sends SIGTERM on the parent's death (`PR_SET_PDEATHSIG`), and a
/// parent that is already gone when this runs means exiting now.
#[cfg(target_os = "linux")]
fn follow_parent() -> anyhow::Result<()> {
    let Some(parent) = rngd_api::env::var(rngd_api::env::RNGD_PD_UP_PARENT) else {
        return Ok(());
    };
    let parent: i32 = parent.parse().map_err(|_| {
        anyhow::anyhow!(
            "{} must be a process id, got `{parent}`",
            rngd_api::env::RNGD_PD_UP_PARENT
        )
    })?;
    rustix::process::set_parent_process_death_signal(Some(rustix::process::Signal::TERM))?;
    // Checked after the signal is armed, so no death goes unnoticed.
    let now = rustix::process::getppid().map_or(0, |p| p.as_raw_nonzero().get());
    if now != parent {
        anyhow::bail!("the parent `rngd-pd up` (pid {parent}) is gone; not starting");
    }
    Ok(())
}

#[cfg(not(target_os = "linux"))]
fn follow_parent() -> anyhow::Result<()> {
    Ok(())
}

/// Takes scheduling niceness `nice` (`rngd-pd worker --nice`) for the whole
/// process: called while the main thread is the only one, so every thread
/// started later inherits it. Never raises the priority: a process already
/// nicer than `nice` keeps its own.
#[cfg(target_os = "linux")]
fn lower_priority(nice: i32) -> anyhow::Result<()> {
    use anyhow::Context as _;
    let now =
        rustix::process::getpriority_process(None).context("reading this process's niceness")?;
    if nice > now {
        rustix::process::setpriority_process(None, nice)
            .with_context(|| format!("--nice {nice}: setting this process's niceness"))?;
        tracing::info!(nice, was = now, "CPU priority lowered");
    }
    Ok(())
}

#[cfg(not(target_os = "linux"))]
fn lower_priority(nice: i32) -> anyhow::Result<()> {
    if nice > 0 {
        anyhow::bail!("--nice is supported on Linux only");
    }
    Ok(())
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    init_tracing(cli.log_format);
    follow_parent()?;
    // The runner becomes the process it starts: no runtime of its own.
    let command = match cli.command {
        Command::Workload(c) => return workload::run(c),
        c => c,
    };
    // Before the runtime starts its threads, so they all inherit it.
    if let Command::Worker(a) = &command {
        lower_priority(a.nice)?;
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async move {
        match command {
            Command::Worker(a) => worker::run(a).await,
            Command::Relay(a) => relay::run(a).await,
            Command::Gateway(a) => gateway::run(*a).await,
            Command::ExtProc(a) => ext_proc::run(a).await,
            Command::Up(a) => up::run(a, cli.log_format).await,
            Command::Kv(c) => kv::run(c).await,
            Command::Model(c) => model::run(c).await,
            Command::Policy(c) => policy::run(c).await,
            Command::Workload(_) => unreachable!("run before the runtime"),
        }
    })
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use clap::CommandFactory;

    use super::Cli;

    /// Spellings a flag had before its meaning got one name everywhere:
    /// still accepted (hidden aliases), never a flag's name.
    const OLDER: &[(&str, &str)] = &[
        ("ext-proc", "max-body-bytes"),
        ("gateway", "policy-watch-ms"),
    ];

    /// Flags with one meaning at several subcommands, and where they are.
    const SHARED: &[(&str, &[&str])] = &[
        ("model", &["worker", "gateway", "ext-proc", "up"]),
        ("chat-template", &["worker", "gateway", "ext-proc", "up"]),
        (
            "served-model-name",
            &["worker", "gateway", "ext-proc", "up"],
        ),
        ("body-limit", &["worker", "gateway", "ext-proc"]),
        ("watch-ms", &["gateway", "ext-proc"]),
        ("api-key", &["worker", "gateway", "up"]),
        ("shutdown-timeout", &["worker", "gateway", "ext-proc", "up"]),
        ("header-timeout-ms", &["worker", "gateway"]),
        ("max-connections", &["worker", "gateway"]),
    ];

    #[test]
    fn every_subcommand_spells_the_shared_flags_the_same() {
        let cli = Cli::command();
        // One field (one meaning) has one name wherever it appears.
        let mut named: HashMap<String, (String, String)> = HashMap::new();
        for sub in cli.get_subcommands() {
            for a in sub.get_arguments() {
                let Some(long) = a.get_long() else { continue };
                let (id, here) = (a.get_id().to_string(), sub.get_name().to_string());
                match named.get(&id) {
                    Some((there, other)) => assert_eq!(
                        long, other,
                        "`{id}` is --{long} at {here} but --{other} at {there}"
                    ),
                    None => {
                        named.insert(id, (here.clone(), long.to_string()));
                    }
                }
                assert!(
                    !OLDER.iter().any(|(_, old)| *old == long),
                    "{here}: --{long} is an older spelling"
                );
            }
        }
        for (flag, subs) in SHARED {
            for sub in *subs {
                let c = cli.find_subcommand(sub).unwrap();
                assert!(
                    c.get_arguments().any(|a| a.get_long() == Some(flag)),
                    "{sub} has no --{flag}"
                );
            }
        }
        // The older spellings still parse, as hidden aliases of the new name.
        for (sub, old) in OLDER {
            let c = cli.find_subcommand(sub).unwrap();
            let a = c
                .get_arguments()
                .find(|a| a.get_all_aliases().is_some_and(|v| v.contains(old)))
                .unwrap_or_else(|| panic!("{sub} no longer takes --{old}"));
            assert!(
                a.get_visible_aliases().is_none_or(|v| !v.contains(old)),
                "--{old} is shown in {sub}'s help"
            );
        }
    }
}
