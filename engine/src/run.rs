//! The generation driver: prompt in, greedy ids out, with the report and the `--out` JSON.
//!
//! Owns: the decode loop (incremental or full recompute), timing, the first-step logits, the
//! run report. Must not: know where weights live (it receives [`Providers`]) or parse flags.

use std::time::Instant;

use k3_kernels::ops;
use k3_models::spec::ModelSpec;

use crate::exec::{ExecError, Executor, Providers, SeqState};
use crate::speculate::{SpecStats, Speculation, Speculator};
use crate::weights::WeightError;

/// How to generate.
#[derive(Clone, Debug)]
pub struct GenRequest {
    pub prompt_ids: Vec<u32>,
    pub n_gen: usize,
    /// Keep KV cache and recurrent state between tokens; otherwise every step recomputes the
    /// whole prefix from a fresh state. Both give identical ids and logit bits.
    pub incremental: bool,
    pub stop_ids: Vec<u32>,
}

/// What one generation produced.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct GenResult {
    pub prompt_ids: Vec<u32>,
    pub generated_ids: Vec<u32>,
    /// f32 logits after the last prompt token (the first generated token's distribution).
    #[serde(skip)]
    pub first_logits: Vec<f32>,
    /// FNV-1a 64 of the first-step logit bits (hex), for snapshots.
    pub first_logits_hash: String,
    /// The first step's early-exit logits, `[n_layers, vocab]` (row `l`: after layer `l`;
    /// the last row equals `first_logits`), when asked for ([`GenOptions::layer_logits`]); else empty.
    #[serde(skip)]
    pub layer_logits: Vec<f32>,
    /// The logits after every prompt token, `[prompt_len, vocab]` (teacher forcing over the
    /// prompt: row `i` after `prompt_ids[i]`, each the bits [`Executor::step`] gives; the last
    /// row equals `first_logits`), when asked for ([`GenOptions::prompt_logits`]); else empty.
    #[serde(skip)]
    pub prompt_logits: Vec<f32>,
    /// Wall-clock seconds of the prompt (prefill) phase.
    pub prefill_seconds: f64,
    /// Wall-clock seconds until the first generated token was known.
    pub first_token_seconds: f64,
    /// Mean seconds per generated token after the first.
    pub seconds_per_token: f64,
    pub total_seconds: f64,
    /// Set when the run stopped early (stop id, Ctrl-C).
    pub stopped_by: Option<String>,
}

