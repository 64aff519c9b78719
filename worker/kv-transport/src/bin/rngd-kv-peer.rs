//! `rngd-kv-peer`: a test tool, not part of the product. The across-nodes test
//! (`tests/netns.rs`) runs it inside network namespaces with `ip netns exec`
//! to play the relay, the prefill side (push) and the decode side (pull) of
//! the `tcp` transport.
//!
//! - `relay --listen HOST:PORT`: prints `relay listening on ADDR`, serves
//!   until stdin closes (or a signal);
//! - `push --addr A --id R --seed S --blobs N --blob-len L`: pushes
//!   deterministic bytes (the conformance pattern), prints the handle as JSON;
//! - `pull --addr A --handle JSON --seed S --timeout-ms T`: pulls, checks the
//!   bytes against the pattern, releases, prints `ok BYTES`; exits 1 on any error.

use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};
use rngd_kv_transport::{
    KvHandle, KvTransport, TransportConfig, conformance, relay, tcp::TcpTransport,
};
use tokio::io::AsyncReadExt;

#[derive(Parser)]
#[command(about = "Test tool: relay / push / pull peer of the tcp KV transport")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Run a relay until stdin closes.
    Relay {
        /// Listen address.
        #[arg(long, default_value = "0.0.0.0:0")]
        listen: String,
    },
    /// Push a deterministic request and print its handle.
    Push {
        /// Relay address.
        #[arg(long)]
        addr: String,
        /// Request id.
        #[arg(long)]
        id: String,
        /// Pattern seed.
        #[arg(long)]
        seed: u64,
        /// Number of blobs.
        #[arg(long, default_value_t = 64)]
        blobs: usize,
        /// Bytes per blob.
        #[arg(long, default_value_t = 1 << 20)]
        blob_len: usize,
    },
    /// Pull a request, check it byte-exact against the pattern, release it.
    Pull {
        /// Relay address.
        #[arg(long)]
        addr: String,
        /// The handle JSON printed by `push`.
        #[arg(long)]
        handle: String,
        /// Pattern seed used by `push`.
        #[arg(long)]
        seed: u64,
        /// Pull timeout.
        #[arg(long, default_value_t = 30_000)]
        timeout_ms: u64,
    },
}

#[tokio::main]
async fn main() -> ExitCode {
    match run(Cli::parse()).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("rngd-kv-peer: {e}");
            ExitCode::FAILURE
        }
    }
}

async fn run(cli: Cli) -> Result<(), String> {
    match cli.cmd {
        Cmd::Relay { listen } => {
            let listener = tokio::net::TcpListener::bind(&listen)
                .await
                .map_err(|e| format!("bind {listen}: {e}"))?;
            let addr = listener.local_addr().map_err(|e| e.to_string())?;
            println!("relay listening on {addr}");
            let stdin_closed = async {
                let mut sink = Vec::new();
                let _ = tokio::io::stdin().read_to_end(&mut sink).await;
            };
            relay::serve(listener, relay::RelayConfig::default(), stdin_closed)
                .await
                .map_err(|e| e.to_string())
        }
        Cmd::Push {
            addr,
            id,
            seed,
            blobs,
            blob_len,
        } => {
            let t = TcpTransport::connect_to(addr, &TransportConfig::default());
            let handle = t
                .push(conformance::payload(&id, seed, blobs, blob_len))
                .await
                .map_err(|e| e.to_string())?;
            println!(
                "{}",
                serde_json::to_string(&handle).map_err(|e| e.to_string())?
            );
            Ok(())
        }
        Cmd::Pull {
            addr,
            handle,
            seed,
            timeout_ms,
        } => {
            let handle: KvHandle =
                serde_json::from_str(&handle).map_err(|e| format!("bad handle JSON: {e}"))?;
            let t = TcpTransport::connect_to(addr, &TransportConfig::default());
            let got = t
                .pull(&handle, Duration::from_millis(timeout_ms))
                .await
                .map_err(|e| e.to_string())?;
            let want = conformance::payload(
                &handle.request_id,
                seed,
                handle.blobs.len(),
                handle.blobs.first().map_or(0, |b| b.len as usize),
            );
            if got != want.blobs {
                return Err("pulled bytes differ from the pushed pattern".into());
            }
            t.release(&handle).await.map_err(|e| e.to_string())?;
            let bytes: usize = got.iter().map(|b| b.len()).sum();
            println!("ok {bytes}");
            Ok(())
        }
    }
}
