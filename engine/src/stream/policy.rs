//! Expert-cache policy plugins (ABI version 2) and their trace replay (`sim-cache --plugin`).
//!
//! Owns: [`CachePlugin`], the [`EvictionPolicy`] over a version-2 cache-policy vtable: every
//! cache event forwarded with (layer, expert, slot, bytes), every answer checked (an error
//! code, a caught panic, a victim index outside the candidates all drop the plugin for the
//! rest of the run with one warning on stderr; the built-in LRU, fed every event from the
//! start, takes over warm), pins granted up to half the capacity; and [`replay`], which runs
//! any policy over a recorded trace the way the cache would (per request; a miss in a full
//! cache evicts the victim the policy picks among every resident, unpinned expert).
//! Must not: let a plugin change a served byte (a policy decides which reads happen only), or
//! call a plugin again after it failed.
//! Follows upstream: SYSTEM.md §10 (cache policies as plugins, judged by trace replay against
//! LRU and Belady).

use std::collections::{HashMap, HashSet};

use k3_plugin_abi as abi;

use super::experts::{EvictionPolicy, ExpertKey, Lru};
use super::trace::TOKEN_MARK;
use crate::plugins::CacheShape;

/// A version-2 cache-policy plugin with the built-in LRU as warm fallback.
pub struct CachePlugin {
    vt: &'static abi::CachePolicyVTable,
    handle: abi::Handle,
    name: String,
    bytes: u64,
    fallback: Lru,
    failure: Option<String>,
    pinned: HashSet<ExpertKey>,
    pin_cap: usize,
    pin_refused: bool,
    requests: u64,
    tokens: u64,
}

// SAFETY: the plugin state behind `handle` is only touched through `&mut self` (one thread at
// a time, as the ABI requires); the vtable is immutable static data.
unsafe impl Send for CachePlugin {}

impl std::fmt::Debug for CachePlugin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CachePlugin")
            .field("name", &self.name)
            .field("failure", &self.failure)
            .finish_non_exhaustive()
    }
}

impl CachePlugin {
    /// Adopt a created instance (see `plugins::cache_policy_from`).
    pub(crate) fn new(
        vt: &'static abi::CachePolicyVTable,
        handle: abi::Handle,
        name: &str,
        shape: &CacheShape,
    ) -> Self {
        Self {
            vt,
            handle,
            name: format!("plugin:{name}"),
            bytes: shape.expert_bytes,
            fallback: Lru::default(),
            failure: None,
            pinned: HashSet::new(),
            pin_cap: shape.capacity / 2,
            pin_refused: false,
            requests: 0,
            tokens: 0,
        }
    }

    fn fail(&mut self, msg: String) {
        if self.failure.is_none() {
            let m = format!(
                "{}: {msg}; the built-in LRU takes over for the rest of the run",
                self.name
            );
            eprintln!("k3-run: warning: cache policy {m}");
            self.failure = Some(m);
        }
    }

    fn event(&mut self, kind: u32, key: Option<ExpertKey>, slot: usize, seq: u64) {
        if self.failure.is_some() {
            return;
        }
        let (layer, expert) = key.unwrap_or((0, 0));
        let ev = abi::CacheEvent {
            kind,
            layer: layer as u32,
            expert: expert as u32,
            reserved: 0,
            slot: slot as u64,
            bytes: if key.is_some() && kind != abi::EV_REQUEST {
                self.bytes
            } else {
                0
            },
            seq,
        };
        // SAFETY: live handle from `create`, one thread (&mut self), a valid event.
        let rc = unsafe { (self.vt.on_event)(self.handle, &ev) };
        match (rc, key) {
            (abi::OK, _) => {}
            (abi::REPLY_PIN, Some(k)) if kind == abi::EV_HIT || kind == abi::EV_INSERT => {
                if self.pinned.contains(&k) || self.pinned.len() < self.pin_cap {
                    self.pinned.insert(k);
                } else if !self.pin_refused {
                    self.pin_refused = true;
                    eprintln!(
                        "k3-run: warning: cache policy {}: pins are capped at half the cache \
                         ({} experts); further pins are not granted",
                        self.name, self.pin_cap
                    );
                }
            }
            (abi::REPLY_UNPIN, Some(k)) => {
                self.pinned.remove(&k);
            }
            (abi::REPLY_PIN | abi::REPLY_UNPIN, _) => {}
            (abi::ERR_PANIC, _) => {
                self.fail(format!("event {kind} panicked (caught in the plugin)"))
            }
            (rc, _) => self.fail(format!("event {kind} returned code {rc}")),
        }
    }
}

