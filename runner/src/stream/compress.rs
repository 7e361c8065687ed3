//! Lossless compression of a packed trunk (`pack-trunk --compress`): fewer bytes read per
//! token, the same bytes in RAM.
//!
//! Owns: the chunk codec and its part of the trunk format. A layer's bytes are cut into
//! chunks of [`Compression::chunk_bytes`]; each chunk is stored as one record at a
//! 4096-aligned offset: its even-indexed bytes (the low byte of every little-endian bf16: the
//! lowest exponent bit and the mantissa, close to random) as they are, then its odd-indexed
//! bytes (sign and the seven high exponent bits: a handful of values) as 4-bit codes into the
//! chunk's table of its 15 most frequent odd bytes, code 15 meaning "listed among the
//! exceptions" (position and byte), or as they are when that would not be smaller. Decoding
//! reads a record into a per-thread staging buffer and writes the layer's original bytes in
//! one pass (16 pairs per step: a table shuffle and two unpacks on x86_64 with SSSE3), then
//! patches the exceptions. Reads and decoding run as tasks on the trunk's read pool, one per
//! chunk.
//! Must not: change a byte (a record that does not decode consistently - lengths, codes
//! against exceptions - is an error naming the layer and chunk, never zeros), or hold more
//! than one staging record per reader thread.
//! Follows upstream: nothing (the C engine reads raw layers; the seed article rejects LOSSY
//! trunk quantization, which this is not). Splitting float weights into byte planes and
//! entropy-coding the exponent bytes is the usual trick; a 16-entry code instead of Huffman
//! trades ~8% of the size for a decode that costs almost nothing on two cores (zstd's Huffman
//! on the same planes: docs/PERFORMANCE.md, "Eleventh session").

use std::sync::Mutex;

use super::StreamError;
use super::aligned::{AlignedBuf, HUGE_PAGE, IO_ALIGN, align_up};
use super::direct::{DirectFile, ReadPool};

/// The codec name written into `trunk.json`.
pub const CODEC: &str = "bytesplit-nibble";
/// Raw bytes per chunk (the last chunk of a layer may be shorter).
pub const CHUNK_BYTES: u64 = 2 << 20;
/// The escape code: the odd byte is in the record's exception list.
const ESCAPE: u8 = 15;
/// Bytes of a coded odd plane's header: the exception count (u32 LE) and the 16-byte table.
const CODED_HEADER: usize = 4 + 16;

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
    /// Stored bytes of the odd-byte plane.
    pub hi: u64,
    /// Whether the odd-byte plane is coded (else stored as it is).
    pub z: bool,
}

/// Lengths of a chunk's even-byte and odd-byte planes.
pub fn planes(raw_len: usize) -> (usize, usize) {
    (raw_len.div_ceil(2), raw_len / 2)
}

/// Bytes of a chunk's record.
pub fn record_len(raw_len: usize, c: &StoredChunk) -> usize {
    planes(raw_len).0 + c.hi as usize
}

/// Raw length of chunk `i` of a `size`-byte layer.
pub fn chunk_raw_len(size: u64, chunk_bytes: u64, i: usize) -> usize {
    let start = i as u64 * chunk_bytes;
    size.saturating_sub(start).min(chunk_bytes) as usize
}

/// Bytes of a coded odd plane of `hi_len` bytes with `n_exc` exceptions.
pub fn coded_len(hi_len: usize, n_exc: usize) -> usize {
    CODED_HEADER + hi_len.div_ceil(2) + 5 * n_exc
}

/// Encodes chunks (one per pack thread).
#[derive(Debug, Default)]
pub struct Encoder {
    hi: Vec<u8>,
}

impl Encoder {
    pub fn new() -> Self {
        Self::default()
    }

