//! Ultra-low-memory globals: streamed embedding rows and lm_head chunks give the resident
//! bits exactly, at any chunk size.

mod stream_support;

use k3_engine::stream::global::{GlobalOptions, StreamedGlobal};
use k3_engine::weights::GlobalSource;
use k3_kernels::matvec::matvec_bf16;
use k3_kernels::par::Pool;
use k3_models::spec::TensorRole;
use stream_support::*;

fn bf16_bits(b: &[u8]) -> Vec<u16> {
    b.chunks_exact(2)
        .map(|c| u16::from_le_bytes([c[0], c[1]]))
        .collect()
}

#[test]
fn streamed_globals_match_resident_bits_at_any_chunk_size() {
    let (_, spec, ck) = tiny_opened("global_ultra", 31);
    let lm = spec
        .tensor(TensorRole::LmHead, None, None)
        .expect("lm_head");
    let emb = spec.tensor(TensorRole::Embed, None, None).expect("embed");
    let lm_bits = bf16_bits(ck.try_bytes(&lm.name).expect("lm bytes"));
    let emb_bits = bf16_bits(ck.try_bytes(&emb.name).expect("embed bytes"));
    let d = spec.d_model;
    let x: Vec<f32> = (0..d)
        .map(|i| ((i * 37 % 101) as f32 - 50.0) / 17.0)
        .collect();
    let pool = Pool::new(2);
    let mut want = vec![0f32; spec.vocab_size];
    matvec_bf16(&pool, &lm_bits, &x, &mut want);

    let row_bytes = d * 2;
    for chunk_rows in [1usize, 7, 100, spec.vocab_size, 10 * spec.vocab_size] {
        let mut g = StreamedGlobal::new(
            &spec,
            &ck,
            &GlobalOptions {
                chunk_bytes: chunk_rows * row_bytes,
                o_direct: true,
                read_threads: 3,
            },
        )
        .expect("streamed global");
        assert_eq!(g.chunk_rows(), chunk_rows.min(spec.vocab_size));
        let mut got = vec![f32::NAN; spec.vocab_size];
        g.lm_head(&pool, &x, &mut got).expect("lm_head");
        for (i, (a, b)) in got.iter().zip(&want).enumerate() {
            assert_eq!(
                a.to_bits(),
                b.to_bits(),
                "row {i} with chunks of {chunk_rows}"
            );
        }
        for tok in [0u32, 1, 77, (spec.vocab_size - 1) as u32] {
            let mut row = vec![0f32; d];
            g.embed_row(tok, &mut row).expect("embed row");
            for (j, v) in row.iter().enumerate() {
                let w = emb_bits[tok as usize * d + j];
                assert_eq!(v.to_bits(), (w as u32) << 16, "token {tok} col {j}");
            }
        }
        // several inputs through one read of each chunk (a verify pass, a batch step): each
        // input's logits are the one-input bits, x among them
        let xs: Vec<Vec<f32>> = (0..5)
            .map(|t| {
                if t == 3 {
                    x.clone()
                } else {
                    x.iter().map(|v| v * (t as f32 - 1.5)).collect()
                }
            })
            .collect();
        let xr: Vec<&[f32]> = xs.iter().map(|v| v.as_slice()).collect();
        let mut outs = vec![vec![f32::NAN; spec.vocab_size]; 5];
        let mut or: Vec<&mut [f32]> = outs.iter_mut().map(|o| o.as_mut_slice()).collect();
        let before = g.io().0;
        g.lm_head(&pool, &x, &mut got).expect("lm_head");
        let one_pass = g.io().0 - before;
        g.lm_head_many(&pool, &xr, &mut or).expect("lm_head_many");
        assert_eq!(
            g.io().0 - before - one_pass,
            one_pass,
            "the matrix is read once for all inputs (chunks of {chunk_rows})"
        );
        for (t, (o, xt)) in outs.iter().zip(&xs).enumerate() {
            let mut one = vec![0f32; spec.vocab_size];
            matvec_bf16(&pool, &lm_bits, xt, &mut one);
            let same = o.iter().zip(&one).all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "input {t} with chunks of {chunk_rows}");
        }
        assert!(
            outs[3]
                .iter()
                .zip(&want)
                .all(|(a, b)| a.to_bits() == b.to_bits())
        );
        let mut short = vec![0f32; spec.vocab_size - 1];
        assert!(g.lm_head_many(&pool, &[&x], &mut [&mut short]).is_err());
        let mut row = vec![0f32; d];
        assert!(g.embed_row(spec.vocab_size as u32, &mut row).is_err());
        let fin = g.small(TensorRole::FinalNorm).expect("final norm");
        assert!(fin.bytes == ck.try_bytes(&fin.decl.name).expect("bytes"));
        let (bytes, _) = g.io();
        assert!(bytes >= (spec.vocab_size * row_bytes) as u64);
    }
}
