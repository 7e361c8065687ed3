//! Weight providers: the seam between the executor and where the bytes live.
//!
//! Owns: the traits the executor calls to get a layer's dense-trunk tensors, a set of routed
//! experts, and the global tensors (embedding rows, lm_head, final norms). Must not: compute.
//!
//! Implementations: resident (whole trunk in RAM / mmap), streamed trunk (pinned prefix + ring
//! slots, O_DIRECT), expert cache (byte budget, pluggable eviction). The executor never knows
//! which one it talks to, so output bits cannot depend on it (docs/NUMERICS.md §1).

use k3_models::spec::{ExpertFormat, TensorDecl, TensorRole};

/// Errors a provider can return. Messages name the file and tensor.
#[derive(Debug, thiserror::Error)]
pub enum WeightError {
    #[error("I/O error reading {what} from {path}: {source}")]
    Io {
        what: String,
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("tensor {name}: {msg}")]
    Invalid { name: String, msg: String },
    /// A streamed trunk that cannot serve a layer (the message names the file and layer).
    #[error("{0}")]
    Trunk(String),
    #[error("routed expert {expert} of layer {layer} failed to load: {msg}")]
    Expert {
        layer: usize,
        expert: usize,
        msg: String,
    },
}

/// Widen little-endian bf16 `bytes` exactly into `out` (as many values as both hold).
pub fn widen_bf16_le(bytes: &[u8], out: &mut [f32]) {
    for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
        *o = k3_kernels::reduce::bf16_to_f32(u16::from_le_bytes([c[0], c[1]]));
    }
}

/// The raw checkpoint bytes of one tensor, with its declaration.
#[derive(Clone, Copy, Debug)]
pub struct TensorBytes<'a> {
    pub decl: &'a TensorDecl,
    pub bytes: &'a [u8],
}

/// One layer's dense-trunk tensors (everything but routed experts), looked up by role.
#[derive(Debug, Default)]
pub struct LayerWeights<'a> {
    pub tensors: Vec<TensorBytes<'a>>,
}

impl<'a> LayerWeights<'a> {
    /// The tensor with this role, if the layer has it.
    pub fn get(&self, role: TensorRole) -> Option<TensorBytes<'a>> {
        self.tensors.iter().copied().find(|t| t.decl.role == role)
    }
}

/// One routed expert's tensors: w1 (gate), w3 (up), w2 (down). MXFP4 experts: packed nibbles
/// in `*_packed` and E8M0 scales in `*_scale`. BF16 experts (`format` = `Bf16`): the
/// little-endian bf16 weights in `*_packed`, `*_scale` empty.
#[derive(Clone, Copy, Debug)]
pub struct ExpertWeights<'a> {
    pub expert: usize,
    pub format: ExpertFormat,
    pub w1_packed: &'a [u8],
    pub w1_scale: &'a [u8],
    pub w3_packed: &'a [u8],
    pub w3_scale: &'a [u8],
    pub w2_packed: &'a [u8],
    pub w2_scale: &'a [u8],
}

/// Counters a trunk provider reports (docs/DESIGN.md §3, §6).
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct TrunkStats {
    pub n_layers: usize,
    pub pinned_layers: usize,
    pub pinned_bytes: u64,
    pub ring_slots: usize,
    pub ring_slot_bytes: u64,
    /// The shared ring that replaced a single slot (0: none; see `TrunkPlan`).
    pub shared_ring_bytes: u64,
    pub bytes_read: u64,
    pub read_seconds: f64,
    /// Seconds the executor waited for trunk bytes (the part of read time not overlapped).
    pub wait_seconds: f64,
    pub o_direct: bool,
    pub reader_thread: bool,
    /// Seconds the pinned prefix took to load (0 while a background load runs).
    pub pinned_load_seconds: f64,
    /// Seconds the executor waited for a background pinned load (part of `wait_seconds`).
    pub pinned_wait_seconds: f64,
    /// The pinned prefix loaded on background threads beside start-up and the prompt, not in
    /// the session build.
    pub pinned_background: bool,
    /// Bytes of trunk buffers (pinned prefix, ring) on the reserved huge-page pool
    /// (`vm.nr_hugepages`; I/O policy `reserved_huge_pages`): not in the peak RSS getrusage
    /// reports, and not charged to a memory cgroup.
    pub hugetlb_bytes: u64,
    /// The pinned prefix is held in trunk.bin's page-cache pages (I/O policy
    /// `pinned = "page-cache"`), mapped and locked, not in buffers.
    pub pinned_page_cache: bool,
    /// Bytes of page-cache pinned layers that could not be locked in RAM (`mlock` refused:
    /// RLIMIT_MEMLOCK): served all the same, but the kernel may evict and read them again.
    pub pinned_unlocked_bytes: u64,
    /// Why `mlock` refused (the first refusal), when `pinned_unlocked_bytes` > 0.
    pub pinned_lock_error: Option<String>,
}

