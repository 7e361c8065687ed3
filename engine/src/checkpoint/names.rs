//! The tensor-name table a checkpoint keeps: every name in one text, entries by position,
//! looked up by hash without a `String` per name.

use super::*;

#[derive(Clone, Debug)]
pub(super) struct Entry {
    /// Relative to the shard's data section.
    pub(super) begin: u64,
    pub(super) end: u64,
    pub(super) shape: Shape,
    pub(super) shard: u32,
    /// Index into the safetensors dtypes ([`header::dtype_name`]).
    pub(super) dtype: u8,
}

impl Entry {
    pub(super) fn shard(&self) -> usize {
        self.shard as usize
    }
    pub(super) fn dtype(&self) -> &'static str {
        header::dtype_name(self.dtype)
    }
}

/// Tensor names in one text (name `i` is `text[starts[i]..starts[i + 1]]`: no allocation
/// per name) with a hash table of positions for lookups. K3 has 497,220 tensors: a `String`
/// per name cost ~100 bytes each; a name-sorted binary search spent 1.3 s of a start-up in
/// `memcmp` at that count (the names share long prefixes).
#[derive(Debug)]
pub(super) struct Names {
    pub(super) text: String,
    pub(super) starts: Vec<usize>,
    pub(super) lookup: hashbrown::HashTable<u32>,
    pub(super) hasher: hashbrown::DefaultHashBuilder,
}

impl Default for Names {
    fn default() -> Self {
        Names {
            text: String::new(),
            starts: vec![0],
            lookup: hashbrown::HashTable::new(),
            hasher: hashbrown::DefaultHashBuilder::default(),
        }
    }
}

impl Names {
    pub(super) fn name(&self, i: usize) -> &str {
        &self.text[self.starts[i]..self.starts[i + 1]]
    }
    pub(super) fn find(&self, name: &str) -> Option<u32> {
        let h = self.hasher.hash_one(name);
        self.lookup
            .find(h, |&j| self.name(j as usize) == name)
            .copied()
    }
    /// The position of `name`, added if new; `true` when it was already there.
    pub(super) fn intern(&mut self, name: &str) -> (u32, bool) {
        let h = self.hasher.hash_one(name);
        let (text, starts, hasher) = (&self.text, &self.starts, &self.hasher);
        let name_of = |j: u32| &text[starts[j as usize]..starts[j as usize + 1]];
        match self
            .lookup
            .entry(h, |&j| name_of(j) == name, |&j| hasher.hash_one(name_of(j)))
        {
            hashbrown::hash_table::Entry::Occupied(o) => (*o.get(), true),
            hashbrown::hash_table::Entry::Vacant(v) => {
                let i = u32::try_from(starts.len() - 1).expect("invariant: fewer than 2^32 names");
                v.insert(i);
                self.text.push_str(name);
                self.starts.push(self.text.len());
                (i, false)
            }
        }
    }
}

/// No entry ([`Table::entry_of`]).
pub(super) const NO_ENTRY: u32 = u32::MAX;

/// Every tensor of the checkpoint: entries in file order (shard by shard, by offset), each
/// with its name's position in `names`. With an index, `names` are the index's own (the
/// index names every tensor; a name it maps to a shard not opened has no entry), so the
/// ~500,000 names of the release are held once and looked up through the index's table.
#[derive(Debug, Default)]
pub(super) struct Table {
    pub(super) names: Names,
    /// Position in `names` of each entry's name.
    pub(super) name_of: Vec<u32>,
    /// Entry of each name in `names` ([`NO_ENTRY`] for none).
    pub(super) entry_of: Vec<u32>,
    pub(super) entries: Vec<Entry>,
    /// The first name found in two entries (kept as an error, see `open_files`).
    pub(super) dup: Option<u32>,
}

impl Table {
    /// Add an entry named `name`, at position `pos` in `names` if known (else interned).
    pub(super) fn push(&mut self, name: &str, pos: Option<u32>, e: Entry) {
        let pos = pos.unwrap_or_else(|| self.names.intern(name).0);
        let i = u32::try_from(self.entries.len()).expect("invariant: fewer than 2^32 tensors");
        if self.entry_of.len() <= pos as usize {
            self.entry_of.resize(pos as usize + 1, NO_ENTRY);
        }
        let slot = &mut self.entry_of[pos as usize];
        if *slot == NO_ENTRY {
            *slot = i;
        } else {
            self.dup.get_or_insert(pos);
        }
        self.name_of.push(pos);
        self.entries.push(e);
    }
    pub(super) fn len(&self) -> usize {
        self.entries.len()
    }
    pub(super) fn name(&self, i: usize) -> &str {
        self.names.name(self.name_of[i] as usize)
    }
    pub(super) fn names(&self) -> TensorNames<'_> {
        TensorNames {
            table: self,
            next: 0,
        }
    }
    /// A name given to two entries, if any.
    pub(super) fn duplicate(&self) -> Option<&str> {
        self.dup.map(|p| self.names.name(p as usize))
    }
    pub(super) fn get(&self, name: &str) -> Option<&Entry> {
        let pos = self.names.find(name)?;
        let &i = self.entry_of.get(pos as usize)?;
        self.entries.get(i as usize)
    }
}

/// The checkpoint's tensor names in file order ([`Checkpoint::tensor_names`]).
#[derive(Clone, Debug)]
pub struct TensorNames<'a> {
    table: &'a Table,
    next: usize,
}

impl<'a> Iterator for TensorNames<'a> {
    type Item = &'a str;
    fn next(&mut self) -> Option<&'a str> {
        let i = self.next;
        (i < self.table.len()).then(|| {
            self.next += 1;
            self.table.name(i)
        })
    }
    fn size_hint(&self) -> (usize, Option<usize>) {
        let n = self.table.len() - self.next;
        (n, Some(n))
    }
}

impl ExactSizeIterator for TensorNames<'_> {}
