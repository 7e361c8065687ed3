//! ABI version 2: one negotiated entry point, two plugin kinds, and the Rust-side template.
//!
//! The host resolves [`PLUGIN_ENTRY`] (type [`PluginEntryFn`]) and calls it with the highest
//! version it speaks. The plugin answers with a pointer to a `static` [`PluginDescriptor`]
//! whose `abi_version` is the version it chose (at most the host's; a plugin that cannot
//! speak any version the host offers answers with its own and the host refuses it, naming
//! both). `struct_size` fields let a later minor revision append fields: the host reads only
//! what the plugin says it filled, and a plugin built against an older revision is accepted
//! as long as the fields of its version are there.
//!
//! Every callback returns [`OK`] (or a documented positive reply) or a negative error code;
//! [`ERR_PANIC`] means the plugin caught a panic. Callbacks of one instance come from one
//! thread at a time. Memory never crosses the boundary: the host owns every buffer it passes
//! (candidates, context, output arrays, the error buffer of `create`) and the plugin owns its
//! state behind the handle, freed by `destroy`.

use std::ffi::{CStr, c_char};
use std::panic::{AssertUnwindSafe, catch_unwind};

use crate::{Candidate, ERR_INVALID, ERR_OTHER, ERR_PANIC, Handle, OK};

/// The version of the unified entry point (version 1 is the eviction-only vtable).
pub const PLUGIN_ABI_VERSION: u32 = 2;
/// The oldest version of the unified entry point a host of this crate accepts.
pub const PLUGIN_ABI_MIN_VERSION: u32 = 2;

/// Symbol every version-2 plugin exports (type [`PluginEntryFn`]).
pub const PLUGIN_ENTRY: &CStr = c"k3_plugin_entry";

/// Type of the [`PLUGIN_ENTRY`] symbol: the host passes the highest ABI version it speaks.
pub type PluginEntryFn = unsafe extern "C" fn(host_version: u32) -> *const PluginDescriptor;

/// [`PluginDescriptor::kind`]: an expert-cache policy ([`CachePolicyVTable`]).
pub const KIND_CACHE_POLICY: u32 = 1;
/// [`PluginDescriptor::kind`]: a speculative-draft provider ([`DraftProviderVTable`]).
pub const KIND_DRAFT_PROVIDER: u32 = 2;

/// What a plugin is. One descriptor per library.
#[repr(C)]
#[derive(Debug)]
pub struct PluginDescriptor {
    /// The version the plugin chose; read first.
    pub abi_version: u32,
    /// `size_of::<PluginDescriptor>()` as the plugin was built.
    pub struct_size: u32,
    /// [`KIND_CACHE_POLICY`] or [`KIND_DRAFT_PROVIDER`].
    pub kind: u32,
    pub reserved: u32,
    /// NUL-terminated static name (short, no spaces).
    pub name: *const c_char,
    /// NUL-terminated static one-line description (may be null).
    pub description: *const c_char,
    /// Non-null iff `kind == KIND_CACHE_POLICY`.
    pub cache_policy: *const CachePolicyVTable,
    /// Non-null iff `kind == KIND_DRAFT_PROVIDER`.
    pub draft_provider: *const DraftProviderVTable,
}

// SAFETY: immutable static data (pointers to static strings and static vtables).
unsafe impl Sync for PluginDescriptor {}

/// `size_of::<PluginDescriptor>()` as a `u32`.
pub const DESCRIPTOR_SIZE: u32 = std::mem::size_of::<PluginDescriptor>() as u32;

/// How the host describes the cache to a policy at `create`.
#[repr(C)]
#[derive(Debug)]
pub struct CacheConfig {
    /// `size_of::<CacheConfig>()` as the host was built.
    pub struct_size: u32,
    /// Layers of the model (routed-expert layer ids are below this).
    pub n_layers: u32,
    /// Experts the cache holds.
    pub capacity: u64,
    /// Bytes one cached expert occupies.
    pub expert_bytes: u64,
    /// Routed experts per layer.
    pub n_experts: u32,
    /// Experts each token routes to per layer.
    pub top_k: u32,
    /// NUL-terminated `key=value` lines (`--plugin-opt`), never null, possibly empty.
    pub options: *const c_char,
}

