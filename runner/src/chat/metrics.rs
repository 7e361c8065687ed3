//! `GET /metrics` of `--serve`: counters, gauges and histograms in the Prometheus text
//! exposition format (version 0.0.4), the format Prometheus, VictoriaMetrics and Grafana
//! Agent scrape.
//!
//! Owns: [`Metrics`] (shared by the HTTP front end, which counts requests and the queue, and
//! the model thread, which counts tokens, times and the engine's read counters) and its
//! rendering ([`Metrics::render`]). Must not: decide anything (it only counts).
//!
//! The engine's counters (trunk and expert bytes read, expert cache hits) are the ones its
//! providers already report ([`crate::weights::TrunkStats`], [`crate::weights::ExpertStats`]):
//! the model thread copies a snapshot after every step ([`Metrics::set_engine`]).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::weights::{ExpertStats, TrunkStats};

/// Upper bounds (seconds) of the time-to-first-token and request-latency buckets: a prompt on
/// a streamed 1.5 TB model takes seconds to minutes.
pub const TTFT_BUCKETS: &[f64] = &[
    0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0,
];
/// Upper bounds (seconds) of the seconds-per-generated-token buckets.
pub const TPOT_BUCKETS: &[f64] = &[
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0,
];

/// A cumulative histogram (Prometheus semantics: `le` buckets, `_sum`, `_count`).
#[derive(Debug, Clone)]
pub struct Histogram {
    bounds: &'static [f64],
    /// Observations at or below each bound (not cumulative; summed when rendered).
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

impl Histogram {
    pub fn new(bounds: &'static [f64]) -> Histogram {
        Histogram {
            bounds,
            counts: vec![0; bounds.len()],
            sum: 0.0,
            count: 0,
        }
    }

    /// Count one observation (a value that is not finite is not counted).
    pub fn observe(&mut self, v: f64) {
        if !v.is_finite() {
            return;
        }
        if let Some(i) = self.bounds.iter().position(|&b| v <= b) {
            self.counts[i] += 1;
        }
        self.sum += v;
        self.count += 1;
    }

    pub fn count(&self) -> u64 {
        self.count
    }

    pub fn sum(&self) -> f64 {
        self.sum
    }

    fn render(&self, out: &mut String, name: &str, help: &str) {
        let _ = writeln!(out, "# HELP {name} {help}");
        let _ = writeln!(out, "# TYPE {name} histogram");
        let mut acc = 0;
        for (b, c) in self.bounds.iter().zip(&self.counts) {
            acc += c;
            let _ = writeln!(out, "{name}_bucket{{le=\"{}\"}} {acc}", fmt_f(*b));
        }
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {}", self.count);
        let _ = writeln!(out, "{name}_sum {}", fmt_f(self.sum));
        let _ = writeln!(out, "{name}_count {}", self.count);
    }
}

/// A float as Prometheus reads it (Rust's shortest round-trip form; `+Inf`/`NaN` spelled its
/// way).
fn fmt_f(v: f64) -> String {
    if v.is_nan() {
        "NaN".into()
    } else if v == f64::INFINITY {
        "+Inf".into()
    } else if v == f64::NEG_INFINITY {
        "-Inf".into()
    } else {
        format!("{v}")
    }
}

/// What one finished request adds.
#[derive(Debug, Clone, Copy, Default)]
pub struct RequestTimes {
    pub prompt_tokens: usize,
    pub generated_tokens: usize,
    /// From arrival to the end of its prompt (the first token is drawn from those logits);
    /// `None` when it never got there (refused, or its client left first).
    pub ttft: Option<f64>,
    /// Decode seconds per generated token after the first (`None` below two tokens).
    pub per_token: Option<f64>,
    /// From arrival to the last byte of the answer.
    pub latency: f64,
}

#[derive(Debug, Default)]
struct Timings {
    ttft: Option<Histogram>,
    tpot: Option<Histogram>,
    latency: Option<Histogram>,
    decode_seconds: f64,
}

/// The server's counters. Every method takes `&self` (atomics and short locks), so the front
/// end and the model thread share one `Arc<Metrics>`.
#[derive(Debug, Default)]
pub struct Metrics {
    /// (endpoint, HTTP status) -> requests answered.
    requests: Mutex<BTreeMap<(String, u16), u64>>,
    prompt_tokens: AtomicU64,
    generated_tokens: AtomicU64,
    /// Requests whose client went away before the answer was complete.
    disconnects: AtomicU64,
    /// Requests refused because the queue was full (also counted as 429 in `requests`).
    rejected_full: AtomicU64,
    queue_depth: AtomicU64,
    queue_capacity: AtomicU64,
    running: AtomicU64,
    slots: AtomicU64,
    steps: AtomicU64,
    /// Sum over steps of the sequences each step decoded (occupancy = this / steps / slots).
    step_sequences: AtomicU64,
    timings: Mutex<Timings>,
    engine: Mutex<(TrunkStats, ExpertStats)>,
}

impl Metrics {
    pub fn new(slots: usize, queue_capacity: usize) -> Metrics {
        let m = Metrics::default();
        m.slots.store(slots as u64, Ordering::Relaxed);
        m.queue_capacity
            .store(queue_capacity as u64, Ordering::Relaxed);
        m
    }

