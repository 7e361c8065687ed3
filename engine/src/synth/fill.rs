//! Random tensor contents of a synthetic checkpoint, by tensor role, streamed row by row.
//!
//! Owns: the recipe of every role (distribution, gain, correlations, MXFP4 quantisation) and
//! writing a tensor's bytes to a `Write` with memory bounded by a row block (plus, for an
//! MXFP4 pair, the scale bytes of the matrix just packed). Must not: decide file layout.
//!
//! Every tensor draws from its own stream (`Rng::for_key(seed, name)`), so its bytes depend
//! only on (seed, name, recipe), never on shard layout or write order. The recipes follow the
//! oracle's `synth_k3.py` (same gains, same correlation construction); the random numbers do
//! not (different generator, approximately normal variates, `A_log` log-uniform in
//! [ln 0.5, ln 4] instead of ln of a uniform), so the two writers make different models of the
//! same family. Conditioning (oracle README): `linear(out, in, gain)` has std `gain/sqrt(in)`;
//! output projections use `out_gain`; KDA `q = c*k + sqrt(1-c^2)*noise` for both `q_proj` and
//! `q_conv1d`; conv taps have the current-token tap raised by 1; `dt_bias ~ N(-1.5, 1)` with
//! |x| < 1e-3 replaced by 0.25 (no zero entries).

use std::collections::HashMap;
use std::io::{self, Write};

use k3_models::spec::{DType, ModelSpec, TensorDecl, TensorRole};

use super::mxfp4;
use super::rng::Rng;
use super::spec::Conditioning;

/// How to fill one tensor.
#[derive(Clone, Debug, PartialEq)]
pub enum Recipe {
    /// `shift + std * z` elementwise.
    Normal { std: f32, shift: f32 },
    /// `c * base + sqrt(1 - c^2) * noise`, `base` drawn exactly as tensor `base_key` draws
    /// (std `std`), noise from this tensor's own stream; `conv_tap`: add 1 to the last element
    /// of every row afterwards (current-token conv tap).
    Correlated {
        base_key: String,
        c: f32,
        std: f32,
        conv_tap: bool,
    },
    /// Depthwise conv taps: `N(0, 0.5)`, last tap of every row + 1.
    Conv,
    /// KDA `dt_bias`.
    DtBias,
    /// KDA `A_log`: first `n_heads` entries log-uniform in [ln 0.5, ln 4], rest exactly 0.
    ALog { n_heads: usize },
    /// MXFP4 `weight_packed` of a logical `[rows, cols]` weight `N(0, std)`.
    Mxfp4Packed { key: String, std: f32 },
    /// MXFP4 `weight_scale` of the same logical weight.
    Mxfp4Scale { key: String, std: f32 },
}

/// One tensor to write.
#[derive(Clone, Debug, PartialEq)]
pub struct Item {
    pub name: String,
    pub dtype: DType,
    pub shape: Vec<usize>,
    pub layer: Option<usize>,
    pub recipe: Recipe,
}

impl Item {
    pub fn n_bytes(&self) -> u64 {
        self.shape.iter().product::<usize>() as u64 * self.dtype.size_bytes() as u64
    }
    /// (rows, stored columns): the last dimension is a row.
    fn rows_cols(&self) -> (usize, usize) {
        let cols = self.shape.last().copied().unwrap_or(1);
        let rows = self.shape.iter().rev().skip(1).product::<usize>();
        (rows, cols)
    }
}

/// Std of `linear(out, in, gain)`: `gain / sqrt(in)`, `in` = last dimension.
fn linear_std(gain: f32, fan_in: usize) -> f32 {
    gain / (fan_in.max(1) as f32).sqrt()
}

/// Name a packed/scale pair shares for its stream.
fn expert_key(name: &str) -> String {
    name.strip_suffix(".weight_packed")
        .or_else(|| name.strip_suffix(".weight_scale"))
        .unwrap_or(name)
        .to_string()
}

