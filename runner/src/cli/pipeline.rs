//! `--pipeline`: the run split over MPI ranks (docs/SCALE-OUT.md), and the split `plan --hosts` /
//! `--host-gb` prints.
//!
//! Owns: the pipeline flags, the per-host budgets -> [`crate::pipeline::Split`], and (with the
//! `mpi` feature) the MPI [`crate::pipeline::Link`] and the run on each rank: load its layers,
//! the handshake, rank 0's report and `--out`, a clear message and a non-zero exit when a rank
//! fails. Must not: compute (the engine's pipeline drivers and executor do).

use super::*;

/// Pipeline flags (docs/SCALE-OUT.md).
#[derive(Args, Debug, Default, Clone)]
pub struct PipelineArgs {
    /// Run as one rank of a pipeline across MPI ranks (under `mpirun` or `srun`; needs a
    /// build with `--features mpi`): rank r runs a contiguous range of layers, rank 0 the
    /// request and the embedding, the last rank lm_head. Prompts: --batch-ids or --ids.
    #[arg(long)]
    pub pipeline: bool,
    /// `plan`: print the layer split over N hosts of equal memory.
    #[arg(long, value_name = "N")]
    pub hosts: Option<usize>,
    /// Each host's memory budget in GB for its layers, expert cache and (last host) lm_head,
    /// comma-separated, one per rank (`plan`: one per host). Without it every rank's layers
    /// are pinned and the split balances their bytes.
    #[arg(long, value_name = "GB,GB,...", value_delimiter = ',')]
    pub host_gb: Option<Vec<f64>>,
    /// `--pipeline`: seconds a rank waits for a message before it ends the job (default 600).
    #[arg(long, value_name = "SECS")]
    pub pipeline_timeout: Option<f64>,
}

/// The split of `spec`'s layers over `hosts` hosts: `--host-gb` budgets (less the expert
/// cache on every host and lm_head + final norms on the last), else equal and unbounded.
pub(crate) fn pipeline_split(
    a: &RunArgs,
    spec: &ModelSpec,
    hosts: usize,
) -> Result<crate::pipeline::Split, Failure> {
    let plan = Plan::new(spec, 1);
    let sizes: Vec<u64> = plan.layers.iter().map(|l| l.trunk_bytes).collect();
    let total: u64 = sizes
        .iter()
        .map(|&b| b.div_ceil(4096) * 4096)
        .sum::<u64>()
        .max(1);
    let budgets: Vec<u64> = match &a.pipe.host_gb {
        None => vec![total; hosts],
        Some(gb) => {
            if gb.len() != hosts {
                return Err(Failure::usage(format!(
                    "--host-gb gives {} budgets for {hosts} ranks: give one per rank",
                    gb.len()
                )));
            }
            let cache = match a.mem.cache_gb {
                Some(c) => crate::stream::gb_to_bytes(c, "--cache-gb")
                    .map_err(|e| Failure::usage(e.to_string()))?,
                None => 0,
            };
            let lm_head = plan.global_bytes.saturating_sub(plan.embed_bytes);
            let mut v = Vec::with_capacity(hosts);
            for (h, &g) in gb.iter().enumerate() {
                let b = crate::stream::gb_to_bytes(g, "--host-gb")
                    .map_err(|e| Failure::usage(e.to_string()))?;
                let fixed = cache + if h + 1 == hosts { lm_head } else { 0 };
                if b <= fixed {
                    return Err(Failure::usage(format!(
                        "--host-gb: host {h}'s {g} GB do not cover its fixed share ({} of \
                         expert cache{}), leaving nothing for layers",
                        crate::stream::fmt_bytes(cache),
                        if h + 1 == hosts {
                            format!(" and {} of lm_head", crate::stream::fmt_bytes(lm_head))
                        } else {
                            String::new()
                        }
                    )));
                }
                v.push(b - fixed);
            }
            v
        }
    };
    crate::pipeline::split_layers(&sizes, &budgets).map_err(|e| Failure::usage(e.to_string()))
}

