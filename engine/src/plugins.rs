//! Plugins: finding, loading and checking shared libraries that speak `k3-plugin-abi`.
//!
//! Owns: where a plugin name is looked for ([`resolve`]: a path as given; a bare name in the
//! current directory, `$K3_PLUGIN_DIR`, `configs/plugins` and next to the `k3-run`
//! executable, as `NAME`, `libNAME.so` or `libk3_plugin_NAME.so`, then the system library
//! path), why a library does not load (the loader's own message plus what the file is: missing,
//! a directory, not ELF (a text file?), an executable, another architecture), the version
//! negotiation and every check of the descriptor before anything else is called
//! ([`load`]), and the entry points the rest of the engine uses: [`cache_policy`],
//! [`drafter`] and [`load_from_settings`].
//! Must not: unload a library (never: dlclose is unreliable with thread-locals), call a
//! plugin function before its version and sizes are checked, or let a plugin decide an output
//! id (policies choose reads, drafts are verified exactly).
//! Follows upstream: rust-deps.md Q5 (plain C ABI, versioned vtables, catch_unwind inside the
//! plugin); docs/PLUGINS.md is the reference for plugin authors.

use std::ffi::{CStr, CString, c_char};
use std::path::{Path, PathBuf};

use k3_plugin_abi as abi;

/// A plugin that cannot be used, with the reason (names the file and, where it applies, the
/// symbol).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct PluginError(pub String);

impl From<PluginError> for crate::stream::StreamError {
    fn from(e: PluginError) -> Self {
        crate::stream::StreamError::Config(e.0)
    }
}

/// What a plugin is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// An expert-cache policy (ABI version 2).
    CachePolicy,
    /// A speculative-draft provider (ABI version 2).
    DraftProvider,
    /// An eviction policy of the version-1 ABI (`k3_eviction_policy_v1`).
    EvictionV1,
}

impl Kind {
    pub fn label(self) -> &'static str {
        match self {
            Kind::CachePolicy => "cache-policy",
            Kind::DraftProvider => "draft-provider",
            Kind::EvictionV1 => "cache-policy (v1 eviction)",
        }
    }
}

