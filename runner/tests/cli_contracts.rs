//! Flag contracts of the `k3-run` binary, black box: no flag is silently ignored or adjusted.
//! `--dump-cache-trace` is written with resident experts and with `--batch-ids` (the same
//! bytes as an expert-cache run of the same request); `--batch-ids --dump-logits` writes each
//! sequence's first-step logits in prompt order (each block the single-prompt run's bytes);
//! `--max-context` below the request is a usage error stating the number; `--preset ultra`
//! without `--trunk` says what it does not apply; a missing `--trunk` directory exits 2 in a
//! run and in `plan` with the same message; a `--config` file of the other kind names the flag
//! it belongs to; a mistyped subcommand is named.
//!
//! Owns: black-box checks of these contracts only. Every expectation comes from another run of
//! the binary (the same request in another mode) or from the documented CLI contract.

mod bin_support;

use std::path::Path;
use std::process::{Command, Output};

use bin_support::{code, expect_fail, fixture_a, fresh_dir, k3, repo, s, stderr};

/// Asserts exit code 0; returns stderr.
fn ok(o: &Output) -> String {
    assert_eq!(code(o), 0, "k3-run failed; stderr:\n{}", stderr(o));
    stderr(o)
}

/// The `k3-run: error: ...` line of stderr.
fn error_line(err: &str) -> String {
    err.lines()
        .find(|l| l.starts_with("k3-run: error:"))
        .unwrap_or_else(|| panic!("no error line in:\n{err}"))
        .to_string()
}

/// (layer, expert) records of an expert_trace.bin (format: docs/STREAMING.md).
fn trace_records(bin: &[u8]) -> Vec<(u32, u32)> {
    assert_eq!(&bin[..8], b"K3XTRACE", "trace magic");
    bin[16..]
        .chunks_exact(8)
        .map(|c| {
            (
                u32::from_le_bytes([c[0], c[1], c[2], c[3]]),
                u32::from_le_bytes([c[4], c[5], c[6], c[7]]),
            )
        })
        .collect()
}

/// Run with `--dump-cache-trace DIR/trace` plus `extra`; returns (trace bytes, hist bytes).
fn traced(dir: &Path, extra: &[&str]) -> (Vec<u8>, Vec<u8>) {
    let t = dir.join("trace");
    let _ = std::fs::remove_dir_all(&t);
    let a = fixture_a();
    let out = dir.join("out.json");
    let mut args = vec![
        s(&a),
        "--incremental",
        "--gen",
        "4",
        "--out",
        s(&out),
        "--dump-cache-trace",
        s(&t),
    ];
    args.extend_from_slice(extra);
    let err = ok(&k3(&args));
    assert!(err.contains("expert trace: "), "{err}");
    (
        std::fs::read(t.join("expert_trace.bin")).expect("expert_trace.bin written"),
        std::fs::read(t.join("expert_hist.json")).expect("expert_hist.json written"),
    )
}

#[test]
fn cache_trace_is_written_with_resident_experts_and_batch_ids() {
    let dir = fresh_dir("contracts_trace");
    let ids = ["--ids", "11,22,33,44,55"];
    let resident = traced(&dir, &ids);
    // An expert cache far below the working set (evictions) and one holding everything
    // (automatic prefetch on): the routing, so the trace, is the same.
    for cache in ["0.0001", "1"] {
        let cached = traced(&dir, &[&ids[..], &["--cache-gb", cache]].concat());
        assert!(
            cached == resident,
            "--cache-gb {cache}: the trace differs from the resident run's"
        );
    }
    // One token mark per pass: the prompt in one chunk, then 3 decode steps; every MoE layer
    // asks for experts.
    let recs = trace_records(&resident.0);
    let marks = recs.iter().filter(|r| r.0 == u32::MAX).count();
    assert_eq!(marks, 4, "{recs:?}");
    assert!(recs.len() > marks, "no expert request recorded");
    // sim-cache reads it
    let o = k3(&["sim-cache", s(&dir.join("trace/expert_trace.bin"))]);
    ok(&o);
    // --batch-ids: written too, the same resident and cached
    let batch = ["--batch-ids", "11,22,33;44,55"];
    let resident = traced(&dir, &batch);
    let cached = traced(&dir, &[&batch[..], &["--cache-gb", "0.0001"]].concat());
    assert!(cached == resident, "--batch-ids: the trace differs");
    let recs = trace_records(&resident.0);
    assert!(recs.iter().any(|r| r.0 != u32::MAX), "no expert request");
    // --chat / --serve do not write it: refused, not ignored
    let a = fixture_a();
    for flag in ["--dump-cache-trace", "--dump-logits"] {
        expect_fail(
            &k3(&[s(&a), "--chat", flag, s(&dir.join("x"))]),
            2,
            &[flag, "--chat"],
        );
    }
    // nor do they save or resume a --ids state (they were silently ignored)
    for (flag, names) in [("--save-state", "--history"), ("--load-state", "--history")] {
        // (an address that cannot be bound: a regression fails instead of serving forever)
        for mode in [&["--chat"][..], &["--serve", "not-an-address"][..]] {
            expect_fail(
                &k3(&[&[s(&a), flag, s(&dir.join("x"))][..], mode].concat()),
                2,
                &[flag, names],
            );
        }
    }
}

