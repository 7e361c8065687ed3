//! The pipeline across ranks (`k3_engine::pipeline`, docs/SCALE-OUT.md) with ranks as threads joined
//! by channels: the same drivers, messages and executor stage hooks the MPI ranks run, without
//! MPI. At every split (1, 2, 3 ranks; balanced and uneven) and batch size (1, 2, 4) the ids
//! and the first-step logit bits equal the single-process batch run; a rank that cannot load
//! its layers, or fails mid-run, ends the run on rank 0 with its message.

use std::ops::Range;
use std::time::Duration;

use k3_conformance::{Fixture, open_model};
use k3_engine::checkpoint::Checkpoint;
use k3_engine::exec::Executor;
use k3_engine::pipeline::{
    self, PipeError, PipeRequest, RankSettings, Split, Stage, local::links, split_layers,
};
use k3_engine::plan::Plan;
use k3_engine::run::{BatchResult, generate_batch};
use k3_models::spec::ModelSpec;

const PROMPTS: [&[u32]; 4] = [&[1, 2, 3], &[4, 5], &[7], &[9, 8, 7, 6, 5, 4, 3]];
const N_GEN: usize = 5;
const POSITIONS: usize = 16;

fn single(spec: &ModelSpec, ckpt: &Checkpoint, prompts: &[Vec<u32>]) -> BatchResult {
    let mut w = k3_conformance::resident(spec, ckpt);
    let mut exec = Executor::new(spec, Plan::new(spec, POSITIONS), 1);
    generate_batch(spec, &mut exec, &mut w, prompts, N_GEN, &[], &mut |_, _| {
        true
    })
    .unwrap()
}

fn split_of(spec: &ModelSpec, ranges: &[Range<usize>]) -> Split {
    let plan = Plan::new(spec, 1);
    Split {
        ranges: ranges.to_vec(),
        trunk_bytes: ranges
            .iter()
            .map(|r| plan.layers[r.clone()].iter().map(|l| l.trunk_bytes).sum())
            .collect(),
        budgets: vec![u64::MAX / 2; ranges.len()],
    }
}

/// Run the pipeline with one thread per range of `split` (`layers_of[r]` overrides the
/// layers rank r actually loads; `fail[r]` makes rank r report a failed load). Rank 0's
/// outcome.
fn pipelined(
    spec: &ModelSpec,
    ckpt: &Checkpoint,
    split: &Split,
    layers_of: &[Range<usize>],
    fail: &[Option<&str>],
    prompts: &[Vec<u32>],
) -> Result<(BatchResult, pipeline::PipelineReport), PipeError> {
    let n = split.ranges.len();
    // A failing run leaves the ranks after the failed one waiting: they give up after 3 s.
    let wait = if fail.iter().any(Option::is_some) || layers_of != split.ranges.as_slice() {
        3
    } else {
        60
    };
    let ls = links(n, Duration::from_secs(wait));
    std::thread::scope(|sc| {
        let mut handles = Vec::new();
        for (rank, mut link) in ls.into_iter().enumerate() {
            let layers = layers_of[rank].clone();
            let fail = fail[rank];
            handles.push(sc.spawn(move || {
                let rs = RankSettings {
                    layers: layers.clone(),
                    // the second rank pins only part of its layers: mapped layers serve too
                    trunk_budget: if rank == 1 { 300_000 } else { u64::MAX / 2 },
                    cache_budget: (rank == 2).then_some(2_000_000),
                    io: k3_engine::stream::io_policy::IoPolicy::direct(),
                };
                let (providers, pinned, _) = pipeline::rank_providers(spec, ckpt, &rs).unwrap();
                let exec = Executor::new(spec, Plan::new(spec, POSITIONS), 1);
                // the stage runs the split's layers, whatever its trunk loaded
                let mut stage =
                    Stage::new(spec, exec, providers, split.ranges[rank].clone(), pinned);
                let status = match fail {
                    Some(e) => Err(e.to_string()),
                    None => Ok(()),
                };
                if rank == 0 {
                    pipeline::start_first(&mut link, split, spec.n_layers, status)?;
                    let req = PipeRequest {
                        prompts: prompts.to_vec(),
                        n_gen: N_GEN,
                        stop_ids: Vec::new(),
                        hop_trips: 3,
                    };
                    pipeline::run_first(&mut link, &mut stage, &req, &mut |_, _| true).map(Some)
                } else {
                    pipeline::start_worker(&mut link, split, spec.n_layers, status)?;
                    pipeline::run_worker(&mut link, &mut stage).map(|()| None)
                }
            }));
        }
        let mut first = None;
        for (rank, h) in handles.into_iter().enumerate() {
            let r: Result<_, PipeError> = h.join().expect("a rank panicked");
            if rank == 0 {
                first = Some(r);
            }
        }
        first
            .unwrap()
            .map(|o| o.expect("rank 0 returns the result"))
    })
}

