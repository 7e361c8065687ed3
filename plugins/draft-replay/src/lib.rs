//! Speculative-draft provider plugin: replays what a previous run generated.
//!
//! Owns: reading a previous run's `--out` JSON (`prompt_ids` followed by `generated_ids`) and
//! proposing its continuation: when the context is a prefix of that recorded sequence, the
//! next `k` recorded ids; otherwise the ids that followed the most recent occurrence of the
//! context's longest suffix (up to 8 tokens) in the recording. Re-running the recorded request
//! accepts nearly every guess: the speculation ceiling at this memory budget.
//! Options: `out=PATH` (a k3-run --out JSON) or `ids=1,2,3` (the recorded sequence itself).

use k3_plugin_abi::{DraftProvider, DraftSetup, export_draft_provider};

pub struct Replay {
    seq: Vec<u32>,
}

/// The numbers of the JSON array after `"key":` in `text` (no JSON library: the run's --out
/// writes plain integer arrays).
pub fn int_array(text: &str, key: &str) -> Result<Vec<u32>, String> {
    let pat = format!("\"{key}\"");
    let at = text
        .find(&pat)
        .ok_or_else(|| format!("no \"{key}\" field"))?;
    let rest = &text[at + pat.len()..];
    let rest = rest.trim_start();
    let rest = rest
        .strip_prefix(':')
        .ok_or_else(|| format!("\"{key}\" is not followed by ':'"))?
        .trim_start();
    let rest = rest
        .strip_prefix('[')
        .ok_or_else(|| format!("\"{key}\" is not an array"))?;
    let end = rest
        .find(']')
        .ok_or_else(|| format!("\"{key}\": unterminated array"))?;
    rest[..end]
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| {
            s.parse::<u32>()
                .map_err(|_| format!("\"{key}\": {s:?} is not a token id"))
        })
        .collect()
}

impl DraftProvider for Replay {
    fn create(setup: &DraftSetup) -> Result<Self, String> {
        let seq = if let Some(path) = setup.options.get("out") {
            let text = std::fs::read_to_string(path).map_err(|e| format!("out {path}: {e}"))?;
            let mut s = int_array(&text, "prompt_ids").map_err(|e| format!("out {path}: {e}"))?;
            s.extend(int_array(&text, "generated_ids").map_err(|e| format!("out {path}: {e}"))?);
            s
        } else if let Some(ids) = setup.options.get("ids") {
            int_array(&format!("\"ids\": [{ids}]"), "ids")?
        } else {
            return Err(
                "needs the recording to replay: --plugin-opt out=PATH (a previous run's --out \
                 JSON) or --plugin-opt ids=1,2,3"
                    .to_string(),
            );
        };
        Ok(Replay { seq })
    }

    fn propose(&mut self, context: &[u32], k: usize, out: &mut Vec<u32>) {
        let n = context.len();
        if n <= self.seq.len() && self.seq[..n] == *context {
            out.extend_from_slice(&self.seq[n..(n + k).min(self.seq.len())]);
            return;
        }
        for m in (1..=8.min(n)).rev() {
            let suffix = &context[n - m..];
            if let Some(j) = (m..self.seq.len())
                .rev()
                .find(|&j| &self.seq[j - m..j] == suffix)
            {
                out.extend_from_slice(&self.seq[j..(j + k).min(self.seq.len())]);
                return;
            }
        }
    }
}

export_draft_provider!(
    Replay,
    "replay",
    "proposes what a previous run generated (out=PATH of its --out JSON)"
);

#[cfg(test)]
mod tests {
    use super::*;
    use k3_plugin_abi::Options;

    #[test]
    fn replays_a_recorded_run() {
        let dir = std::env::temp_dir().join(format!("k3-replay-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("mkdir");
        let p = dir.join("run.json");
        std::fs::write(
            &p,
            "{\n  \"prompt_ids\": [1, 2, 3],\n  \"x\": 1,\n  \"generated_ids\": [\n    7,\n    8,\n    9\n  ]\n}",
        )
        .expect("write");
        let setup = DraftSetup {
            vocab_size: 10,
            max_draft: 4,
            options: Options::parse(&format!("out={}", p.display())),
        };
        let mut r = Replay::create(&setup).expect("create");
        assert_eq!(r.seq, vec![1, 2, 3, 7, 8, 9]);
        let mut out = Vec::new();
        r.propose(&[1, 2, 3, 7], 4, &mut out);
        assert_eq!(out, vec![8, 9]);
        out.clear();
        r.propose(&[5, 5, 3], 2, &mut out);
        assert_eq!(out, vec![7, 8], "suffix match off the recorded path");
        out.clear();
        r.propose(&[4, 4], 2, &mut out);
        assert!(out.is_empty());
        std::fs::write(&p, "{\"prompt_ids\": [1, x]}").expect("write");
        let e = Replay::create(&setup).err().expect("bad json");
        assert!(e.contains("run.json") && e.contains("\"x\""), "{e}");
        let e = Replay::create(&DraftSetup {
            options: Options::default(),
            ..setup
        })
        .err()
        .expect("no recording");
        assert!(e.contains("out=PATH"), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
