//! Draft providers for speculative decoding: the built-in prompt lookup and plugins.
//!
//! Owns: the [`Drafter`] trait the speculator asks for guesses ([`crate::speculate`]), and
//! [`PluginDrafter`], a version-2 draft-provider plugin whose every answer is checked: more
//! than `k` ids, an id outside the vocabulary, an error code or a caught panic make it fall
//! back, with one warning on stderr, to the built-in prompt lookup for the rest of the run.
//! Must not: decide an emitted id. A guess is only fed to the model; the speculator keeps it
//! only if it equals the model's own greedy choice, so ids and logit bits are those of plain
//! decoding whatever a drafter proposes (an out-of-vocabulary id is refused before it could
//! reach the embedding).

use k3_plugin_abi as abi;

use crate::speculate::{Speculation, lookup_draft};

/// Proposes the next tokens for speculative decoding.
pub trait Drafter: Send + std::fmt::Debug {
    fn name(&self) -> &str;
    /// Up to `k` (>= 1) guesses for the ids after `context` (every id so far).
    fn propose(&mut self, context: &[u32], k: usize) -> Vec<u32>;
    /// The first `accepted` of the last `proposed` guesses were the model's choice.
    fn on_result(&mut self, _proposed: usize, _accepted: usize) {}
    /// Why the drafter stopped working as configured (it fell back), if it did.
    fn failure(&self) -> Option<&str> {
        None
    }
}

/// The built-in prompt-lookup drafter (suffix n-grams, `Speculation::min_ngram..=max_ngram`).
#[derive(Clone, Copy, Debug)]
pub struct PromptLookup {
    pub min_ngram: usize,
    pub max_ngram: usize,
}

impl PromptLookup {
    pub fn new(s: &Speculation) -> Self {
        Self {
            min_ngram: s.min_ngram,
            max_ngram: s.max_ngram,
        }
    }
}

impl Drafter for PromptLookup {
    fn name(&self) -> &str {
        "prompt-lookup"
    }
    fn propose(&mut self, context: &[u32], k: usize) -> Vec<u32> {
        lookup_draft(context, k, self.min_ngram, self.max_ngram)
    }
}

/// A version-2 draft-provider plugin, checked, with the built-in lookup as fallback.
pub struct PluginDrafter {
    vt: &'static abi::DraftProviderVTable,
    handle: abi::Handle,
    name: String,
    vocab: usize,
    fallback: PromptLookup,
    failure: Option<String>,
    buf: Vec<u32>,
}

// SAFETY: the plugin state is only touched through `&mut self` (one thread at a time, as the
// ABI requires); the vtable is immutable static data.
unsafe impl Send for PluginDrafter {}

impl std::fmt::Debug for PluginDrafter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PluginDrafter")
            .field("name", &self.name)
            .field("failure", &self.failure)
            .finish_non_exhaustive()
    }
}

impl PluginDrafter {
    /// Adopt a created instance (see `plugins::drafter`).
    pub(crate) fn new(
        vt: &'static abi::DraftProviderVTable,
        handle: abi::Handle,
        name: &str,
        vocab: usize,
    ) -> Self {
        Self {
            vt,
            handle,
            name: format!("plugin:{name}"),
            vocab,
            fallback: PromptLookup::new(&Speculation::with_max_draft(1)),
            failure: None,
            buf: Vec::new(),
        }
    }

    fn fail(&mut self, msg: String) {
        if self.failure.is_none() {
            let m = format!(
                "{}: {msg}; the built-in prompt lookup drafts for the rest of the run (the \
                 output is the same either way)",
                self.name
            );
            eprintln!("k3-run: warning: draft provider {m}");
            self.failure = Some(m);
        }
    }
}

impl Drafter for PluginDrafter {
    fn name(&self) -> &str {
        &self.name
    }
    fn failure(&self) -> Option<&str> {
        self.failure.as_deref()
    }
    fn propose(&mut self, context: &[u32], k: usize) -> Vec<u32> {
        if self.failure.is_none() && k > 0 {
            let k32 = u32::try_from(k).unwrap_or(u32::MAX);
            self.buf.clear();
            self.buf.resize(k32 as usize, 0);
            let mut n = 0u32;
            // SAFETY: live handle; `context` holds its length; `buf` has room for `k32` ids.
            let rc = unsafe {
                (self.vt.propose)(
                    self.handle,
                    context.as_ptr(),
                    context.len() as u64,
                    k32,
                    self.buf.as_mut_ptr(),
                    &mut n,
                )
            };
            match rc {
                abi::OK if n > k32 => {
                    self.fail(format!("propose returned {n} ids, {k32} were asked for"))
                }
                abi::OK => {
                    let d = &self.buf[..n as usize];
                    match d.iter().find(|&&t| t as usize >= self.vocab) {
                        Some(&t) => self.fail(format!(
                            "propose returned id {t}, outside the vocabulary of {} ids",
                            self.vocab
                        )),
                        None => return d.to_vec(),
                    }
                }
                abi::ERR_PANIC => self.fail("propose panicked (caught in the plugin)".into()),
                rc => self.fail(format!("propose returned code {rc}")),
            }
        }
        self.fallback.propose(context, k)
    }
    fn on_result(&mut self, proposed: usize, accepted: usize) {
        if self.failure.is_some() {
            return;
        }
        // SAFETY: live handle, one thread.
        let rc = unsafe { (self.vt.on_result)(self.handle, proposed as u32, accepted as u32) };
        match rc {
            abi::OK => {}
            abi::ERR_PANIC => self.fail("on_result panicked (caught in the plugin)".into()),
            rc => self.fail(format!("on_result returned code {rc}")),
        }
    }
}

impl Drop for PluginDrafter {
    fn drop(&mut self) {
        // SAFETY: the handle came from `create` and is destroyed exactly once.
        unsafe { (self.vt.destroy)(self.handle) };
    }
}