    /// Encode `raw` into `out` (cleared first): the record's bytes, the stored length of its
    /// odd plane and whether that plane is coded. Deterministic: the same bytes give the same
    /// record.
    pub fn encode(&mut self, raw: &[u8], out: &mut Vec<u8>) -> (u64, bool) {
        out.clear();
        self.hi.clear();
        out.extend(raw.iter().step_by(2));
        self.hi.extend(raw.iter().skip(1).step_by(2));
        let hi = &self.hi;
        let mut counts = [0u64; 256];
        for &b in hi {
            counts[b as usize] += 1;
        }
        // The 15 most frequent bytes (ties: the smaller byte first) get codes 0..15.
        let mut order: Vec<u8> = (0..=255u8).filter(|&b| counts[b as usize] > 0).collect();
        order.sort_by_key(|&b| (std::cmp::Reverse(counts[b as usize]), b));
        order.truncate(ESCAPE as usize);
        let mut table = [0u8; 16];
        let mut code = [ESCAPE; 256];
        for (i, &b) in order.iter().enumerate() {
            table[i] = b;
            code[b as usize] = i as u8;
        }
        let n_exc: usize = hi.iter().filter(|&&b| code[b as usize] == ESCAPE).count();
        let coded = coded_len(hi.len(), n_exc);
        if coded >= hi.len() {
            out.extend_from_slice(hi);
            return (hi.len() as u64, false);
        }
        out.extend_from_slice(&(n_exc as u32).to_le_bytes());
        out.extend_from_slice(&table);
        for pair in hi.chunks(2) {
            let a = code[pair[0] as usize];
            let b = pair.get(1).map_or(0, |&x| code[x as usize]);
            out.push(a | b << 4);
        }
        let escapes = || {
            hi.iter()
                .enumerate()
                .filter(|&(_, &b)| code[b as usize] == ESCAPE)
        };
        for (k, _) in escapes() {
            out.extend_from_slice(&(k as u32).to_le_bytes());
        }
        out.extend(escapes().map(|(_, &b)| b));
        (coded as u64, true)
    }
}

/// Write the pairs of `lo` (the even bytes) and the odd bytes `table[code]` of the 4-bit
/// codes in `nibbles` (two per byte, low nibble first) into `dst` (`2 * n` bytes for `n`
/// codes, `lo.len() >= n`); returns how many codes were [`ESCAPE`].
fn expand(lo: &[u8], nibbles: &[u8], table: &[u8; 16], dst: &mut [u8]) -> usize {
    let n = dst.len() / 2;
    let done = expand_simd(lo, nibbles, table, dst);
    let mut escapes = done.1;
    for k in done.0..n {
        let c = (nibbles[k / 2] >> (4 * (k % 2))) & 0x0F;
        escapes += usize::from(c == ESCAPE);
        dst[2 * k] = lo[k];
        dst[2 * k + 1] = table[c as usize];
    }
    escapes
}

/// [`expand`] for whole blocks of 16 codes; returns (codes done, escapes among them).
#[cfg(target_arch = "x86_64")]
fn expand_simd(lo: &[u8], nibbles: &[u8], table: &[u8; 16], dst: &mut [u8]) -> (usize, usize) {
    if !std::arch::is_x86_feature_detected!("ssse3") {
        return (0, 0);
    }
    // SAFETY: SSSE3 was detected just above.
    unsafe { expand_ssse3(lo, nibbles, table, dst) }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "ssse3")]
fn expand_ssse3(lo: &[u8], nibbles: &[u8], table: &[u8; 16], dst: &mut [u8]) -> (usize, usize) {
    use std::arch::x86_64::{
        __m128i, _mm_and_si128, _mm_cmpeq_epi8, _mm_loadl_epi64, _mm_loadu_si128,
        _mm_movemask_epi8, _mm_set1_epi8, _mm_sfence, _mm_shuffle_epi8, _mm_srli_epi16,
        _mm_storeu_si128, _mm_stream_si128, _mm_unpackhi_epi8, _mm_unpacklo_epi8,
    };
    let n = dst.len() / 2;
    let blocks = n.min(lo.len()).min(nibbles.len() * 2) / 16;
    let stream = (dst.as_ptr() as usize).is_multiple_of(16);
    let mut escapes = 0usize;
    // SAFETY (whole block): SSSE3 is enabled for this function; block `b` reads
    // lo[16b..16b+16], nibbles[8b..8b+8] and the 16-byte table, and writes dst[32b..32b+32],
    // all in bounds by `blocks`; streaming stores only when dst is 16-byte aligned.
    unsafe {
        let lut = _mm_loadu_si128(table.as_ptr().cast::<__m128i>());
        let low4 = _mm_set1_epi8(0x0F);
        let esc = _mm_set1_epi8(ESCAPE as i8);
        for b in 0..blocks {
            let nib = _mm_loadl_epi64(nibbles.as_ptr().add(8 * b).cast::<__m128i>());
            let codes = _mm_unpacklo_epi8(
                _mm_and_si128(nib, low4),
                _mm_and_si128(_mm_srli_epi16(nib, 4), low4),
            );
            escapes += _mm_movemask_epi8(_mm_cmpeq_epi8(codes, esc)).count_ones() as usize;
            let h = _mm_shuffle_epi8(lut, codes);
            let l = _mm_loadu_si128(lo.as_ptr().add(16 * b).cast::<__m128i>());
            let d = dst.as_mut_ptr().add(32 * b).cast::<__m128i>();
            if stream {
                _mm_stream_si128(d, _mm_unpacklo_epi8(l, h));
                _mm_stream_si128(d.add(1), _mm_unpackhi_epi8(l, h));
            } else {
                _mm_storeu_si128(d, _mm_unpacklo_epi8(l, h));
                _mm_storeu_si128(d.add(1), _mm_unpackhi_epi8(l, h));
            }
        }
        // Orders the streaming stores before the exception patches and the hand-over.
        _mm_sfence();
    }
    (blocks * 16, escapes)
}

