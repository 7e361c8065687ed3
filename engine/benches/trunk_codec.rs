//! `cargo bench -p k3-engine --bench trunk_codec`: how fast a compressed trunk's records decode in
//! place (`pack-trunk --compress`, `engine/src/stream/compress.rs`), per kernel ISA path.
//!
//! A plain `harness = false` main. The input is the first 256 MiB of `K3_BENCH_TRUNK` (a raw
//! packed `trunk.bin`, e.g. k3-mini's) or, without it, 256 MiB of bf16 values drawn from a
//! normal distribution (sigma 0.02, like trained weights). It is cut into `CHUNK_BYTES` chunks and
//! encoded once. Then, for every ISA path this CPU has (`k3_kernels::isa::set_active`, as
//! `K3_ISA` does in the engine), the median of `K3_BENCH_REPS` (default 7) repetitions of:
//!
//! * ring: every record copied into its own chunk buffer (untimed), then all decoded in place
//!   (timed): 256 MiB far from the caches, as the reader threads meet records fresh from disk;
//! * in cache: one record copied into one buffer and decoded, 64 times, minus the copies alone
//!   (a 512 KiB chunk: in L2 on the machines here).
//!
//! Figures are GB/s of decoded (raw) bytes on one thread; every decoded chunk is checked
//! against the input, so a path that writes other bytes stops the bench.

use std::io::Read;
use std::time::Instant;

use k3_engine::stream::compress::{CHUNK_BYTES, Encoder, StoredChunk, decode_in_place};
use k3_kernels::isa;

const INPUT: usize = 256 << 20;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// bf16 of N(0, 0.02^2) draws (Box-Muller on a xorshift), round to nearest even.
fn normal_bf16(n_bytes: usize) -> Vec<u8> {
    let mut s = 0x9E37_79B9_7F4A_7C15u64;
    let mut uniform = move || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        ((s >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    };
    let mut out = Vec::with_capacity(n_bytes);
    while out.len() < n_bytes {
        let (u, v) = (uniform(), uniform());
        let x = 0.02 * (-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos();
        let b = (x as f32).to_bits();
        let h = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) as u16;
        out.extend_from_slice(&h.to_le_bytes());
    }
    out
}

fn input() -> (String, Vec<u8>) {
    match std::env::var("K3_BENCH_TRUNK") {
        Ok(path) if !path.is_empty() => {
            let mut raw = vec![0u8; INPUT];
            let mut f =
                std::fs::File::open(&path).unwrap_or_else(|e| panic!("K3_BENCH_TRUNK {path}: {e}"));
            let n = f
                .read(&mut raw)
                .unwrap_or_else(|e| panic!("K3_BENCH_TRUNK {path}: {e}"));
            let mut got = n;
            while got < INPUT {
                let k = f.read(&mut raw[got..]).unwrap_or(0);
                if k == 0 {
                    break;
                }
                got += k;
            }
            raw.truncate(got - got % CHUNK_BYTES as usize);
            assert!(
                !raw.is_empty(),
                "K3_BENCH_TRUNK {path}: shorter than one chunk"
            );
            (format!("{path} (first {} MiB)", raw.len() >> 20), raw)
        }
        _ => ("normal bf16, sigma 0.02".to_string(), normal_bf16(INPUT)),
    }
}

fn main() {
    let reps: usize = std::env::var("K3_BENCH_REPS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(7)
        .max(1);
    let (what, raw) = input();
    let n = CHUNK_BYTES as usize;
    let mut enc = Encoder::new();
    let records: Vec<(Vec<u8>, StoredChunk)> = raw
        .chunks(n)
        .map(|ch| {
            let mut r = Vec::new();
            let z = enc.encode(ch, &mut r);
            let c = StoredChunk {
                at: 0,
                len: r.len() as u64,
                z,
            };
            (r, c)
        })
        .collect();
    let stored: usize = records.iter().map(|(r, _)| r.len()).sum();
    println!(
        "input: {what}; {} chunks of {} KiB, {} coded, records {:.1}% of the bytes; {reps} reps",
        records.len(),
        n >> 10,
        records.iter().filter(|(_, c)| c.z).count(),
        100.0 * stored as f64 / raw.len() as f64
    );
    println!("| path | ring GB/s | in cache GB/s |");
    println!("|---|---|---|");
    let mut bufs: Vec<Vec<u8>> = records.iter().map(|_| vec![0u8; n]).collect();
    let probe = records.len() / 2;
    for path in isa::available() {
        isa::set_active(path).expect("an available path");
        let mut ring = Vec::with_capacity(reps);
        let mut cached = Vec::with_capacity(reps);
        for _ in 0..reps {
            for (b, (r, _)) in bufs.iter_mut().zip(&records) {
                b[..r.len()].copy_from_slice(r);
            }
            let t = Instant::now();
            for (b, (_, c)) in bufs.iter_mut().zip(&records) {
                decode_in_place(b, n, c).expect("a record the encoder wrote");
            }
            ring.push(raw.len() as f64 / t.elapsed().as_secs_f64() / 1e9);
            for (b, ch) in bufs.iter().zip(raw.chunks(n)) {
                assert!(b[..ch.len()] == *ch, "{} decoded other bytes", path.name());
            }

            let (r, c) = &records[probe];
            let t = Instant::now();
            for _ in 0..64 {
                bufs[0][..r.len()].copy_from_slice(r);
                decode_in_place(&mut bufs[0], n, c).expect("a record the encoder wrote");
            }
            let both = t.elapsed().as_secs_f64();
            let t = Instant::now();
            for _ in 0..64 {
                bufs[0][..r.len()].copy_from_slice(std::hint::black_box(r));
            }
            let copies = t.elapsed().as_secs_f64();
            cached.push(64.0 * n as f64 / (both - copies).max(1e-9) / 1e9);
        }
        println!(
            "| {} | {:.2} | {:.2} |",
            path.name(),
            median(ring),
            median(cached)
        );
    }
}
