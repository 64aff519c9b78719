//! `rngd-pd gateway`: not wired yet.

/// Flags.
#[derive(Debug, clap::Args)]
pub struct Args {}

/// Runs the subcommand.
pub async fn run(_args: Args) -> anyhow::Result<()> {
    anyhow::bail!("rngd-pd gateway is not built yet")
}
