//! `rngd-pd relay`: the KV relay server of the `tcp` transport. The flags
//! live here; the relay is `rngd_kv_transport::relay` ([`RelayOptions`],
//! [`rngd_kv_transport::relay::launch`]).

use rngd_api::env;
use rngd_kv_transport::relay::{self, RelayOptions};

/// Flags of `rngd-pd relay` (each also read from the environment).
#[derive(Debug, Clone, clap::Args)]
pub struct Args {
    /// Listen address, `HOST:PORT` (port 0 picks a free one; the bound address is logged and printed).
    #[arg(long, env = env::AIRM_KV_RELAY_LISTEN, default_value = "0.0.0.0:7070")]
    pub listen: String,
    /// Seconds an unread request's blobs live.
    #[arg(long = "ttl-s", env = env::AIRM_KV_TCP_TTL_S, default_value_t = 60.0)]
    pub ttl_s: f64,
    /// Memory cap in bytes.
    #[arg(long = "max-bytes", env = env::AIRM_KV_RELAY_MAX_BYTES, default_value_t = 4 << 30)]
    pub max_bytes: u64,
    /// Largest blob (frame body) accepted, bytes.
    #[arg(long = "max-frame", env = env::AIRM_KV_RELAY_MAX_FRAME, default_value_t = 64 << 20)]
    pub max_frame: u64,
    /// Validate the flags and exit: 0 and `ok`, or a clear error.
    #[arg(long)]
    pub check: bool,
}

impl From<Args> for RelayOptions {
    fn from(a: Args) -> RelayOptions {
        RelayOptions {
            listen: a.listen,
            ttl_s: a.ttl_s,
            max_bytes: a.max_bytes,
            max_frame: a.max_frame,
        }
    }
}

/// Runs the relay until Ctrl-C / SIGTERM: binds `--listen`, prints
/// `relay listening on ADDR` to stdout, serves.
pub async fn run(args: Args) -> anyhow::Result<()> {
    if args.check {
        let opts = RelayOptions::from(args);
        opts.config()?;
        opts.listen
            .parse::<std::net::SocketAddr>()
            .map_err(|e| anyhow::anyhow!("--listen {}: {e}", opts.listen))?;
        println!("ok");
        return Ok(());
    }
    let launched = relay::launch(args.into()).await?;
    println!("relay listening on {}", launched.addr);
    crate::gateway::shutdown_signal().await;
    launched.shutdown();
    launched.join().await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use clap::Parser;

    use super::*;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: Args,
    }

    /// Moved from `worker/kv-transport/tests/tcp.rs` with the flags.
    #[test]
    fn relay_args_read_flags_and_env_names() {
        let cli = Cli::try_parse_from([
            "relay",
            "--listen",
            "127.0.0.1:9999",
            "--ttl-s",
            "2.5",
            "--max-bytes",
            "1000",
            "--max-frame",
            "100",
        ])
        .unwrap();
        let cfg = RelayOptions::from(cli.args).config().unwrap();
        assert_eq!(cfg.listen, "127.0.0.1:9999");
        assert_eq!(cfg.ttl, Duration::from_millis(2500));
        assert_eq!((cfg.max_bytes, cfg.max_frame), (1000, 100));
        let cli = Cli::try_parse_from(["relay", "--ttl-s", "0"]).unwrap();
        assert!(
            RelayOptions::from(cli.args).config().is_err(),
            "a zero TTL is rejected"
        );
    }

    #[test]
    fn flag_defaults_are_the_library_defaults() {
        // Only meaningful without the variables set (as in the test runs).
        let vars = [
            env::AIRM_KV_RELAY_LISTEN,
            env::AIRM_KV_TCP_TTL_S,
            env::AIRM_KV_RELAY_MAX_BYTES,
            env::AIRM_KV_RELAY_MAX_FRAME,
        ];
        if vars.iter().any(|v| std::env::var_os(v).is_some()) {
            return;
        }
        let opts: RelayOptions = Cli::parse_from(["relay"]).args.into();
        assert_eq!(opts, RelayOptions::default());
    }
}
