//! The `k3-run` binary end to end (docs/DESIGN.md §6 exit codes): help and version without a model,
//! usage errors (exit 2) with a message, a config.json missing a needed key (exit 2 naming the
//! key and the file), a real run on fixture A whose `--out` JSON and `--dump-logits` bytes match
//! the independent reference, the `plan` subcommand, the `K3_ISA` override, and an unwritable
//! `--out` (exit 3 after the run).
//!
//! Owns: black-box checks of the command line only. Must not: call the library (the library is
//! covered by the conformance tests in `tests/tests/`); every expectation here comes from the
//! fixture's reference files (`fixtures/models/A/ref/`, `ckpt/synth_manifest.json`) or from the
//! documented CLI contract.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::{Value, json};

mod bin_support;

use bin_support::{code, expect_fail, fixture_a, k3_out, repo, stderr};

fn summary_a() -> Value {
    let p = repo().join("fixtures/models/A/ref/summary.json");
    serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap()
}

fn ids_of(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap_or_else(|| panic!("expected an id array, got {v}"))
        .iter()
        .map(|x| x.as_u64().expect("id is an integer") as u32)
        .collect()
}

fn csv(ids: &[u32]) -> String {
    ids.iter().map(u32::to_string).collect::<Vec<_>>().join(",")
}

fn k3(args: &[&str]) -> Output {
    k3_env(args, &[])
}

fn k3_env(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut c = Command::new(env!("CARGO_BIN_EXE_k3-run"));
    c.args(args).env_remove("K3_ISA");
    for (k, v) in env {
        c.env(k, v);
    }
    c.output().expect("spawn k3-run")
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// FNV-1a 64 over the little-endian bytes (the documented `first_logits_hash`).
fn fnv1a(bytes: &[u8]) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in bytes {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    format!("{h:016x}")
}

/// A packed trunk's trunk.json.
fn trunk_json(trunk: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(trunk.join("trunk.json")).unwrap()).unwrap()
}