    /// One answered request: its endpoint (the path, or `other`) and status.
    pub fn count_request(&self, endpoint: &str, status: u16) {
        let mut r = self.requests.lock().unwrap_or_else(|e| e.into_inner());
        *r.entry((endpoint.to_string(), status)).or_insert(0) += 1;
    }

    /// A generation request that finished (any status): tokens and times.
    pub fn finish_generation(&self, t: &RequestTimes) {
        self.prompt_tokens
            .fetch_add(t.prompt_tokens as u64, Ordering::Relaxed);
        self.generated_tokens
            .fetch_add(t.generated_tokens as u64, Ordering::Relaxed);
        let mut g = self.timings.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(v) = t.ttft {
            g.ttft
                .get_or_insert_with(|| Histogram::new(TTFT_BUCKETS))
                .observe(v);
        }
        if let Some(v) = t.per_token {
            g.tpot
                .get_or_insert_with(|| Histogram::new(TPOT_BUCKETS))
                .observe(v);
            g.decode_seconds += v * t.generated_tokens.saturating_sub(1) as f64;
        }
        g.latency
            .get_or_insert_with(|| Histogram::new(TTFT_BUCKETS))
            .observe(t.latency);
    }

    pub fn count_disconnect(&self) {
        self.disconnects.fetch_add(1, Ordering::Relaxed);
    }

    pub fn count_rejected_full(&self) {
        self.rejected_full.fetch_add(1, Ordering::Relaxed);
    }

    pub fn set_queue_depth(&self, n: usize) {
        self.queue_depth.store(n as u64, Ordering::Relaxed);
    }

    pub fn set_running(&self, n: usize) {
        self.running.store(n as u64, Ordering::Relaxed);
    }

    /// One step of the model decoded `sequences` requests together.
    pub fn count_step(&self, sequences: usize) {
        self.steps.fetch_add(1, Ordering::Relaxed);
        self.step_sequences
            .fetch_add(sequences as u64, Ordering::Relaxed);
    }

    /// The engine's read and cache counters as its providers report them now.
    pub fn set_engine(&self, trunk: TrunkStats, experts: ExpertStats) {
        *self.engine.lock().unwrap_or_else(|e| e.into_inner()) = (trunk, experts);
    }

    /// Mean seconds of a finished generation request so far (for `Retry-After`).
    pub fn mean_latency(&self) -> Option<f64> {
        let g = self.timings.lock().unwrap_or_else(|e| e.into_inner());
        g.latency
            .as_ref()
            .filter(|h| h.count() > 0)
            .map(|h| h.sum() / h.count() as f64)
    }

    /// Generated tokens so far.
    pub fn generated_tokens(&self) -> u64 {
        self.generated_tokens.load(Ordering::Relaxed)
    }