/// The recipe of a declared tensor.
pub fn recipe_for(spec: &ModelSpec, cond: &Conditioning, d: &TensorDecl) -> Recipe {
    use TensorRole::*;
    let fan_in = d.shape.last().copied().unwrap_or(1);
    let lin = |gain: f32| Recipe::Normal {
        std: linear_std(gain, fan_in),
        shift: 0.0,
    };
    let normw = Recipe::Normal {
        std: cond.norm_spread,
        shift: 1.0,
    };
    let sibling = |role: TensorRole| {
        spec.tensor(role, d.layer, None)
            .map_or_else(|| d.name.clone(), |t| t.name.clone())
    };
    // Logical input width of an MXFP4 pair: packed holds 2 per byte, scale 1 per 32.
    let mx_in = match d.role {
        ExpertW1Packed | ExpertW3Packed | ExpertW2Packed => fan_in * 2,
        _ => fan_in * mxfp4::GROUP,
    };
    match d.role {
        Embed => Recipe::Normal {
            std: 1.0,
            shift: 0.0,
        },
        LmHead => lin(cond.logit_std),
        FinalNorm | OutputResNorm | InputNorm | PostAttnNorm | AttnResNorm | MlpResNorm
        | MlaQANorm | MlaKvANorm | LatentNorm | KdaONorm => normw,
        OutputResProj | AttnResProj | MlpResProj => lin(cond.attn_res_logit_std),
        KdaQ => Recipe::Correlated {
            base_key: sibling(KdaK),
            c: cond.qk_corr,
            std: linear_std(1.0, fan_in),
            conv_tap: false,
        },
        KdaQConv => Recipe::Correlated {
            base_key: sibling(KdaKConv),
            c: cond.qk_corr,
            std: 0.5,
            conv_tap: true,
        },
        KdaKConv | KdaVConv => Recipe::Conv,
        KdaDtBias => Recipe::DtBias,
        KdaALog => Recipe::ALog {
            n_heads: spec.kda.as_ref().map_or(0, |k| k.n_heads),
        },
        KdaBeta => lin(2.0),
        KdaO | MlaO | DenseDown | SharedDown | LatentUp => lin(cond.out_gain),
        MlaQB | MlaKvA => lin(1.5),
        DenseGate | DenseUp | SharedGate | SharedUp => lin(2.0),
        Router => lin(cond.router_gain),
        RouterBias => Recipe::Normal {
            std: cond.router_bias_std,
            shift: 0.0,
        },
        ExpertW1Packed | ExpertW3Packed => Recipe::Mxfp4Packed {
            key: expert_key(&d.name),
            std: linear_std(2.0, mx_in),
        },
        ExpertW2Packed => Recipe::Mxfp4Packed {
            key: expert_key(&d.name),
            std: linear_std(1.0, mx_in),
        },
        ExpertW1Scale | ExpertW3Scale => Recipe::Mxfp4Scale {
            key: expert_key(&d.name),
            std: linear_std(2.0, mx_in),
        },
        ExpertW2Scale => Recipe::Mxfp4Scale {
            key: expert_key(&d.name),
            std: linear_std(1.0, mx_in),
        },
        // KdaK, KdaV, KdaFA, KdaFB, KdaGate(+A/B), MlaQ, MlaQA, MlaKvB, MlaGate, LatentDown,
        // and any unquantised expert weights: plain linear.
        _ => lin(1.0),
    }
}

/// Item for a declared tensor.
pub fn item_for(spec: &ModelSpec, cond: &Conditioning, d: &TensorDecl) -> Item {
    Item {
        name: d.name.clone(),
        dtype: d.dtype,
        shape: d.shape.to_vec(),
        layer: d.layer,
        recipe: recipe_for(spec, cond, d),
    }
}

/// Writes items' bytes; keeps the scale bytes of an MXFP4 matrix between its packed and scale
/// tensors (the scale follows the packed tensor in name order).
#[derive(Debug)]
pub struct Writer {
    seed: u64,
    pending_scales: HashMap<String, Vec<u8>>,
}

/// Rows per write block: about 1 MiB of output.
fn block_rows(row_bytes: usize) -> usize {
    (1 << 20) / row_bytes.max(1) + 1
}

fn push_value(buf: &mut Vec<u8>, dtype: DType, x: f32) {
    match dtype {
        DType::BF16 => buf.extend_from_slice(&half::bf16::from_f32(x).to_bits().to_le_bytes()),
        DType::F32 => buf.extend_from_slice(&x.to_le_bytes()),
        // U8 only carries MXFP4 bytes, which never go through here; clamp for completeness.
        DType::U8 => buf.push(x.clamp(0.0, 255.0) as u8),
    }
}

impl Writer {
    pub fn new(seed: u64) -> Writer {
        Writer {
            seed,
            pending_scales: HashMap::new(),
        }
    }