/// Its layers' sizes rounded up to 4096 (the ring slot each needs).
fn layer_slots(m: &Value) -> Vec<u64> {
    m["layers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l["size"].as_u64().unwrap().next_multiple_of(4096))
        .collect()
}

fn f32s(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

#[test]
fn help_and_version_need_no_model() {
    let o = k3(&["--help"]);
    assert_eq!(code(&o), 0, "--help: {}", stderr(&o));
    let out = stdout(&o);
    for needle in ["Usage", "--ids", "--gen", "--out", "plan", "synth"] {
        assert!(
            out.contains(needle),
            "--help should mention {needle}:\n{out}"
        );
    }
    let o = k3(&["--version"]);
    assert_eq!(code(&o), 0, "--version: {}", stderr(&o));
    assert_eq!(
        stdout(&o).trim(),
        format!("k3-run {}", env!("CARGO_PKG_VERSION"))
    );
    let o = k3(&["plan", "--help"]);
    assert_eq!(code(&o), 0);
    assert!(stdout(&o).contains("--positions"));
}

#[test]
fn usage_errors_exit_2_with_a_message() {
    let a = fixture_a();
    let a = a.to_str().unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("r.json");
    let out = out.to_str().unwrap();
    // no prompt source
    let o = k3(&[a, "--gen", "1", "--out", out]);
    expect_fail(&o, 2, &["exactly one of --ids, --prompt, --prompt-file"]);
    // two prompt sources
    let o = k3(&[a, "--ids", "1,2", "--prompt", "hi", "--out", out]);
    expect_fail(&o, 2, &["exactly one of --ids, --prompt, --prompt-file"]);
    // a prompt whose tokenizer does not fit the model: the message names the prompt, not --ids
    let tok = repo().join("fixtures/text/vocab");
    let o = k3(&[
        a,
        "--prompt",
        "hello world",
        "--tok",
        tok.to_str().unwrap(),
        "--gen",
        "1",
        "--out",
        out,
    ]);
    let err = expect_fail(&o, 2, &["tokenized prompt", "outside the vocabulary"]);
    assert!(!err.contains("--ids"), "{err}");
    // token id == vocab (256 for fixture A)
    let o = k3(&[a, "--ids", "1,256", "--gen", "1", "--out", out]);
    expect_fail(&o, 2, &["256", "vocabulary"]);
    // --gen over the documented maximum
    let o = k3(&[a, "--ids", "1", "--gen", "4097", "--out", out]);
    expect_fail(&o, 2, &["4096"]);
    // no model directory at all (clap usage error)
    let o = k3(&["--ids", "1"]);
    assert_eq!(code(&o), 2, "{}", stderr(&o));
    // an unknown flag
    let o = k3(&[a, "--ids", "1", "--no-such-flag"]);
    expect_fail(&o, 2, &["--no-such-flag"]);
    // flags the settings would ignore: trunk sizes without --trunk, cache policies without a
    // cache (both ran with exit 0 before)
    for (flags, needle) in [
        (&["--trunk-gb", "1"][..], "add --trunk DIR"),
        (&["--trunk-ring", "3"][..], "add --trunk DIR"),
        (&["--expert-prefetch", "true"][..], "add --cache-gb"),
        // no ring slot at all (it silently became 1)
        (
            &["--trunk", "/nonexistent", "--trunk-ring", "0"][..],
            "at least 1",
        ),
    ] {
        let o = k3(&[&[a, "--ids", "1", "--out", out][..], flags].concat());
        expect_fail(&o, 2, &[needle]);
    }
    // thread counts outside 1..=1024 (40000 used to abort spawning the pool)
    for n in ["0", "40000"] {
        let o = k3(&[a, "--ids", "1", "--threads", n, "--out", out]);
        expect_fail(&o, 2, &["--threads", n, "1..=1024"]);
    }
    assert!(!Path::new(out).exists(), "no --out written by a failed run");
}

#[test]
fn missing_model_dir_is_a_clear_error() {
    let tmp = tempfile::tempdir().unwrap();
    let missing = tmp.path().join("no-such-model");
    let m = missing.to_str().unwrap();
    let out = tmp.path().join("r.json");
    let o = run_two_ids(&missing, &["--out", out.to_str().unwrap()]);
    let err = stderr(&o);
    assert_ne!(code(&o), 0, "{err}");
    assert!(err.contains(m), "error names the directory:\n{err}");
    assert!(
        err.contains("config.json"),
        "error names the file it needed:\n{err}"
    );
    assert!(!err.contains("panicked"), "no panic:\n{err}");
    let o = k3(&["plan", m]);
    assert_ne!(code(&o), 0);
    assert!(stderr(&o).contains(m));
    // A config.json that is a FIFO: refused, not read forever (the run used to block).
    let fifo_model = tmp.path().join("fifo-model");
    std::fs::create_dir_all(&fifo_model).unwrap();
    let cfg = fifo_model.join("config.json");
    let made = Command::new("mkfifo").arg(&cfg).status().unwrap();
    assert!(made.success(), "mkfifo");
    let o = k3(&[fifo_model.to_str().unwrap(), "--ids", "1", "--gen", "1"]);
    expect_fail(&o, 2, &["config.json", "not a regular file"]);
}

/// A copy of fixture A's config.json with `parent`'s `key` removed (`None`) or set to `value`
/// (the key must exist), written to DIR/config.json.
fn config_edited(dir: &Path, parent: &str, key: &str, value: Option<Value>) -> PathBuf {
    let text = std::fs::read_to_string(fixture_a().join("config.json")).unwrap();
    let mut v: Value = serde_json::from_str(&text).unwrap();
    let obj = v
        .pointer_mut(parent)
        .and_then(Value::as_object_mut)
        .unwrap_or_else(|| panic!("fixture A config.json has {parent}"));
    let had = match value {
        None => obj.remove(key),
        Some(value) => obj.insert(key.to_string(), value),
    };
    assert!(had.is_some(), "{parent}/{key} exists in fixture A");
    let p = dir.join("config.json");
    std::fs::write(&p, serde_json::to_string_pretty(&v).unwrap()).unwrap();
    p
}

/// `k3-run MODEL --ids 1,2 --gen 1 EXTRA...`: the smallest run.
fn run_two_ids(model: &Path, extra: &[&str]) -> Output {
    let mut args = vec![model.to_str().unwrap(), "--ids", "1,2", "--gen", "1"];
    args.extend_from_slice(extra);
    k3(&args)
}

/// Fixture A's shards run with `--config cfg`.
fn run_a_with_config(cfg: &str, out: &Path) -> Output {
    run_two_ids(
        &fixture_a(),
        &["--config", cfg, "--out", out.to_str().unwrap()],
    )
}

#[test]
fn config_missing_a_needed_key_exits_2_naming_key_and_file() {
    for (parent, key) in [
        ("/text_config", "moe_intermediate_size"),
        ("/text_config/linear_attn_config", "num_heads"),
        ("/text_config", "attn_res_block_size"),
    ] {
        let tmp = tempfile::tempdir().unwrap();
        let cfg = config_edited(tmp.path(), parent, key, None);
        let cfg_s = cfg.to_str().unwrap();
        let out = tmp.path().join("r.json");
        // model dir holding only the broken config.json: the config is read before any shard
        let o = run_two_ids(tmp.path(), &["--out", out.to_str().unwrap()]);
        expect_fail(&o, 2, &[key, cfg_s]);
        // the real shards with --config pointing at the broken file
        expect_fail(&run_a_with_config(cfg_s, &out), 2, &[key, cfg_s]);
        // plan reads the same config
        let o = k3(&["plan", tmp.path().to_str().unwrap()]);
        expect_fail(&o, 2, &[key, cfg_s]);
    }
}

/// A config.json value whose number makes the math meaningless (SiTU beta 0 divides by zero,
/// a routed scaling factor <= 0, an absurd epsilon, 0 positions) is refused before any shard is
/// read: exit 2 naming the key and the file.
#[test]
fn config_number_out_of_range_exits_2_naming_key_and_file() {
    for (parent, key, value) in [
        ("/text_config", "activation_situ_beta", json!(0.0)),
        ("/text_config", "activation_situ_linear_beta", json!(-25.0)),
        ("/text_config", "routed_scaling_factor", json!(0.0)),
        ("/text_config", "rms_norm_eps", json!(1e12)),
        ("/text_config", "max_position_embeddings", json!(0)),
    ] {
        let tmp = tempfile::tempdir().unwrap();
        let cfg = config_edited(tmp.path(), parent, key, Some(value));
        let cfg_s = cfg.to_str().unwrap();
        let o = run_a_with_config(cfg_s, &tmp.path().join("r.json"));
        expect_fail(&o, 2, &[key, cfg_s]);
    }
}

/// A packed trunk whose trunk.json does not add up (`packed_bytes` is not the sum of the layer
/// sizes) or whose trunk.bin is a directory is refused before the run: exit 2 naming the
/// field or the file.
#[test]
fn an_inconsistent_packed_trunk_exits_2_naming_the_field() {
    let a = fixture_a();
    let tmp = tempfile::tempdir().unwrap();
    let trunk = tmp.path().join("trunk");
    let o = k3(&["pack-trunk", a.to_str().unwrap(), trunk.to_str().unwrap()]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let run = |t: &Path| run_two_ids(&a, &["--trunk", t.to_str().unwrap()]);
    let mut m = trunk_json(&trunk);
    let packed = m["packed_bytes"].as_u64().unwrap();
    m["packed_bytes"] = json!(packed + 4096);
    std::fs::write(trunk.join("trunk.json"), m.to_string()).unwrap();
    expect_fail(&run(&trunk), 2, &["trunk.json", "packed_bytes"]);
    m["packed_bytes"] = json!(packed);
    std::fs::write(trunk.join("trunk.json"), m.to_string()).unwrap();
    let bin = trunk.join("trunk.bin");
    std::fs::remove_file(&bin).unwrap();
    std::fs::create_dir(&bin).unwrap();
    expect_fail(
        &run(&trunk),
        2,
        &[bin.to_str().unwrap(), "is a directory, not a regular file"],
    );
}

/// `doctor --seconds` outside 0.1..=3600 (0, negative, NaN, infinite, absurdly long) is a
/// usage error before anything is measured; 0 used to print 0 MB/s, 0 ms latencies and an
/// I/O floor of 1e12 s per GB.
#[test]
fn doctor_refuses_a_meaningless_seconds_value() {
    let tmp = tempfile::tempdir().unwrap();
    for bad in ["0", "-1", "NaN", "inf", "0.01", "1e9"] {
        let o = k3(&[
            "doctor",
            "--no-dram",
            "--dir",
            tmp.path().to_str().unwrap(),
            "--size-gb",
            "0.01",
            &format!("--seconds={bad}"),
        ]);
        let err = expect_fail(&o, 2, &["--seconds", "0.1..=3600"]);
        assert!(
            stdout(&o).is_empty(),
            "--seconds {bad}: refused before any measurement: {}\n{err}",
            stdout(&o)
        );
    }
}

/// `--dir` in RAM (tmpfs) is refused for the disk measurement, and the next commands do not
/// suggest packing the trunk there either.
#[test]
fn doctor_does_not_suggest_a_trunk_on_tmpfs() {
    let mounts = std::fs::read_to_string("/proc/self/mounts").unwrap_or_default();
    if !mounts
        .lines()
        .any(|l| l.split(' ').nth(1) == Some("/dev/shm") && l.contains(" tmpfs "))
    {
        eprintln!("skipped: no tmpfs at /dev/shm");
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let json = tmp.path().join("doctor.json");
    let o = k3(&[
        "doctor",
        "--no-dram",
        "--dir",
        "/dev/shm",
        "--size-gb",
        "0.01",
        "--seconds",
        "0.2",
        "--json",
        json.to_str().unwrap(),
    ]);
    let out = stdout(&o);
    assert!(
        out.contains("NOT MEASURED") && out.contains("tmpfs"),
        "{out}"
    );
    let v: Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let next = v["next_commands"].as_array().expect("next_commands");
    assert!(
        next.iter()
            .all(|c| !c.as_str().unwrap().contains("/dev/shm")),
        "{next:?}"
    );
}

/// `doctor`'s next commands: before a trunk is packed, check the download (`verify --release
/// kimi-k3`), then pack, then run; with a packed trunk only the run. On a machine where no
/// preset fits there is nothing to run and no command.
#[test]
fn doctor_next_commands_check_the_download_before_packing() {
    let tmp = tempfile::tempdir().unwrap();
    let a = fixture_a();
    let a_s = a.to_str().unwrap();
    let doctor = |trunk: &std::path::Path| -> Vec<String> {
        let json = tmp.path().join("doctor.json");
        let o = k3(&[
            "doctor",
            "--no-dram",
            "--no-disk",
            "--model",
            a_s,
            "--trunk",
            trunk.to_str().unwrap(),
            "--json",
            json.to_str().unwrap(),
        ]);
        assert!(
            o.status.code() == Some(0) || o.status.code() == Some(1),
            "{}",
            String::from_utf8_lossy(&o.stderr)
        );
        let v: Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
        let next: Vec<String> = v["next_commands"]
            .as_array()
            .expect("next_commands")
            .iter()
            .map(|c| c.as_str().unwrap().to_string())
            .collect();
        if next.is_empty() {
            assert!(stdout(&o).contains("nothing to run"), "{}", stdout(&o));
        }
        next
    };
    let trunk = tmp.path().join("trunk");
    let next = doctor(&trunk);
    if next.is_empty() {
        return; // no preset fits this machine: covered by the branch above
    }
    let t = trunk.to_str().unwrap();
    assert_eq!(next.len(), 3, "{next:?}");
    assert_eq!(next[0], format!("k3-run verify {a_s} --release kimi-k3"));
    assert_eq!(next[1], format!("k3-run pack-trunk {a_s} {t}"));
    assert!(
        next[2].starts_with(&format!("k3-run {a_s} --trunk {t} --preset ")),
        "{next:?}"
    );
    // packed: only the run
    let o = k3(&["pack-trunk", a_s, t]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let next = doctor(&trunk);
    assert_eq!(next.len(), 1, "{next:?}");
    assert!(
        next[0].starts_with(&format!("k3-run {a_s} --trunk {t} ")),
        "{next:?}"
    );
}

/// Runs fixture A with the reference prompt and --gen; returns (json, dumped logits bytes, stdout).
fn run_a(extra: &[&str], env: &[(&str, &str)]) -> (Value, Vec<u8>, String) {
    let s = summary_a();
    let prompt = csv(&ids_of(&s["prompt_ids"]));
    let n_gen = ids_of(&s["generated_ids"]).len().to_string();
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("run.json");
    let dump = tmp.path().join("step0.f32");
    let a = fixture_a();
    let mut args = vec![
        a.to_str().unwrap(),
        "--ids",
        &prompt,
        "--gen",
        &n_gen,
        "--out",
        out.to_str().unwrap(),
        "--dump-logits",
        dump.to_str().unwrap(),
    ];
    args.extend_from_slice(extra);
    let o = k3_env(&args, env);
    assert_eq!(code(&o), 0, "run on fixture A failed:\n{}", stderr(&o));
    let json: Value =
        serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).expect("--out is valid JSON");
    (json, std::fs::read(&dump).unwrap(), stdout(&o))
}

#[test]
fn run_on_fixture_a_writes_out_json_and_logits_matching_the_reference() {
    let s = summary_a();
    let vocab = s["n_vocab"].as_u64().unwrap() as usize;
    let want_gen = ids_of(&s["generated_ids"]);
    let (j, dump, out) = run_a(&["--incremental", "--threads", "2"], &[]);
    assert_eq!(ids_of(&j["prompt_ids"]), ids_of(&s["prompt_ids"]));
    assert_eq!(
        ids_of(&j["generated_ids"]),
        want_gen,
        "generated ids equal the numpy reference's (fixtures/models/A/ref/summary.json)"
    );
    let spt = j["seconds_per_token"]
        .as_f64()
        .expect("seconds_per_token is a number");
    assert!(spt > 0.0 && spt < 60.0, "seconds_per_token {spt}");
    let rss = j["peak_rss_bytes"]
        .as_u64()
        .expect("peak_rss_bytes is an integer");
    // the checkpoint alone is 5.5 MB and is resident; a process is at least that big
    assert!(
        rss > 5_000_000 && rss < 4_000_000_000,
        "peak_rss_bytes {rss}"
    );
    assert_eq!(j["threads"], 2);
    assert_eq!(j["incremental"], true);
    // printed report
    assert!(
        out.contains(&format!("generated ids: {want_gen:?}")),
        "{out}"
    );
    assert!(out.contains("PEAK RSS"), "{out}");

    // --dump-logits: vocab f32s, the hash in the JSON, within the reference tolerance
    assert_eq!(dump.len(), vocab * 4, "--dump-logits holds vocab*4 bytes");
    assert_eq!(
        j["first_logits_hash"].as_str().unwrap(),
        fnv1a(&dump),
        "first_logits_hash is the FNV-1a of the dumped bytes"
    );
    let mine = f32s(&dump);
    let reference =
        f32s(&std::fs::read(repo().join("fixtures/models/A/ref/step0_logits.f32")).unwrap());
    assert_eq!(reference.len(), vocab);
    let tol = s["logit_tolerance"].as_f64().unwrap() as f32;
    let worst = mine
        .iter()
        .zip(&reference)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max);
    assert!(
        worst <= tol,
        "step-0 logits differ from the reference by {worst} > {tol}"
    );
}

#[test]
fn full_recompute_threads_and_isa_give_the_same_bits_through_the_cli() {
    let (inc, dump_inc, _) = run_a(&["--incremental", "--threads", "2"], &[]);
    let (full, dump_full, _) = run_a(&["--threads", "1"], &[("K3_ISA", "scalar")]);
    assert_eq!(full["isa"], "scalar", "K3_ISA=scalar is honoured");
    assert_eq!(full["incremental"], false);
    assert_eq!(inc["generated_ids"], full["generated_ids"]);
    assert_eq!(inc["first_logits_hash"], full["first_logits_hash"]);
    assert_eq!(dump_inc, dump_full, "first-step logit bytes");
}

/// `--dump-prompt-logits`: teacher forcing over the prompt. Fed the reference's teacher-forced
/// sequence (prompt + generated ids), every row is within the reference's per-position
/// tolerance of its `tf_logits.f32`, `prompt_argmax` is its `tf_argmax`, and the last row is
/// the `--dump-logits` bits. The rows are the same bytes with a packed trunk streamed through
/// two ring slots and in prompt chunks of 7 (rows across chunk boundaries). With
/// `--dump-layer-logits` or `--batch-ids` it is a usage error.
#[test]
fn dump_prompt_logits_are_the_reference_teacher_forced_logits() {
    let s = summary_a();
    let vocab = s["n_vocab"].as_u64().unwrap() as usize;
    let seq = ids_of(&s["tf_sequence"]);
    let tmp = tempfile::tempdir().unwrap();
    let a = fixture_a();
    let a = a.to_str().unwrap();
    let ids = csv(&seq);
    let run = |name: &str, extra: &[&str]| -> (Value, Vec<u8>, Vec<u8>) {
        let rows = tmp.path().join(format!("{name}.f32"));
        let step0 = tmp.path().join(format!("{name}-step0.f32"));
        let out = tmp.path().join(format!("{name}.json"));
        let mut args = vec![
            a,
            "--ids",
            &ids,
            "--gen",
            "1",
            "--incremental",
            "--dump-prompt-logits",
            rows.to_str().unwrap(),
            "--dump-logits",
            step0.to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
        ];
        args.extend_from_slice(extra);
        (
            k3_out(&args, &out),
            std::fs::read(&rows).unwrap(),
            std::fs::read(&step0).unwrap(),
        )
    };
    let (j, rows, step0) = run("resident", &[]);
    assert_eq!(
        rows.len(),
        seq.len() * vocab * 4,
        "[prompt tokens, vocab] f32"
    );
    assert_eq!(
        &rows[rows.len() - vocab * 4..],
        &step0[..],
        "last row = --dump-logits"
    );
    assert_eq!(ids_of(&j["prompt_argmax"]), ids_of(&s["tf_argmax"]));
    let reference =
        f32s(&std::fs::read(repo().join("fixtures/models/A/ref/tf_logits.f32")).unwrap());
    let mine = f32s(&rows);
    assert_eq!(reference.len(), mine.len());
    let tol = s["logit_tolerance_per_position"].as_array().unwrap();
    for (p, (m, r)) in mine.chunks(vocab).zip(reference.chunks(vocab)).enumerate() {
        let worst = m
            .iter()
            .zip(r)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0f32, f32::max);
        let t = tol[p].as_f64().unwrap() as f32;
        assert!(worst <= t, "position {p}: {worst} > {t}");
    }
    // streamed through two ring slots, chunks of 7: the same bytes
    let trunk = tmp.path().join("trunk");
    assert_eq!(code(&k3(&["pack-trunk", a, trunk.to_str().unwrap()])), 0);
    let m = trunk_json(&trunk);
    let two_slots = (2 * layer_slots(&m).into_iter().max().unwrap()) as f64 / 1e9 + 1e-6;
    let (_, streamed, _) = run(
        "streamed",
        &[
            "--trunk",
            trunk.to_str().unwrap(),
            "--trunk-gb",
            &format!("{two_slots:.6}"),
            "--prefill-chunk",
            "7",
        ],
    );
    assert!(streamed == rows, "streamed, chunks of 7: other bytes");
    // one prompt, its own way of computing the last chunk
    let o = k3(&[
        a,
        "--ids",
        "1,2",
        "--dump-prompt-logits",
        "x.f32",
        "--dump-layer-logits",
        "y.f32",
    ]);
    expect_fail(&o, 2, &["--dump-prompt-logits", "--dump-layer-logits"]);
    let o = k3(&[
        a,
        "--batch-ids",
        "1,2;3",
        "--incremental",
        "--dump-prompt-logits",
        "x.f32",
    ]);
    expect_fail(&o, 2, &["--dump-prompt-logits", "--batch-ids"]);
}

/// `--prefill-chunk`: token by token (1, the one-token MoE path), uneven chunks (3) and one
/// chunk for everything give the same ids and first-step bytes, incremental and in full
/// recompute (which feeds the whole prefix each step); the working memory is printed with the
/// decode state; 0 and 4097 are usage errors.
#[test]
fn prefill_chunk_changes_no_bit() {
    let (base, dump, _) = run_a(&["--incremental"], &[]);
    for extra in [
        &["--incremental", "--prefill-chunk", "1"][..],
        &["--incremental", "--prefill-chunk", "3"][..],
        &["--prefill-chunk", "1"][..],
        &["--prefill-chunk", "4096", "--threads", "2"][..],
    ] {
        let (j, d, _) = run_a(extra, &[]);
        assert_eq!(j["generated_ids"], base["generated_ids"], "{extra:?}");
        assert_eq!(
            j["first_logits_hash"], base["first_logits_hash"],
            "{extra:?}"
        );
        assert_eq!(d, dump, "{extra:?}: first-step logit bytes");
    }
    let a = fixture_a();
    let o = run_two_ids(&a, &["--prefill-chunk", "5"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert!(
        stderr(&o).contains("for prompt chunks of 5"),
        "{}",
        stderr(&o)
    );
    for bad in ["0", "4097"] {
        let o = k3(&[a.to_str().unwrap(), "--ids", "1", "--prefill-chunk", bad]);
        expect_fail(&o, 2, &["--prefill-chunk"]);
    }
    // Without the flag: 64 with the trunk in RAM, 256 when trunk layers are read per pass
    // (two ring slots), the flag winning; the same ids and bytes.
    let tmp = tempfile::tempdir().unwrap();
    let trunk = tmp.path().join("trunk");
    let o = k3(&["pack-trunk", a.to_str().unwrap(), trunk.to_str().unwrap()]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let m = trunk_json(&trunk);
    let largest = *layer_slots(&m).iter().max().unwrap();
    let gb = format!("{:.9}", (2 * largest) as f64 / 1e9);
    let t = trunk.to_str().unwrap();
    for (extra, want) in [
        (
            &["--trunk", t, "--trunk-gb", &gb][..],
            "prompt chunks of 256",
        ),
        (
            &["--trunk", t, "--trunk-gb", &gb, "--prefill-chunk", "9"][..],
            "prompt chunks of 9",
        ),
        (&["--threads", "1"][..], "prompt chunks of 64"),
    ] {
        let mut args = vec!["--incremental"];
        args.extend_from_slice(extra);
        let (j, d, _) = run_a(&args, &[]);
        assert_eq!(j["generated_ids"], base["generated_ids"], "{extra:?}");
        assert_eq!(d, dump, "{extra:?}");
        let o = k3(&[
            &[a.to_str().unwrap(), "--ids", "1,2", "--gen", "1"][..],
            &args,
        ]
        .concat());
        assert!(stderr(&o).contains(want), "{extra:?}: {}", stderr(&o));
    }
}

#[test]
fn unknown_k3_isa_is_a_usage_error() {
    let a = fixture_a();
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("r.json");
    let o = k3_env(
        &[
            a.to_str().unwrap(),
            "--ids",
            "1",
            "--gen",
            "1",
            "--out",
            out.to_str().unwrap(),
        ],
        &[("K3_ISA", "sse9")],
    );
    expect_fail(&o, 2, &["sse9"]);
}

#[test]
fn plan_prints_one_line_per_layer() {
    let a = fixture_a();
    let o = k3(&["plan", a.to_str().unwrap(), "--positions", "64"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let text = stdout(&o);
    // expected layer map from the oracle's own record of what it wrote
    let man: Value =
        serde_json::from_str(&std::fs::read_to_string(a.join("synth_manifest.json")).unwrap())
            .unwrap();
    let n_layers = man["layers"].as_u64().unwrap() as usize;
    let mla = ids_of(&man["mla_layers_0based"]);
    let first_dense = man["first_dense"].as_u64().unwrap() as usize;
    let mut rows = Vec::new();
    for line in text.lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        if f.len() == 7 && f[0].parse::<usize>().is_ok() {
            rows.push((
                f[0].parse::<usize>().unwrap(),
                f[1].to_string(),
                f[2].to_string(),
            ));
        }
    }
    assert_eq!(
        rows.len(),
        n_layers,
        "one per-layer line per layer:\n{text}"
    );
    for (i, (idx, attn, ffn)) in rows.iter().enumerate() {
        assert_eq!(*idx, i);
        let want_attn = if mla.contains(&(i as u32)) {
            "Mla"
        } else {
            "Kda"
        };
        assert_eq!(attn, want_attn, "layer {i} attention kind:\n{text}");
        let want_ffn = if i < first_dense { "Dense" } else { "Moe" };
        assert_eq!(ffn, want_ffn, "layer {i} ffn kind:\n{text}");
    }
    assert!(text.contains("64 positions max"), "{text}");
    let o = k3(&["plan", a.to_str().unwrap(), "--json"]);
    assert_eq!(code(&o), 0);
    let j: Value = serde_json::from_str(&stdout(&o)).expect("plan --json is JSON");
    assert_eq!(j["layers"].as_array().unwrap().len(), n_layers);
}

#[test]
fn unwritable_out_exits_3_after_the_run() {
    let s = summary_a();
    let want_gen = ids_of(&s["generated_ids"]);
    let prompt = csv(&ids_of(&s["prompt_ids"]));
    let tmp = tempfile::tempdir().unwrap();
    let bad = tmp.path().join("no-such-dir/run.json");
    let a = fixture_a();
    let o = k3(&[
        a.to_str().unwrap(),
        "--ids",
        &prompt,
        "--gen",
        "3",
        "--incremental",
        "--out",
        bad.to_str().unwrap(),
    ]);
    expect_fail(&o, 3, &["--out", bad.to_str().unwrap()]);
    // the run itself finished and reported its tokens before the write failed
    assert!(
        stdout(&o).contains(&format!("generated ids: {:?}", &want_gen[..3])),
        "{}",
        stdout(&o)
    );
    // same for --dump-logits
    let ok_out = tmp.path().join("run.json");
    let o = k3(&[
        a.to_str().unwrap(),
        "--ids",
        &prompt,
        "--gen",
        "2",
        "--incremental",
        "--out",
        ok_out.to_str().unwrap(),
        "--dump-logits",
        bad.to_str().unwrap(),
    ]);
    expect_fail(&o, 3, &["--dump-logits"]);
    assert!(stdout(&o).contains("generated ids:"));
}

#[test]
fn resident_arena_flag_gives_the_reference_ids_and_bad_values_exit_2() {
    let a = fixture_a();
    let a = a.to_str().unwrap();
    let s = summary_a();
    let want = ids_of(&s["generated_ids"]);
    let prompt = csv(&ids_of(&s["prompt_ids"]));
    let tmp = tempfile::tempdir().unwrap();
    let mut got = Vec::new();
    for mode in ["mmap", "arena"] {
        let out = tmp.path().join(format!("{mode}.json"));
        let o = k3(&[
            a,
            "--ids",
            &prompt,
            "--gen",
            &want.len().to_string(),
            "--incremental",
            "--resident",
            mode,
            "--out",
            out.to_str().unwrap(),
        ]);
        assert_eq!(code(&o), 0, "--resident {mode}: {}", stderr(&o));
        let v: Value = serde_json::from_slice(&std::fs::read(&out).unwrap()).unwrap();
        assert_eq!(ids_of(&v["generated_ids"]), want, "--resident {mode}");
        let load = v["resident_load_seconds"]
            .as_f64()
            .expect("resident_load_seconds");
        if mode == "arena" {
            assert!(
                stderr(&o).contains("resident weights:"),
                "the arena load is reported: {}",
                stderr(&o)
            );
            assert!(load > 0.0, "arena load time recorded");
        } else {
            assert_eq!(load, 0.0, "no arena with --resident mmap");
        }
        got.push(v["first_logits_hash"].clone());
    }
    assert_eq!(got[0], got[1], "same first-step logit bits");
    // --io mmap serves resident weights from the maps: an arena asked for is said not used
    let out = tmp.path().join("arena-mmap.json");
    let o = k3(&[
        a,
        "--ids",
        &prompt,
        "--gen",
        "1",
        "--resident",
        "arena",
        "--io",
        "mmap",
        "--out",
        out.to_str().unwrap(),
    ]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert!(
        stderr(&o).contains("--resident arena (or K3_RESIDENT=arena) is not used"),
        "{}",
        stderr(&o)
    );
    let v: Value = serde_json::from_slice(&std::fs::read(&out).unwrap()).unwrap();
    assert_eq!(v["resident_load_seconds"].as_f64(), Some(0.0));
    assert_eq!(ids_of(&v["generated_ids"]), want[..1]);
    let out = tmp.path().join("bad.json");
    let o = k3(&[
        a,
        "--ids",
        "1",
        "--resident",
        "ramdisk",
        "--out",
        out.to_str().unwrap(),
    ]);
    expect_fail(&o, 2, &["ramdisk", "mmap or arena"]);
}

#[test]
fn expert_prefetch_takes_a_margin_and_keeps_the_reference_ids() {
    let want = ids_of(&summary_a()["generated_ids"]);
    // Resident trunk, experts streamed through a cache of a few layers' worth: the look-ahead
    // guess (from the previous MoE layer) reads experts ahead; ids stay the reference's.
    let mut counts = Vec::new();
    for margin in ["0", "2", "true"] {
        let (j, _, _) = run_a(
            &[
                "--incremental",
                "--cache-gb",
                "0.002",
                "--expert-prefetch",
                margin,
            ],
            &[],
        );
        assert_eq!(
            ids_of(&j["generated_ids"]),
            want,
            "--expert-prefetch {margin}"
        );
        let pf = j["experts"]["prefetched"]
            .as_u64()
            .expect("experts.prefetched");
        assert!(
            pf > 0,
            "--expert-prefetch {margin}: nothing prefetched: {j}"
        );
        counts.push(pf);
    }
    assert!(
        counts[0] < counts[1],
        "a larger margin guesses more: {counts:?}"
    );
    let (j, _, _) = run_a(
        &[
            "--incremental",
            "--cache-gb",
            "0.002",
            "--expert-prefetch",
            "false",
        ],
        &[],
    );
    assert_eq!(j["experts"]["prefetched"].as_u64(), Some(0));
    let a = fixture_a();
    let o = k3(&[
        a.to_str().unwrap(),
        "--ids",
        "1",
        "--expert-prefetch",
        "maybe",
    ]);
    expect_fail(&o, 2, &["--expert-prefetch", "margin", "maybe"]);
}

#[test]
fn batch_ids_decode_together_with_each_sequences_own_bits() {
    let tmp = tempfile::tempdir().unwrap();
    let a = fixture_a();
    let a = a.to_str().unwrap();
    let prompts = ["11,22,33,44,55,66,77,88,99,110", "5,6,7", "200"];
    let mut want = Vec::new();
    for p in prompts {
        let out = tmp.path().join("one.json");
        let o = k3(&[
            a,
            "--ids",
            p,
            "--gen",
            "6",
            "--incremental",
            "--out",
            out.to_str().unwrap(),
        ]);
        assert_eq!(code(&o), 0, "{}", stderr(&o));
        let v: Value = serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
        want.push((ids_of(&v["generated_ids"]), v["first_logits_hash"].clone()));
    }
    let out = tmp.path().join("batch.json");
    let joined = prompts.join(";");
    let o = k3(&[
        a,
        "--batch-ids",
        &joined,
        "--gen",
        "6",
        "--incremental",
        "--threads",
        "2",
        "--out",
        out.to_str().unwrap(),
    ]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let v: Value = serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
    let seqs = v["sequences"].as_array().expect("sequences");
    assert_eq!(seqs.len(), 3);
    for (s, (ids, hash)) in seqs.iter().zip(&want) {
        assert_eq!(&ids_of(&s["generated_ids"]), ids, "batched ids differ");
        assert_eq!(
            &s["first_logits_hash"], hash,
            "batched first-step bits differ"
        );
    }
    assert_eq!(v["steps"], 5);
    assert!(
        stdout(&o).contains("sequence 1: generated ids"),
        "{}",
        stdout(&o)
    );
    // usage errors
    for (args, needle) in [
        (
            vec![a, "--batch-ids", "1,2;;3", "--incremental"],
            "prompt 2 is empty",
        ),
        (vec![a, "--batch-ids", "1,x", "--incremental"], "prompt 1"),
        (vec![a, "--batch-ids", "1,2;3"], "--incremental"),
        (
            vec![a, "--batch-ids", "1;99999", "--incremental"],
            "outside the vocabulary",
        ),
        (
            vec![a, "--batch-ids", "1;2", "--ids", "3", "--incremental"],
            "--ids",
        ),
    ] {
        expect_fail(&k3(&args), 2, &[needle]);
    }
}

#[test]
fn speculate_keeps_the_reference_ids_and_reports_its_passes() {
    let (plain, dump_plain, _) = run_a(&["--incremental"], &[]);
    let (spec, dump_spec, out) = run_a(&["--incremental", "--speculate", "4"], &[]);
    assert_eq!(spec["generated_ids"], plain["generated_ids"]);
    assert_eq!(dump_spec, dump_plain, "first-step logit bytes");
    let s = &spec["speculation"];
    let passes = s["passes"].as_u64().expect("speculation.passes");
    let n = ids_of(&spec["generated_ids"]).len() as u64;
    assert!(passes >= 1 && passes < n, "{passes} passes for {n} ids");
    assert!(s["accepted"].as_u64() <= s["drafted"].as_u64(), "{s}");
    assert!(out.contains("speculation: "), "{out}");
    assert!(plain["speculation"].is_null());
    // Refusals: without --incremental, K out of range, with --batch-ids.
    let a = fixture_a();
    let a = a.to_str().unwrap();
    expect_fail(
        &k3(&[a, "--ids", "1,2", "--speculate", "4"]),
        2,
        &["--speculate", "--incremental"],
    );
    expect_fail(
        &k3(&[a, "--ids", "1,2", "--incremental", "--speculate", "0"]),
        2,
        &["--speculate 0", "1..=32"],
    );
    expect_fail(
        &k3(&[a, "--ids", "1,2", "--incremental", "--speculate", "33"]),
        2,
        &["1..=32"],
    );
    expect_fail(
        &k3(&[
            a,
            "--batch-ids",
            "1,2;3",
            "--incremental",
            "--speculate",
            "2",
        ]),
        2,
        &["--speculate"],
    );
}

#[test]
fn plan_with_a_packed_trunk_prints_its_memory_plan() {
    let tmp = tempfile::tempdir().unwrap();
    let trunk = tmp.path().join("trunk");
    let a = fixture_a();
    let a = a.to_str().unwrap();
    let o = k3(&["pack-trunk", a, trunk.to_str().unwrap()]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let m = trunk_json(&trunk);
    let sizes = layer_slots(&m);
    let (largest, smallest) = (*sizes.iter().max().unwrap(), *sizes.iter().min().unwrap());
    // Between one slot and two: a shared ring (the largest layer beside the smallest fits).
    let gb = format!("{:.9}", (largest + smallest) as f64 / 1e9);
    let t = trunk.to_str().unwrap();
    let o = k3(&["plan", a, "--trunk", t, "--trunk-gb", &gb]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let out = stdout(&o);
    assert!(out.contains("ONE SHARED ring"), "{out}");
    assert!(out.contains("deterministic hit rate"), "{out}");
    let o = k3(&["plan", a, "--trunk", t, "--trunk-gb", &gb, "--json"]);
    let j: Value = serde_json::from_str(&stdout(&o)).expect("plan --json");
    let tp = &j["trunk_plan"];
    assert_eq!(tp["ring_slots"], 1, "{tp}");
    assert!(tp["shared_ring_bytes"].as_u64().unwrap() >= largest, "{tp}");
    assert!(tp["read_ahead_layers"].as_u64().unwrap() >= 1, "{tp}");
    assert_eq!(tp["n_layers"].as_u64().unwrap() as usize, sizes.len());
    // A preset's budget pins this small trunk whole; no budget, or too small a one, exits 2.
    let o = k3(&["plan", a, "--trunk", t, "--preset", "laptop"]);
    assert!(stdout(&o).contains("layers PINNED"), "{}", stdout(&o));
    expect_fail(
        &k3(&["plan", a, "--trunk", t]),
        2,
        &["--trunk-gb", "--preset"],
    );
    expect_fail(
        &k3(&["plan", a, "--trunk", t, "--trunk-gb", "0.0001"]),
        2,
        &["cannot fit even one ring slot"],
    );
}

/// `pack-trunk --compress` through the binary: the summary says how much is stored; runs from
/// the compressed trunk at two ring slots and with every layer pinned give fixture A's
/// reference ids and the resident run's first-step logit bytes; the mmap I/O policy refuses it
/// with exit 2, naming the directory.
#[test]
fn a_compressed_trunk_gives_the_reference_bits_through_the_cli() {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("cli_compressed");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let trunk = dir.join("trunk");
    let a = fixture_a();
    let o = k3(&[
        "pack-trunk",
        "--compress",
        a.to_str().unwrap(),
        trunk.to_str().unwrap(),
    ]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert!(stdout(&o).contains("stored compressed"), "{}", stdout(&o));
    // the summary is the command's result, printed once (stdout), not also on stderr
    assert!(!stderr(&o).contains("stored compressed"), "{}", stderr(&o));
    let m = trunk_json(&trunk);
    assert_eq!(m["version"], 2);
    let largest = *layer_slots(&m).iter().max().unwrap();
    let (base, dump, _) = run_a(&["--incremental"], &[]);
    assert_eq!(base["generated_ids"], summary_a()["generated_ids"]);
    let t = trunk.to_str().unwrap();
    for gb in [
        format!("{:.9}", (2 * largest) as f64 / 1e9),
        "1".to_string(),
    ] {
        let (j, d, _) = run_a(&["--incremental", "--trunk", t, "--trunk-gb", &gb], &[]);
        assert_eq!(j["generated_ids"], base["generated_ids"], "--trunk-gb {gb}");
        assert_eq!(d, dump, "--trunk-gb {gb}: first-step logits differ");
        let read = j["trunk"]["bytes_read"].as_u64().unwrap();
        assert!(read > 0, "{}", j["trunk"]);
    }
    let o = k3(&[
        a.to_str().unwrap(),
        "--ids",
        "1,2",
        "--trunk",
        t,
        "--io",
        "mmap",
    ]);
    expect_fail(&o, 2, &["compressed", t]);
    let bad = dir.join("bad");
    for k in ["0", "6", "18014398509481988"] {
        let o = k3(&[
            "pack-trunk",
            "--compress",
            "--chunk-kib",
            k,
            a.to_str().unwrap(),
            bad.to_str().unwrap(),
        ]);
        expect_fail(&o, 2, &["--chunk-kib"]);
    }
    assert!(!bad.join("trunk.json").exists());
    let o = k3(&["plan", a.to_str().unwrap(), "--trunk", t, "--trunk-gb", "1"]);
    assert!(
        stdout(&o).contains("compressed trunk (bf16-nibble-inplace): a pass"),
        "{}",
        stdout(&o)
    );
}

/// A run config's `trunk_ring` is used when `--trunk-ring` is not on the command line (the
/// flag's default must not hide it), and the flag wins when it is.
#[test]
fn a_run_configs_trunk_ring_is_used_unless_the_flag_is_given() {
    let a = fixture_a();
    let a = a.to_str().unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let trunk = tmp.path().join("trunk");
    let o = k3(&["pack-trunk", a, trunk.to_str().unwrap()]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let largest = *layer_slots(&trunk_json(&trunk)).iter().max().unwrap();
    let gb = format!("{:.9}", (4 * largest) as f64 / 1e9);
    let configs = repo().join("configs");
    let rc = tmp.path().join("ring3.toml");
    std::fs::write(
        &rc,
        format!(
            "schema_version = 1\nname = \"ring3\"\nmanifest = \"{}\"\nio = \"{}\"\ntrunk_ring = 3\n",
            configs.join("models/kimi-k3.toml").display(),
            configs.join("io/direct.toml").display()
        ),
    )
    .unwrap();
    let t = trunk.to_str().unwrap();
    let r = rc.to_str().unwrap();
    let base = [
        a,
        "--ids",
        "11,22",
        "--gen",
        "1",
        "--trunk",
        t,
        "--trunk-gb",
        &gb,
    ];
    for (extra, want) in [
        (&["--config", r][..], ", ring 3 x"),
        (&["--config", r, "--trunk-ring", "2"][..], ", ring 2 x"),
        (&[][..], ", ring 2 x"),
    ] {
        let out = tmp.path().join("o.json");
        let o = k3(&[&base[..], extra, &["--out", out.to_str().unwrap()]].concat());
        assert_eq!(code(&o), 0, "{extra:?}: {}", stderr(&o));
        assert!(stderr(&o).contains(want), "{extra:?}: {}", stderr(&o));
    }
}