    /// The exposition text.
    pub fn render(&self) -> String {
        let mut out = String::new();
        let counter = |out: &mut String, name: &str, help: &str, v: String| {
            let _ = writeln!(out, "# HELP {name} {help}");
            let _ = writeln!(out, "# TYPE {name} counter");
            let _ = writeln!(out, "{name} {v}");
        };
        let gauge = |out: &mut String, name: &str, help: &str, v: String| {
            let _ = writeln!(out, "# HELP {name} {help}");
            let _ = writeln!(out, "# TYPE {name} gauge");
            let _ = writeln!(out, "{name} {v}");
        };
        let load = |a: &AtomicU64| a.load(Ordering::Relaxed);

        let _ = writeln!(
            out,
            "# HELP k3run_requests_total HTTP requests answered, by endpoint and status."
        );
        let _ = writeln!(out, "# TYPE k3run_requests_total counter");
        {
            let r = self.requests.lock().unwrap_or_else(|e| e.into_inner());
            for ((endpoint, status), n) in r.iter() {
                let _ = writeln!(
                    out,
                    "k3run_requests_total{{endpoint=\"{}\",status=\"{status}\"}} {n}",
                    escape_label(endpoint)
                );
            }
        }
        counter(
            &mut out,
            "k3run_prompt_tokens_total",
            "Prompt tokens of finished generation requests.",
            load(&self.prompt_tokens).to_string(),
        );
        counter(
            &mut out,
            "k3run_generation_tokens_total",
            "Tokens generated (the stop token included).",
            load(&self.generated_tokens).to_string(),
        );
        counter(
            &mut out,
            "k3run_client_disconnects_total",
            "Generation requests whose client went away before the answer was complete.",
            load(&self.disconnects).to_string(),
        );
        counter(
            &mut out,
            "k3run_queue_rejections_total",
            "Requests refused with 429 because the queue was full.",
            load(&self.rejected_full).to_string(),
        );
        gauge(
            &mut out,
            "k3run_queue_depth",
            "Requests waiting for a slot.",
            load(&self.queue_depth).to_string(),
        );
        gauge(
            &mut out,
            "k3run_queue_capacity",
            "Most requests that may wait (--max-queue); more are refused with 429.",
            load(&self.queue_capacity).to_string(),
        );
        gauge(
            &mut out,
            "k3run_requests_running",
            "Requests being decoded now.",
            load(&self.running).to_string(),
        );
        gauge(
            &mut out,
            "k3run_batch_slots",
            "Requests that can be decoded together (--serve-batch).",
            load(&self.slots).to_string(),
        );
        let steps = load(&self.steps);
        let seqs = load(&self.step_sequences);
        counter(
            &mut out,
            "k3run_steps_total",
            "Passes over the weights (steps) run for requests.",
            steps.to_string(),
        );
        counter(
            &mut out,
            "k3run_step_sequences_total",
            "Sum over steps of the requests each step decoded together.",
            seqs.to_string(),
        );
        let slots = load(&self.slots).max(1);
        let occupancy = if steps == 0 {
            0.0
        } else {
            seqs as f64 / (steps * slots) as f64
        };
        gauge(
            &mut out,
            "k3run_batch_occupancy_ratio",
            "Mean fraction of the batch slots used per step so far.",
            fmt_f(occupancy),
        );
        {
            let g = self.timings.lock().unwrap_or_else(|e| e.into_inner());
            let empty_ttft = Histogram::new(TTFT_BUCKETS);
            let empty_tpot = Histogram::new(TPOT_BUCKETS);
            g.ttft.as_ref().unwrap_or(&empty_ttft).render(
                &mut out,
                "k3run_time_to_first_token_seconds",
                "Seconds from a request's arrival until its prompt was processed (queue \
                 included).",
            );
            g.tpot.as_ref().unwrap_or(&empty_tpot).render(
                &mut out,
                "k3run_seconds_per_token",
                "Decode seconds per generated token after the first, one observation per \
                 request.",
            );
            g.latency.as_ref().unwrap_or(&empty_ttft).render(
                &mut out,
                "k3run_request_latency_seconds",
                "Seconds from a generation request's arrival until its answer was complete.",
            );
            counter(
                &mut out,
                "k3run_decode_seconds_total",
                "Decode seconds of generated tokens after each request's first.",
                fmt_f(g.decode_seconds),
            );
        }
        let (t, e) = self
            .engine
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        counter(
            &mut out,
            "k3run_trunk_bytes_read_total",
            "Bytes of dense-trunk weights read from disk.",
            t.bytes_read.to_string(),
        );
        counter(
            &mut out,
            "k3run_expert_bytes_read_total",
            "Bytes of routed-expert weights read from disk (demand and prefetch).",
            e.bytes_read.to_string(),
        );
        counter(
            &mut out,
            "k3run_expert_requests_total",
            "Routed-expert requests of the forward passes.",
            e.requests.to_string(),
        );
        counter(
            &mut out,
            "k3run_expert_cache_hits_total",
            "Routed-expert requests served from RAM without a read.",
            e.hits.to_string(),
        );
        counter(
            &mut out,
            "k3run_expert_cache_misses_total",
            "Routed-expert requests that read the expert from disk.",
            e.misses.to_string(),
        );
        let ratio = |a: u64, b: u64| if b == 0 { 0.0 } else { a as f64 / b as f64 };
        gauge(
            &mut out,
            "k3run_expert_cache_hit_ratio",
            "Expert cache hits / expert requests since start.",
            fmt_f(ratio(e.hits, e.requests)),
        );
        gauge(
            &mut out,
            "k3run_expert_resident_hit_ratio",
            "Expert requests served from RAM that was resident before the token asked for \
             them / expert requests.",
            fmt_f(e.resident_hit_rate()),
        );
        counter(
            &mut out,
            "k3run_expert_prefetch_hits_total",
            "Expert requests served by a prefetched expert.",
            e.prefetch_hits.to_string(),
        );
        out
    }
}

/// A label value as the text format needs it (`\`, `"` and newlines escaped).
fn escape_label(s: &str) -> String {
    s.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_buckets_are_cumulative_and_count_everything() {
        let mut h = Histogram::new(&[1.0, 2.0]);
        for v in [0.5, 1.0, 1.5, 3.0, f64::NAN] {
            h.observe(v);
        }
        let mut s = String::new();
        h.render(&mut s, "x", "help");
        assert!(s.contains("x_bucket{le=\"1\"} 2\n"), "{s}");
        assert!(s.contains("x_bucket{le=\"2\"} 3\n"), "{s}");
        assert!(s.contains("x_bucket{le=\"+Inf\"} 4\n"), "{s}");
        assert!(s.contains("x_sum 6\n"), "{s}");
        assert!(s.contains("x_count 4\n"), "{s}");
    }

    #[test]
    fn labels_are_escaped() {
        assert_eq!(escape_label("a\"b\\c\nd"), "a\\\"b\\\\c\\nd");
    }
}
