//! Expert-cache policy plugin: Belady's optimum (MIN) replayed from a recorded trace.
//!
//! Owns: reading an `expert_trace.bin` (`--dump-cache-trace`; format in
//! runner/src/stream/trace.rs), following the run's requests through it, and evicting the
//! candidate whose next request lies farthest in the future (never again counts as the
//! farthest; ties to the larger (layer, expert), as `k3-run sim-cache`'s Belady column). It
//! is a what-if bound, not a policy: it needs the future. When the requests stop matching the
//! trace (another prompt, another model), it says so once on stderr and evicts the least
//! recently used candidate from then on.
//! Options: `trace=PATH` (required; `k3-run sim-cache` passes the trace it replays).

use std::collections::HashMap;

use k3_plugin_abi::{
    CacheEvent, CachePolicy, CacheSetup, Candidate, EV_HIT, EV_INSERT, EV_REQUEST, OK,
    export_cache_policy,
};

type Key = (u32, u32);

const TOKEN_MARK: u32 = u32::MAX;

/// The requests of an `expert_trace.bin` (token marks dropped), or why it cannot be read.
pub fn read_trace(path: &str) -> Result<Vec<Key>, String> {
    let b = std::fs::read(path).map_err(|e| format!("trace {path}: {e}"))?;
    if b.len() < 16 || &b[..8] != b"K3XTRACE" {
        return Err(format!("trace {path}: not a k3 expert trace (bad magic)"));
    }
    let u = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
    if u(8) != 1 || u(12) != 8 || (b.len() - 16) % 8 != 0 {
        return Err(format!(
            "trace {path}: version {} / record size {} / {} bytes not supported",
            u(8),
            u(12),
            b.len()
        ));
    }
    Ok((16..b.len())
        .step_by(8)
        .map(|i| (u(i), u(i + 4)))
        .filter(|r| r.0 != TOKEN_MARK)
        .collect())
}

pub struct Belady {
    /// Every position of each key, ascending.
    positions: HashMap<Key, Vec<usize>>,
    reqs: Vec<Key>,
    /// Requests seen so far.
    cursor: usize,
    diverged: bool,
    clock: u64,
    last_use: HashMap<Key, u64>,
}

impl Belady {
    /// Position of `k`'s next request at or after the cursor (`reqs.len()` if none).
    fn next_use(&self, k: Key) -> usize {
        let n = self.reqs.len();
        self.positions.get(&k).map_or(n, |p| {
            let i = p.partition_point(|&x| x < self.cursor);
            p.get(i).copied().unwrap_or(n)
        })
    }
}

impl CachePolicy for Belady {
    fn create(setup: &CacheSetup) -> Result<Self, String> {
        let path = setup.options.get("trace").ok_or_else(|| {
            "needs the trace to replay: --plugin-opt trace=PATH (an expert_trace.bin from \
             --dump-cache-trace of the same request)"
                .to_string()
        })?;
        let reqs = read_trace(path)?;
        let mut positions: HashMap<Key, Vec<usize>> = HashMap::new();
        for (i, &k) in reqs.iter().enumerate() {
            positions.entry(k).or_default().push(i);
        }
        Ok(Belady {
            positions,
            reqs,
            cursor: 0,
            diverged: false,
            clock: 0,
            last_use: HashMap::new(),
        })
    }

    fn on_event(&mut self, ev: &CacheEvent) -> i32 {
        let k = (ev.layer, ev.expert);
        match ev.kind {
            EV_REQUEST if !self.diverged => {
                if self.reqs.get(self.cursor) == Some(&k) {
                    self.cursor += 1;
                } else {
                    self.diverged = true;
                    eprintln!(
                        "belady plugin: request {} is ({}, {}) but the trace says {:?}; \
                         evicting least recently used from here on",
                        self.cursor,
                        k.0,
                        k.1,
                        self.reqs.get(self.cursor)
                    );
                }
            }
            EV_HIT | EV_INSERT => {
                self.clock += 1;
                self.last_use.insert(k, self.clock);
            }
            _ => {}
        }
        OK
    }

    fn choose_victim(&mut self, candidates: &[Candidate]) -> usize {
        let key = |c: &Candidate| (c.key.layer, c.key.expert);
        let best = if self.diverged {
            candidates
                .iter()
                .enumerate()
                .min_by_key(|(_, c)| (self.last_use.get(&key(c)).copied().unwrap_or(0), c.slot))
        } else {
            candidates
                .iter()
                .enumerate()
                .max_by_key(|(_, c)| (self.next_use(key(c)), key(c)))
        };
        best.map_or(0, |(i, _)| i)
    }
}

export_cache_policy!(
    Belady,
    "belady",
    "Belady/MIN replay of a recorded expert trace (what-if upper bound; needs trace=PATH)"
);

#[cfg(test)]
mod tests {
    use super::*;
    use k3_plugin_abi::{ExpertKey, Options};

    #[test]
    fn evicts_the_farthest_next_use_and_notices_divergence() {
        let dir = std::env::temp_dir().join(format!("k3-belady-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("mkdir");
        let path = dir.join("t.bin");
        let mut b = b"K3XTRACE".to_vec();
        b.extend_from_slice(&1u32.to_le_bytes());
        b.extend_from_slice(&8u32.to_le_bytes());
        // a b a c b a (layer 1)
        for (l, e) in [
            (TOKEN_MARK, 1),
            (1, 0),
            (1, 1),
            (1, 0),
            (1, 2),
            (1, 1),
            (1, 0),
        ] {
            b.extend_from_slice(&u32::to_le_bytes(l));
            b.extend_from_slice(&u32::to_le_bytes(e));
        }
        std::fs::write(&path, b).expect("write");
        let setup = CacheSetup {
            capacity: 2,
            expert_bytes: 1,
            n_layers: 2,
            n_experts: 4,
            top_k: 1,
            options: Options::parse(&format!("trace={}", path.display())),
        };
        let mut p = Belady::create(&setup).expect("create");
        let ev = |kind, e| CacheEvent {
            kind,
            layer: 1,
            expert: e,
            reserved: 0,
            slot: 0,
            bytes: 0,
            seq: 0,
        };
        for e in [0, 1, 0, 2] {
            p.on_event(&ev(EV_REQUEST, e));
        }
        // At request 3 (c): a is next used at 5, b at 4: evict a.
        let c = |e| Candidate {
            key: ExpertKey {
                layer: 1,
                expert: e,
            },
            slot: u64::from(e),
        };
        assert_eq!(p.choose_victim(&[c(0), c(1)]), 0);
        p.on_event(&ev(EV_REQUEST, 3)); // not what the trace says (b)
        assert!(p.diverged);
        let e = Belady::create(&CacheSetup {
            options: Options::default(),
            ..setup.clone()
        })
        .err()
        .expect("no trace");
        assert!(e.contains("trace=PATH"), "{e}");
        let e = Belady::create(&CacheSetup {
            options: Options::parse("trace=/nonexistent/t.bin"),
            ..setup
        })
        .err()
        .expect("missing trace");
        assert!(e.contains("/nonexistent/t.bin"), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
