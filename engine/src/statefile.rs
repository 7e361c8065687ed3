//! Saved decode state: `--gen 0 --incremental --save-state PATH` prefills a prompt once and
//! writes the exact state; `--load-state PATH` resumes from it (prepare a long prefix once,
//! continue many times). docs/DESIGN.md §6.
//!
//! Owns: the file format. Must not: compute. The state is the executor's own f32 state
//! (KDA conv windows + recurrent state, MLA latent cache), written bit for bit, so a resumed run
//! gives the same ids and logit bits as one that fed the whole prompt at once (tested).
//!
//! Format (little-endian): magic `K3STATE\0`, u32 version (2), u32 header length, the JSON
//! header ([`Header`]), then per layer in order: KDA `conv_q, conv_k, conv_v, s`; MLA
//! `c_kv, k_rope` (the latent cache: `[n_pos, kv_lora]`, `[n_pos, d_rope]`); each as u64
//! element count + f32 values. Version 1 files held the expanded MLA cache (`k_nope, k_rope,
//! v`), which this build cannot continue from bit for bit: they are refused.

use std::io::{Read, Write};
use std::path::Path;

use k3_models::spec::{AttnKind, ModelSpec};

use crate::exec::{KdaState, LayerState, MlaState, SeqState};

const MAGIC: &[u8; 8] = b"K3STATE\0";
const VERSION: u32 = 2;

/// What the state belongs to; checked on load.
#[derive(Debug, serde::Serialize, serde::Deserialize, PartialEq)]
pub struct Header {
    pub model: String,
    /// FNV-1a of every tensor name, dtype and shape of the spec: a different model is refused.
    pub spec_fingerprint: String,
    pub n_layers: usize,
    pub n_pos: usize,
    /// The token ids the state has consumed.
    pub ids: Vec<u32>,
    /// `Checkpoint::weights_fingerprint` of the weights that computed the state: a state
    /// from other weights of the same shape is refused. Absent in older files (not checked).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weights_fingerprint: Option<String>,
}

#[derive(Debug, thiserror::Error)]
pub enum StateFileError {
    #[error("state file {path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("state file {path}: {msg}")]
    Invalid { path: String, msg: String },
}

/// Fingerprint of a spec's tensor inventory (names, dtypes, shapes).
pub fn spec_fingerprint(spec: &ModelSpec) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut eat = |b: &[u8]| {
        for &x in b {
            h ^= x as u64;
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
    };
    for t in &spec.tensors {
        eat(t.name.as_bytes());
        eat(t.dtype.as_str().as_bytes());
        for d in &t.shape {
            eat(&(*d as u64).to_le_bytes());
        }
    }
    format!("{h:016x}")
}

fn put(w: &mut Vec<u8>, v: &[f32]) {
    w.extend_from_slice(&(v.len() as u64).to_le_bytes());
    for x in v {
        w.extend_from_slice(&x.to_le_bytes());
    }
}

/// Write `state` (which has consumed `ids`) to `path` atomically.
pub fn save(
    path: &Path,
    spec: &ModelSpec,
    weights_fingerprint: Option<String>,
    state: &SeqState,
    ids: &[u32],
) -> Result<(), StateFileError> {
    let io = |source| StateFileError::Io {
        path: path.display().to_string(),
        source,
    };
    let header = Header {
        model: spec.name.clone(),
        spec_fingerprint: spec_fingerprint(spec),
        n_layers: spec.n_layers,
        n_pos: state.n_pos,
        ids: ids.to_vec(),
        weights_fingerprint,
    };
    let hj = serde_json::to_vec(&header).map_err(|e| StateFileError::Invalid {
        path: path.display().to_string(),
        msg: e.to_string(),
    })?;
    let mut buf = Vec::new();
    buf.extend_from_slice(MAGIC);
    buf.extend_from_slice(&VERSION.to_le_bytes());
    buf.extend_from_slice(&(hj.len() as u32).to_le_bytes());
    buf.extend_from_slice(&hj);
    for l in &state.layers {
        match l {
            LayerState::Kda(k) => {
                put(&mut buf, &k.conv_q);
                put(&mut buf, &k.conv_k);
                put(&mut buf, &k.conv_v);
                put(&mut buf, &k.s);
            }
            LayerState::Mla(m) => {
                put(&mut buf, &m.c_kv);
                put(&mut buf, &m.k_rope);
            }
        }
    }
    let tmp = path.with_extension("partial");
    let mut f = std::fs::File::create(&tmp).map_err(io)?;
    f.write_all(&buf).map_err(io)?;
    f.sync_all().map_err(io)?;
    std::fs::rename(&tmp, path).map_err(io)
}

struct Reader<'a> {
    b: &'a [u8],
    at: usize,
    path: &'a Path,
}