/// FNV-1a over the little-endian bits of a float slice.
pub fn logits_hash(x: &[f32]) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for v in x {
        for b in v.to_bits().to_le_bytes() {
            h ^= b as u64;
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    format!("{h:016x}")
}

/// Called after every generated token (for the per-token line); return false to stop early.
pub type OnToken<'f> = dyn FnMut(usize, u32, f64) -> bool + 'f;

/// Greedy generation from a fresh state.
pub fn generate(
    spec: &ModelSpec,
    exec: &mut Executor<'_>,
    w: &mut Providers<'_>,
    req: &GenRequest,
    on_token: &mut OnToken<'_>,
) -> Result<GenResult, ExecError> {
    generate_from(spec, exec, w, req, SeqState::new(spec), on_token).map(|(r, _)| r)
}

/// Greedy generation continuing from `start` (a state that has already consumed some prefix,
/// e.g. loaded with `--load-state`). Returns the result and the final state (after every fed
/// token; with `n_gen == 0`, exactly the state after the prompt).
pub fn generate_from(
    spec: &ModelSpec,
    exec: &mut Executor<'_>,
    w: &mut Providers<'_>,
    req: &GenRequest,
    start: SeqState,
    on_token: &mut OnToken<'_>,
) -> Result<(GenResult, SeqState), ExecError> {
    generate_with(spec, exec, w, req, start, GenOptions::default(), on_token)
        .map(|(r, _, st)| (r, st))
}

/// What [`generate_with`] does beyond [`generate_from`]; the default is neither.
#[derive(Clone, Copy, Debug, Default)]
pub struct GenOptions {
    /// Speculate (`--speculate`; incremental requests only, a full-recompute request ignores
    /// it): prompt-lookup guesses verified in one pass each ([`Speculator`]), the same ids,
    /// first-step logits and final state.
    pub speculate: Option<Speculation>,
    /// Also the first step's early-exit logits ([`GenResult::layer_logits`],
    /// `--dump-layer-logits`; the last prompt chunk runs through
    /// [`Executor::prefill_layer_logits`]). Every other output is the same bits.
    pub layer_logits: bool,
    /// Also the logits after every prompt token ([`GenResult::prompt_logits`],
    /// `--dump-prompt-logits`; each chunk runs through [`Executor::prefill_each`], the lm_head
    /// once per prompt token). Every other output is the same bits. Not with `layer_logits`
    /// (the last chunk cannot give both; the CLI refuses the pair).
    pub prompt_logits: bool,
}

/// [`generate_from`] with [`GenOptions`]. Returns the speculation counters when it speculated.
pub fn generate_with(
    spec: &ModelSpec,
    exec: &mut Executor<'_>,
    w: &mut Providers<'_>,
    req: &GenRequest,
    start: SeqState,
    opts: GenOptions,
    on_token: &mut OnToken<'_>,
) -> Result<(GenResult, Option<SpecStats>, SeqState), ExecError> {
    generate_with_drafter(spec, exec, w, req, start, opts, None, on_token)
}

/// [`generate_with`] taking speculative guesses from `drafter` (a `--draft-plugin`) instead of
/// the built-in prompt lookup. The same ids and logit bits whatever it proposes.
#[allow(clippy::too_many_arguments)]
pub fn generate_with_drafter(
    spec: &ModelSpec,
    exec: &mut Executor<'_>,
    w: &mut Providers<'_>,
    req: &GenRequest,
    start: SeqState,
    opts: GenOptions,
    mut drafter: Option<Box<dyn crate::draft::Drafter>>,
    on_token: &mut OnToken<'_>,
) -> Result<(GenResult, Option<SpecStats>, SeqState), ExecError> {
    let t0 = Instant::now();
    let mut logits = vec![0.0f32; spec.vocab_size];
    let mut state = start.clone();
    let mut res = GenResult {
        prompt_ids: req.prompt_ids.clone(),
        ..GenResult::default()
    };
    // Layer-major chunks: a streamed trunk is read once per chunk, not once per prompt token
    // (same bits as feeding token by token; tests/tests/invariance.rs).
    let mut expert_failed = false;
    let mut rows = if opts.layer_logits {
        vec![0.0f32; spec.n_layers * spec.vocab_size]
    } else {
        Vec::new()
    };
    let n_chunks = req.prompt_ids.len().div_ceil(exec.prefill_chunk());
    for (c, chunk) in req.prompt_ids.chunks(exec.prefill_chunk()).enumerate() {
        let fed = if opts.layer_logits && c + 1 == n_chunks {
            exec.prefill_layer_logits(chunk, &mut state, w, &mut logits, &mut rows)
        } else if opts.prompt_logits {
            let mut each = vec![vec![0.0f32; spec.vocab_size]; chunk.len()];
            let fed = exec.prefill_each(chunk, &mut state, w, &mut each);
            if fed.is_ok() {
                for l in &each {
                    res.prompt_logits.extend_from_slice(l);
                }
                if let Some(last) = each.last() {
                    logits.copy_from_slice(last);
                }
            }
            fed
        } else {
            exec.prefill(chunk, &mut state, w, &mut logits)
        };
        match fed {
            Ok(()) => {}
            // A routed expert that could not be loaded: nothing is zeroed; the run reports
            // (no ids) and exits 4 (docs/DESIGN.md §6).
            Err(e @ ExecError::Weight(WeightError::Expert { .. })) => {
                res.stopped_by = Some(format!("expert load failed: {e}"));
                res.total_seconds = t0.elapsed().as_secs_f64();
                return Ok((res, None, state));
            }
            Err(e) => return Err(e),
        }
    }
    res.prefill_seconds = t0.elapsed().as_secs_f64();
    res.first_logits = logits.clone();
    res.first_logits_hash = logits_hash(&logits);
    res.layer_logits = rows;
    let mut sp = opts
        .speculate
        .filter(|_| req.incremental)
        .map(|s| Speculator::new(s).with_drafter(drafter.take()));
    let choose = |l: &[f32]| ops::argmax(l) as u32;
    // Verified guesses still to emit (the logits are already past them).
    let mut queue = std::collections::VecDeque::new();
    let every_id = |res: &GenResult| -> Vec<u32> {
        req.prompt_ids
            .iter()
            .chain(&res.generated_ids)
            .copied()
            .collect()
    };
    let mut decode_seconds = 0.0;
    for i in 0..req.n_gen {
        let (next, guessed) = match queue.pop_front() {
            Some(d) => (d, true),
            None => {
                crate::exec::check_finite(&logits, state.n_pos)?;
                (choose(&logits), false)
            }
        };
        res.generated_ids.push(next);
        let now = t0.elapsed().as_secs_f64();
        if i == 0 {
            res.first_token_seconds = now;
        }
        let keep_going = on_token(i, next, now);
        if req.stop_ids.contains(&next) {
            res.stopped_by = Some(format!("stop id {next}"));
            break;
        }
        if !keep_going {
            res.stopped_by = Some("interrupted".into());
            break;
        }
        if i + 1 == req.n_gen {
            break;
        }
        let ts = Instant::now();
        let stepped: Result<(), ExecError> = match sp.as_mut() {
            // A verified guess: fed already (or pending in the speculator).
            Some(_) if guessed => Ok(()),
            Some(sp) => {
                let room = req.n_gen - (i + 1);
                let context = every_id(&res);
                sp.advance(
                    exec,
                    &mut state,
                    w,
                    next,
                    &context,
                    room,
                    &mut logits,
                    &choose,
                )
                .map(|guesses| queue.extend(guesses))
            }
            None if req.incremental => exec.step(next, &mut state, w, &mut logits),
            None => {
                // full recompute: the starting state fed the whole prefix again
                state = start.clone();
                every_id(&res)
                    .chunks(exec.prefill_chunk())
                    .try_for_each(|chunk| exec.prefill(chunk, &mut state, w, &mut logits))
            }
        };
        decode_seconds += ts.elapsed().as_secs_f64();
        match stepped {
            Ok(()) => {}
            // A routed expert that could not be loaded: nothing is zeroed, the run stops
            // after the ids it could compute and reports (exit 4: docs/DESIGN.md §6).
            Err(e @ ExecError::Weight(WeightError::Expert { .. })) => {
                res.stopped_by = Some(format!("expert load failed: {e}"));
                expert_failed = true;
                break;
            }
            Err(e) => return Err(e),
        }
    }
    if let Some(sp) = sp.as_mut().filter(|_| !expert_failed) {
        sp.finish(exec, &mut state, w, &every_id(&res), start.n_pos)?;
    }
    let n_decode = res.generated_ids.len().saturating_sub(1);
    res.seconds_per_token = if n_decode > 0 {
        decode_seconds / n_decode as f64
    } else {
        0.0
    };
    res.total_seconds = t0.elapsed().as_secs_f64();
    Ok((res, sp.map(|s| s.stats), state))
}

/// Called after every batched step with the (sequence, id) pairs chosen; false stops.
pub type OnStep<'f> = dyn FnMut(usize, &[(usize, u32)]) -> bool + 'f;

/// What a batched generation produced.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct BatchResult {
    /// Per sequence: prompt, greedy ids, first-step logits hash, why it stopped early.
    pub sequences: Vec<GenResult>,
    /// Decode steps run (each feeds every still-active sequence one token).
    pub steps: usize,
    pub prefill_seconds: f64,
    /// Mean seconds per decode step (all active sequences together).
    pub seconds_per_step: f64,
    pub total_seconds: f64,
}