/// Counters an expert provider reports (docs/DESIGN.md §4).
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct ExpertStats {
    pub requests: u64,
    pub hits: u64,
    pub misses: u64,
    pub evictions: u64,
    /// Requests served from RAM that was resident before the token asked for them.
    pub resident_hits: u64,
    /// Every expert byte read, demand and prefetch.
    pub bytes_read: u64,
    /// Seconds the executor was blocked on expert reads (demand reads + waits for prefetches).
    pub read_seconds: f64,
    pub load_failures: u64,
    pub budget_bytes: u64,
    /// Experts read ahead by [`ExpertSource::prefetch`].
    pub prefetched: u64,
    /// Requests served by a prefetched expert (raw hits, never resident hits).
    pub prefetch_hits: u64,
    /// Prefetched experts the routing did not pick (or evicted before any use).
    pub prefetch_wasted: u64,
    /// Prefetch reads that failed (the later request reads again and reports).
    pub prefetch_failures: u64,
    pub prefetch_bytes: u64,
    /// Seconds of background prefetch reads (overlapped with compute, or waited for).
    pub prefetch_read_seconds: f64,
    /// Seconds the executor waited for prefetch reads (included in `read_seconds`).
    pub prefetch_wait_seconds: f64,
    /// Requests of layers that had a guess, and how many of those ids the guess contained.
    pub guessed_requests: u64,
    pub guess_covered: u64,
}

impl ExpertStats {
    pub fn resident_hit_rate(&self) -> f64 {
        if self.requests == 0 {
            0.0
        } else {
            self.resident_hits as f64 / self.requests as f64
        }
    }

    /// Fraction of routed ids (in layers with a guess) that the prefetch guess contained.
    pub fn guess_accuracy(&self) -> f64 {
        if self.guessed_requests == 0 {
            0.0
        } else {
            self.guess_covered as f64 / self.guessed_requests as f64
        }
    }
}

/// Supplies each layer's dense-trunk tensors, in the cyclic order 0..n_layers every token.
pub trait TrunkSource: Send {
    /// Make layer `layer`'s trunk tensors available (blocking until they are) and return them.
    /// The view is valid until the next call. Implementations may start reading the next
    /// layer in the background.
    fn layer(&mut self, layer: usize) -> Result<LayerWeights<'_>, WeightError>;
    /// Like [`TrunkSource::layer`], plus the view of layer `peek` when it is already in RAM
    /// without a read (resident, or pinned and loaded); `None` otherwise (the default). Both
    /// views are valid until the next call. Used for the executor's look-ahead expert guess.
    fn layer_and_peek(
        &mut self,
        layer: usize,
        _peek: usize,
    ) -> Result<(LayerWeights<'_>, Option<LayerWeights<'_>>), WeightError> {
        Ok((self.layer(layer)?, None))
    }
    fn stats(&self) -> TrunkStats;
}

