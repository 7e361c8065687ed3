//! Expert-cache policy plugin: S3-FIFO (Yang et al., SOSP 2023), a recency/frequency hybrid.
//!
//! Owns: three FIFO queues over (layer, expert) keys: a small probationary queue S (target
//! `small_share` of the capacity, default 10%), the main queue M, and a ghost queue G of
//! recently evicted keys (as many as the capacity). A newcomer enters S, or M if its key is
//! in G. Each resident key counts hits up to 3. To evict: while S is over its target (or M is
//! empty), S's head moves to M if it was hit more than once, else it is the victim (its key
//! goes to G); otherwise M's head is reinserted at the tail with one hit less if it has any,
//! else it is the victim. Keys the host does not offer (in use by the current call) rotate
//! to their queue's tail.
//! Options: `small_share=F` (0 < F < 1).

use std::collections::{HashMap, HashSet, VecDeque};

use k3_plugin_abi::{
    CacheEvent, CachePolicy, CacheSetup, Candidate, EV_EVICT, EV_HIT, EV_INSERT, OK,
    export_cache_policy,
};

type Key = (u32, u32);

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Queue {
    Small,
    Main,
}

pub struct S3Fifo {
    small: VecDeque<Key>,
    main: VecDeque<Key>,
    ghost: VecDeque<Key>,
    ghost_set: HashSet<Key>,
    /// Resident keys: their queue and hit count (0..=3).
    resident: HashMap<Key, (Queue, u8)>,
    small_target: usize,
    ghost_cap: usize,
}

impl S3Fifo {
    fn len_of(&self, q: Queue) -> usize {
        self.resident.values().filter(|(x, _)| *x == q).count()
    }

    fn remember_ghost(&mut self, k: Key) {
        if self.ghost_set.insert(k) {
            self.ghost.push_back(k);
            while self.ghost.len() > self.ghost_cap {
                if let Some(old) = self.ghost.pop_front() {
                    self.ghost_set.remove(&old);
                }
            }
        }
    }
}

impl CachePolicy for S3Fifo {
    fn create(setup: &CacheSetup) -> Result<Self, String> {
        let share: f64 = setup.options.number("small_share", 0.1)?;
        if !(share > 0.0 && share < 1.0) {
            return Err(format!(
                "option small_share={share}: must be between 0 and 1"
            ));
        }
        let cap = usize::try_from(setup.capacity).unwrap_or(usize::MAX);
        Ok(S3Fifo {
            small: VecDeque::new(),
            main: VecDeque::new(),
            ghost: VecDeque::new(),
            ghost_set: HashSet::new(),
            resident: HashMap::new(),
            small_target: ((cap as f64 * share).round() as usize).max(1),
            ghost_cap: cap.max(1),
        })
    }

    fn on_event(&mut self, ev: &CacheEvent) -> i32 {
        let k = (ev.layer, ev.expert);
        match ev.kind {
            EV_HIT => {
                if let Some((_, f)) = self.resident.get_mut(&k) {
                    *f = (*f + 1).min(3);
                }
            }
            EV_INSERT => {
                let q = if self.ghost_set.remove(&k) {
                    self.ghost.retain(|g| *g != k);
                    self.main.push_back(k);
                    Queue::Main
                } else {
                    self.small.push_back(k);
                    Queue::Small
                };
                self.resident.insert(k, (q, 0));
            }
            EV_EVICT => {
                // Queues drop the key lazily (skipped when it reaches a head).
                self.resident.remove(&k);
            }
            _ => {}
        }
        OK
    }

    fn choose_victim(&mut self, candidates: &[Candidate]) -> usize {
        let offered: HashMap<Key, usize> = candidates
            .iter()
            .enumerate()
            .map(|(i, c)| ((c.key.layer, c.key.expert), i))
            .collect();
        let mut small_len = self.len_of(Queue::Small);
        // Every resident key can be looked at a few times (a reinsertion spends a hit).
        let budget = 8 * (self.small.len() + self.main.len()) + 16;
        for _ in 0..budget {
            let from_small = small_len > self.small_target || self.main.is_empty();
            let q = if from_small {
                &mut self.small
            } else {
                &mut self.main
            };
            let Some(k) = q.pop_front() else {
                break;
            };
            let want = if from_small {
                Queue::Small
            } else {
                Queue::Main
            };
            let Some(&(at, f)) = self.resident.get(&k) else {
                continue; // evicted earlier; drop the stale entry
            };
            if at != want {
                continue; // stale entry (the key moved)
            }
            let Some(&i) = offered.get(&k) else {
                // In use by the current call: keep it, at the tail.
                q.push_back(k);
                continue;
            };
            if from_small {
                if f > 1 {
                    self.resident.insert(k, (Queue::Main, 0));
                    self.main.push_back(k);
                    small_len -= 1;
                    continue;
                }
                self.remember_ghost(k);
                // Stays in `resident` until the host's EV_EVICT; re-queued in case the host
                // evicts something else after all.
                self.small.push_front(k);
                return i;
            }
            if f > 0 {
                self.resident.insert(k, (Queue::Main, f - 1));
                self.main.push_back(k);
                continue;
            }
            self.main.push_front(k);
            return i;
        }
        0
    }
}

export_cache_policy!(
    S3Fifo,
    "s3fifo",
    "S3-FIFO: small probationary FIFO, main FIFO with reinsertion, ghost history"
);

#[cfg(test)]
mod tests {
    use super::*;
    use k3_plugin_abi::{EV_REQUEST, ExpertKey, Options};

    fn ev(kind: u32, expert: u32) -> CacheEvent {
        CacheEvent {
            kind,
            layer: 0,
            expert,
            reserved: 0,
            slot: u64::from(expert),
            bytes: 0,
            seq: 0,
        }
    }

    fn cand(e: u32) -> Candidate {
        Candidate {
            key: ExpertKey {
                layer: 0,
                expert: e,
            },
            slot: u64::from(e),
        }
    }

    #[test]
    fn one_hit_wonders_leave_first_and_ghosts_return_to_main() {
        let setup = CacheSetup {
            capacity: 4,
            expert_bytes: 1,
            n_layers: 1,
            n_experts: 16,
            top_k: 1,
            options: Options::default(),
        };
        let mut p = S3Fifo::create(&setup).expect("create");
        for e in 0..4 {
            p.on_event(&ev(EV_REQUEST, e));
            p.on_event(&ev(EV_INSERT, e));
        }
        // 0 and 1 hit twice: they graduate to M; 2 is the first one-hit wonder.
        for e in [0, 1, 0, 1] {
            p.on_event(&ev(EV_HIT, e));
        }
        let all: Vec<Candidate> = (0..4).map(cand).collect();
        let v = p.choose_victim(&all);
        assert_eq!(all[v].key.expert, 2);
        p.on_event(&ev(EV_EVICT, 2));
        // 2 comes back: from the ghost queue straight into M.
        p.on_event(&ev(EV_INSERT, 2));
        assert_eq!(p.resident.get(&(0, 2)), Some(&(Queue::Main, 0)));
        // Not offered: 3 is skipped (in use), so the victim comes from M's hitless head.
        let some: Vec<Candidate> = [0, 1, 2].into_iter().map(cand).collect();
        let v = p.choose_victim(&some);
        assert!(some[v].key.expert <= 2);
        let bad = CacheSetup {
            options: Options::parse("small_share=2"),
            ..setup
        };
        assert!(
            S3Fifo::create(&bad)
                .err()
                .is_some_and(|e| e.contains("small_share"))
        );
    }
}
