//! Eviction-policy plugins: shared libraries implementing the `k3-plugin-abi` vtable.
//!
//! Owns: loading a plugin (`libloading`, never unloaded), checking its ABI version before
//! anything else, and [`PluginPolicy`], the adapter that makes a plugin an
//! [`EvictionPolicy`]. A plugin that returns an error, an out-of-range victim, or panics
//! (caught on its side, reported as `ERR_PANIC`) is dropped for the rest of the run and the
//! built-in LRU — fed every event from the start, so it is warm — takes over; the failure is
//! kept for the report. This cannot change output: the policy decides which reads happen, not
//! which bytes are served.
//! Must not: call a plugin from two threads at once (the cache calls it from its own thread),
//! or unload a library (rust-deps.md Q5: dlclose is unreliable with TLS; never unloading is
//! what Polars does).
//! Follows upstream: docs/DESIGN.md §10 (expert-cache policies as plugins, judged by trace replay).

use std::ffi::CStr;
use std::path::Path;

use k3_plugin_abi as abi;

use super::StreamError;
use super::experts::{EvictionPolicy, ExpertKey, Lru};

/// A plugin policy with the built-in LRU as warm fallback.
pub struct PluginPolicy {
    vt: &'static abi::EvictionVTable,
    handle: abi::Handle,
    name: String,
    fallback: Lru,
    failure: Option<String>,
}

// SAFETY: the plugin state behind `handle` is only touched through `&mut self` (one thread at
// a time), which is what the ABI requires; the vtable is immutable static data.
unsafe impl Send for PluginPolicy {}

impl std::fmt::Debug for PluginPolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PluginPolicy")
            .field("name", &self.name)
            .field("failure", &self.failure)
            .finish_non_exhaustive()
    }
}

fn key_c(k: ExpertKey) -> abi::ExpertKey {
    abi::ExpertKey {
        layer: k.0 as u32,
        expert: k.1 as u32,
    }
}

impl PluginPolicy {
    /// Adopt a vtable (checked: non-null, ABI version first, then size and name) and create
    /// the plugin state for a cache of `capacity` slots.
    ///
    /// # Safety
    /// `vt` must be null or point to memory that stays valid for the rest of the process and
    /// starts with a `u32` ABI version; if the version and size match, it must be a valid
    /// [`abi::EvictionVTable`] whose functions honour the ABI contract.
    pub unsafe fn from_vtable(
        vt: *const abi::EvictionVTable,
        capacity: usize,
        origin: &str,
    ) -> Result<Self, StreamError> {
        let bad = |msg: String| StreamError::Config(format!("eviction plugin {origin}: {msg}"));
        if vt.is_null() {
            return Err(bad("the entry point returned a null vtable".to_string()));
        }
        // SAFETY: the caller guarantees at least a leading u32 version is readable.
        let version = unsafe { std::ptr::read(vt as *const u32) };
        if version != abi::ABI_VERSION {
            return Err(bad(format!(
                "ABI version {version}, this k3-run speaks version {}",
                abi::ABI_VERSION
            )));
        }
        // SAFETY: version matches, so the caller guarantees a valid v1 vtable.
        let vt: &'static abi::EvictionVTable = unsafe { &*vt };
        if vt.struct_size < abi::EVICTION_VTABLE_SIZE {
            return Err(bad(format!(
                "vtable of {} bytes, version {} needs {}",
                vt.struct_size,
                abi::ABI_VERSION,
                abi::EVICTION_VTABLE_SIZE
            )));
        }
        let name = if vt.name.is_null() {
            "unnamed".to_string()
        } else {
            // SAFETY: a non-null name is a static NUL-terminated string per the ABI.
            unsafe { CStr::from_ptr(vt.name) }
                .to_string_lossy()
                .into_owned()
        };
        let mut handle: abi::Handle = std::ptr::null_mut();
        // SAFETY: valid out pointer; the function follows the ABI.
        let rc = unsafe { (vt.create)(capacity as u64, &mut handle) };
        if rc != abi::OK {
            return Err(bad(format!("create({capacity}) failed with code {rc}")));
        }
        Ok(Self {
            vt,
            handle,
            name: format!("plugin:{name}"),
            fallback: Lru::default(),
            failure: None,
        })
    }

    /// Why the plugin was dropped, if it was.
    pub fn failure(&self) -> Option<&str> {
        self.failure.as_deref()
    }

