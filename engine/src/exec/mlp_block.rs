//! The dense MLP of the first layer(s): down(act(gate x) * up x), intermediate width from the
//! checkpoint (33,792 in the release); the activation is the manifest's (SiTU-GLU for K3, SiLU
//! for Kimi-Linear).

use super::*;

/// Gated MLP activation into `h`.
pub(super) fn glu(act: Activation, gate: &[f32], up: &[f32], h: &mut [f32]) {
    match act {
        Activation::Situ { beta, beta_lin } => ops::situ_glu(gate, up, beta, beta_lin, h),
        Activation::Silu => ops::silu_glu(gate, up, h),
    }
}

impl<'s> Executor<'s> {
    /// Dense gated MLP (layer 0 of K3) of `n` tokens: `rows.xn` in, `rows.mlp_out` out.
    pub(super) fn dense_many(
        spec: &ModelSpec,
        pool: &Pool,
        rows: &mut Rows,
        n: usize,
        lw: &LayerWeights<'_>,
        l: usize,
    ) -> Result<(), ExecError> {
        let ff = spec
            .dense
            .as_ref()
            .expect("validated: dense layers have a DenseMlpSpec")
            .d_ff;
        let d = spec.d_model;
        let Rows {
            xn, mlp_out, work, ..
        } = rows;
        let (xn, mlp_out) = (&xn[..n * d], &mut mlp_out[..n * d]);
        let [gate, up, h] = carve(work, [n * ff; 3]);
        lin_many(
            pool,
            n,
            vec![
                (need(lw, l, TensorRole::DenseGate)?, xn, &mut *gate),
                (need(lw, l, TensorRole::DenseUp)?, xn, &mut *up),
            ],
        );
        for ((g, u), hh) in gate.chunks(ff).zip(up.chunks(ff)).zip(h.chunks_mut(ff)) {
            glu(spec.activation, g, u, hh);
        }
        let w = need(lw, l, TensorRole::DenseDown)?;
        lin_many(pool, n, vec![(w, &*h, mlp_out)]);
        Ok(())
    }
}
