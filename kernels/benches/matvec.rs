//! `cargo bench -p k3-kernels`: matvec throughput at Kimi K3 shapes versus this machine's
//! memory read bandwidth, measured in the same run.
//!
//! A plain `harness = false` main: every figure is the MEDIAN of `K3_BENCH_REPS` (default 15)
//! timed calls after one warm-up. Weight buffers are far larger than the last-level cache
//! (bf16: one 176 MB matrix; MXFP4: a ring of distinct experts totalling > 256 MB, each call
//! uses the next expert, as real MoE decoding does), so the figures are DRAM-bound numbers.
//!
//! Read bandwidth: all cores, and one core, stream-read a 1 GiB buffer (median of the reps);
//! the "of read bw" column divides by the larger of the two. Because a shared
//! machine's bandwidth drifts, every kernel repetition is also PAIRED with a one-thread streaming
//! read of a 256 MiB window of that buffer taken just before it; the "paired" column is the
//! median of the per-repetition ratios kernel / read.
//!
//! Environment: `K3_ISA` forces the path for the headline rows; `K3_BENCH_ALL_ISA=1` adds a
//! row per available ISA and the per-token kernels table; `K3_BENCH_OPS_ONLY=1` prints only
//! that table (every ISA); `K3_BENCH_REPS=n` sets the repetitions; `K3_BENCH_MANY=1` prints
//! only the several-inputs table (a prompt pass: one weight read for n inputs, one thread).

use std::hint::black_box;
use std::time::Instant;

use k3_kernels::Pool;
use k3_kernels::attn::{MlaCache, MlaShape, mla_attend_with};
use k3_kernels::isa::{self, Isa};
use k3_kernels::kda::{KdaStep, conv_step_with, kda_step_with};
use k3_kernels::matvec::{
    matvec_bf16_with, matvec_mxfp4_with, rows_bf16_many_with, rows_mxfp4_many_with,
};
use k3_kernels::ops::{rmsnorm_with, situ_glu_with, softmax_inplace_with};
use k3_kernels::router::{RouterCfg, Scoring, route_with};

const GIB: usize = 1 << 30;
/// Size of the MXFP4 expert ring (far larger than the 32 MiB L3 of the reference machine).
const RING: usize = 256 << 20;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// Deterministic fill without a rand crate.
fn fill_u16(n: usize, seed: u64) -> Vec<u16> {
    let mut s = seed | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            // bf16 values in roughly +-0.03 (exponent 0x3C..0x3E), random sign and mantissa
            (0x3C00 | (s as u16 & 0x83FF)) & 0xBFFF
        })
        .collect()
}

fn fill_u8(n: usize, seed: u64) -> Vec<u8> {
    let mut s = seed | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            s as u8
        })
        .collect()
}

/// One streaming read of `buf` split over all threads of `pool`; returns bytes/s.
fn read_once(pool: &Pool, buf: &[u64]) -> f64 {
    let chunk = buf.len().div_ceil(pool.n_threads());
    let mut sink = vec![0u64; pool.n_threads()];
    let t = Instant::now();
    pool.for_each_chunk(&mut sink, 1, |i, s| {
        let end = buf.len().min((i + 1) * chunk);
        s[0] = k3_kernels::membw::xor_reduce(&buf[i * chunk..end]);
    });
    let dt = t.elapsed().as_secs_f64();
    black_box(&sink);
    (buf.len() * 8) as f64 / dt
}

/// The all-core read-bandwidth reference: the 1 GiB buffer and a rotating 256 MiB window.
struct Probe<'a> {
    pool: &'a Pool,
    buf: Vec<u64>,
    next: std::cell::Cell<usize>,
}

impl Probe<'_> {
    /// Median over `reps` full 1 GiB reads by `pool` (after one warm-up).
    fn full(&self, pool: &Pool, reps: usize) -> f64 {
        read_once(pool, &self.buf);
        median((0..reps).map(|_| read_once(pool, &self.buf)).collect())
    }

    /// One read of the next 256 MiB window (far larger than the caches) by the probe's pool
    /// (one thread: least disturbed by preemption on a shared machine).
    fn sample(&self) -> f64 {
        let win = self.buf.len() / 4;
        let i = self.next.get();
        self.next.set((i + 1) % 4);
        read_once(self.pool, &self.buf[i * win..(i + 1) * win])
    }
}