#[test]
fn batch_dump_logits_holds_each_sequences_first_step_logits() {
    let dir = fresh_dir("contracts_batch_logits");
    let a = fixture_a();
    let prompts = ["11,22,33,44", "5,6,7", "200"];
    let out = dir.join("out.json");
    // `--ids P` or `--batch-ids P;Q;...`: the --dump-logits bytes
    let dumped = |flag: &str, ids: &str| -> Vec<u8> {
        let f = dir.join("logits.f32");
        let _ = std::fs::remove_file(&f);
        ok(&k3(&[
            s(&a),
            flag,
            ids,
            "--gen",
            "3",
            "--incremental",
            "--out",
            s(&out),
            "--dump-logits",
            s(&f),
        ]));
        std::fs::read(&f).unwrap_or_else(|e| panic!("{flag} {ids}: --dump-logits not written: {e}"))
    };
    let want: Vec<Vec<u8>> = prompts.iter().map(|p| dumped("--ids", p)).collect();
    let got = dumped("--batch-ids", &prompts.join(";"));
    let block = want[0].len();
    assert!(block > 0);
    assert_eq!(got.len(), block * prompts.len(), "one block per prompt");
    for (i, (g, w)) in got.chunks(block).zip(&want).enumerate() {
        assert!(
            g == w.as_slice(),
            "prompt {i}: block differs from its own run"
        );
    }
}

/// `k3-run FIXTURE_A --out out EXTRA...`.
fn run_a(out: &Path, extra: &[&str]) -> Output {
    let a = fixture_a();
    let mut args = vec![s(&a), "--out", s(out)];
    args.extend_from_slice(extra);
    k3(&args)
}

#[test]
fn max_context_below_the_request_is_a_usage_error() {
    let dir = fresh_dir("contracts_max_context");
    let out = dir.join("out.json");
    let run = |extra: &[&str]| run_a(&out, extra);
    // 3 prompt ids + --gen 4 = 7 positions
    expect_fail(
        &run(&["--ids", "1,2,3", "--gen", "4", "--max-context", "6"]),
        2,
        &["--max-context 6", "7 positions", "--max-context 7"],
    );
    let err = ok(&run(&[
        "--ids",
        "1,2,3",
        "--gen",
        "4",
        "--max-context",
        "7",
    ]));
    assert!(err.contains("x 7 positions"), "{err}");
    let err = ok(&run(&[
        "--ids",
        "1,2,3",
        "--gen",
        "4",
        "--max-context",
        "9",
    ]));
    assert!(err.contains("x 9 positions"), "{err}");
    // the positions of a loaded state count
    let st = dir.join("p.state");
    ok(&run(&[
        "--ids",
        "1,2,3",
        "--gen",
        "0",
        "--save-state",
        s(&st),
    ]));
    expect_fail(
        &run(&[
            "--ids",
            "4,5",
            "--gen",
            "2",
            "--load-state",
            s(&st),
            "--max-context",
            "6",
        ]),
        2,
        &["7 positions", "--load-state"],
    );
    // --batch-ids: the longest prompt + --gen
    expect_fail(
        &run(&[
            "--batch-ids",
            "1,2,3;4",
            "--gen",
            "4",
            "--incremental",
            "--max-context",
            "5",
        ]),
        2,
        &["--max-context 5", "7 positions"],
    );
}

#[test]
fn preset_ultra_without_trunk_names_what_it_does_not_apply() {
    let (dir, a) = (fresh_dir("contracts_ultra"), fixture_a());
    let out = dir.join("out.json");
    let run = |extra: &[&str]| {
        let mut args = vec!["--ids", "11,22,33", "--gen", "3"];
        args.extend_from_slice(extra);
        let err = ok(&run_a(&out, &args));
        let v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
        (err, v["generated_ids"].clone())
    };
    let (err, ids_resident) = run(&["--preset", "ultra"]);
    for n in [
        "ultra-low-memory setting",
        "not applied",
        "trunk budget (2.50 GB)",
        "ultra-low-memory off",
    ] {
        assert!(err.contains(n), "stderr should mention {n:?}:\n{err}");
    }
    assert!(err.contains("embedding + lm_head: memory-mapped"), "{err}");
    // the expert cache named as applied is the one in effect: a later --cache-gb's
    let (err, ids_cache) = run(&["--preset", "ultra", "--cache-gb", "0.002"]);
    assert!(err.contains("only the expert cache (2.00 MB) is"), "{err}");
    assert_eq!(ids_cache, ids_resident);
    // With a packed trunk the preset's ultra-low-memory is applied.
    let trunk = dir.join("trunk");
    ok(&k3(&["pack-trunk", s(&a), s(&trunk)]));
    let (err, ids_streamed) = run(&["--preset", "ultra", "--trunk", s(&trunk)]);
    assert!(
        err.contains("ultra-low-memory: embedding rows read per token"),
        "{err}"
    );
    assert!(!err.contains("not applied"), "{err}");
    assert_eq!(ids_streamed, ids_resident);
}

