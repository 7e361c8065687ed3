//! Routed experts from disk: the expert store (positional reads) and the expert cache.
//!
//! Owns: [`ExpertStore`] — where each routed expert's six tensors (w1/w3/w2 packed + E8M0
//! scale) live in the shards, one positional read per contiguous run, a layer's misses issued
//! together in disk-offset order on a small read pool, and the E8M0 0xFF check on every read
//! (the error names the tensor); [`ExpertCache`] — the `ExpertSource` with a byte budget,
//! slot states (empty / in flight / ready), a pluggable [`EvictionPolicy`] ([`Lru`] default)
//! and the counters, including the TRUE resident hit rate (served from RAM that was resident
//! before the token asked; [`ExpertSource::begin_token`] marks the boundary). A budget of 0
//! caches nothing and serves each call from a scratch area. Speculative prefetch
//! ([`ExpertSource::prefetch`]): guessed experts are read on a background thread into claimed
//! slots (state in flight, buffer handed to the thread) while the executor computes; a later
//! request waits for them instead of reading twice. Prefetch-served requests count as raw hits,
//! never as resident hits, and are counted apart (prefetched / prefetch hits / wasted).
//! Must not: decode or zero anything: a failed read is returned as `WeightError::Expert` (the
//! run finishes and exits 4), never replaced by zeros.
//! Follows upstream: docs/DESIGN.md §4 and the seeds (expert LRU cache, true resident hit rate
//! reported apart from raw hits).
//!
//! Files: this one holds the expert keys and tensor slots and serves experts (the
//! `ExpertSource` impl of [`ExpertCache`]); `store.rs` is [`ExpertStore`]; `cache.rs` the
//! cache's slots and bookkeeping; `prefetch.rs` the background reads of guesses;
//! `policy.rs` [`EvictionPolicy`] and [`Lru`].

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, mpsc};
use std::time::Instant;

use k3_models::spec::{ExpertFormat, ModelSpec, TensorRole};

use super::StreamError;
use super::aligned::{AlignedBuf, IO_ALIGN, align_up};
use super::direct::{DirectFile, ReadPool, ReadReq};
use crate::checkpoint::Checkpoint;
use crate::weights::{ExpertSource, ExpertStats, ExpertWeights, WeightError};

mod cache;
mod policy;
mod prefetch;
mod store;

use cache::*;
pub use cache::{ExpertCache, ExpertCacheOptions, SlotState};
pub use policy::{EvictionPolicy, Lru};
use prefetch::*;
pub use store::ExpertStore;
use store::*;

/// (layer, expert).
pub type ExpertKey = (usize, usize);

/// The six tensors of one expert, in this order.
pub const EXPERT_ROLES: [TensorRole; 6] = [
    TensorRole::ExpertW1Packed,
    TensorRole::ExpertW1Scale,
    TensorRole::ExpertW3Packed,
    TensorRole::ExpertW3Scale,
    TensorRole::ExpertW2Packed,
    TensorRole::ExpertW2Scale,
];

fn is_scale(i: usize) -> bool {
    i % 2 == 1
}

/// The slot (index into [`EXPERT_ROLES`] order) of an expert tensor role: MXFP4 roles map to
/// their own slot, a BF16 expert's `ExpertW1/W3/W2` to the packed slots 0/2/4 (its scale
/// slots stay empty).
pub fn expert_slot(role: TensorRole) -> Option<usize> {
    match role {
        TensorRole::ExpertW1 => Some(0),
        TensorRole::ExpertW3 => Some(2),
        TensorRole::ExpertW2 => Some(4),
        r => EXPERT_ROLES.iter().position(|&x| x == r),
    }
}

/// Whether slot `k` is absent by design: the scale slots of BF16 experts.
fn slot_absent(format: ExpertFormat, k: usize) -> bool {
    format == ExpertFormat::Bf16 && is_scale(k)
}

/// The routed experts' storage format of `spec` (MXFP4 when it has no MoE).
pub fn expert_format(spec: &ModelSpec) -> ExpertFormat {
    spec.moe
        .as_ref()
        .map_or(ExpertFormat::Mxfp4, |m| m.expert_format)
}

