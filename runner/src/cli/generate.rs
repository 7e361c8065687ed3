use super::*;

pub(crate) fn run_main(a: &RunArgs) -> Result<u8, Failure> {
    // time to first token counts from here: config, checkpoint open, session build (pinned
    // prefix load), state check, prefill, first token
    let run_start = std::time::Instant::now();
    if a.mem.list_presets {
        let t =
            crate::stream::presets::list_presets().map_err(|e| Failure::usage(e.to_string()))?;
        print!("{t}");
        return Ok(exit::OK);
    }
    if a.pipe.pipeline {
        if a.chat.chat || a.chat.serve.is_some() {
            return Err(Failure::usage(
                "--pipeline runs --batch-ids / --ids requests; --chat and --serve are not \
                 pipelined yet (docs/SCALE-OUT.md)",
            ));
        }
        return pipeline_main(a);
    }
    if a.chat.chat || a.chat.serve.is_some() {
        for (given, flag, what) in [
            (
                a.dump_logits.is_some(),
                "--dump-logits",
                "is written by a --ids / --prompt / --batch-ids run; --chat and --serve do not write it",
            ),
            (
                a.dump_layer_logits.is_some(),
                "--dump-layer-logits",
                "is written by a --ids / --prompt run; --chat and --serve do not write it",
            ),
            (
                a.dump_prompt_logits.is_some(),
                "--dump-prompt-logits",
                "is written by a --ids / --prompt run; --chat and --serve do not write it",
            ),
            (
                a.mem.dump_cache_trace.is_some(),
                "--dump-cache-trace",
                "is written by a --ids / --prompt / --batch-ids run; --chat and --serve do not write it",
            ),
            (
                a.save_state.is_some(),
                "--save-state",
                "saves the state of a --ids / --prompt prefill (--gen 0); --chat keeps its conversation with --history, --serve keeps none",
            ),
            (
                a.load_state.is_some(),
                "--load-state",
                "resumes a --ids / --prompt run; --chat resumes a conversation from --history (re-prefilled), --serve starts every request afresh",
            ),
        ] {
            if given {
                return Err(Failure::usage(format!("{flag} {what}")));
            }
        }
        return chat_main(a);
    }
    if a.chat.no_think || a.chat.thinking_effort.is_some() {
        return Err(Failure::usage(
            "--no-think and --thinking-effort shape a chat prompt: use them with --chat or \
             --serve (docs/CHAT.md)",
        ));
    }
    if a.batch_ids.is_some() {
        for (given, flag) in [
            (a.dump_layer_logits.is_some(), "--dump-layer-logits"),
            (a.dump_prompt_logits.is_some(), "--dump-prompt-logits"),
        ] {
            if given {
                return Err(Failure::usage(format!(
                    "{flag} is written by a --ids / --prompt run (one prompt); --batch-ids \
                     does not write it"
                )));
            }
        }
        return batch_main(a);
    }
    let model_dir = a
        .model_dir
        .as_deref()
        .ok_or_else(|| Failure::usage("a model directory is required (see --help)"))?;
    let tokenizer = run_tokenizer(a)?;
    let prompt = prompt_ids(a, tokenizer.as_ref())?;
    if prompt.is_empty() {
        return Err(Failure::usage("the prompt is empty"));
    }
    if prompt.len() > 32768 {
        return Err(Failure::usage(format!(
            "the prompt has {} tokens; the maximum is 32768",
            prompt.len()
        )));
    }
    if a.n_gen > 4096 {
        return Err(Failure::usage(format!(
            "--gen {} exceeds the maximum of 4096",
            a.n_gen
        )));
    }
    if a.stop_ids.len() > 8 {
        return Err(Failure::usage("at most 8 --stop-id values"));
    }
    if a.dump_layer_logits.is_some() && a.dump_prompt_logits.is_some() {
        return Err(Failure::usage(
            "--dump-layer-logits and --dump-prompt-logits both need the last prompt chunk's \
             logits computed their own way: give one per run",
        ));
    }
    let speculation = crate::speculate::from_flag(a.speculate).map_err(Failure::usage)?;
    if speculation.is_some() && !a.incremental {
        return Err(Failure::usage(
            "--speculate verifies guesses on the incremental state: add --incremental",
        ));
    }
    let (settings, notes) = memory_settings(a)?;
    let (spec, files) = run_spec_files(a, model_dir)?;
    let mut drafter = super::plugins_cmd::run_drafter(a, &spec, speculation)?;
    let drafter_name = drafter.as_ref().map(|d| d.name().to_string());
    if let Some(bad) = prompt.iter().find(|&&t| t as usize >= spec.vocab_size) {
        let from = if a.ids.is_some() {
            "--ids"
        } else {
            "the tokenized prompt (--tok's tokenizer does not fit this model)"
        };
        return Err(Failure::usage(format!(
            "{from}: token {bad} is outside the vocabulary (size {})",
            spec.vocab_size
        )));
    }
    if a.dump_prompt_logits.is_some() {
        // the rows are held until the run ends: refused up front if they would crowd it out
        let bytes = prompt.len() as u64 * spec.vocab_size as u64 * 4;
        if let Some(limit) = crate::platform::memory::memory_limit_bytes()
            && bytes > limit / 4
        {
            return Err(Failure::usage(format!(
                "--dump-prompt-logits: {} prompt tokens x {} vocabulary x 4 bytes = {} held in \
                 memory, over a quarter of the {} available: use a shorter prompt",
                prompt.len(),
                spec.vocab_size,
                crate::stream::fmt_bytes(bytes),
                crate::stream::fmt_bytes(limit)
            )));
        }
    }
    let ckpt = open_checkpoint(model_dir, &spec, &settings, &a.mem, files)?;
    let threads = run_threads(a)?;
    if a.save_state.is_some() && a.n_gen != 0 {
        return Err(Failure::usage(
            "--save-state saves the state after the prompt: use it with --gen 0",
        ));
    }
    let (start, prefix_ids) = match &a.load_state {
        Some(p) => crate::statefile::load(p, &spec, ckpt.weights_fingerprint(&spec).as_deref())
            .map_err(|e| Failure::usage(e.to_string()))?,
        None => (crate::exec::SeqState::new(&spec), Vec::new()),
    };
    if !prefix_ids.is_empty() {
        eprintln!(
            "resuming from {} saved positions ({})",
            prefix_ids.len(),
            a.load_state
                .as_deref()
                .map_or(String::new(), |p| p.display().to_string())
        );
    }
    let needed = prefix_ids.len() + prompt.len() + a.n_gen;
    let positions = context_positions(
        a.max_context,
        needed,
        &if prefix_ids.is_empty() {
            format!("the prompt ({}) + --gen {}", prompt.len(), a.n_gen)
        } else {
            format!(
                "{} positions of --load-state + the prompt ({}) + --gen {}",
                prefix_ids.len(),
                prompt.len(),
                a.n_gen
            )
        },
    )?;
    let mut plan = with_prefill_chunk(a, Plan::new(&spec, positions))?;
    eprintln!(
        "k3-run {}: {} ({} layers, d_model {}, vocab {}), {} threads, {} kernels",
        env!("CARGO_PKG_VERSION"),
        spec.name,
        spec.n_layers,
        spec.d_model,
        spec.vocab_size,
        threads,
        k3_kernels::isa::active().name()
    );
    if let Some(all) = spec.truncated_from {
        eprintln!(
            "--layers {}: only the first {} of {all} layers are bound (a diagnostic: the output is not the whole model's)",
            spec.n_layers, spec.n_layers
        );
    }
    for n in &notes {
        eprintln!("{n}");
    }
    // measured before the session allocates: afterwards its own pages count as used
    let mem_limit = crate::platform::memory::memory_limit();
    let mut session =
        crate::session::build_with(&spec, &ckpt, &plan, &settings, resident_mode(&a.mem)?)
            .map_err(stream_failure)?;
    eprintln!("memory plan:");
    for l in &session.startup {
        eprintln!("  {l}");
    }
    eprintln!("  {}", mem_limit.report_line());
    // features this platform lacks (huge pages, memory caps) are said, not silently skipped
    if let Some(l) = crate::platform::absent_line() {
        eprintln!("  {l}");
    }
    let state_line =
        check_states_and_chunk(a, &mut plan, &session, (positions, 1), mem_limit.bytes())?;
    eprintln!("  {state_line}");
    // first Ctrl-C: finish the step in progress and stop; second: the default action (kill)
    let interrupted = ctrl_c_flag(130);
    let mut exec = Executor::new(&spec, plan, threads);
    if let Some(l) = session.configure_pool(exec.pool()) {
        eprintln!("  {l}");
    }
    let req = GenRequest {
        prompt_ids: prompt,
        n_gen: a.n_gen,
        incremental: a.incremental,
        stop_ids: a.stop_ids.clone(),
    };
    let providers = &mut session.providers;
    let time_to_first_token = std::cell::Cell::new(None::<f64>);
    let decoder = std::cell::RefCell::new(k3_text::tokenizer::Decoder::default());
    // A long prompt on a streamed trunk can take minutes per pass: progress on a terminal,
    // cleared before the first token is printed.
    let res = with_prompt_progress(&mut exec, Some(req.prompt_ids.len()), |exec, bar| {
        let mut on_token = |i: usize, id: u32, t: f64| {
            if i == 0 {
                if let Some(b) = bar {
                    b.finish_and_clear();
                }
                time_to_first_token.set(Some(run_start.elapsed().as_secs_f64()));
            }
            match &tokenizer {
                // The text as it completes (a piece may wait for the rest of a UTF-8 character).
                Some(tok) => {
                    let piece = decoder.borrow_mut().push(tok, id).unwrap_or_default();
                    println!("token {i:>4}: {id:>7}  ({t:.3} s)  {piece:?}");
                }
                None => println!("token {i:>4}: {id:>7}  ({t:.3} s)"),
            }
            !interrupted.load(Ordering::Relaxed)
        };
        let opts = run::GenOptions {
            speculate: speculation,
            layer_logits: a.dump_layer_logits.is_some(),
            prompt_logits: a.dump_prompt_logits.is_some(),
        };
        run::generate_with_drafter(
            &spec,
            exec,
            providers,
            &req,
            start,
            opts,
            drafter.take(),
            &mut on_token,
        )
    });
    let mut spec_stats = None;
    let res = res.map(|(r, st, end)| {
        spec_stats = st;
        (r, end)
    });
    let res = match res {
        Ok((r, end_state)) => {
            // A run stopped by an expert that failed to load has no trustworthy state.
            let failed = r
                .stopped_by
                .as_deref()
                .is_some_and(|s| s.starts_with("expert load failed"));
            if let Some(p) = a.save_state.as_ref().filter(|_| !failed) {
                let ids: Vec<u32> = prefix_ids.iter().chain(&req.prompt_ids).copied().collect();
                let fp = ckpt.weights_fingerprint(&spec);
                crate::statefile::save(p, &spec, fp, &end_state, &ids).map_err(|e| Failure {
                    code: exit::OUT_WRITE,
                    msg: e.to_string(),
                })?;
                eprintln!(
                    "saved the state after {} positions to {}",
                    ids.len(),
                    p.display()
                );
            }
            r
        }
        Err(e) => {
            let expert_failures = providers.experts.stats().load_failures;
            let f = exec_failure(e);
            if expert_failures > 0 {
                return Err(Failure {
                    code: exit::EXPERT_LOAD,
                    msg: f.msg,
                });
            }
            return Err(f);
        }
    };
    let trunk = providers.trunk.stats();
    let experts = providers.experts.stats();
    let peak = run::peak_rss_bytes();
    // A pinned prefix loaded in the session build (K3_PIN_SYNC=1) is before the run's clock:
    // not in the share. A background load is counted by what the run waited for it.
    let run_trunk_seconds =
        (trunk.read_seconds - trunk.pinned_load_seconds).max(0.0) + trunk.pinned_wait_seconds;
    // The share is of time the executor was BLOCKED on reads: with a reader thread the trunk's
    // reads overlap compute (their seconds can exceed the wall clock), so its waits count.
    let trunk_blocked = if trunk.reader_thread {
        if trunk.pinned_background {
            trunk.wait_seconds
        } else {
            (trunk.wait_seconds - trunk.pinned_load_seconds).max(0.0)
        }
    } else {
        run_trunk_seconds
    };
    let total_io = trunk_blocked + experts.read_seconds;
    let io_share = if res.total_seconds > 0.0 {
        total_io / res.total_seconds
    } else {
        0.0
    };
    println!("generated ids: {:?}", res.generated_ids);
    let generated_text = match &tokenizer {
        Some(tok) => Some(
            tok.decode_lossy(&res.generated_ids)
                .map_err(|e| Failure::usage(e.to_string()))?,
        ),
        None => None,
    };
    if let Some(t) = &generated_text {
        println!("generated text: {t:?}");
    }
    println!(
        "first token {:.3} s, decode {:.4} s/token ({} mode), first-step logits hash {}",
        res.first_token_seconds,
        res.seconds_per_token,
        if a.incremental {
            "incremental"
        } else {
            "full recompute"
        },
        res.first_logits_hash
    );
    if let Some(st) = &spec_stats {
        println!(
            "speculation{}: {} passes for {} tokens ({:.2} per pass); {} guesses, {} accepted \
             ({:.0}%), {} rewinds",
            drafter_name
                .as_deref()
                .map_or_else(String::new, |n| format!(" ({n})")),
            st.passes,
            res.generated_ids.len(),
            if st.passes > 0 {
                // the first id comes from the prefill; each pass yields its accepted guesses
                // plus one id
                (res.generated_ids.len().saturating_sub(1)) as f64 / st.passes as f64
            } else {
                0.0
            },
            st.drafted,
            st.accepted,
            if st.drafted > 0 {
                100.0 * st.accepted as f64 / st.drafted as f64
            } else {
                0.0
            },
            st.rewinds
        );
    }
    let time_to_first_token = time_to_first_token.get();
    if let Some(ttft) = time_to_first_token {
        if trunk.pinned_background {
            println!(
                "time to first token {:.3} s (start-up {:.3} s, then prefill + first token {:.3} s; the pinned prefix loaded beside them in {:.3} s, the run waited {:.3} s for it)",
                ttft,
                ttft - res.first_token_seconds,
                res.first_token_seconds,
                trunk.pinned_load_seconds,
                trunk.pinned_wait_seconds
            );
        } else {
            // What start-up spent its time on, of the loads that apply to this run.
            let mut incl = Vec::new();
            if trunk.pinned_load_seconds > 0.0 {
                incl.push(format!(
                    "pinned prefix load {:.3} s",
                    trunk.pinned_load_seconds
                ));
            }
            if session.resident_load_seconds > 0.0 {
                incl.push(format!(
                    "resident load {:.3} s",
                    session.resident_load_seconds
                ));
            }
            println!(
                "time to first token {:.3} s (start-up {:.3} s{}, then prefill + first token {:.3} s)",
                ttft,
                ttft - res.first_token_seconds,
                if incl.is_empty() {
                    String::new()
                } else {
                    format!(" incl. {}", incl.join(" and "))
                },
                res.first_token_seconds
            );
        }
    }
    let other_hits = experts
        .hits
        .saturating_sub(experts.resident_hits + experts.prefetch_hits);
    println!(
        "expert cache: {} requests = {} already in RAM before the token asked (TRUE resident hit rate {:.2}%) + {} read ahead by prefetch + {} loaded earlier in the same token + {} read from disk; {} evictions",
        experts.requests,
        experts.resident_hits,
        100.0 * experts.resident_hit_rate(),
        experts.prefetch_hits,
        other_hits,
        experts.misses,
        experts.evictions,
    );
    if experts.prefetched > 0 {
        println!(
            "expert prefetch: {} read ahead in {:.3} s (waited {:.3} s), {} requests served by them, {} wasted, guesses covered {:.2}% of routed ids",
            experts.prefetched,
            experts.prefetch_read_seconds,
            experts.prefetch_wait_seconds,
            experts.prefetch_hits,
            experts.prefetch_wasted,
            100.0 * experts.guess_accuracy()
        );
    }
    println!(
        "I/O share of wall clock: {:.1}% = time the executor waited for reads (trunk {:.3} s + experts {:.3} s) of {:.3} s; {}{}",
        100.0 * io_share,
        trunk_blocked,
        experts.read_seconds,
        res.total_seconds,
        if trunk.pinned_background {
            "the waits for the pinned prefix loading in the background are in it"
        } else {
            "the pinned-prefix load at start-up is not in it"
        },
        if trunk.reader_thread {
            // Reader-thread reads overlap compute: their own seconds can exceed the wall clock.
            format!(
                "; the trunk's reads ran beside compute for {:.3} s",
                run_trunk_seconds
            )
        } else {
            String::new()
        }
    );
    println!(
        "trunk: pinned {}/{} layers, ring {} x {}{}, {:.3} GB read in {:.3} s ({:.0} MB/s){}",
        trunk.pinned_layers,
        trunk.n_layers,
        trunk.ring_slots,
        crate::stream::fmt_bytes(trunk.ring_slot_bytes),
        if trunk.shared_ring_bytes > 0 {
            format!(
                " (shared ring {})",
                crate::stream::fmt_bytes(trunk.shared_ring_bytes)
            )
        } else {
            String::new()
        },
        trunk.bytes_read as f64 / 1e9,
        trunk.read_seconds,
        if trunk.read_seconds > 0.0 {
            trunk.bytes_read as f64 / 1e6 / trunk.read_seconds
        } else {
            0.0
        },
        match (trunk.o_direct, trunk.pinned_page_cache) {
            (true, true) => ", O_DIRECT; pinned prefix in the page cache",
            (true, false) => ", O_DIRECT",
            (false, true) => ", pinned prefix in the page cache",
            (false, false) => "",
        }
    );
    if trunk.pinned_unlocked_bytes > 0 {
        println!(
            "warning: {} of the pinned prefix in the page cache could not be locked in RAM \
             (mlock: {}; raise the locked-memory limit, `ulimit -l`): the kernel may evict \
             those pages and read them again",
            crate::stream::fmt_bytes(trunk.pinned_unlocked_bytes),
            trunk.pinned_lock_error.as_deref().unwrap_or("refused")
        );
    }
    let reserved = trunk.hugetlb_bytes + session.arena_hugetlb_bytes;
    println!(
        "PEAK RSS {:.1} MB (getrusage; quote this, not the plan){}",
        peak as f64 / 1e6,
        if reserved > 0 {
            format!(
                ", plus {:.1} MB of weight buffers on reserved huge pages (vm.nr_hugepages), \
                 which getrusage does not count",
                reserved as f64 / 1e6
            )
        } else {
            String::new()
        }
    );
    dump_logits(a, &[&res.first_logits])?;
    dump_rows(
        a.dump_layer_logits.as_deref(),
        "--dump-layer-logits",
        &res.layer_logits,
    )?;
    dump_rows(
        a.dump_prompt_logits.as_deref(),
        "--dump-prompt-logits",
        &res.prompt_logits,
    )?;
    dump_expert_trace(a, providers)?;
    let mut json = serde_json::json!({
        "model": spec.name,
        "prompt_ids": res.prompt_ids,
        "resumed_positions": prefix_ids.len(),
        "generated_ids": res.generated_ids,
        "first_logits_hash": res.first_logits_hash,
        "incremental": a.incremental,
        "threads": threads,
        "layers_bound": spec.n_layers,
        "layers_in_model": spec.truncated_from.unwrap_or(spec.n_layers),
        "isa": k3_kernels::isa::active().name(),
        "prefill_seconds": res.prefill_seconds,
        "first_token_seconds": res.first_token_seconds,
        "pinned_load_seconds": trunk.pinned_load_seconds,
        "resident_load_seconds": session.resident_load_seconds,
        "time_to_first_token_seconds": time_to_first_token,
        "seconds_per_token": res.seconds_per_token,
        "total_seconds": res.total_seconds,
        "peak_rss_bytes": peak,
        "reserved_huge_page_bytes": reserved,
        "stopped_by": res.stopped_by,
        "speculation": spec_stats,
        "memory_plan": session.startup,
        "memory_limit": {
            "bytes": mem_limit.bytes(),
            "mem_available_bytes": mem_limit.mem_available_bytes,
            "cgroup": mem_limit.cgroup,
        },
        "trunk": trunk,
        "experts": {
            "requests": experts.requests,
            "hits": experts.hits,
            "misses": experts.misses,
            "evictions": experts.evictions,
            "resident_hits": experts.resident_hits,
            "resident_hit_rate": experts.resident_hit_rate(),
            "bytes_read": experts.bytes_read,
            "read_seconds": experts.read_seconds,
            "load_failures": experts.load_failures,
            "budget_bytes": experts.budget_bytes,
            "prefetched": experts.prefetched,
            "prefetch_hits": experts.prefetch_hits,
            "prefetch_wasted": experts.prefetch_wasted,
            "prefetch_read_seconds": experts.prefetch_read_seconds,
            "prefetch_wait_seconds": experts.prefetch_wait_seconds,
            "guess_accuracy": experts.guess_accuracy(),
        },
        "io_share": io_share,
    });
    if let Some(t) = &generated_text {
        json["text"] = t.clone().into();
    }
    if a.dump_prompt_logits.is_some() {
        // the argmax after every prompt token (compare_k3.py --tf-argmax)
        json["prompt_argmax"] = res
            .prompt_logits
            .chunks(spec.vocab_size)
            .map(|l| k3_kernels::ops::argmax(l) as u32)
            .collect::<Vec<u32>>()
            .into();
    }
    let text = serde_json::to_string_pretty(&json).map_err(|e| Failure {
        code: exit::OUT_WRITE,
        msg: e.to_string(),
    })?;
    write_atomic(&a.out, text.as_bytes()).map_err(|e| Failure {
        code: exit::OUT_WRITE,
        msg: format!("cannot write --out {}: {e}", a.out.display()),
    })?;
    eprintln!(
        "wrote {} (ids, timings, memory and cache figures)",
        a.out.display()
    );
    if experts.load_failures > 0 {
        if let Some(why) = res
            .stopped_by
            .as_deref()
            .filter(|s| s.starts_with("expert load failed"))
        {
            eprintln!(
                "k3-run: stopped after {} ids: {why}",
                res.generated_ids.len()
            );
        }
        eprintln!(
            "k3-run: {} routed expert loads failed: the ids are not trustworthy (report and \
             --out written)",
            experts.load_failures
        );
        return Ok(exit::EXPERT_LOAD);
    }
    if res.stopped_by.as_deref() == Some("interrupted") {
        eprintln!("k3-run: stopped by Ctrl-C; report and --out written");
        return Ok(exit::INTERRUPTED);
    }
    Ok(exit::OK)
}

