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
//! `density` (evict the lowest (count + prior) / layers until its layer's turn;
//! `density_prior=F`).
//! `prior=PATH` (an `expert_trace.bin` from an earlier `--dump-cache-trace` run of the same
//! model, another prompt) starts every count from that run's requests, each worth
//! `prior_weight` (default 1) requests of this run: expert popularity is a property of the
//! model's router, so a recorded run tells a cold cache what to keep.
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
            prior: setup.options.number("density_prior", 1.0)?,
        })
        .and_then(|mut l| {
            if let Some(path) = setup.options.get("prior") {
                let w: f64 = setup.options.number("prior_weight", 1.0)?;
                for k in read_trace(path)? {
                    // Counts are in half-requests (a request adds 2).
                    let add = (2.0 * w).round() as u32;
                    let c = l.counts.entry(k).or_insert(0);
                    *c = c.saturating_add(add);
                }
            }
            Ok(l)
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

/// The requests of an `expert_trace.bin` (token marks dropped), or why it cannot be read.
fn read_trace(path: &str) -> Result<Vec<(u32, u32)>, String> {
    let b = std::fs::read(path).map_err(|e| format!("option prior={path}: {e}"))?;
    if b.len() < 16 || &b[..8] != b"K3XTRACE" {
        return Err(format!(
            "option prior={path}: not a k3 expert trace (bad magic)"
        ));
    }
    let u = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
    if u(8) != 1 || u(12) != 8 || (b.len() - 16) % 8 != 0 {
        return Err(format!(
            "option prior={path}: unsupported trace version or size"
        ));
    }
    Ok((16..b.len())
        .step_by(8)
        .map(|i| (u(i), u(i + 4)))
        .filter(|r| r.0 != u32::MAX)
        .collect())
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
        // A prior trace in which expert 1 was requested three times and 0 never: with it, 0
        // (same counts in this run) is the victim instead of 1.
        let path = std::env::temp_dir().join(format!("k3-lfu-prior-{}.bin", std::process::id()));
        let mut b = b"K3XTRACE".to_vec();
        for w in [1u32, 8, u32::MAX, 0, 0, 1, 0, 1, 0, 1] {
            b.extend_from_slice(&w.to_le_bytes());
        }
        std::fs::write(&path, b).expect("write prior");
        let fresh = |opts: &str| {
            let mut p = Lfu::create(&CacheSetup {
                options: Options::parse(opts),
                ..setup.clone()
            })
            .expect("create");
            for e in [0, 1] {
                p.on_event(&ev(EV_REQUEST, e));
                p.on_event(&ev(EV_INSERT, e));
            }
            p.on_event(&ev(EV_REQUEST, 1));
            p.on_event(&ev(EV_HIT, 1));
            p.on_event(&ev(EV_REQUEST, 0));
            p.on_event(&ev(EV_HIT, 0));
            p.choose_victim(&[c(0), c(1)])
        };
        let cold = fresh("mode=lru");
        let warm = fresh(&format!("mode=lru\nprior={}", path.display()));
        std::fs::remove_file(&path).ok();
        assert_eq!((cold, warm), (1, 0), "the prior changes the victim");
        assert!(
            Lfu::create(&CacheSetup {
                options: Options::parse("prior=/nonexistent/trace.bin"),
                ..setup.clone()
            })
            .err()
            .is_some_and(|e| e.contains("prior="))
        );
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
