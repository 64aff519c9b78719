//! `rngd-pd-bench tokenize`: the token ids the engine's tokenizer gives texts
//! ([`rngd_engine::tokenizer::Tokenizer::encode`], the serving path's
//! encoding: special tokens in the text parsed, BOS as the model says),
//! printed as one JSON line for the tokenizer fidelity test
//! (`tests/python/test_tokenizer_fidelity.py`). A probe, not a benchmark: it
//! reads only the GGUF metadata and times nothing.

use std::fmt::Write as _;
use std::path::PathBuf;

use anyhow::Context;
use rngd_engine::tokenizer::Tokenizer;

/// Flags of `rngd-pd-bench tokenize`.
#[derive(Debug, Clone, clap::Args)]
pub struct Args {
    /// GGUF model (default: `$RNGD_PD_MODEL`, else the cached default model).
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// A text to tokenize; repeat the flag for more (ids are listed in order).
    #[arg(long = "text", required = true, allow_hyphen_values = true)]
    pub texts: Vec<String>,
}

/// Prints `{"pre": NAME, "add_bos": BOOL, "ids": [[…], …]}`.
pub fn run(a: Args) -> anyhow::Result<()> {
    let path = rngd_engine::model_fetch::resolve(a.model.as_deref())?;
    let t = Tokenizer::from_gguf(&path)
        .with_context(|| format!("building the tokenizer of {}", path.display()))?;
    let mut out = format!(
        "{{\"pre\":\"{}\",\"add_bos\":{},\"ids\":[",
        t.pre_tokenizer().name(),
        t.adds_bos()
    );
    for (i, text) in a.texts.iter().enumerate() {
        let ids = t.encode(text)?;
        out.push_str(if i == 0 { "[" } else { ",[" });
        for (j, id) in ids.iter().enumerate() {
            if j > 0 {
                out.push(',');
            }
            write!(out, "{id}")?;
        }
        out.push(']');
    }
    out.push_str("]}");
    println!("{out}");
    Ok(())
}
