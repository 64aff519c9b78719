//! `rngd-pd kv …`: KV-transport chores on a node. `shm-root DIR` prepares
//! the node directory the `shm` transport shares between the pods of a node
//! (the chart's worker init container runs it): created if missing, mode
//! 1777 (world-writable, sticky: every worker uid can create its caches, none
//! can remove another's), refused if it is a symlink or not a directory.
//! `doctor` prints, for every transport, what this host would use: the shm
//! root and its mode, the relay address and whether it answers (with the
//! secret), and the NIXL runtime `nixl-ucx` would load (library, plugins,
//! bundled UCX and its version, UCX_TLS/UCX_NET_DEVICES, an agent started
//! with the UCX backend and its parameters). It fails when the default
//! transport (`AIRM_KV_TRANSPORT`) is not usable.

use std::path::PathBuf;

use anyhow::Context;

/// KV subcommands.
#[derive(Debug, clap::Subcommand)]
pub enum Command {
    /// Create (or fix the mode of) the node directory of the shm transport.
    ShmRoot {
        /// The directory (the chart's `kvTransport.shmHostPath`).
        dir: PathBuf,
    },
    /// Print what each KV transport would use on this host; fail if the
    /// default one (`AIRM_KV_TRANSPORT`) is not usable.
    Doctor,
}

/// Runs the subcommand.
pub async fn run(cmd: Command) -> anyhow::Result<()> {
    match cmd {
        Command::Doctor => doctor().await,
        Command::ShmRoot { dir } => {
            use std::os::unix::fs::PermissionsExt;
            std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
            let meta = std::fs::symlink_metadata(&dir)
                .with_context(|| format!("reading {}", dir.display()))?;
            anyhow::ensure!(
                meta.file_type().is_dir(),
                "{} is not a directory (a symlink or a file): refusing to use it as the shm root",
                dir.display()
            );
            std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o1777))
                .with_context(|| format!("setting the mode of {}", dir.display()))?;
            println!("{} ready (mode 1777)", dir.display());
            Ok(())
        }
    }
}

/// `rngd-pd kv doctor`.
async fn doctor() -> anyhow::Result<()> {
    use rngd_kv_transport::nixl::{agent::Agent, arena::Arena, runtime};
    let cfg =
        rngd_kv_transport::TransportConfig::from_env().context("KV transport configuration")?;
    let default = rngd_api::env::var(rngd_api::env::AIRM_KV_TRANSPORT)
        .unwrap_or_else(|| rngd_kv_transport::registry::DEFAULT.to_string());
    println!(
        "default transport: {default}; this build has {}",
        rngd_kv_transport::registry::KNOWN.join(", ")
    );
    let mut ok = std::collections::HashMap::new();

    // shm
    let root = &cfg.shm_root;
    let shm = match std::fs::symlink_metadata(root) {
        Ok(m) if m.file_type().is_dir() => {
            use std::os::unix::fs::{MetadataExt, PermissionsExt};
            println!(
                "shm: root {} (mode {:o}, owner uid {}), ttl {:?}",
                root.display(),
                m.permissions().mode() & 0o7777,
                m.uid(),
                cfg.shm_ttl
            );
            true
        }
        Ok(_) => {
            println!("shm: root {} is not a directory (refused)", root.display());
            false
        }
        Err(e) => {
            println!(
                "shm: root {} missing ({e}); `rngd-pd kv shm-root` creates it",
                root.display()
            );
            false
        }
    };
    ok.insert("shm", shm);

    // tcp (and the descriptors of nixl-ucx)
    let relay = match &cfg.tcp_addr {
        None => {
            println!("tcp: AIRM_KV_TCP_ADDR unset (no relay)");
            false
        }
        Some(addr) => {
            let t = rngd_kv_transport::tcp::TcpTransport::connect_to(addr.clone(), &cfg);
            match t.stats().await {
                Ok(s) => {
                    println!(
                        "tcp: relay {addr} answers (secret {}): {} keys, {} bytes held",
                        if cfg.tcp_secret.is_some() {
                            "set"
                        } else {
                            "none"
                        },
                        s.keys,
                        s.bytes
                    );
                    true
                }
                Err(e) => {
                    println!("tcp: relay {addr} does not answer: {e}");
                    false
                }
            }
        }
    };
    ok.insert("tcp", relay);

    // nixl-ucx
    let nixl = match runtime::locate(&cfg) {
        Err(e) => {
            println!("nixl-ucx: {e}");
            false
        }
        Ok(rt) => {
            println!(
                "nixl-ucx: runtime {} (found by {})",
                rt.capi.display(),
                rt.found_by
            );
            println!(
                "nixl-ucx: plugin dir {}: {}",
                rt.plugin_dir.display(),
                rt.plugins().join(", ")
            );
            match rt.bundled_ucp() {
                Some(ucp) => println!(
                    "nixl-ucx: UCX {} ({})",
                    runtime::ucx_version(&ucp).unwrap_or_else(|| "version unknown".into()),
                    ucp.display()
                ),
                None => println!("nixl-ucx: no bundled UCX; the system's libucp is used"),
            }
            for var in ["UCX_TLS", "UCX_NET_DEVICES"] {
                println!(
                    "nixl-ucx: {var}={}",
                    std::env::var(var).unwrap_or_else(|_| "(unset: UCX's choice)".into())
                );
            }
            println!(
                "nixl-ucx: arena {} MiB (AIRM_KV_UCX_POOL_MB)",
                cfg.ucx_pool_mb
            );
            let started = runtime::load(&cfg).and_then(|_| {
                let arena =
                    Arena::new(1 << 20).map_err(|source| rngd_kv_transport::KvError::Io {
                        transport: "nixl-ucx",
                        context: "mapping a test arena".into(),
                        source,
                    })?;
                Agent::new("rngd-kv-doctor", arena).map_err(|e| rngd_kv_transport::KvError::Io {
                    transport: "nixl-ucx",
                    context: "starting a NIXL agent with the UCX backend".into(),
                    source: std::io::Error::other(e),
                })
            });
            match started {
                Ok(agent) => {
                    println!(
                        "nixl-ucx: agent up; NIXL plugins: {}",
                        agent.plugins().join(", ")
                    );
                    for (k, v) in agent.ucx_params() {
                        println!("nixl-ucx: UCX backend {k}={v}");
                    }
                    println!("nixl-ucx: metadata {} bytes", agent.metadata.len());
                    relay
                }
                Err(e) => {
                    println!("nixl-ucx: {e}");
                    false
                }
            }
        }
    };
    ok.insert("nixl-ucx", nixl);

    // nixl (HETERO_NPU): known, never usable in this build.
    if let Err(e) = rngd_kv_transport::registry::check_name(rngd_kv_transport::nixl_route::NAME) {
        println!("{e}");
    }
    ok.insert(rngd_kv_transport::nixl_route::NAME, false);
    anyhow::ensure!(
        ok.get(default.as_str()).copied().unwrap_or(false),
        "the default transport `{default}` is not usable here (see above)"
    );
    println!("ok: `{default}` is usable");
    Ok(())
}
