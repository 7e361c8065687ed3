//! pack-trunk: contiguity refusal, determinism, layout, and what an incomplete pack looks like.

mod stream_support;

use std::path::PathBuf;

use k3_engine::stream::pack::{
    TRUNK_BIN, TRUNK_JSON, TrunkManifest, pack_trunk, trunk_decls_by_layer,
};
use k3_models::spec::ModelSpec;
use stream_support::*;

/// A fresh test directory with the tiny synthetic model (seed 5) packed raw into `dir/NAME`.
fn packed_tiny(test: &str, name: &str) -> (PathBuf, PathBuf, ModelSpec, PathBuf) {
    let dir = test_dir(test);
    let (model, spec) = synth_tiny(&dir, 5);
    let out = dir.join(name);
    pack_trunk(&model, &spec, &out, false).expect("pack");
    (dir, model, spec, out)
}

#[test]
fn pack_is_deterministic_aligned_and_byte_exact() {
    let dir = test_dir("pack_determinism");
    let (model, spec) = synth_tiny(&dir, 7);
    let a = dir.join("trunk_a");
    let b = dir.join("trunk_b");
    let ra = pack_trunk(&model, &spec, &a, false).expect("first pack");
    let rb = pack_trunk(&model, &spec, &b, false).expect("second pack");
    assert_eq!(ra.packed_bytes, rb.packed_bytes);
    for f in [TRUNK_BIN, TRUNK_JSON] {
        let x = std::fs::read(a.join(f)).expect("read a");
        let y = std::fs::read(b.join(f)).expect("read b");
        assert!(
            x == y,
            "{f} differs between two packs of the same checkpoint"
        );
    }
    // Packing again into the same directory replaces the pack with identical bytes.
    pack_trunk(&model, &spec, &a, false).expect("re-pack in place");
    assert_eq!(
        std::fs::read(a.join(TRUNK_BIN)).expect("read"),
        std::fs::read(b.join(TRUNK_BIN)).expect("read")
    );
    let names: Vec<String> = std::fs::read_dir(&a)
        .expect("list")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .collect();
    assert!(!names.iter().any(|n| n.contains("partial")), "{names:?}");

    // Layout: every layer 4096-aligned, exactly the checkpoint's bytes, tensors at their
    // recorded offsets; globals are not packed.
    let m = TrunkManifest::load(&a, &spec).expect("manifest loads and validates");
    let bin = std::fs::read(a.join(TRUNK_BIN)).expect("read bin");
    assert_eq!(bin.len() as u64, m.file_bytes);
    assert_eq!(m.file_bytes % 4096, 0);
    let ck = open_ckpt(&model, &spec);
    let mut sum = 0u64;
    for pl in &m.layers {
        assert_eq!(pl.offset % 4096, 0, "layer {}", pl.layer);
        let decls = &trunk_decls_by_layer(&spec)[pl.layer];
        assert_eq!(decls.len(), pl.tensors.len());
        for t in &pl.tensors {
            let got =
                &bin[(pl.offset + t.offset) as usize..(pl.offset + t.offset + t.size) as usize];
            let want = ck.try_bytes(&t.name).expect("tensor in checkpoint");
            assert!(got == want, "tensor {} differs in trunk.bin", t.name);
        }
        sum += pl.size;
    }
    assert_eq!(sum, m.packed_bytes);
    let trunk_decl_bytes: u64 = spec
        .tensors
        .iter()
        .filter(|t| t.layer.is_some() && t.expert.is_none())
        .map(|t| t.n_bytes() as u64)
        .sum();
    assert_eq!(
        m.packed_bytes, trunk_decl_bytes,
        "only trunk tensors are packed"
    );
    assert!(m.globals.iter().any(|g| g.role == "LmHead"));
    assert!(m.globals.iter().any(|g| g.role == "Embed"));
}

