//! A pipeline across processes: rank r runs a contiguous range of layers and passes each
//! token's residual carry on to rank r + 1 (docs/SCALE-OUT.md).
//!
//! Owns: the split of the layers over the ranks ([`split`]), one rank's trunk ([`trunk`]), the
//! messages ([`wire`]), and the two drivers: [`run_first`] on rank 0 (the request, the
//! embedding, its own layers, the schedule that keeps one item of every sequence in flight so
//! the ranks work at once, the ids that come back) and [`run_worker`] on every other rank (its
//! layers; the last rank also the output head and the greedy id). Also the start-up handshake
//! (every rank says whether it loaded its layers before any token moves) and the per-rank
//! reports. Must not: know how bytes travel (a [`Link`]: MPI in the `k3-run` binary with the
//! `mpi` feature, channels in the tests), or compute anything the single-process executor
//! does not: the stages call [`Executor::stage_embed`], [`Executor::stage_layers`] and
//! [`Executor::stage_outputs`], the same kernels on the same bytes, so the ids and logit bits
//! are those of one process at every split and batch size.

pub mod local;
pub mod split;
pub mod trunk;
pub mod wire;

use std::collections::HashMap;
use std::ops::Range;
use std::time::Instant;

use k3_kernels::ops;
use k3_models::spec::ModelSpec;

use crate::exec::{ExecError, Executor, Providers, SeqState, TokenCarry};
use crate::run::{BatchResult, GenResult, logits_hash};
pub use split::{Split, SplitError, split_layers};
pub use wire::{Msg, WireError};

/// How ranks reach each other. Sends must not wait for the receiver to take the message
/// (MPI: buffered sends); receives block until a message arrives or the link gives up.
pub trait Link {
    fn rank(&self) -> usize;
    fn size(&self) -> usize;
    fn send(&mut self, to: usize, bytes: &[u8]) -> Result<(), String>;
    fn recv_from(&mut self, from: usize) -> Result<Vec<u8>, String>;
    /// The next message from any rank, with its sender.
    fn recv_any(&mut self) -> Result<(usize, Vec<u8>), String>;
}

