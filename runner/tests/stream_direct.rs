//! O_DIRECT reads with unaligned offsets and lengths, on a file under target/ (not tmpfs,
//! where misaligned O_DIRECT reads succeed and alignment bugs hide).

use std::path::PathBuf;

use k3_engine::stream::aligned::AlignedBuf;
use k3_engine::stream::direct::{DirectFile, ReadPool, ReadReq};

fn pattern(i: u64) -> u8 {
    (i.wrapping_mul(2_654_435_761) >> 13) as u8
}

fn test_file(name: &str, len: u64) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("stream_direct");
    std::fs::create_dir_all(&dir).expect("create test dir under target/");
    let path = dir.join(name);
    let bytes: Vec<u8> = (0..len).map(pattern).collect();
    std::fs::write(&path, bytes).expect("write test file");
    path
}

fn expect_bytes(got: &[u8], offset: u64) {
    for (i, &b) in got.iter().enumerate() {
        assert_eq!(
            b,
            pattern(offset + i as u64),
            "byte {} of read at {offset}",
            i
        );
    }
}

const LEN: u64 = 3 * 1024 * 1024 + 1234; // not a multiple of 4096

#[test]
fn direct_reads_with_unaligned_offsets_and_lengths() {
    let path = test_file("unaligned.bin", LEN);
    let f = DirectFile::open(&path, true).expect("open");
    if !f.is_direct() {
        // The filesystem refused O_DIRECT: the fallback must say why, reads must still work.
        let why = f
            .fallback_reason()
            .expect("a buffered file states its reason");
        eprintln!("O_DIRECT unavailable here: {why}");
    } else {
        assert!(f.fallback_reason().is_none());
        eprintln!("O_DIRECT in use; alignment {:?}", f.dio_align());
    }
    let cases: &[(u64, usize)] = &[
        (0, 1),
        (0, 4096),
        (1, 4095),
        (4095, 2),
        (352, 1000), // a safetensors data section typically starts at a non-aligned offset
        (4096 * 3 + 17, 200_000),
        (LEN - 1, 1),
        (LEN - 5000, 5000), // the rounded-out read runs past end of file
        (1_000_001, 2 * 1024 * 1024 + 3),
        (12_345, 0),
    ];
    for &(off, len) in cases {
        let span = f.span(off, len);
        assert_eq!(span.start % f.offset_align() as u64, 0);
        assert_eq!(span.len % f.offset_align(), 0);
        assert!(span.lead < f.offset_align());
        let mut buf = AlignedBuf::new(span.len).expect("buffer");
        let lead = f.read_into(off, len, buf.full_mut()).expect("read");
        assert_eq!(lead, if len == 0 { 0 } else { span.lead });
        expect_bytes(&buf.full()[lead..lead + len], off);
    }
    // Exact unaligned read through the buffered handle.
    let mut small = [0u8; 13];
    f.read_exact_at(777, &mut small).expect("small read");
    expect_bytes(&small, 777);
}

#[test]
fn misaligned_buffer_and_short_buffer_and_eof_are_errors() {
    let path = test_file("errors.bin", LEN);
    let f = DirectFile::open(&path, true).expect("open");
    let mut buf = AlignedBuf::new(3 * 4096).expect("buffer");
    if f.is_direct() {
        let e = f
            .read_into(0, 4096, &mut buf.full_mut()[1..])
            .expect_err("misaligned buffer");
        assert!(e.to_string().contains("not aligned"), "{e}");
    }
    let e = f
        .read_into(10, 8192, &mut buf.full_mut()[..4096])
        .expect_err("short buffer");
    assert!(e.to_string().contains("needs a"), "{e}");
    let e = f
        .read_into(LEN - 10, 11, buf.full_mut())
        .expect_err("past end");
    assert!(e.to_string().contains("errors.bin"), "{e}");
}

#[test]
fn buffered_policy_reads_the_same_bytes() {
    let path = test_file("buffered.bin", LEN);
    let f = DirectFile::open(&path, false).expect("open");
    assert!(!f.is_direct());
    assert!(f.fallback_reason().expect("reason").contains("requested"));
    let (off, len) = (4097u64, 70_001usize);
    let mut buf = AlignedBuf::new(f.span(off, len).len).expect("buffer");
    let lead = f.read_into(off, len, buf.full_mut()).expect("read");
    expect_bytes(&buf.full()[lead..lead + len], off);
}

