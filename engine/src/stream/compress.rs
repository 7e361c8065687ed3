//! Lossless compression of a packed trunk (`pack-trunk --compress`): fewer bytes read per
//! pass over the trunk, the same bytes in RAM.
//!
//! Owns: the chunk codec and its part of the trunk format. A layer's bytes are cut into
//! chunks of [`Compression::chunk_bytes`]; each chunk is stored as one record at a
//! 4096-aligned offset. A little-endian bf16 weight is a low byte (the lowest exponent bit and
//! the mantissa: close to random) and a high byte (sign and the seven high exponent bits: a
//! handful of values per tensor). A coded record keeps every low byte and replaces every high
//! byte by a 4-bit code into the chunk's table of its 15 most frequent high bytes, code 15
//! meaning "listed among the exceptions" (position and byte). Layout, for a chunk of `n` bytes
//! (`n / 2` pairs, `B = n / 32` blocks of 16 pairs):
//!
//! ```text
//! B x [16 low bytes][8 bytes of codes, low nibble first]   24 bytes per 32 raw bytes
//! the last n - 32B raw bytes as they are                    (< 32)
//! E x u32 LE exception pair index, then E exception bytes
//! u32 LE E, then the 16-byte table                          (20-byte footer)
//! ```
//!
//! A record that would not be shorter than its chunk is the chunk's bytes as they are.
//! The layout decodes IN PLACE: the record is read into the start of the chunk's own place in
//! the layer buffer, the footer, exceptions and raw tail are copied out, the tail is written,
//! then blocks are expanded from the last to the first (block `b` reads `24b..24b+24` into
//! registers and writes `32b..32b+32`, which only ever overwrites input already consumed), then
//! the exceptions are patched. No staging buffer, no extra memory: a compressed trunk plans
//! exactly like a raw one.
//! Must not: change a byte (a record that does not decode consistently - lengths, escape codes
//! against the exception list - is an error naming the layer and chunk, never other bytes).
//! Follows upstream: nothing (the C engine reads raw layers; the seed article rejects LOSSY
//! trunk quantization, which this is not). Splitting float weights into byte planes and
//! entropy-coding the exponent bytes is the usual trick; a 16-entry code instead of Huffman
//! trades ~8% of the size for a decode that costs almost nothing on two cores (zstd's Huffman
//! on the same bytes: docs/history/PERFORMANCE-LOG.md §6.1).

use super::StreamError;
use super::aligned::{IO_ALIGN, align_up};
use super::direct::{DirectFile, ReadPool};
#[cfg(target_arch = "x86_64")]
use k3_kernels::isa::Isa;

/// The codec name written into `trunk.json`.
pub const CODEC: &str = "bf16-nibble-inplace";
/// Raw bytes per chunk (the last chunk of a layer may be shorter). 512 KiB: on k3-mini,
/// 1.11-1.19x faster streaming decode and a 1.09x faster pinned load than 2 MiB records
/// (docs/history/PERFORMANCE-LOG.md §6.2): more records in flight per layer, a shorter tail
/// at the end of each layer, each decode in cache.
pub const CHUNK_BYTES: u64 = 512 << 10;
/// The escape code: the high byte is in the record's exception list.
const ESCAPE: u8 = 15;
/// Bytes of a coded record's footer: the exception count (u32 LE) and the 16-byte table.
const FOOTER: usize = 4 + 16;
/// Raw bytes of one block (16 pairs) and its coded bytes.
const BLOCK_RAW: usize = 32;
const BLOCK_CODED: usize = 24;

/// `trunk.json`'s `compression` object.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Compression {
    pub codec: String,
    /// Raw bytes per chunk (a multiple of 4096).
    pub chunk_bytes: u64,
    /// Bytes of the stored records (without alignment padding) over all layers.
    pub stored_bytes: u64,
}

/// One layer's stored form (`trunk.json`: a packed layer's `stored`).
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StoredLayer {
    /// Bytes from the layer's offset to the end of its last record.
    pub bytes: u64,
    pub chunks: Vec<StoredChunk>,
}