/// `size_of::<CacheConfig>()` as a `u32`.
pub const CACHE_CONFIG_SIZE: u32 = std::mem::size_of::<CacheConfig>() as u32;

/// [`CacheEvent::kind`]: `(layer, expert)` was asked for (before the hit or the miss).
pub const EV_REQUEST: u32 = 1;
/// A request was served from `slot` (the expert was resident).
pub const EV_HIT: u32 = 2;
/// `(layer, expert)` was loaded into `slot` (a miss, or a read-ahead that landed).
pub const EV_INSERT: u32 = 3;
/// `(layer, expert)` left `slot` (evicted, a wasted read-ahead dropped, or a failed load).
pub const EV_EVICT: u32 = 4;
/// A token (one forward pass) starts; `seq` is its number. `layer`/`expert`/`slot` are 0.
pub const EV_TOKEN: u32 = 5;

/// Reply of `on_event` to a [`EV_HIT`] or [`EV_INSERT`]: keep this expert; the host stops
/// offering it as a victim. The host grants at most half the capacity in pins (a refused pin
/// is reported once) and ignores pins when nothing else could be evicted.
pub const REPLY_PIN: i32 = 1;
/// Reply to any event naming an expert: it may be offered as a victim again.
pub const REPLY_UNPIN: i32 = 2;

/// One cache event. Unknown kinds (from a newer host) must be ignored with [`OK`].
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CacheEvent {
    pub kind: u32,
    pub layer: u32,
    pub expert: u32,
    pub reserved: u32,
    /// The cache slot (hit, insert, evict), else 0.
    pub slot: u64,
    /// Bytes the expert occupies in the cache (the config's `expert_bytes`), else 0.
    pub bytes: u64,
    /// Requests so far including this one ([`EV_REQUEST`]), the token number ([`EV_TOKEN`]).
    pub seq: u64,
}

/// The expert-cache policy vtable (kind [`KIND_CACHE_POLICY`]).
#[repr(C)]
#[derive(Debug)]
pub struct CachePolicyVTable {
    /// `size_of::<CachePolicyVTable>()` as the plugin was built.
    pub struct_size: u32,
    pub reserved: u32,
    /// Create an instance; on failure return an error code and write a NUL-terminated reason
    /// of at most `err_len` bytes (including the NUL) to `err`.
    pub create: unsafe extern "C" fn(
        cfg: *const CacheConfig,
        out: *mut Handle,
        err: *mut c_char,
        err_len: u64,
    ) -> i32,
    pub destroy: unsafe extern "C" fn(handle: Handle),
    /// One event; returns [`OK`], [`REPLY_PIN`], [`REPLY_UNPIN`] or an error code.
    pub on_event: unsafe extern "C" fn(handle: Handle, ev: *const CacheEvent) -> i32,
    /// Choose a victim among `n >= 1` resident candidates; write its index to `*out_index`.
    /// Must be deterministic.
    pub choose_victim: unsafe extern "C" fn(
        handle: Handle,
        candidates: *const Candidate,
        n: u64,
        out_index: *mut u64,
    ) -> i32,
}

// SAFETY: immutable static data (function pointers).
unsafe impl Sync for CachePolicyVTable {}

pub const CACHE_POLICY_VTABLE_SIZE: u32 = std::mem::size_of::<CachePolicyVTable>() as u32;

/// How the host describes speculation to a draft provider at `create`.
#[repr(C)]
#[derive(Debug)]
pub struct DraftConfig {
    pub struct_size: u32,
    /// Token ids are below this; the host refuses any proposal at or above it.
    pub vocab_size: u32,
    /// Most tokens the host will ever ask for in one proposal.
    pub max_draft: u32,
    pub reserved: u32,
    /// NUL-terminated `key=value` lines (`--plugin-opt`), never null, possibly empty.
    pub options: *const c_char,
}

pub const DRAFT_CONFIG_SIZE: u32 = std::mem::size_of::<DraftConfig>() as u32;