#[cfg(not(target_arch = "x86_64"))]
fn expand_simd(_lo: &[u8], _nibbles: &[u8], _table: &[u8; 16], _dst: &mut [u8]) -> (usize, usize) {
    (0, 0)
}

/// Decode one record (`rec`, exactly [`record_len`] bytes) of a `dst.len()`-byte chunk into
/// `dst`. Errors say what did not match.
pub fn decode(rec: &[u8], c: &StoredChunk, dst: &mut [u8]) -> Result<(), String> {
    let (lo_len, hi_len) = planes(dst.len());
    if rec.len() != lo_len + c.hi as usize {
        return Err(format!(
            "record of {} bytes, expected {}",
            rec.len(),
            lo_len + c.hi as usize
        ));
    }
    let (lo, stored_hi) = rec.split_at(lo_len);
    if !c.z {
        if stored_hi.len() != hi_len {
            return Err(format!(
                "stored odd-byte plane of {} bytes, expected {hi_len}",
                stored_hi.len()
            ));
        }
        for (k, d) in dst.iter_mut().enumerate() {
            *d = if k % 2 == 0 {
                lo[k / 2]
            } else {
                stored_hi[k / 2]
            };
        }
        return Ok(());
    }
    if stored_hi.len() < CODED_HEADER {
        return Err(format!("coded odd-byte plane of {} bytes", stored_hi.len()));
    }
    let (head, rest) = stored_hi.split_at(CODED_HEADER);
    let n_exc = u32::from_le_bytes([head[0], head[1], head[2], head[3]]) as usize;
    let mut table = [0u8; 16];
    table.copy_from_slice(&head[4..]);
    if stored_hi.len() != coded_len(hi_len, n_exc) {
        return Err(format!(
            "coded odd-byte plane of {} bytes, expected {} for {n_exc} exceptions",
            stored_hi.len(),
            coded_len(hi_len, n_exc)
        ));
    }
    let (nibbles, exc) = rest.split_at(hi_len.div_ceil(2));
    let (positions, values) = exc.split_at(4 * n_exc);
    let escapes = expand(lo, nibbles, &table, &mut dst[..2 * hi_len]);
    if lo_len > hi_len {
        dst[2 * hi_len] = lo[hi_len];
    }
    if escapes != n_exc {
        return Err(format!(
            "{escapes} escape codes but {n_exc} exceptions listed"
        ));
    }
    let mut prev: Option<usize> = None;
    for (p, &v) in positions.chunks_exact(4).zip(values) {
        let k = u32::from_le_bytes([p[0], p[1], p[2], p[3]]) as usize;
        let code = nibbles.get(k / 2).map(|n| (n >> (4 * (k % 2))) & 0x0F);
        if k >= hi_len || prev.is_some_and(|q| q >= k) || code != Some(ESCAPE) {
            return Err(format!(
                "exception at odd-plane byte {k} is out of order, out of range or not escaped"
            ));
        }
        dst[2 * k + 1] = v;
        prev = Some(k);
    }
    Ok(())
}

/// Staging buffers for records: a task takes one for its read and decode and gives it back,
/// so at most one per reader thread exists ([`Staging::bytes_for`] is what the trunk takes
/// from its budget for them).
#[derive(Debug)]
pub struct Staging {
    free: Mutex<Vec<AlignedBuf>>,
    len: usize,
}

impl Staging {
    /// Buffers for records of `chunk_bytes`-byte chunks (a record is never longer than its
    /// chunk): at least one 2 MiB page each, since O_DIRECT reads into 4 KiB pages ran at half
    /// the rate on the development VM (docs/PERFORMANCE.md, `AlignedBuf::carve`).
    pub fn new(chunk_bytes: u64) -> Self {
        Self {
            free: Mutex::new(Vec::new()),
            len: Self::buffer_len(chunk_bytes),
        }
    }

    fn buffer_len(chunk_bytes: u64) -> usize {
        (align_up(chunk_bytes, IO_ALIGN as u64) as usize).max(HUGE_PAGE)
    }

    /// The most staging memory `depth` reader threads can hold.
    pub fn bytes_for(depth: usize, chunk_bytes: u64) -> u64 {
        (depth * Self::buffer_len(chunk_bytes)) as u64
    }

