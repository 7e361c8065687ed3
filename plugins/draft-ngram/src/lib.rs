//! Speculative-draft provider plugin: prompt lookup over n-grams, with an adaptive n.
//!
//! Owns: finding the most recent earlier occurrence of the context's longest suffix (from
//! `max_ngram` down to the current minimum) and proposing the tokens that followed it. The
//! minimum adapts to the verdicts: a proposal with nothing accepted raises it by one (up to
//! `max_ngram`: fewer, surer guesses), a fully accepted one lowers it back towards
//! `min_ngram`. The built-in drafter is the same lookup with n from 3 down to 2, fixed.
//! Options: `min_ngram=N` (default 1), `max_ngram=N` (default 4).

use k3_plugin_abi::{DraftProvider, DraftSetup, export_draft_provider};

pub struct Ngram {
    min_ngram: usize,
    max_ngram: usize,
    cur_min: usize,
}

/// Up to `k` tokens after the most recent earlier occurrence of the longest suffix of
/// `context` of `lo..=hi` tokens.
pub fn lookup(context: &[u32], k: usize, lo: usize, hi: usize) -> &[u32] {
    let len = context.len();
    for n in (lo.max(1)..=hi).rev() {
        if len <= n {
            continue;
        }
        let suffix = &context[len - n..];
        if let Some(i) = (0..len - n).rev().find(|&i| &context[i..i + n] == suffix) {
            return &context[i + n..(i + n + k).min(len)];
        }
    }
    &[]
}

impl DraftProvider for Ngram {
    fn create(setup: &DraftSetup) -> Result<Self, String> {
        let min_ngram: usize = setup.options.number("min_ngram", 1)?;
        let max_ngram: usize = setup.options.number("max_ngram", 4)?;
        if min_ngram == 0 || max_ngram < min_ngram || max_ngram > 64 {
            return Err(format!(
                "options min_ngram={min_ngram} max_ngram={max_ngram}: need 1 <= min <= max <= 64"
            ));
        }
        Ok(Ngram {
            min_ngram,
            max_ngram,
            cur_min: min_ngram,
        })
    }

    fn propose(&mut self, context: &[u32], k: usize, out: &mut Vec<u32>) {
        out.extend_from_slice(lookup(context, k, self.cur_min, self.max_ngram));
    }

    fn on_result(&mut self, proposed: usize, accepted: usize) {
        if proposed == 0 {
            return;
        }
        if accepted == 0 {
            self.cur_min = (self.cur_min + 1).min(self.max_ngram);
        } else if accepted == proposed {
            self.cur_min = self.cur_min.saturating_sub(1).max(self.min_ngram);
        }
    }
}

export_draft_provider!(
    Ngram,
    "ngram",
    "prompt lookup over n-grams of the context (n adapts to acceptance)"
);

#[cfg(test)]
mod tests {
    use super::*;
    use k3_plugin_abi::Options;

    #[test]
    fn lookup_and_adaptation() {
        let ctx = [5, 6, 7, 8, 5, 6, 9, 1, 2, 5, 6];
        assert_eq!(lookup(&ctx, 2, 1, 4), &[9, 1]);
        // Only a 1-gram repeats: found with min 1, not with min 2.
        let ctx = [1, 2, 3, 1];
        assert_eq!(lookup(&ctx, 3, 1, 4), &[2, 3, 1]);
        assert!(lookup(&ctx, 3, 2, 4).is_empty());
        let setup = DraftSetup {
            vocab_size: 10,
            max_draft: 4,
            options: Options::parse("max_ngram=2"),
        };
        let mut p = Ngram::create(&setup).expect("create");
        let mut out = Vec::new();
        p.propose(&ctx, 3, &mut out);
        assert_eq!(out, vec![2, 3, 1]);
        p.on_result(3, 0);
        out.clear();
        p.propose(&ctx, 3, &mut out);
        assert!(
            out.is_empty(),
            "after a miss the 1-gram is no longer enough"
        );
        p.on_result(0, 0);
        p.on_result(2, 2);
        assert_eq!(p.cur_min, 1);
        assert!(
            Ngram::create(&DraftSetup {
                options: Options::parse("min_ngram=0"),
                ..setup
            })
            .is_err()
        );
    }
}