#[test]
fn a_hole_in_a_layer_range_is_refused_naming_layer_and_gap() {
    let dir = test_dir("pack_hole");
    let (model, spec) = synth_tiny(&dir, 3);
    let layer = 5usize;
    // Move one routed expert tensor of layer 5 between two of its trunk tensors.
    let trunk = trunk_decls_by_layer(&spec).swap_remove(layer);
    let first_trunk = &trunk[0].name;
    let shard = shard_of(&model, first_trunk);
    let mut tensors = read_safetensors(&shard);
    let prefix = format!("language_model.model.layers.{layer}.");
    let expert_pos = tensors
        .iter()
        .position(|t| t.0.starts_with(&prefix) && t.0.contains(".experts."))
        .expect("layer 5 has routed experts in its shard");
    let moved = tensors.remove(expert_pos);
    let moved_name = moved.0.clone();
    let trunk_pos = tensors
        .iter()
        .position(|t| t.0.starts_with(&prefix) && !t.0.contains(".experts."))
        .expect("layer 5 trunk tensor");
    tensors.insert(trunk_pos + 1, moved);
    write_safetensors(&shard, &tensors);

    let out = dir.join("trunk");
    let err = pack_trunk(&model, &spec, &out, false).expect_err("hole must be refused");
    let msg = err.to_string();
    eprintln!("{msg}");
    assert!(msg.contains("layer 5"), "{msg}");
    assert!(msg.contains("hole at bytes"), "{msg}");
    assert!(
        msg.contains(&moved_name),
        "the gap's content is named: {msg}"
    );
    assert!(
        !out.join(TRUNK_JSON).exists(),
        "a refused pack writes no trunk.json"
    );
    assert!(
        !out.join(TRUNK_BIN).exists(),
        "a refused pack writes no trunk.bin"
    );
}

#[test]
fn incomplete_or_mismatched_packs_are_refused_by_the_loader() {
    let (dir, _, spec, out) = packed_tiny("pack_incomplete", "trunk");
    // A pack interrupted before the final rename has only partial names: not a trunk.
    let partial = dir.join("partial");
    std::fs::create_dir_all(&partial).expect("mkdir");
    std::fs::copy(out.join(TRUNK_BIN), partial.join("trunk.bin.partial")).expect("copy");
    std::fs::copy(out.join(TRUNK_JSON), partial.join("trunk.json.partial")).expect("copy");
    let e = TrunkManifest::load(&partial, &spec).expect_err("partial pack");
    assert!(e.to_string().contains("did not finish"), "{e}");
    // A trunk.bin of the wrong length.
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(out.join(TRUNK_BIN))
        .expect("open");
    let len = f.metadata().expect("meta").len();
    f.set_len(len - 4096).expect("truncate");
    let e = TrunkManifest::load(&out, &spec).expect_err("short trunk.bin");
    assert!(e.to_string().contains("incomplete"), "{e}");
    // A manifest of a model with other tensors.
    let mut other = spec.clone();
    other.tensors.retain(|t| {
        !(t.layer == Some(2) && t.expert.is_none() && t.name.ends_with("input_layernorm.weight"))
    });
    let m: TrunkManifest =
        serde_json::from_slice(&std::fs::read(out.join(TRUNK_JSON)).expect("read")).expect("parse");
    let e = m.validate(&other).expect_err("spec mismatch");
    assert!(e.contains("layer 2"), "{e}");
}