/// `--dump-logits FILE`: the first-step f32 logits (little-endian), one block per sequence in
/// prompt order (one for a single prompt, one per `--batch-ids` prompt).
pub(crate) fn dump_logits(a: &RunArgs, blocks: &[&[f32]]) -> Result<(), Failure> {
    let Some(p) = &a.dump_logits else {
        return Ok(());
    };
    let bytes: Vec<u8> = blocks
        .iter()
        .flat_map(|b| b.iter())
        .flat_map(|v| v.to_le_bytes())
        .collect();
    std::fs::write(p, bytes).map_err(|e| Failure {
        code: exit::OUT_WRITE,
        msg: format!("cannot write --dump-logits {}: {e}", p.display()),
    })
}

/// `--dump-layer-logits FILE` / `--dump-prompt-logits FILE`: rows of f32 logits,
/// little-endian ([`run::GenResult::layer_logits`], [`run::GenResult::prompt_logits`]).
pub(crate) fn dump_rows(path: Option<&Path>, flag: &str, rows: &[f32]) -> Result<(), Failure> {
    use std::io::Write;
    let Some(p) = path else {
        return Ok(());
    };
    // written through a buffer, not copied whole: the prompt's rows can be large
    let write = || -> std::io::Result<()> {
        let mut f = std::io::BufWriter::new(std::fs::File::create(p)?);
        for v in rows {
            f.write_all(&v.to_le_bytes())?;
        }
        f.into_inner().map_err(|e| e.into_error())?.sync_all()
    };
    write().map_err(|e| Failure {
        code: exit::OUT_WRITE,
        msg: format!("cannot write {flag} {}: {e}", p.display()),
    })
}