/// `plan --hosts N` / `plan --host-gb LIST`: the split, one line per host.
pub(crate) fn plan_split_lines(a: &RunArgs, spec: &ModelSpec) -> Result<Vec<String>, Failure> {
    let hosts = match (&a.pipe.host_gb, a.pipe.hosts) {
        (Some(gb), Some(n)) if gb.len() != n => {
            return Err(Failure::usage(format!(
                "--hosts {n} but --host-gb gives {} budgets",
                gb.len()
            )));
        }
        (Some(gb), _) => gb.len(),
        (None, Some(n)) => n,
        (None, None) => return Ok(Vec::new()),
    };
    let s = pipeline_split(a, spec, hosts)?;
    let mut v = vec![format!(
        "pipeline split over {hosts} hosts ({}):",
        if a.pipe.host_gb.is_some() {
            "--host-gb budgets less expert cache and lm_head"
        } else {
            "equal hosts, trunk bytes balanced"
        }
    )];
    v.extend(s.report_lines().into_iter().map(|l| format!("  {l}")));
    Ok(v)
}

/// `--pipeline` in a build without the `mpi` feature.
#[cfg(not(feature = "mpi"))]
pub(crate) fn pipeline_main(_a: &RunArgs) -> Result<u8, Failure> {
    Err(Failure::usage(
        "--pipeline needs a k3-run built with the `mpi` feature (cargo build --release \
         --features mpi; docs/SCALE-OUT.md)",
    ))
}

#[cfg(feature = "mpi")]
pub(crate) use with_mpi::pipeline_main;

#[cfg(feature = "mpi")]
mod with_mpi {
    use std::time::{Duration, Instant};

    use mpi::topology::SimpleCommunicator;
    use mpi::traits::*;

    use super::*;
    use crate::pipeline::{self, Link, PipeError, PipeRequest, RankSettings, Stage};

    /// Point-to-point MPI between the ranks of `MPI_COMM_WORLD`: buffered sends (a send
    /// never waits for its receiver, so no cycle of ranks can block), polled receives with a
    /// deadline (a silent peer ends the job instead of hanging it).
    struct MpiLink {
        world: SimpleCommunicator,
        rank: usize,
        size: usize,
        timeout: Duration,
    }

    impl MpiLink {
        fn wait<T>(&self, what: &str, mut poll: impl FnMut() -> Option<T>) -> Result<T, String> {
            let t0 = Instant::now();
            let mut spins = 0u32;
            loop {
                if let Some(v) = poll() {
                    return Ok(v);
                }
                if t0.elapsed() > self.timeout {
                    return Err(format!(
                        "rank {}: no message from {what} for {:.0} s (--pipeline-timeout)",
                        self.rank,
                        self.timeout.as_secs_f64()
                    ));
                }
                spins += 1;
                if spins < 256 {
                    std::thread::yield_now();
                } else {
                    std::thread::sleep(Duration::from_micros(50));
                }
            }
        }
    }

    impl Link for MpiLink {
        fn rank(&self) -> usize {
            self.rank
        }
        fn size(&self) -> usize {
            self.size
        }
        fn send(&mut self, to: usize, bytes: &[u8]) -> Result<(), String> {
            self.world.process_at_rank(to as i32).buffered_send(bytes);
            Ok(())
        }
        fn recv_from(&mut self, from: usize) -> Result<Vec<u8>, String> {
            let p = self.world.process_at_rank(from as i32);
            self.wait(&format!("rank {from}"), || {
                p.immediate_matched_probe().map(|(m, s)| take(m, &s))
            })
        }
        fn recv_any(&mut self) -> Result<(usize, Vec<u8>), String> {
            let p = self.world.any_process();
            self.wait("any rank", || {
                p.immediate_matched_probe().map(|(m, s)| {
                    let from = s.source_rank() as usize;
                    (from, take(m, &s))
                })
            })
        }
    }

    /// The bytes of a probed message.
    fn take(m: mpi::point_to_point::Message, s: &mpi::point_to_point::Status) -> Vec<u8> {
        let n = s.count(u8::equivalent_datatype()).max(0) as usize;
        let mut buf = vec![0u8; n];
        m.matched_receive_into(&mut buf[..]);
        buf
    }

    /// Ends the whole job from this rank (every rank is killed, `mpirun` exits non-zero).
    fn abort(world: &SimpleCommunicator, code: u8) -> ! {
        world.abort(code as i32)
    }