/// One chunk's record.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StoredChunk {
    /// Offset of the record from the layer's offset (a multiple of 4096).
    pub at: u64,
    /// Bytes of the record.
    pub len: u64,
    /// Whether the record is coded (else it is the chunk's bytes as they are).
    pub z: bool,
}

/// Raw length of chunk `i` of a `size`-byte layer.
pub fn chunk_raw_len(size: u64, chunk_bytes: u64, i: usize) -> usize {
    let start = i as u64 * chunk_bytes;
    size.saturating_sub(start).min(chunk_bytes) as usize
}

/// Bytes of a coded record of an `n`-byte chunk with `n_exc` exceptions.
pub fn coded_len(n: usize, n_exc: usize) -> usize {
    let blocks = n / BLOCK_RAW;
    blocks * BLOCK_CODED + (n - blocks * BLOCK_RAW) + 5 * n_exc + FOOTER
}

/// Whether a record of `c.len` bytes is possible for an `n`-byte chunk.
pub fn plausible(n: usize, c: &StoredChunk) -> bool {
    if c.z {
        (c.len as usize) < n && c.len as usize >= coded_len(n, 0)
    } else {
        c.len as usize == n
    }
}

/// Encodes chunks (one per pack thread).
#[derive(Debug, Default)]
pub struct Encoder {
    exc: Vec<(u32, u8)>,
}

impl Encoder {
    pub fn new() -> Self {
        Self::default()
    }

    /// Encode `raw` into `out` (cleared first); returns whether the record is coded.
    /// Deterministic: the same bytes give the same record.
    pub fn encode(&mut self, raw: &[u8], out: &mut Vec<u8>) -> bool {
        out.clear();
        let blocks = raw.len() / BLOCK_RAW;
        let coded_pairs = blocks * 16;
        let mut counts = [0u64; 256];
        for &b in raw[..2 * coded_pairs].iter().skip(1).step_by(2) {
            counts[b as usize] += 1;
        }
        // The 15 most frequent high bytes (ties: the smaller byte first) get codes 0..15.
        let mut order: Vec<u8> = (0..=255u8).filter(|&b| counts[b as usize] > 0).collect();
        order.sort_by_key(|&b| (std::cmp::Reverse(counts[b as usize]), b));
        order.truncate(ESCAPE as usize);
        let mut table = [0u8; 16];
        let mut code = [ESCAPE; 256];
        for (i, &b) in order.iter().enumerate() {
            table[i] = b;
            code[b as usize] = i as u8;
        }
        self.exc.clear();
        for k in 0..coded_pairs {
            let h = raw[2 * k + 1];
            if code[h as usize] == ESCAPE {
                self.exc.push((k as u32, h));
            }
        }
        if blocks == 0 || coded_len(raw.len(), self.exc.len()) >= raw.len() {
            out.extend_from_slice(raw);
            return false;
        }
        for blk in raw[..2 * coded_pairs].chunks_exact(BLOCK_RAW) {
            out.extend(blk.iter().step_by(2));
            for q in blk.chunks_exact(4) {
                out.push(code[q[1] as usize] | code[q[3] as usize] << 4);
            }
        }
        out.extend_from_slice(&raw[2 * coded_pairs..]);
        for &(k, _) in &self.exc {
            out.extend_from_slice(&k.to_le_bytes());
        }
        out.extend(self.exc.iter().map(|&(_, h)| h));
        out.extend_from_slice(&(self.exc.len() as u32).to_le_bytes());
        out.extend_from_slice(&table);
        true
    }
}

