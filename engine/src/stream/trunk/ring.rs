//! Streamed layers through the ring slots: a synchronous read with one slot; with two or
//! more, one reader thread reading ahead in order while the executor computes.

use super::*;

impl StreamedTrunk {
    pub(super) fn check_layer(&self, layer: usize) -> Result<(), WeightError> {
        if layer >= self.pinned.len() {
            return Err(WeightError::Invalid {
                name: format!("trunk layer {layer}"),
                msg: format!(
                    "out of range: the packed trunk {} serves layers 0..{}",
                    self.dir.display(),
                    self.pinned.len()
                ),
            });
        }
        Ok(())
    }

    pub(super) fn read_sync(&mut self, layer: usize) -> Result<(), WeightError> {
        let Ring::Sync { slot, holds } = &mut self.ring else {
            return Ok(());
        };
        if matches!(holds, Some((l, _)) if *l == layer) {
            return Ok(());
        }
        *holds = None;
        let t0 = Instant::now();
        let (lead, bytes) = read_packed(
            &self.pool,
            &self.file,
            &self.manifest,
            layer,
            slot.full_mut(),
        )
        .map_err(|e| weight_err(layer, e))?;
        let secs = t0.elapsed().as_secs_f64();
        *holds = Some((layer, lead));
        self.stats.bytes_read += bytes;
        self.stats.read_seconds += secs;
        self.stats.wait_seconds += secs;
        Ok(())
    }

    /// Start the reader thread (only ever called with >= 2 ring slots).
    pub(super) fn start_reader(&mut self) -> Result<(), WeightError> {
        let Ring::Prefetch(p) = &mut self.ring else {
            return Ok(());
        };
        if p.jobs.is_some() {
            return Ok(());
        }
        let (jobs_tx, jobs_rx) = mpsc::channel::<ReadJob>();
        let (done_tx, done_rx) = mpsc::channel::<ReadDone>();
        let file = Arc::clone(&self.file);
        let pool = Arc::clone(&self.pool);
        let manifest = Arc::clone(&self.manifest);
        let handle = std::thread::Builder::new()
            .name("k3-trunk-reader".to_string())
            .spawn(move || {
                for mut job in jobs_rx {
                    let t0 = Instant::now();
                    let read = read_packed(&pool, &file, &manifest, job.layer, job.buf.full_mut());
                    let bytes = read.as_ref().map_or(0, |&(_, b)| b);
                    let done = ReadDone {
                        layer: job.layer,
                        buf: job.buf,
                        result: read.map(|(lead, _)| lead),
                        seconds: t0.elapsed().as_secs_f64(),
                        bytes,
                    };
                    if done_tx.send(done).is_err() {
                        break;
                    }
                }
            })
            .map_err(|e| WeightError::Invalid {
                name: "packed trunk reader thread".to_string(),
                msg: format!("cannot start: {e}"),
            })?;
        p.jobs = Some(jobs_tx);
        p.done = done_rx;
        p.handle = Some(handle);
        self.reader_threads_spawned += 1;
        self.stats.reader_thread = true;
        Ok(())
    }

    /// Issue reads for the next streamed layers into every free slot (`asked`: the layer the
    /// executor is waiting for, whose read is not a read ahead).
    pub(super) fn top_up(&mut self, asked: usize) -> Result<(), WeightError> {
        let Ring::Prefetch(p) = &mut self.ring else {
            return Ok(());
        };
        let Some(jobs) = &p.jobs else {
            return Ok(());
        };
        loop {
            let layer = self.streamed[p.cursor];
            let pl = &self.manifest.layers[layer];
            let Some(buf) = p
                .slots
                .take(self.file.span(pl.offset, pl.size as usize).len)
            else {
                break;
            };
            p.cursor = (p.cursor + 1) % self.streamed.len();
            let job = ReadJob { layer, buf };
            if let Err(mpsc::SendError(job)) = jobs.send(job) {
                p.slots.give_back(job.buf);
                return Err(WeightError::Invalid {
                    name: "packed trunk reader thread".to_string(),
                    msg: "stopped unexpectedly".to_string(),
                });
            }
            p.in_flight.push_back(layer);
            if layer != asked {
                self.reads_ahead += 1;
            }
        }
        Ok(())
    }

    /// Receive one finished read (blocking), accounting the wait.
    pub(super) fn recv_one(&mut self) -> Result<ReadDone, WeightError> {
        let Ring::Prefetch(p) = &mut self.ring else {
            return Err(WeightError::Invalid {
                name: "packed trunk".to_string(),
                msg: "no reader ring".to_string(),
            });
        };
        if p.in_flight.is_empty() {
            return Err(WeightError::Invalid {
                name: "packed trunk".to_string(),
                msg: "no read in flight for the requested layer (internal error: the ring \
                      could not place it)"
                    .to_string(),
            });
        }
        let t0 = Instant::now();
        let done = p.done.recv().map_err(|_| WeightError::Invalid {
            name: "packed trunk reader thread".to_string(),
            msg: "stopped unexpectedly".to_string(),
        })?;
        self.stats.wait_seconds += t0.elapsed().as_secs_f64();
        self.stats.read_seconds += done.seconds;
        self.stats.bytes_read += done.bytes;
        p.in_flight.pop_front();
        Ok(done)
    }

    pub(super) fn read_prefetched(&mut self, layer: usize) -> Result<(), WeightError> {
        self.start_reader()?;
        self.top_up(layer)?;
        let front = match &self.ring {
            Ring::Prefetch(p) => p.in_flight.front().copied(),
            _ => None,
        };
        if front != Some(layer) {
            // Out of the cyclic order: drain, restart the sequence at `layer`.
            self.out_of_order += 1;
            loop {
                let pending = match &self.ring {
                    Ring::Prefetch(p) => !p.in_flight.is_empty(),
                    _ => false,
                };
                if !pending {
                    break;
                }
                let d = self.recv_one()?;
                if let Ring::Prefetch(p) = &mut self.ring {
                    p.slots.give_back(d.buf);
                }
            }
            let pos = self
                .streamed
                .iter()
                .position(|&l| l == layer)
                .ok_or_else(|| WeightError::Invalid {
                    name: format!("trunk layer {layer}"),
                    msg: "not a streamed layer".to_string(),
                })?;
            if let Ring::Prefetch(p) = &mut self.ring {
                p.cursor = pos;
            }
            self.top_up(layer)?;
        }
        let d = self.recv_one()?;
        let Ring::Prefetch(p) = &mut self.ring else {
            return Ok(());
        };
        if d.layer != layer {
            p.slots.give_back(d.buf);
            return Err(WeightError::Invalid {
                name: format!("trunk layer {layer}"),
                msg: format!("reader delivered layer {} instead", d.layer),
            });
        }
        match d.result {
            Ok(lead) => {
                p.current = Some((layer, Loaded { buf: d.buf, lead }));
                Ok(())
            }
            Err(e) => {
                p.slots.give_back(d.buf);
                Err(weight_err(layer, e))
            }
        }
    }
}
