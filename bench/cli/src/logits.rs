//! `rngd-pd-bench logits`: the CPU engine's raw logits at every position of
//! given token ids, through the prefill or the decode path
//! ([`rngd_engine::logits::LogitsProbe`]), written as a `.npy` file for the
//! numerics test (`tests/python/test_numerics.py`). A measurement probe, not
//! a benchmark: it times nothing.

use std::io::Write;
use std::path::PathBuf;

use anyhow::Context;
use rngd_engine::cpu::PrefillProjections;
use rngd_engine::logits::LogitsProbe;

/// Flags of `rngd-pd-bench logits`.
#[derive(Debug, Clone, clap::Args)]
pub struct Args {
    /// GGUF model (default: `$RNGD_PD_MODEL`, else the cached default model).
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Token ids of one sequence, comma-separated; repeat the flag for more
    /// sequences (their rows follow each other in the output, in order).
    #[arg(long, required = true)]
    pub ids: Vec<String>,
    /// Decode path: prefill the first K ids, then decode the rest one step
    /// at a time; rows are positions K-1..n of each sequence. Without it,
    /// the prefill path: row i is a prefill of ids[..=i], positions 0..n.
    #[arg(long = "prefill-len")]
    pub prefill_len: Option<usize>,
    /// Compiled context length S (the cache's stride; at least the longest sequence).
    #[arg(long = "seq-len", default_value_t = 512)]
    pub seq_len: usize,
    /// Threads of the decode matmuls (default: candle's count).
    #[arg(long)]
    pub threads: Option<usize>,
    /// Kernel of the prefills' projections: auto, f32 or int8 (as the
    /// worker's flag of the same name).
    #[arg(long = "prefill-projections", default_value_t)]
    pub prefill_projections: PrefillProjections,
    /// Output: a `.npy` file, little-endian f32, shape `[rows, vocab]`.
    #[arg(long)]
    pub out: PathBuf,
}

/// The `--ids` occurrences (one comma list each) as sequences of ids.
fn sequences(raw: &[String]) -> anyhow::Result<Vec<Vec<u32>>> {
    raw.iter()
        .map(|s| {
            s.split(',')
                .map(|t| {
                    t.trim()
                        .parse::<u32>()
                        .with_context(|| format!("token id `{t}` in --ids"))
                })
                .collect()
        })
        .collect()
}

/// The `.npy` (version 1.0) header of a little-endian f32 array `[rows, cols]`.
fn npy_header(rows: usize, cols: usize) -> Vec<u8> {
    let dict = format!("{{'descr': '<f4', 'fortran_order': False, 'shape': ({rows}, {cols}), }}");
    // Magic (6) + version (2) + length (2) + dict + padding + '\n', a multiple of 64.
    let unpadded = 10 + dict.len() + 1;
    let len = dict.len() + unpadded.next_multiple_of(64) - unpadded + 1;
    let mut h = b"\x93NUMPY\x01\x00".to_vec();
    h.extend_from_slice(&(len as u16).to_le_bytes());
    h.extend_from_slice(dict.as_bytes());
    h.resize(10 + len - 1, b' ');
    h.push(b'\n');
    h
}

/// Loads the model, computes the rows and writes them.
pub fn run(a: Args) -> anyhow::Result<()> {
    let seqs = sequences(&a.ids)?;
    let path = rngd_engine::model_fetch::resolve(a.model.as_deref())?;
    let probe = LogitsProbe::load(&path, a.seq_len, a.threads, a.prefill_projections)?;
    let mut data = Vec::new();
    for ids in &seqs {
        data.extend(match a.prefill_len {
            Some(k) => probe.decode_logits(ids, k)?,
            None => probe.prefill_logits(ids)?,
        });
    }
    let vocab = probe.vocab();
    let mut out = std::io::BufWriter::new(
        std::fs::File::create(&a.out).with_context(|| format!("creating {}", a.out.display()))?,
    );
    out.write_all(&npy_header(data.len() / vocab, vocab))?;
    for x in &data {
        out.write_all(&x.to_le_bytes())?;
    }
    out.flush()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_is_aligned_and_names_the_shape() {
        let h = npy_header(3, 49152);
        assert_eq!(h.len() % 64, 0);
        assert_eq!(&h[..8], b"\x93NUMPY\x01\x00");
        assert_eq!(u16::from_le_bytes([h[8], h[9]]) as usize, h.len() - 10);
        assert_eq!(*h.last().expect("non-empty"), b'\n');
        let text = String::from_utf8_lossy(&h[10..]);
        assert!(text.contains("'shape': (3, 49152)"), "{text}");
    }

    #[test]
    fn ids_parse_per_occurrence() {
        let s = sequences(&["1,2,3".into(), "4".into()]).expect("parses");
        assert_eq!(s, vec![vec![1, 2, 3], vec![4]]);
        assert!(sequences(&["1,x".into()]).is_err());
    }
}