/// Supplies routed experts.
pub trait ExpertSource: Send {
    /// Called once per token before the forward pass (lets caches tell resident hits apart).
    fn begin_token(&mut self) {}
    /// Make the given experts of `layer` available (ids ascending, unique) and return them in
    /// the same order. A failed load is an error; the caller decides (exit code 4).
    fn experts(&mut self, layer: usize, ids: &[u32])
    -> Result<Vec<ExpertWeights<'_>>, WeightError>;
    fn stats(&self) -> ExpertStats;
    /// The (layer, expert) request trace, when the provider records one (`--dump-cache-trace`).
    fn trace(&self) -> Option<&[(u32, u32)]> {
        None
    }
    /// Hint (non-binding): `ids` of `layer` will probably be requested soon; a provider may
    /// start reading them in the background. Never changes what `experts` returns.
    fn prefetch(&mut self, _layer: usize, _ids: &[u32]) {}
    /// Like [`ExpertSource::prefetch`], but to be started only after the NEXT
    /// [`ExpertSource::experts`] call has read its own misses (a look-ahead guess for a later
    /// layer must not delay, or evict, the experts the current layer is about to ask for).
    /// Default: nothing.
    fn prefetch_after_next(&mut self, _layer: usize, _ids: &[u32]) {}
    /// `Some(margin)`: the provider wants a guess of the top-(k + margin) experts before each
    /// MoE layer (passed to [`ExpertSource::prefetch`]); `None`: no guesses (default).
    fn prefetch_margin(&self) -> Option<usize> {
        None
    }
    /// `true` when [`ExpertSource::experts`] may block on disk reads: the executor then calls
    /// it from a helper thread while it computes the work that does not need the routed
    /// experts (latent down-projection, shared experts). Default `false` (served from RAM).
    fn reads_block(&self) -> bool {
        false
    }
    /// `true` when an [`ExpertSource::experts`] call for these ids would be served from RAM
    /// now, without waiting for a read (the executor then skips the overlap thread). Default:
    /// `!reads_block()`.
    fn ready(&mut self, _layer: usize, _ids: &[u32]) -> bool {
        !self.reads_block()
    }
    /// `true` when guessed experts are being read in the background, each usable as soon as
    /// its own read lands: the executor then computes the work that does not need the routed
    /// experts first and takes the experts through [`ExpertSource::experts_split`] (computing
    /// those already in RAM while the rest land) instead of waiting for all of them on a
    /// helper thread. Default `false`.
    fn reads_ahead(&self) -> bool {
        false
    }
    /// [`ExpertSource::experts`] in two parts: when some requested experts still have to be
    /// read, the ones in RAM right now (possibly none) first go to `early` (their positions in
    /// `ids` and their views; it may compute with them, or do other work, while the others
    /// are being read), then the call makes the others available and returns them (positions
    /// and views). Every position is in exactly one of the two; bookkeeping (counters, trace,
    /// errors) is that of one `experts` call. Default: `early` is not called.
    fn experts_split(
        &mut self,
        layer: usize,
        ids: &[u32],
        _early: &mut dyn FnMut(&[usize], &[ExpertWeights<'_>]),
    ) -> Result<(Vec<usize>, Vec<ExpertWeights<'_>>), WeightError> {
        let all = self.experts(layer, ids)?;
        Ok(((0..ids.len()).collect(), all))
    }
}

/// Supplies the global tensors.
pub trait GlobalSource: Send {
    /// Write the f32 embedding row of `token` into `out` (exact widening of bf16).
    fn embed_row(&mut self, token: u32, out: &mut [f32]) -> Result<(), WeightError>;
    /// Compute `logits = lm_head · x` (rows = vocab) with the canonical matvec, in chunks if
    /// streamed; the result bits must not depend on the chunking (rows are independent).
    /// [`Self::lm_head_many`] with one input.
    fn lm_head(
        &mut self,
        pool: &k3_kernels::par::Pool,
        x: &[f32],
        logits: &mut [f32],
    ) -> Result<(), WeightError> {
        self.lm_head_many(pool, &[x], &mut [logits])
    }
    /// [`Self::lm_head`] for several inputs: `logits[t] = lm_head · xs[t]`, each bit-identical
    /// to what one input alone gives. Sources should read the matrix once for all inputs (a
    /// verify pass or a batch step wants several positions' logits; real K3's lm_head is
    /// 2.3 GB).
    fn lm_head_many(
        &mut self,
        pool: &k3_kernels::par::Pool,
        xs: &[&[f32]],
        logits: &mut [&mut [f32]],
    ) -> Result<(), WeightError>;
    /// A small global tensor (final norm, output AttnRes proj/norm) as raw bytes.
    fn small(&self, role: TensorRole) -> Option<TensorBytes<'_>>;
}