/// Expand blocks `0..blocks` of a coded record in place in `buf` (block `b`'s 24 input bytes
/// at `24b`, its 32 output bytes at `32b`), from the last block to the first; returns how many
/// codes were [`ESCAPE`].
///
/// The path follows the kernels' active ISA (`K3_ISA`): `avx512` takes [`expand_vbmi`] where
/// the CPU has AVX-512 VBMI, `avx2` (and `avx512` without VBMI) [`expand_ssse3`], anything
/// else the byte loop. Every path writes the same bytes (tested).
fn expand_in_place(buf: &mut [u8], blocks: usize, table: &[u8; 16]) -> usize {
    debug_assert!(buf.len() >= blocks * BLOCK_RAW);
    #[cfg(target_arch = "x86_64")]
    {
        let isa = k3_kernels::isa::active();
        if isa == Isa::Avx512
            && std::arch::is_x86_feature_detected!("avx512vbmi")
            && std::arch::is_x86_feature_detected!("avx512bw")
        {
            // SAFETY: AVX-512 VBMI and BW (and so SSSE3) were detected just above.
            return unsafe { expand_vbmi(buf, blocks, table) };
        }
        if matches!(isa, Isa::Avx2 | Isa::Avx512) && std::arch::is_x86_feature_detected!("ssse3") {
            // SAFETY: SSSE3 was detected just above.
            return unsafe { expand_ssse3(buf, blocks, table) };
        }
    }
    expand_scalar(buf, blocks, table)
}

/// [`expand_in_place`] one byte at a time (targets without SSSE3 or NEON paths).
fn expand_scalar(buf: &mut [u8], blocks: usize, table: &[u8; 16]) -> usize {
    let mut escapes = 0;
    for b in (0..blocks).rev() {
        let mut inp = [0u8; BLOCK_CODED];
        inp.copy_from_slice(&buf[BLOCK_CODED * b..BLOCK_CODED * (b + 1)]);
        let out = &mut buf[BLOCK_RAW * b..BLOCK_RAW * (b + 1)];
        for i in 0..16 {
            let c = (inp[16 + i / 2] >> (4 * (i % 2))) & 0x0F;
            escapes += usize::from(c == ESCAPE);
            out[2 * i] = inp[i];
            out[2 * i + 1] = table[c as usize];
        }
    }
    escapes
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "ssse3")]
fn expand_ssse3(buf: &mut [u8], blocks: usize, table: &[u8; 16]) -> usize {
    use std::arch::x86_64::{
        __m128i, _mm_and_si128, _mm_cmpeq_epi8, _mm_loadl_epi64, _mm_loadu_si128,
        _mm_movemask_epi8, _mm_set1_epi8, _mm_shuffle_epi8, _mm_srli_epi16, _mm_storeu_si128,
        _mm_unpackhi_epi8, _mm_unpacklo_epi8,
    };
    assert!(buf.len() >= blocks * BLOCK_RAW);
    let p = buf.as_mut_ptr();
    let mut escapes = 0usize;
    // SAFETY (whole block): SSSE3 is enabled for this function; block `b` loads
    // buf[24b..24b+24] and stores buf[32b..32b+32], in bounds by the assert above. Both loads
    // happen before the stores, and blocks go from the last to the first, so a store only
    // overwrites input of this block or of later blocks, already loaded.
    unsafe {
        let lut = _mm_loadu_si128(table.as_ptr().cast::<__m128i>());
        let low4 = _mm_set1_epi8(0x0F);
        let esc = _mm_set1_epi8(ESCAPE as i8);
        for b in (0..blocks).rev() {
            let l = _mm_loadu_si128(p.add(BLOCK_CODED * b).cast::<__m128i>());
            let nib = _mm_loadl_epi64(p.add(BLOCK_CODED * b + 16).cast::<__m128i>());
            let codes = _mm_unpacklo_epi8(
                _mm_and_si128(nib, low4),
                _mm_and_si128(_mm_srli_epi16(nib, 4), low4),
            );
            escapes += _mm_movemask_epi8(_mm_cmpeq_epi8(codes, esc)).count_ones() as usize;
            let h = _mm_shuffle_epi8(lut, codes);
            let d = p.add(BLOCK_RAW * b).cast::<__m128i>();
            _mm_storeu_si128(d, _mm_unpacklo_epi8(l, h));
            _mm_storeu_si128(d.add(1), _mm_unpackhi_epi8(l, h));
        }
    }
    escapes
}

