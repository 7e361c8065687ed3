//! Continuous batching for the HTTP server (`--serve-batch N`): up to N requests decode
//! together, each step ONE layer-major pass ([`Executor::prefill_batch`]) that fetches every
//! layer once for all of them, so on a streamed trunk N replies cost about one trunk read per
//! step instead of N (docs/DESIGN.md §10, "several sequences share each streamed layer read").
//!
//! Owns: the slots (one [`SeqState`] each, allocated up front, so the start-up state check
//! covers them), admission (a free slot whose fed ids the new prompt extends is reused with
//! `--incremental`, as [`super::session::Session`] does for one conversation), the step
//! (a prompt chunk for slots still prefilling, the last generated id for the others) and the
//! per-request turn ([`TurnDecoder`]: sampling stream, reply parser, stop rules).
//! Must not: HTTP (the server owns the sinks, `S`), model math.
//!
//! Every request's ids are those of the same request served alone: each sequence goes
//! through exactly the operations of a one-token step on its own state, whatever else is in
//! the batch, whenever it was admitted and however its prompt was chunked (tested in
//! `runner/tests/chat_batch.rs` against [`super::session::Session::turn`]).

use std::time::Instant;

use k3_models::spec::ModelSpec;
use k3_text::chat::{Message, RenderOptions};
use k3_text::tokenizer::Tokenizer;

use super::sample::Sampling;
use super::session::{
    Event, Prefill, SessionConfig, SessionError, Stop, TurnDecoder, TurnOutcome, end_of_msg_id,
    prompt_ids,
};
use crate::exec::{ExecError, Executor, Providers, SeqState};

/// One request: the rendered prompt (transcript + generation prompt), its turn settings and
/// the caller's sink (where its text and result go).
#[derive(Debug)]
pub struct Job<S> {
    pub prompt: Vec<u32>,
    pub n_gen: usize,
    pub sampling: Sampling,
    /// 0-based index of the assistant turn (its sampling stream).
    pub turn_index: u64,
    pub sink: S,
}

/// A request that ended: its sink and what its turn did (`records` is `None`: the server
/// keeps no transcript), or why it failed.
#[derive(Debug)]
pub struct Finished<S> {
    pub sink: S,
    pub outcome: Result<TurnOutcome, SessionError>,
    /// The most sequences any step of this request decoded together.
    pub max_batch: usize,
}

/// A request in a slot.
#[derive(Debug)]
struct Running<S> {
    sink: S,
    prompt: Vec<u32>,
    dec: TurnDecoder,
    /// The id generated last, to be fed by the next step (`None` while prefilling).
    pending: Option<u32>,
    prefill: Prefill,
    admitted: Instant,
    decode_start: Option<Instant>,
    max_batch: usize,
}

/// A slot: the ids its state holds and the request using it, if any.
#[derive(Debug)]
struct Slot<S> {
    fed: Vec<u32>,
    run: Option<Running<S>>,
}

/// The scheduler. Slots `0..n_active` hold running requests; `states[i]` and `logits[i]`
/// belong to `slots[i]` (kept in step so that the running states are one slice).
pub struct Batcher<'s, S> {
    spec: &'s ModelSpec,
    tok: Tokenizer,
    opts: RenderOptions,
    cfg: SessionConfig,
    eom: u32,
    n_allowed: usize,
    max_positions: usize,
    slots: Vec<Slot<S>>,
    states: Vec<SeqState>,
    logits: Vec<Vec<f32>>,
    n_active: usize,
}

impl<S> std::fmt::Debug for Batcher<'_, S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Batcher")
            .field("slots", &self.slots.len())
            .field("active", &self.n_active)
            .finish_non_exhaustive()
    }
}

