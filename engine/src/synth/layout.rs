//! File layout of a synthetic checkpoint: which tensor goes to which shard, in which order,
//! and the safetensors header of each shard.
//!
//! Owns: grouping tensors by layer, ordering them inside a group, splitting groups over
//! shards, and header bytes. Must not: generate tensor contents.
//!
//! What the release does and what we do. Upstream `safetensors` serialisation orders a file's
//! tensors by dtype alignment, descending (F32 before BF16 before U8), then by name, and HF
//! sharding fills shards in state-dict order; K3's 96 shards of ~16 GB hold about one layer
//! each (a layer's 896 experts alone are 15.7 GB). Inside a layer that gives: the F32 trunk
//! tensors, the BF16 trunk tensors, then the U8 routed experts (`experts.0.w1.weight_packed`,
//! `...weight_scale`, `w2`, `w3`, `experts.1...`, `experts.10...` in name order). We apply that
//! order per layer group, and never split a layer across shards, so:
//!
//! - every layer's tensors are one contiguous run in one shard;
//! - inside it, the layer's non-expert ("trunk") tensors form one contiguous range (what the
//!   trunk packer copies in one read), followed by the routed experts;
//! - each expert's six tensors are adjacent.
//!
//! Groups in file order: `embed_tokens` (head), layers 0..n-1, then the final norm, output
//! AttnRes, `lm_head` and the vision stubs (tail). Shards receive consecutive groups, split so
//! bytes are roughly balanced and no shard is empty. Headers: `__metadata__ {"format":"pt"}`
//! first, then entries in offset order, JSON padded with spaces to a multiple of 8 bytes, as
//! the Python writer does.

use k3_models::spec::DType;

use super::fill::Item;

/// One shard's file name and its items in file order.
#[derive(Clone, Debug)]
pub struct ShardPlan {
    pub file_name: String,
    pub items: Vec<Item>,
}

/// safetensors dtype order key: larger alignment first (F32, BF16, U8).
fn dtype_rank(d: DType) -> u8 {
    match d {
        DType::F32 => 0,
        DType::BF16 => 1,
        DType::U8 => 2,
    }
}

/// Sort a group like the safetensors serializer: dtype (descending alignment), then name.
pub fn sort_group(items: &mut [Item]) {
    items.sort_by(|a, b| (dtype_rank(a.dtype), &a.name).cmp(&(dtype_rank(b.dtype), &b.name)));
}

/// Split `items` (head globals have `layer == None` and come first in `head`) into shards.
/// `head`: tensors before layer 0; `tail`: tensors after the last layer.
pub fn plan_shards(
    head: Vec<Item>,
    layers: Vec<Vec<Item>>,
    tail: Vec<Item>,
    n_shards: usize,
) -> Vec<ShardPlan> {
    let mut groups: Vec<Vec<Item>> = Vec::with_capacity(layers.len() + 2);
    groups.push(head);
    groups.extend(layers);
    groups.push(tail);
    groups.retain(|g| !g.is_empty());
    for g in &mut groups {
        sort_group(g);
    }
    let n = n_shards.clamp(1, groups.len().max(1));
    let bytes: Vec<u64> = groups
        .iter()
        .map(|g| g.iter().map(Item::n_bytes).sum())
        .collect();
    let total: u64 = bytes.iter().sum();
    let mut shards: Vec<Vec<Item>> = vec![Vec::new(); n];
    let mut cur = 0usize;
    let mut acc = 0u64;
    let n_groups = groups.len();
    for (i, g) in groups.into_iter().enumerate() {
        acc += bytes[i];
        shards[cur].extend(g);
        let shards_left = n - cur - 1;
        let groups_left = n_groups - i - 1;
        let reached = acc as u128 * n as u128 >= (cur as u128 + 1) * total as u128;
        if shards_left > 0 && (reached || groups_left == shards_left) {
            cur += 1;
        }
    }
    shards
        .into_iter()
        .enumerate()
        .map(|(i, items)| ShardPlan {
            file_name: format!("model-{:05}-of-{:05}.safetensors", i + 1, n),
            items,
        })
        .collect()
}