/// Why a pipeline run stopped.
#[derive(Debug, thiserror::Error)]
pub enum PipeError {
    #[error("pipeline link: {0}")]
    Link(String),
    #[error(transparent)]
    Wire(#[from] WireError),
    #[error(transparent)]
    Exec(#[from] ExecError),
    /// Another rank failed (its own message).
    #[error("rank {rank}: {msg}")]
    Rank { rank: usize, msg: String },
    /// Ranks that could not load their layers (rank, message), reported on rank 0.
    #[error("{}", load_failures(.0))]
    Load(Vec<(usize, String)>),
    /// Rank 0 ended the run before it started (another rank could not load).
    #[error("rank 0 stopped the pipeline before the run (another rank could not load its layers)")]
    Stopped,
    #[error("pipeline protocol: {0}")]
    Protocol(String),
}

fn load_failures(v: &[(usize, String)]) -> String {
    v.iter()
        .map(|(r, m)| format!("rank {r} could not load its layers: {m}"))
        .collect::<Vec<_>>()
        .join("; ")
}

/// What one rank did, for the report.
#[derive(Clone, Debug, Default, serde::Serialize, serde::Deserialize)]
pub struct RankReport {
    pub rank: usize,
    pub layers: (usize, usize),
    pub pinned_layers: usize,
    /// Work items (one sequence's tokens) this rank ran, and their tokens.
    pub items: u64,
    pub tokens: u64,
    /// Seconds in this rank's layers (and embedding / output head).
    pub compute_seconds: f64,
    /// Seconds waiting for a message.
    pub wait_seconds: f64,
    /// Seconds handing messages to the link.
    pub send_seconds: f64,
    pub bytes_sent: u64,
    pub bytes_received: u64,
    /// Trunk bytes pinned at start and the seconds the load took.
    pub trunk_pinned_bytes: u64,
    pub trunk_load_seconds: f64,
    /// Trunk bytes served per token from the memory maps (0 when every layer is pinned).
    pub trunk_bytes_read: u64,
    pub expert_requests: u64,
    pub expert_hits: u64,
    pub expert_bytes_read: u64,
    pub expert_read_seconds: f64,
    pub peak_rss_bytes: u64,
}

/// The whole pipeline's report (rank 0).
#[derive(Clone, Debug, Default, serde::Serialize, serde::Deserialize)]
pub struct PipelineReport {
    pub ranks: Vec<RankReport>,
    /// Wall seconds of the run (after the handshake and the hop measurement).
    pub seconds: f64,
    /// Ids generated, all sequences, and per second of wall time.
    pub generated: u64,
    pub tokens_per_second: f64,
    /// Median one-way seconds of a message of one hidden state from rank 0 to rank 1 and
    /// back (half the round trip), and its size; 0 with one rank.
    pub hop_seconds: f64,
    pub hop_bytes: u64,
    /// The same for a message the size of one token's largest carry (the partial sum and
    /// every block sum a token can carry: what crosses a hop near the last layer).
    #[serde(default)]
    pub carry_hop_seconds: f64,
    #[serde(default)]
    pub carry_hop_bytes: u64,
}

/// One rank's executor, providers, layers and per-sequence states.
pub struct Stage<'s, 'c> {
    pub exec: Executor<'s>,
    pub providers: Providers<'c>,
    pub layers: Range<usize>,
    pub pinned_layers: usize,
    spec: &'s ModelSpec,
    states: HashMap<u32, SeqState>,
    report: RankReport,
    trunk_read_before: u64,
    expert_before: crate::weights::ExpertStats,
}

impl<'s, 'c> Stage<'s, 'c> {
    pub fn new(
        spec: &'s ModelSpec,
        exec: Executor<'s>,
        providers: Providers<'c>,
        layers: Range<usize>,
        pinned_layers: usize,
    ) -> Stage<'s, 'c> {
        let t = providers.trunk.stats();
        let report = RankReport {
            layers: (layers.start, layers.end),
            pinned_layers,
            trunk_pinned_bytes: t.pinned_bytes,
            trunk_load_seconds: t.pinned_load_seconds,
            ..RankReport::default()
        };
        Stage {
            trunk_read_before: t.bytes_read,
            expert_before: providers.experts.stats(),
            exec,
            providers,
            layers,
            pinned_layers,
            spec,
            states: HashMap::new(),
            report,
        }
    }

    /// This rank's layers on `carries` (tokens of sequence `seq` from position `pos`).
    fn run_layers(
        &mut self,
        seq: u32,
        pos: u32,
        carries: Vec<TokenCarry>,
    ) -> Result<Vec<TokenCarry>, PipeError> {
        let spec = self.spec;
        let st = self
            .states
            .entry(seq)
            .or_insert_with(|| SeqState::new(spec));
        if st.n_pos != pos as usize {
            return Err(PipeError::Protocol(format!(
                "sequence {seq} arrived at position {pos}, this rank is at {}",
                st.n_pos
            )));
        }
        let t = Instant::now();
        let n = carries.len();
        let out = self.exec.stage_layers(
            self.layers.clone(),
            &[n],
            std::slice::from_mut(st),
            carries,
            &mut self.providers,
        )?;
        self.report.compute_seconds += t.elapsed().as_secs_f64();
        self.report.items += 1;
        self.report.tokens += n as u64;
        Ok(out)
    }

    /// The last rank's end of an item: the logits after its last token, the greedy id.
    fn finish(
        &mut self,
        seq: u32,
        emit: bool,
        want_logits: bool,
        carries: Vec<TokenCarry>,
    ) -> Result<Msg, PipeError> {
        let t = Instant::now();
        let v = self.spec.vocab_size;
        let mut logits = vec![0.0f32; v];
        let last = carries.len() - 1;
        self.exec
            .stage_outputs(carries, &[last], &mut self.providers, &mut [&mut logits])?;
        let pos = self.states.get(&seq).map_or(0, |s| s.n_pos);
        crate::exec::check_finite(&logits, pos)?;
        let id = ops::argmax(&logits) as u32;
        let hash = fnv64(&logits);
        self.report.compute_seconds += t.elapsed().as_secs_f64();
        Ok(Msg::Result {
            seq,
            emit,
            id,
            logits_hash: hash,
            logits: if want_logits { logits } else { Vec::new() },
        })
    }

    /// The report as it stands (counters of the providers since the stage was built).
    pub fn report(&self, rank: usize) -> RankReport {
        let mut r = self.report.clone();
        r.rank = rank;
        r.trunk_bytes_read = self.providers.trunk.stats().bytes_read - self.trunk_read_before;
        let e = self.providers.experts.stats();
        let b = &self.expert_before;
        r.expert_requests = e.requests - b.requests;
        r.expert_hits = e.hits - b.hits;
        r.expert_bytes_read = e.bytes_read - b.bytes_read;
        r.expert_read_seconds = e.read_seconds - b.read_seconds;
        r.peak_rss_bytes = crate::run::peak_rss_bytes();
        r
    }
}

/// FNV-1a 64 over the little-endian bits (the number [`logits_hash`] prints in hex).
pub fn fnv64(x: &[f32]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for v in x {
        for b in v.to_bits().to_le_bytes() {
            h ^= b as u64;
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    h
}

/// Counting wrapper around a [`Link`]: bytes and seconds into the stage's report.
struct Counted<'l, L: Link + ?Sized> {
    link: &'l mut L,
    report: RankReport,
}

impl<L: Link + ?Sized> Counted<'_, L> {
    fn send(&mut self, to: usize, m: &Msg) -> Result<(), PipeError> {
        let b = m.encode();
        let t = Instant::now();
        self.link.send(to, &b).map_err(PipeError::Link)?;
        self.report.send_seconds += t.elapsed().as_secs_f64();
        self.report.bytes_sent += b.len() as u64;
        Ok(())
    }
    fn recv_from(&mut self, from: usize) -> Result<Msg, PipeError> {
        let t = Instant::now();
        let b = self.link.recv_from(from).map_err(PipeError::Link)?;
        self.report.wait_seconds += t.elapsed().as_secs_f64();
        self.report.bytes_received += b.len() as u64;
        Ok(Msg::decode(&b)?)
    }
    fn recv_any(&mut self) -> Result<(usize, Msg), PipeError> {
        let t = Instant::now();
        let (from, b) = self.link.recv_any().map_err(PipeError::Link)?;
        self.report.wait_seconds += t.elapsed().as_secs_f64();
        self.report.bytes_received += b.len() as u64;
        Ok((from, Msg::decode(&b)?))
    }
}

fn ranges_of(split: &Split) -> Vec<(u32, u32)> {
    split
        .ranges
        .iter()
        .map(|r| (r.start as u32, r.end as u32))
        .collect()
}

/// Rank 0's start: every rank's load status gathered (after each checked rank 0's split
/// against its own), then everyone told to start or to end. `loaded` is rank 0's own status.
pub fn start_first<L: Link + ?Sized>(
    link: &mut L,
    split: &Split,
    n_layers: usize,
    loaded: Result<(), String>,
) -> Result<(), PipeError> {
    let hello = Msg::Hello {
        n_layers: n_layers as u32,
        ranges: ranges_of(split),
    }
    .encode();
    for r in 1..link.size() {
        link.send(r, &hello).map_err(PipeError::Link)?;
    }
    let mut failed = Vec::new();
    if let Err(e) = loaded {
        failed.push((0, e));
    }
    for r in 1..link.size() {
        let b = link.recv_from(r).map_err(PipeError::Link)?;
        match Msg::decode(&b)? {
            Msg::Status { error: None } => {}
            Msg::Status { error: Some(e) } => failed.push((r, e)),
            m => {
                return Err(PipeError::Protocol(format!(
                    "rank {r} sent {m:?} instead of its load status"
                )));
            }
        }
    }
    let go = Msg::Go(failed.is_empty()).encode();
    for r in 1..link.size() {
        link.send(r, &go).map_err(PipeError::Link)?;
    }
    if failed.is_empty() {
        Ok(())
    } else {
        Err(PipeError::Load(failed))
    }
}

/// A worker's start: rank 0's split checked against `split` (this rank's own), its load
/// status sent, and rank 0's decision awaited.
pub fn start_worker<L: Link + ?Sized>(
    link: &mut L,
    split: &Split,
    n_layers: usize,
    loaded: Result<(), String>,
) -> Result<(), PipeError> {
    let b = link.recv_from(0).map_err(PipeError::Link)?;
    let status = match Msg::decode(&b)? {
        Msg::Hello {
            n_layers: n,
            ranges,
        } => {
            if n as usize != n_layers || ranges != ranges_of(split) {
                Err(format!(
                    "rank 0 split {n} layers as {ranges:?}, this rank {n_layers} layers as {:?}: \
                     give every rank the same model, --hosts / --host-gb and --cache-gb",
                    ranges_of(split)
                ))
            } else {
                loaded
            }
        }
        m => {
            return Err(PipeError::Protocol(format!(
                "expected rank 0's split, got {m:?}"
            )));
        }
    };
    link.send(
        0,
        &Msg::Status {
            error: status.clone().err(),
        }
        .encode(),
    )
    .map_err(PipeError::Link)?;
    let b = link.recv_from(0).map_err(PipeError::Link)?;
    match Msg::decode(&b)? {
        Msg::Go(true) => status.map_err(|e| PipeError::Load(vec![(link.rank(), e)])),
        Msg::Go(false) => Err(PipeError::Stopped),
        m => Err(PipeError::Protocol(format!(
            "expected rank 0's go, got {m:?}"
        ))),
    }
}

/// A worker rank's run (rank >= 1), after [`start_worker`]: its layers on every item from
/// rank r - 1 until [`Msg::Stop`]; the last rank returns ids to rank 0. A failure is sent to
/// rank 0 as [`Msg::Error`] before it is returned.
pub fn run_worker<L: Link + ?Sized>(
    link: &mut L,
    stage: &mut Stage<'_, '_>,
) -> Result<(), PipeError> {
    let (rank, size) = (link.rank(), link.size());
    let mut c = Counted {
        link,
        report: RankReport::default(),
    };
    let r = worker_loop(&mut c, stage, rank, size);
    if let Err(e) = &r {
        let what = format!("layers {}..{}: {e}", stage.layers.start, stage.layers.end);
        let _ = c.send(0, &Msg::Error(what));
    }
    r
}

fn worker_loop<L: Link + ?Sized>(
    c: &mut Counted<'_, L>,
    stage: &mut Stage<'_, '_>,
    rank: usize,
    size: usize,
) -> Result<(), PipeError> {
    let last = rank + 1 == size;
    loop {
        match c.recv_from(rank - 1)? {
            Msg::Work {
                seq,
                pos,
                emit,
                want_logits,
                carries,
            } => {
                let out = stage.run_layers(seq, pos, carries)?;
                if last {
                    let m = stage.finish(seq, emit, want_logits, out)?;
                    c.send(0, &m)?;
                } else {
                    c.send(
                        rank + 1,
                        &Msg::Work {
                            seq,
                            pos,
                            emit,
                            want_logits,
                            carries: out,
                        },
                    )?;
                }
            }
            Msg::Ping(b) if rank == 1 => c.send(0, &Msg::Ping(b))?,
            Msg::Stop => {
                if !last {
                    c.send(rank + 1, &Msg::Stop)?;
                }
                let mut r = stage.report(rank);
                let own = &c.report;
                r.wait_seconds = own.wait_seconds;
                r.send_seconds = own.send_seconds;
                r.bytes_sent = own.bytes_sent;
                r.bytes_received = own.bytes_received;
                let json =
                    serde_json::to_string(&r).map_err(|e| PipeError::Protocol(e.to_string()))?;
                c.send(0, &Msg::Report(json))?;
                return Ok(());
            }
            m => {
                return Err(PipeError::Protocol(format!(
                    "rank {rank} got an unexpected {m:?}"
                )));
            }
        }
    }
}

/// What rank 0 runs: several prompts, greedy, `n_gen` ids each (fewer at a stop id).
#[derive(Clone, Debug)]
pub struct PipeRequest {
    pub prompts: Vec<Vec<u32>>,
    pub n_gen: usize,
    pub stop_ids: Vec<u32>,
    /// Round trips of one hidden state between ranks 0 and 1 to time a hop (0: none).
    pub hop_trips: usize,
}

/// Called on rank 0 with (sequence, id) as each id comes back; false stops the run.
pub type OnId<'f> = dyn FnMut(usize, u32) -> bool + 'f;

struct SeqRun {
    fed: usize,
    pos: u32,
    in_flight: bool,
    done: bool,
}

/// The median one-way seconds (half a round trip to rank 1 and back, `trips` times) of a
/// message with a `payload`-byte body, and the message's bytes.
fn time_hop<L: Link + ?Sized>(
    c: &mut Counted<'_, L>,
    payload: usize,
    trips: usize,
) -> Result<(f64, u64), PipeError> {
    let body = vec![0u8; payload];
    let bytes = Msg::Ping(body.clone()).encode().len() as u64;
    let mut v = Vec::with_capacity(trips);
    for _ in 0..trips {
        let t = Instant::now();
        c.send(1, &Msg::Ping(body.clone()))?;
        match c.recv_from(1)? {
            Msg::Ping(_) => v.push(t.elapsed().as_secs_f64() / 2.0),
            Msg::Error(e) => return Err(PipeError::Rank { rank: 1, msg: e }),
            m => return Err(PipeError::Protocol(format!("expected a ping, got {m:?}"))),
        }
    }
    v.sort_by(f64::total_cmp);
    Ok((v[v.len() / 2], bytes))
}

/// Rank 0's run, after [`start_first`]: embeds and runs its layers on one item of every
/// sequence that has none in flight (a prompt chunk, or the last id), sends it to rank 1
/// (with one rank, runs the output head itself), and takes the ids that come back, until
/// every sequence has its ids; then stops the pipeline and gathers the reports. The result
/// has the shape of the single-process batch run (`--out`), ids and first-step logits equal.
pub fn run_first<L: Link + ?Sized>(
    link: &mut L,
    stage: &mut Stage<'_, '_>,
    req: &PipeRequest,
    on_id: &mut OnId<'_>,
) -> Result<(BatchResult, PipelineReport), PipeError> {
    let size = link.size();
    let mut c = Counted {
        link,
        report: RankReport::default(),
    };
    let mut rep = PipelineReport::default();
    if size > 1 && req.hop_trips > 0 {
        let d = stage.spec.d_model;
        let blocks = stage.exec.plan().buffers.max_attn_res_sources;
        (rep.hop_seconds, rep.hop_bytes) = time_hop(&mut c, 4 * d, req.hop_trips)?;
        (rep.carry_hop_seconds, rep.carry_hop_bytes) = time_hop(
            &mut c,
            wire::work_bytes(1, d * (blocks + 1), blocks),
            req.hop_trips,
        )?;
        c.report = RankReport::default();
    }
    let t0 = Instant::now();
    let n = req.prompts.len();
    let mut res = BatchResult::default();
    for p in &req.prompts {
        res.sequences.push(GenResult {
            prompt_ids: p.clone(),
            ..GenResult::default()
        });
    }
    let mut seqs: Vec<SeqRun> = req
        .prompts
        .iter()
        .map(|_| SeqRun {
            fed: 0,
            pos: 0,
            in_flight: false,
            done: false,
        })
        .collect();
    let chunk = stage.exec.prefill_chunk();
    let mut prefilled = 0;
    let mut stopped = false;
    loop {
        // one item of every sequence that has none in flight
        let mut local = Vec::new();
        for (b, s) in seqs.iter_mut().enumerate() {
            if s.in_flight || s.done || stopped {
                continue;
            }
            let p = &req.prompts[b];
            let (tokens, emit, want) = if s.fed < p.len() {
                let end = (s.fed + chunk).min(p.len());
                let t = p[s.fed..end].to_vec();
                s.fed = end;
                (t, end == p.len(), end == p.len())
            } else {
                let last = *res.sequences[b]
                    .generated_ids
                    .last()
                    .expect("a decode item follows an id");
                (vec![last], true, false)
            };
            let t = Instant::now();
            let carries = stage.exec.stage_embed(&[&tokens], &mut stage.providers)?;
            stage.report.compute_seconds += t.elapsed().as_secs_f64();
            let carries = stage.run_layers(b as u32, s.pos, carries)?;
            let pos = s.pos;
            s.pos += tokens.len() as u32;
            s.in_flight = true;
            if size == 1 {
                local.push(stage.finish(b as u32, emit, want, carries)?);
            } else {
                c.send(
                    1,
                    &Msg::Work {
                        seq: b as u32,
                        pos,
                        emit,
                        want_logits: want,
                        carries,
                    },
                )?;
            }
        }
        if seqs.iter().all(|s| !s.in_flight) {
            break;
        }
        let msgs = if size == 1 {
            local
        } else {
            match c.recv_any()? {
                (_, m @ Msg::Result { .. }) => vec![m],
                (rank, Msg::Error(msg)) => return Err(PipeError::Rank { rank, msg }),
                (rank, m) => {
                    return Err(PipeError::Protocol(format!(
                        "rank {rank} sent {m:?} during the run"
                    )));
                }
            }
        };
        for m in msgs {
            let Msg::Result {
                seq,
                emit,
                id,
                logits_hash: _,
                logits,
            } = m
            else {
                unreachable!("only results are kept");
            };
            let b = seq as usize;
            let Some(s) = seqs.get_mut(b).filter(|s| s.in_flight) else {
                return Err(PipeError::Protocol(format!(
                    "a result for sequence {seq}, which has nothing in flight"
                )));
            };
            s.in_flight = false;
            let g = &mut res.sequences[b];
            if !logits.is_empty() {
                g.first_logits_hash = logits_hash(&logits);
                g.first_logits = logits;
                prefilled += 1;
                if prefilled == n {
                    res.prefill_seconds = t0.elapsed().as_secs_f64();
                }
            }
            if !emit {
                continue;
            }
            if req.n_gen == 0 {
                s.done = true;
                continue;
            }
            g.generated_ids.push(id);
            if !on_id(b, id) {
                stopped = true;
                if g.generated_ids.len() < req.n_gen {
                    g.stopped_by = Some("interrupted".into());
                }
            }
            if req.stop_ids.contains(&id) {
                g.stopped_by = Some(format!("stop id {id}"));
                s.done = true;
            } else if g.generated_ids.len() >= req.n_gen {
                s.done = true;
            }
        }
        if stopped {
            for (b, s) in seqs.iter_mut().enumerate() {
                if !s.done && !s.in_flight && res.sequences[b].stopped_by.is_none() {
                    res.sequences[b].stopped_by = Some("interrupted".into());
                }
            }
        }
    }
    rep.seconds = t0.elapsed().as_secs_f64();
    res.total_seconds = rep.seconds;
    rep.generated = res
        .sequences
        .iter()
        .map(|s| s.generated_ids.len() as u64)
        .sum();
    rep.tokens_per_second = rep.generated as f64 / rep.seconds.max(1e-9);
    res.steps = res
        .sequences
        .iter()
        .map(|s| s.generated_ids.len().saturating_sub(1))
        .max()
        .unwrap_or(0);
    res.seconds_per_step = if res.steps > 0 {
        (rep.seconds - res.prefill_seconds) / res.steps as f64
    } else {
        0.0
    };
    // stop the pipeline, gather the reports
    let mut own = stage.report(0);
    if size > 1 {
        c.send(1, &Msg::Stop)?;
    }
    let mut ranks = vec![RankReport::default(); size];
    for (r, slot) in ranks.iter_mut().enumerate().skip(1) {
        match c.recv_from(r)? {
            Msg::Report(json) => {
                *slot = serde_json::from_str(&json)
                    .map_err(|e| PipeError::Protocol(format!("rank {r}'s report: {e}")))?;
            }
            Msg::Error(msg) => return Err(PipeError::Rank { rank: r, msg }),
            m => {
                return Err(PipeError::Protocol(format!(
                    "rank {r} sent {m:?} instead of its report"
                )));
            }
        }
    }
    own.wait_seconds = c.report.wait_seconds;
    own.send_seconds = c.report.send_seconds;
    own.bytes_sent = c.report.bytes_sent;
    own.bytes_received = c.report.bytes_received;
    ranks[0] = own;
    rep.ranks = ranks;
    Ok((res, rep))
}

impl PipelineReport {
    /// The lines `k3-run --pipeline` prints: one per rank, then the whole pipeline.
    pub fn lines(&self) -> Vec<String> {
        let gb = |b: u64| b as f64 / 1e9;
        let mut v: Vec<String> = self
            .ranks
            .iter()
            .map(|r| {
                format!(
                    "rank {}: layers {}..{} ({} pinned): {} items, {} tokens; compute {:.3} s, \
                     wait {:.3} s, send {:.3} s; sent {:.3} MB, received {:.3} MB; trunk pinned \
                     {:.3} GB (loaded in {:.2} s), trunk read during the run {:.3} GB; experts \
                     {} requests, {} hits, {:.3} GB read in {:.3} s; peak RSS {:.3} GB",
                    r.rank,
                    r.layers.0,
                    r.layers.1,
                    r.pinned_layers,
                    r.items,
                    r.tokens,
                    r.compute_seconds,
                    r.wait_seconds,
                    r.send_seconds,
                    r.bytes_sent as f64 / 1e6,
                    r.bytes_received as f64 / 1e6,
                    gb(r.trunk_pinned_bytes),
                    r.trunk_load_seconds,
                    gb(r.trunk_bytes_read),
                    r.expert_requests,
                    r.expert_hits,
                    gb(r.expert_bytes_read),
                    r.expert_read_seconds,
                    gb(r.peak_rss_bytes)
                )
            })
            .collect();
        v.push(format!(
            "pipeline: {} ranks, {} ids in {:.3} s ({:.2} ids/s); hop rank 0 -> 1: {:.1} us one \
             way for {} bytes, {:.1} us for {} bytes (a largest carry) (medians of round trips \
             / 2)",
            self.ranks.len(),
            self.generated,
            self.seconds,
            self.tokens_per_second,
            self.hop_seconds * 1e6,
            self.hop_bytes,
            self.carry_hop_seconds * 1e6,
            self.carry_hop_bytes
        ));
        v
    }
}

/// Where one rank's weights come from.
#[derive(Clone, Debug)]
pub struct RankSettings {
    pub layers: Range<usize>,
    /// Bytes of the rank's layers to pin (the rest served from the memory maps).
    pub trunk_budget: u64,
    /// Expert-cache budget; `None`: routed experts served from the memory maps (only the
    /// rank's own layers' experts are ever touched).
    pub cache_budget: Option<u64>,
    pub io: crate::stream::io_policy::IoPolicy,
}

/// One rank's providers: its layers' trunk ([`trunk::RangeTrunk`]), routed experts (the
/// budgeted cache, or mapped with the rank's own layers' scales checked here), and the
/// global tensors through the maps (rank 0 touches the embedding rows, the last rank
/// lm_head). Returns the providers and the start-up lines.
pub fn rank_providers<'c>(
    spec: &'c ModelSpec,
    ckpt: &'c crate::checkpoint::Checkpoint,
    s: &RankSettings,
) -> Result<(Providers<'c>, usize, Vec<String>), crate::stream::StreamError> {
    use crate::stream::StreamError;
    let mut lines = Vec::new();
    let opts = crate::arena::ArenaOptions {
        o_direct: s.io.o_direct,
        huge_pages: s.io.huge_pages,
        pages: s.io.page_source(),
        read_threads: s.io.read_threads,
        progress: false,
    };
    let t = trunk::RangeTrunk::open(spec, ckpt, s.layers.clone(), s.trunk_budget, &opts)?;
    lines.push(t.startup_line());
    let pinned = t.pinned_layers();
    let experts: Box<dyn crate::weights::ExpertSource + 'c> = match s.cache_budget {
        Some(budget) => {
            let o = crate::stream::experts::ExpertCacheOptions {
                budget_bytes: budget,
                o_direct: s.io.o_direct,
                read_threads: s.io.read_threads,
            };
            let pool = crate::stream::direct::ReadPool::for_policy(&s.io)?;
            let c = crate::stream::experts::ExpertCache::new_with_pool(spec, ckpt, &o, pool)?;
            lines.push(c.startup_line());
            Box::new(c)
        }
        None => {
            for d in &spec.tensors {
                if d.layer.is_some_and(|l| s.layers.contains(&l))
                    && crate::checkpoint::Checkpoint::is_scale(d)
                {
                    ckpt.check_scale_bytes(d, ckpt.bytes(d))
                        .map_err(|e| StreamError::Invalid(e.to_string()))?;
                }
            }
            lines.push(
                "experts: the rank's layers' routed experts from the checkpoint's memory maps"
                    .into(),
            );
            Box::new(crate::resident::ResidentExperts::with_arena(
                spec, ckpt, None,
            ))
        }
    };
    let bind = |e: crate::weights::WeightError| StreamError::Invalid(e.to_string());
    let global =
        Box::new(crate::resident::ResidentGlobal::with_arena(spec, ckpt, None).map_err(bind)?);
    Ok((
        Providers {
            trunk: Box::new(t),
            experts,
            global,
        },
        pinned,
        lines,
    ))
}
