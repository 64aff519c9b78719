//! Fetches the default model into a cache directory (what `rngd-pd model fetch` does):
//! `cargo run --release -p rngd-engine --example fetch -- /path/to/cache`.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = std::env::args()
        .nth(1)
        .map(std::path::PathBuf::from)
        .unwrap_or_else(rngd_engine::model_fetch::default_cache_dir);
    let path = rngd_engine::model_fetch::fetch(&dir)?;
    println!("{}", path.display());
    Ok(())
}
