//! Misbehaving plugins for k3-run's tests; not for use.
//!
//! Owns: one library that is either kind, chosen by the environment of the loading process
//! (`K3_TESTKIT_KIND=cache|draft`, default cache), answering the version negotiation with
//! `K3_TESTKIT_ABI` when set (to test refusal), and misbehaving on request
//! (`--plugin-opt misbehave=...`): a cache policy that panics in `choose_victim` (`panic`),
//! names a victim that is not a candidate (`bogus`), fails `create` (`create`), or asks to
//! pin everything it loads (`pin`); a draft provider that proposes ids outside the
//! vocabulary (`oov`) or panics (`panic`). Well-behaved otherwise: the cache policy evicts
//! the most recently used candidate, the drafter repeats the last context id.

use std::ffi::c_char;
use std::sync::OnceLock;

use k3_plugin_abi::{
    CACHE_POLICY_VTABLE_SIZE, CacheEvent, CachePolicy, CachePolicyVTable, CacheSetup, Candidate,
    DESCRIPTOR_SIZE, DRAFT_PROVIDER_VTABLE_SIZE, DraftProvider, DraftProviderVTable, DraftSetup,
    EV_HIT, EV_INSERT, KIND_CACHE_POLICY, KIND_DRAFT_PROVIDER, OK, PLUGIN_ABI_VERSION,
    PluginDescriptor, REPLY_PIN, glue,
};

pub struct Cache {
    misbehave: String,
    clock: u64,
    last: std::collections::HashMap<u64, u64>,
}

impl CachePolicy for Cache {
    fn create(setup: &CacheSetup) -> Result<Self, String> {
        let misbehave = setup.options.get("misbehave").unwrap_or("").to_string();
        if misbehave == "create" {
            return Err("testkit: create refused as asked (misbehave=create)".to_string());
        }
        Ok(Cache {
            misbehave,
            clock: 0,
            last: Default::default(),
        })
    }
    fn on_event(&mut self, ev: &CacheEvent) -> i32 {
        if ev.kind == EV_HIT || ev.kind == EV_INSERT {
            self.clock += 1;
            self.last.insert(ev.slot, self.clock);
        }
        if ev.kind == EV_INSERT && self.misbehave == "pin" {
            return REPLY_PIN;
        }
        OK
    }
    fn choose_victim(&mut self, c: &[Candidate]) -> usize {
        match self.misbehave.as_str() {
            "panic" => panic!("testkit: choose_victim panics as asked (misbehave=panic)"),
            "bogus" => c.len() + 7,
            _ => c
                .iter()
                .enumerate()
                .max_by_key(|(_, x)| (self.last.get(&x.slot).copied().unwrap_or(0), x.slot))
                .map_or(0, |(i, _)| i),
        }
    }
}

pub struct Draft {
    misbehave: String,
    vocab: u32,
}

impl DraftProvider for Draft {
    fn create(setup: &DraftSetup) -> Result<Self, String> {
        Ok(Draft {
            misbehave: setup.options.get("misbehave").unwrap_or("").to_string(),
            vocab: setup.vocab_size,
        })
    }
    fn propose(&mut self, context: &[u32], k: usize, out: &mut Vec<u32>) {
        match self.misbehave.as_str() {
            "panic" => panic!("testkit: propose panics as asked (misbehave=panic)"),
            "oov" => out.extend(std::iter::repeat_n(self.vocab + 5, k)),
            _ => {
                if let Some(&l) = context.last() {
                    out.extend(std::iter::repeat_n(l, k));
                }
            }
        }
    }
}

static CACHE_VT: CachePolicyVTable = CachePolicyVTable {
    struct_size: CACHE_POLICY_VTABLE_SIZE,
    reserved: 0,
    create: glue::cache_create::<Cache>,
    destroy: glue::destroy::<Cache>,
    on_event: glue::cache_event::<Cache>,
    choose_victim: glue::cache_victim::<Cache>,
};

static DRAFT_VT: DraftProviderVTable = DraftProviderVTable {
    struct_size: DRAFT_PROVIDER_VTABLE_SIZE,
    reserved: 0,
    create: glue::draft_create::<Draft>,
    destroy: glue::destroy::<Draft>,
    propose: glue::draft_propose::<Draft>,
    on_result: glue::draft_result::<Draft>,
};

struct Desc(PluginDescriptor);
// SAFETY: built once, then immutable; points at static data only.
unsafe impl Send for Desc {}
// SAFETY: as above.
unsafe impl Sync for Desc {}

static DESC: OnceLock<Desc> = OnceLock::new();

/// The entry point: the descriptor the environment asks for.
#[unsafe(no_mangle)]
pub extern "C" fn k3_plugin_entry(_host_version: u32) -> *const PluginDescriptor {
    let d = DESC.get_or_init(|| {
        let draft = std::env::var("K3_TESTKIT_KIND").is_ok_and(|k| k == "draft");
        let abi_version = std::env::var("K3_TESTKIT_ABI")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(PLUGIN_ABI_VERSION);
        Desc(PluginDescriptor {
            abi_version,
            struct_size: DESCRIPTOR_SIZE,
            kind: if draft {
                KIND_DRAFT_PROVIDER
            } else {
                KIND_CACHE_POLICY
            },
            reserved: 0,
            name: c"testkit".as_ptr() as *const c_char,
            description: c"misbehaving plugin for tests".as_ptr() as *const c_char,
            cache_policy: if draft { std::ptr::null() } else { &CACHE_VT },
            draft_provider: if draft { &DRAFT_VT } else { std::ptr::null() },
        })
    });
    &d.0
}
