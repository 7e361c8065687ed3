//! A minimal program over the embedding API (`k3_engine::api`): open a model directory,
//! generate a few tokens from prompt ids, printing each as it comes, then the report.
//!
//! ```text
//! cargo run -p k3-engine --example generate -- [MODEL_DIR] [N_TOKENS]
//! ```
//!
//! Without arguments it runs the small synthetic model shipped in the repository
//! (`fixtures/models/A/ckpt`) with the prompt of its reference (`fixtures/models/A/ref`).
//! `engine/tests/example.rs` runs this same code in `cargo test`.

use std::path::{Path, PathBuf};

use k3_engine::api::{Model, Report, Request, Settings};

/// The shipped fixture model.
pub fn fixture_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/models/A/ckpt")
}

/// Open `dir`, generate `n` tokens after `prompt`, print each token as it is generated.
pub fn run(dir: &Path, prompt: &[u32], n: usize) -> Result<Report, k3_engine::api::Error> {
    let model = Model::open(dir, &Settings::default())?;
    println!(
        "{}: {} layers, vocabulary {}, {} threads",
        model.name(),
        model.n_layers(),
        model.vocab_size(),
        model.threads()
    );
    let run = model.generate(&Request::new(prompt.to_vec(), n), None, |t| {
        println!("token {:>3}: {:>6}  ({:.3} s)", t.index, t.id, t.seconds);
        true
    })?;
    let r = &run.report;
    println!("generated ids: {:?}", r.generated_ids);
    println!(
        "first token {:.3} s, {:.4} s/token; trunk read {} bytes, expert requests {}",
        r.timings.first_token_seconds,
        r.timings.seconds_per_token,
        r.counters.trunk_bytes_read,
        r.counters.expert_requests
    );
    Ok(run.report)
}

/// The prompt of the fixture's reference run (`ref/summary.json`).
pub fn fixture_prompt() -> Vec<u32> {
    let path = fixture_dir().join("../ref/summary.json");
    let text = std::fs::read_to_string(&path).expect("read fixtures/models/A/ref/summary.json");
    let v: serde_json::Value = serde_json::from_str(&text).expect("summary.json is JSON");
    serde_json::from_value(v["prompt_ids"].clone()).expect("prompt_ids: a list of ids")
}

#[allow(dead_code)] // `engine/tests/example.rs` includes this file and calls `run`
fn main() {
    let mut args = std::env::args().skip(1);
    let dir = args.next().map_or_else(fixture_dir, PathBuf::from);
    let n = args
        .next()
        .map_or(8, |s| s.parse().expect("N_TOKENS: a number"));
    if let Err(e) = run(&dir, &fixture_prompt(), n) {
        eprintln!("generate: {e}");
        std::process::exit(1);
    }
}
