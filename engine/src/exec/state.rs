//! The per-sequence decode state: every layer's carried state (KDA conv windows and recurrent
//! state, the MLA latent cache) and the position count; marks to rewind it to (speculative
//! decoding's rejected drafts) and the bit-for-bit comparison the tests use.

use k3_models::spec::{AttnKind, ModelSpec};

use super::{KdaState, MlaState};

#[derive(Clone, Debug)]
pub enum LayerState {
    Kda(KdaState),
    Mla(MlaState),
}

/// The whole per-sequence state: everything carried from one position to the next.
#[derive(Clone, Debug)]
pub struct SeqState {
    pub layers: Vec<LayerState>,
    /// Positions already processed.
    pub n_pos: usize,
}

impl SeqState {
    pub fn new(spec: &ModelSpec) -> SeqState {
        let layers = spec
            .layers
            .iter()
            .map(|l| match l.attn {
                AttnKind::Kda => {
                    let p = spec
                        .kda
                        .as_ref()
                        .expect("validated: KDA layers have a KdaSpec");
                    let ch = p.n_heads * p.head_dim;
                    let win = ch * (p.conv_kernel - 1);
                    LayerState::Kda(KdaState {
                        conv_q: vec![0.0; win],
                        conv_k: vec![0.0; win],
                        conv_v: vec![0.0; win],
                        s: vec![0.0; p.n_heads * p.head_dim * p.head_dim],
                    })
                }
                AttnKind::Mla => LayerState::Mla(MlaState::default()),
            })
            .collect();
        SeqState { layers, n_pos: 0 }
    }

    /// Whether `other` holds the same positions and the same state, bit for bit.
    pub fn same_bits(&self, other: &SeqState) -> bool {
        let eq = |a: &[f32], b: &[f32]| {
            a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
        };
        self.n_pos == other.n_pos
            && self.layers.len() == other.layers.len()
            && self
                .layers
                .iter()
                .zip(&other.layers)
                .all(|(a, b)| match (a, b) {
                    (LayerState::Kda(a), LayerState::Kda(b)) => {
                        eq(&a.conv_q, &b.conv_q)
                            && eq(&a.conv_k, &b.conv_k)
                            && eq(&a.conv_v, &b.conv_v)
                            && eq(&a.s, &b.s)
                    }
                    (LayerState::Mla(a), LayerState::Mla(b)) => {
                        eq(&a.c_kv, &b.c_kv) && eq(&a.k_rope, &b.k_rope)
                    }
                    _ => false,
                })
    }

    /// A mark to [`Self::rewind`] to: the KDA layers' conv windows and recurrent state (fixed
    /// size, copied) and every MLA cache's length (append-only, so a length is enough).
    pub fn mark(&self) -> StateMark {
        StateMark {
            n_pos: self.n_pos,
            layers: self
                .layers
                .iter()
                .map(|l| match l {
                    LayerState::Kda(k) => MarkedLayer::Kda(k.clone()),
                    LayerState::Mla(m) => MarkedLayer::Mla([m.c_kv.len(), m.k_rope.len()]),
                })
                .collect(),
        }
    }

    /// Back to the state at `mark` (taken from this state, which has only been fed since):
    /// the KDA states copied back, the MLA caches cut to their marked lengths.
    pub fn rewind(&mut self, mark: &StateMark) {
        assert!(
            mark.n_pos <= self.n_pos && mark.layers.len() == self.layers.len(),
            "rewind: the mark is not from this state's past"
        );
        for (l, m) in self.layers.iter_mut().zip(&mark.layers) {
            match (l, m) {
                (LayerState::Kda(k), MarkedLayer::Kda(saved)) => k.clone_from(saved),
                (LayerState::Mla(st), MarkedLayer::Mla([a, b])) => {
                    st.c_kv.truncate(*a);
                    st.k_rope.truncate(*b);
                }
                _ => panic!("rewind: the mark's layer kinds differ from this state's"),
            }
        }
        self.n_pos = mark.n_pos;
    }
}

/// A point a [`SeqState`] can be rewound to (speculative decoding's rejected drafts).
#[derive(Clone, Debug)]
pub struct StateMark {
    n_pos: usize,
    layers: Vec<MarkedLayer>,
}

#[derive(Clone, Debug)]
enum MarkedLayer {
    Kda(KdaState),
    Mla([usize; 2]),
}

impl StateMark {
    /// Positions fed when the mark was taken.
    pub fn n_pos(&self) -> usize {
        self.n_pos
    }
}