    fn check(&mut self, what: &str, rc: i32) {
        if rc != abi::OK && self.failure.is_none() {
            let why = if rc == abi::ERR_PANIC {
                "panicked (caught in the plugin)".to_string()
            } else {
                format!("returned code {rc}")
            };
            self.failure = Some(format!(
                "{}: {what} {why}; the built-in LRU takes over for the rest of the run",
                self.name
            ));
        }
    }

    fn event(
        &mut self,
        what: &str,
        f: unsafe extern "C" fn(abi::Handle, abi::ExpertKey, u64) -> i32,
        key: ExpertKey,
        slot: usize,
    ) {
        if self.failure.is_none() {
            // SAFETY: live handle from `create`, called from one thread (&mut self).
            let rc = unsafe { f(self.handle, key_c(key), slot as u64) };
            self.check(what, rc);
        }
    }
}

impl EvictionPolicy for PluginPolicy {
    fn name(&self) -> &str {
        &self.name
    }
    fn failure(&self) -> Option<&str> {
        self.failure.as_deref()
    }
    fn on_access(&mut self, key: ExpertKey, slot: usize) {
        self.fallback.on_access(key, slot);
        self.event("on_access", self.vt.on_access, key, slot);
    }
    fn on_insert(&mut self, key: ExpertKey, slot: usize) {
        self.fallback.on_insert(key, slot);
        self.event("on_insert", self.vt.on_insert, key, slot);
    }
    fn on_remove(&mut self, key: ExpertKey, slot: usize) {
        self.fallback.on_remove(key, slot);
        self.event("on_remove", self.vt.on_remove, key, slot);
    }
    fn choose_victim(&mut self, candidates: &[(ExpertKey, usize)]) -> usize {
        if self.failure.is_none() {
            let c: Vec<abi::Candidate> = candidates
                .iter()
                .map(|&(k, s)| abi::Candidate {
                    key: key_c(k),
                    slot: s as u64,
                })
                .collect();
            let mut out = u64::MAX;
            // SAFETY: live handle; `c` holds `c.len()` candidates; `out` is a valid pointer.
            let rc = unsafe {
                (self.vt.choose_victim)(self.handle, c.as_ptr(), c.len() as u64, &mut out)
            };
            self.check("choose_victim", rc);
            if self.failure.is_none() {
                if let Ok(i) = usize::try_from(out)
                    && i < candidates.len()
                {
                    return i;
                }
                self.failure = Some(format!(
                    "{}: choose_victim chose index {out} of {} candidates; the built-in LRU \
                     takes over for the rest of the run",
                    self.name,
                    candidates.len()
                ));
            }
        }
        self.fallback.choose_victim(candidates)
    }
}

impl Drop for PluginPolicy {
    fn drop(&mut self) {
        // SAFETY: the handle came from `create` and is destroyed exactly once.
        unsafe { (self.vt.destroy)(self.handle) };
    }
}

/// Load the eviction plugin at `path` (a shared library exporting
/// [`abi::EVICTION_ENTRY`]) for a cache of `capacity` slots. The library is never unloaded.
pub fn load_eviction_plugin(path: &Path, capacity: usize) -> Result<PluginPolicy, StreamError> {
    let origin = path.display().to_string();
    let bad = |msg: String| StreamError::Config(format!("eviction plugin {origin}: {msg}"));
    // SAFETY: loading runs the library's initialisers; plugins are trusted code the user
    // named on the command line (as with any dlopen-based plugin system).
    let lib =
        unsafe { libloading::Library::new(path) }.map_err(|e| bad(format!("cannot load: {e}")))?;
    let lib: &'static libloading::Library = Box::leak(Box::new(lib));
    // SAFETY: the symbol's type is fixed by the ABI crate.
    let entry = unsafe { lib.get::<abi::EvictionEntryFn>(abi::EVICTION_ENTRY) }.map_err(|e| {
        bad(format!(
            "no {} symbol: {e}",
            abi::EVICTION_ENTRY.to_string_lossy()
        ))
    })?;
    // SAFETY: calling the plugin's entry point per the ABI; it returns a static vtable.
    let vt = unsafe { entry() };
    // SAFETY: the library stays loaded forever, so the vtable stays valid; version checked
    // before use.
    unsafe { PluginPolicy::from_vtable(vt, capacity, &origin) }
}