/// `pack-trunk --compress`: deterministic, smaller, and every layer read back (pinned and
/// streamed) is the checkpoint's own bytes; a tampered chunk table or a damaged record is an
/// error naming the layer and chunk, never different bytes.
#[test]
fn compressed_pack_is_deterministic_and_reads_back_the_same_bytes() {
    use k3_engine::stream::pack::pack_trunk_with;
    use k3_engine::stream::trunk::{StreamedTrunk, TrunkOptions};
    use k3_engine::weights::TrunkSource;

    let dir = test_dir("pack_compressed");
    let (model, spec) = synth_tiny(&dir, 5);
    let cb = 8 << 10;
    let a = dir.join("z_a");
    let b = dir.join("z_b");
    let ra = pack_trunk_with(&model, &spec, &a, false, Some(cb)).expect("first pack");
    pack_trunk_with(&model, &spec, &b, false, Some(cb)).expect("second pack");
    for f in [TRUNK_BIN, TRUNK_JSON] {
        let x = std::fs::read(a.join(f)).expect("read a");
        let y = std::fs::read(b.join(f)).expect("read b");
        assert!(x == y, "{f} differs between two compressed packs");
    }
    let stored = ra
        .stored_bytes
        .expect("a compressed pack reports its stored bytes");
    assert!(
        stored * 10 < ra.packed_bytes * 9,
        "stored {stored} of {} layer bytes",
        ra.packed_bytes
    );
    assert!(pack_trunk_with(&model, &spec, &dir.join("bad"), false, Some(5000)).is_err());
    let m = TrunkManifest::load(&a, &spec).expect("manifest validates");
    assert_eq!(m.version, k3_engine::stream::pack::VERSION_COMPRESSED);
    assert!(m.layers.iter().all(|l| {
        l.stored
            .as_ref()
            .is_some_and(|s| s.chunks.len() == l.size.div_ceil(cb) as usize)
    }));

    // Every layer, pinned (budget for all) and streamed (one slot), equals the checkpoint.
    let ck = open_ckpt(&model, &spec);
    let one_slot = m
        .layer_sizes()
        .iter()
        .map(|s| s.next_multiple_of(4096))
        .max()
        .expect("layers");
    // A compressed trunk's records are decoded in place: the page-cache policy keeps its
    // pinned prefix in buffers, says so, and serves the same bytes.
    let opts = TrunkOptions {
        budget_bytes: 1 << 30,
        pinned_page_cache: true,
        ..TrunkOptions::default()
    };
    let mut t = StreamedTrunk::open(&a, &spec, &opts).expect("open compressed trunk");
    let lines = t.startup_lines().join("\n");
    assert!(
        lines.contains("pinned prefix in buffers, not the page cache: the trunk is compressed"),
        "{lines}"
    );
    assert!(!t.stats().pinned_page_cache);
    check_passes(&mut t, &spec, &ck, 1);
    drop(t);
    // The same with the pinned prefix loaded in the background: same bytes, same disk bytes.
    for budget in [1u64 << 30, one_slot] {
        let mut read = Vec::new();
        for background_pinned in [false, true] {
            let opts = TrunkOptions {
                budget_bytes: budget,
                ring_slots: 1,
                read_threads: 3,
                background_pinned,
                ..TrunkOptions::default()
            };
            let mut t = StreamedTrunk::open(&a, &spec, &opts).expect("open compressed trunk");
            check_passes(&mut t, &spec, &ck, 2);
            let st = t.stats();
            assert!(st.bytes_read > 0);
            assert_eq!(
                st.pinned_background,
                background_pinned && st.pinned_layers > 0
            );
            if budget == one_slot {
                assert!(st.pinned_layers < st.n_layers, "{st:?}");
            }
            read.push(st.bytes_read);
        }
        assert_eq!(
            read[0], read[1],
            "disk bytes, loaded in open vs in the background"
        );
    }

    // A tampered chunk table: a record offset that is not aligned.
    let json = std::fs::read_to_string(a.join(TRUNK_JSON)).expect("json");
    let mut v: serde_json::Value = serde_json::from_str(&json).expect("parse");
    let orig_at = v["layers"][1]["stored"]["chunks"][1]["at"].clone();
    v["layers"][1]["stored"]["chunks"][1]["at"] = serde_json::json!(4097);
    let bad = dir.join("z_badjson");
    std::fs::create_dir_all(&bad).expect("mkdir");
    std::fs::copy(a.join(TRUNK_BIN), bad.join(TRUNK_BIN)).expect("copy");
    std::fs::write(bad.join(TRUNK_JSON), v.to_string()).expect("write");
    let e = TrunkManifest::load(&bad, &spec).expect_err("misaligned record refused");
    assert!(e.to_string().contains("layer 1, chunk 1"), "{e}");
    // A record offset at the end of the u64 range: refused, no overflow.
    let last = v["layers"][1]["stored"]["chunks"]
        .as_array()
        .expect("chunks")
        .len()
        - 1;
    v["layers"][1]["stored"]["chunks"][1]["at"] = orig_at;
    v["layers"][1]["stored"]["chunks"][last]["at"] = serde_json::json!(u64::MAX - 4095);
    std::fs::write(bad.join(TRUNK_JSON), v.to_string()).expect("write");
    let e = TrunkManifest::load(&bad, &spec).expect_err("a record past any file refused");
    assert!(
        e.to_string().contains(&format!("layer 1, chunk {last}")),
        "{e}"
    );
    // A tensor offset at the end of the u64 range: refused by name (it wrapped and panicked
    // on the slice before).
    let mut v: serde_json::Value = serde_json::from_str(&json).expect("parse");
    let name = v["layers"][2]["tensors"][1]["name"].clone();
    v["layers"][2]["tensors"][1]["offset"] = serde_json::json!(u64::MAX - 1);
    std::fs::write(bad.join(TRUNK_JSON), v.to_string()).expect("write");
    let e = TrunkManifest::load(&bad, &spec).expect_err("a tensor past its layer refused");
    let name = name.as_str().expect("tensor name");
    assert!(
        e.to_string().contains("layer 2") && e.to_string().contains(name),
        "{e}"
    );

    // A damaged record: layer 1's first coded record.
    let pl = m.layers[1].clone();
    let s = pl.stored.as_ref().expect("stored");
    let (k, ch) = s
        .chunks
        .iter()
        .enumerate()
        .find(|(_, c)| c.z)
        .expect("a coded record in layer 1");
    // The footer's exception count.
    let pos = (pl.offset + ch.at + ch.len) as usize - 20;
    let mut bin = std::fs::read(a.join(TRUNK_BIN)).expect("bin");
    bin[pos] ^= 0x01;
    let dmg = dir.join("z_damaged");
    std::fs::create_dir_all(&dmg).expect("mkdir");
    std::fs::write(dmg.join(TRUNK_BIN), &bin).expect("write");
    std::fs::copy(a.join(TRUNK_JSON), dmg.join(TRUNK_JSON)).expect("copy");
    let opts = TrunkOptions {
        budget_bytes: 1 << 30,
        ..TrunkOptions::default()
    };
    let names_the_record = |msg: String| {
        assert!(
            msg.contains(&format!("layer 1, chunk {k}")) && msg.contains("damaged"),
            "{msg}"
        );
    };
    let e = StreamedTrunk::open(&dmg, &spec, &opts)
        .map(|_| ())
        .expect_err("a damaged record is an error");
    names_the_record(e.to_string());
    // Loaded in the background, the same error comes when layer 1 is asked for; layer 0 is
    // served.
    let opts = TrunkOptions {
        background_pinned: true,
        ..opts
    };
    let mut t = StreamedTrunk::open(&dmg, &spec, &opts).expect("opens: the load runs after");
    t.layer(0).expect("layer 0 is intact");
    let e = t
        .layer(1)
        .map(|_| ())
        .expect_err("a damaged record is an error");
    names_the_record(e.to_string());
}