    fn take(&self) -> Result<AlignedBuf, StreamError> {
        if let Some(b) = self.free.lock().unwrap_or_else(|p| p.into_inner()).pop() {
            return Ok(b);
        }
        AlignedBuf::new(self.len).map_err(|e| {
            StreamError::Invalid(format!("cannot allocate a trunk staging buffer: {e}"))
        })
    }

    fn give_back(&self, b: AlignedBuf) {
        self.free.lock().unwrap_or_else(|p| p.into_inner()).push(b);
    }

    /// Free the idle buffers (e.g. once a fully pinned trunk is loaded).
    pub fn release(&self) {
        self.free.lock().unwrap_or_else(|p| p.into_inner()).clear();
    }
}

/// Read chunk `i` of the layer at `offset` and decode it into `dst`.
fn read_chunk(
    file: &DirectFile,
    staging: &Staging,
    offset: u64,
    layer: usize,
    i: usize,
    c: &StoredChunk,
    dst: &mut [u8],
) -> Result<(), StreamError> {
    let rec_len = record_len(dst.len(), c);
    let at = offset + c.at;
    let span = file.span(at, rec_len);
    let mut buf = staging.take()?;
    let result = if buf.capacity() < span.len {
        Err(StreamError::Invalid(format!(
            "layer {layer}, chunk {i}: a {}-byte record does not fit the {}-byte staging buffer",
            span.len,
            buf.capacity()
        )))
    } else {
        file.read_into(at, rec_len, buf.full_mut())
            .and_then(|lead| {
                decode(&buf.full()[lead..lead + rec_len], c, dst).map_err(|msg| StreamError::Trunk {
                path: file.path().display().to_string(),
                msg: format!(
                    "layer {layer}, chunk {i} (record at byte {at}, {rec_len} bytes): {msg}; the \
                     file is damaged: pack again"
                ),
            })
            })
    };
    staging.give_back(buf);
    result
}

/// One layer to read and decode: its offset, stored form, raw size and destination.
pub struct LayerRead<'a> {
    pub layer: usize,
    pub offset: u64,
    pub size: u64,
    pub stored: &'a StoredLayer,
    /// At least `size` bytes; the layer lands at index 0.
    pub dst: &'a mut [u8],
}