struct Row {
    name: String,
    threads: usize,
    isa: Isa,
    weight_bytes_per_s: f64,
    /// Median of per-repetition (kernel / paired read) ratios.
    paired: f64,
}

/// Times `reps` calls of `call(rep)` (after one warm-up), each preceded by a paired read
/// sample; returns (median seconds, median paired ratio) for `bytes` per call. In-cache
/// kernels (`in_cache`) are not paired (the read would evict them); their ratio is NaN.
fn timed(
    probe: &Probe,
    in_cache: bool,
    reps: usize,
    bytes: usize,
    mut call: impl FnMut(usize),
) -> (f64, f64) {
    call(0);
    let (mut times, mut ratios) = (Vec::new(), Vec::new());
    for rep in 1..=reps {
        let bw = if in_cache { f64::NAN } else { probe.sample() };
        let t = Instant::now();
        call(rep);
        let dt = t.elapsed().as_secs_f64();
        times.push(dt);
        ratios.push(bytes as f64 / dt / bw);
    }
    (median(times), median(ratios))
}

fn bench_bf16(probe: &Probe, pool: &Pool, isa: Isa, shape: (usize, usize), reps: usize) -> Row {
    let (rows, cols) = shape;
    let w = fill_u16(rows * cols, 0x1234_5678 ^ rows as u64);
    let x: Vec<f32> = (0..cols).map(|i| ((i % 17) as f32 - 8.0) * 0.1).collect();
    let mut out = vec![0.0f32; rows];
    let bytes = rows * cols * 2;
    let (t, paired) = timed(probe, bytes <= 4 << 20, reps, bytes, |_| {
        matvec_bf16_with(isa, pool, &w, &x, &mut out);
        black_box(&out);
    });
    Row {
        name: if bytes <= 4 << 20 {
            format!("bf16 matvec {rows}x{cols} (in cache)")
        } else {
            format!("bf16 matvec {rows}x{cols}")
        },
        threads: pool.n_threads(),
        isa,
        weight_bytes_per_s: bytes as f64 / t,
        paired,
    }
}

/// `ring_bytes`: total size of the ring of distinct experts (0: one expert, stays in cache).
fn bench_mxfp4(
    probe: &Probe,
    pool: &Pool,
    isa: Isa,
    shape: (usize, usize),
    reps: usize,
    ring_bytes: usize,
) -> Row {
    let (rows, cols) = shape;
    let (pb, sb) = (rows * cols / 2, rows * cols / 32);
    let n_experts = ring_bytes.div_ceil(pb + sb).max(1);
    let packed = fill_u8(n_experts * pb, 99);
    // realistic scale bytes (K3 experts use 112..122)
    let scales: Vec<u8> = fill_u8(n_experts * sb, 7)
        .iter()
        .map(|b| 112 + b % 11)
        .collect();
    let x: Vec<f32> = (0..cols).map(|i| ((i % 13) as f32 - 6.0) * 0.1).collect();
    let mut out = vec![0.0f32; rows];
    let (t, paired) = timed(probe, n_experts == 1, reps, pb + sb, |rep| {
        let e = rep % n_experts;
        let (p, s) = (&packed[e * pb..(e + 1) * pb], &scales[e * sb..(e + 1) * sb]);
        matvec_mxfp4_with(isa, pool, p, s, &x, &mut out);
        black_box(&out);
    });
    Row {
        name: if n_experts == 1 {
            format!("mxfp4 matvec {rows}x{cols} (in cache)")
        } else {
            format!("mxfp4 matvec {rows}x{cols} ({n_experts} experts ring)")
        },
        threads: pool.n_threads(),
        isa,
        weight_bytes_per_s: (pb + sb) as f64 / t,
        paired,
    }
}

/// Median microseconds per call of `f`.
fn time_us(reps: usize, mut f: impl FnMut()) -> f64 {
    let mut times = Vec::new();
    for rep in 0..=reps {
        let t = Instant::now();
        f();
        if rep > 0 {
            times.push(t.elapsed().as_secs_f64() * 1e6);
        }
    }
    median(times)
}

fn vals(n: usize, seed: u32, scale: f32) -> Vec<f32> {
    (0..n)
        .map(|i| {
            (((i as u32).wrapping_mul(2_654_435_761) ^ seed) >> 8) as f32 / 8_388_608.0 * 2.0 - 1.0
        })
        .map(|v| v * scale)
        .collect()
}