/// The draft-provider vtable (kind [`KIND_DRAFT_PROVIDER`]).
#[repr(C)]
#[derive(Debug)]
pub struct DraftProviderVTable {
    pub struct_size: u32,
    pub reserved: u32,
    /// As [`CachePolicyVTable::create`].
    pub create: unsafe extern "C" fn(
        cfg: *const DraftConfig,
        out: *mut Handle,
        err: *mut c_char,
        err_len: u64,
    ) -> i32,
    pub destroy: unsafe extern "C" fn(handle: Handle),
    /// Propose up to `k` next tokens after `context` (every token id so far, prompt first):
    /// write them to `out` (room for `k`) and their number to `*out_n` (0 = no guess).
    pub propose: unsafe extern "C" fn(
        handle: Handle,
        context: *const u32,
        n_context: u64,
        k: u32,
        out: *mut u32,
        out_n: *mut u32,
    ) -> i32,
    /// The verdict on the last proposal: its first `accepted` of `proposed` tokens were what
    /// the model chose.
    pub on_result: unsafe extern "C" fn(handle: Handle, proposed: u32, accepted: u32) -> i32,
}

// SAFETY: immutable static data (function pointers).
unsafe impl Sync for DraftProviderVTable {}

pub const DRAFT_PROVIDER_VTABLE_SIZE: u32 = std::mem::size_of::<DraftProviderVTable>() as u32;

// ---------------------------------------------------------------------------------------------
// Plugin-side template: implement a trait, call one macro. Every entry point runs inside
// `catch_unwind`, so a panicking plugin returns ERR_PANIC instead of aborting the host.

/// `key=value` options as the plugin receives them.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Options(pub Vec<(String, String)>);

impl Options {
    /// Parse `key=value` lines (a line without `=` is a key with an empty value).
    pub fn parse(text: &str) -> Options {
        Options(
            text.lines()
                .map(str::trim)
                .filter(|l| !l.is_empty())
                .map(|l| match l.split_once('=') {
                    Some((k, v)) => (k.trim().to_string(), v.trim().to_string()),
                    None => (l.to_string(), String::new()),
                })
                .collect(),
        )
    }

    /// # Safety
    /// `p` is null or a NUL-terminated string.
    unsafe fn from_ptr(p: *const c_char) -> Options {
        if p.is_null() {
            return Options::default();
        }
        // SAFETY: per the caller.
        Options::parse(&unsafe { CStr::from_ptr(p) }.to_string_lossy())
    }

    /// The last value given for `key`.
    pub fn get(&self, key: &str) -> Option<&str> {
        self.0
            .iter()
            .rev()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }

    /// `key` parsed as a number, `default` when absent; an error naming the key otherwise.
    pub fn number<T: std::str::FromStr>(&self, key: &str, default: T) -> Result<T, String> {
        match self.get(key) {
            None => Ok(default),
            Some(v) => v
                .parse()
                .map_err(|_| format!("option {key}={v}: not a valid number")),
        }
    }
}

/// The cache as a policy sees it at creation.
#[derive(Clone, Debug)]
pub struct CacheSetup {
    pub capacity: u64,
    pub expert_bytes: u64,
    pub n_layers: u32,
    pub n_experts: u32,
    pub top_k: u32,
    pub options: Options,
}

/// A cache policy written in Rust; export it with [`export_cache_policy!`].
pub trait CachePolicy: Sized {
    /// A new instance, or why not (shown to the user).
    fn create(setup: &CacheSetup) -> Result<Self, String>;
    /// One event; return [`OK`], [`REPLY_PIN`] or [`REPLY_UNPIN`].
    fn on_event(&mut self, ev: &CacheEvent) -> i32;
    /// An index into `candidates` (never empty).
    fn choose_victim(&mut self, candidates: &[Candidate]) -> usize;
}

/// Speculation as a draft provider sees it at creation.
#[derive(Clone, Debug)]
pub struct DraftSetup {
    pub vocab_size: u32,
    pub max_draft: u32,
    pub options: Options,
}

/// A draft provider written in Rust; export it with [`export_draft_provider!`].
pub trait DraftProvider: Sized {
    fn create(setup: &DraftSetup) -> Result<Self, String>;
    /// Push up to `k` proposed next tokens after `context` onto `out` (extra ones are cut).
    fn propose(&mut self, context: &[u32], k: usize, out: &mut Vec<u32>);
    /// The first `accepted` of the last `proposed` tokens held.
    fn on_result(&mut self, _proposed: usize, _accepted: usize) {}
}

/// Run `f`, turning a panic into [`ERR_PANIC`].
pub fn guard(f: impl FnOnce() -> i32) -> i32 {
    catch_unwind(AssertUnwindSafe(f)).unwrap_or(ERR_PANIC)
}