/// Run `f` on the states and logits of the sequences `idx` only (moved out into contiguous
/// slices and back, whatever `f` returns).
fn on_subset<T>(
    states: &mut [SeqState],
    logits: &mut [Vec<f32>],
    idx: &[usize],
    f: impl FnOnce(&mut [SeqState], &mut [Vec<f32>]) -> T,
) -> T {
    let empty = || SeqState {
        layers: Vec::new(),
        n_pos: 0,
    };
    let mut st: Vec<SeqState> = idx
        .iter()
        .map(|&b| std::mem::replace(&mut states[b], empty()))
        .collect();
    let mut lg: Vec<Vec<f32>> = idx
        .iter()
        .map(|&b| std::mem::take(&mut logits[b]))
        .collect();
    let r = f(&mut st, &mut lg);
    for ((&b, s), l) in idx.iter().zip(st).zip(lg) {
        states[b] = s;
        logits[b] = l;
    }
    r
}

/// Greedy generation of several prompts decoded TOGETHER ([`Executor::step_batch`]): the
/// prompts are prefilled together (rounds of about `prefill_chunk` tokens in all, a streamed
/// trunk read once per round), then every step feeds each active sequence its next id, so
/// a streamed trunk is read once per step for all of them. A sequence leaves the batch at a
/// stop id or after `n_gen` ids. Each sequence's ids and first-step hash equal generating it
/// alone. `on_step(i)` runs after step i's ids are chosen; false stops the batch.
pub fn generate_batch(
    spec: &ModelSpec,
    exec: &mut Executor<'_>,
    w: &mut Providers<'_>,
    prompts: &[Vec<u32>],
    n_gen: usize,
    stop_ids: &[u32],
    on_step: &mut OnStep<'_>,
) -> Result<BatchResult, ExecError> {
    let t0 = Instant::now();
    let n = prompts.len();
    let mut states: Vec<SeqState> = (0..n).map(|_| SeqState::new(spec)).collect();
    let mut logits = vec![vec![0.0f32; spec.vocab_size]; n];
    let mut res = BatchResult::default();
    // The prompts together, layer-major, in rounds of about `prefill_chunk` tokens in all: a
    // streamed trunk is read once per round for every prompt.
    let mut fed = vec![0usize; n];
    loop {
        let open: Vec<usize> = (0..n).filter(|&b| fed[b] < prompts[b].len()).collect();
        if open.is_empty() {
            break;
        }
        let per = (exec.prefill_chunk() / open.len()).max(1);
        let parts: Vec<&[u32]> = open
            .iter()
            .map(|&b| &prompts[b][fed[b]..(fed[b] + per).min(prompts[b].len())])
            .collect();
        on_subset(&mut states, &mut logits, &open, |st, lg| {
            exec.prefill_batch(&parts, st, w, lg)
        })?;
        for (&b, p) in open.iter().zip(&parts) {
            fed[b] += p.len();
        }
    }
    for (b, p) in prompts.iter().enumerate() {
        res.sequences.push(GenResult {
            prompt_ids: p.clone(),
            first_logits: logits[b].clone(),
            first_logits_hash: logits_hash(&logits[b]),
            ..GenResult::default()
        });
    }
    res.prefill_seconds = t0.elapsed().as_secs_f64();
    let mut active: Vec<usize> = (0..n).collect();
    let mut decode_seconds = 0.0;
    for i in 0..n_gen {
        let mut chosen = Vec::with_capacity(active.len());
        let mut next_active = Vec::with_capacity(active.len());
        for &b in &active {
            crate::exec::check_finite(&logits[b], states[b].n_pos)?;
            let next = ops::argmax(&logits[b]) as u32;
            res.sequences[b].generated_ids.push(next);
            chosen.push((b, next));
            if stop_ids.contains(&next) {
                res.sequences[b].stopped_by = Some(format!("stop id {next}"));
            } else if i + 1 < n_gen {
                next_active.push(b);
            }
        }
        if !on_step(i, &chosen) {
            for &b in &next_active {
                res.sequences[b].stopped_by = Some("interrupted".into());
            }
            break;
        }
        active = next_active;
        if active.is_empty() {
            break;
        }
        let ts = Instant::now();
        let tokens: Vec<u32> = active
            .iter()
            .map(|&b| *res.sequences[b].generated_ids.last().expect("just pushed"))
            .collect();
        on_subset(&mut states, &mut logits, &active, |st, lg| {
            exec.step_batch(&tokens, st, w, lg)
        })?;
        decode_seconds += ts.elapsed().as_secs_f64();
        res.steps += 1;
    }
    res.seconds_per_step = if res.steps > 0 {
        decode_seconds / res.steps as f64
    } else {
        0.0
    };
    res.total_seconds = t0.elapsed().as_secs_f64();
    Ok(res)
}

/// Teacher forcing: feed `ids` token by token and return the argmax after every position
/// (and the logits if asked).
pub fn teacher_forced(
    spec: &ModelSpec,
    exec: &mut Executor<'_>,
    w: &mut Providers<'_>,
    ids: &[u32],
    keep_logits: bool,
) -> Result<(Vec<u32>, Vec<Vec<f32>>), ExecError> {
    let mut logits = vec![0.0f32; spec.vocab_size];
    let mut state = SeqState::new(spec);
    let mut am = Vec::with_capacity(ids.len());
    let mut all = Vec::new();
    for &t in ids {
        exec.step(t, &mut state, w, &mut logits)?;
        am.push(ops::argmax(&logits) as u32);
        if keep_logits {
            all.push(logits.clone());
        }
    }
    Ok((am, all))
}

/// Peak resident set size of this process in bytes (getrusage; Windows: the peak working
/// set); 0 if unknown.
pub fn peak_rss_bytes() -> u64 {
    crate::platform::peak_rss_bytes().unwrap_or(0)
}
