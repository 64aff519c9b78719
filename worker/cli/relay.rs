//! `rngd-pd relay`: the KV relay server of the `tcp` transport.

/// Flags (each also from its environment variable).
pub type Args = rngd_kv_transport::relay::RelayArgs;

/// Runs the relay until Ctrl-C / SIGTERM.
pub async fn run(args: Args) -> anyhow::Result<()> {
    rngd_kv_transport::relay::run(args).await?;
    Ok(())
}
