//! `rngd-pd bench …`: one subcommand per harness crate under `bench/`.

/// Benchmarks.
#[derive(Debug, clap::Subcommand)]
pub enum Command {
    /// Not wired yet.
    Kv {},
}

/// Runs the benchmark.
pub async fn run(_cmd: Command) -> anyhow::Result<()> {
    anyhow::bail!("rngd-pd bench is not built yet")
}
