//! `rngd-kv-peer`: a test tool, not part of the product (built only with the
//! `test-util` feature, which the crate's own tests enable). The across-nodes
//! test (`tests/netns.rs`) runs it inside network namespaces with
//! `ip netns exec` to play the relay, the prefill side (push) and the decode
//! side (pull) of the `tcp` and `nixl-ucx` transports.
//!
//! - `relay [--listen HOST:PORT]` (default `0.0.0.0:0`): prints
//!   `relay listening on ADDR`, serves until stdin closes;
//! - `push --addr A --id R --seed S [--blobs N] [--blob-len L]` (defaults 64
//!   blobs of 1 MiB): pushes deterministic bytes (the conformance pattern),
//!   prints the handle as JSON;
//! - `pull --addr A --handle JSON --seed S [--timeout-ms T]` (default 30000):
//!   pulls, checks the bytes against the pattern, releases, prints
//!   `ok BYTES`; exits 1 on any error.
//!
//! `push` and `pull` take `--transport tcp|nixl-ucx` (default `tcp`).
//! With `nixl-ucx` the pusher must stay up until the puller has READ its
//! slot: after the handle it keeps running until stdin closes, then prints
//! `slots N` (the slots it still holds) and exits. `--ttl-ms` sets the slot
//! TTL, `--pool-mb` the arena; the relay secret comes from
//! `AIRM_KV_TCP_SECRET` if set.
//!
//! Flags are `--name value` or `--name=value`; a usage error exits 2.

use std::collections::HashMap;
use std::process::ExitCode;
use std::str::FromStr;
use std::time::Duration;

use rngd_kv_transport::nixl::NixlUcxTransport;
use rngd_kv_transport::{
    KvHandle, KvTransport, TransportConfig, conformance, relay, tcp::TcpTransport,
};
use tokio::io::AsyncReadExt;

const USAGE: &str = "\
rngd-kv-peer: test tool: relay / push / pull peer of the tcp KV transport

usage:
  rngd-kv-peer relay [--listen HOST:PORT]
  rngd-kv-peer push --addr A --id R --seed S [--blobs N] [--blob-len L] [--transport T] [--ttl-ms T] [--pool-mb M]
  rngd-kv-peer pull --addr A --handle JSON --seed S [--timeout-ms T] [--transport T] [--pool-mb M]";

enum Cmd {
    /// Run a relay until stdin closes.
    Relay { listen: String },
    /// Push a deterministic request and print its handle.
    Push {
        addr: String,
        id: String,
        seed: u64,
        blobs: usize,
        blob_len: usize,
        opts: Opts,
    },
    /// Pull a request, check it byte-exact against the pattern, release it.
    Pull {
        addr: String,
        handle: String,
        seed: u64,
        timeout_ms: u64,
        opts: Opts,
    },
}

/// Transport choice and its settings.
struct Opts {
    transport: String,
    ttl_ms: u64,
    pool_mb: usize,
}

impl Opts {
    fn parse(f: &Flags) -> Result<Opts, String> {
        Ok(Opts {
            transport: f.string("transport").unwrap_or_else(|_| "tcp".into()),
            ttl_ms: f.number("ttl-ms", Some(60_000))?,
            pool_mb: f.number("pool-mb", Some(256))?,
        })
    }

    /// The transport (and, for `nixl-ucx`, the concrete one for its counters).
    fn make(
        &self,
        addr: String,
    ) -> Result<(std::sync::Arc<dyn KvTransport>, Option<NixlUcxTransport>), String> {
        let cfg = TransportConfig {
            tcp_ttl: Duration::from_millis(self.ttl_ms),
            ucx_pool_mb: self.pool_mb,
            tcp_secret: std::env::var("AIRM_KV_TCP_SECRET")
                .ok()
                .map(|s| relay::Secret::parse(&s).map_err(|e| e.to_string()))
                .transpose()?,
            ..TransportConfig::default()
        };
        match self.transport.as_str() {
            "tcp" => Ok((
                std::sync::Arc::new(TcpTransport::connect_to(addr, &cfg)),
                None,
            )),
            "nixl-ucx" => {
                let n = NixlUcxTransport::with_relay(addr, &cfg).map_err(|e| e.to_string())?;
                Ok((std::sync::Arc::new(n.clone()), Some(n)))
            }
            other => Err(format!("unknown transport `{other}`")),
        }
    }
}

/// The `--name value` flags after the subcommand.
struct Flags(HashMap<String, String>);

