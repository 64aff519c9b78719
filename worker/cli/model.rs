//! `rngd-pd model …`: not wired yet.

/// Model subcommands.
#[derive(Debug, clap::Subcommand)]
pub enum Command {
    /// Download the default model into the cache.
    Fetch {},
}

/// Runs the subcommand.
pub async fn run(_cmd: Command) -> anyhow::Result<()> {
    anyhow::bail!("rngd-pd model is not built yet")
}