/// Write `msg` NUL-terminated into the host's buffer (cut to fit).
///
/// # Safety
/// `err` is null or points to `err_len` writable bytes.
unsafe fn write_err(err: *mut c_char, err_len: u64, msg: &str) {
    let Ok(len) = usize::try_from(err_len) else {
        return;
    };
    if err.is_null() || len == 0 {
        return;
    }
    let mut n = msg.len().min(len - 1);
    while !msg.is_char_boundary(n) {
        n -= 1;
    }
    // SAFETY: `n + 1 <= len` bytes of the host buffer.
    unsafe {
        std::ptr::copy_nonoverlapping(msg.as_ptr() as *const c_char, err, n);
        *err.add(n) = 0;
    }
}

/// Glue the macros instantiate; not part of the stable surface.
#[doc(hidden)]
pub mod glue {
    use super::*;

    /// Box a created instance into a handle, or report why not.
    unsafe fn finish<T>(
        made: Result<T, String>,
        out: *mut Handle,
        err: *mut c_char,
        err_len: u64,
    ) -> i32 {
        match made {
            Ok(t) => {
                // SAFETY: `out` is non-null (checked by callers).
                unsafe { *out = Box::into_raw(Box::new(t)) as Handle };
                OK
            }
            Err(msg) => {
                // SAFETY: host error buffer per the ABI.
                unsafe { write_err(err, err_len, &msg) };
                ERR_OTHER
            }
        }
    }

    /// # Safety
    /// ABI contract of [`CachePolicyVTable::create`].
    pub unsafe extern "C" fn cache_create<T: CachePolicy>(
        cfg: *const CacheConfig,
        out: *mut Handle,
        err: *mut c_char,
        err_len: u64,
    ) -> i32 {
        let rc = guard(|| {
            if cfg.is_null() || out.is_null() {
                return ERR_INVALID;
            }
            // SAFETY: non-null host config.
            let c = unsafe { &*cfg };
            if c.struct_size < CACHE_CONFIG_SIZE {
                // SAFETY: host error buffer.
                unsafe { write_err(err, err_len, "cache config from an older host is too short") };
                return ERR_INVALID;
            }
            let setup = CacheSetup {
                capacity: c.capacity,
                expert_bytes: c.expert_bytes,
                n_layers: c.n_layers,
                n_experts: c.n_experts,
                top_k: c.top_k,
                // SAFETY: NUL-terminated per the ABI.
                options: unsafe { Options::from_ptr(c.options) },
            };
            // SAFETY: out checked above.
            unsafe { finish(T::create(&setup), out, err, err_len) }
        });
        if rc == ERR_PANIC {
            // SAFETY: host error buffer.
            unsafe { write_err(err, err_len, "create panicked") };
        }
        rc
    }

    /// # Safety
    /// `handle` came from `cache_create::<T>` / `draft_create::<T>` and is destroyed once.
    pub unsafe extern "C" fn destroy<T>(handle: Handle) {
        let _ = guard(|| {
            if !handle.is_null() {
                // SAFETY: per the contract.
                drop(unsafe { Box::from_raw(handle as *mut T) });
            }
            OK
        });
    }

    /// # Safety
    /// ABI contract of [`CachePolicyVTable::on_event`].
    pub unsafe extern "C" fn cache_event<T: CachePolicy>(
        handle: Handle,
        ev: *const CacheEvent,
    ) -> i32 {
        guard(|| {
            // SAFETY: a live handle of type T, one thread at a time.
            let (Some(s), false) = (unsafe { (handle as *mut T).as_mut() }, ev.is_null()) else {
                return ERR_INVALID;
            };
            // SAFETY: non-null host event.
            s.on_event(unsafe { &*ev })
        })
    }

    /// # Safety
    /// ABI contract of [`CachePolicyVTable::choose_victim`].
    pub unsafe extern "C" fn cache_victim<T: CachePolicy>(
        handle: Handle,
        candidates: *const Candidate,
        n: u64,
        out_index: *mut u64,
    ) -> i32 {
        guard(|| {
            // SAFETY: a live handle of type T.
            let Some(s) = (unsafe { (handle as *mut T).as_mut() }) else {
                return ERR_INVALID;
            };
            let Ok(n) = usize::try_from(n) else {
                return ERR_INVALID;
            };
            if candidates.is_null() || out_index.is_null() || n == 0 {
                return ERR_INVALID;
            }
            // SAFETY: the host passes `n` candidates.
            let c = unsafe { std::slice::from_raw_parts(candidates, n) };
            let i = s.choose_victim(c);
            // SAFETY: non-null host out pointer.
            unsafe { *out_index = i as u64 };
            OK
        })
    }

