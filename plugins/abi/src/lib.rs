//! k3-plugin-abi: the stable C ABI between k3-run and its plugins.
//!
//! Two generations live here, both loadable by the host:
//! - **version 2** (current, [`PLUGIN_ABI_VERSION`]): one entry symbol, [`PLUGIN_ENTRY`]
//!   (`k3_plugin_entry`), negotiated by version, returning a [`PluginDescriptor`] for one of
//!   two kinds: an expert-cache policy ([`CachePolicyVTable`]) or a speculative-draft provider
//!   ([`DraftProviderVTable`]). Write one in Rust with the [`CachePolicy`] / [`DraftProvider`]
//!   traits and [`export_cache_policy!`] / [`export_draft_provider!`], which catch every panic
//!   at the boundary. docs/PLUGINS.md is the reference.
//! - **version 1** (below, kept loading unchanged): the eviction-only vtable behind
//!   `k3_eviction_policy_v1`.
//!
//! Owns: `#[repr(C)]` types, the ABI version, the exported symbol names and the result codes.
//! Must not: depend on anything (plugins build against this crate alone), carry Rust-only
//! types (trait objects, `String`, `Vec`) across the boundary, or change a published layout:
//! a new version appends fields (`struct_size` tells the host how much the plugin filled) or
//! adds a new entry symbol.
//! Follows upstream: rust-deps.md Q5 — plain C ABI with a versioned vtable, the host checks the
//! version first, every plugin entry point catches panics (`catch_unwind`) because a panic
//! crossing `extern "C"` aborts the host, memory never crosses the boundary (the plugin frees
//! what it allocates), and libraries are never unloaded.
//!
//! # Expert-cache eviction policy (version 1)
//!
//! A plugin exports `extern "C" fn k3_eviction_policy_v1() -> *const EvictionVTable` (see
//! [`EVICTION_ENTRY`]) returning a pointer to a `static` vtable. The host:
//! 1. reads `abi_version` (offset 0, always a `u32`) and refuses anything but [`ABI_VERSION`];
//! 2. checks `struct_size >= size_of::<EvictionVTable>()`;
//! 3. calls `create(capacity, &mut handle)` once, then `on_access` / `on_insert` / `on_remove`
//!    / `choose_victim` from one thread at a time, and `destroy(handle)` at the end.
//!
//! Every function returns [`OK`] or a negative code ([`ERR_PANIC`] if the plugin caught a
//! panic, [`ERR_INVALID`] for bad arguments, [`ERR_OTHER`]). On any error the host stops using
//! the plugin for the rest of the run and continues with its built-in LRU: an eviction policy
//! only decides which reads happen, never which bytes are served, so output is unaffected.
//! `choose_victim` must be deterministic (same calls, same answers) and write an index
//! `< n` into `*out_index`.

use std::ffi::{CStr, c_char, c_void};

/// Version of every vtable in this crate.
pub const ABI_VERSION: u32 = 1;

/// Symbol a policy plugin exports (type [`EvictionEntryFn`]).
pub const EVICTION_ENTRY: &CStr = c"k3_eviction_policy_v1";

pub const OK: i32 = 0;
/// The plugin caught a panic in this call.
pub const ERR_PANIC: i32 = -1;
/// An argument was invalid (null pointer, n = 0, unknown handle).
pub const ERR_INVALID: i32 = -2;
/// Any other failure.
pub const ERR_OTHER: i32 = -3;

/// (layer, routed expert id).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ExpertKey {
    pub layer: u32,
    pub expert: u32,
}

/// A resident expert the policy may evict, and the cache slot holding it.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Candidate {
    pub key: ExpertKey,
    pub slot: u64,
}

/// Opaque plugin state.
pub type Handle = *mut c_void;

/// The eviction-policy vtable, version 1.
#[repr(C)]
#[derive(Debug)]
pub struct EvictionVTable {
    /// Must be [`ABI_VERSION`]; read first.
    pub abi_version: u32,
    /// `size_of::<EvictionVTable>()` as the plugin was built.
    pub struct_size: u32,
    /// NUL-terminated static policy name.
    pub name: *const c_char,
    /// Create state for a cache of `capacity` slots; writes the handle to `*out`.
    pub create: unsafe extern "C" fn(capacity: u64, out: *mut Handle) -> i32,
    /// Free the state.
    pub destroy: unsafe extern "C" fn(handle: Handle),
    /// A request was served from `slot`.
    pub on_access: unsafe extern "C" fn(handle: Handle, key: ExpertKey, slot: u64) -> i32,
    /// `key` was loaded into `slot`.
    pub on_insert: unsafe extern "C" fn(handle: Handle, key: ExpertKey, slot: u64) -> i32,
    /// `key` left `slot`.
    pub on_remove: unsafe extern "C" fn(handle: Handle, key: ExpertKey, slot: u64) -> i32,
    /// Choose a victim among `n >= 1` candidates; write its index to `*out_index`.
    pub choose_victim: unsafe extern "C" fn(
        handle: Handle,
        candidates: *const Candidate,
        n: u64,
        out_index: *mut u64,
    ) -> i32,
}

// SAFETY: the vtable is immutable static data (function pointers and a pointer to a static
// NUL-terminated string), so sharing references between threads is sound.
unsafe impl Sync for EvictionVTable {}

/// Type of the [`EVICTION_ENTRY`] symbol.
pub type EvictionEntryFn = unsafe extern "C" fn() -> *const EvictionVTable;

/// `size_of::<EvictionVTable>()` as a `u32`, for `struct_size`.
pub const EVICTION_VTABLE_SIZE: u32 = std::mem::size_of::<EvictionVTable>() as u32;

mod v2;
pub use v2::*;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_is_stable() {
        // Fields are u32, u32, then seven pointers: any change here is an ABI break.
        let p = std::mem::size_of::<usize>();
        assert_eq!(std::mem::size_of::<EvictionVTable>(), 8 + 7 * p);
        assert_eq!(std::mem::offset_of!(EvictionVTable, abi_version), 0);
        assert_eq!(std::mem::offset_of!(EvictionVTable, struct_size), 4);
        assert_eq!(std::mem::offset_of!(EvictionVTable, name), 8);
        assert_eq!(std::mem::size_of::<ExpertKey>(), 8);
        assert_eq!(std::mem::size_of::<Candidate>(), 16);
        assert_eq!(EVICTION_ENTRY.to_bytes(), b"k3_eviction_policy_v1");
    }
}