/// `vpermt2b` indices that put, for output half `h` of a group of 4 blocks (its blocks `2h`
/// and `2h + 1`), each pair's low byte at its even position and the coded byte holding its
/// code at its odd position (indices into the group's 96 input bytes).
#[cfg(target_arch = "x86_64")]
const fn vbmi_indices(h: usize) -> [u8; 64] {
    let mut idx = [0u8; 64];
    let mut k = 0;
    while k < 64 {
        let blk = 2 * h + k / BLOCK_RAW;
        let i = (k % BLOCK_RAW) / 2;
        idx[k] = if k % 2 == 0 {
            BLOCK_CODED * blk + i
        } else {
            BLOCK_CODED * blk + 16 + i / 2
        } as u8;
        k += 1;
    }
    idx
}

/// [`expand_ssse3`] four blocks (96 input bytes, 128 output bytes) at a time with AVX-512
/// VBMI: one two-source byte permute puts low bytes and code bytes in their output positions,
/// the nibble of each pair is picked by a mask, looked up with `vpshufb` and blended in. The
/// first `blocks % 4` blocks (the last to be expanded) go through [`expand_ssse3`].
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vbmi,ssse3")]
fn expand_vbmi(buf: &mut [u8], blocks: usize, table: &[u8; 16]) -> usize {
    use std::arch::x86_64::{
        __m128i, __m256i, _mm_loadu_si128, _mm256_loadu_si256, _mm512_and_si512,
        _mm512_broadcast_i32x4, _mm512_loadu_si512, _mm512_mask_blend_epi8,
        _mm512_mask_cmpeq_epi8_mask, _mm512_permutex2var_epi8, _mm512_set1_epi8,
        _mm512_shuffle_epi8, _mm512_srli_epi16, _mm512_storeu_si512, _mm512_zextsi256_si512,
    };
    /// Odd output bytes (the high bytes) and, among them, those of odd pairs (high nibbles).
    const ODD: u64 = 0xAAAA_AAAA_AAAA_AAAA;
    const HIGH_NIBBLE: u64 = 0x8888_8888_8888_8888;
    static IDX: [[u8; 64]; 2] = [vbmi_indices(0), vbmi_indices(1)];
    assert!(buf.len() >= blocks * BLOCK_RAW);
    let first = blocks % 4;
    let p = buf.as_mut_ptr();
    let mut escapes = 0usize;
    // SAFETY (whole block): the features are enabled for this function; the group of blocks
    // g..g+4 loads buf[24g..24g+96] and stores buf[32g..32g+128], in bounds by the assert.
    // Both loads happen before the stores and groups go from the last to the first, so a
    // store only overwrites input of this group or of later ones, already loaded.
    unsafe {
        let lut = _mm512_broadcast_i32x4(_mm_loadu_si128(table.as_ptr().cast::<__m128i>()));
        let idx = [
            _mm512_loadu_si512(IDX[0].as_ptr().cast()),
            _mm512_loadu_si512(IDX[1].as_ptr().cast()),
        ];
        let low4 = _mm512_set1_epi8(0x0F);
        let esc = _mm512_set1_epi8(ESCAPE as i8);
        let mut g = blocks;
        while g >= first + 4 {
            g -= 4;
            let src = p.add(BLOCK_CODED * g);
            let a = _mm512_loadu_si512(src.cast());
            let b = _mm512_zextsi256_si512(_mm256_loadu_si256(src.add(64).cast::<__m256i>()));
            let mut out = [a; 2];
            for (o, ix) in out.iter_mut().zip(idx) {
                let v = _mm512_permutex2var_epi8(a, ix, b);
                let lo = _mm512_and_si512(v, low4);
                let hi = _mm512_and_si512(_mm512_srli_epi16::<4>(v), low4);
                let nib = _mm512_mask_blend_epi8(HIGH_NIBBLE, lo, hi);
                escapes += _mm512_mask_cmpeq_epi8_mask(ODD, nib, esc).count_ones() as usize;
                *o = _mm512_mask_blend_epi8(ODD, v, _mm512_shuffle_epi8(lut, nib));
            }
            let dst = p.add(BLOCK_RAW * g);
            _mm512_storeu_si512(dst.cast(), out[0]);
            _mm512_storeu_si512(dst.add(64).cast(), out[1]);
        }
        escapes + expand_ssse3(buf, first, table)
    }
}