/// The other per-token hot loops at K3 shapes, per ISA (µs per call, 1 thread / all cores).
fn bench_ops(isas: &[Isa], pools: [&Pool; 2], reps: usize) {
    println!("\nper-token kernels at K3 shapes (median µs per call):");
    println!(
        "{:<52} {:>8} {:>10} {:>10}",
        "kernel", "isa", "1 thread", "all cores"
    );
    let g = vals(33792, 1, 30.0);
    let u = vals(33792, 2, 30.0);
    let mut o = vec![0.0f32; 33792];
    let x = vals(7168, 3, 3.0);
    let w = vals(7168, 4, 1.0);
    let mut sm = vals(4096, 5, 10.0);
    let (h, dk, dv) = (96, 128, 128);
    let q = vals(h * dk, 6, 0.1);
    let k = vals(h * dk, 7, 0.1);
    let v = vals(h * dv, 8, 1.0);
    let gd: Vec<f32> = vals(h * dk, 9, 1.0)
        .iter()
        .map(|g| -2.5 * (g + 1.0))
        .collect();
    let beta = vec![0.5f32; h];
    let mut state = vals(h * dk * dv, 10, 0.1);
    let mut ko = vec![0.0f32; h * dv];
    let n_pos = 1024;
    let shape = MlaShape {
        n_heads: 96,
        d_nope: 128,
        d_rope: 64,
        d_v: 128,
        kv_lora: 512,
        n_pos,
        scale: 0.072,
    };
    let mq = vals(96 * 192, 11, 1.0);
    let w_kv_b = fill_u16(96 * 256 * 512, 12);
    let ckv = vals(n_pos * 512, 13, 1.0);
    let kr = vals(n_pos * 64, 14, 1.0);
    let cache = MlaCache {
        c_kv: &ckv,
        k_rope: &kr,
    };
    let mut sc = vec![0.0f32; shape.work_len()];
    let mut mo = vec![0.0f32; 96 * 128];
    let logits = vals(896, 15, 3.0);
    let bias = vals(896, 16, 0.3);
    let rcfg = RouterCfg {
        top_k: 16,
        scoring: Scoring::Sigmoid,
        renormalize: true,
        scale: 1.0,
    };
    let (mut ids, mut rw) = ([0u32; 16], [0.0f32; 16]);
    let cx = vals(12288, 17, 1.0);
    let taps = vals(12288 * 4, 18, 0.5);
    let mut hist = vals(12288 * 3, 19, 1.0);
    let mut co = vec![0.0f32; 12288];
    for &isa in isas {
        let single =
            |name: &str, t: f64| println!("{name:<52} {:>8} {t:>10.1} {:>10}", isa.name(), "-");
        single(
            "situ_glu 33792",
            time_us(reps, || situ_glu_with(isa, &g, &u, 4.0, Some(25.0), &mut o)),
        );
        single(
            "rmsnorm 7168",
            time_us(reps, || {
                rmsnorm_with(isa, &x, Some(&w), 1e-5, &mut o[..7168])
            }),
        );
        single(
            "softmax 4096",
            time_us(reps, || softmax_inplace_with(isa, &mut sm)),
        );
        single(
            "route 896 -> top 16",
            time_us(reps, || {
                route_with(isa, &logits, Some(&bias), &rcfg, &mut ids, &mut rw)
            }),
        );
        single(
            "conv_step 12288 x k4",
            time_us(reps, || {
                conv_step_with(isa, &mut hist, &cx, &taps, 4, &mut co)
            }),
        );
        let t = pools.map(|p| {
            time_us(reps, || {
                let step = KdaStep {
                    q: &q,
                    k: &k,
                    v: &v,
                    log_decay: &gd,
                    beta: &beta,
                    n_heads: h,
                    head_dim_k: dk,
                    head_dim_v: dv,
                };
                kda_step_with(isa, p, &step, &mut state, &mut ko)
            })
        });
        println!(
            "{:<52} {:>8} {:>10.1} {:>10.1}",
            "kda_step 96 heads 128x128",
            isa.name(),
            t[0],
            t[1]
        );
        let t = pools.map(|p| {
            time_us(reps, || {
                mla_attend_with(isa, p, &shape, &mq, &w_kv_b, &cache, &mut sc, &mut mo)
            })
        });
        println!(
            "{:<52} {:>8} {:>10.1} {:>10.1}",
            "mla_attend 96 heads, 1024 positions",
            isa.name(),
            t[0],
            t[1]
        );
    }
    black_box((&o, &sm, &state, &ko, &mo, &ids, &rw, &co));
}

