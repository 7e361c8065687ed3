//! Resident weight providers: every tensor served straight from the checkpoint's memory maps.
//!
//! Owns: the [`TrunkSource`], [`ExpertSource`] and [`GlobalSource`] used when no packed trunk
//! is given (SYSTEM.md §3: "without a packed trunk the whole trunk loads resident"). Must not:
//! copy or convert weights (the executor widens exactly from the checkpoint's own bytes).

use k3_kernels::{matvec, par::Pool};
use k3_models::spec::{ModelSpec, TensorRole};

use crate::checkpoint::Checkpoint;
use crate::weights::{
    ExpertSource, ExpertStats, ExpertWeights, GlobalSource, LayerWeights, TensorBytes, TrunkSource,
    TrunkStats, WeightError,
};

fn bytes_of<'c>(
    ckpt: &'c Checkpoint,
    decl: &'c k3_models::spec::TensorDecl,
) -> Result<TensorBytes<'c>, WeightError> {
    let bytes = ckpt
        .try_bytes(&decl.name)
        .ok_or_else(|| WeightError::Invalid {
            name: decl.name.clone(),
            msg: format!("not present in the checkpoint at {}", ckpt.dir().display()),
        })?;
    Ok(TensorBytes { decl, bytes })
}

/// The whole dense trunk, resident (memory-mapped checkpoint shards).
pub struct ResidentTrunk<'c> {
    layers: Vec<Vec<TensorBytes<'c>>>,
    stats: TrunkStats,
}

impl<'c> ResidentTrunk<'c> {
    pub fn new(spec: &'c ModelSpec, ckpt: &'c Checkpoint) -> Result<Self, WeightError> {
        let mut layers: Vec<Vec<TensorBytes<'c>>> = vec![Vec::new(); spec.n_layers];
        let mut pinned_bytes = 0u64;
        for t in &spec.tensors {
            if let (Some(l), None) = (t.layer, t.expert) {
                let tb = bytes_of(ckpt, t)?;
                pinned_bytes += tb.bytes.len() as u64;
                layers[l].push(tb);
            }
        }
        let stats = TrunkStats {
            n_layers: spec.n_layers,
            pinned_layers: spec.n_layers,
            pinned_bytes,
            ..TrunkStats::default()
        };
        Ok(ResidentTrunk { layers, stats })
    }
}

impl TrunkSource for ResidentTrunk<'_> {
    fn layer(&mut self, layer: usize) -> Result<LayerWeights<'_>, WeightError> {
        Ok(LayerWeights {
            tensors: self.layers[layer].clone(),
        })
    }
    fn stats(&self) -> TrunkStats {
        self.stats.clone()
    }
}

/// Every routed expert, resident (memory-mapped).
pub struct ResidentExperts<'c> {
    spec: &'c ModelSpec,
    ckpt: &'c Checkpoint,
    stats: ExpertStats,
}

impl<'c> ResidentExperts<'c> {
    pub fn new(spec: &'c ModelSpec, ckpt: &'c Checkpoint) -> Self {
        ResidentExperts {
            spec,
            ckpt,
            stats: ExpertStats::default(),
        }
    }

    fn one(&self, layer: usize, e: usize) -> Result<ExpertWeights<'c>, WeightError> {
        let get = |role: TensorRole| -> Result<&'c [u8], WeightError> {
            let spec: &'c ModelSpec = self.spec;
            let decl =
                spec.tensor(role, Some(layer), Some(e))
                    .ok_or_else(|| WeightError::Expert {
                        layer,
                        expert: e,
                        msg: format!("{role:?} is not declared by the model spec"),
                    })?;
            Ok(bytes_of(self.ckpt, decl)?.bytes)
        };
        Ok(ExpertWeights {
            expert: e,
            w1_packed: get(TensorRole::ExpertW1Packed)?,
            w1_scale: get(TensorRole::ExpertW1Scale)?,
            w3_packed: get(TensorRole::ExpertW3Packed)?,
            w3_scale: get(TensorRole::ExpertW3Scale)?,
            w2_packed: get(TensorRole::ExpertW2Packed)?,
            w2_scale: get(TensorRole::ExpertW2Scale)?,
        })
    }
}

impl ExpertSource for ResidentExperts<'_> {
    fn experts(
        &mut self,
        layer: usize,
        ids: &[u32],
    ) -> Result<Vec<ExpertWeights<'_>>, WeightError> {
        let mut out = Vec::with_capacity(ids.len());
        for &e in ids {
            out.push(self.one(layer, e as usize)?);
        }
        self.stats.requests += ids.len() as u64;
        self.stats.hits += ids.len() as u64;
        self.stats.resident_hits += ids.len() as u64;
        Ok(out)
    }
    fn stats(&self) -> ExpertStats {
        self.stats.clone()
    }
}

/// Embedding, lm_head and the final small tensors, resident.
pub struct ResidentGlobal<'c> {
    embed: TensorBytes<'c>,
    lm_head: TensorBytes<'c>,
    small: Vec<TensorBytes<'c>>,
    d_model: usize,
}

impl<'c> ResidentGlobal<'c> {
    pub fn new(spec: &'c ModelSpec, ckpt: &'c Checkpoint) -> Result<Self, WeightError> {
        let find = |role: TensorRole| -> Result<TensorBytes<'c>, WeightError> {
            let decl = spec
                .tensor(role, None, None)
                .ok_or_else(|| WeightError::Invalid {
                    name: format!("{role:?}"),
                    msg: "not declared by the model spec".into(),
                })?;
            bytes_of(ckpt, decl)
        };
        let mut small = vec![find(TensorRole::FinalNorm)?];
        if spec.attn_res.is_some() {
            small.push(find(TensorRole::OutputResProj)?);
            small.push(find(TensorRole::OutputResNorm)?);
        }
        Ok(ResidentGlobal {
            embed: find(TensorRole::Embed)?,
            lm_head: find(TensorRole::LmHead)?,
            small,
            d_model: spec.d_model,
        })
    }
}

impl GlobalSource for ResidentGlobal<'_> {
    fn embed_row(&mut self, token: u32, out: &mut [f32]) -> Result<(), WeightError> {
        let d = self.d_model;
        let row = 2 * d * token as usize;
        let bytes = self
            .embed
            .bytes
            .get(row..row + 2 * d)
            .ok_or_else(|| WeightError::Invalid {
                name: self.embed.decl.name.clone(),
                msg: format!("token {token} is past the end of the embedding"),
            })?;
        for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
            *o = f32::from_bits((u16::from_le_bytes([c[0], c[1]]) as u32) << 16);
        }
        Ok(())
    }

    fn lm_head(&mut self, pool: &Pool, x: &[f32], logits: &mut [f32]) -> Result<(), WeightError> {
        let w: std::borrow::Cow<'_, [u16]> =
            match bytemuck::try_cast_slice::<u8, u16>(self.lm_head.bytes) {
                Ok(s) => std::borrow::Cow::Borrowed(s),
                Err(_) => std::borrow::Cow::Owned(
                    self.lm_head
                        .bytes
                        .chunks_exact(2)
                        .map(|c| u16::from_le_bytes([c[0], c[1]]))
                        .collect(),
                ),
            };
        matvec::matvec_bf16(pool, &w, x, logits);
        Ok(())
    }

    fn small(&self, role: TensorRole) -> Option<TensorBytes<'_>> {
        self.small.iter().copied().find(|t| t.decl.role == role)
    }
}
