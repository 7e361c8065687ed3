//! Shared helpers of the k3-models integration tests: repository paths, the committed
//! header inventories and a minimal safetensors header reader (8-byte LE length + JSON).
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use k3_models::ModelSpec;

pub fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

pub fn manifest(name: &str) -> PathBuf {
    repo().join("configs/models").join(format!("{name}.toml"))
}

pub fn data(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data")
        .join(rel)
}

pub fn load(manifest_name: &str, config_rel: &str) -> ModelSpec {
    match k3_models::load_spec(&manifest(manifest_name), &data(config_rel)) {
        Ok(s) => s,
        Err(e) => panic!("{e}"),
    }
}

/// name -> (dtype, shape)
pub type Inventory = BTreeMap<String, (String, Vec<usize>)>;

/// Read `tests/data/<dir>/tensors.tsv` (name \t dtype \t comma-separated shape).
pub fn read_tsv(rel: &str) -> Inventory {
    let text = std::fs::read_to_string(data(rel)).expect("committed test data is readable");
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .map(|l| {
            let mut f = l.split('\t');
            let name = f.next().expect("name column").to_string();
            let dtype = f.next().expect("dtype column").to_string();
            let shape = f
                .next()
                .expect("shape column")
                .split(',')
                .map(|x| x.parse().expect("shape entries are integers"))
                .collect();
            (name, (dtype, shape))
        })
        .collect()
}

/// Every tensor of every `*.safetensors` file in `dir`, from the headers only.
pub fn read_headers(dir: &Path) -> Inventory {
    use std::io::Read;
    let mut out = Inventory::new();
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .expect("checkpoint dir is readable")
        .map(|e| e.expect("dir entry").path())
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    files.sort();
    for f in files {
        let mut fh = std::fs::File::open(&f).expect("shard opens");
        let mut len = [0u8; 8];
        fh.read_exact(&mut len).expect("header length");
        let n = u64::from_le_bytes(len) as usize;
        let mut h = vec![0u8; n];
        fh.read_exact(&mut h).expect("header bytes");
        let v: serde_json::Value = serde_json::from_slice(&h).expect("header is JSON");
        for (name, t) in v.as_object().expect("header is an object") {
            if name == "__metadata__" {
                continue;
            }
            let dtype = t["dtype"].as_str().expect("dtype").to_string();
            let shape = t["shape"]
                .as_array()
                .expect("shape")
                .iter()
                .map(|x| x.as_u64().expect("dim") as usize)
                .collect();
            out.insert(name.clone(), (dtype, shape));
        }
    }
    out
}

/// Compare a spec's inventory with a checkpoint's: every declared tensor present with the
/// same dtype and shape, every checkpoint tensor declared or under an ignored prefix.
/// Returns the list of differences (empty = equal).
pub fn diff_inventory(spec: &ModelSpec, ckpt: &Inventory) -> Vec<String> {
    let mut d = Vec::new();
    for t in &spec.tensors {
        match ckpt.get(&t.name) {
            None => d.push(format!("missing in checkpoint: {}", t.name)),
            Some((dt, sh)) => {
                if dt != t.dtype.as_str() || **sh != *t.shape {
                    d.push(format!(
                        "{}: spec {} {:?}, checkpoint {dt} {sh:?}",
                        t.name,
                        t.dtype.as_str(),
                        t.shape
                    ));
                }
            }
        }
    }
    let declared: std::collections::HashSet<&str> =
        spec.tensors.iter().map(|t| t.name.as_str()).collect();
    for name in ckpt.keys() {
        let ignored = spec
            .ignored_tensor_prefixes
            .iter()
            .any(|p| name.starts_with(p.as_str()));
        if !declared.contains(name.as_str()) && !ignored {
            d.push(format!("unexpected in checkpoint: {name}"));
        }
    }
    d
}
