//! Block Attention Residuals: instead of adding each block's output to one running residual,
//! every layer's input is a learned softmax mixture over the carries of the earlier blocks
//! (plus the current partial block), with one query vector per layer and RMS-normalised keys;
//! the carry of a block is the sum of its layers' outputs. `attn_in` builds a layer's input,
//! `attn_merge` adds a layer's output to the current carry, and [`Executor::attn_res`] is the
//! mixture itself (also used for the output before the final norm).

use super::*;

impl<'s> Executor<'s> {
    /// The attention input of layer `l` for the token whose carry is in the scratch: the
    /// AttnRes mix (the block sums and the partial sum; a new block starts here every
    /// `block_size` layers) or the residual stream, normed into `s.xn`.
    pub(super) fn attn_in(&mut self, l: usize, lw: &LayerWeights<'_>) -> Result<(), ExecError> {
        let spec = self.spec;
        let s = &mut self.s;
        // blk.{l}.attn_in
        match &spec.attn_res {
            Some(ar) => {
                if s.blocks.is_empty() {
                    s.x.copy_from_slice(&s.partial);
                } else {
                    let proj = need(lw, l, TensorRole::AttnResProj)?;
                    let norm = need(lw, l, TensorRole::AttnResNorm)?;
                    Self::attn_res(s, proj, norm, ar.eps, true);
                }
                if l.is_multiple_of(ar.block_size) {
                    s.blocks.push(s.partial.clone());
                    s.has_partial = false;
                }
            }
            None => s.x.copy_from_slice(&s.partial),
        }
        let n = widen(need(lw, l, TensorRole::InputNorm)?, &mut s.w_a);
        ops::rmsnorm(&s.x, Some(&s.w_a[..n]), spec.rms_norm_eps, &mut s.xn);
        Ok(())
    }

    /// After the attention of the token whose carry is in the scratch: `attn_out`
    /// (blk.{l}.attn_out) into the partial sum, then the FFN input (AttnRes mix or residual)
    /// normed into `s.xn` (and unnormed in `s.x`).
    pub(super) fn attn_merge(
        spec: &ModelSpec,
        s: &mut Scratch,
        lw: &LayerWeights<'_>,
        l: usize,
        attn_out: &[f32],
    ) -> Result<(), ExecError> {
        if s.has_partial {
            ops::add_inplace(&mut s.partial, attn_out);
        } else {
            s.partial.copy_from_slice(attn_out);
            s.has_partial = true;
        }
        // blk.{l}.mlp_in
        match &spec.attn_res {
            Some(ar) => {
                let proj = need(lw, l, TensorRole::MlpResProj)?;
                let norm = need(lw, l, TensorRole::MlpResNorm)?;
                Self::attn_res(s, proj, norm, ar.eps, true);
            }
            None => s.x.copy_from_slice(&s.partial),
        }
        let n = widen(need(lw, l, TensorRole::PostAttnNorm)?, &mut s.w_a);
        ops::rmsnorm(&s.x, Some(&s.w_a[..n]), spec.rms_norm_eps, &mut s.xn);
        Ok(())
    }

    /// x = AttnRes(blocks ∪ {partial}) with the pseudo-query `norm ⊙ proj` folded in f32.
    pub(super) fn attn_res(
        s: &mut Scratch,
        proj: TensorBytes<'_>,
        norm: TensorBytes<'_>,
        eps: f32,
        with_partial: bool,
    ) {
        let d = s.x.len();
        widen(proj, &mut s.w_a);
        widen(norm, &mut s.w_b);
        for i in 0..d {
            s.res_query[i] = s.w_a[i] * s.w_b[i];
        }
        let mut sources: Vec<&[f32]> = s.blocks.iter().map(|b| b.as_slice()).collect();
        if with_partial && s.has_partial {
            sources.push(&s.partial);
        }
        let n = sources.len();
        attnres::attnres_mix(
            &sources,
            &s.res_query,
            eps,
            &mut s.res_logits[..n],
            &mut s.x,
        );
    }
}