fn assert_same(a: &BatchResult, b: &BatchResult, what: &str) {
    assert_eq!(a.sequences.len(), b.sequences.len(), "{what}");
    for (i, (x, y)) in a.sequences.iter().zip(&b.sequences).enumerate() {
        assert_eq!(x.generated_ids, y.generated_ids, "{what}: sequence {i} ids");
        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        assert_eq!(
            bits(&x.first_logits),
            bits(&y.first_logits),
            "{what}: sequence {i} first-step logits"
        );
        assert_eq!(x.first_logits_hash, y.first_logits_hash, "{what}");
    }
}

#[test]
fn every_split_and_batch_size_gives_the_single_process_bits() {
    for name in ["A", "B"] {
        let fx = Fixture::load(name);
        let (spec, ckpt) = open_model(&fx.ckpt_dir);
        let n = spec.n_layers;
        let plan = Plan::new(&spec, 1);
        let sizes: Vec<u64> = plan.layers.iter().map(|l| l.trunk_bytes).collect();
        let balanced3 = split_layers(&sizes, &[1, 1, 1]).unwrap().ranges;
        let uneven = split_layers(&sizes, &[1, 3]).unwrap().ranges;
        assert!(uneven[0].len() < uneven[1].len(), "{uneven:?}");
        let splits: Vec<Vec<Range<usize>>> = vec![
            vec![0..n],
            vec![0..n / 2, n / 2..n],
            uneven,
            balanced3,
            vec![0..1, 1..n - 1, n - 1..n],
        ];
        for batch in [1usize, 2, 4] {
            let prompts: Vec<Vec<u32>> = PROMPTS[..batch].iter().map(|p| p.to_vec()).collect();
            let want = single(&spec, &ckpt, &prompts);
            for ranges in &splits {
                let split = split_of(&spec, ranges);
                let fail = vec![None; ranges.len()];
                let (got, rep) = pipelined(&spec, &ckpt, &split, ranges, &fail, &prompts).unwrap();
                let what = format!("fixture {name}, batch {batch}, split {ranges:?}");
                assert_same(&want, &got, &what);
                assert_eq!(rep.ranks.len(), ranges.len(), "{what}");
                assert_eq!(rep.generated, (batch * N_GEN) as u64, "{what}");
                for (r, rr) in rep.ranks.iter().enumerate() {
                    assert_eq!(rr.layers, (ranges[r].start, ranges[r].end), "{what}");
                    assert!(
                        rr.items > 0 && rr.tokens > 0,
                        "{what}: rank {r} did nothing"
                    );
                    // rank 1 pins part of its layers only (300 kB): the others are mapped
                    if r == 1 {
                        assert!(rr.pinned_layers < ranges[1].len(), "{what}");
                        assert!(rr.trunk_bytes_read > 0, "{what}");
                    } else {
                        assert_eq!(rr.pinned_layers, ranges[r].len(), "{what}");
                        assert_eq!(rr.trunk_bytes_read, 0, "{what}: pinned rank read trunk");
                    }
                }
            }
        }
    }
}

#[test]
fn a_rank_that_cannot_load_ends_the_run_on_rank_0() {
    let fx = Fixture::load("A");
    let (spec, ckpt) = open_model(&fx.ckpt_dir);
    let ranges = vec![0..4, 4..8, 8..13];
    let split = split_of(&spec, &ranges);
    let prompts = vec![vec![1, 2, 3]];
    let fail = vec![None, None, Some("no space for layers 8..13")];
    match pipelined(&spec, &ckpt, &split, &ranges, &fail, &prompts) {
        Err(e @ PipeError::Load(_)) => {
            let msg = e.to_string();
            assert!(
                msg.contains("rank 2 could not load its layers: no space for layers 8..13"),
                "{msg}"
            );
        }
        other => panic!("expected a load failure, got {:?}", other.map(|_| ())),
    }
}

#[test]
fn a_rank_that_fails_mid_run_ends_the_run_on_rank_0() {
    let fx = Fixture::load("A");
    let (spec, ckpt) = open_model(&fx.ckpt_dir);
    let ranges = vec![0..4, 4..8, 8..13];
    let split = split_of(&spec, &ranges);
    // rank 1 holds layers 4..7 only: its first item asks for layer 7, which it does not have
    let loaded = vec![0..4, 4..7, 8..13];
    let prompts = vec![vec![1, 2, 3], vec![4, 5]];
    let fail = vec![None; 3];
    match pipelined(&spec, &ckpt, &split, &loaded, &fail, &prompts) {
        Err(PipeError::Rank { rank: 1, msg }) => {
            assert!(
                msg.contains("layer 7 is not on this pipeline rank"),
                "{msg}"
            );
        }
        other => panic!("expected rank 1's failure, got {:?}", other.map(|_| ())),
    }
}
