//! Expert-cache policy plugin: LFU with aging.
//!
//! Owns: a request count per (layer, expert) kept for the whole run, resident or not (so an
//! expert that comes back after an eviction keeps its history), halved every `age_every`
//! requests (default: 16 x the capacity) so popularity can shift; the victim is the candidate
//! with the lowest count; ties go to the expert whose layer comes round last (the layer just
//! computed: with every token sweeping the layers in order, its experts are needed farthest in
//! the future), then the lowest slot.
//! Why: with flat routing every token sweeps all layers in order, and LRU evicts exactly what
//! the next token needs (a cyclic scan); frequency keeps the popular experts through the sweep.
//! Options (`--plugin-opt`): `age_every=N` requests between halvings (default 16 x the
//! capacity; 0 = never); `mode=layer` (default), `lru` (ties to the least recently used) or
//! `density` (evict the lowest (count + prior) / layers until its layer's turn; `prior=F`).
//! Build: `cargo build --release -p k3-plugin-lfu` gives `target/release/libk3_plugin_lfu.so`.

use std::collections::HashMap;

use k3_plugin_abi::{
    CacheEvent, CachePolicy, CacheSetup, Candidate, EV_HIT, EV_INSERT, EV_REQUEST, OK,
    export_cache_policy,
};

pub struct Lfu {
    counts: HashMap<(u32, u32), u32>,
    last_use: HashMap<(u32, u32), u64>,
    clock: u64,
    age_every: u64,
    since_aging: u64,
    /// Layers (for the distance to a layer's next turn).
    n_layers: u32,
    /// The layer of the latest request.
    cur_layer: u32,
    /// How the victim is scored (`mode=`): 0 = count then LRU, 1 = count then farthest
    /// layer, 2 = count / distance.
    mode: u8,
    prior: f64,
}

impl Lfu {
    /// Layers until `layer` comes round again (the current layer counts as a full cycle).
    fn distance(&self, layer: u32) -> u32 {
        let n = self.n_layers.max(1);
        let d = (layer % n + n - self.cur_layer % n) % n;
        if d == 0 { n } else { d }
    }
}

impl CachePolicy for Lfu {
    fn create(setup: &CacheSetup) -> Result<Self, String> {
        let age_every = setup
            .options
            .number("age_every", setup.capacity.saturating_mul(16))?;
        let mode = match setup.options.get("mode").unwrap_or("layer") {
            "lru" => 0,
            "layer" => 1,
            "density" => 2,
            m => return Err(format!("option mode={m}: expected lru, layer or density")),
        };
        Ok(Lfu {
            counts: HashMap::new(),
            last_use: HashMap::new(),
            clock: 0,
            age_every,
            since_aging: 0,
            n_layers: setup.n_layers,
            cur_layer: 0,
            mode,
            prior: setup.options.number("prior", 1.0)?,
        })
    }

    fn on_event(&mut self, ev: &CacheEvent) -> i32 {
        let key = (ev.layer, ev.expert);
        match ev.kind {
            EV_REQUEST => {
                self.cur_layer = ev.layer;
                *self.counts.entry(key).or_insert(0) += 2;
                self.since_aging += 1;
                if self.age_every > 0 && self.since_aging >= self.age_every {
                    self.since_aging = 0;
                    self.counts.retain(|_, c| {
                        *c /= 2;
                        *c > 0
                    });
                }
            }
            EV_HIT | EV_INSERT => {
                self.clock += 1;
                self.last_use.insert(key, self.clock);
            }
            _ => {}
        }
        OK
    }

    fn choose_victim(&mut self, candidates: &[Candidate]) -> usize {
        let count = |c: &Candidate| {
            self.counts
                .get(&(c.key.layer, c.key.expert))
                .copied()
                .unwrap_or(0)
        };
        if self.mode == 1 {
            return candidates
                .iter()
                .enumerate()
                .min_by_key(|(_, c)| (count(c), u32::MAX - self.distance(c.key.layer), c.slot))
                .map_or(0, |(i, _)| i);
        }
        if self.mode == 2 {
            let score = |c: &Candidate| {
                (f64::from(count(c)) + self.prior) / f64::from(self.distance(c.key.layer))
            };
            return candidates
                .iter()
                .enumerate()
                .min_by(|(_, a), (_, b)| score(a).total_cmp(&score(b)).then(a.slot.cmp(&b.slot)))
                .map_or(0, |(i, _)| i);
        }
        candidates
            .iter()
            .enumerate()
            .min_by_key(|(_, c)| {
                let k = (c.key.layer, c.key.expert);
                (
                    self.counts.get(&k).copied().unwrap_or(0),
                    self.last_use.get(&k).copied().unwrap_or(0),
                    c.slot,
                )
            })
            .map_or(0, |(i, _)| i)
    }
}

export_cache_policy!(
    Lfu,
    "lfu",
    "LFU with aging: run-long request counts, halved every age_every requests"
);

#[cfg(test)]
mod tests {
    use super::*;
    use k3_plugin_abi::{ExpertKey, Options};

    fn ev(kind: u32, expert: u32) -> CacheEvent {
        CacheEvent {
            kind,
            layer: 0,
            expert,
            reserved: 0,
            slot: 0,
            bytes: 0,
            seq: 0,
        }
    }

    #[test]
    fn evicts_the_least_frequent_then_ages() {
        let setup = CacheSetup {
            capacity: 2,
            expert_bytes: 1,
            n_layers: 1,
            n_experts: 4,
            top_k: 1,
            options: Options::parse("age_every=6\nmode=lru"),
        };
        let mut p = Lfu::create(&setup).expect("create");
        for e in [0, 0, 0, 1] {
            p.on_event(&ev(EV_REQUEST, e));
            p.on_event(&ev(EV_HIT, e));
        }
        let c = |e| Candidate {
            key: ExpertKey {
                layer: 0,
                expert: e,
            },
            slot: u64::from(e),
        };
        // 1 was used more recently but less often.
        assert_eq!(p.choose_victim(&[c(0), c(1)]), 1);
        // Two more requests of 1 reach the aging point: counts halve (0: 6 -> 3, 1: 6 -> 3),
        // then the tie goes to the least recently used (0).
        for _ in 0..2 {
            p.on_event(&ev(EV_REQUEST, 1));
            p.on_event(&ev(EV_HIT, 1));
        }
        assert_eq!(p.choose_victim(&[c(0), c(1)]), 0);
        let bad = CacheSetup {
            options: Options::parse("age_every=soon"),
            ..setup
        };
        assert!(
            Lfu::create(&bad)
                .err()
                .is_some_and(|e| e.contains("age_every"))
        );
    }
}