impl Reader<'_> {
    fn bad(&self, msg: impl Into<String>) -> StateFileError {
        StateFileError::Invalid {
            path: self.path.display().to_string(),
            msg: msg.into(),
        }
    }
    fn take(&mut self, n: usize) -> Result<&[u8], StateFileError> {
        let end = self.at.checked_add(n).filter(|&e| e <= self.b.len());
        let end = end.ok_or_else(|| self.bad(format!("truncated at byte {}", self.at)))?;
        let s = &self.b[self.at..end];
        self.at = end;
        Ok(s)
    }
    fn u32(&mut self) -> Result<u32, StateFileError> {
        let s = self.take(4)?;
        Ok(u32::from_le_bytes([s[0], s[1], s[2], s[3]]))
    }
    /// An f32 vector that must have exactly `want` elements.
    fn vec(&mut self, want: usize, what: &str) -> Result<Vec<f32>, StateFileError> {
        let s = self.take(8)?;
        let mut n8 = [0u8; 8];
        n8.copy_from_slice(s);
        let n = u64::from_le_bytes(n8) as usize;
        if n != want {
            return Err(self.bad(format!("{what}: {n} values, expected {want}")));
        }
        let bytes = self.take(n.checked_mul(4).ok_or_else(|| self.bad("size overflow"))?)?;
        Ok(bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect())
    }
}

/// Load a state saved for this exact model (and, when both are known, these weights:
/// `weights_fingerprint`). Returns the state and the ids it consumed.
pub fn load(
    path: &Path,
    spec: &ModelSpec,
    weights_fingerprint: Option<&str>,
) -> Result<(SeqState, Vec<u32>), StateFileError> {
    let io = |source| StateFileError::Io {
        path: path.display().to_string(),
        source,
    };
    let mut f = std::fs::File::open(path).map_err(io)?;
    // A regular file, its magic checked before the rest is read (`/dev/zero` or a FIFO would
    // otherwise be read until memory runs out).
    if !f.metadata().map_err(io)?.is_file() {
        return Err(StateFileError::Invalid {
            path: path.display().to_string(),
            msg: "not a regular file".into(),
        });
    }
    let mut bytes = vec![0u8; MAGIC.len()];
    let n = f.read(&mut bytes).map_err(io)?;
    bytes.truncate(n);
    if n == MAGIC.len() && bytes == MAGIC {
        f.read_to_end(&mut bytes).map_err(io)?;
    }
    let mut r = Reader {
        b: &bytes,
        at: 0,
        path,
    };
    if r.take(8)? != MAGIC {
        return Err(r.bad("not a k3-run state file (bad magic)"));
    }
    let v = r.u32()?;
    if v == 1 {
        return Err(r.bad(
            "version 1 (an expanded MLA cache); this build keeps the latent MLA cache and reads \
             only version 2: save the state again with this build (--save-state)",
        ));
    }
    if v != VERSION {
        return Err(r.bad(format!("version {v}, this build reads {VERSION}")));
    }
    let hl = r.u32()? as usize;
    let hb = r.take(hl)?;
    let h: Header = serde_json::from_slice(hb).map_err(|e| r.bad(format!("header: {e}")))?;
    if h.spec_fingerprint != spec_fingerprint(spec) || h.n_layers != spec.n_layers {
        return Err(r.bad(format!(
            "saved for a different model ({} with fingerprint {}, {} layers); this model is {} \
             ({}, {} layers)",
            h.model,
            h.spec_fingerprint,
            h.n_layers,
            spec.name,
            spec_fingerprint(spec),
            spec.n_layers
        )));
    }
    if let (Some(saved), Some(here)) = (h.weights_fingerprint.as_deref(), weights_fingerprint)
        && saved != here
    {
        return Err(r.bad(format!(
            "saved from other weights of this model's shape (weights fingerprint {saved}, this \
             checkpoint {here}): save it again from this checkpoint"
        )));
    }
    if let Some(bad) = h.ids.iter().find(|&&t| t as usize >= spec.vocab_size) {
        return Err(r.bad(format!(
            "header id {bad} is outside the model's vocabulary (size {})",
            spec.vocab_size
        )));
    }
    if h.ids.len() != h.n_pos {
        return Err(r.bad("header ids and n_pos disagree"));
    }
    let fresh = SeqState::new(spec);
    let mut layers = Vec::with_capacity(spec.n_layers);
    for (i, (ls, l)) in fresh.layers.iter().zip(&spec.layers).enumerate() {
        let what = |s: &str| format!("layer {i} {s}");
        match (ls, l.attn) {
            (LayerState::Kda(k), AttnKind::Kda) => layers.push(LayerState::Kda(KdaState {
                conv_q: r.vec(k.conv_q.len(), &what("conv_q"))?,
                conv_k: r.vec(k.conv_k.len(), &what("conv_k"))?,
                conv_v: r.vec(k.conv_v.len(), &what("conv_v"))?,
                s: r.vec(k.s.len(), &what("state"))?,
            })),
            (LayerState::Mla(_), AttnKind::Mla) => {
                let m = spec
                    .mla
                    .as_ref()
                    .expect("validated: MLA layers have an MlaSpec");
                layers.push(LayerState::Mla(MlaState {
                    c_kv: r.vec(h.n_pos * m.kv_lora_rank, &what("c_kv"))?,
                    k_rope: r.vec(h.n_pos * m.d_rope, &what("k_rope"))?,
                }));
            }
            _ => return Err(r.bad(format!("layer {i}: kind differs from the model"))),
        }
    }
    if r.at != bytes.len() {
        return Err(r.bad(format!("{} trailing bytes", bytes.len() - r.at)));
    }
    Ok((
        SeqState {
            layers,
            n_pos: h.n_pos,
        },
        h.ids,
    ))
}
