//! Speculative decoding with prompt-lookup drafts: several greedy tokens per trunk pass, the
//! same tokens as plain greedy decoding.
//!
//! Owns: the draft source (the tokens that followed the most recent earlier occurrence of the
//! context's longest suffix n-gram: "prompt lookup", no second model), the verify step
//! ([`Speculator`], driven by `run::generate_with` and the chat session) and its counters.
//! Must not: change a single emitted token or logit bit relative to plain greedy decoding
//! (every emitted token is the argmax of logits [`Executor::prefill_each`] computes
//! bit-identically to one-token steps), or know where weights live.
//!
//! Why: with a streamed trunk the cost of a token is one read of every streamed layer (real
//! K3 at the laptop preset: ~109 GB per token). One verify pass feeds the pending token and
//! up to `max_draft` guesses layer-major, so the trunk is read once for all of them; each
//! guess that equals the greedy choice is a token gained for one more token's compute and
//! routed-expert reads. A rejected guess costs that compute and those expert reads and is
//! undone ([`SeqState::rewind`]): the accepted tokens are fed again at the start of the next
//! pass (no extra trunk read). Gains need text that repeats its context (code, quotes,
//! edits); on text that does not, the drafter mostly finds nothing and nothing is spent.

use crate::exec::{ExecError, Executor, Providers, SeqState, StateMark};

/// How to speculate.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Speculation {
    /// Most guesses verified in one pass (`--speculate K`).
    pub max_draft: usize,
    /// Shortest context suffix that must have occurred before for a draft to be proposed.
    pub min_ngram: usize,
    /// Longest suffix tried first.
    pub max_ngram: usize,
}

impl Speculation {
    /// `--speculate K`: up to K guesses, suffixes of 3 down to 2 tokens.
    pub fn with_max_draft(k: usize) -> Self {
        Self {
            max_draft: k,
            min_ngram: 2,
            max_ngram: 3,
        }
    }
}

/// `--speculate K` checked: `None` without the flag, an error naming the flag for K outside
/// 1..=32.
pub fn from_flag(k: Option<usize>) -> Result<Option<Speculation>, String> {
    match k {
        None => Ok(None),
        Some(k) if (1..=32).contains(&k) => Ok(Some(Speculation::with_max_draft(k))),
        Some(k) => Err(format!("--speculate {k}: guesses per pass must be 1..=32")),
    }
}

/// What speculation did.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct SpecStats {
    /// Verify passes (each reads the trunk once), including passes with no guesses.
    pub passes: usize,
    /// Guesses fed.
    pub drafted: usize,
    /// Guesses that were the greedy choice (tokens gained).
    pub accepted: usize,
    /// Passes with a rejected guess (the state rewound).
    pub rewinds: usize,
}

/// Up to `k` tokens that followed the most recent earlier occurrence of the longest suffix of
/// `context` (from `max_ngram` down to `min_ngram` tokens); empty when no suffix repeats.
pub fn lookup_draft(context: &[u32], k: usize, min_ngram: usize, max_ngram: usize) -> Vec<u32> {
    let len = context.len();
    if k == 0 || min_ngram == 0 {
        return Vec::new();
    }
    for n in (min_ngram..=max_ngram).rev() {
        if len <= n {
            continue;
        }
        let suffix = &context[len - n..];
        // The most recent earlier occurrence (it may overlap the suffix itself).
        if let Some(i) = (0..len - n).rev().find(|&i| &context[i..i + n] == suffix) {
            let end = (i + n + k).min(len);
            return context[i + n..end].to_vec();
        }
    }
    Vec::new()
}

/// The verify loop's state across one generation: emitted ids not yet fed, the mark of the
/// last pass, the adaptive guess count, the counters. The driver emits ids as usual; after
/// each emitted id that does not end generation it calls [`Speculator::advance`] instead of a
/// one-token step, emits the accepted guesses it returns (any of them may end generation), and
/// calls [`Speculator::finish`] at the end.
#[derive(Debug)]
pub struct Speculator {
    opts: Speculation,
    k_cur: usize,
    pending: Vec<u32>,
    mark: Option<StateMark>,
    pass_logits: Vec<Vec<f32>>,
    pub stats: SpecStats,
    /// Where guesses come from instead of the built-in lookup (`--draft-plugin`).
    drafter: Option<Box<dyn crate::draft::Drafter>>,
}

impl Speculator {
    pub fn new(opts: Speculation) -> Self {
        Self {
            opts,
            k_cur: opts.max_draft.div_ceil(2).clamp(1, opts.max_draft.max(1)),
            pending: Vec::new(),
            mark: None,
            pass_logits: Vec::new(),
            stats: SpecStats::default(),
            drafter: None,
        }
    }

    /// Take guesses from `drafter` (`None`: the built-in prompt lookup). The emitted ids are
    /// the same whatever it proposes: only guesses the model itself would choose are kept.
    pub fn with_drafter(mut self, drafter: Option<Box<dyn crate::draft::Drafter>>) -> Self {
        self.drafter = drafter;
        self
    }

