//! An example expert-cache eviction plugin: least recently used, as a shared library.
//!
//! Owns: one implementation of the `k3-plugin-abi` eviction vtable (version 1), exported as
//! `k3_eviction_policy_v1`. Must not: let a panic cross `extern "C"` (every entry point runs
//! inside `catch_unwind` and returns `ERR_PANIC` instead), or hand memory to the host.
//! Follows upstream: rust-deps.md Q5. Its choices equal the host's built-in LRU (least recently
//! accessed; ties to the lowest slot), so a run with this plugin reports the same counters.
//!
//! Build: `cargo build -p k3-plugin-lru-example` gives `target/debug/libk3_plugin_lru_example.so`.

use std::collections::HashMap;
use std::panic::{AssertUnwindSafe, catch_unwind};

use k3_plugin_abi::{
    ABI_VERSION, Candidate, ERR_INVALID, ERR_PANIC, EVICTION_VTABLE_SIZE, EvictionVTable,
    ExpertKey, Handle, OK,
};

#[derive(Default)]
struct Lru {
    clock: u64,
    last_use: HashMap<u64, u64>,
}

fn guard(f: impl FnOnce() -> i32) -> i32 {
    catch_unwind(AssertUnwindSafe(f)).unwrap_or(ERR_PANIC)
}

/// # Safety
/// `handle` must come from `create` and not be destroyed.
unsafe fn state<'a>(handle: Handle) -> Option<&'a mut Lru> {
    // SAFETY: per the ABI contract the host passes the handle `create` returned, from one
    // thread at a time.
    unsafe { (handle as *mut Lru).as_mut() }
}

unsafe extern "C" fn create(_capacity: u64, out: *mut Handle) -> i32 {
    guard(|| {
        if out.is_null() {
            return ERR_INVALID;
        }
        let h = Box::into_raw(Box::new(Lru::default())) as Handle;
        // SAFETY: `out` is non-null and points to a host-owned Handle.
        unsafe { *out = h };
        OK
    })
}

unsafe extern "C" fn destroy(handle: Handle) {
    let _ = guard(|| {
        if !handle.is_null() {
            // SAFETY: the handle came from Box::into_raw in `create`; destroyed once.
            drop(unsafe { Box::from_raw(handle as *mut Lru) });
        }
        OK
    });
}

unsafe extern "C" fn on_access(handle: Handle, _key: ExpertKey, slot: u64) -> i32 {
    guard(|| {
        // SAFETY: see `state`.
        let Some(s) = (unsafe { state(handle) }) else {
            return ERR_INVALID;
        };
        s.clock += 1;
        s.last_use.insert(slot, s.clock);
        OK
    })
}

unsafe extern "C" fn on_insert(handle: Handle, key: ExpertKey, slot: u64) -> i32 {
    // SAFETY: same contract as on_access.
    unsafe { on_access(handle, key, slot) }
}

unsafe extern "C" fn on_remove(handle: Handle, _key: ExpertKey, slot: u64) -> i32 {
    guard(|| {
        // SAFETY: see `state`.
        let Some(s) = (unsafe { state(handle) }) else {
            return ERR_INVALID;
        };
        s.last_use.remove(&slot);
        OK
    })
}

unsafe extern "C" fn choose_victim(
    handle: Handle,
    candidates: *const Candidate,
    n: u64,
    out_index: *mut u64,
) -> i32 {
    guard(|| {
        // SAFETY: see `state`.
        let Some(s) = (unsafe { state(handle) }) else {
            return ERR_INVALID;
        };
        if candidates.is_null() || out_index.is_null() || n == 0 {
            return ERR_INVALID;
        }
        let Ok(n) = usize::try_from(n) else {
            return ERR_INVALID;
        };
        // SAFETY: the host passes `n` valid candidates.
        let c = unsafe { std::slice::from_raw_parts(candidates, n) };
        let best = c
            .iter()
            .enumerate()
            .min_by_key(|(_, c)| (s.last_use.get(&c.slot).copied().unwrap_or(0), c.slot))
            .map_or(0, |(i, _)| i as u64);
        // SAFETY: `out_index` is non-null and host-owned.
        unsafe { *out_index = best };
        OK
    })
}

static VTABLE: EvictionVTable = EvictionVTable {
    abi_version: ABI_VERSION,
    struct_size: EVICTION_VTABLE_SIZE,
    name: c"lru-example".as_ptr(),
    create,
    destroy,
    on_access,
    on_insert,
    on_remove,
    choose_victim,
};

/// The plugin entry point the host looks up by name.
#[unsafe(no_mangle)]
pub extern "C" fn k3_eviction_policy_v1() -> *const EvictionVTable {
    &VTABLE
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lru_choice_and_errors() {
        let vt = k3_eviction_policy_v1();
        // SAFETY: the vtable is our own static.
        let vt = unsafe { &*vt };
        assert_eq!(vt.abi_version, ABI_VERSION);
        let mut h: Handle = std::ptr::null_mut();
        // SAFETY: valid out pointer; handle used and destroyed below.
        unsafe {
            assert_eq!((vt.create)(4, &mut h), OK);
            let k = |e| ExpertKey {
                layer: 1,
                expert: e,
            };
            assert_eq!((vt.on_insert)(h, k(0), 0), OK);
            assert_eq!((vt.on_insert)(h, k(1), 1), OK);
            assert_eq!((vt.on_access)(h, k(0), 0), OK);
            let cands = [
                Candidate { key: k(0), slot: 0 },
                Candidate { key: k(1), slot: 1 },
            ];
            let mut out = 99u64;
            assert_eq!((vt.choose_victim)(h, cands.as_ptr(), 2, &mut out), OK);
            assert_eq!(out, 1, "slot 1 was used least recently");
            assert_eq!(
                (vt.choose_victim)(h, cands.as_ptr(), 0, &mut out),
                ERR_INVALID
            );
            assert_eq!((vt.on_access)(std::ptr::null_mut(), k(0), 0), ERR_INVALID);
            (vt.destroy)(h);
        }
    }
}
