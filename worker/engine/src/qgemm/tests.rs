//! Unit tests of the quantized matmul: quantization round trips, Q4_1 blocks
//! kept exactly, every path against a dequantized f64 reference and against
//! each other bit for bit, and a timing harness (ignored).

use super::*;

/// Deterministic pseudo-random values in [-1, 1).
fn random(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

/// Pseudo-random weights made of Q4_1 blocks as GGUF dequantizes them:
/// `(q as f32) · d + m`, `d` and `m` f16-like (11 significant bits). A
/// block may straddle two columns when `k` is not a multiple of 32.
fn q4_1_values(n: usize, seed: u64) -> Vec<f32> {
    let r = random(n + 2 * n.div_ceil(BLOCK), seed);
    let f16ish = |v: f32| f32::from_bits(v.to_bits() & !0x1FFF);
    let mut out = Vec::with_capacity(n);
    for (b, block) in r[..n].chunks(BLOCK).enumerate() {
        let d = f16ish(0.01 + 0.02 * r[n + 2 * b].abs());
        let m = f16ish(-8.0 * d * (1.0 + 0.1 * r[n + 2 * b + 1]));
        // Each block has its minimum (q = 0) and maximum (q = 15), as the
        // Q4_1 rule (d = (max - min) / 15, m = min) gives.
        out.extend(block.iter().enumerate().map(|(i, v)| {
            let q = match i {
                0 => 0.0,
                1 => 15.0,
                _ => ((v + 1.0) * 7.99).floor(),
            };
            q * d + m
        }));
    }
    out
}

/// Column `c` of the weights as the kernel sees them: `(q · d, m)` per
/// value in order (padded to whole blocks).
fn weight_column(w: &QWeights, c: usize) -> Vec<(f64, f64)> {
    let (p, cc) = (c / PANEL, c % PANEL);
    let mut out = Vec::new();
    for b in 0..w.blocks {
        let pb = &w.panels[p * w.blocks + b];
        let m = w.mins.get(p * w.blocks + b).map_or(0.0, |m| m.0[cc]);
        for i in 0..BLOCK {
            let q = (pb.q[i / 4][4 * cc + i % 4] ^ 0x80) as i8;
            out.push((f64::from(q) * f64::from(pb.d[cc]), f64::from(m)));
        }
    }
    out
}

/// The exact value the kernel approximates: dequantized weights and
/// activations, f64 dot products; the offsets' term with the quantized sums.
fn reference(w: &QWeights, x: &[f32], rows: usize) -> Vec<f64> {
    let acts = QActs::quantize(x, rows, w.k, !w.mins.is_empty());
    let mut out = vec![0f64; rows * w.n];
    for r in 0..rows {
        let mut ad = Vec::new();
        for b in 0..acts.blocks {
            let i = b * rows + r;
            assert_eq!(
                acts.corr[i],
                -128 * acts.quants[i].iter().map(|v| i32::from(*v)).sum::<i32>()
            );
            ad.extend(
                acts.quants[i]
                    .iter()
                    .map(|q| f64::from(*q) * f64::from(acts.scales[i])),
            );
        }
        for c in 0..w.n {
            let wd = weight_column(w, c);
            let mut v: f64 = wd.iter().zip(&ad).map(|((a, _), b)| a * b).sum();
            if !w.mins.is_empty() {
                for b in 0..acts.blocks {
                    v += wd[b * BLOCK].1 * f64::from(acts.sums[b * rows + r]);
                }
            }
            out[r * w.n + c] = v;
        }
    }
    out
}

#[test]
fn quantized_values_round_trip_within_half_a_step() {
    let (n, k) = (21, 100);
    let wf = random(n * k, 7);
    let w = QWeights::quantize(&wf, n, k).unwrap();
    assert_eq!((w.blocks, w.panel_count()), (4, 2));
    assert!(w.mins.is_empty(), "random weights are not Q4_1 blocks");
    for c in 0..n {
        let col: Vec<f64> = weight_column(&w, c).iter().map(|v| v.0).collect();
        // Padding past k is zero.
        assert!(col[k..].iter().all(|v| *v == 0.0));
        let d = w.panels[(c / PANEL) * w.blocks].d[c % PANEL];
        for (i, v) in col[..k].iter().enumerate() {
            let exact = f64::from(wf[c * k + i]);
            let step = f64::from(w.panels[(c / PANEL) * w.blocks + i / BLOCK].d[c % PANEL]);
            assert!((v - exact).abs() <= 0.5 * step + 1e-7, "c={c} i={i}");
        }
        assert!(d > 0.0);
    }
    // Columns past n in the last panel are zero weights.
    for c in n..2 * PANEL {
        assert!(weight_column(&w, c).iter().all(|v| v.0 == 0.0));
    }
}

/// Q4_1 blocks are kept exactly: `q · d + m` gives back every value bit
/// for bit; a block off the 16-level grid falls back to the Q8_0 rule.
#[test]
fn q4_1_blocks_are_kept_exactly() {
    let (n, k) = (19, 96);
    let mut wf = q4_1_values(n * k, 11);
    // Column 3's second block: one value off the grid.
    wf[3 * k + 40] += 1e-4;
    let w = QWeights::quantize(&wf, n, k).unwrap();
    assert!(!w.mins.is_empty());
    for c in 0..n {
        let col = weight_column(&w, c);
        for (i, (qd, m)) in col[..k].iter().enumerate() {
            let exact = f64::from(wf[c * k + i]);
            if c == 3 && i / BLOCK == 1 {
                assert_eq!(*m, 0.0);
                let step = f64::from(w.panels[i / BLOCK].d[3]);
                assert!((qd - exact).abs() <= 0.5 * step + 1e-7);
            } else {
                let d = f64::from(w.panels[(c / PANEL) * w.blocks + i / BLOCK].d[c % PANEL]);
                let q = (qd / d).round();
                assert!((0.0..=15.0).contains(&q), "c={c} i={i}: q {q}");
                let (d, m) = (d as f32, *m as f32);
                assert_eq!(q as f32 * d + m, wf[c * k + i], "c={c} i={i}");
            }
        }
    }
    // The detection itself is bit-exact: q · d + m gives every value.
    let mut q = [0i8; BLOCK];
    for block in wf.chunks_exact(BLOCK).take(20) {
        let x: &[f32; BLOCK] = block.try_into().unwrap();
        if let Some((d, m)) = offset_block(x, &mut q) {
            assert!(x.iter().zip(&q).all(|(v, q)| f32::from(*q) * d + m == *v));
        }
    }
    // A constant block is exact too (d = 0).
    assert_eq!(offset_block(&[0.375; BLOCK], &mut q), Some((0.0, 0.375)));
}

#[test]
fn matches_the_dequantized_f64_reference_and_the_f32_product() {
    let pool = Pool::new(2).unwrap();
    for (k, n, rows) in [
        (64, 37, 3),
        (576, 70, 9),
        (1536, 33, 8),
        (100, 19, 2),
        (448, 21, 5),
    ] {
        for wf in [random(n * k, k as u64), q4_1_values(n * k, k as u64)] {
            let x = random(rows * k, n as u64 + 1);
            let w = QWeights::quantize(&wf, n, k).unwrap();
            let want = reference(&w, &x, rows);
            for isa in Isa::available() {
                let got = w.matmul_with(isa, &x, rows, &pool);
                for (i, (g, e)) in got.iter().zip(&want).enumerate() {
                    assert!(
                        (f64::from(*g) - e).abs() <= 1e-4 * (1.0 + e.abs()),
                        "{isa:?} k={k} n={n} [{i}]: {g} vs {e}"
                    );
                }
                // And close to the unquantized product (8-bit quantization error).
                for r in 0..rows {
                    for c in 0..n {
                        let exact: f32 = (0..k).map(|i| wf[c * k + i] * x[r * k + i]).sum();
                        let g = got[r * n + c];
                        assert!(
                            (g - exact).abs() < 0.02 * (k as f32).sqrt(),
                            "{g} vs {exact}"
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn every_path_and_batch_size_gives_the_same_bits() {
    let pools = [Pool::new(1).unwrap(), Pool::new(2).unwrap()];
    for (k, n, q4) in [
        (64, 37, false),
        (576, 131, false),
        (1536, 45, false),
        (448, 17, false),
        (100, 300, false),
        (576, 131, true),
        (1536, 45, true),
    ] {
        let wf = if q4 {
            q4_1_values(n * k, 3 * k as u64)
        } else {
            random(n * k, 3 * k as u64)
        };
        let w = QWeights::quantize(&wf, n, k).unwrap();
        assert_eq!(w.mins.is_empty(), !q4);
        let x = random(11 * k, 5);
        let all = w.matmul_with(Isa::Scalar, &x, 11, &pools[0]);
        for isa in Isa::available() {
            for pool in &pools {
                assert_eq!(
                    w.matmul_with(isa, &x, 11, pool),
                    all,
                    "{isa:?} k={k} batch 11"
                );
                for r in [0, 5, 7, 10] {
                    let alone = w.matmul_with(isa, &x[r * k..(r + 1) * k], 1, pool);
                    assert_eq!(alone[..], all[r * n..(r + 1) * n], "{isa:?} k={k} row {r}");
                }
                // Row 3 as the last row of a batch of 4 and the first of a batch of 8.
                let four = w.matmul_with(isa, &x[..4 * k], 4, pool);
                assert_eq!(four[3 * n..], all[3 * n..4 * n]);
                let eight = w.matmul_with(isa, &x[3 * k..11 * k], 8, pool);
                assert_eq!(eight[..n], all[3 * n..4 * n]);
            }
        }
    }
}

#[test]
fn every_path_quantizes_activations_alike() {
    // Ties (x.5 after scaling) round away from zero on every path.
    let mut x = vec![127.0f32, 0.5, 1.5, 2.5, -0.5, -2.5, 126.5, -126.5];
    x.extend(random(3 * 576 - x.len(), 17));
    x.extend([0.0; 32]);
    x.extend(random(8, 3).iter().map(|v| v * 1e-30));
    x.extend(random(24, 4).iter().map(|v| v * 1e30));
    let (rows, k) = (4, 8 * 32 + 3);
    x.resize(rows * k, 0.25);
    let want = QActs::quantize_impl(&x, rows, k, true);
    assert_eq!(&want.quants[0][..8], &[127, 1, 2, 3, -1, -3, 127, -127]);
    let got = QActs::quantize(&x, rows, k, true);
    assert_eq!(got.quants, want.quants);
    assert_eq!(got.scales, want.scales);
    assert_eq!(got.corr, want.corr);
    assert_eq!(got.sums, want.sums);
    assert_eq!(want.sums.len(), rows * want.blocks);
    assert!(QActs::quantize(&x, rows, k, false).sums.is_empty());
}

#[test]
fn panel_chunks_cover_every_panel_once() {
    for n in [1, 15, 16, 64, 577, 3072] {
        for t in [1, 2, 3, 8] {
            let ch = panel_chunks(n, t);
            assert_eq!(ch.first().unwrap().start, 0);
            assert_eq!(ch.last().unwrap().end, n);
            assert!(ch.windows(2).all(|w| w[0].end == w[1].start));
        }
    }
}

/// Kernel timings on this machine:
/// `cargo test --release -p rngd-engine --lib qgemm_speed -- --ignored --nocapture`
#[test]
#[ignore = "timing, not a check"]
fn qgemm_speed() {
    // One SmolLM2-135M decode step's projections (30 layers, each its own
    // weights as in the model, so they stream from memory) and its head.
    let shapes = [(576, 960), (576, 576), (576, 3072), (1536, 576)];
    let layers: Vec<Vec<_>> = (0..30)
        .map(|l| {
            shapes
                .iter()
                .map(|(k, n)| {
                    let w = random(n * k, 1 + l);
                    (*k, QWeights::quantize(&w, *n, *k).unwrap())
                })
                .collect()
        })
        .collect();
    let head = QWeights::quantize(&random(49152 * 576, 2), 49152, 576).unwrap();
    {
        // Cache-resident weights: the kernel's compute rate alone.
        let small = QWeights::quantize(&random(256 * 576, 9), 256, 576).unwrap();
        let pool = Pool::new(1).unwrap();
        for rows in [1, 8] {
            let x = random(rows * 576, 3);
            let t0 = std::time::Instant::now();
            for _ in 0..5000 {
                std::hint::black_box(QActs::quantize(&x, rows, 576, false));
            }
            let ns = t0.elapsed().as_secs_f64() * 1e9 / 5000.0 / (576.0 * rows as f64);
            println!("quantize rows {rows}: {ns:.2} ns per value");
            for _ in 0..2 {
                for isa in Isa::available().into_iter().skip(1) {
                    let t0 = std::time::Instant::now();
                    for _ in 0..5000 {
                        std::hint::black_box(small.matmul_with(isa, &x, rows, &pool));
                    }
                    let ns = t0.elapsed().as_secs_f64() * 1e9 / 5000.0 / (256.0 * rows as f64);
                    println!("cache-resident {isa:?} rows {rows}: {ns:.2} ns per column-row");
                }
            }
        }
    }
    for threads in [1, 2] {
        let pool = Pool::new(threads).unwrap();
        for rows in [1, 2, 4, 8] {
            let xs: Vec<Vec<f32>> = [576, 1536].iter().map(|k| random(rows * k, 3)).collect();
            let x = |k: usize| if k == 576 { &xs[0] } else { &xs[1] };
            let mut best = f64::MAX;
            for _ in 0..5 {
                let t0 = std::time::Instant::now();
                pool.install(|| {
                    for layer in &layers {
                        for (k, w) in layer {
                            std::hint::black_box(w.matmul(x(*k), rows, &pool));
                        }
                    }
                    std::hint::black_box(head.matmul(x(576), rows, &pool));
                });
                best = best.min(t0.elapsed().as_secs_f64() * 1e3);
            }
            println!("threads {threads} rows {rows}: {best:.2} ms per step (best of 5)");
        }
    }
}

#[test]
fn splicing_quantized_rows_equals_quantizing_the_spliced_rows() {
    // Row counts that do not fall on panel edges; Q8_0-rule rows (random)
    // and Q4_1 rows (with offsets) on either side.
    let k = 72;
    for (n, at, m, old_q4, new_q4) in [
        (50, 0, 50, false, false),
        (50, 7, 20, false, true),
        (50, 33, 17, true, false),
        (48, 16, 16, true, true),
        (40, 3, 1, true, false),
    ] {
        let old = if old_q4 {
            q4_1_values(n * k, 3)
        } else {
            random(n * k, 3)
        };
        let part = if new_q4 {
            q4_1_values(m * k, 9)
        } else {
            random(m * k, 9)
        };
        let mut spliced = old.clone();
        spliced[at * k..(at + m) * k].copy_from_slice(&part);
        let fresh = QWeights::quantize(&spliced, n, k).unwrap();
        let patched = QWeights::quantize(&old, n, k)
            .unwrap()
            .splice(at, &QWeights::quantize(&part, m, k).unwrap())
            .unwrap();
        assert!(patched == fresh, "n {n} at {at} m {m}");
        assert_eq!(patched.mins.is_empty(), fresh.mins.is_empty());
    }
    // (`patched == fresh` compares the rows' exactness too.) Inexact rows
    // replaced by exact ones: the whole is exact again.
    let k = 96;
    let mut old = q4_1_values(48 * k, 5);
    old[20 * k + 3] += 1e-4;
    let old = QWeights::quantize(&old, 48, k).unwrap();
    assert!(!old.is_exact());
    let part = QWeights::quantize(&q4_1_values(16 * k, 6), 16, k).unwrap();
    assert!(old.splice(16, &part).unwrap().is_exact());
    assert!(!old.splice(24, &part).unwrap().is_exact());
    let w = QWeights::quantize(&random(4 * k, 1), 4, k).unwrap();
    assert!(
        w.splice(3, &QWeights::quantize(&random(2 * k, 1), 2, k).unwrap())
            .is_err()
    );
    assert!(
        w.splice(0, &QWeights::quantize(&random(32, 1), 1, 32).unwrap())
            .is_err()
    );
}

/// Exactness: Q4_1 blocks and Q8_0 blocks (`q · d`, `d` f16-like, as a
/// GGUF Q8_0 file dequantizes) are exact and dequantize to the very f32
/// weights; one value off their grid, or random f32 weights, are not.
#[test]
fn exact_weights_dequantize_to_themselves() {
    let (n, k) = (19, 96);
    let q4 = q4_1_values(n * k, 21);
    let w = QWeights::quantize(&q4, n, k).unwrap();
    assert!(w.is_exact());
    assert_eq!(w.dequantize(), q4);
    let f16ish = |v: f32| f32::from_bits(v.to_bits() & !0x1FFF);
    let r = random(n * k + n * k / BLOCK, 22);
    let q8: Vec<f32> = (0..n * k)
        .map(|i| {
            let d = f16ish(0.001 + 0.002 * r[n * k + i / BLOCK].abs());
            // Each block reaches ±127 somewhere, as the Q8_0 rule makes it.
            let q = if i % BLOCK == 5 {
                127.0
            } else {
                (r[i] * 127.0).round()
            };
            q * d
        })
        .collect();
    let w = QWeights::quantize(&q8, n, k).unwrap();
    assert!(w.is_exact());
    assert_eq!(w.dequantize(), q8);
    let mut off = q4.clone();
    off[7 * k + 50] += 1e-4;
    assert!(!QWeights::quantize(&off, n, k).unwrap().is_exact());
    assert!(
        !QWeights::quantize(&random(n * k, 23), n, k)
            .unwrap()
            .is_exact()
    );
    // A width that is not a multiple of the block: the padding is exact.
    let q4 = q4_1_values(5 * 40, 24);
    let w = QWeights::quantize(&q4, 5, 40).unwrap();
    assert_eq!(w.is_exact(), w.dequantize() == q4);
}

#[test]
fn bad_shapes_are_refused() {
    assert!(QWeights::quantize(&[0.0; 10], 3, 4).is_err());
    assert!(QWeights::quantize(&[], 3, 0).is_err());
}