/// Reads `ranges` of `f` as one batch on `pool` and checks every byte; then a batch of one good
/// and one out-of-range read reports the error for that read only.
fn check_batch_and_per_read_errors(pool: &ReadPool, f: &DirectFile, ranges: &[(u64, usize)]) {
    let mut bufs: Vec<AlignedBuf> = ranges
        .iter()
        .map(|&(o, l)| AlignedBuf::new(f.span(o, l).len).expect("buffer"))
        .collect();
    let mut reqs: Vec<ReadReq<'_>> = ranges
        .iter()
        .zip(bufs.iter_mut())
        .map(|(&(offset, len), b)| ReadReq {
            file: f,
            offset,
            len,
            buf: b.full_mut(),
        })
        .collect();
    let leads = pool.read_all(&mut reqs);
    drop(reqs);
    for ((&(o, l), b), lead) in ranges.iter().zip(&bufs).zip(leads) {
        let lead = lead.expect("batch read");
        expect_bytes(&b.full()[lead..lead + l], o);
    }
    let mut b1 = AlignedBuf::new(8192).expect("buffer");
    let mut b2 = AlignedBuf::new(8192).expect("buffer");
    let mut reqs = vec![
        ReadReq {
            file: f,
            offset: 100,
            len: 10,
            buf: b1.full_mut(),
        },
        ReadReq {
            file: f,
            offset: LEN,
            len: 10,
            buf: b2.full_mut(),
        },
    ];
    let r = pool.read_all(&mut reqs);
    assert!(r[0].is_ok(), "the good read of the pair: {:?}", r[0]);
    assert!(r[1].is_err(), "the read past the end fails alone");
}

#[test]
fn pool_reads_a_batch_in_parallel() {
    let path = test_file("pool.bin", LEN);
    let f = DirectFile::open(&path, true).expect("open");
    let pool = ReadPool::new(4).expect("pool");
    assert_eq!(pool.depth(), 4);
    let ranges: Vec<(u64, usize)> = (0..24u64)
        .map(|i| {
            (
                (i * 131_071 + 7 * i) % (LEN - 70_000),
                1 + (i as usize * 2_909) % 65_000,
            )
        })
        .collect();
    check_batch_and_per_read_errors(&pool, &f, &ranges);
}

#[test]
fn split_reads_match_single_reads() {
    let path = test_file("split.bin", LEN);
    let f = DirectFile::open(&path, true).expect("open");
    let pool = ReadPool::new(3).expect("pool");
    let one = ReadPool::new(1).expect("pool");
    let cases: &[(u64, usize, usize)] = &[
        (0, LEN as usize, 64 * 1024),
        (1, 1_000_000, 64 * 1024),
        (4096 * 5 + 3, 300_000, 4096),
        (LEN - 200_001, 200_001, 8192),
        (777, 5000, 1000), // piece not a multiple of the alignment: one read
        (123, 10, 4096),   // smaller than a piece: one read
        (2 * 4096, 3 * 4096, 4096), // aligned on both ends
    ];
    for &(off, len, piece) in cases {
        for p in [&pool, &one] {
            let span = f.span(off, len);
            let mut buf = AlignedBuf::new(span.len).expect("buffer");
            let lead = p
                .read_split(&f, off, len, buf.full_mut(), piece)
                .expect("split read");
            assert_eq!(lead, span.lead);
            expect_bytes(&buf.full()[lead..lead + len], off);
        }
    }
    let mut small = AlignedBuf::new(4096).expect("buffer");
    assert!(
        pool.read_split(&f, 0, 100_000, small.full_mut(), 4096)
            .is_err()
    );
}

#[test]
fn io_uring_pool_reads_the_same_bytes_or_falls_back() {
    let path = test_file("uring.bin", LEN);
    let f = DirectFile::open(&path, true).expect("open");
    let pool = ReadPool::with_io_uring(4).expect("pool");
    let line = pool.backend_line();
    eprintln!("read backend: {line}");
    if cfg!(all(feature = "io-uring", target_os = "linux")) {
        assert!(
            pool.uses_io_uring() || line.contains("io_uring unavailable"),
            "{line}"
        );
    } else {
        assert!(!pool.uses_io_uring());
        assert!(line.contains("lacks the `io-uring` feature"), "{line}");
    }
    let ranges: Vec<(u64, usize)> = (0..40u64)
        .map(|i| {
            (
                (i * 77_777 + 13 * i) % (LEN - 90_000),
                1 + (i as usize * 4_099) % 85_000,
            )
        })
        .chain([(LEN - 3, 3), (0, 4096), (4095, 2)])
        .collect();
    // Errors stay per read; split reads go through the same backend.
    check_batch_and_per_read_errors(&pool, &f, &ranges);
    let (off, len) = (12_345u64, 2_000_001usize);
    let mut big = AlignedBuf::new(f.span(off, len).len).expect("buffer");
    let lead = pool
        .read_split(&f, off, len, big.full_mut(), 64 * 1024)
        .expect("split");
    expect_bytes(&big.full()[lead..lead + len], off);
}