impl EvictionPolicy for CachePlugin {
    fn name(&self) -> &str {
        &self.name
    }
    fn failure(&self) -> Option<&str> {
        self.failure.as_deref()
    }
    fn on_request(&mut self, key: ExpertKey) {
        self.requests += 1;
        self.event(abi::EV_REQUEST, Some(key), 0, self.requests);
    }
    fn on_token(&mut self) {
        self.tokens += 1;
        self.event(abi::EV_TOKEN, None, 0, self.tokens);
    }
    fn is_pinned(&self, key: ExpertKey) -> bool {
        self.failure.is_none() && self.pinned.contains(&key)
    }
    fn on_access(&mut self, key: ExpertKey, slot: usize) {
        self.fallback.on_access(key, slot);
        self.event(abi::EV_HIT, Some(key), slot, self.requests);
    }
    fn on_insert(&mut self, key: ExpertKey, slot: usize) {
        self.fallback.on_insert(key, slot);
        self.event(abi::EV_INSERT, Some(key), slot, self.requests);
    }
    fn on_remove(&mut self, key: ExpertKey, slot: usize) {
        self.fallback.on_remove(key, slot);
        self.pinned.remove(&key);
        self.event(abi::EV_EVICT, Some(key), slot, self.requests);
    }
    fn choose_victim(&mut self, candidates: &[(ExpertKey, usize)]) -> usize {
        if self.failure.is_none() {
            let c: Vec<abi::Candidate> = candidates
                .iter()
                .map(|&(k, s)| abi::Candidate {
                    key: abi::ExpertKey {
                        layer: k.0 as u32,
                        expert: k.1 as u32,
                    },
                    slot: s as u64,
                })
                .collect();
            let mut out = u64::MAX;
            // SAFETY: live handle; `c` holds `c.len()` candidates; `out` is valid.
            let rc = unsafe {
                (self.vt.choose_victim)(self.handle, c.as_ptr(), c.len() as u64, &mut out)
            };
            match rc {
                abi::OK => match usize::try_from(out) {
                    Ok(i) if i < candidates.len() => return i,
                    _ => self.fail(format!(
                        "choose_victim named candidate {out} of {} (not a resident expert it \
                         was offered)",
                        candidates.len()
                    )),
                },
                abi::ERR_PANIC => self.fail("choose_victim panicked (caught in the plugin)".into()),
                rc => self.fail(format!("choose_victim returned code {rc}")),
            }
        }
        self.fallback.choose_victim(candidates)
    }
}

impl Drop for CachePlugin {
    fn drop(&mut self) {
        // SAFETY: the handle came from `create` and is destroyed exactly once.
        unsafe { (self.vt.destroy)(self.handle) };
    }
}

/// The shape of the model a trace was recorded on, as far as the trace shows it.
pub fn trace_shape(records: &[(u32, u32)], capacity: usize, expert_bytes: u64) -> CacheShape {
    let (mut layers, mut experts) = (0usize, 0usize);
    let mut top_k = 0usize;
    let mut run = 0usize;
    let mut last_layer = None;
    for &(l, e) in records {
        if l == TOKEN_MARK {
            last_layer = None;
            run = 0;
            continue;
        }
        layers = layers.max(l as usize + 1);
        experts = experts.max(e as usize + 1);
        run = if last_layer == Some(l) { run + 1 } else { 1 };
        last_layer = Some(l);
        top_k = top_k.max(run);
    }
    CacheShape {
        capacity,
        expert_bytes,
        n_layers: layers,
        n_experts: experts,
        top_k,
    }
}

/// Hits of `policy` replaying `records` at `capacity` experts: per request, a hit if resident;
/// else the expert is loaded, into a free slot or in place of the victim the policy picks
/// among every resident expert it has not pinned (all of them if it pinned every one).
pub fn replay(records: &[(u32, u32)], capacity: usize, policy: &mut dyn EvictionPolicy) -> u64 {
    let mut hits = 0u64;
    if capacity == 0 {
        return 0;
    }
    let mut slot_of: HashMap<ExpertKey, usize> = HashMap::new();
    let mut slots: Vec<ExpertKey> = Vec::with_capacity(capacity);
    for &(l, e) in records {
        if l == TOKEN_MARK {
            policy.on_token();
            continue;
        }
        let key = (l as usize, e as usize);
        policy.on_request(key);
        if let Some(&s) = slot_of.get(&key) {
            hits += 1;
            policy.on_access(key, s);
            continue;
        }
        let s = if slots.len() < capacity {
            slots.push(key);
            slots.len() - 1
        } else {
            let mut cands: Vec<(ExpertKey, usize)> =
                slots.iter().enumerate().map(|(i, &k)| (k, i)).collect();
            if cands.iter().any(|&(k, _)| !policy.is_pinned(k)) {
                cands.retain(|&(k, _)| !policy.is_pinned(k));
            }
            let pick = policy.choose_victim(&cands).min(cands.len() - 1);
            let (old, i) = cands[pick];
            slot_of.remove(&old);
            policy.on_remove(old, i);
            slots[i] = key;
            i
        };
        slot_of.insert(key, s);
        policy.on_insert(key, s);
    }
    hits
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::stream::trace::simulate;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn replaying_the_builtin_lru_gives_the_simulators_lru(
            recs in prop::collection::vec((0u32..3, 0u32..8), 0..300), cap in 0usize..12
        ) {
            let mut lru = Lru::default();
            prop_assert_eq!(replay(&recs, cap, &mut lru), simulate(&recs, cap).lru_hits);
        }
    }

    #[test]
    fn shape_from_a_trace() {
        let recs = [
            (TOKEN_MARK, 1),
            (1, 3),
            (1, 5),
            (2, 0),
            (TOKEN_MARK, 2),
            (1, 9),
        ];
        let s = trace_shape(&recs, 4, 100);
        assert_eq!(
            (s.n_layers, s.n_experts, s.top_k, s.capacity),
            (3, 10, 2, 4)
        );
    }
}