/// The 8-byte length + JSON header of a shard whose items are written in order.
pub fn header_bytes(items: &[Item]) -> Vec<u8> {
    let mut json = String::from("{\"__metadata__\":{\"format\":\"pt\"}");
    let mut off = 0u64;
    for it in items {
        let end = off + it.n_bytes();
        let name = serde_json::Value::String(it.name.clone()).to_string();
        let shape: Vec<String> = it.shape.iter().map(|d| d.to_string()).collect();
        json.push_str(&format!(
            ",{name}:{{\"dtype\":\"{}\",\"shape\":[{}],\"data_offsets\":[{off},{end}]}}",
            it.dtype.as_str(),
            shape.join(",")
        ));
        off = end;
    }
    json.push('}');
    while !json.len().is_multiple_of(8) {
        json.push(' ');
    }
    let mut out = Vec::with_capacity(8 + json.len());
    out.extend_from_slice(&(json.len() as u64).to_le_bytes());
    out.extend_from_slice(json.as_bytes());
    out
}

#[cfg(test)]
mod tests {
    use super::super::fill::Recipe;
    use super::*;

    fn item(name: &str, dtype: DType, n: usize, layer: Option<usize>) -> Item {
        Item {
            name: name.to_string(),
            dtype,
            shape: vec![n],
            layer,
            recipe: Recipe::Normal {
                std: 1.0,
                shift: 0.0,
            },
        }
    }

    #[test]
    fn group_order_puts_trunk_before_experts() {
        let mut g = vec![
            item(
                "l.0.block_sparse_moe.experts.1.w1.weight_packed",
                DType::U8,
                4,
                Some(0),
            ),
            item("l.0.self_attn.q_proj.weight", DType::BF16, 4, Some(0)),
            item(
                "l.0.block_sparse_moe.experts.0.w1.weight_scale",
                DType::U8,
                4,
                Some(0),
            ),
            item("l.0.self_attn.A_log", DType::F32, 4, Some(0)),
            item("l.0.input_layernorm.weight", DType::BF16, 4, Some(0)),
        ];
        sort_group(&mut g);
        let names: Vec<&str> = g.iter().map(|i| i.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "l.0.self_attn.A_log",
                "l.0.input_layernorm.weight",
                "l.0.self_attn.q_proj.weight",
                "l.0.block_sparse_moe.experts.0.w1.weight_scale",
                "l.0.block_sparse_moe.experts.1.w1.weight_packed",
            ]
        );
    }

    #[test]
    fn shards_hold_whole_groups_and_none_is_empty() {
        let layers: Vec<Vec<Item>> = (0..5)
            .map(|l| vec![item(&format!("l{l}"), DType::BF16, 100 * (l + 1), Some(l))])
            .collect();
        for n in 1..=7 {
            let plan = plan_shards(
                vec![item("embed", DType::BF16, 10, None)],
                layers.clone(),
                vec![item("head", DType::BF16, 10, None)],
                n,
            );
            assert_eq!(plan.len(), n.min(7));
            assert!(plan.iter().all(|s| !s.items.is_empty()), "n={n}");
            let all: Vec<String> = plan
                .iter()
                .flat_map(|s| s.items.iter().map(|i| i.name.clone()))
                .collect();
            assert_eq!(all, ["embed", "l0", "l1", "l2", "l3", "l4", "head"]);
            assert!(
                plan[0]
                    .file_name
                    .ends_with(&format!("-of-{:05}.safetensors", n.min(7)))
            );
        }
    }

    #[test]
    fn header_is_padded_and_parses() {
        let items = vec![
            item("a", DType::F32, 3, None),
            item("b\"q", DType::BF16, 5, None),
        ];
        let h = header_bytes(&items);
        let n = u64::from_le_bytes(h[..8].try_into().unwrap()) as usize;
        assert_eq!(n % 8, 0);
        assert_eq!(h.len(), 8 + n);
        let v: serde_json::Value = serde_json::from_slice(&h[8..]).unwrap();
        assert_eq!(v["a"]["data_offsets"], serde_json::json!([0, 12]));
        assert_eq!(v["b\"q"]["data_offsets"], serde_json::json!([12, 22]));
        assert_eq!(v["__metadata__"]["format"], "pt");
    }
}
