//! `rngd-pd worker`: a worker sidecar (prefill, decode or solo); the work is in `rngd-worker`.

/// Flags (see [`rngd_worker::WorkerArgs`]).
pub type Args = rngd_worker::WorkerArgs;

/// Runs the subcommand.
pub async fn run(args: Args) -> anyhow::Result<()> {
    rngd_worker::run(args).await?;
    Ok(())
}
