//! The embedding example (`examples/generate.rs`) run as a test, and the API against the
//! fixture's reference ids (`fixtures/models/A/ref/summary.json`, the ids `k3-run` gives).

#[path = "../examples/generate.rs"]
mod example;

use k3_engine::api::{Error, Memory, Model, Request, Settings};

/// (prompt ids, generated ids) of the fixture's reference run.
fn reference() -> (Vec<u32>, Vec<u32>) {
    let path = example::fixture_dir().join("../ref/summary.json");
    let text = std::fs::read_to_string(&path).expect("read ref/summary.json");
    let v: serde_json::Value = serde_json::from_str(&text).expect("JSON");
    let ids = |k: &str| -> Vec<u32> { serde_json::from_value(v[k].clone()).expect(k) };
    (ids("prompt_ids"), ids("generated_ids"))
}

#[test]
fn example_generates_the_reference_ids() {
    let (prompt, want) = reference();
    assert_eq!(prompt, example::fixture_prompt());
    let report = example::run(&example::fixture_dir(), &prompt, want.len()).expect("example runs");
    assert_eq!(report.generated_ids, want);
    assert_eq!(report.prompt_ids, prompt);
    assert_eq!(report.stopped_by, None);
    assert!(report.counters.expert_requests > 0, "{report:?}");
}

#[test]
fn a_saved_state_continues_the_same_sequence_under_a_cache_budget() {
    let (prompt, want) = reference();
    // routed experts through a small cache: the same ids as resident
    let settings = Settings {
        memory: Memory::Budgets {
            trunk_gb: None,
            cache_gb: Some(0.0001),
        },
        threads: Some(2),
        ..Settings::default()
    };
    let model = Model::open(example::fixture_dir(), &settings).expect("open");
    let first = 5;
    let mut streamed = Vec::new();
    let run = model
        .generate(&Request::new(prompt.clone(), first), None, |t| {
            streamed.push((t.index, t.id));
            true
        })
        .expect("first part");
    assert_eq!(run.report.generated_ids, want[..first]);
    assert_eq!(
        streamed,
        want[..first]
            .iter()
            .copied()
            .enumerate()
            .collect::<Vec<_>>()
    );
    assert!(run.report.counters.expert_misses > 0, "{:?}", run.report);
    // the state holds the prompt and every generated id but the last
    assert_eq!(run.state.positions(), prompt.len() + first - 1);
    assert_eq!(&run.state.ids()[..prompt.len()], prompt.as_slice());
    let dir = tempfile::tempdir().expect("temp dir");
    let file = dir.path().join("state.bin");
    model.save_state(&run.state, &file).expect("save");
    let loaded = model.load_state(&file).expect("load");
    assert_eq!(loaded.ids(), run.state.ids());
    // continue: the last generated id is the next prompt
    let rest = model
        .generate(
            &Request::new(vec![want[first - 1]], want.len() - first),
            Some(&loaded),
            |_| true,
        )
        .expect("second part");
    assert_eq!(rest.report.generated_ids, want[first..]);
}

#[test]
fn stopping_and_refusals() {
    let (prompt, want) = reference();
    let model = Model::open(example::fixture_dir(), &Settings::default()).expect("open");
    // the callback stops after the third token
    let run = model
        .generate(&Request::new(prompt.clone(), 10), None, |t| t.index < 2)
        .expect("run");
    assert_eq!(run.report.generated_ids, want[..3]);
    assert_eq!(run.report.stopped_by.as_deref(), Some("interrupted"));
    // a stop id ends the run after it
    let mut req = Request::new(prompt.clone(), 10);
    req.stop_ids = vec![want[1]];
    let run = model.generate(&req, None, |_| true).expect("run");
    assert_eq!(run.report.generated_ids, want[..2]);
    let bad = model.generate(
        &Request::new(vec![model.vocab_size() as u32], 1),
        None,
        |_| true,
    );
    assert!(matches!(bad, Err(Error::Request(_))), "{bad:?}");
    let empty = model.generate(&Request::new(Vec::new(), 1), None, |_| true);
    assert!(matches!(empty, Err(Error::Request(_))), "{empty:?}");
    let missing = Model::open(
        example::fixture_dir().join("no-such-dir"),
        &Settings::default(),
    );
    assert!(matches!(missing, Err(Error::Model(_))), "{missing:?}");
}
