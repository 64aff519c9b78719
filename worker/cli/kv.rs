//! `rngd-pd kv …`: KV-transport chores on a node. `shm-root DIR` prepares
//! the node directory the `shm` transport shares between the pods of a node
//! (the chart's worker init container runs it): created if missing, mode
//! 1777 (world-writable, sticky: every worker uid can create its caches, none
//! can remove another's), refused if it is a symlink or not a directory.

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
}

/// Runs the subcommand.
pub async fn run(cmd: Command) -> anyhow::Result<()> {
    match cmd {
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