/// `--dump-cache-trace DIR`: the (layer, expert) requests the expert source recorded (resident
/// experts and the expert cache both record them when the flag is given).
pub(crate) fn dump_expert_trace(
    a: &RunArgs,
    providers: &crate::exec::Providers<'_>,
) -> Result<(), Failure> {
    let Some(dir) = &a.mem.dump_cache_trace else {
        return Ok(());
    };
    let t = providers.experts.trace().ok_or_else(|| Failure {
        code: exit::FORWARD,
        msg: format!(
            "--dump-cache-trace {}: the expert source recorded no trace (internal error)",
            dir.display()
        ),
    })?;
    crate::stream::trace::write_trace(dir, t).map_err(|e| Failure {
        code: exit::OUT_WRITE,
        msg: format!("--dump-cache-trace: {e}"),
    })?;
    let requests = t
        .iter()
        .filter(|r| r.0 != crate::stream::trace::TOKEN_MARK)
        .count();
    eprintln!(
        "expert trace: {requests} requests written to {}",
        dir.display()
    );
    Ok(())
}

/// `--chat` / `--serve`: load the model (memory flags apply) and hand it to the REPL or the
/// HTTP server.
pub(crate) fn chat_main(a: &RunArgs) -> Result<u8, Failure> {
    crate::chat::preflight(a)?;
    let model_dir = a
        .model_dir
        .as_deref()
        .ok_or_else(|| Failure::usage("a model directory is required"))?;
    let (settings, notes) = memory_settings(a)?;
    let (spec, files) = run_spec_files(a, model_dir)?;
    let ckpt = open_checkpoint(model_dir, &spec, &settings, &a.mem, files)?;
    // None: the longest context the memory holds (load_model)
    let positions = a.max_context;
    // --serve-batch N: every request in the batch holds its own decode state.
    let sequences = match a.chat.serve {
        Some(_) => crate::chat::serve::serve_batch(a)?,
        None => 1,
    };
    let (mut session, mut exec) =
        load_model(a, &spec, &ckpt, &settings, &notes, positions, sequences)?;
    crate::chat::repl_main(&spec, &mut exec, &mut session.providers, a)
}