    /// Write `item`'s bytes to `out`.
    pub fn write(&mut self, item: &Item, out: &mut dyn Write) -> io::Result<()> {
        let (rows, cols) = item.rows_cols();
        match &item.recipe {
            Recipe::Mxfp4Packed { key, std } => self.write_mxfp4(key, *std, rows, cols * 2, out),
            Recipe::Mxfp4Scale { key, std } => {
                let scales = match self.pending_scales.remove(key) {
                    Some(s) => s,
                    None => {
                        let mut sink = io::sink();
                        self.write_mxfp4(key, *std, rows, cols * mxfp4::GROUP, &mut sink)?;
                        self.pending_scales.remove(key).unwrap_or_default()
                    }
                };
                out.write_all(&scales)
            }
            _ => self.write_rows(item, rows, cols, out),
        }
    }

    fn write_rows(
        &mut self,
        item: &Item,
        rows: usize,
        cols: usize,
        out: &mut dyn Write,
    ) -> io::Result<()> {
        let mut own = Rng::for_key(self.seed, &item.name);
        let mut base = match &item.recipe {
            Recipe::Correlated { base_key, .. } => Some(Rng::for_key(self.seed, base_key)),
            _ => None,
        };
        let mut row = vec![0f32; cols];
        let per_block = block_rows(cols * item.dtype.size_bytes());
        let mut buf = Vec::with_capacity(per_block.min(rows.max(1)) * cols * 4);
        for r in 0..rows {
            fill_row(&item.recipe, &mut own, base.as_mut(), &mut row);
            for &x in &row {
                push_value(&mut buf, item.dtype, x);
            }
            if (r + 1) % per_block == 0 {
                out.write_all(&buf)?;
                buf.clear();
            }
        }
        out.write_all(&buf)
    }

    /// Generate the logical `[rows, cols]` weight row by row, write the packed bytes to `out`
    /// and keep the scale bytes for the matching scale tensor.
    fn write_mxfp4(
        &mut self,
        key: &str,
        std: f32,
        rows: usize,
        cols: usize,
        out: &mut dyn Write,
    ) -> io::Result<()> {
        let mut rng = Rng::for_key(self.seed, key);
        let mut row = vec![0f32; cols];
        let mut packed = vec![0u8; cols / 2];
        let mut scales = vec![0u8; rows * (cols / mxfp4::GROUP)];
        let per_block = block_rows(cols / 2);
        let mut buf = Vec::with_capacity(per_block.min(rows.max(1)) * cols / 2);
        for (r, srow) in scales.chunks_exact_mut(cols / mxfp4::GROUP).enumerate() {
            for x in row.iter_mut() {
                *x = rng.normal() * std;
            }
            mxfp4::quantize_row(&row, &mut packed, srow);
            buf.extend_from_slice(&packed);
            if (r + 1) % per_block == 0 {
                out.write_all(&buf)?;
                buf.clear();
            }
        }
        out.write_all(&buf)?;
        self.pending_scales.insert(key.to_string(), scales);
        Ok(())
    }
}

/// Fill one row of a non-MXFP4 recipe (`A_log` is a single row).
fn fill_row(recipe: &Recipe, own: &mut Rng, base: Option<&mut Rng>, row: &mut [f32]) {
    match recipe {
        Recipe::Normal { std, shift } => {
            for x in row.iter_mut() {
                *x = shift + std * own.normal();
            }
        }
        Recipe::Conv => {
            for x in row.iter_mut() {
                *x = 0.5 * own.normal();
            }
            if let Some(last) = row.last_mut() {
                *last += 1.0;
            }
        }
        Recipe::Correlated {
            c, std, conv_tap, ..
        } => {
            let s = (1.0 - c * c).sqrt();
            let base = base.expect("invariant: a Correlated recipe always has a base stream");
            for x in row.iter_mut() {
                let b = std * base.normal();
                let n = std * own.normal();
                *x = c * b + s * n;
            }
            if *conv_tap && let Some(last) = row.last_mut() {
                *last += 1.0;
            }
        }
        Recipe::DtBias => {
            for x in row.iter_mut() {
                let v = own.normal() - 1.5;
                *x = if v.abs() < 1e-3 { 0.25 } else { v };
            }
        }
        Recipe::ALog { n_heads } => {
            // ln(0.5) = -ln 2 and ln(4) = 2 ln 2 as f32 constants; uniform in between (no libm).
            const LO: f32 = -std::f32::consts::LN_2;
            const HI: f32 = 2.0 * std::f32::consts::LN_2;
            for (i, x) in row.iter_mut().enumerate() {
                *x = if i < *n_heads {
                    LO + (HI - LO) * own.uniform()
                } else {
                    0.0
                };
            }
        }
        Recipe::Mxfp4Packed { .. } | Recipe::Mxfp4Scale { .. } => {
            unreachable!("MXFP4 recipes are written by write_mxfp4")
        }
    }
}