#[derive(Clone, Copy, Debug)]
enum Entry {
    V2(&'static abi::PluginDescriptor),
    V1(*const abi::EvictionVTable),
}

/// A loaded, checked plugin library.
#[derive(Clone, Debug)]
pub struct Loaded {
    /// The file that was loaded.
    pub path: PathBuf,
    pub name: String,
    pub description: String,
    pub abi_version: u32,
    pub kind: Kind,
    entry: Entry,
}

// SAFETY: `entry` points at static data of a library that is never unloaded.
unsafe impl Send for Loaded {}

/// Directories a bare plugin name is looked for in, in order.
pub fn search_dirs() -> Vec<PathBuf> {
    let mut dirs = vec![PathBuf::from(".")];
    if let Some(v) = std::env::var_os("K3_PLUGIN_DIR") {
        dirs.extend(std::env::split_paths(&v).filter(|p| !p.as_os_str().is_empty()));
    }
    dirs.push(PathBuf::from("configs/plugins"));
    if let Some(d) = std::env::current_exe()
        .ok()
        .and_then(|e| e.parent().map(Path::to_path_buf))
    {
        dirs.push(d);
    }
    dirs
}

/// File names a bare `name` may stand for.
fn name_variants(name: &str) -> Vec<String> {
    let (pre, suf) = (std::env::consts::DLL_PREFIX, std::env::consts::DLL_SUFFIX);
    let mut v = vec![name.to_string()];
    if !name.ends_with(suf) {
        v.push(format!("{pre}{name}{suf}"));
        v.push(format!("{pre}k3_plugin_{}{suf}", name.replace('-', "_")));
    }
    v
}

/// Where `spec` names a file: a path with a directory part as given; a bare name found in
/// [`search_dirs`]. `None`: a bare name found nowhere (left to the system library path).
pub fn resolve(spec: &Path) -> Option<PathBuf> {
    let bare = spec.components().count() == 1 && !spec.is_absolute();
    if !bare {
        return Some(spec.to_path_buf());
    }
    let name = spec.to_string_lossy();
    for d in search_dirs() {
        for v in name_variants(&name) {
            let p = d.join(&v);
            if p.is_file() {
                // dlopen searches the system path for a name without a slash: make it one.
                return Some(p.canonicalize().unwrap_or(p));
            }
        }
    }
    None
}

/// A libloading error with its causes (the loader's own `dlerror` text is the source).
fn loader_says(e: &libloading::Error) -> String {
    let mut msg = e.to_string();
    let mut src = std::error::Error::source(e);
    while let Some(s) = src {
        let t = s.to_string();
        if !msg.contains(&t) {
            msg = format!("{msg}: {t}");
        }
        src = s.source();
    }
    msg
}

/// Whether a 64-bit little-endian ELF file has a program interpreter (a position-independent
/// executable, or a library that can also run, like libc).
fn has_interp(path: &Path) -> bool {
    let Ok(b) = std::fs::read(path) else {
        return false;
    };
    let u16_at = |i: usize| b.get(i..i + 2).map(|x| u16::from_le_bytes([x[0], x[1]]));
    let u64_at = |i: usize| {
        b.get(i..i + 8)
            .and_then(|x| x.try_into().ok())
            .map(u64::from_le_bytes)
    };
    let (Some(phoff), Some(phentsize), Some(phnum)) = (u64_at(32), u16_at(54), u16_at(56)) else {
        return false;
    };
    (0..usize::from(phnum)).any(|i| {
        let at = phoff as usize + i * usize::from(phentsize);
        b.get(at..at + 4)
            .is_some_and(|t| u32::from_le_bytes([t[0], t[1], t[2], t[3]]) == 3)
    })
}

/// What the first bytes of `path` say about why it is not a loadable library.
fn what_the_file_is(path: &Path) -> Option<String> {
    let meta = std::fs::metadata(path).ok()?;
    if meta.is_dir() {
        return Some("it is a directory".to_string());
    }
    let mut head = [0u8; 20];
    let n = {
        use std::io::Read;
        let mut f = std::fs::File::open(path).ok()?;
        f.read(&mut head).ok()?
    };
    // Plugins are Mach-O (.dylib) on macOS and PE (.dll) on Windows: only a text file is told
    // apart there; the loader's own message says the rest.
    if cfg!(any(target_os = "macos", windows)) {
        let text = n > 0
            && head[..n]
                .iter()
                .all(|&b| b.is_ascii_graphic() || b.is_ascii_whitespace());
        return text.then(|| "it is not a shared library but a text file".to_string());
    }
    if n < 20 || &head[..4] != b"\x7fELF" {
        let text = head[..n]
            .iter()
            .all(|&b| b.is_ascii_graphic() || b.is_ascii_whitespace());
        return Some(if text && n > 0 {
            "it is not a shared library but a text file (no ELF header)".to_string()
        } else {
            "it is not a shared library (no ELF header)".to_string()
        });
    }
    let class = head[4]; // 1 = 32-bit, 2 = 64-bit
    let little = head[5] == 1;
    let e_type = if little {
        u16::from_le_bytes([head[16], head[17]])
    } else {
        u16::from_be_bytes([head[16], head[17]])
    };
    let machine = if little {
        u16::from_le_bytes([head[18], head[19]])
    } else {
        u16::from_be_bytes([head[18], head[19]])
    };
    let (want_machine, arch) = match std::env::consts::ARCH {
        "x86_64" => (62u16, "x86_64"),
        "aarch64" => (183, "aarch64"),
        "riscv64" => (243, "riscv64"),
        a => (0, a),
    };
    let want_class = if cfg!(target_pointer_width = "64") {
        2
    } else {
        1
    };
    if class != want_class || (want_machine != 0 && machine != want_machine) {
        return Some(format!(
            "it was built for another architecture (ELF class {class}, machine {machine}; this \
             k3-run is {arch}, machine {want_machine})"
        ));
    }
    if e_type == 2 || (e_type == 3 && class == 2 && little && has_interp(path)) {
        return Some("it is an executable, not a shared library".to_string());
    }
    None
}

/// Open the library `spec` names (see [`resolve`]), never to be closed.
fn open(spec: &Path) -> Result<(&'static libloading::Library, PathBuf), PluginError> {
    let shown = spec.display().to_string();
    let path = match resolve(spec) {
        Some(p) => p,
        None => {
            // Last resort: the system library path (LD_LIBRARY_PATH, ld.so.cache).
            // SAFETY: loading runs the library's initialisers; plugins are trusted code the
            // user named.
            return match unsafe { libloading::Library::new(spec) } {
                Ok(lib) => Ok((Box::leak(Box::new(lib)), spec.to_path_buf())),
                Err(e) => {
                    let dirs: Vec<String> = search_dirs()
                        .iter()
                        .map(|d| d.display().to_string())
                        .collect();
                    Err(PluginError(format!(
                        "plugin {shown}: not found: no {} in {} (nor on the system library \
                         path: {})",
                        name_variants(&spec.to_string_lossy()).join(" / "),
                        dirs.join(", "),
                        loader_says(&e)
                    )))
                }
            };
        }
    };
    if !path.exists() {
        return Err(PluginError(format!(
            "plugin {}: no such file",
            path.display()
        )));
    }
    // A relative path with a directory part is passed as is: it contains a slash, so dlopen
    // takes it relative to the current directory.
    // SAFETY: as above.
    match unsafe { libloading::Library::new(&path) } {
        Ok(lib) => Ok((Box::leak(Box::new(lib)), path)),
        Err(e) => {
            let why = what_the_file_is(&path).map_or_else(String::new, |w| format!("{w}; "));
            Err(PluginError(format!(
                "plugin {}: cannot load: {why}the loader says: {}",
                path.display(),
                loader_says(&e)
            )))
        }
    }
}

/// A NUL-terminated static string from a plugin, or `dflt` for null.
///
/// # Safety
/// `p` is null or a NUL-terminated string that lives as long as the process.
unsafe fn c_str(p: *const c_char, dflt: &str) -> String {
    if p.is_null() {
        dflt.to_string()
    } else {
        // SAFETY: per the caller.
        unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
    }
}

/// Load `spec` and check what it says it is: the version negotiated through
/// [`abi::PLUGIN_ENTRY`] (or the version-1 eviction entry), the descriptor's size, its kind
/// and vtable. No plugin callback runs here except the entry point itself.
pub fn load(spec: &Path) -> Result<Loaded, PluginError> {
    let (lib, path) = open(spec)?;
    let shown = path.display().to_string();
    let bad = |msg: String| PluginError(format!("plugin {shown}: {msg}"));
    // SAFETY: the symbol's type is fixed by the ABI crate.
    if let Ok(entry) = unsafe { lib.get::<abi::PluginEntryFn>(abi::PLUGIN_ENTRY) } {
        // SAFETY: the entry point per the ABI; returns a pointer to static data.
        let d = unsafe { entry(abi::PLUGIN_ABI_VERSION) };
        if d.is_null() {
            return Err(bad(format!(
                "{} returned no descriptor",
                abi::PLUGIN_ENTRY.to_string_lossy()
            )));
        }
        // SAFETY: every version starts with a u32 version; the library is never unloaded.
        let version = unsafe { std::ptr::read(d as *const u32) };
        if !(abi::PLUGIN_ABI_MIN_VERSION..=abi::PLUGIN_ABI_VERSION).contains(&version) {
            return Err(bad(format!(
                "it speaks plugin ABI version {version}; this k3-run speaks version {} (and \
                 the version-1 eviction entry): rebuild the plugin against this k3-run's \
                 k3-plugin-abi",
                abi::PLUGIN_ABI_VERSION
            )));
        }
        // SAFETY: version 2 checked; the descriptor layout is version 2's.
        let d: &'static abi::PluginDescriptor = unsafe { &*d };
        if d.struct_size < abi::DESCRIPTOR_SIZE {
            return Err(bad(format!(
                "descriptor of {} bytes, version {version} needs {}",
                d.struct_size,
                abi::DESCRIPTOR_SIZE
            )));
        }
        // SAFETY: static strings per the ABI.
        let name = unsafe { c_str(d.name, "unnamed") };
        // SAFETY: as above.
        let description = unsafe { c_str(d.description, "") };
        let kind = match d.kind {
            abi::KIND_CACHE_POLICY => {
                // SAFETY: a non-null vtable pointer is static data per the ABI.
                match unsafe { d.cache_policy.as_ref() } {
                    None => return Err(bad("cache-policy descriptor without a vtable".into())),
                    Some(v) if v.struct_size < abi::CACHE_POLICY_VTABLE_SIZE => {
                        return Err(bad(format!(
                            "cache-policy vtable of {} bytes, version {version} needs {}",
                            v.struct_size,
                            abi::CACHE_POLICY_VTABLE_SIZE
                        )));
                    }
                    Some(_) => Kind::CachePolicy,
                }
            }
            abi::KIND_DRAFT_PROVIDER => {
                // SAFETY: as above.
                match unsafe { d.draft_provider.as_ref() } {
                    None => return Err(bad("draft-provider descriptor without a vtable".into())),
                    Some(v) if v.struct_size < abi::DRAFT_PROVIDER_VTABLE_SIZE => {
                        return Err(bad(format!(
                            "draft-provider vtable of {} bytes, version {version} needs {}",
                            v.struct_size,
                            abi::DRAFT_PROVIDER_VTABLE_SIZE
                        )));
                    }
                    Some(_) => Kind::DraftProvider,
                }
            }
            k => {
                return Err(bad(format!(
                    "unknown plugin kind {k} (this k3-run knows 1 = cache policy, 2 = draft \
                     provider)"
                )));
            }
        };
        return Ok(Loaded {
            path,
            name,
            description,
            abi_version: version,
            kind,
            entry: Entry::V2(d),
        });
    }
    // SAFETY: the symbol's type is fixed by the ABI crate.
    match unsafe { lib.get::<abi::EvictionEntryFn>(abi::EVICTION_ENTRY) } {
        Ok(entry) => {
            // SAFETY: the version-1 entry per the ABI.
            let vt = unsafe { entry() };
            if vt.is_null() {
                return Err(bad("the version-1 entry returned a null vtable".into()));
            }
            // SAFETY: a version-1 vtable starts with its u32 version.
            let version = unsafe { std::ptr::read(vt as *const u32) };
            let name = if version == abi::ABI_VERSION {
                // SAFETY: version 1 checked; the name is static.
                unsafe { c_str((*vt).name, "unnamed") }
            } else {
                "unnamed".to_string()
            };
            Ok(Loaded {
                path,
                name,
                description: "version-1 eviction policy".to_string(),
                abi_version: version,
                kind: Kind::EvictionV1,
                entry: Entry::V1(vt),
            })
        }
        Err(e) => Err(bad(format!(
            "not a k3-run plugin: no {} symbol (nor the version-1 {}); the loader says: {}",
            abi::PLUGIN_ENTRY.to_string_lossy(),
            abi::EVICTION_ENTRY.to_string_lossy(),
            loader_says(&e)
        ))),
    }
}

/// `key=value` options for a plugin's `create`, one a line, or which one is malformed.
pub fn options_text(options: &[String]) -> Result<CString, PluginError> {
    for o in options {
        if !o.contains('=') || o.starts_with('=') || o.contains('\n') {
            return Err(PluginError(format!(
                "--plugin-opt {o:?}: expected KEY=VALUE"
            )));
        }
    }
    CString::new(options.join("\n"))
        .map_err(|_| PluginError("--plugin-opt: a value contains a NUL byte".to_string()))
}

/// Read the NUL-terminated reason a failed `create` wrote.
fn create_error(buf: &[c_char]) -> String {
    let bytes: Vec<u8> = buf
        .iter()
        .take_while(|&&c| c != 0)
        .map(|&c| c as u8)
        .collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

/// The cache as [`cache_policy`] describes it to a plugin.
#[derive(Clone, Debug, Default)]
pub struct CacheShape {
    pub capacity: usize,
    pub expert_bytes: u64,
    pub n_layers: usize,
    pub n_experts: usize,
    pub top_k: usize,
}

/// An expert-cache policy from `loaded` for a cache of `shape`, with the built-in LRU as its
/// warm fallback (see [`crate::stream::policy`]).
pub fn cache_policy_from(
    loaded: &Loaded,
    shape: &CacheShape,
    options: &[String],
) -> Result<Box<dyn crate::stream::experts::EvictionPolicy>, PluginError> {
    let shown = loaded.path.display().to_string();
    match (loaded.kind, loaded.entry) {
        (Kind::CachePolicy, Entry::V2(d)) => {
            let opts = options_text(options)?;
            // SAFETY: checked in `load`: non-null, version 2, sizes.
            let vt: &'static abi::CachePolicyVTable = unsafe { &*d.cache_policy };
            let cfg = abi::CacheConfig {
                struct_size: abi::CACHE_CONFIG_SIZE,
                n_layers: u32::try_from(shape.n_layers).unwrap_or(u32::MAX),
                capacity: shape.capacity as u64,
                expert_bytes: shape.expert_bytes,
                n_experts: u32::try_from(shape.n_experts).unwrap_or(u32::MAX),
                top_k: u32::try_from(shape.top_k).unwrap_or(u32::MAX),
                options: opts.as_ptr(),
            };
            let mut handle: abi::Handle = std::ptr::null_mut();
            let mut err = [0 as c_char; 512];
            // SAFETY: valid config, out pointer and error buffer; the ABI contract.
            let rc = unsafe { (vt.create)(&cfg, &mut handle, err.as_mut_ptr(), err.len() as u64) };
            if rc != abi::OK {
                let why = create_error(&err);
                return Err(PluginError(format!(
                    "plugin {shown} ({}): create failed (code {rc}){}",
                    loaded.name,
                    if why.is_empty() {
                        String::new()
                    } else {
                        format!(": {why}")
                    }
                )));
            }
            Ok(Box::new(crate::stream::policy::CachePlugin::new(
                vt,
                handle,
                &loaded.name,
                shape,
            )))
        }
        (Kind::EvictionV1, Entry::V1(vt)) => {
            // SAFETY: the library is never unloaded; `from_vtable` checks the version first.
            let p = unsafe {
                crate::stream::plugin::PluginPolicy::from_vtable(vt, shape.capacity, &shown)
            }
            .map_err(|e| PluginError(e.to_string()))?;
            Ok(Box::new(p))
        }
        _ => Err(PluginError(format!(
            "plugin {shown} ({}) is a {}, not a cache policy: give it to --draft-plugin",
            loaded.name,
            loaded.kind.label()
        ))),
    }
}

/// [`load`] + [`cache_policy_from`].
pub fn cache_policy(
    spec: &Path,
    shape: &CacheShape,
    options: &[String],
) -> Result<Box<dyn crate::stream::experts::EvictionPolicy>, PluginError> {
    cache_policy_from(&load(spec)?, shape, options)
}

/// A draft provider from `spec` for a model of `vocab_size` ids and up to `max_draft`
/// guesses per pass; falls back to the built-in prompt lookup on any misbehaviour.
pub fn drafter(
    spec: &Path,
    vocab_size: usize,
    max_draft: usize,
    options: &[String],
) -> Result<Box<dyn crate::draft::Drafter>, PluginError> {
    let loaded = load(spec)?;
    let shown = loaded.path.display().to_string();
    let Entry::V2(d) = loaded.entry else {
        return Err(PluginError(format!(
            "plugin {shown} ({}) is a {}, not a draft provider: give it to --eviction-plugin",
            loaded.name,
            loaded.kind.label()
        )));
    };
    if loaded.kind != Kind::DraftProvider {
        return Err(PluginError(format!(
            "plugin {shown} ({}) is a {}, not a draft provider: give it to --eviction-plugin",
            loaded.name,
            loaded.kind.label()
        )));
    }
    let opts = options_text(options)?;
    // SAFETY: checked in `load`.
    let vt: &'static abi::DraftProviderVTable = unsafe { &*d.draft_provider };
    let cfg = abi::DraftConfig {
        struct_size: abi::DRAFT_CONFIG_SIZE,
        vocab_size: u32::try_from(vocab_size).unwrap_or(u32::MAX),
        max_draft: u32::try_from(max_draft).unwrap_or(u32::MAX),
        reserved: 0,
        options: opts.as_ptr(),
    };
    let mut handle: abi::Handle = std::ptr::null_mut();
    let mut err = [0 as c_char; 512];
    // SAFETY: valid config, out pointer and error buffer.
    let rc = unsafe { (vt.create)(&cfg, &mut handle, err.as_mut_ptr(), err.len() as u64) };
    if rc != abi::OK {
        let why = create_error(&err);
        return Err(PluginError(format!(
            "plugin {shown} ({}): create failed (code {rc}){}",
            loaded.name,
            if why.is_empty() {
                String::new()
            } else {
                format!(": {why}")
            }
        )));
    }
    Ok(Box::new(crate::draft::PluginDrafter::new(
        vt,
        handle,
        &loaded.name,
        vocab_size,
    )))
}

/// Plugins a run is configured with (flags, or a run config's `[plugins]` table).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PluginSettings {
    /// The expert-cache policy (`--eviction-plugin`, `[plugins] cache`).
    pub cache_policy: Option<PathBuf>,
    /// The draft provider (`--draft-plugin`, `[plugins] draft`).
    pub draft: Option<PathBuf>,
    /// `KEY=VALUE` options given to every plugin's `create` (`--plugin-opt`,
    /// `[plugins] options`).
    pub options: Vec<String>,
}

/// Load and check the plugins `s` names (libraries and kinds; instances are created when the
/// cache and the speculator exist). For the config layering: call it once the settings are
/// merged, to refuse a wrong plugin before any weight is read.
pub fn load_from_settings(s: &PluginSettings) -> Result<Vec<Loaded>, PluginError> {
    options_text(&s.options)?;
    let mut out = Vec::new();
    if let Some(p) = &s.cache_policy {
        let l = load(p)?;
        if l.kind == Kind::DraftProvider {
            return Err(PluginError(format!(
                "plugin {} ({}) is a {}, not a cache policy: name it as the draft provider \
                 ([plugins] draft, --draft-plugin)",
                l.path.display(),
                l.name,
                l.kind.label()
            )));
        }
        out.push(l);
    }
    if let Some(p) = &s.draft {
        let l = load(p)?;
        if l.kind != Kind::DraftProvider {
            return Err(PluginError(format!(
                "plugin {} ({}) is a {}, not a draft provider: name it as the cache policy \
                 ([plugins] cache, --eviction-plugin)",
                l.path.display(),
                l.name,
                l.kind.label()
            )));
        }
        out.push(l);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bare_names_are_looked_for_in_the_search_dirs_only() {
        assert_eq!(
            resolve(Path::new("dir/x.so")),
            Some(PathBuf::from("dir/x.so"))
        );
        assert_eq!(
            resolve(Path::new("/abs/x.so")),
            Some(PathBuf::from("/abs/x.so"))
        );
        assert_eq!(resolve(Path::new("surely-no-such-plugin-name")), None);
        let v = name_variants("draft-ngram");
        assert!(
            v.contains(&"libk3_plugin_draft_ngram.so".to_string()),
            "{v:?}"
        );
        assert_eq!(name_variants("x.so"), vec!["x.so".to_string()]);
    }

    #[test]
    fn load_errors_say_why() {
        let d = tempfile::tempdir().expect("tempdir");
        let txt = d.path().join("notes.so");
        std::fs::write(&txt, "this is text, not a library\n").expect("write");
        let e = load(&txt).expect_err("text").0;
        assert!(e.contains("notes.so") && e.contains("text file"), "{e}");
        assert!(e.contains("the loader says"), "{e}");
        let e = load(&d.path().join("missing.so")).expect_err("missing").0;
        assert!(
            e.contains("missing.so") && e.contains("no such file"),
            "{e}"
        );
        let e = load(d.path()).expect_err("dir").0;
        assert!(e.contains("directory"), "{e}");
        let e = load(Path::new("surely-no-such-plugin-name"))
            .expect_err("bare")
            .0;
        assert!(
            e.contains("not found") && e.contains("configs/plugins"),
            "{e}"
        );
        let e = options_text(&["novalue".to_string()]).expect_err("opt").0;
        assert!(e.contains("KEY=VALUE"), "{e}");
    }
}