    /// How long a rank other than 0 stays after a SIGTERM (then it leaves with exit 1):
    /// longer than mpirun's wait between its SIGTERM and its SIGKILL (1 s,
    /// `odls_base_sigkill_timeout`), so mpirun's SIGKILL, sent once rank 0 has gone, ends it.
    const WORKER_SIGTERM_HOLD: Duration = Duration::from_secs(2);

    /// SIGTERM on every rank, so rank 0 says why it is going away when `mpirun` ends the job
    /// (after another rank died or failed) instead of vanishing silently.
    ///
    /// mpirun (Open MPI 4.1) ends a job by sending every remaining rank SIGCONT, then 1 s
    /// later SIGTERM, then waits up to 1 s (`odls_base_sigkill_timeout`) before SIGKILL; but
    /// that wait ends at the first SIGCHLD, so the SIGKILL follows as soon as any one rank
    /// has died of the SIGTERM. With only rank 0 handling SIGTERM, the others died of it at
    /// once and rank 0 had 0.1-2 ms to write its line: on a loaded host it was often not
    /// even scheduled by then (strace: SIGKILL 87 us after the SIGTERM was delivered).
    /// Hence: rank 0 writes the line and leaves (write(2) then _exit(2), async-signal-safe,
    /// from the handler itself, so no other thread needs to be scheduled); its exit is the
    /// SIGCHLD that ends mpirun's wait, and its pipe holds the line by then, which mpirun
    /// drains before it exits. Every other rank holds on in its handler
    /// ([`WORKER_SIGTERM_HOLD`], nanosleep(2), async-signal-safe) so that its death does
    /// not cut rank 0's second short; mpirun's SIGKILL ends it, or it leaves by itself
    /// when the SIGTERM came from elsewhere (a scheduler's SIGTERM and later SIGKILL).
    fn handle_sigterm(rank: usize) {
        use signal_hook::consts::SIGTERM;
        let line: &'static [u8] = format!(
            "k3-run: error: pipeline rank {rank}: the job was ended from outside (SIGTERM; \
             mpirun does this when another rank died or failed: its message names the rank); \
             no ids for the unfinished sequences\n"
        )
        .into_bytes()
        .leak();
        #[cfg(unix)]
        {
            let code = exit::FORWARD as libc::c_int;
            let hold = libc::timespec {
                tv_sec: WORKER_SIGTERM_HOLD.as_secs() as libc::time_t,
                tv_nsec: 0,
            };
            // SAFETY: the handler calls only write(2), nanosleep(2) and _exit(2), which are
            // async-signal-safe, on a buffer that lives for the rest of the process and on
            // timespecs of its own stack.
            let _ = unsafe {
                signal_hook::low_level::register(SIGTERM, move || {
                    if rank == 0 {
                        libc::write(2, line.as_ptr().cast(), line.len());
                    } else {
                        let mut left = hold;
                        let mut rem = libc::timespec {
                            tv_sec: 0,
                            tv_nsec: 0,
                        };
                        while libc::nanosleep(&left, &mut rem) != 0 {
                            left = rem;
                        }
                    }
                    libc::_exit(code);
                })
            };
        }
        #[cfg(not(unix))]
        if rank == 0 {
            if let Ok(mut s) = signal_hook::iterator::Signals::new([SIGTERM]) {
                std::thread::spawn(move || {
                    if s.forever().next().is_some() {
                        use std::io::Write;
                        let _ = std::io::stderr().write_all(line);
                        std::process::exit(exit::FORWARD as i32);
                    }
                });
            }
        }
    }

    pub(crate) fn pipeline_main(a: &RunArgs) -> Result<u8, Failure> {
        let Some((mut universe, _)) = mpi::initialize_with_threading(mpi::Threading::Single) else {
            return Err(Failure::usage("--pipeline: MPI was already initialised"));
        };
        let world = universe.world();
        let (rank, size) = (world.rank() as usize, world.size() as usize);
        handle_sigterm(rank);
        let timeout = Duration::from_secs_f64(a.pipe.pipeline_timeout.unwrap_or(600.0).max(1.0));
        // Everything that can fail before the handshake is this rank's load status.
        let prepared = prepare(a, size);
        let prompts = prepared
            .as_ref()
            .map(|p| p.prompts.clone())
            .unwrap_or_default();
        // Buffered sends: room for one item of every sequence in flight (and the results).
        if let Ok(p) = &prepared {
            universe.set_buffer_size(p.send_buffer_bytes);
        } else {
            universe.set_buffer_size(1 << 20);
        }
        let mut link = MpiLink {
            world: universe.world(),
            rank,
            size,
            timeout,
        };
        let (split, n_layers) = match &prepared {
            Ok(p) => (Some(p.split.clone()), p.spec.n_layers),
            Err(_) => (None, 0),
        };
        let model_dir = a.model_dir.clone().unwrap_or_default();
        // Load this rank's layers.
        let ckpt = prepared.as_ref().map_err(|f| f.msg.clone()).and_then(|p| {
            Checkpoint::open_with(
                &model_dir,
                &p.spec,
                &crate::checkpoint::OpenOptions {
                    validate_expert_scales: false,
                },
            )
            .map_err(|e| e.to_string())
        });
        let built = match (&prepared, &ckpt) {
            (Ok(p), Ok(ck)) => build_stage(a, p, ck, rank),
            (Err(f), _) => Err(f.msg.clone()),
            (_, Err(e)) => Err(e.clone()),
        };
        let status = built.as_ref().map(|_| ()).map_err(|e| e.clone());
        if let Err(e) = &status {
            say!("pipeline rank {rank}: cannot load its layers: {e}");
        }
        if rank == 0 {
            let Some(split) = split.as_ref() else {
                let msg = status.clone().err().unwrap_or_default();
                say!("k3-run: error: pipeline rank 0: {msg}");
                abort(&world, exit::USAGE);
            };
            if let Err(e) = pipeline::start_first(&mut link, split, n_layers, status) {
                return Err(Failure {
                    code: exit::FORWARD,
                    msg: format!("pipeline: {e}"),
                });
            }
        } else {
            let dummy = crate::pipeline::Split {
                ranges: Vec::new(),
                trunk_bytes: Vec::new(),
                budgets: Vec::new(),
            };
            let r = pipeline::start_worker(
                &mut link,
                split.as_ref().unwrap_or(&dummy),
                n_layers,
                status,
            );
            match r {
                Ok(()) => {}
                // Rank 0 has this rank's status and ends the job non-zero with the message; a
                // non-zero exit here would let mpirun end rank 0 before it says why.
                Err(PipeError::Stopped | PipeError::Load(_)) => return Ok(exit::OK),
                Err(_) => return Ok(exit::FORWARD),
            }
        }
        let mut stage = built.expect("a failed load ended the run at the handshake");
        if rank == 0 {
            let p = prepared.as_ref().expect("loaded");
            let req = PipeRequest {
                prompts,
                n_gen: a.n_gen,
                stop_ids: a.stop_ids.clone(),
                hop_trips: 21,
            };
            let mut on_id = |b: usize, id: u32| {
                println!("sequence {b}: id {id}");
                true
            };
            match pipeline::run_first(&mut link, &mut stage, &req, &mut on_id) {
                Ok((res, rep)) => finish_first(a, p, &res, &rep),
                Err(e) => {
                    let code = match &e {
                        PipeError::Exec(ExecError::Weight(WeightError::Expert { .. })) => {
                            exit::EXPERT_LOAD
                        }
                        _ => exit::FORWARD,
                    };
                    say!("k3-run: error: pipeline: {e}");
                    abort(&world, code);
                }
            }
        } else {
            match pipeline::run_worker(&mut link, &mut stage) {
                Ok(()) => Ok(exit::OK),
                Err(e) => {
                    say!("pipeline rank {rank}: {e}");
                    // rank 0 was told and ends the job; if it cannot, end it from here
                    std::thread::sleep(Duration::from_secs(10));
                    abort(&world, exit::FORWARD);
                }
            }
        }
    }

    /// What every rank works out from the same arguments before loading.
    struct Prepared {
        spec: ModelSpec,
        split: crate::pipeline::Split,
        prompts: Vec<Vec<u32>>,
        positions: usize,
        send_buffer_bytes: usize,
    }

    fn prepare(a: &RunArgs, size: usize) -> Result<Prepared, Failure> {
        let model_dir = a
            .model_dir
            .as_deref()
            .ok_or_else(|| Failure::usage("a model directory is required (see --help)"))?;
        let prompts = match (&a.batch_ids, &a.ids) {
            (Some(b), _) => batch_prompts(b)?,
            (None, Some(ids)) => vec![ids.clone()],
            (None, None) => {
                return Err(Failure::usage(
                    "--pipeline takes its prompts as --batch-ids or --ids",
                ));
            }
        };
        if prompts.iter().any(Vec::is_empty) {
            return Err(Failure::usage("--pipeline: a prompt is empty"));
        }
        if a.n_gen > 4096 {
            return Err(Failure::usage(format!(
                "--gen {} exceeds the maximum of 4096",
                a.n_gen
            )));
        }
        let (spec, _files) = run_spec_files(a, model_dir)?;
        check_prompts_in_vocab(&prompts, spec.vocab_size, "")?;
        let split = pipeline_split(a, &spec, size)?;
        let longest = prompts.iter().map(Vec::len).max().unwrap_or(0);
        let positions = context_positions(
            a.max_context,
            longest + a.n_gen,
            &format!("the longest prompt ({longest}) + --gen {}", a.n_gen),
        )?;
        let plan = with_prefill_chunk(a, Plan::new(&spec, positions))?;
        let blocks = plan.buffers.max_attn_res_sources;
        let item = crate::pipeline::wire::work_bytes(
            plan.prefill_chunk.max(1),
            spec.d_model * (blocks + 1),
            blocks,
        );
        let result = 64 + 4 * spec.vocab_size;
        let send_buffer_bytes =
            (prompts.len() + 2) * (item.max(result) + 1024) + (4 << 20) + 64 * spec.d_model;
        Ok(Prepared {
            spec,
            split,
            prompts,
            positions,
            send_buffer_bytes,
        })
    }

    fn build_stage<'c>(
        a: &RunArgs,
        p: &'c Prepared,
        ckpt: &'c Checkpoint,
        rank: usize,
    ) -> Result<Stage<'c, 'c>, String> {
        let (settings, _notes) = memory_settings(a).map_err(|f| f.msg)?;
        let rs = RankSettings {
            layers: p.split.ranges[rank].clone(),
            trunk_budget: p.split.budgets[rank],
            cache_budget: settings.cache_budget_bytes,
            io: settings.io.clone(),
        };
        let (providers, pinned, lines) =
            pipeline::rank_providers(&p.spec, ckpt, &rs).map_err(|e| e.to_string())?;
        let threads = run_threads(a).map_err(|f| f.msg)?;
        let plan = with_prefill_chunk(a, Plan::new(&p.spec, p.positions)).map_err(|f| f.msg)?;
        let exec = Executor::new(&p.spec, plan, threads);
        say!(
            "pipeline rank {rank} (pid {}): layers {}..{} of {}",
            std::process::id(),
            rs.layers.start,
            rs.layers.end,
            p.spec.n_layers
        );
        for l in lines {
            say!("  rank {rank}: {l}");
        }
        Ok(Stage::new(&p.spec, exec, providers, rs.layers, pinned))
    }

    fn finish_first(
        a: &RunArgs,
        p: &Prepared,
        res: &crate::run::BatchResult,
        rep: &crate::pipeline::PipelineReport,
    ) -> Result<u8, Failure> {
        for (b, s) in res.sequences.iter().enumerate() {
            println!(
                "sequence {b}: generated ids {:?}{}",
                s.generated_ids,
                s.stopped_by
                    .as_deref()
                    .map_or(String::new(), |w| format!(" (stopped: {w})"))
            );
        }
        for l in rep.lines() {
            println!("{l}");
        }
        let firsts: Vec<&[f32]> = res
            .sequences
            .iter()
            .map(|s| s.first_logits.as_slice())
            .collect();
        dump_logits(a, &firsts)?;
        let mut v = serde_json::to_value(res).map_err(|e| Failure::usage(e.to_string()))?;
        v["pipeline"] = serde_json::to_value(rep).map_err(|e| Failure::usage(e.to_string()))?;
        v["pipeline_split"] =
            serde_json::to_value(&p.split).map_err(|e| Failure::usage(e.to_string()))?;
        let bytes = serde_json::to_vec_pretty(&v).map_err(|e| Failure::usage(e.to_string()))?;
        write_atomic(&a.out, &bytes).map_err(|e| Failure {
            code: exit::OUT_WRITE,
            msg: format!("cannot write --out {}: {e}", a.out.display()),
        })?;
        Ok(exit::OK)
    }
}