    /// # Safety
    /// ABI contract of [`DraftProviderVTable::create`].
    pub unsafe extern "C" fn draft_create<T: DraftProvider>(
        cfg: *const DraftConfig,
        out: *mut Handle,
        err: *mut c_char,
        err_len: u64,
    ) -> i32 {
        let rc = guard(|| {
            if cfg.is_null() || out.is_null() {
                return ERR_INVALID;
            }
            // SAFETY: non-null host config.
            let c = unsafe { &*cfg };
            if c.struct_size < DRAFT_CONFIG_SIZE {
                // SAFETY: host error buffer.
                unsafe { write_err(err, err_len, "draft config from an older host is too short") };
                return ERR_INVALID;
            }
            let setup = DraftSetup {
                vocab_size: c.vocab_size,
                max_draft: c.max_draft,
                // SAFETY: NUL-terminated per the ABI.
                options: unsafe { Options::from_ptr(c.options) },
            };
            // SAFETY: out checked above.
            unsafe { finish(T::create(&setup), out, err, err_len) }
        });
        if rc == ERR_PANIC {
            // SAFETY: host error buffer.
            unsafe { write_err(err, err_len, "create panicked") };
        }
        rc
    }

    /// # Safety
    /// ABI contract of [`DraftProviderVTable::propose`].
    pub unsafe extern "C" fn draft_propose<T: DraftProvider>(
        handle: Handle,
        context: *const u32,
        n_context: u64,
        k: u32,
        out: *mut u32,
        out_n: *mut u32,
    ) -> i32 {
        guard(|| {
            // SAFETY: a live handle of type T.
            let Some(s) = (unsafe { (handle as *mut T).as_mut() }) else {
                return ERR_INVALID;
            };
            let Ok(n) = usize::try_from(n_context) else {
                return ERR_INVALID;
            };
            if (context.is_null() && n > 0) || out_n.is_null() || (out.is_null() && k > 0) {
                return ERR_INVALID;
            }
            let ctx = if n == 0 {
                &[][..]
            } else {
                // SAFETY: the host passes `n` ids.
                unsafe { std::slice::from_raw_parts(context, n) }
            };
            let mut v = Vec::with_capacity(k as usize);
            s.propose(ctx, k as usize, &mut v);
            v.truncate(k as usize);
            // SAFETY: room for `k` ids and one count, host-owned.
            unsafe {
                if !v.is_empty() {
                    std::ptr::copy_nonoverlapping(v.as_ptr(), out, v.len());
                }
                *out_n = v.len() as u32;
            }
            OK
        })
    }

    /// # Safety
    /// ABI contract of [`DraftProviderVTable::on_result`].
    pub unsafe extern "C" fn draft_result<T: DraftProvider>(
        handle: Handle,
        proposed: u32,
        accepted: u32,
    ) -> i32 {
        guard(|| {
            // SAFETY: a live handle of type T.
            let Some(s) = (unsafe { (handle as *mut T).as_mut() }) else {
                return ERR_INVALID;
            };
            s.on_result(proposed as usize, accepted as usize);
            OK
        })
    }

    /// The negotiated answer: version 2 if the host speaks it, else our own version (which
    /// the host then refuses, naming both).
    pub fn entry(host_version: u32, d: &'static PluginDescriptor) -> *const PluginDescriptor {
        let _ = host_version; // only one version to offer so far
        d
    }
}

