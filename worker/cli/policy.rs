//! `rngd-pd policy …`: not wired yet.

/// Policy subcommands.
#[derive(Debug, clap::Subcommand)]
pub enum Command {
    /// Validate a policy module.
    Check {},
}

/// Runs the subcommand.
pub async fn run(_cmd: Command) -> anyhow::Result<()> {
    anyhow::bail!("rngd-pd policy is not built yet")
}