impl ExpertSource for ExpertCache<'_> {
    fn trace(&self) -> Option<&[(u32, u32)]> {
        self.trace.as_deref()
    }

    fn begin_token(&mut self) {
        self.token += 1;
        self.policy.on_token();
        if let Some(t) = &mut self.trace {
            t.push((super::trace::TOKEN_MARK, self.token as u32));
        }
    }

    fn experts(
        &mut self,
        layer: usize,
        ids: &[u32],
    ) -> Result<Vec<ExpertWeights<'_>>, WeightError> {
        if ids.windows(2).any(|w| w[0] >= w[1]) {
            return Err(WeightError::Invalid {
                name: format!("routed experts of layer {layer}"),
                msg: format!("ids must be ascending and unique, got {ids:?}"),
            });
        }
        if let Some(t) = &mut self.trace {
            t.extend(ids.iter().map(|&e| (layer as u32, e)));
        }
        // Every prefetch lands (or fails) before this call looks at the slots: no slot is in
        // flight below except this call's own misses, so nothing is read twice.
        let deferred = self.deferred.take();
        self.poll_prefetches(Some(layer));
        if let Some(g) = self.guesses.iter().find(|(gl, _)| *gl == layer) {
            self.stats.guessed_requests += ids.len() as u64;
            self.stats.guess_covered += ids.iter().filter(|id| g.1.contains(id)).count() as u64;
        }
        self.guesses.retain(|(gl, _)| *gl > layer);
        self.stats.requests += ids.len() as u64;
        for &id in ids {
            self.policy.on_request((layer, id as usize));
        }
        let mut places: Vec<Option<Place>> = vec![None; ids.len()];
        let mut protected: HashSet<usize> = HashSet::new();
        // Hits first, so no victim is chosen among the experts this call needs.
        for (i, &id) in ids.iter().enumerate() {
            let key = (layer, id as usize);
            if let Some(&s) = self.map.get(&key)
                && self.slots[s].state == SlotState::Ready
            {
                places[i] = Some(Place::Slot(s));
                protected.insert(s);
                self.stats.hits += 1;
                let slot = &mut self.slots[s];
                if slot.from_prefetch {
                    // Fetched by a guess, not resident before the token needed it.
                    slot.from_prefetch = false;
                    self.stats.prefetch_hits += 1;
                } else if slot.loaded_token < self.token {
                    self.stats.resident_hits += 1;
                }
                self.policy.on_access(key, s);
            }
        }
        // Guesses for this layer that the routing did not pick: dropped at once, so a wrong
        // guess never pushes a useful expert out later (with cyclic layer order, a cache just
        // above the working set would otherwise fall off the LRU cliff).
        for (i, slot) in self.slots.iter_mut().enumerate() {
            if let Some(k) = slot.key
                && slot.from_prefetch
                && k.0 == layer
            {
                slot.from_prefetch = false;
                slot.state = SlotState::Empty;
                slot.key = None;
                if self.map.get(&k) == Some(&i) {
                    self.map.remove(&k);
                }
                self.policy.on_remove(k, i);
                self.stats.prefetch_wasted += 1;
            }
        }
        // Misses: claim slots (or scratch), in ascending id order.
        let mut miss_idx = Vec::new();
        let mut n_scratch = 0usize;
        for i in 0..ids.len() {
            if places[i].is_some() {
                continue;
            }
            miss_idx.push(i);
            let key = (layer, ids[i] as usize);
            match self.claim_slot(&protected) {
                Some(s) => {
                    protected.insert(s);
                    let slot = &mut self.slots[s];
                    slot.state = SlotState::InFlight;
                    slot.key = Some(key);
                    places[i] = Some(Place::Slot(s));
                }
                None => {
                    places[i] = Some(Place::Scratch(n_scratch));
                    n_scratch += 1;
                }
            }
        }
        self.stats.misses += miss_idx.len() as u64;
        let mut first_err: Option<WeightError> = None;
        if !miss_idx.is_empty() {
            let need = self.store.expert_buf_bytes();
            let alloc_err = |e: std::io::Error| WeightError::Invalid {
                name: format!("routed experts of layer {layer}"),
                msg: format!("cannot allocate an expert buffer of {need} bytes: {e}"),
            };
            let n_miss = miss_idx.len();
            while self.scratch.len() < n_scratch {
                let b = self.take_buf(n_miss).map_err(alloc_err)?;
                self.scratch.push((b, [(0, 0); 6]));
            }
            for &i in &miss_idx {
                if let Some(Place::Slot(s)) = places[i]
                    && self.slots[s].buf.is_none()
                {
                    self.slots[s].buf = Some(self.take_buf(n_miss).map_err(alloc_err)?);
                }
            }
            // Borrow every miss buffer at once (slots and scratch are disjoint fields).
            let keys: Vec<ExpertKey> = miss_idx.iter().map(|&i| (layer, ids[i] as usize)).collect();
            let mut slot_bufs: HashMap<usize, &mut AlignedBuf> = self
                .slots
                .iter_mut()
                .enumerate()
                .filter(|(_, s)| s.state == SlotState::InFlight)
                .filter_map(|(i, s)| s.buf.as_mut().map(|b| (i, b)))
                .collect();
            let mut scratch_bufs: Vec<Option<&mut AlignedBuf>> =
                self.scratch.iter_mut().map(|(b, _)| Some(b)).collect();
            let mut bufs = Vec::with_capacity(miss_idx.len());
            for &i in &miss_idx {
                let b = match places[i] {
                    Some(Place::Slot(s)) => slot_bufs.remove(&s),
                    Some(Place::Scratch(k)) => scratch_bufs[k].take(),
                    None => None,
                };
                bufs.push(b.ok_or_else(|| WeightError::Invalid {
                    name: format!("routed experts of layer {layer}"),
                    msg: "expert buffer bookkeeping broke (internal error)".to_string(),
                })?);
            }
            let t0 = Instant::now();
            let (layouts, bytes) = self.store.read_batch(&keys, bufs);
            self.stats.read_seconds += t0.elapsed().as_secs_f64();
            self.stats.bytes_read += bytes;
            for ((&i, key), lay) in miss_idx.iter().zip(&keys).zip(layouts) {
                let place = places[i].ok_or_else(|| WeightError::Invalid {
                    name: format!("routed experts of layer {layer}"),
                    msg: "unplaced miss (internal error)".to_string(),
                })?;
                let checked = lay.and_then(|lay| {
                    let buf = match place {
                        Place::Slot(s) => self.slots[s].buf.as_ref().map(|b| b.full()),
                        Place::Scratch(k) => Some(self.scratch[k].0.full()),
                    }
                    .ok_or_else(|| "expert buffer missing (internal error)".to_string())?;
                    self.store.check_scales(*key, &lay, buf)?;
                    Ok(lay)
                });
                match (checked, place) {
                    (Ok(lay), Place::Slot(s)) => {
                        let slot = &mut self.slots[s];
                        slot.state = SlotState::Ready;
                        slot.tensors = lay.tensors;
                        slot.loaded_token = self.token;
                        self.map.insert(*key, s);
                        self.policy.on_insert(*key, s);
                    }
                    (Ok(lay), Place::Scratch(k)) => self.scratch[k].1 = lay.tensors,
                    (Err(msg), place) => {
                        self.stats.load_failures += 1;
                        if let Place::Slot(s) = place {
                            let slot = &mut self.slots[s];
                            slot.state = SlotState::Empty;
                            slot.key = None;
                        }
                        if first_err.is_none() {
                            first_err = Some(WeightError::Expert {
                                layer,
                                expert: key.1,
                                msg,
                            });
                        }
                    }
                }
            }
        }
        if let Some(e) = first_err {
            return Err(e);
        }
        self.last_layer = Some(layer);
        self.last_slots.clear();
        for p in &places {
            if let Some(Place::Slot(s)) = p {
                self.last_slots.push(*s);
            }
        }
        // This layer's misses have landed: start the look-ahead guess (never evicts them).
        if let Some((nl, next)) = deferred {
            self.prefetch(nl, &next);
        }
        let mut out = Vec::with_capacity(ids.len());
        for (i, &id) in ids.iter().enumerate() {
            let (buf, t) = match places[i] {
                Some(Place::Slot(s)) => {
                    let slot = &self.slots[s];
                    (slot.buf.as_ref().map(|b| b.full()), slot.tensors)
                }
                Some(Place::Scratch(k)) => (Some(self.scratch[k].0.full()), self.scratch[k].1),
                None => (None, [(0, 0); 6]),
            };
            let buf = buf.ok_or_else(|| WeightError::Invalid {
                name: format!("routed expert {id} of layer {layer}"),
                msg: "not resident after its read (internal error)".to_string(),
            })?;
            out.push(expert_view(id, self.store.format, buf, &t));
        }
        Ok(out)
    }

    fn reads_ahead(&self) -> bool {
        self.capacity > 0 && self.prefetch_margin.is_some() && self.prefetch_off.is_none()
    }

    fn experts_split(
        &mut self,
        layer: usize,
        ids: &[u32],
        early: &mut dyn FnMut(&[usize], &[ExpertWeights<'_>]),
    ) -> Result<(Vec<usize>, Vec<ExpertWeights<'_>>), WeightError> {
        // Reads that landed since the last look, then what is in RAM now.
        self.poll_prefetches(None);
        let mut ready = Vec::new();
        let mut all_known = true;
        for (i, &id) in ids.iter().enumerate() {
            match self.map.get(&(layer, id as usize)) {
                Some(&s) if self.slots[s].state == SlotState::Ready => ready.push((i, s)),
                Some(_) => {}
                None => all_known = false,
            }
        }
        // Something left to wait for: `early` runs first (with the ready ones, possibly none).
        if ready.len() < ids.len() && !ids.windows(2).any(|w| w[0] >= w[1]) {
            // Nothing to read on demand (every id is ready or in flight): the look-ahead guess
            // can start now; it queues behind this layer's reads and never evicts them.
            if all_known && let Some((nl, next)) = self.deferred.take() {
                self.prefetch(nl, &next);
            }
            let at: Vec<usize> = ready.iter().map(|&(i, _)| i).collect();
            let views: Vec<ExpertWeights<'_>> = ready
                .iter()
                .filter_map(|&(i, s)| {
                    let slot = &self.slots[s];
                    // still Ready: `prefetch` above never evicts this layer's experts
                    (slot.state == SlotState::Ready)
                        .then_some(())
                        .and(slot.buf.as_ref())
                        .map(|b| expert_view(ids[i], self.store.format, b.full(), &slot.tensors))
                })
                .collect();
            if views.len() == at.len() {
                early(&at, &views);
                drop(views);
                let all = self.experts(layer, ids)?;
                let (mut rest_at, mut rest) = (Vec::new(), Vec::new());
                for (i, v) in all.into_iter().enumerate() {
                    if !at.contains(&i) {
                        rest_at.push(i);
                        rest.push(v);
                    }
                }
                return Ok((rest_at, rest));
            }
        }
        let all = self.experts(layer, ids)?;
        Ok(((0..ids.len()).collect(), all))
    }

    fn stats(&self) -> ExpertStats {
        self.stats.clone()
    }

    fn reads_block(&self) -> bool {
        true
    }

    fn ready(&mut self, layer: usize, ids: &[u32]) -> bool {
        self.poll_prefetches(None);
        ids.iter().all(|&id| {
            self.map
                .get(&(layer, id as usize))
                .is_some_and(|&s| self.slots[s].state == SlotState::Ready)
        })
    }

    fn prefetch_margin(&self) -> Option<usize> {
        if self.capacity == 0 || self.prefetch_off.is_some() {
            None
        } else {
            self.prefetch_margin
        }
    }

    fn prefetch_after_next(&mut self, layer: usize, ids: &[u32]) {
        self.deferred = Some((layer, ids.to_vec()));
    }

    fn prefetch(&mut self, layer: usize, ids: &[u32]) {
        self.guesses.retain(|(gl, _)| *gl != layer);
        self.guesses.push((layer, ids.to_vec()));
        if self.capacity == 0 || self.prefetch_off.is_some() {
            return;
        }
        self.poll_prefetches(None);
        let (files, pool) = (&self.store.files, &self.store.pool);
        self.prefetcher
            .get_or_insert_with(|| Prefetcher::new(Arc::clone(files), Arc::clone(pool)));
        // Never evicted for a guess: what the last request used, other guesses still pending,
        // slots in flight, and guessed experts already resident.
        // Nor experts of the layers between the last request and the guessed one: they may be
        // asked for before the guessed layer (a look-ahead guess skips the current layer).
        let upcoming = |k: usize| match self.last_layer {
            Some(last) if last < layer => k > last && k <= layer,
            Some(last) => k > last || k <= layer,
            None => k <= layer,
        };
        let mut protected: HashSet<usize> = self.last_slots.iter().copied().collect();
        for (i, slot) in self.slots.iter().enumerate() {
            if slot.from_prefetch
                || slot.state != SlotState::Ready
                || slot.key.is_some_and(|k| upcoming(k.0))
            {
                protected.insert(i);
            }
        }
        for &id in ids {
            if let Some(&s) = self.map.get(&(layer, id as usize)) {
                protected.insert(s);
            }
        }
        let mut items = Vec::new();
        for &id in ids {
            let key = (layer, id as usize);
            if self.map.contains_key(&key) {
                continue;
            }
            let Some(entry) = self.store.entries.get(key) else {
                continue;
            };
            let layout = self.store.layout(entry);
            let Some(s) = self.claim_slot(&protected) else {
                break;
            };
            protected.insert(s);
            let buf = match self.slots[s].buf.take() {
                Some(b) => b,
                None => match self.take_buf(1) {
                    Ok(b) => b,
                    Err(_) => break,
                },
            };
            let slot = &mut self.slots[s];
            slot.state = SlotState::InFlight;
            slot.key = Some(key);
            slot.from_prefetch = true;
            slot.loaded_token = self.token;
            self.map.insert(key, s);
            items.push(PrefetchItem {
                slot: s,
                key,
                layout,
                buf,
            });
        }
        if items.is_empty() {
            return;
        }
        self.stats.prefetched += items.len() as u64;
        if let Some(p) = self.prefetcher.as_mut() {
            p.send(items);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tensor_loc_keeps_what_fits_and_refuses_the_rest() {
        let l = TensorLoc::new(3, (1 << 47) + 12_345, u64::from(u32::MAX)).expect("fits");
        assert_eq!(
            (l.file, l.offset(), l.len()),
            (3, (1 << 47) + 12_345, u64::from(u32::MAX))
        );
        assert_eq!(std::mem::size_of::<TensorLoc>(), 12);
        assert_eq!(std::mem::size_of::<ExpertEntry>(), 96);
        let e = TensorLoc::new(0, 0, 1 << 32).expect_err("too long");
        assert!(e.contains("4294967296 bytes long"), "{e}");
        let e = TensorLoc::new(0, LOC_OFFSET_LIMIT, 1).expect_err("too far");
        assert!(e.contains("offset 281474976710656"), "{e}");
    }

    #[test]
    fn table_lookups_stay_in_their_layer() {
        let mut t = ExpertTable {
            base: vec![0, 0, 3, 5],
            entries: vec![ExpertEntry::ABSENT; 5],
            count: 0,
        };
        for i in [0, 2, 3] {
            t.entries[i].decl[0] = i as u32;
        }
        assert!(t.get((0, 0)).is_none());
        assert_eq!(t.get((1, 0)).map(|e| e.decl[0]), Some(0));
        assert!(t.get((1, 1)).is_none(), "sparse id");
        assert_eq!(t.get((1, 2)).map(|e| e.decl[0]), Some(2));
        assert!(
            t.get((1, 3)).is_none(),
            "past the layer's width, not the next layer's"
        );
        assert_eq!(t.get((2, 0)).map(|e| e.decl[0]), Some(3));
        assert!(t.get((2, 2)).is_none() && t.get((3, 0)).is_none());
        assert!(t.get((usize::MAX, usize::MAX)).is_none());
        let keys: Vec<ExpertKey> = t.iter().map(|(k, _)| k).collect();
        assert_eq!(keys, vec![(1, 0), (1, 2), (2, 0)]);
    }
}