fn main() {
    // `cargo bench` passes `--bench`; a filter argument is accepted and ignored.
    let reps: usize = std::env::var("K3_BENCH_REPS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(15);
    let all_isa = std::env::var("K3_BENCH_ALL_ISA").is_ok_and(|v| v == "1");
    let n_all = std::thread::available_parallelism().map_or(1, |n| n.get());
    let headline = isa::active();
    println!(
        "k3-kernels matvec bench: active ISA {headline:?}, available {:?}, {n_all} cores, median of {reps}",
        isa::available()
    );

    let pool_all = Pool::new(n_all);
    let pool_one = Pool::new(1);
    let isas = if all_isa {
        isa::available()
    } else {
        vec![headline]
    };
    if std::env::var("K3_BENCH_OPS_ONLY").is_ok_and(|v| v == "1") {
        bench_ops(&isa::available(), [&pool_one, &pool_all], reps);
        return;
    }

    if std::env::var("K3_BENCH_MANY").is_ok_and(|v| v == "1") {
        bench_many(&isas, reps);
        return;
    }

    let probe = Probe {
        pool: &pool_one,
        buf: (0..GIB / 8).map(|i| i as u64 * 0x9E37_79B9).collect(),
        next: std::cell::Cell::new(0),
    };
    let bw_all = probe.full(&pool_all, reps);
    let bw_one = probe.full(&pool_one, reps);
    // The reference is the larger of the two: on a shared machine the all-core read can be
    // slowed by preemption of one of its threads, and the hardware delivers at least the max.
    let bw_ref = bw_all.max(bw_one);
    println!(
        "memory read bandwidth (1 GiB streaming read): all {n_all} cores {:.2} GB/s, 1 core {:.2} GB/s; reference (max) {:.2} GB/s",
        bw_all / 1e9,
        bw_one / 1e9,
        bw_ref / 1e9
    );

    let mut rows = Vec::new();
    for &isa in &isas {
        for pool in [&pool_one, &pool_all] {
            rows.push(bench_bf16(&probe, pool, isa, (12288, 7168), reps));
            rows.push(bench_bf16(&probe, pool, isa, (7168, 12288), reps));
            rows.push(bench_mxfp4(&probe, pool, isa, (3072, 3584), reps, RING));
            rows.push(bench_mxfp4(&probe, pool, isa, (3584, 3072), reps, RING));
        }
    }
    // compute ceiling: the same kernels on weights that stay in L2/L3
    for &isa in &isas {
        for pool in [&pool_one, &pool_all] {
            rows.push(bench_bf16(&probe, pool, isa, (256, 4096), reps * 4));
            rows.push(bench_mxfp4(&probe, pool, isa, (512, 4096), reps * 4, 0));
        }
    }
    println!(
        "{:<44} {:>7} {:>8} {:>12} {:>10} {:>8}",
        "kernel", "isa", "threads", "weight GB/s", "of read bw", "paired"
    );
    for r in &rows {
        let paired = if r.paired.is_nan() {
            "-".to_string()
        } else {
            format!("{:.1}%", 100.0 * r.paired)
        };
        println!(
            "{:<44} {:>7} {:>8} {:>12.2} {:>9.1}% {:>8}",
            r.name,
            r.isa.name(),
            r.threads,
            r.weight_bytes_per_s / 1e9,
            100.0 * r.weight_bytes_per_s / bw_ref,
            paired
        );
    }
    if all_isa {
        bench_ops(&isas, [&pool_one, &pool_all], reps);
    }
}

/// One thread, a 176 MB bf16 matrix (far beyond the caches) times n inputs: n one-input
/// matvecs (the weights stream from memory n times) against one `rows_bf16_many` call (once);
/// then an MXFP4 expert matrix of k3-mini's shape (512x512, in cache) and of the decode
/// bench's (3072x3584) the same way. Figures are input-weight products per second
/// (G MAC/s), medians of the reps.
fn bench_many(isas: &[Isa], reps: usize) {
    bench_many_bf16(isas, reps);
    bench_many_mxfp4(isas, reps);
}

fn inputs(n: usize, cols: usize) -> Vec<Vec<f32>> {
    (0..n)
        .map(|t| {
            fill_u16(cols, 100 + t as u64)
                .iter()
                .map(|&b| f32::from_bits((b as u32) << 16) * 30.0)
                .collect()
        })
        .collect()
}

fn bench_many_mxfp4(isas: &[Isa], reps: usize) {
    let pool = Pool::new(1);
    for (rows, cols) in [(512, 512), (3072, 3584)] {
        let packed = fill_u8(rows * cols / 2, 5);
        let scales: Vec<u8> = fill_u8(rows * cols / 32, 6)
            .iter()
            .map(|b| 118 + b % 8)
            .collect();
        for &isa in isas {
            for n in [1usize, 4, 8, 16] {
                let xs = inputs(n, cols);
                let mut outs = vec![vec![0.0f32; rows]; n];
                let macs = (rows * cols * n) as f64;
                let calls = (4_000_000 / (rows * cols)).max(1);
                let (mut one, mut many) = (Vec::new(), Vec::new());
                for _ in 0..reps.max(3) {
                    let t0 = Instant::now();
                    for _ in 0..calls {
                        for (x, o) in xs.iter().zip(outs.iter_mut()) {
                            matvec_mxfp4_with(isa, &pool, &packed, &scales, x, o);
                        }
                    }
                    one.push(calls as f64 * macs / t0.elapsed().as_secs_f64());
                    black_box(&outs);
                    let xr: Vec<&[f32]> = xs.iter().map(|x| x.as_slice()).collect();
                    let mut or: Vec<&mut [f32]> =
                        outs.iter_mut().map(|o| o.as_mut_slice()).collect();
                    let t0 = Instant::now();
                    for _ in 0..calls {
                        rows_mxfp4_many_with(isa, &packed, &scales, &xr, &mut or);
                    }
                    many.push(calls as f64 * macs / t0.elapsed().as_secs_f64());
                    black_box(&or);
                }
                let (a, b) = (median(one), median(many));
                println!(
                    "{:<10} {:>7} {:>4} {:>16.2} {:>16.2} {:>6.2}x  mxfp4",
                    format!("{rows}x{cols}"),
                    isa.name(),
                    n,
                    a / 1e9,
                    b / 1e9,
                    b / a
                );
            }
        }
    }
}

fn bench_many_bf16(isas: &[Isa], reps: usize) {
    let (rows, cols) = (12288, 7168);
    let w = fill_u16(rows * cols, 11);
    let pool = Pool::new(1);
    println!(
        "{:<10} {:>7} {:>4} {:>16} {:>16} {:>7}",
        "shape", "isa", "n", "one by one GMAC/s", "many GMAC/s", "ratio"
    );
    for &isa in isas {
        for n in [1usize, 4, 16, 64] {
            let xs = inputs(n, cols);
            let mut outs = vec![vec![0.0f32; rows]; n];
            let macs = (rows * cols * n) as f64;
            let (mut one, mut many) = (Vec::new(), Vec::new());
            for _ in 0..reps.div_ceil(3).max(2) {
                let t0 = Instant::now();
                for (x, o) in xs.iter().zip(outs.iter_mut()) {
                    matvec_bf16_with(isa, &pool, &w, x, o);
                }
                one.push(macs / t0.elapsed().as_secs_f64());
                black_box(&outs);
                let xr: Vec<&[f32]> = xs.iter().map(|x| x.as_slice()).collect();
                let mut or: Vec<&mut [f32]> = outs.iter_mut().map(|o| o.as_mut_slice()).collect();
                let t0 = Instant::now();
                rows_bf16_many_with(isa, &w, &xr, &mut or);
                many.push(macs / t0.elapsed().as_secs_f64());
                black_box(&outs);
            }
            let (a, b) = (median(one), median(many));
            println!(
                "{:<10} {:>7} {:>4} {:>16.2} {:>16.2} {:>6.2}x",
                format!("{rows}x{cols}"),
                isa.name(),
                n,
                a / 1e9,
                b / 1e9,
                b / a
            );
        }
    }
}