/// A trunk.bin that is no regular file (a directory, a FIFO) is said to be that, not an
/// "incomplete" pack of 4096 or 0 bytes; a trunk.json that is a FIFO is refused, not read
/// forever.
#[test]
fn a_trunk_bin_that_is_not_a_regular_file_is_said_to_be_that() {
    let (_, _, spec, out) = packed_tiny("pack_bin_not_regular", "trunk");
    let bin = out.join(TRUNK_BIN);
    std::fs::remove_file(&bin).expect("rm trunk.bin");
    std::fs::create_dir(&bin).expect("trunk.bin as a directory");
    let e = TrunkManifest::load(&out, &spec)
        .expect_err("directory trunk.bin")
        .to_string();
    assert!(
        e.contains(bin.to_str().unwrap()) && e.contains("is a directory, not a regular file"),
        "{e}"
    );
    assert!(!e.contains("incomplete"), "{e}");
    std::fs::remove_dir(&bin).expect("rmdir");
    let made = std::process::Command::new("mkfifo")
        .arg(&bin)
        .status()
        .expect("mkfifo");
    assert!(made.success());
    let e = TrunkManifest::load(&out, &spec)
        .expect_err("FIFO trunk.bin")
        .to_string();
    assert!(
        e.contains("is a FIFO") && e.contains("not a regular file"),
        "{e}"
    );
    let json = out.join(TRUNK_JSON);
    std::fs::remove_file(&json).expect("rm trunk.json");
    let made = std::process::Command::new("mkfifo")
        .arg(&json)
        .status()
        .expect("mkfifo");
    assert!(made.success());
    let e = TrunkManifest::load(&out, &spec)
        .expect_err("FIFO trunk.json")
        .to_string();
    assert!(
        e.contains(json.to_str().unwrap()) && e.contains("is a FIFO"),
        "{e}"
    );
}