/// Export `$ty: CachePolicy` as this library's plugin: `export_cache_policy!(MyPolicy,
/// "name", "one-line description");`. Defines the `k3_plugin_entry` symbol.
#[macro_export]
macro_rules! export_cache_policy {
    ($ty:ty, $name:literal, $desc:literal) => {
        static __K3_CACHE_VTABLE: $crate::CachePolicyVTable = $crate::CachePolicyVTable {
            struct_size: $crate::CACHE_POLICY_VTABLE_SIZE,
            reserved: 0,
            create: $crate::glue::cache_create::<$ty>,
            destroy: $crate::glue::destroy::<$ty>,
            on_event: $crate::glue::cache_event::<$ty>,
            choose_victim: $crate::glue::cache_victim::<$ty>,
        };
        static __K3_DESCRIPTOR: $crate::PluginDescriptor = $crate::PluginDescriptor {
            abi_version: $crate::PLUGIN_ABI_VERSION,
            struct_size: $crate::DESCRIPTOR_SIZE,
            kind: $crate::KIND_CACHE_POLICY,
            reserved: 0,
            name: concat!($name, "\0").as_ptr() as *const ::std::ffi::c_char,
            description: concat!($desc, "\0").as_ptr() as *const ::std::ffi::c_char,
            cache_policy: &__K3_CACHE_VTABLE,
            draft_provider: ::std::ptr::null(),
        };
        /// The plugin entry point (k3-plugin-abi version 2).
        #[unsafe(no_mangle)]
        pub extern "C" fn k3_plugin_entry(host_version: u32) -> *const $crate::PluginDescriptor {
            $crate::glue::entry(host_version, &__K3_DESCRIPTOR)
        }
    };
}

