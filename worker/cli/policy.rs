//! `rngd-pd policy …`: work with policy modules.

/// Policy subcommands.
#[derive(Debug, clap::Subcommand)]
pub enum Command {
    /// Validate a module: compile, instantiate, run the built-in canned
    /// requests and print the decisions. Exits non-zero if the module is bad.
    Check(rngd_policy_host::CheckArgs),
}

/// Runs the subcommand.
pub async fn run(cmd: Command) -> anyhow::Result<()> {
    match cmd {
        Command::Check(args) => {
            let report = tokio::task::spawn_blocking(move || args.run()).await??;
            println!("{report}");
            Ok(())
        }
    }
}