/// Read and decode every chunk of `layers` on `pool` (one task per chunk, issued in file
/// order); returns the disk bytes read (aligned record spans).
pub fn read_layers(
    pool: &ReadPool,
    file: &DirectFile,
    staging: &Staging,
    chunk_bytes: u64,
    layers: Vec<LayerRead<'_>>,
) -> Result<u64, StreamError> {
    let mut outs: Vec<Option<Result<(), StreamError>>> = Vec::new();
    let mut bytes = 0u64;
    let mut jobs = Vec::new();
    for lr in layers {
        let n = lr.size.div_ceil(chunk_bytes) as usize;
        if lr.stored.chunks.len() != n || (lr.dst.len() as u64) < lr.size {
            return Err(StreamError::Invalid(format!(
                "layer {}: {} stored chunks for {} bytes in {}-byte chunks, destination {} bytes",
                lr.layer,
                lr.stored.chunks.len(),
                lr.size,
                chunk_bytes,
                lr.dst.len()
            )));
        }
        let dst = &mut lr.dst[..lr.size as usize];
        for ((i, c), d) in lr
            .stored
            .chunks
            .iter()
            .enumerate()
            .zip(dst.chunks_mut(chunk_bytes as usize))
        {
            bytes += file.span(lr.offset + c.at, record_len(d.len(), c)).len as u64;
            jobs.push((lr.layer, lr.offset, i, c, d));
        }
    }
    outs.resize_with(jobs.len(), || None);
    {
        let mut tasks: Vec<Box<dyn FnOnce() + Send + '_>> = Vec::with_capacity(jobs.len());
        for ((layer, offset, i, c, d), out) in jobs.into_iter().zip(outs.iter_mut()) {
            tasks.push(Box::new(move || {
                *out = Some(read_chunk(file, staging, offset, layer, i, c, d));
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

/// Disk bytes one read of a stored layer takes (aligned record spans).
pub fn disk_bytes(
    file: &DirectFile,
    offset: u64,
    size: u64,
    chunk_bytes: u64,
    s: &StoredLayer,
) -> u64 {
    s.chunks
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let raw = chunk_raw_len(size, chunk_bytes, i);
            file.span(offset + c.at, record_len(raw, c)).len as u64
        })
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn round_trip(raw: &[u8]) -> (u64, bool) {
        let mut enc = Encoder::new();
        let mut rec = Vec::new();
        let (hi, z) = enc.encode(raw, &mut rec);
        let c = StoredChunk { at: 0, hi, z };
        assert_eq!(rec.len(), record_len(raw.len(), &c));
        let mut dst = vec![0xAAu8; raw.len()];
        decode(&rec, &c, &mut dst).unwrap();
        assert_eq!(dst, raw);
        // Into an unaligned destination too (no streaming stores).
        let mut odd = vec![0x55u8; raw.len() + 1];
        decode(&rec, &c, &mut odd[1..]).unwrap();
        assert_eq!(&odd[1..], raw);
        // Deterministic.
        let mut rec2 = Vec::new();
        enc.encode(raw, &mut rec2);
        assert_eq!(rec, rec2);
        (hi, z)
    }

    #[test]
    fn bf16_like_bytes_compress_and_round_trip() {
        // Sign and exponent bytes from a narrow range, mantissa bytes spread: compressible.
        let mut x = 12345u32;
        let raw: Vec<u8> = (0..40_001)
            .map(|i| {
                x = x.wrapping_mul(1_103_515_245).wrapping_add(12345);
                if i % 2 == 1 {
                    0x3C + ((x >> 16) % 3) as u8 + if x & 1 << 30 != 0 { 0x80 } else { 0 }
                } else {
                    (x >> 8) as u8
                }
            })
            .collect();
        let (hi, z) = round_trip(&raw);
        assert!(z, "a six-value plane must be coded");
        assert_eq!(hi as usize, coded_len(raw.len() / 2, 0));
    }

    #[test]
    fn random_bytes_are_stored_raw_and_odd_lengths_work() {
        let mut x = 7u64;
        let raw: Vec<u8> = (0..9_999)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect();
        let (hi, z) = round_trip(&raw);
        assert!(!z);
        assert_eq!(hi, (raw.len() / 2) as u64);
        round_trip(&[]);
        round_trip(&[5]);
        round_trip(&[5, 6, 7]);
    }

    #[test]
    fn every_length_and_table_size_round_trips() {
        // Lengths around the 16-code SIMD blocks, odd and even; 1..=40 distinct odd bytes
        // (below, at and above the 15-entry table).
        for n in 0..140usize {
            for distinct in [1usize, 2, 15, 16, 40] {
                let raw: Vec<u8> = (0..n)
                    .map(|i| {
                        if i % 2 == 1 {
                            0x38 + ((i * 7 / 2) % distinct) as u8
                        } else {
                            (i * 37 + 11) as u8
                        }
                    })
                    .collect();
                round_trip(&raw);
            }
        }
    }

    #[test]
    fn a_damaged_record_is_an_error_not_zeros() {
        // 20 distinct odd bytes: the 5 rare ones are exceptions.
        let raw: Vec<u8> = (0..20_000usize)
            .map(|i| {
                if i % 2 == 1 && i / 2 % 100 < 95 {
                    0x30 + (i / 2 % 15) as u8
                } else if i % 2 == 1 {
                    0x50 + (i / 2 % 5) as u8
                } else {
                    i as u8
                }
            })
            .collect();
        let mut enc = Encoder::new();
        let mut rec = Vec::new();
        let (hi, z) = enc.encode(&raw, &mut rec);
        assert!(z);
        let c = StoredChunk { at: 0, hi, z };
        let mut dst = vec![0u8; raw.len()];
        decode(&rec, &c, &mut dst).unwrap();
        assert_eq!(dst, raw);
        let lo_len = planes(raw.len()).0;
        let nib = lo_len + CODED_HEADER;
        // A common byte's code turned into the escape: the escape count no longer matches.
        assert_ne!(rec[nib] & 0x0F, ESCAPE);
        let mut bad = rec.clone();
        bad[nib] |= ESCAPE;
        assert!(decode(&bad, &c, &mut dst).is_err());
        // An exception position moved out of order.
        let exc = nib + planes(raw.len()).1.div_ceil(2);
        let mut bad = rec.clone();
        bad[exc + 4..exc + 8].copy_from_slice(&0u32.to_le_bytes());
        assert!(decode(&bad, &c, &mut dst).is_err());
        // A wrong exception count.
        let mut bad = rec.clone();
        bad[lo_len] ^= 1;
        assert!(decode(&bad, &c, &mut dst).is_err());
        // A truncated record.
        assert!(decode(&rec[..rec.len() - 1], &c, &mut dst).is_err());
        // A chunk of another length.
        let mut short = vec![0u8; raw.len() - 2];
        assert!(decode(&rec, &c, &mut short).is_err());
    }
}