impl<'s, S> Batcher<'s, S> {
    /// `capacity` slots (at least 1) for a context of `max_positions`; thinking, reuse
    /// (`incremental`) and stop ids from `cfg` (its `n_gen`, `sampling` and `speculate` are
    /// not used: every job brings its own, and batched turns do not speculate).
    pub fn new(
        spec: &'s ModelSpec,
        tok: Tokenizer,
        cfg: SessionConfig,
        capacity: usize,
        max_positions: usize,
    ) -> Result<Batcher<'s, S>, SessionError> {
        let eom = end_of_msg_id(spec, &tok)?;
        let n = capacity.max(1);
        Ok(Batcher {
            spec,
            opts: RenderOptions {
                thinking: cfg.thinking,
                ..RenderOptions::default()
            },
            eom,
            n_allowed: spec.vocab_size.min(tok.vocab_size()),
            tok,
            cfg,
            max_positions,
            slots: (0..n)
                .map(|_| Slot {
                    fed: Vec::new(),
                    run: None,
                })
                .collect(),
            states: (0..n).map(|_| SeqState::new(spec)).collect(),
            logits: vec![vec![0.0; spec.vocab_size]; n],
            n_active: 0,
        })
    }

    /// The prompt ids of a request: `messages` (ending with the user's) rendered with the
    /// generation prompt and checked against the vocabulary.
    pub fn render(&self, messages: &[Message]) -> Result<Vec<u32>, SessionError> {
        prompt_ids(self.spec, &self.tok, &self.opts, messages, true)
    }

    /// [`Self::render`] with a request's tools, tool choice and response format.
    pub fn render_with(
        &self,
        messages: &[Message],
        tools: Option<k3_text::pyjson::PyJson>,
        tool_choice: Option<k3_text::chat::ToolChoice>,
        response_format: Option<k3_text::chat::ResponseFormat>,
    ) -> Result<Vec<u32>, SessionError> {
        let opts = RenderOptions {
            tools,
            tool_choice,
            response_format,
            ..self.opts.clone()
        };
        prompt_ids(self.spec, &self.tok, &opts, messages, true)
    }

    /// The tokenizer (for raw prompts).
    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tok
    }

    /// Ids the sampler may draw and a raw prompt may hold: those both the model and the
    /// tokenizer know.
    pub fn n_allowed(&self) -> usize {
        self.n_allowed
    }

    /// End every running request whose sink says its client is gone (`gone`), as
    /// interrupted: its slot is free for the next admission.
    pub fn drop_gone(&mut self, gone: impl Fn(&S) -> bool) -> Vec<Finished<S>> {
        let mut out = Vec::new();
        for i in (0..self.n_active).rev() {
            if self.slots[i].run.as_ref().is_some_and(|r| gone(&r.sink)) {
                out.push(self.finish(i, Ok(Stop::Interrupted)));
            }
        }
        out
    }

    /// Slots in all.
    pub fn capacity(&self) -> usize {
        self.slots.len()
    }

    /// Requests running.
    pub fn active(&self) -> usize {
        self.n_active
    }

    pub fn has_room(&self) -> bool {
        self.n_active < self.slots.len()
    }

    pub fn is_idle(&self) -> bool {
        self.n_active == 0
    }

    /// Swap slot `i` and slot `j` with their states and logits.
    fn swap(&mut self, i: usize, j: usize) {
        self.slots.swap(i, j);
        self.states.swap(i, j);
        self.logits.swap(i, j);
    }

    /// Start `job` in a free slot (call only when [`Self::has_room`]). With `incremental`,
    /// the free slot holding the longest prefix of the prompt keeps its state and only the
    /// rest is fed; otherwise a fresh state. A prompt longer than the context is refused.
    pub fn admit(&mut self, job: Job<S>) -> Result<(), (S, SessionError)> {
        self.admit_as(job, false)
    }

    /// [`Self::admit`] for a raw continuation of `job.prompt` (no chat grammar: see
    /// [`TurnDecoder::raw`]); the prompt's ids must be below [`Self::n_allowed`].
    pub fn admit_raw(&mut self, job: Job<S>) -> Result<(), (S, SessionError)> {
        if let Some(&id) = job.prompt.iter().find(|&&id| id as usize >= self.n_allowed) {
            let vocab = self.n_allowed;
            return Err((
                job.sink,
                SessionError::TokenOutsideModel {
                    id,
                    what: "a prompt id".into(),
                    vocab,
                },
            ));
        }
        self.admit_as(job, true)
    }

    fn admit_as(&mut self, job: Job<S>, raw: bool) -> Result<(), (S, SessionError)> {
        assert!(self.has_room(), "Batcher::admit: every slot is running");
        if job.prompt.len() > self.max_positions {
            return Err((
                job.sink,
                SessionError::ContextTooLong {
                    needed: job.prompt.len(),
                    max: self.max_positions,
                },
            ));
        }
        let cfg = SessionConfig {
            n_gen: job.n_gen,
            sampling: job.sampling,
            ..self.cfg.clone()
        };
        let dec = if raw {
            TurnDecoder::raw(&cfg, job.turn_index, self.n_allowed, self.eom)
        } else {
            match TurnDecoder::new(&self.tok, &cfg, job.turn_index, self.n_allowed, self.eom) {
                Ok(d) => d,
                Err(e) => return Err((job.sink, e)),
            }
        };
        let free = self.n_active..self.slots.len();
        // Reuse needs something left to feed: the logits come from feeding the prompt's tail.
        let extends = |s: &Slot<S>| {
            !s.fed.is_empty() && job.prompt.len() > s.fed.len() && job.prompt.starts_with(&s.fed)
        };
        let reuse = free
            .clone()
            .filter(|&j| self.cfg.incremental && extends(&self.slots[j]))
            .max_by_key(|&j| self.slots[j].fed.len());
        // Otherwise the free slot holding the least, so longer reusable states survive.
        let j = reuse.unwrap_or_else(|| {
            free.min_by_key(|&j| self.slots[j].fed.len())
                .expect("has_room: a free slot")
        });
        if reuse.is_none() {
            self.states[j] = SeqState::new(self.spec);
            self.slots[j].fed.clear();
        }
        let k = self.n_active;
        self.swap(j, k);
        self.n_active += 1;
        let slot = &mut self.slots[k];
        slot.run = Some(Running {
            sink: job.sink,
            prefill: Prefill {
                reused: slot.fed.len(),
                fed: 0,
                total: job.prompt.len(),
                seconds: 0.0,
            },
            prompt: job.prompt,
            dec,
            pending: None,
            admitted: Instant::now(),
            decode_start: None,
            max_batch: 0,
        });
        Ok(())
    }

    /// End running slot `i` with `stop` (or `err`); it becomes free, its state kept for reuse.
    fn finish(&mut self, i: usize, outcome: Result<Stop, SessionError>) -> Finished<S> {
        let run = self.slots[i].run.take().expect("finish: a running slot");
        let last = self.n_active - 1;
        self.swap(i, last);
        self.n_active -= 1;
        let decode_seconds = run.decode_start.map_or(0.0, |t| t.elapsed().as_secs_f64());
        let (reply, generated) = run.dec.finish();
        Finished {
            sink: run.sink,
            outcome: outcome.map(|stop| TurnOutcome {
                stop,
                prefill: run.prefill,
                reply,
                generated,
                decode_seconds,
                records: None,
                speculation: None,
            }),
            max_batch: run.max_batch,
        }
    }

    /// End every running request as interrupted (Ctrl-C).
    pub fn interrupt_all(&mut self) -> Vec<Finished<S>> {
        (0..self.n_active)
            .rev()
            .map(|i| self.finish(i, Ok(Stop::Interrupted)))
            .collect()
    }

    /// After a failed step: every running request's sink (their states are dropped).
    pub fn abort(&mut self) -> Vec<S> {
        let n = self.n_active;
        self.n_active = 0;
        for (slot, st) in self.slots[..n].iter_mut().zip(&mut self.states[..n]) {
            slot.fed.clear();
            *st = SeqState::new(self.spec);
        }
        self.slots[..n]
            .iter_mut()
            .filter_map(|s| s.run.take().map(|r| r.sink))
            .collect()
    }

    /// One step of every running request: prompt chunks for those still prefilling (together
    /// about [`Executor::prefill_chunk`] ids with the decoders' one each), the last generated id for
    /// the others, in ONE layer-major pass; then each request that has logits draws its next
    /// id (its text goes to `emit`, which returns false when the request's client is gone:
    /// it ends as interrupted). Returns the requests that ended. An `Err` is the forward
    /// pass's failure: call [`Self::abort`].
    pub fn step(
        &mut self,
        exec: &mut Executor<'_>,
        w: &mut Providers<'_>,
        emit: &mut dyn FnMut(&mut S, Event<'_>) -> bool,
    ) -> Result<Vec<Finished<S>>, ExecError> {
        let mut done = Vec::new();
        // A decoder whose next id does not fit ends here (the turn's `ContextFull`).
        for i in (0..self.n_active).rev() {
            let run = self.slots[i].run.as_ref().expect("running");
            if run.pending.is_some() && self.states[i].n_pos >= self.max_positions {
                let max = self.max_positions;
                done.push(self.finish(i, Ok(Stop::ContextFull { max })));
            }
        }
        let n = self.n_active;
        if n == 0 {
            return Ok(done);
        }
        let n_decode = self.slots[..n]
            .iter()
            .filter(|s| s.run.as_ref().is_some_and(|r| r.pending.is_some()))
            .count();
        let n_prefill = n - n_decode;
        // Each prefilling request's share of the chunk (at least one id).
        let per = exec
            .prefill_chunk()
            .saturating_sub(n_decode)
            .checked_div(n_prefill)
            .unwrap_or(0)
            .max(1);
        let parts: Vec<Vec<u32>> = self.slots[..n]
            .iter()
            .map(|s| {
                let r = s.run.as_ref().expect("running");
                match r.pending {
                    Some(t) => vec![t],
                    None => {
                        let rest = &r.prompt[s.fed.len()..];
                        rest[..rest.len().min(per)].to_vec()
                    }
                }
            })
            .collect();
        let refs: Vec<&[u32]> = parts.iter().map(Vec::as_slice).collect();
        exec.prefill_batch(&refs, &mut self.states[..n], w, &mut self.logits[..n])?;
        // Backwards: finishing slot i moves the last running slot (already handled) into i.
        for i in (0..n).rev() {
            let slot = &mut self.slots[i];
            slot.fed.extend_from_slice(&parts[i]);
            let run = slot.run.as_mut().expect("running");
            run.max_batch = run.max_batch.max(n);
            if run.pending.take().is_none() {
                run.prefill.fed += parts[i].len();
                if slot.fed.len() < run.prompt.len() {
                    continue;
                }
                run.prefill.seconds = run.admitted.elapsed().as_secs_f64();
                run.decode_start = Some(Instant::now());
                emit(&mut run.sink, Event::Prefilled(run.prefill));
            }
            let next = run.dec.sample(&self.logits[i]);
            let mut alive = true;
            let Running { sink, dec, .. } = run;
            let accepted = dec.accept(&self.tok, next, &mut |ev| {
                if !emit(sink, ev) {
                    alive = false;
                }
            });
            let ended = match accepted {
                Err(e) => Some(Err(e)),
                Ok(Some(stop)) => Some(Ok(stop)),
                Ok(None) if !alive => Some(Ok(Stop::Interrupted)),
                Ok(None) if dec.at_limit() => Some(Ok(Stop::GenLimit)),
                Ok(None) => None,
            };
            match ended {
                Some(outcome) => done.push(self.finish(i, outcome)),
                None => run.pending = Some(next),
            }
        }
        Ok(done)
    }

    /// Every slot's fed ids and the state holding them (what a later request can reuse).
    pub fn slots(&self) -> impl Iterator<Item = (&[u32], &SeqState)> {
        self.slots
            .iter()
            .zip(&self.states)
            .map(|(s, st)| (s.fed.as_slice(), st))
    }
}