#[test]
fn a_missing_trunk_directory_exits_2_in_a_run_and_in_plan() {
    let dir = fresh_dir("contracts_trunk_dir");
    let a = fixture_a();
    let file = dir.join("a-file");
    std::fs::write(&file, b"x").unwrap();
    let empty = dir.join("empty");
    std::fs::create_dir_all(&empty).unwrap();
    let out = dir.join("out.json");
    for (t, why) in [
        (dir.join("nonexistent"), "cannot read the directory"),
        (file, "not a directory"),
        (empty, "no trunk.json"),
    ] {
        let name = format!("--trunk {}", t.display());
        let run = expect_fail(
            &k3(&[
                s(&a),
                "--ids",
                "1,2",
                "--gen",
                "2",
                "--trunk",
                s(&t),
                "--out",
                s(&out),
            ]),
            2,
            &[&name, why, "pack-trunk"],
        );
        let plan = expect_fail(
            &k3(&["plan", s(&a), "--trunk", s(&t), "--trunk-gb", "1"]),
            2,
            &[&name, why],
        );
        assert_eq!(error_line(&run), error_line(&plan));
    }
}

#[test]
fn a_config_of_the_other_kind_names_the_flag_it_belongs_to() {
    let dir = fresh_dir("contracts_config");
    let a = fixture_a();
    let laptop = repo().join("configs/laptop.toml");
    let manifest = repo().join("configs/models/kimi-k3.toml");
    let out = dir.join("out.json");
    // plan --config: a run config (merged as a run merges it) or the model's config.json; a
    // manifest names its flag
    ok(&k3(&["plan", s(&a), "--config", s(&laptop)]));
    expect_fail(
        &k3(&["plan", s(&a), "--config", s(&manifest)]),
        2,
        &["model manifest", "--manifest"],
    );
    ok(&k3(&["plan", s(&a), "--config", s(&a.join("config.json"))]));
    let run = |cfg: &Path| k3(&[s(&a), "--ids", "1", "--config", s(cfg), "--out", s(&out)]);
    // the run's --config: a run config by a .toml name, else the model's config.json
    expect_fail(&run(&manifest), 2, &["model manifest", "--manifest"]);
    let renamed = dir.join("laptop.cfg");
    std::fs::copy(&laptop, &renamed).unwrap();
    expect_fail(&run(&renamed), 2, &["run config", ".toml"]);
    let json_as_toml = dir.join("config.toml");
    std::fs::copy(a.join("config.json"), &json_as_toml).unwrap();
    expect_fail(&run(&json_as_toml), 2, &["JSON", ".json"]);
    ok(&run(&a.join("config.json")));
}

#[test]
fn a_mistyped_subcommand_is_named() {
    for (args, word, sub) in [
        (&["pack-trnk", "a", "b"][..], "pack-trnk", "pack-trunk"),
        (&["sim-cash", "x"][..], "sim-cash", "sim-cache"),
        (&["plna", "x"][..], "plna", "plan"),
        (&["rende", "--ids", "1"][..], "rende", "render-chat"),
        (&["hlep"][..], "hlep", "help"),
    ] {
        expect_fail(
            &k3(args),
            2,
            &[
                &format!("no model directory '{word}'"),
                &format!("did you mean the subcommand `{sub}`?"),
            ],
        );
    }
    // A directory of that name is a model directory, not a typo.
    let dir = fresh_dir("contracts_subcommand");
    std::fs::create_dir_all(dir.join("plna")).unwrap();
    let o = Command::new(env!("CARGO_BIN_EXE_k3-run"))
        .args(["plna", "--ids", "1"])
        .current_dir(&dir)
        .env_remove("K3_ISA")
        .output()
        .expect("spawn k3-run");
    let err = expect_fail(&o, 2, &["config.json"]);
    assert!(!err.contains("did you mean"), "{err}");
    // A word far from every subcommand keeps the missing-directory error.
    let err = expect_fail(&k3(&["no-such-model", "--ids", "1"]), 2, &["no-such-model"]);
    assert!(!err.contains("did you mean"), "{err}");
}

