//! `--dump-layer-logits FILE` (docs/DESIGN.md §9, per-layer conformance): the first step's
//! early-exit logits, f32 little-endian `[layers, vocab]`, row L-1 = what `--layers L` gives.
//! On fixture A (13 layers, vocab 256, the fixture's prompt):
//! - every row is within the stated tolerance of the independent numpy reference's
//!   (`fixtures/models/A/ref/layer_logits.f32`, `ref_k3.py --layer-logits`, see
//!   fixtures/README.md): max |engine - ref| <= 5e-3 x max |ref| per row (the rule of
//!   `fixtures/oracle/conform_layers.py`, computed here independently of it) and the same
//!   top-1 id;
//! - the flag changes nothing else: the ids and the `--dump-logits` bytes are those of a run
//!   without it; the last row is the `--dump-logits` bytes; row L-1 is the `--dump-logits`
//!   bytes of a `--layers L` run (L = 1, 4, 13), resident and from a packed trunk streamed
//!   through a ring slot, with any prompt chunking;
//! - `--batch-ids`, `--chat` and `--serve` refuse it (exit 2, naming the flag).
//!
//! Owns: black-box checks through the `k3-run` binary. Must not: call the library.

use std::path::Path;
use std::process::Output;

mod bin_support;
use bin_support::{fixture_a, fresh_dir, k3, k3_out, repo, s};

/// Fixture A's prompt (the reference's, `fixtures/models/A/ref/summary.json`).
const IDS: &str = "11,22,33,44,55,66,77,88,99,110";
const LAYERS: usize = 13;
const VOCAB: usize = 256;
/// conform_layers.py's REL_TOL: max |engine - ref| / max |ref| per row.
const REL_TOL: f64 = 5e-3;

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Run fixture A's prompt with `extra` flags; the `--out` JSON's generated ids.
fn run(dir: &Path, extra: &[&str]) -> serde_json::Value {
    let a = fixture_a();
    let out = dir.join("out.json");
    let mut args = vec![s(&a), "--ids", IDS, "--gen", "3", "--out", s(&out)];
    args.extend_from_slice(extra);
    k3_out(&args, &out)["generated_ids"].clone()
}

fn f32s(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().expect("4 bytes")))
        .collect()
}

/// The largest logit's id, ties to the lowest id (as the engine and the reference choose).
fn top1(row: &[f32]) -> usize {
    let mut best = 0;
    for (i, &v) in row.iter().enumerate() {
        if v > row[best] {
            best = i;
        }
    }
    best
}

/// max |e - r| / max |r| of one row.
fn rel_err(e: &[f32], r: &[f32]) -> f64 {
    let scale = r.iter().map(|v| (*v as f64).abs()).fold(0.0, f64::max);
    let diff = e
        .iter()
        .zip(r)
        .map(|(a, b)| (*a as f64 - *b as f64).abs())
        .fold(0.0, f64::max);
    diff / scale
}

