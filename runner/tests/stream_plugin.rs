//! Eviction-policy plugins: the example LRU plugin reproduces the built-in counters; ABI
//! version mismatches are refused; a misbehaving plugin falls back to the built-in LRU.

mod stream_support;

use std::ffi::c_char;

use k3_engine::checkpoint::Checkpoint;
use k3_engine::stream::experts::{EvictionPolicy, ExpertCache, ExpertCacheOptions};
use k3_engine::stream::plugin::{PluginPolicy, load_eviction_plugin};
use k3_engine::weights::ExpertSource;
use k3_models::spec::ModelSpec;
use k3_plugin_abi as abi;
use stream_support::*;

fn cache2<'c>(spec: &'c ModelSpec, ck: &Checkpoint) -> ExpertCache<'c> {
    let per = ExpertCache::new(spec, ck, &ExpertCacheOptions::default())
        .expect("store")
        .store()
        .expert_buf_bytes() as u64;
    let c = ExpertCache::new(
        spec,
        ck,
        &ExpertCacheOptions {
            budget_bytes: 2 * per,
            o_direct: true,
            read_threads: 2,
        },
    )
    .expect("cache");
    assert_eq!(c.capacity(), 2);
    c
}

/// The scripted sequence of stream_experts; returns (requests, hits, misses, evictions, resident).
fn script(c: &mut ExpertCache<'_>) -> (u64, u64, u64, u64, u64) {
    c.begin_token();
    c.experts(1, &[0, 1]).expect("experts");
    c.experts(2, &[0]).expect("experts");
    c.begin_token();
    c.experts(1, &[1]).expect("experts");
    c.experts(1, &[0, 1]).expect("experts");
    c.experts(1, &[0]).expect("experts");
    let s = c.stats();
    (s.requests, s.hits, s.misses, s.evictions, s.resident_hits)
}

#[test]
fn example_plugin_in_process_matches_builtin_lru() {
    let (_, spec, ck) = tiny_opened("plugin_in_process", 41);
    let mut builtin = cache2(&spec, &ck);
    let want = script(&mut builtin);
    assert_eq!(want, (7, 3, 4, 2, 2));

    let mut c = cache2(&spec, &ck);
    // SAFETY: the example plugin's entry returns its static v1 vtable.
    let p = unsafe {
        PluginPolicy::from_vtable(k3_plugin_lru_example::k3_eviction_policy_v1(), 2, "example")
    }
    .expect("plugin adopts");
    assert_eq!(p.name(), "plugin:lru-example");
    c.set_policy(Box::new(p));
    assert_eq!(script(&mut c), want);
    let lines = c.report_lines().join("\n");
    assert!(
        lines.contains("eviction policy plugin:lru-example"),
        "{lines}"
    );
    assert!(!lines.contains("FELL BACK"), "{lines}");
}

unsafe extern "C" fn bad_create(_c: u64, out: *mut abi::Handle) -> i32 {
    // SAFETY: host-provided out pointer.
    unsafe { *out = std::ptr::null_mut() };
    abi::OK
}
unsafe extern "C" fn bad_destroy(_h: abi::Handle) {}
unsafe extern "C" fn bad_event(_h: abi::Handle, _k: abi::ExpertKey, _s: u64) -> i32 {
    abi::OK
}
unsafe extern "C" fn bad_choose(
    _h: abi::Handle,
    _c: *const abi::Candidate,
    n: u64,
    out: *mut u64,
) -> i32 {
    // Out of range on purpose.
    // SAFETY: host-provided out pointer.
    unsafe { *out = n + 5 };
    abi::OK
}
unsafe extern "C" fn panicky_choose(
    _h: abi::Handle,
    _c: *const abi::Candidate,
    _n: u64,
    _out: *mut u64,
) -> i32 {
    abi::ERR_PANIC
}

const fn vtable(
    version: u32,
    choose: unsafe extern "C" fn(abi::Handle, *const abi::Candidate, u64, *mut u64) -> i32,
) -> abi::EvictionVTable {
    abi::EvictionVTable {
        abi_version: version,
        struct_size: abi::EVICTION_VTABLE_SIZE,
        name: c"bad".as_ptr() as *const c_char,
        create: bad_create,
        destroy: bad_destroy,
        on_access: bad_event,
        on_insert: bad_event,
        on_remove: bad_event,
        choose_victim: choose,
    }
}

static WRONG_VERSION: abi::EvictionVTable = vtable(99, bad_choose);
static OUT_OF_RANGE: abi::EvictionVTable = vtable(abi::ABI_VERSION, bad_choose);
static PANICKY: abi::EvictionVTable = vtable(abi::ABI_VERSION, panicky_choose);

#[test]
fn version_mismatch_is_refused_before_anything_else() {
    // SAFETY: a static vtable.
    let e = unsafe { PluginPolicy::from_vtable(&WRONG_VERSION, 2, "wrong.so") }.expect_err("v99");
    let msg = e.to_string();
    assert!(
        msg.contains("ABI version 99") && msg.contains("wrong.so"),
        "{msg}"
    );
    // SAFETY: null is allowed and refused.
    let e = unsafe { PluginPolicy::from_vtable(std::ptr::null(), 2, "null.so") }.expect_err("null");
    assert!(e.to_string().contains("null"), "{e}");
}

#[test]
fn misbehaving_plugins_fall_back_to_builtin_lru() {
    let (_, spec, ck) = tiny_opened("plugin_fallback", 42);
    for (vt, why) in [(&OUT_OF_RANGE, "index"), (&PANICKY, "panicked")] {
        let mut c = cache2(&spec, &ck);
        // SAFETY: static vtables following the ABI (except the deliberate bad answers).
        let p = unsafe { PluginPolicy::from_vtable(vt, 2, "bad.so") }.expect("adopts");
        c.set_policy(Box::new(p));
        assert_eq!(script(&mut c), (7, 3, 4, 2, 2), "fallback LRU is warm");
        let lines = c.report_lines().join("\n");
        assert!(
            lines.contains("FELL BACK") && lines.contains(why),
            "{lines}"
        );
    }
}

#[test]
fn the_built_example_library_loads_through_dlopen() {
    // Build the example cdylib (cargo builds only its rlib for this test's dependency graph)
    // into a separate target directory, so the outer cargo's lock is never contended.
    let manifest =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../plugins/lru-example/Cargo.toml");
    let target = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("stream-plugin-build");
    let status = std::process::Command::new(env!("CARGO"))
        .args(["build", "--quiet", "--manifest-path"])
        .arg(&manifest)
        .arg("--target-dir")
        .arg(&target)
        .env_remove("RUSTFLAGS")
        .status()
        .expect("cargo runs");
    assert!(status.success(), "building the example plugin failed");
    let lib = target.join("debug").join(format!(
        "{}k3_plugin_lru_example{}",
        std::env::consts::DLL_PREFIX,
        std::env::consts::DLL_SUFFIX
    ));
    assert!(lib.exists(), "{} was not built", lib.display());
    let mut p = load_eviction_plugin(&lib, 4).expect("plugin loads");
    assert_eq!(p.name(), "plugin:lru-example");
    p.on_insert((1, 0), 0);
    p.on_insert((1, 1), 1);
    p.on_access((1, 0), 0);
    assert_eq!(p.choose_victim(&[((1, 0), 0), ((1, 1), 1)]), 1);
    assert!(p.failure().is_none());
    let e = load_eviction_plugin(std::path::Path::new("/nonexistent/plugin.so"), 4)
        .expect_err("missing");
    assert!(e.to_string().contains("cannot load"), "{e}");
}