/// `--batch-ids "A;B;..."`: parse one id list per sequence.
pub(crate) fn batch_prompts(text: &str) -> Result<Vec<Vec<u32>>, Failure> {
    let mut out = Vec::new();
    for (i, part) in text.split(';').enumerate() {
        let ids: Result<Vec<u32>, _> = part
            .split(',')
            .map(|t| t.trim())
            .filter(|t| !t.is_empty())
            .map(str::parse::<u32>)
            .collect();
        match ids {
            Ok(v) if !v.is_empty() => out.push(v),
            Ok(_) => {
                return Err(Failure::usage(format!(
                    "--batch-ids: prompt {} is empty",
                    i + 1
                )));
            }
            Err(e) => {
                return Err(Failure::usage(format!(
                    "--batch-ids: prompt {}: {e} (ids are non-negative integers, lists \
                     separated by ';')",
                    i + 1
                )));
            }
        }
    }
    if out.len() > 64 {
        return Err(Failure::usage("--batch-ids: at most 64 prompts"));
    }
    Ok(out)
}

/// `--batch-ids`: several prompts decoded together (memory flags apply).
pub(crate) fn batch_main(a: &RunArgs) -> Result<u8, Failure> {
    let model_dir = a
        .model_dir
        .as_deref()
        .ok_or_else(|| Failure::usage("a model directory is required (see --help)"))?;
    let prompts = batch_prompts(a.batch_ids.as_deref().unwrap_or(""))?;
    if a.n_gen > 4096 {
        return Err(Failure::usage(format!(
            "--gen {} exceeds the maximum of 4096",
            a.n_gen
        )));
    }
    if !a.incremental {
        return Err(Failure::usage(
            "--batch-ids decodes incrementally: add --incremental",
        ));
    }
    let (settings, notes) = memory_settings(a)?;
    let (spec, files) = run_spec_files(a, model_dir)?;
    check_prompts_in_vocab(&prompts, spec.vocab_size, "--batch-ids: ")?;
    let ckpt = open_checkpoint(model_dir, &spec, &settings, &a.mem, files)?;
    let longest = prompts.iter().map(Vec::len).max().unwrap_or(0);
    let positions = context_positions(
        a.max_context,
        longest + a.n_gen,
        &format!("the longest prompt ({longest}) + --gen {}", a.n_gen),
    )?;
    let (mut session, mut exec) = load_model(
        a,
        &spec,
        &ckpt,
        &settings,
        &notes,
        Some(positions),
        prompts.len(),
    )?;
    let interrupted = Arc::new(AtomicBool::new(false));
    let _ = signal_hook::flag::register(signal_hook::consts::SIGINT, Arc::clone(&interrupted));
    let providers = &mut session.providers;
    let trunk_before = providers.trunk.stats().bytes_read;
    let mut on_step = |i: usize, chosen: &[(usize, u32)]| {
        let ids: Vec<String> = chosen.iter().map(|(b, t)| format!("{b}:{t}")).collect();
        println!("step {i:>4}: {}", ids.join(" "));
        !interrupted.load(Ordering::Relaxed)
    };
    let res = run::generate_batch(
        &spec,
        &mut exec,
        providers,
        &prompts,
        a.n_gen,
        &a.stop_ids,
        &mut on_step,
    )
    .map_err(exec_failure)?;
    let trunk_read = providers.trunk.stats().bytes_read - trunk_before;
    for (b, s) in res.sequences.iter().enumerate() {
        println!(
            "sequence {b}: generated ids {:?}{}",
            s.generated_ids,
            s.stopped_by
                .as_deref()
                .map_or(String::new(), |w| format!(" (stopped: {w})"))
        );
    }
    println!(
        "batch: {} sequences, {} decode steps, {:.4} s/step, prefill {:.3} s; trunk read {:.3} GB \
         during the run",
        prompts.len(),
        res.steps,
        res.seconds_per_step,
        res.prefill_seconds,
        trunk_read as f64 / 1e9
    );
    let firsts: Vec<&[f32]> = res
        .sequences
        .iter()
        .map(|s| s.first_logits.as_slice())
        .collect();
    dump_logits(a, &firsts)?;
    dump_expert_trace(a, providers)?;
    let mut v = serde_json::to_value(&res).map_err(|e| Failure::usage(e.to_string()))?;
    v["trunk_bytes_read"] = serde_json::json!(trunk_read);
    v["peak_rss_bytes"] = serde_json::json!(run::peak_rss_bytes());
    let bytes = serde_json::to_vec_pretty(&v).map_err(|e| Failure::usage(e.to_string()))?;
    write_atomic(&a.out, &bytes).map_err(|e| Failure {
        code: exit::OUT_WRITE,
        msg: format!("cannot write --out {}: {e}", a.out.display()),
    })?;
    if interrupted.load(Ordering::Relaxed) {
        return Ok(exit::INTERRUPTED);
    }
    Ok(exit::OK)
}