/// Output into a pipe whose reader is gone (`k3-run plan M | head -1` after `head` exits) ends
/// the process by SIGPIPE, quietly, for a subcommand and for a run; before, `println!`
/// panicked (exit 101, a backtrace on stderr).
#[cfg(unix)] // SIGPIPE: Windows has none
#[test]
fn a_closed_stdout_pipe_ends_the_process_quietly() {
    use std::os::unix::process::ExitStatusExt;
    let a = fixture_a();
    for args in [
        vec!["plan", s(&a)],
        vec![s(&a), "--ids", "1,2,3", "--gen", "3", "--incremental"],
    ] {
        let (reader, writer) = std::io::pipe().expect("pipe");
        drop(reader);
        let o = Command::new(env!("CARGO_BIN_EXE_k3-run"))
            .args(&args)
            .stdout(writer)
            .output()
            .expect("spawn k3-run");
        let err = stderr(&o);
        assert!(!err.contains("panicked"), "{args:?}:\n{err}");
        assert_eq!(
            o.status.signal(),
            Some(libc::SIGPIPE),
            "{args:?}: {:?}\n{err}",
            o.status
        );
    }
}

/// A NaN (0xFF) E8M0 scale byte in a resident expert is refused naming the tensor in both
/// resident modes: through the maps at open, and from RAM after the arena load (where the
/// arena mode checks it), never used.
#[test]
fn a_nan_expert_scale_is_refused_in_both_resident_modes() {
    let dir = fresh_dir("nan_scale_resident");
    let a = fixture_a();
    for e in std::fs::read_dir(&a).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), dir.join(e.file_name())).unwrap();
    }
    let tensor = "language_model.model.layers.1.block_sparse_moe.experts.3.w2.weight_scale";
    let idx: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("model.safetensors.index.json")).unwrap())
            .unwrap();
    let shard = dir.join(idx["weight_map"][tensor].as_str().expect("in the index"));
    let mut bytes = std::fs::read(&shard).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let begin = header[tensor]["data_offsets"][0].as_u64().unwrap() as usize;
    bytes[8 + n + begin + 5] = 0xFF;
    std::fs::write(&shard, bytes).unwrap();
    for mode in ["mmap", "arena"] {
        let o = k3(&[s(&dir), "--ids", "1,2,3", "--gen", "1", "--resident", mode]);
        let err = stderr(&o);
        assert!(!o.status.success(), "{mode}: a NaN scale must be refused");
        assert!(
            err.contains(tensor) && err.contains("0xFF"),
            "{mode}: the message names the tensor: {err}"
        );
        assert!(
            !String::from_utf8_lossy(&o.stdout).contains("generated ids"),
            "{mode}: nothing generated"
        );
    }
}

/// A text prompt gets text back: the tokenizer comes from the model directory when `--tok` is
/// not given, each token line carries its text, the JSON has the generated text (the
/// tokenizer's decoding of the generated ids), and the run says where it wrote the JSON. A
/// model directory without a tokenizer is named in the error.
#[test]
fn a_text_prompt_gets_text_back_with_the_model_directorys_tokenizer() {
    let dir = fresh_dir("text_prompt");
    let model = repo().join("fixtures/models/chat/ckpt");
    let out = dir.join("r.json");
    let o = k3(&[
        s(&model),
        "--prompt",
        "The capital of France is",
        "--gen",
        "4",
        "--out",
        s(&out),
    ]);
    ok(&o);
    let stdout = String::from_utf8_lossy(&o.stdout).into_owned();
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&out).unwrap()).unwrap();
    let ids: Vec<u32> = v["generated_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect();
    assert_eq!(ids.len(), 4, "{v}");
    let tok = k3_text::tokenizer::Tokenizer::load(&model).unwrap();
    let want = tok.decode_lossy(&ids).unwrap();
    assert_eq!(v["text"].as_str(), Some(want.as_str()), "{v}");
    assert!(
        stdout.contains(&format!("generated text: {want:?}")),
        "{stdout}"
    );
    let prompt_ids = tok.encode_text("The capital of France is").unwrap();
    assert_eq!(v["prompt_ids"], serde_json::json!(prompt_ids));
    assert!(
        stderr(&o).contains(&format!("wrote {}", out.display())),
        "{}",
        stderr(&o)
    );

    let a = fixture_a();
    let o = k3(&[s(&a), "--prompt", "x", "--gen", "1", "--out", s(&out)]);
    assert_eq!(code(&o), 2);
    let err = stderr(&o);
    assert!(
        err.contains(&format!(
            "{} has no tiktoken.model; pass --tok DIR",
            a.display()
        )),
        "{err}"
    );
}