#[test]
fn early_exit_logits_match_the_reference_and_layers_runs() {
    let dir = fresh_dir("layer_logits");
    let (plain, dumped, rows) = (
        dir.join("plain.f32"),
        dir.join("dumped.f32"),
        dir.join("rows.f32"),
    );
    let ids = run(&dir, &["--dump-logits", s(&plain)]);
    let ids_with = run(
        &dir,
        &["--dump-logits", s(&dumped), "--dump-layer-logits", s(&rows)],
    );
    assert_eq!(ids_with, ids, "--dump-layer-logits changed the ids");
    let plain = std::fs::read(&plain).expect("--dump-logits");
    assert_eq!(
        std::fs::read(&dumped).expect("--dump-logits"),
        plain,
        "--dump-layer-logits changed the --dump-logits bytes"
    );
    let bytes = std::fs::read(&rows).expect("--dump-layer-logits written");
    let row_bytes = VOCAB * 4;
    assert_eq!(bytes.len(), LAYERS * row_bytes, "[layers, vocab] f32");
    assert_eq!(
        &bytes[(LAYERS - 1) * row_bytes..],
        &plain[..],
        "the last row is the --dump-logits bytes"
    );

    // Against the numpy reference: the stated tolerance and the same top-1 id per layer.
    let ref_dir = repo().join("fixtures/models/A/ref");
    let reference = f32s(&std::fs::read(ref_dir.join("layer_logits.f32")).expect("reference"));
    assert_eq!(reference.len(), LAYERS * VOCAB, "reference [13, 256] f32");
    // the reference's last row is its step-0 logits (the committed full-stack reference)
    let step0 = f32s(&std::fs::read(ref_dir.join("step0_logits.f32")).expect("step0"));
    assert_eq!(
        &reference[(LAYERS - 1) * VOCAB..],
        &step0[..],
        "reference last row"
    );
    let engine = f32s(&bytes);
    let mut worst = 0.0f64;
    for l in 0..LAYERS {
        let (e, r) = (
            &engine[l * VOCAB..(l + 1) * VOCAB],
            &reference[l * VOCAB..(l + 1) * VOCAB],
        );
        let rel = rel_err(e, r);
        worst = worst.max(rel);
        assert!(
            rel <= REL_TOL,
            "layer {l}: max |engine - ref| is {rel:.3e} of max |ref| (tolerance {REL_TOL})"
        );
        assert_eq!(top1(e), top1(r), "layer {l}: top-1 id differs");
    }
    eprintln!("early-exit logits vs the reference: worst relative error {worst:.3e}");

    // Row L-1 is a --layers L run's --dump-logits, bit for bit.
    for l in [1usize, 4, 13] {
        let f = dir.join(format!("layers{l}.f32"));
        run(&dir, &["--layers", &l.to_string(), "--dump-logits", s(&f)]);
        assert_eq!(
            std::fs::read(&f).expect("--layers --dump-logits"),
            &bytes[(l - 1) * row_bytes..l * row_bytes],
            "row {} differs from --layers {l}",
            l - 1
        );
    }

    // The same bytes from a packed trunk streamed through one ring slot (every layer read per
    // pass), with the prompt in chunks of 3, and incremental.
    let trunk = dir.join("trunk");
    let o = k3(&["pack-trunk", s(&fixture_a()), s(&trunk)]);
    assert!(o.status.success(), "pack-trunk: {}", stderr(&o));
    let again = dir.join("again.f32");
    for extra in [
        &["--prefill-chunk", "3", "--incremental"][..],
        &["--trunk", s(&trunk), "--trunk-gb", "0.0005"][..],
    ] {
        let mut args = extra.to_vec();
        args.extend_from_slice(&["--dump-layer-logits", s(&again)]);
        assert_eq!(run(&dir, &args), ids, "{extra:?}");
        assert!(
            std::fs::read(&again).expect("written") == bytes,
            "{extra:?}: the early-exit logits differ"
        );
    }
}

#[test]
fn batch_chat_and_serve_refuse_the_flag() {
    let dir = fresh_dir("layer_logits_refusals");
    let a = fixture_a();
    let f = dir.join("x.f32");
    for (mode, names) in [
        (
            &["--batch-ids", "11,22;33", "--incremental"][..],
            "--batch-ids",
        ),
        (&["--chat"][..], "--chat"),
        // (an address that cannot be bound: a regression fails instead of serving forever)
        (&["--serve", "not-an-address"][..], "--serve"),
    ] {
        let o = k3(&[&[s(&a), "--dump-layer-logits", s(&f)][..], mode].concat());
        let err = stderr(&o);
        assert_eq!(
            o.status.code(),
            Some(2),
            "{mode:?}: exit code; stderr:\n{err}"
        );
        for n in ["--dump-layer-logits", names] {
            assert!(err.contains(n), "{mode:?}: stderr should name {n}:\n{err}");
        }
        assert!(!f.exists(), "{mode:?}: nothing written");
    }
}