impl Flags {
    fn parse(args: &[String], known: &[&str]) -> Result<Flags, String> {
        let mut out = HashMap::new();
        let mut it = args.iter();
        while let Some(arg) = it.next() {
            let Some(flag) = arg.strip_prefix("--") else {
                return Err(format!("unexpected argument `{arg}`"));
            };
            let (name, value) = match flag.split_once('=') {
                Some((n, v)) => (n.to_string(), v.to_string()),
                None => {
                    let v = it.next().ok_or_else(|| format!("--{flag} needs a value"))?;
                    (flag.to_string(), v.clone())
                }
            };
            if !known.contains(&name.as_str()) {
                return Err(format!("unknown flag --{name}"));
            }
            if out.insert(name.clone(), value).is_some() {
                return Err(format!("--{name} given twice"));
            }
        }
        Ok(Flags(out))
    }

    fn string(&self, name: &str) -> Result<String, String> {
        self.0
            .get(name)
            .cloned()
            .ok_or_else(|| format!("--{name} is required"))
    }

    fn number<T: FromStr>(&self, name: &str, default: Option<T>) -> Result<T, String> {
        match (self.0.get(name), default) {
            (Some(v), _) => v
                .parse()
                .map_err(|_| format!("--{name}: `{v}` is not a valid number")),
            (None, Some(d)) => Ok(d),
            (None, None) => Err(format!("--{name} is required")),
        }
    }
}

fn parse(args: &[String]) -> Result<Cmd, String> {
    let (cmd, rest) = args.split_first().ok_or("a subcommand is required")?;
    match cmd.as_str() {
        "relay" => {
            let f = Flags::parse(rest, &["listen"])?;
            Ok(Cmd::Relay {
                listen: f.string("listen").unwrap_or_else(|_| "0.0.0.0:0".into()),
            })
        }
        "push" => {
            let f = Flags::parse(
                rest,
                &[
                    "addr",
                    "id",
                    "seed",
                    "blobs",
                    "blob-len",
                    "transport",
                    "ttl-ms",
                    "pool-mb",
                ],
            )?;
            Ok(Cmd::Push {
                addr: f.string("addr")?,
                id: f.string("id")?,
                seed: f.number("seed", None)?,
                blobs: f.number("blobs", Some(64))?,
                blob_len: f.number("blob-len", Some(1 << 20))?,
                opts: Opts::parse(&f)?,
            })
        }
        "pull" => {
            let f = Flags::parse(
                rest,
                &[
                    "addr",
                    "handle",
                    "seed",
                    "timeout-ms",
                    "transport",
                    "pool-mb",
                ],
            )?;
            Ok(Cmd::Pull {
                addr: f.string("addr")?,
                handle: f.string("handle")?,
                seed: f.number("seed", None)?,
                timeout_ms: f.number("timeout-ms", Some(30_000))?,
                opts: Opts::parse(&f)?,
            })
        }
        other => Err(format!("unknown subcommand `{other}`")),
    }
}

#[tokio::main]
async fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.iter().any(|a| a == "-h" || a == "--help") {
        println!("{USAGE}");
        return ExitCode::SUCCESS;
    }
    let cmd = match parse(&args) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("rngd-kv-peer: {e}\n\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    match run(cmd).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("rngd-kv-peer: {e}");
            ExitCode::FAILURE
        }
    }
}

async fn run(cmd: Cmd) -> Result<(), String> {
    match cmd {
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
            opts,
        } => {
            let (t, nixl) = opts.make(addr)?;
            let handle = t
                .push(conformance::payload(&id, seed, blobs, blob_len))
                .await
                .map_err(|e| e.to_string())?;
            println!(
                "{}",
                serde_json::to_string(&handle).map_err(|e| e.to_string())?
            );
            if opts.transport == "nixl-ucx" {
                use std::io::Write;
                let _ = std::io::stdout().flush();
                let mut sink = Vec::new();
                let _ = tokio::io::stdin().read_to_end(&mut sink).await;
                // The READ's notification is handled by the transport's
                // housekeeping thread: give it up to 100 ms (on a loaded
                // machine it may not have run yet), well under the tests'
                // slot TTL, so a slot the READ did not free still shows.
                let slots = match &nixl {
                    None => 0,
                    Some(n) => {
                        let deadline = std::time::Instant::now() + Duration::from_millis(100);
                        while n.slots() > 0 && std::time::Instant::now() < deadline {
                            tokio::time::sleep(Duration::from_millis(2)).await;
                        }
                        n.slots()
                    }
                };
                println!("slots {slots}");
            }
            Ok(())
        }
        Cmd::Pull {
            addr,
            handle,
            seed,
            timeout_ms,
            opts,
        } => {
            let handle: KvHandle =
                serde_json::from_str(&handle).map_err(|e| format!("bad handle JSON: {e}"))?;
            let (t, _) = opts.make(addr)?;
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
