//! Speculative decoding with prompt-lookup drafts: several greedy tokens per trunk pass, the
//! same tokens as plain greedy decoding.
//!
//! Owns: the draft source (the tokens that followed the most recent earlier occurrence of the
//! context's longest suffix n-gram: "prompt lookup", no second model), the verify loop
//! ([`generate_speculative`]) and its counters. Must not: change a single emitted token or
//! logit bit relative to [`crate::run::generate`] (every emitted token is the argmax of logits
//! [`Executor::prefill_each`] computes bit-identically to one-token steps), or know where
//! weights live.
//!
//! Why: with a streamed trunk the cost of a token is one read of every streamed layer (real
//! K3 at the laptop preset: ~109 GB per token). One verify pass feeds the pending token and
//! up to `max_draft` guesses layer-major, so the trunk is read once for all of them; each
//! guess that equals the greedy choice is a token gained for one more token's compute and
//! routed-expert reads. A rejected guess costs that compute and those expert reads and is
//! undone ([`SeqState::rewind`]): the accepted tokens are fed again at the start of the next
//! pass (no extra trunk read). Gains need text that repeats its context (code, quotes,
//! edits); on text that does not, the drafter mostly finds nothing and nothing is spent.

use std::time::Instant;

use k3_kernels::ops;
use k3_models::spec::ModelSpec;

use crate::exec::{ExecError, Executor, PREFILL_CHUNK, Providers, SeqState, StateMark};
use crate::run::{GenRequest, GenResult, OnToken, logits_hash};

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

/// Greedy generation like [`crate::run::generate_from`] (incremental) from `start`,
/// verifying prompt-lookup guesses: the same ids and first-step logits, in fewer trunk passes
/// when guesses hold. Returns the result, the counters and the state after the prompt and
/// every generated id but the last (as `generate_from` does).
pub fn generate_speculative(
    spec: &ModelSpec,
    exec: &mut Executor<'_>,
    w: &mut Providers<'_>,
    req: &GenRequest,
    start: SeqState,
    opts: Speculation,
    on_token: &mut OnToken<'_>,
) -> Result<(GenResult, SpecStats, SeqState), ExecError> {
    let t0 = Instant::now();
    let base = start.n_pos;
    let mut state = start;
    let mut logits = vec![0.0f32; spec.vocab_size];
    let mut res = GenResult {
        prompt_ids: req.prompt_ids.clone(),
        ..GenResult::default()
    };
    let mut stats = SpecStats::default();
    for chunk in req.prompt_ids.chunks(PREFILL_CHUNK) {
        exec.prefill(chunk, &mut state, w, &mut logits)?;
    }
    res.prefill_seconds = t0.elapsed().as_secs_f64();
    res.first_logits = logits.clone();
    res.first_logits_hash = logits_hash(&logits);

    // Every token from position `base` on (the lookup context); `pending`: emitted ids not
    // yet fed.
    let mut all = req.prompt_ids.clone();
    let mut pending: Vec<u32> = Vec::new();
    let mut pass_logits: Vec<Vec<f32>> = Vec::new();
    let mut mark: Option<StateMark> = None;
    let mut k_cur = opts.max_draft.div_ceil(2).max(1).min(opts.max_draft);
    let mut decode_seconds = 0.0;
    let max_pos = exec.plan().max_positions;
    // Emit one id: record it, report it; false when generation ends here.
    let mut emit = |res: &mut GenResult, all: &mut Vec<u32>, id: u32| -> bool {
        let i = res.generated_ids.len();
        res.generated_ids.push(id);
        all.push(id);
        let now = t0.elapsed().as_secs_f64();
        if i == 0 {
            res.first_token_seconds = now;
        }
        let keep_going = on_token(i, id, now);
        if req.stop_ids.contains(&id) {
            res.stopped_by = Some(format!("stop id {id}"));
            return false;
        }
        if !keep_going {
            res.stopped_by = Some("interrupted".into());
            return false;
        }
        i + 1 < req.n_gen
    };
    if req.n_gen > 0 {
        'run: loop {
            let next = ops::argmax(&logits) as u32;
            if !emit(&mut res, &mut all, next) {
                break;
            }
            pending.push(next);
            let ts = Instant::now();
            // Guesses beyond what is still to emit are wasted: the pass's bonus id is one more.
            let room = req.n_gen - res.generated_ids.len();
            let ctx_room = max_pos.saturating_sub(state.n_pos + pending.len());
            let k = opts.max_draft.min(k_cur).min(room - 1).min(ctx_room);
            let drafts = lookup_draft(&all, k, opts.min_ngram, opts.max_ngram);
            let fed: Vec<u32> = pending.iter().chain(&drafts).copied().collect();
            pass_logits.resize_with(fed.len(), || vec![0.0f32; spec.vocab_size]);
            let m0 = state.mark();
            exec.prefill_each(&fed, &mut state, w, &mut pass_logits[..fed.len()])?;
            let p = pending.len();
            let accepted = drafts
                .iter()
                .enumerate()
                .take_while(|&(j, &d)| ops::argmax(&pass_logits[p - 1 + j]) as u32 == d)
                .count();
            stats.passes += 1;
            stats.drafted += drafts.len();
            stats.accepted += accepted;
            std::mem::swap(&mut logits, &mut pass_logits[p - 1 + accepted]);
            if accepted == drafts.len() {
                pending.clear();
            } else {
                // Undo the pass; its accepted ids are fed again at the start of the next one.
                state.rewind(&m0);
                stats.rewinds += 1;
            }
            mark = Some(m0);
            if !drafts.is_empty() {
                k_cur = if accepted == drafts.len() {
                    (k_cur + 2).min(opts.max_draft)
                } else {
                    k_cur.saturating_sub(1).max(1)
                };
            }
            decode_seconds += ts.elapsed().as_secs_f64();
            for &d in &drafts[..accepted] {
                if accepted < drafts.len() {
                    pending.push(d);
                }
                if !emit(&mut res, &mut all, d) {
                    break 'run;
                }
            }
        }
    }
    // The state plain decoding ends in: the prompt and every generated id but the last fed.
    let target = base + req.prompt_ids.len() + res.generated_ids.len().saturating_sub(1);
    if state.n_pos > target
        && let Some(m) = &mark
    {
        state.rewind(m);
    }
    let mut scratch = vec![0.0f32; spec.vocab_size];
    for chunk in all[state.n_pos.min(target) - base..target - base].chunks(PREFILL_CHUNK) {
        exec.prefill(chunk, &mut state, w, &mut scratch)?;
    }
    let n_decode = res.generated_ids.len().saturating_sub(1);
    res.seconds_per_token = if n_decode > 0 {
        decode_seconds / n_decode as f64
    } else {
        0.0
    };
    res.total_seconds = t0.elapsed().as_secs_f64();
    Ok((res, stats, state))
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
