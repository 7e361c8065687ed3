//! Expert-cache policy plugin: LFU with aging.
//!
//! Owns: a request count per (layer, expert) kept for the whole run, resident or not (so an
//! expert that comes back after an eviction keeps its history), halved every `age_every`
//! requests (default: 8 x the capacity) so popularity can shift; the victim is the candidate
//! with the lowest count, ties to the least recently used, then the lowest slot.
//! Why: with flat routing every token sweeps all layers in order, and LRU evicts exactly what
//! the next token needs (a cyclic scan); frequency keeps the popular experts through the sweep.
//! Options (`--plugin-opt`): `age_every=N` requests between halvings (0 = never).
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
}

impl CachePolicy for Lfu {
    fn create(setup: &CacheSetup) -> Result<Self, String> {
        let age_every = setup
            .options
            .number("age_every", setup.capacity.saturating_mul(8))?;
        Ok(Lfu {
            counts: HashMap::new(),
            last_use: HashMap::new(),
            clock: 0,
            age_every,
            since_aging: 0,
        })
    }

    fn on_event(&mut self, ev: &CacheEvent) -> i32 {
        let key = (ev.layer, ev.expert);
        match ev.kind {
            EV_REQUEST => {
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
            options: Options::parse("age_every=6"),
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