/// Decode, in place, a chunk of `n` bytes whose record (`c.len` bytes) sits at the start of
/// `buf` (`buf.len() >= n`); afterwards `buf[..n]` holds the chunk. Errors say what did not
/// match.
pub fn decode_in_place(buf: &mut [u8], n: usize, c: &StoredChunk) -> Result<(), String> {
    let len = c.len as usize;
    if !plausible(n, c) || buf.len() < n {
        return Err(format!(
            "a {len}-byte record (coded: {}) cannot hold a {n}-byte chunk",
            c.z
        ));
    }
    if !c.z {
        return Ok(()); // the chunk's bytes as they are
    }
    let blocks = n / BLOCK_RAW;
    let tail_len = n - blocks * BLOCK_RAW;
    let foot = &buf[len - FOOTER..len];
    let n_exc = u32::from_le_bytes([foot[0], foot[1], foot[2], foot[3]]) as usize;
    let mut table = [0u8; 16];
    table.copy_from_slice(&foot[4..]);
    if coded_len(n, n_exc) != len {
        return Err(format!(
            "record of {len} bytes, but {n_exc} exceptions make it {}",
            coded_len(n, n_exc)
        ));
    }
    let tail_at = blocks * BLOCK_CODED;
    let mut tail = [0u8; BLOCK_RAW];
    tail[..tail_len].copy_from_slice(&buf[tail_at..tail_at + tail_len]);
    let exc_at = tail_at + tail_len;
    let exc: Vec<(usize, u8)> = buf[exc_at..exc_at + 4 * n_exc]
        .chunks_exact(4)
        .zip(&buf[exc_at + 4 * n_exc..exc_at + 5 * n_exc])
        .map(|(p, &v)| (u32::from_le_bytes([p[0], p[1], p[2], p[3]]) as usize, v))
        .collect();
    buf[blocks * BLOCK_RAW..n].copy_from_slice(&tail[..tail_len]);
    let escapes = expand_in_place(buf, blocks, &table);
    if escapes != n_exc {
        return Err(format!(
            "{escapes} escape codes but {n_exc} exceptions listed"
        ));
    }
    let mut prev: Option<usize> = None;
    for (k, v) in exc {
        // The escape code put table[15] there; anything else means the list is wrong.
        if k >= blocks * 16 || prev.is_some_and(|q| q >= k) || buf[2 * k + 1] != table[15] {
            return Err(format!(
                "exception at pair {k} is out of order, out of range or not escaped"
            ));
        }
        buf[2 * k + 1] = v;
        prev = Some(k);
    }
    Ok(())
}

/// One layer to read and decode: its offset, stored form, raw size and destination.
pub struct LayerRead<'a> {
    pub layer: usize,
    pub offset: u64,
    pub size: u64,
    pub stored: &'a StoredLayer,
    /// At least `size` rounded up to 4096 bytes, aligned for O_DIRECT; the layer lands at 0.
    pub dst: &'a mut [u8],
}

/// Read chunk `i` of the layer at `offset` into the start of `place` (the chunk's own bytes
/// in the layer buffer, plus up to the next 4096 boundary) and decode it there.
fn read_chunk(
    file: &DirectFile,
    offset: u64,
    layer: usize,
    i: usize,
    n: usize,
    c: &StoredChunk,
    place: &mut [u8],
) -> Result<(), StreamError> {
    let at = offset + c.at;
    let len = c.len as usize;
    let lead = file.read_into(at, len, place)?;
    if lead != 0 {
        return Err(StreamError::Invalid(format!(
            "layer {layer}, chunk {i}: record at byte {at} is not aligned"
        )));
    }
    decode_in_place(place, n, c).map_err(|msg| StreamError::Trunk {
        path: file.path().display().to_string(),
        msg: format!(
            "layer {layer}, chunk {i} (record at byte {at}, {len} bytes): {msg}; the file is \
             damaged: pack again"
        ),
    })
}

