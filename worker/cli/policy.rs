//! `rngd-pd policy …`: work with policy modules. The flags live here; the
//! work is `rngd_policy_host` ([`CheckOptions`], [`rngd_policy_host::check`]).

use std::path::PathBuf;

use rngd_policy_host::CheckOptions;

/// Policy subcommands.
#[derive(Debug, clap::Subcommand)]
pub enum Command {
    /// Validate a module: compile, instantiate, run the built-in canned
    /// requests and print the decisions. Exits non-zero if the module is bad.
    Check(CheckArgs),
}

/// Arguments of `rngd-pd policy check`.
#[derive(Debug, Clone, clap::Args)]
pub struct CheckArgs {
    /// The `.wasm` module.
    pub module: PathBuf,
    /// Plugin configuration file (JSON); default `{}`.
    #[arg(long)]
    pub config: Option<PathBuf>,
}

impl From<CheckArgs> for CheckOptions {
    fn from(a: CheckArgs) -> CheckOptions {
        CheckOptions {
            module: a.module,
            config: a.config,
        }
    }
}

/// Runs the subcommand.
pub async fn run(cmd: Command) -> anyhow::Result<()> {
    match cmd {
        Command::Check(args) => {
            let opts = CheckOptions::from(args);
            let report = tokio::task::spawn_blocking(move || opts.run()).await??;
            println!("{report}");
            Ok(())
        }
    }
}
