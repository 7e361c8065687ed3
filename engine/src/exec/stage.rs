//! Pipeline-stage hooks: the forward pass cut at layer boundaries, for a pipeline whose
//! stages run on different processes (`crate::pipeline`).
//!
//! Owns: exporting and importing the per-token residual carries (the AttnRes partial sum and
//! completed block sums, or the plain residual stream) that cross a cut, and running one
//! contiguous range of layers on them. Must not: move bytes between processes or choose the
//! cut (the pipeline does), or compute anything [`Executor::prefill_batch`] does not: a
//! stage's layers go through the same [`Executor::layer`] / [`Executor::layer_many`] calls on
//! the same inputs, so the embedding on the first stage, the layers on each, and the output
//! head on the last give the bits of one process running all of them (docs/NUMERICS.md §1).

use super::*;

/// One token's residual carry between two layers, as it crosses a pipeline cut: the partial
/// sum (`d_model` floats), whether the current block has started, and the completed block sums
/// (each `d_model` floats; the embedding is the first). Without AttnRes the partial sum is the
/// residual stream and `blocks` stays empty.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenCarry {
    pub partial: Vec<f32>,
    pub has_partial: bool,
    pub blocks: Vec<Vec<f32>>,
}

impl TokenCarry {
    /// Whether `other` holds the same bits.
    pub fn same_bits(&self, other: &TokenCarry) -> bool {
        let eq = |a: &[f32], b: &[f32]| {
            a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
        };
        self.has_partial == other.has_partial
            && eq(&self.partial, &other.partial)
            && self.blocks.len() == other.blocks.len()
            && self.blocks.iter().zip(&other.blocks).all(|(a, b)| eq(a, b))
    }
}

impl<'s> Executor<'s> {
    /// The first stage's start: every token of `parts` (one slice per sequence, in order)
    /// checked against the vocabulary and embedded, one carry per token.
    pub fn stage_embed(
        &mut self,
        parts: &[&[u32]],
        w: &mut Providers<'_>,
    ) -> Result<Vec<TokenCarry>, ExecError> {
        let spec = self.spec;
        let all: Vec<u32> = parts.iter().flat_map(|p| p.iter().copied()).collect();
        if let Some(&token) = all.iter().find(|&&t| t as usize >= spec.vocab_size) {
            return Err(ExecError::BadToken {
                token,
                vocab: spec.vocab_size,
            });
        }
        if all.is_empty() {
            return Ok(Vec::new());
        }
        let carries = self.embed_carries(&all, w)?;
        Ok(self.export_carries(carries))
    }

    /// Layers `layers` (ascending, contiguous) for the tokens of `parts` (`lens[b]` tokens of
    /// `states[b]` from its position on; `carries` one per token, in order), as
    /// [`Self::prefill_batch`] runs them, every state advanced past its tokens. Only the
    /// layers of `layers` of each state are used. Returns the carries after the last layer.
    pub fn stage_layers(
        &mut self,
        layers: std::ops::Range<usize>,
        lens: &[usize],
        states: &mut [SeqState],
        carries: Vec<TokenCarry>,
        w: &mut Providers<'_>,
    ) -> Result<Vec<TokenCarry>, ExecError> {
        assert!(
            lens.len() == states.len() && lens.iter().sum::<usize>() == carries.len(),
            "stage_layers: one length per state and one carry per token"
        );
        assert!(
            layers.end <= self.spec.n_layers,
            "stage_layers: past the last layer"
        );
        if let Some((st, n)) = states
            .iter()
            .zip(lens)
            .find(|(s, n)| s.n_pos + *n > self.plan.max_positions)
        {
            return Err(ExecError::ContextFull {
                pos: (st.n_pos + n).max(self.plan.max_positions),
                max: self.plan.max_positions,
            });
        }
        if carries.is_empty() {
            return Ok(carries);
        }
        w.experts.begin_token();
        if let Some(g) = self.guess.as_mut() {
            g.ahead_for.clear();
        }
        let mut rest = self.import_carries(carries);
        let at: Vec<(usize, usize)> = states
            .iter()
            .zip(lens)
            .enumerate()
            .flat_map(|(b, (st, &n))| (0..n).map(move |t| (b, st.n_pos + t)))
            .collect();
        for l in layers {
            let lw = w.trunk.layer(l)?;
            let experts = w.experts.as_mut();
            if at.len() > 1 {
                self.layer_many(l, &lw, &mut rest, &at, states, experts)?;
            } else {
                let st = &mut states[at[0].0];
                self.layer(l, &lw, None, &mut st.layers[l], at[0].1, experts)?;
            }
            self.layer_done(at.len());
        }
        for (st, n) in states.iter_mut().zip(lens) {
            st.n_pos += n;
        }
        Ok(self.export_carries(rest))
    }

    /// The last stage's end: the logits after the tokens `which` (indices into `carries`)
    /// into `logits[j]` for `which[j]`, one lm_head pass for all of them (as
    /// [`Self::prefill_batch`] computes its outputs).
    pub fn stage_outputs(
        &mut self,
        carries: Vec<TokenCarry>,
        which: &[usize],
        w: &mut Providers<'_>,
        logits: &mut [&mut [f32]],
    ) -> Result<(), ExecError> {
        if carries.is_empty() {
            return Ok(());
        }
        let mut rest = self.import_carries(carries);
        self.outputs_of(&mut rest, which, w, logits)
    }

    /// Token 0's carry out of the scratch and every other one out of `rest`, in order.
    fn export_carries(&mut self, rest: Vec<Carry>) -> Vec<TokenCarry> {
        let d = self.spec.d_model;
        let first = TokenCarry {
            partial: std::mem::replace(&mut self.s.partial, vec![0.0; d]),
            has_partial: self.s.has_partial,
            blocks: std::mem::take(&mut self.s.blocks),
        };
        std::iter::once(first)
            .chain(rest.into_iter().map(|c| TokenCarry {
                partial: c.partial,
                has_partial: c.has_partial,
                blocks: c.blocks,
            }))
            .collect()
    }

    /// The inverse of [`Self::export_carries`]: token 0's carry into the scratch, the others
    /// returned (as the layer loop keeps them).
    fn import_carries(&mut self, carries: Vec<TokenCarry>) -> Vec<Carry> {
        let d = self.spec.d_model;
        let mut it = carries.into_iter();
        let first = it.next().expect("import_carries: at least one carry");
        assert_eq!(
            first.partial.len(),
            d,
            "a carry's partial sum is d_model floats"
        );
        self.s.partial = first.partial;
        self.s.has_partial = first.has_partial;
        self.s.blocks = first.blocks;
        it.map(|c| Carry {
            partial: c.partial,
            has_partial: c.has_partial,
            blocks: c.blocks,
        })
        .collect()
    }
}