/// Export `$ty: DraftProvider` as this library's plugin (see [`export_cache_policy!`]).
#[macro_export]
macro_rules! export_draft_provider {
    ($ty:ty, $name:literal, $desc:literal) => {
        static __K3_DRAFT_VTABLE: $crate::DraftProviderVTable = $crate::DraftProviderVTable {
            struct_size: $crate::DRAFT_PROVIDER_VTABLE_SIZE,
            reserved: 0,
            create: $crate::glue::draft_create::<$ty>,
            destroy: $crate::glue::destroy::<$ty>,
            propose: $crate::glue::draft_propose::<$ty>,
            on_result: $crate::glue::draft_result::<$ty>,
        };
        static __K3_DESCRIPTOR: $crate::PluginDescriptor = $crate::PluginDescriptor {
            abi_version: $crate::PLUGIN_ABI_VERSION,
            struct_size: $crate::DESCRIPTOR_SIZE,
            kind: $crate::KIND_DRAFT_PROVIDER,
            reserved: 0,
            name: concat!($name, "\0").as_ptr() as *const ::std::ffi::c_char,
            description: concat!($desc, "\0").as_ptr() as *const ::std::ffi::c_char,
            cache_policy: ::std::ptr::null(),
            draft_provider: &__K3_DRAFT_VTABLE,
        };
        /// The plugin entry point (k3-plugin-abi version 2).
        #[unsafe(no_mangle)]
        pub extern "C" fn k3_plugin_entry(host_version: u32) -> *const $crate::PluginDescriptor {
            $crate::glue::entry(host_version, &__K3_DESCRIPTOR)
        }
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn v2_layout_is_stable() {
        let p = std::mem::size_of::<usize>();
        assert_eq!(std::mem::size_of::<PluginDescriptor>(), 16 + 4 * p);
        assert_eq!(std::mem::offset_of!(PluginDescriptor, abi_version), 0);
        assert_eq!(std::mem::offset_of!(PluginDescriptor, kind), 8);
        assert_eq!(std::mem::size_of::<CacheEvent>(), 40);
        assert_eq!(std::mem::size_of::<CacheConfig>(), 32 + p);
        assert_eq!(std::mem::size_of::<CachePolicyVTable>(), 8 + 4 * p);
        assert_eq!(std::mem::size_of::<DraftProviderVTable>(), 8 + 4 * p);
        assert_eq!(std::mem::size_of::<DraftConfig>(), 16 + p);
        assert_eq!(PLUGIN_ENTRY.to_bytes(), b"k3_plugin_entry");
    }

    #[test]
    fn options_parse_and_numbers_name_the_key() {
        let o = Options::parse("a=1\n\n b = x y \nflag\na=2");
        assert_eq!(o.get("a"), Some("2"));
        assert_eq!(o.get("b"), Some("x y"));
        assert_eq!(o.get("flag"), Some(""));
        assert_eq!(o.number("a", 0u32), Ok(2));
        assert_eq!(o.number("zz", 7u32), Ok(7));
        let e = o.number::<u32>("b", 0).expect_err("not a number");
        assert!(e.contains("b=x y"), "{e}");
    }

    struct Boom;
    impl CachePolicy for Boom {
        fn create(s: &CacheSetup) -> Result<Self, String> {
            if s.options.get("fail").is_some() {
                return Err("asked to fail: a reason longer than the buffer".into());
            }
            Ok(Boom)
        }
        fn on_event(&mut self, ev: &CacheEvent) -> i32 {
            if ev.kind == EV_HIT {
                panic!("boom");
            }
            OK
        }
        fn choose_victim(&mut self, c: &[Candidate]) -> usize {
            c.len() - 1
        }
    }

    #[test]
    fn glue_catches_panics_and_reports_create_errors() {
        let opts = c"fail=1";
        let mut cfg = CacheConfig {
            struct_size: CACHE_CONFIG_SIZE,
            n_layers: 2,
            capacity: 4,
            expert_bytes: 10,
            n_experts: 8,
            top_k: 2,
            options: opts.as_ptr(),
        };
        let mut h: Handle = std::ptr::null_mut();
        let mut err = [0 as c_char; 12];
        // SAFETY: valid host-side pointers throughout.
        unsafe {
            let rc = glue::cache_create::<Boom>(&cfg, &mut h, err.as_mut_ptr(), 12);
            assert_eq!(rc, ERR_OTHER);
            let msg = CStr::from_ptr(err.as_ptr()).to_string_lossy().into_owned();
            assert_eq!(msg, "asked to fa", "cut to the buffer, NUL-terminated");
            cfg.options = c"".as_ptr();
            assert_eq!(
                glue::cache_create::<Boom>(&cfg, &mut h, err.as_mut_ptr(), 12),
                OK
            );
            let ev = |kind| CacheEvent {
                kind,
                layer: 1,
                expert: 2,
                reserved: 0,
                slot: 0,
                bytes: 10,
                seq: 1,
            };
            assert_eq!(glue::cache_event::<Boom>(h, &ev(EV_REQUEST)), OK);
            let prev = std::panic::take_hook();
            std::panic::set_hook(Box::new(|_| {}));
            let rc = glue::cache_event::<Boom>(h, &ev(EV_HIT));
            std::panic::set_hook(prev);
            assert_eq!(rc, ERR_PANIC);
            let cands = [Candidate {
                key: crate::ExpertKey {
                    layer: 1,
                    expert: 2,
                },
                slot: 3,
            }; 3];
            let mut out = 0u64;
            assert_eq!(
                glue::cache_victim::<Boom>(h, cands.as_ptr(), 3, &mut out),
                OK
            );
            assert_eq!(out, 2);
            assert_eq!(
                glue::cache_victim::<Boom>(h, cands.as_ptr(), 0, &mut out),
                ERR_INVALID
            );
            glue::destroy::<Boom>(h);
        }
    }

    struct Echo;
    impl DraftProvider for Echo {
        fn create(_: &DraftSetup) -> Result<Self, String> {
            Ok(Echo)
        }
        fn propose(&mut self, context: &[u32], k: usize, out: &mut Vec<u32>) {
            // Proposes more than asked: the glue cuts to k.
            out.extend(context.iter().rev().take(k + 3));
        }
    }

    #[test]
    fn draft_glue_cuts_to_k() {
        let cfg = DraftConfig {
            struct_size: DRAFT_CONFIG_SIZE,
            vocab_size: 100,
            max_draft: 4,
            reserved: 0,
            options: std::ptr::null(),
        };
        let mut h: Handle = std::ptr::null_mut();
        // SAFETY: valid host-side pointers.
        unsafe {
            assert_eq!(
                glue::draft_create::<Echo>(&cfg, &mut h, std::ptr::null_mut(), 0),
                OK
            );
            let ctx = [1u32, 2, 3, 4, 5];
            let mut out = [0u32; 2];
            let mut n = 9u32;
            let rc = glue::draft_propose::<Echo>(h, ctx.as_ptr(), 5, 2, out.as_mut_ptr(), &mut n);
            assert_eq!((rc, n, out), (OK, 2, [5, 4]));
            assert_eq!(glue::draft_result::<Echo>(h, 2, 1), OK);
            glue::destroy::<Echo>(h);
        }
    }
}