/// One chunk of a layer to read and decode into its place in the layer's buffer.
pub struct ChunkJob<'a> {
    layer: usize,
    /// The layer's offset in trunk.bin.
    offset: u64,
    i: usize,
    /// Raw bytes of the chunk.
    n: usize,
    c: &'a StoredChunk,
    place: &'a mut [u8],
}

impl ChunkJob<'_> {
    /// Disk bytes the read covers (the record's aligned span).
    pub fn disk_bytes(&self, file: &DirectFile) -> u64 {
        file.span(self.offset + self.c.at, self.c.len as usize).len as u64
    }

    /// Read the record and decode it in place.
    pub fn run(self, file: &DirectFile) -> Result<(), StreamError> {
        read_chunk(
            file,
            self.offset,
            self.layer,
            self.i,
            self.n,
            self.c,
            self.place,
        )
    }
}

/// The chunk jobs of one layer, in file order, after checking that its stored records and
/// its destination fit its size.
pub fn chunk_jobs(chunk_bytes: u64, lr: LayerRead<'_>) -> Result<Vec<ChunkJob<'_>>, StreamError> {
    let n_chunks = lr.size.div_ceil(chunk_bytes) as usize;
    let room = align_up(lr.size, IO_ALIGN as u64) as usize;
    if lr.stored.chunks.len() != n_chunks
        || lr.dst.len() < room
        || !chunk_bytes.is_multiple_of(IO_ALIGN as u64)
    {
        return Err(StreamError::Invalid(format!(
            "layer {}: {} stored chunks for {} bytes in {}-byte chunks, destination {} bytes",
            lr.layer,
            lr.stored.chunks.len(),
            lr.size,
            chunk_bytes,
            lr.dst.len()
        )));
    }
    let (layer, offset, size) = (lr.layer, lr.offset, lr.size);
    Ok(lr
        .stored
        .chunks
        .iter()
        .enumerate()
        .zip(lr.dst[..room].chunks_mut(chunk_bytes as usize))
        .map(|((i, c), place)| ChunkJob {
            layer,
            offset,
            i,
            n: chunk_raw_len(size, chunk_bytes, i),
            c,
            place,
        })
        .collect())
}

/// Read and decode every chunk of `layers` on `pool` (one task per chunk, issued in file
/// order, each into its own place in its layer's buffer); returns the disk bytes read
/// (aligned record spans).
pub fn read_layers(
    pool: &ReadPool,
    file: &DirectFile,
    chunk_bytes: u64,
    layers: Vec<LayerRead<'_>>,
) -> Result<u64, StreamError> {
    let mut jobs = Vec::new();
    for lr in layers {
        jobs.extend(chunk_jobs(chunk_bytes, lr)?);
    }
    let bytes = jobs.iter().map(|j| j.disk_bytes(file)).sum();
    let mut outs: Vec<Option<Result<(), StreamError>>> = Vec::new();
    outs.resize_with(jobs.len(), || None);
    {
        let mut tasks: Vec<Box<dyn FnOnce() + Send + '_>> = Vec::with_capacity(jobs.len());
        for (job, out) in jobs.into_iter().zip(outs.iter_mut()) {
            tasks.push(Box::new(move || {
                *out = Some(job.run(file));
            }));
        }
        if tasks.len() == 1 {
            // No hand-off for a single chunk.
            if let Some(t) = tasks.pop() {
                t();
            }
        } else {
            pool.run_tasks(tasks);
        }
    }
    for o in outs {
        o.unwrap_or_else(|| {
            Err(StreamError::Invalid(
                "a trunk chunk task did not run (reader thread panicked)".into(),
            ))
        })?;
    }
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Encode, check the record, decode in place (aligned and not); returns whether coded.
    fn round_trip(raw: &[u8]) -> bool {
        let mut enc = Encoder::new();
        let mut rec = Vec::new();
        let z = enc.encode(raw, &mut rec);
        let c = StoredChunk {
            at: 0,
            len: rec.len() as u64,
            z,
        };
        assert!(plausible(raw.len(), &c), "{} of {}", rec.len(), raw.len());
        for shift in [0usize, 1, 3] {
            let mut buf = vec![0xA5u8; raw.len() + shift + 7];
            buf[shift..shift + rec.len()].copy_from_slice(&rec);
            decode_in_place(&mut buf[shift..], raw.len(), &c).unwrap();
            assert_eq!(&buf[shift..shift + raw.len()], raw, "length {}", raw.len());
        }
        let mut rec2 = Vec::new();
        assert_eq!(enc.encode(raw, &mut rec2), z);
        assert_eq!(rec, rec2, "deterministic");
        z
    }

    fn bf16_like(n: usize, distinct: usize, seed: u32) -> Vec<u8> {
        let mut x = seed;
        (0..n)
            .map(|i| {
                x = x.wrapping_mul(1_103_515_245).wrapping_add(12345);
                if i % 2 == 1 {
                    0x38 + ((x >> 16) as usize % distinct) as u8
                } else {
                    (x >> 8) as u8
                }
            })
            .collect()
    }

    #[test]
    fn bf16_like_bytes_are_coded_and_round_trip() {
        let raw = bf16_like(40_000, 6, 1);
        assert!(round_trip(&raw), "a six-value high plane must be coded");
        let mut rec = Vec::new();
        Encoder::new().encode(&raw, &mut rec);
        assert_eq!(rec.len(), coded_len(raw.len(), 0));
        assert_eq!(coded_len(raw.len(), 0), raw.len() / 4 * 3 + 20);
    }

    #[test]
    fn every_length_and_table_size_round_trips() {
        // Lengths around the 32-byte blocks, odd and even; 1..=40 distinct high bytes (below,
        // at and above the 15-entry table).
        for n in 0..200usize {
            for distinct in [1usize, 2, 15, 16, 40] {
                round_trip(&bf16_like(n, distinct, n as u32));
            }
        }
        // Rare values are exceptions; a plane without a favourite is stored as it is.
        let mut raw = bf16_like(4096, 15, 9);
        for k in [3usize, 100, 1000, 2047] {
            raw[2 * k + 1] = 0xEE;
        }
        assert!(round_trip(&raw));
        assert!(!round_trip(&bf16_like(4096, 200, 5)));
    }

    /// An expansion: buffer, blocks, table -> escape codes seen.
    type Expand = fn(&mut [u8], usize, &[u8; 16]) -> usize;

    /// Every expansion this machine can run, by name (the dispatched one included).
    fn expansions() -> Vec<(&'static str, Expand)> {
        #[allow(unused_mut)] // only x86-64 adds paths
        let mut v: Vec<(&'static str, Expand)> = vec![("dispatched", expand_in_place)];
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("ssse3") {
                // SAFETY: SSSE3 was detected just above.
                v.push(("ssse3", |b, n, t| unsafe { expand_ssse3(b, n, t) }));
            }
            if std::arch::is_x86_feature_detected!("avx512vbmi")
                && std::arch::is_x86_feature_detected!("avx512bw")
            {
                // SAFETY: AVX-512 VBMI and BW were detected just above.
                v.push(("vbmi", |b, n, t| unsafe { expand_vbmi(b, n, t) }));
            }
        }
        v
    }

    #[test]
    fn every_expansion_matches_the_scalar_one() {
        // Block counts 0..=13 cover every remainder of the 4-block groups, then larger ones;
        // at shifted addresses; tables with escapes.
        let mut cases: Vec<(usize, usize)> = (0..=13).map(|b| (32 * b + b % 7, 15)).collect();
        cases.extend([
            (32 * 5, 15usize),
            (4096, 17),
            (32 * 77 + 9, 40),
            (65_536 + 64, 22),
        ]);
        for (case, &(n, distinct)) in cases.iter().enumerate() {
            let raw = bf16_like(n, distinct, 77 + case as u32);
            let mut rec = Vec::new();
            if !Encoder::new().encode(&raw, &mut rec) {
                continue; // too short to code: nothing to expand
            }
            let blocks = n / BLOCK_RAW;
            let foot = rec.len() - FOOTER;
            let table: [u8; 16] = rec[foot + 4..].try_into().unwrap();
            let mut want = rec.clone();
            want.resize(n.max(rec.len()), 0);
            let want_esc = expand_scalar(&mut want, blocks, &table);
            for (name, f) in expansions() {
                for shift in [0usize, 1, 5] {
                    let mut a = vec![0u8; shift];
                    a.extend_from_slice(&rec);
                    a.resize(shift + n.max(rec.len()), 0);
                    let esc = f(&mut a[shift..], blocks, &table);
                    assert_eq!(esc, want_esc, "{name}, {blocks} blocks, shift {shift}");
                    assert_eq!(
                        a[shift..shift + blocks * BLOCK_RAW],
                        want[..blocks * BLOCK_RAW],
                        "{name}, {blocks} blocks, shift {shift}"
                    );
                }
            }
        }
    }

    #[test]
    fn random_records_never_panic() {
        // Any bytes in a record of any plausible length: Ok or Err, never a panic or an
        // out-of-bounds write.
        let mut x = 0x9E37_79B9_7F4A_7C15u64;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        for _ in 0..3000 {
            let n = (next() % 700) as usize;
            let lo = coded_len(n, 0);
            if lo >= n {
                continue;
            }
            let len = lo + (next() as usize % (n - lo));
            let c = StoredChunk {
                at: 0,
                len: len as u64,
                z: true,
            };
            let mut buf: Vec<u8> = (0..n).map(|_| next() as u8).collect();
            if next() % 2 == 0 {
                // A small exception count, so the list is parsed more often.
                let f = len - FOOTER;
                let e = ((len - coded_len(n, 0)) / 5) as u32;
                buf[f..f + 4].copy_from_slice(&e.to_le_bytes());
            }
            let _ = decode_in_place(&mut buf, n, &c);
        }
    }

    #[test]
    fn a_damaged_record_is_an_error_not_other_bytes() {
        let mut raw = bf16_like(20_000, 15, 3);
        for k in (7..9_000).step_by(997) {
            raw[2 * k + 1] = 0xF0; // exceptions
        }
        let mut rec = Vec::new();
        assert!(Encoder::new().encode(&raw, &mut rec));
        let c = StoredChunk {
            at: 0,
            len: rec.len() as u64,
            z: true,
        };
        let decode = |rec: &[u8], c: &StoredChunk, n: usize| {
            let mut buf = vec![0u8; n.max(rec.len())];
            buf[..rec.len()].copy_from_slice(rec);
            decode_in_place(&mut buf, n, c).map(|()| buf[..n].to_vec())
        };
        assert_eq!(decode(&rec, &c, raw.len()).unwrap(), raw);
        // A common byte's code turned into the escape: the escape count no longer matches.
        assert_ne!(rec[16] & 0x0F, ESCAPE);
        let mut bad = rec.clone();
        bad[16] |= ESCAPE;
        assert!(decode(&bad, &c, raw.len()).is_err());
        // Exception positions out of order.
        let exc_at = rec.len() - FOOTER - 5 * 10;
        let mut bad = rec.clone();
        bad[exc_at + 4..exc_at + 8].copy_from_slice(&0u32.to_le_bytes());
        assert!(decode(&bad, &c, raw.len()).is_err());
        // A wrong exception count.
        let mut bad = rec.clone();
        let f = rec.len() - FOOTER;
        bad[f] ^= 1;
        assert!(decode(&bad, &c, raw.len()).is_err());
        // A record length or chunk length that does not fit.
        let short = StoredChunk {
            len: c.len - 1,
            ..c.clone()
        };
        assert!(decode(&rec[..rec.len() - 1], &short, raw.len()).is_err());
        assert!(decode(&rec, &c, raw.len() - 2).is_err());
    }
}