    /// `next` was just emitted and generation goes on: feed it (with any ids still pending)
    /// and guesses drawn from `context` (every id so far, ending with `next`) in one pass.
    /// `logits` becomes the logits after the last accepted guess (after `next` if none held);
    /// returns the accepted guesses, in order, for the driver to emit. `room`: ids the driver
    /// may still emit after `next`; `choose`: the id the driver would pick from logits (its
    /// greedy rule, e.g. an argmax over the allowed vocabulary).
    #[allow(clippy::too_many_arguments)]
    pub fn advance(
        &mut self,
        exec: &mut Executor<'_>,
        state: &mut SeqState,
        w: &mut Providers<'_>,
        next: u32,
        context: &[u32],
        room: usize,
        logits: &mut Vec<f32>,
        choose: &dyn Fn(&[f32]) -> u32,
    ) -> Result<Vec<u32>, ExecError> {
        self.pending.push(next);
        let ctx_room = exec
            .plan()
            .max_positions
            .saturating_sub(state.n_pos + self.pending.len());
        // Guesses beyond what is still to emit are wasted: the pass's own next id is one more.
        let k = self.k_cur.min(room.saturating_sub(1)).min(ctx_room);
        let drafts = match self.drafter.as_mut() {
            Some(d) if k > 0 => {
                let mut v = d.propose(context, k);
                v.truncate(k);
                v
            }
            _ => lookup_draft(context, k, self.opts.min_ngram, self.opts.max_ngram),
        };
        let fed: Vec<u32> = self.pending.iter().chain(&drafts).copied().collect();
        // Logits from the last pending id on: pass_logits[j] predicts drafts[j].
        let n_out = drafts.len() + 1;
        let vocab = logits.len();
        self.pass_logits.resize_with(n_out, || vec![0.0f32; vocab]);
        let m0 = state.mark();
        exec.prefill_each(&fed, state, w, &mut self.pass_logits[..n_out])?;
        let accepted = drafts
            .iter()
            .enumerate()
            .take_while(|&(j, &d)| choose(&self.pass_logits[j]) == d)
            .count();
        self.stats.passes += 1;
        self.stats.drafted += drafts.len();
        self.stats.accepted += accepted;
        if let Some(d) = self.drafter.as_mut() {
            d.on_result(drafts.len(), accepted);
        }
        std::mem::swap(logits, &mut self.pass_logits[accepted]);
        if accepted == drafts.len() {
            self.pending.clear();
        } else {
            // Undo the pass; its accepted ids are fed again at the start of the next one.
            state.rewind(&m0);
            self.stats.rewinds += 1;
            self.pending.extend_from_slice(&drafts[..accepted]);
        }
        self.mark = Some(m0);
        if !drafts.is_empty() {
            self.k_cur = if accepted == drafts.len() {
                (self.k_cur + 2).min(self.opts.max_draft)
            } else {
                self.k_cur.saturating_sub(1).max(1)
            };
        }
        Ok(drafts[..accepted].to_vec())
    }

    /// Leave `state` as plain decoding would: `all` (the ids from position `base` on: what was
    /// fed before generation, then every emitted id) fed but its last id. The last pass may
    /// have fed guesses beyond an id that ended generation (rewound), or left emitted ids
    /// pending (fed here).
    pub fn finish(
        &mut self,
        exec: &mut Executor<'_>,
        state: &mut SeqState,
        w: &mut Providers<'_>,
        all: &[u32],
        base: usize,
    ) -> Result<(), ExecError> {
        let target = base + all.len().saturating_sub(1);
        if state.n_pos > target
            && let Some(m) = &self.mark
        {
            state.rewind(m);
        }
        let mut scratch = vec![0.0f32; exec.spec().vocab_size];
        let chunk_len = exec.prefill_chunk();
        for chunk in all[state.n_pos.min(target) - base..target - base].chunks(chunk_len) {
            exec.prefill(chunk, state, w, &mut scratch)?;
        }
        self.pending.clear();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lookup_takes_the_longest_most_recent_suffix_match() {
        // "5 6" occurred twice; the most recent occurrence (index 4) is followed by 9 1.
        let ctx = [5, 6, 7, 8, 5, 6, 9, 1, 2, 5, 6];
        assert_eq!(lookup_draft(&ctx, 2, 2, 3), vec![9, 1]);
        assert_eq!(lookup_draft(&ctx, 10, 2, 3), vec![9, 1, 2, 5, 6]);
        // A 3-gram match wins over a more recent 2-gram one.
        let ctx = [1, 2, 3, 4, 0, 2, 3, 7, 1, 2, 3];
        assert_eq!(lookup_draft(&ctx, 1, 2, 3), vec![4]);
        // No suffix of >= 2 tokens repeats: nothing (a 1-gram would match with min 1).
        let ctx = [1, 2, 3, 1];
        assert!(lookup_draft(&ctx, 3, 2, 3).is_empty());
        assert_eq!(lookup_draft(&ctx, 3, 1, 3), vec![2, 3, 1]);
        // A run repeats itself: the match overlaps the suffix.
        assert_eq!(lookup_draft(&[4, 4, 4], 3, 2, 2), vec![4]);
        assert!(lookup_draft(&[], 3, 1, 3).is_empty());
        assert!(lookup_draft(&ctx, 0, 1, 3).is_empty());
    }
}