/// trunk.json's derivable summary fields must agree with the layers they summarise, and
/// `model` with the model being run: a mismatch refuses the trunk naming the field.
#[test]
fn trunk_json_summary_fields_are_checked() {
    use k3_engine::stream::pack::pack_trunk_with;
    let (dir, model, spec, raw) = packed_tiny("pack_summary_fields", "raw");
    let z = dir.join("z");
    pack_trunk_with(&model, &spec, &z, false, Some(8 << 10)).expect("compressed pack");
    let read = |d: &std::path::Path| -> TrunkManifest {
        serde_json::from_slice(&std::fs::read(d.join(TRUNK_JSON)).expect("read")).expect("parse")
    };
    let good = read(&raw);
    good.validate(&spec).expect("the pack as written validates");
    let good_z = read(&z);
    good_z
        .validate(&spec)
        .expect("the compressed pack validates");

    let mut m = good.clone();
    m.packed_bytes += 1;
    let e = m.validate(&spec).expect_err("packed_bytes + 1");
    assert!(e.contains("packed_bytes"), "{e}");

    let mut m = good.clone();
    m.model = "some-other-model".into();
    let e = m.validate(&spec).expect_err("model");
    assert!(e.contains("model") && e.contains("some-other-model"), "{e}");

    let mut m = good.clone();
    m.layers[2].size += 1;
    m.packed_bytes += 1;
    let e = m.validate(&spec).expect_err("layer size + 1");
    assert!(e.contains("layer 2") && e.contains("size"), "{e}");

    let mut m = good_z.clone();
    m.compression.as_mut().expect("compressed").stored_bytes += 1;
    let e = m.validate(&spec).expect_err("stored_bytes + 1");
    assert!(e.contains("stored_bytes"), "{e}");

    // Through load, from the files: the refusal names trunk.json.
    let mut m = good;
    m.packed_bytes -= 1;
    std::fs::write(raw.join(TRUNK_JSON), serde_json::to_vec(&m).expect("json")).expect("write");
    let e = TrunkManifest::load(&raw, &spec)
        .expect_err("load refuses")
        .to_string();
    assert!(e.contains(TRUNK_JSON) && e.contains("packed_bytes"), "{e}");
}

#[test]
fn a_check_stopped_before_its_first_layer_says_so_and_compares_nothing() {
    use k3_engine::stream::check::check_trunk;
    use std::sync::atomic::AtomicBool;
    let (_dir, model, spec, trunk) = packed_tiny("check_stopped", "trunk");
    let n = TrunkManifest::load(&trunk, &spec)
        .expect("manifest")
        .layers
        .len();
    // not stopped: every layer compared, every tensor equal
    let r = check_trunk(&model, &spec, &trunk, &AtomicBool::new(false), false).expect("check");
    assert!(!r.interrupted);
    assert_eq!((r.layers, r.layers_checked, r.n_problems), (n, n, 0));
    assert!(r.tensors_checked > 0 && r.bytes_checked > 0);
    // Ctrl-C already pressed (the flag `k3-run pack-trunk --check` passes): the report says
    // interrupted, with no layer counted as checked, so the command cannot claim a match
    let r = check_trunk(&model, &spec, &trunk, &AtomicBool::new(true), false).expect("check");
    assert!(r.interrupted);
    assert_eq!((r.layers, r.layers_checked, r.n_problems), (n, 0, 0));
    assert_eq!((r.tensors_checked, r.bytes_checked), (0, 0));
}
